//! SLA classes: which class a request belongs to (the class header where the request may name
//! one, else its tenant's, else the default class), and what the class means: its priority and
//! queue in admission, whether it is shed instead of queued, the pool of replicas it may use and
//! its routing weights.

use crate::config::SlaConfig;
use crate::tenants::Tenant;
use kvgate_policies::{PolicyConfig, Weights};
use kvgate_protocol::{ApiError, ErrorKind};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Clone, PartialEq)]
pub struct Class {
    pub name: String,
    pub priority: u32,
    pub sheddable: bool,
    /// Labels a replica must carry to serve the class.
    pub pool: BTreeMap<String, String>,
    pub weights: Weights,
    pub max_queue: usize,
    pub queue_timeout: Duration,
}

impl Class {
    /// Whether a replica with `labels` is in the class's pool.
    pub fn admits(&self, labels: &BTreeMap<String, String>) -> bool {
        self.pool.iter().all(|(k, v)| labels.get(k) == Some(v))
    }
}

#[derive(Debug, Clone)]
pub struct Classes {
    header: String,
    default: Arc<Class>,
    by_name: BTreeMap<String, Arc<Class>>,
    trust_header: bool,
}

/// Queued requests per class at most.
const MAX_QUEUE: usize = 1_000_000;

impl Classes {
    /// The classes of `sla`, with weights over those of `policy`; or every problem, each as
    /// (path under `sla`, message).
    pub fn build(sla: &SlaConfig, policy: &PolicyConfig) -> Result<Classes, Vec<(String, String)>> {
        let mut errors = Vec::new();
        if sla.classes.is_empty() {
            errors.push(("classes".into(), "at least one class is required".into()));
        }
        if sla.header.is_empty() || http::HeaderName::from_bytes(sla.header.as_bytes()).is_err() {
            errors.push((
                "header".into(),
                format!("`{}` is not a header name", sla.header),
            ));
        }
        let mut by_name = BTreeMap::new();
        for (name, c) in &sla.classes {
            let path = |field: &str| format!("classes.{name}.{field}");
            let mut weights = policy.weights.clone();
            if let Some(preset) = &c.preset {
                match crate::config::preset(preset) {
                    Ok(p) => weights = p.weights,
                    Err(e) => errors.push((path("preset"), e)),
                }
            }
            for (key, &value) in &c.weights {
                if let Err(e) = weights.set(key, value) {
                    errors.push((path(&format!("weights.{key}")), e));
                }
            }
            if !(1..=MAX_QUEUE).contains(&c.max_queue) {
                errors.push((
                    path("max_queue"),
                    format!("must be 1 to {MAX_QUEUE}, got {}", c.max_queue),
                ));
            }
            if c.queue_timeout_ms == 0 {
                errors.push((path("queue_timeout_ms"), "must be greater than 0".into()));
            }
            if c.pool.keys().any(|k| k.is_empty()) {
                errors.push((path("pool"), "label names must not be empty".into()));
            }
            let class = Class {
                name: name.clone(),
                priority: c.priority,
                sheddable: c.sheddable,
                pool: c.pool.clone(),
                weights,
                max_queue: c.max_queue,
                queue_timeout: Duration::from_millis(c.queue_timeout_ms),
            };
            by_name.insert(name.clone(), Arc::new(class));
        }
        let default = by_name.get(&sla.default_class).cloned();
        if default.is_none() {
            errors.push((
                "default_class".into(),
                format!("`{}` is not one of the classes", sla.default_class),
            ));
        }
        if sla.api_keys.is_some() {
            errors.push((
                "api_keys".into(),
                "API keys are no longer kept in clear here: list their hashes (kvgate hash-key) under `tenants`, each tenant with its `class`".into(),
            ));
        }
        match default {
            Some(default) if errors.is_empty() => Ok(Classes {
                header: sla.header.clone(),
                default,
                by_name,
                trust_header: sla.trust_class_header,
            }),
            _ => Err(errors),
        }
    }

    /// The header that names a request's class.
    pub fn header(&self) -> &str {
        &self.header
    }

