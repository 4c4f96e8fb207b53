//! Semantic checks after parsing: every problem is reported, each with its YAML path.

use super::{ConfigError, GatewayConfig};
use std::collections::HashSet;
use std::net::{SocketAddr, ToSocketAddrs};

/// A replica URL resolved to the address the gateway connects to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    pub addr: SocketAddr,
    /// `host:port` as written, for the Host header.
    pub authority: String,
}

/// Parses `http://HOST:PORT` (an optional trailing `/`), resolving HOST once.
pub fn resolve_url(url: &str) -> Result<Upstream, String> {
    if url.starts_with("https://") {
        return Err(format!(
            "`{url}`: https upstreams are not supported yet; use http://"
        ));
    }
    let authority = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("`{url}` must start with http://"))?
        .trim_end_matches('/');
    if authority.is_empty() || authority.contains('/') {
        return Err(format!("`{url}` must be http://HOST:PORT with no path"));
    }
    let addr = authority
        .to_socket_addrs()
        .map_err(|e| format!("`{url}`: cannot resolve `{authority}` (HOST:PORT expected): {e}"))?
        .next()
        .ok_or_else(|| format!("`{url}`: `{authority}` resolves to no address"))?;
    Ok(Upstream {
        addr,
        authority: authority.to_string(),
    })
}

/// Largest KV block accepted, in tokens.
const MAX_BLOCK_SIZE: usize = 1024;
/// Longest context accepted, in tokens.
const MAX_CONTEXT_LENGTH: usize = 1 << 24;

pub(super) fn validate(c: &GatewayConfig) -> Vec<ConfigError> {
    let mut errors = Vec::new();
    let mut err = |path: String, message: String| {
        errors.push(ConfigError {
            path,
            line: None,
            message,
        })
    };

    let addresses = c.listen.addresses();
    if addresses.is_empty() {
        err("listen".into(), "at least one address is required".into());
    }
    for (i, a) in addresses.iter().enumerate() {
        if a.parse::<SocketAddr>().is_err() {
            let path = if addresses.len() == 1 {
                "listen".into()
            } else {
                format!("listen[{i}]")
            };
            err(path, format!("`{a}` is not an IP:PORT socket address"));
        }
    }
    if let Some(a) = &c.admin_listen {
        if a.parse::<SocketAddr>().is_err() {
            err(
                "admin_listen".into(),
                format!("`{a}` is not an IP:PORT socket address"),
            );
        }
    }
    if !(1..=256).contains(&c.threads) {
        err(
            "threads".into(),
            format!("must be between 1 and 256, got {}", c.threads),
        );
    }
    let open = c
        .agents
        .as_ref()
        .is_some_and(|a| a.join == super::JoinMode::Open);
    if c.replicas.is_empty() && !open {
        err(
            "replicas".into(),
            "at least one replica is required (or `agents.join: open`)".into(),
        );
    }
    if let Some(a) = &c.agents {
        if a.stale_after_ms == 0 {
            err(
                "agents.stale_after_ms".into(),
                "must be greater than 0".into(),
            );
        }
        if a.exclude_after_ms <= a.stale_after_ms {
            err(
                "agents.exclude_after_ms".into(),
                format!(
                    "must be greater than stale_after_ms ({}), got {}",
                    a.stale_after_ms, a.exclude_after_ms
                ),
            );
        }
        if c.admin_listen.is_none() {
            err(
                "agents".into(),
                "agents report to the admin listener: set `admin_listen`".into(),
            );
        }
        if let Err(e) = super::read_token(&a.token_file) {
            err("agents.token_file".into(), e);
        }
    }
    let mut tokenized = HashSet::new();
    for (i, t) in c.tokenizers.iter().enumerate() {
        if t.model.trim().is_empty() {
            err(format!("tokenizers[{i}].model"), "must not be empty".into());
        }
        if !tokenized.insert(t.model.as_str()) {
            err(
                format!("tokenizers[{i}].model"),
                format!("`{}` has a tokenizer already", t.model),
            );
        }
        if !(1..=MAX_BLOCK_SIZE).contains(&t.block_size) {
            err(
                format!("tokenizers[{i}].block_size"),
                format!("must be 1 to {MAX_BLOCK_SIZE}, got {}", t.block_size),
            );
        }
        if t.context_length
            .is_some_and(|n| !(2..=MAX_CONTEXT_LENGTH).contains(&n))
        {
            err(
                format!("tokenizers[{i}].context_length"),
                format!(
                    "must be 2 to {MAX_CONTEXT_LENGTH}, got {}",
                    t.context_length.unwrap_or(0)
                ),
            );
        }
        if !t.path.is_file() {
            err(
                format!("tokenizers[{i}].path"),
                format!("{} is not a readable file", t.path.display()),
            );
        }
    }
    let mut names = HashSet::new();
    for (i, r) in c.replicas.iter().enumerate() {
        if let Err(e) = resolve_url(&r.url) {
            err(format!("replicas[{i}].url"), e);
        }
        if !names.insert(r.name()) {
            err(
                format!("replicas[{i}]"),
                format!("duplicate replica `{}` (set a distinct `id`)", r.name()),
            );
        }
        if r.id.as_deref().is_some_and(str::is_empty) {
            err(format!("replicas[{i}].id"), "must not be empty".into());
        }
        for (j, m) in r.models.iter().enumerate() {
            if m.trim().is_empty() {
                err(
                    format!("replicas[{i}].models[{j}]"),
                    "model names must not be empty".into(),
                );
            }
        }
        if r.max_in_flight == Some(0) {
            err(
                format!("replicas[{i}].max_in_flight"),
                "must be at least 1, got 0".into(),
            );
        }
    }
    if !(1..=1 << 30).contains(&c.limits.max_body_bytes) {
        err(
            "limits.max_body_bytes".into(),
            format!(
                "must be between 1 and 1073741824, got {}",
                c.limits.max_body_bytes
            ),
        );
    }
    let t = &c.timeouts;
    for (name, v) in [
        ("connect_ms", t.connect_ms),
        ("first_byte_ms", t.first_byte_ms),
        ("idle_ms", t.idle_ms),
        ("pool_idle_ms", t.pool_idle_ms),
    ] {
        if v == 0 {
            err(format!("timeouts.{name}"), "must be greater than 0".into());
        }
    }
    if !(1..=16).contains(&c.retries.attempts) {
        err(
            "retries.attempts".into(),
            format!("must be between 1 and 16, got {}", c.retries.attempts),
        );
    }
    let h = &c.health;
    if !h.path.starts_with('/') {
        err(
            "health.path".into(),
            format!("must start with `/`, got `{}`", h.path),
        );
    }
    if h.interval_ms < 10 {
        err(
            "health.interval_ms".into(),
            format!("must be at least 10, got {}", h.interval_ms),
        );
    }
    if h.timeout_ms == 0 {
        err("health.timeout_ms".into(), "must be greater than 0".into());
    }
    if h.eject_after_failures == 0 {
        err(
            "health.eject_after_failures".into(),
            "must be at least 1, got 0".into(),
        );
    }
    if h.ejection_base_ms == 0 || h.ejection_base_ms > h.ejection_max_ms {
        err(
            "health.ejection_base_ms".into(),
            format!(
                "must be > 0 and <= ejection_max_ms ({}), got {}",
                h.ejection_max_ms, h.ejection_base_ms
            ),
        );
    }
    for (path, message) in c.policy.validate() {
        err(format!("policy.{path}"), message);
    }
    if let Some(sla) = &c.sla {
        if let Err(problems) = crate::classes::Classes::build(sla, &c.policy) {
            for (path, message) in problems {
                err(format!("sla.{path}"), message);
            }
        }
    }
    errors
}

