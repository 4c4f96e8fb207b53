//! Tenants: who a request comes from (its API key, kept in the config only as a SHA-256 hash
//! and compared in constant time), which classes it may use, and its limits — requests in
//! flight and tokens per minute — enforced before a request is routed.

use crate::config::TenantConfig;
use kvgate_protocol::telemetry::token_matches;
use kvgate_protocol::{ApiError, ErrorKind};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How a hashed key is written in the config.
const HASH_PREFIX: &str = "sha256:";
/// Output tokens charged to a request that sets no `max_tokens`.
pub const UNSET_MAX_TOKENS_CHARGE: u64 = 1024;

/// The config form of an API key's hash: `sha256:` and 64 lowercase hex digits.
pub fn hash_api_key(key: &[u8]) -> String {
    let digest = Sha256::digest(key);
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("{HASH_PREFIX}{hex}")
}

/// Whether `s` is a hash as [`hash_api_key`] writes it.
pub fn is_key_hash(s: &str) -> bool {
    s.strip_prefix(HASH_PREFIX).is_some_and(|hex| {
        hex.len() == 64
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

pub struct Tenant {
    pub name: String,
    /// The class of its requests (`None`: the default class).
    pub class: Option<String>,
    /// Classes its requests may name in the class header (its own included).
    pub allowed_classes: BTreeSet<String>,
    max_concurrent: Option<u32>,
    tokens_per_minute: Option<u64>,
    state: Arc<State>,
}

/// What a tenant has in use; kept across reloads for a tenant of the same name.
#[derive(Default)]
struct State {
    in_flight: AtomicU32,
    bucket: Mutex<Option<Bucket>>,
}

/// Tokens left to admit, refilled continuously up to a minute's worth.
struct Bucket {
    tokens: f64,
    at: Instant,
}

/// A request admitted for a tenant: counted in flight until released or dropped.
pub struct Lease {
    state: Arc<State>,
    released: AtomicBool,
}

impl Lease {
    /// Ends the request's count in flight, once: called as its answer's last bytes go out, so
    /// that a client who waits for each answer never meets its own last request (the
    /// gateway's own work after the answer is no longer the client's).
    pub fn release(&self) {
        if !self.released.swap(true, Ordering::AcqRel) {
            self.state.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.release();
    }
}

/// Why a tenant's request was turned down, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    Concurrency,
    Tokens,
}

impl Limit {
    pub fn label(self) -> &'static str {
        match self {
            Limit::Concurrency => "concurrency",
            Limit::Tokens => "tokens",
        }
    }
}

/// A refusal by a tenant's limits: the error for the client (429 with a retry delay, or 400
/// for a request no wait would let through) and the limit that refused it.
pub struct Refusal {
    pub error: ApiError,
    pub retry_after: Option<Duration>,
    pub limit: Limit,
}

impl Tenant {
    /// Admits a request that costs `tokens` (its prompt plus its output limit) at `now`.
    pub fn admit(&self, tokens: u64, now: Instant) -> Result<Lease, Refusal> {
        let in_flight = self.state.in_flight.fetch_add(1, Ordering::AcqRel) + 1;
        let lease = Lease {
            state: Arc::clone(&self.state),
            released: AtomicBool::new(false),
        };
        if let Some(cap) = self.max_concurrent.filter(|&cap| in_flight > cap) {
            return Err(Refusal {
                error: ApiError::new(
                    ErrorKind::RateLimited,
                    format!(
                        "tenant `{}` has {cap} requests in flight, its limit",
                        self.name
                    ),
                ),
                retry_after: Some(Duration::from_secs(1)),
                limit: Limit::Concurrency,
            });
        }
        if let Some(per_minute) = self.tokens_per_minute {
            self.take_tokens(tokens, per_minute, now)?;
        }
        Ok(lease)
    }

    fn take_tokens(&self, tokens: u64, per_minute: u64, now: Instant) -> Result<(), Refusal> {
        let refusal = |error: ApiError, retry_after| Refusal {
            error,
            retry_after,
            limit: Limit::Tokens,
        };
        if tokens > per_minute {
            return Err(refusal(
                ApiError::new(
                    ErrorKind::InvalidRequest,
                    format!("the request is charged {tokens} tokens (prompt plus max_tokens), more than tenant `{}` may use in a minute ({per_minute}): lower max_tokens", self.name),
                )
                .with_param("max_tokens"),
                None,
            ));
        }
        let rate = per_minute as f64 / 60.0;
        let mut bucket = self
            .state
            .bucket
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let b = bucket.get_or_insert(Bucket {
            tokens: per_minute as f64,
            at: now,
        });
        let elapsed = now.saturating_duration_since(b.at).as_secs_f64();
        b.tokens = (b.tokens + elapsed * rate).min(per_minute as f64);
        b.at = b.at.max(now);
        let wanted = tokens as f64;
        if b.tokens < wanted {
            let wait = Duration::from_secs_f64((wanted - b.tokens) / rate);
            return Err(refusal(
                ApiError::new(
                    ErrorKind::RateLimited,
                    format!(
                        "tenant `{}` has used its {per_minute} tokens per minute",
                        self.name
                    ),
                ),
                Some(wait),
            ));
        }
        b.tokens -= wanted;
        Ok(())
    }

    pub fn in_flight(&self) -> u32 {
        self.state.in_flight.load(Ordering::Acquire)
    }
}

#[derive(Clone, Default)]
pub struct Tenants {
    by_name: BTreeMap<String, Arc<Tenant>>,
    keys: Vec<(String, Arc<Tenant>)>,
}

impl Tenants {
    /// The tenants of `config`, keeping the state of `old` ones of the same name. The config
    /// is validated already.
    pub fn build(config: &BTreeMap<String, TenantConfig>, old: Option<&Tenants>) -> Tenants {
        let mut tenants = Tenants::default();
        for (name, t) in config {
            let state = old
                .and_then(|o| o.by_name.get(name))
                .map(|o| Arc::clone(&o.state))
                .unwrap_or_default();
            let mut allowed_classes: BTreeSet<String> = t.allowed_classes.iter().cloned().collect();
            allowed_classes.extend(t.class.clone());
            let tenant = Arc::new(Tenant {
                name: name.clone(),
                class: t.class.clone(),
                allowed_classes,
                max_concurrent: t.max_concurrent,
                tokens_per_minute: t.tokens_per_minute,
                state,
            });
            for key in &t.api_keys {
                tenants.keys.push((key.clone(), Arc::clone(&tenant)));
            }
            tenants.by_name.insert(name.clone(), tenant);
        }
        tenants
    }

    /// The tenant whose key the request presents (`Authorization: Bearer KEY`): every hash is
    /// compared, each in constant time, so timing tells nothing about which matched.
    pub fn authenticate(&self, authorization: Option<&[u8]>) -> Result<Arc<Tenant>, ApiError> {
        let key = authorization
            .and_then(|a| a.strip_prefix(b"Bearer "))
            .ok_or_else(|| {
                ApiError::new(
                    ErrorKind::Unauthorized,
                    "an API key is required: send `Authorization: Bearer KEY`",
                )
            })?;
        let presented = hash_api_key(key.trim_ascii());
        let mut found = None;
        for (hash, tenant) in &self.keys {
            if token_matches(presented.as_bytes(), hash.as_bytes()) {
                found = Some(tenant);
            }
        }
        found
            .cloned()
            .ok_or_else(|| ApiError::new(ErrorKind::Unauthorized, "the API key is not valid"))
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<Tenant>> {
        self.by_name.values()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenants(max_concurrent: Option<u32>, tokens_per_minute: Option<u64>) -> Tenants {
        let config = TenantConfig {
            api_keys: vec![hash_api_key(b"sk-good")],
            class: None,
            allowed_classes: Vec::new(),
            max_concurrent,
            tokens_per_minute,
        };
        Tenants::build(&[("acme".to_string(), config)].into(), None)
    }

    #[test]
    fn keys_are_hashed_and_checked() {
        let hash = hash_api_key(b"sk-good");
        assert!(is_key_hash(&hash), "{hash}");
        assert!(!is_key_hash("sk-good"));
        assert!(!is_key_hash(&hash.to_uppercase()));
        let t = tenants(None, None);
        let name = |auth: Option<&[u8]>| t.authenticate(auth).map(|t| t.name.clone());
        assert_eq!(name(Some(b"Bearer sk-good")).ok(), Some("acme".into()));
        for bad in [
            None,
            Some(&b"Bearer sk-bad"[..]),
            Some(b"sk-good"),
            Some(b"Bearer "),
        ] {
            let e = name(bad).err().map(|e| e.status());
            assert_eq!(e, Some(401), "{bad:?}");
        }
    }

    #[test]
    fn concurrency_is_capped_and_released() {
        let t = tenants(Some(2), None);
        let acme = t.authenticate(Some(b"Bearer sk-good")).unwrap();
        let now = Instant::now();
        let a = acme.admit(10, now);
        let b = acme.admit(10, now);
        assert!(a.is_ok() && b.is_ok());
        let refused = acme
            .admit(10, now)
            .err()
            .map(|r| (r.limit, r.error.status()));
        assert_eq!(refused, Some((Limit::Concurrency, 429)));
        drop(a);
        assert!(acme.admit(10, now).is_ok());
        assert_eq!(acme.in_flight(), 1, "leases are released when dropped");
    }

    #[test]
    fn a_lease_released_early_is_not_released_again_when_dropped() {
        let t = tenants(Some(2), None);
        let acme = t.authenticate(Some(b"Bearer sk-good")).unwrap();
        let now = Instant::now();
        let (a, b) = (acme.admit(10, now).ok(), acme.admit(10, now).ok());
        let a = a.unwrap();
        a.release();
        a.release();
        assert_eq!(acme.in_flight(), 1);
        drop(a);
        assert_eq!(acme.in_flight(), 1, "b is still in flight");
        drop(b);
        assert_eq!(acme.in_flight(), 0);
    }

    #[test]
    fn tokens_refill_over_the_minute() {
        let t = tenants(None, Some(600));
        let acme = t.authenticate(Some(b"Bearer sk-good")).unwrap();
        let start = Instant::now();
        assert!(acme.admit(500, start).is_ok());
        let refused = acme.admit(200, start).err();
        let wait = refused.as_ref().and_then(|r| r.retry_after);
        // 100 left, 100 more needed at 10 a second.
        assert_eq!(wait.map(|w| w.as_secs()), Some(10));
        assert_eq!(refused.map(|r| r.error.status()), Some(429));
        assert!(acme.admit(200, start + Duration::from_secs(10)).is_ok());
        let too_big = acme.admit(601, start + Duration::from_secs(600)).err();
        assert_eq!(too_big.map(|r| r.error.status()), Some(400));
    }
}