    /// Whether `name` is one of the classes.
    pub fn contains(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    /// A request's class: the one its header names (400 if unknown; 403 unless the header is
    /// trusted or the tenant may use that class), else its tenant's, else the default.
    pub fn classify(
        &self,
        header: Option<&[u8]>,
        tenant: Option<&Tenant>,
    ) -> Result<Arc<Class>, ApiError> {
        let by_name = |name: &str| self.by_name.get(name).cloned();
        let Some(name) = header else {
            let own = tenant.and_then(|t| t.class.as_deref()).and_then(by_name);
            return Ok(own.unwrap_or_else(|| Arc::clone(&self.default)));
        };
        let name = String::from_utf8_lossy(name);
        let class = by_name(&name).ok_or_else(|| {
            let known: Vec<&str> = self.by_name.keys().map(String::as_str).collect();
            ApiError::new(
                ErrorKind::InvalidRequest,
                format!(
                    "unknown class `{name}` in `{}` (known: {})",
                    self.header,
                    known.join(", ")
                ),
            )
            .with_param(&self.header)
        })?;
        let allowed =
            self.trust_header || tenant.is_some_and(|t| t.allowed_classes.contains(name.as_ref()));
        if allowed {
            return Ok(class);
        }
        let message = match tenant {
            Some(t) => format!(
                "tenant `{}` may not use class `{name}` (its classes: {})",
                t.name,
                t.allowed_classes.iter().cloned().collect::<Vec<_>>().join(", ")
            ),
            None => format!(
                "`{}` is honoured only for tenants allowed that class (or with sla.trust_class_header)",
                self.header
            ),
        };
        Err(ApiError::new(ErrorKind::Forbidden, message).with_param(&self.header))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ClassConfig, TenantConfig};
    use crate::tenants::{hash_api_key, Tenants};

    fn class(priority: u32) -> ClassConfig {
        ClassConfig {
            priority,
            sheddable: false,
            pool: BTreeMap::new(),
            preset: None,
            weights: BTreeMap::new(),
            max_queue: 8,
            queue_timeout_ms: 1000,
        }
    }

    fn sla(trust_class_header: bool) -> SlaConfig {
        let mut batch = class(0);
        batch.weights.insert("load".into(), 7.0);
        batch.pool.insert("tier".into(), "batch".into());
        SlaConfig {
            header: "x-kvgate-class".into(),
            default_class: "interactive".into(),
            classes: [
                ("interactive".into(), class(2)),
                ("batch".into(), batch),
                ("gold".into(), class(9)),
            ]
            .into(),
            trust_class_header,
            api_keys: None,
        }
    }

    fn tenant(key: &str, class: Option<&str>, allowed: &[&str]) -> TenantConfig {
        TenantConfig {
            api_keys: vec![hash_api_key(key.as_bytes())],
            class: class.map(str::to_string),
            allowed_classes: allowed.iter().map(|c| c.to_string()).collect(),
            max_concurrent: None,
            tokens_per_minute: None,
        }
    }

    #[test]
    fn the_header_counts_only_where_allowed_then_the_tenant_then_the_default() {
        let classes = Classes::build(&sla(false), &PolicyConfig::default()).unwrap();
        let tenants = Tenants::build(
            &[
                (
                    "batchy".to_string(),
                    tenant("sk-b", Some("batch"), &["interactive"]),
                ),
                ("plain".to_string(), tenant("sk-p", None, &[])),
            ]
            .into(),
            None,
        );
        let batchy = tenants.authenticate(Some(b"Bearer sk-b")).unwrap();
        let plain = tenants.authenticate(Some(b"Bearer sk-p")).unwrap();
        let name = |h: Option<&[u8]>, t: Option<&Tenant>| {
            classes
                .classify(h, t)
                .map(|c| c.name.clone())
                .map_err(|e| e.status())
        };
        assert_eq!(name(None, Some(&batchy)), Ok("batch".into()));
        assert_eq!(name(None, Some(&plain)), Ok("interactive".into()));
        assert_eq!(name(None, None), Ok("interactive".into()));
        assert_eq!(
            name(Some(b"interactive"), Some(&batchy)),
            Ok("interactive".into())
        );
        assert_eq!(name(Some(b"batch"), Some(&batchy)), Ok("batch".into()));
        assert_eq!(
            name(Some(b"gold"), Some(&batchy)),
            Err(403),
            "not among its classes"
        );
        assert_eq!(name(Some(b"gold"), Some(&plain)), Err(403));
        assert_eq!(
            name(Some(b"gold"), None),
            Err(403),
            "no tenant, untrusted header"
        );
        assert_eq!(name(Some(b"platinum"), Some(&batchy)), Err(400));
        let e = classes.classify(Some(b"platinum"), None).err().unwrap();
        assert!(
            e.message.contains("known: batch, gold, interactive"),
            "{}",
            e.message
        );

        let trusting = Classes::build(&sla(true), &PolicyConfig::default()).unwrap();
        let gold = trusting.classify(Some(b"gold"), None).unwrap();
        assert_eq!(gold.name, "gold");
        let batch = trusting.classify(Some(b"batch"), None).unwrap();
        assert_eq!(batch.weights[kvgate_policies::Signal::Load], 7.0);
        assert_eq!(
            batch.weights[kvgate_policies::Signal::Prefix],
            PolicyConfig::default().weights[kvgate_policies::Signal::Prefix]
        );
        assert!(
            batch.admits(&[("tier".into(), "batch".into()), ("zone".into(), "a".into())].into())
        );
        assert!(!batch.admits(&BTreeMap::new()));
    }

    #[test]
    fn every_problem_is_reported() {
        let mut bad = sla(false);
        bad.default_class = "silver".into();
        bad.api_keys = Some(serde_json::json!({"sk-x": "batch"}));
        let mut c = class(1);
        c.weights.insert("speed".into(), 1.0);
        c.preset = Some("fastest".into());
        c.max_queue = 0;
        bad.classes.insert("odd".into(), c);
        let errors = Classes::build(&bad, &PolicyConfig::default())
            .err()
            .unwrap_or_default();
        let paths: Vec<&str> = errors.iter().map(|(p, _)| p.as_str()).collect();
        for want in [
            "default_class",
            "api_keys",
            "classes.odd.weights.speed",
            "classes.odd.preset",
            "classes.odd.max_queue",
        ] {
            assert!(paths.contains(&want), "{want} in {errors:?}");
        }
    }
}