#[cfg(test)]
mod tests {
    use super::super::parse_str;
    use super::*;

    #[test]
    fn every_semantic_error_is_reported_with_its_path() {
        let errs = parse_str(
            "listen: \"nowhere\"\nreplicas:\n  - url: \"ftp://x\"\n  - url: \"http://127.0.0.1:1\"\n    id: a\n  - url: \"http://127.0.0.1:2\"\n    id: a\nretries: {attempts: 0}\npolicy: {load_factor: 0.5}\n",
        )
        .unwrap_err();
        let paths: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "listen",
                "replicas[0].url",
                "replicas[2]",
                "retries.attempts",
                "policy.load_factor"
            ]
        );
    }

    #[test]
    fn agent_settings_are_checked() {
        let errs = parse_str(
            "listen: \"127.0.0.1:1\"\nreplicas: []\nagents: {token_file: /nonexistent/token, stale_after_ms: 500, exclude_after_ms: 500}\n",
        )
        .unwrap_err();
        let paths: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "replicas",
                "agents.exclude_after_ms",
                "agents",
                "agents.token_file"
            ],
            "{errs:?}"
        );
        // An open fleet may start empty.
        let token = std::env::temp_dir().join(format!("kvgate-token-{}", std::process::id()));
        std::fs::write(&token, "t0ken\n").unwrap();
        let ok = parse_str(&format!(
            "listen: \"127.0.0.1:1\"\nadmin_listen: \"127.0.0.1:2\"\nreplicas: []\nagents: {{token_file: {}, join: open}}\n",
            token.display()
        ));
        assert!(ok.is_ok(), "{ok:?}");
        assert_eq!(super::super::read_token(&token).unwrap(), "t0ken");
    }

    #[test]
    fn urls_resolve_to_socket_addresses() {
        let u = resolve_url("http://127.0.0.1:9001/").unwrap();
        assert_eq!(u.addr, "127.0.0.1:9001".parse().unwrap());
        assert_eq!(u.authority, "127.0.0.1:9001");
        assert!(resolve_url("http://localhost:80").is_ok());
        assert!(resolve_url("https://127.0.0.1:1")
            .unwrap_err()
            .contains("https"));
        assert!(resolve_url("http://127.0.0.1").is_err());
        assert!(resolve_url("http://127.0.0.1:1/v1").is_err());
    }
}
