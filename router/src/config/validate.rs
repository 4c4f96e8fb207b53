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
    /// `https://`: TLS to the replica, its certificate checked for `host`.
    pub tls: bool,
    /// The host as written (TLS server name).
    pub host: String,
}

/// Parses `http://HOST:PORT` or `https://HOST:PORT` (an optional trailing `/`), resolving HOST
/// once.
pub fn resolve_url(url: &str) -> Result<Upstream, String> {
    let (tls, authority) = match (url.strip_prefix("http://"), url.strip_prefix("https://")) {
        (Some(rest), _) => (false, rest),
        (_, Some(rest)) => (true, rest),
        _ => return Err(format!("`{url}` must start with http:// or https://")),
    };
    let authority = authority.trim_end_matches('/');
    if authority.is_empty() || authority.contains('/') {
        return Err(format!("`{url}` must be http(s)://HOST:PORT with no path"));
    }
    let addr = authority
        .to_socket_addrs()
        .map_err(|e| format!("`{url}`: cannot resolve `{authority}` (HOST:PORT expected): {e}"))?
        .next()
        .ok_or_else(|| format!("`{url}`: `{authority}` resolves to no address"))?;
    let host = authority
        .rsplit_once(':')
        .map_or(authority, |(h, _)| h)
        .trim_start_matches('[')
        .trim_end_matches(']');
    Ok(Upstream {
        addr,
        authority: authority.to_string(),
        tls,
        host: host.to_string(),
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
        match a.parse::<SocketAddr>() {
            Err(_) => err(
                "admin_listen".into(),
                format!("`{a}` is not an IP:PORT socket address"),
            ),
            Ok(addr) if !addr.ip().is_loopback() && c.admin_token_file.is_none() => err(
                "admin_token_file".into(),
                format!(
                    "the admin API on `{a}`, beyond loopback, needs a token: set admin_token_file"
                ),
            ),
            Ok(_) => {}
        }
    }
    if let Some(path) = &c.admin_token_file {
        if c.admin_listen.is_none() {
            err(
                "admin_token_file".into(),
                "there is no admin listener to protect: set admin_listen".into(),
            );
        }
        if let Err(e) = super::read_token(path) {
            err("admin_token_file".into(), e);
        }
    }
    if c.shutdown_grace_ms > 3_600_000 {
        err(
            "shutdown_grace_ms".into(),
            format!(
                "must be at most 3600000 (an hour), got {}",
                c.shutdown_grace_ms
            ),
        );
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
    if let Some(p) = &c.peers {
        let own = c.admin_listen.as_deref().and_then(|a| a.parse().ok());
        validate_peers(p, c.admin_listen.is_some(), own, &mut err);
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
    let mut addresses: Vec<(SocketAddr, usize)> = Vec::new();
    for (i, r) in c.replicas.iter().enumerate() {
        match resolve_url(&r.url) {
            Err(e) => err(format!("replicas[{i}].url"), e),
            Ok(up) => match addresses.iter().find(|(a, _)| *a == up.addr) {
                // Two names for one server would split its load and cache state in two.
                Some((_, first)) => err(
                    format!("replicas[{i}].url"),
                    format!("`{}` is the server of replicas[{first}] too", r.url),
                ),
                None => addresses.push((up.addr, i)),
            },
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
    for (name, v) in [
        ("header_timeout_ms", c.limits.header_timeout_ms),
        ("body_timeout_ms", c.limits.body_timeout_ms),
        ("send_timeout_ms", c.limits.send_timeout_ms),
    ] {
        if v == 0 {
            err(format!("limits.{name}"), "must be greater than 0".into());
        }
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
    if let Some(d) = &c.disaggregation {
        for (path, message) in d.validate() {
            err(format!("disaggregation.{path}"), message);
        }
    }
    validate_tenants(c, &mut err);
    if let Some(tls) = &c.tls {
        if let Err(e) = crate::tls::Certificate::load(tls) {
            err("tls".into(), e);
        }
    }
    if let Some(ca) = &c.upstream_ca_file {
        if !ca.is_file() {
            err(
                "upstream_ca_file".into(),
                format!("{} is not a readable file", ca.display()),
            );
        }
    }
    errors
}

/// `own`: this gateway's admin address, which must not be its own peer (it would count each
/// of its decisions twice).
fn validate_peers(
    p: &super::PeersConfig,
    has_admin: bool,
    own: Option<SocketAddr>,
    err: &mut impl FnMut(String, String),
) {
    if p.urls.is_empty() {
        err("peers.urls".into(), "at least one peer is required".into());
    }
    for (i, url) in p.urls.iter().enumerate() {
        match resolve_url(url) {
            Err(e) => err(format!("peers.urls[{i}]"), e),
            Ok(up) if Some(up.addr) == own => err(
                format!("peers.urls[{i}]"),
                format!("`{url}` is this gateway's own admin listener; list the others"),
            ),
            Ok(_) => {}
        }
    }
    if !has_admin {
        err(
            "peers".into(),
            "peers push to each other's admin listener: set `admin_listen`".into(),
        );
    }
    if let Err(e) = super::read_token(&p.token_file) {
        err("peers.token_file".into(), e);
    }
    let ranges = [
        ("interval_ms", p.interval_ms, 1, 60_000),
        ("max_pending", p.max_pending as u64, 1, 1_000_000),
        ("timeout_ms", p.timeout_ms, 1, 60_000),
    ];
    for (field, value, lo, hi) in ranges {
        if !(lo..=hi).contains(&value) {
            err(
                format!("peers.{field}"),
                format!("must be between {lo} and {hi}, got {value}"),
            );
        }
    }
}

fn validate_tenants(c: &GatewayConfig, err: &mut impl FnMut(String, String)) {
    let class_known = |name: &str| c.sla.as_ref().is_some_and(|s| s.classes.contains_key(name));
    let mut hashes: Vec<(&str, &str)> = Vec::new();
    for (name, t) in &c.tenants {
        let path = |field: &str| format!("tenants.{name}.{field}");
        if t.api_keys.is_empty() {
            err(path("api_keys"), "at least one key hash is required".into());
        }
        for (i, key) in t.api_keys.iter().enumerate() {
            if !crate::tenants::is_key_hash(key) {
                // Never echo what may be a key in clear.
                err(
                    format!("tenants.{name}.api_keys[{i}]"),
                    "must be a key's hash, `sha256:` and 64 lowercase hex digits (kvgate hash-key prints it)".into(),
                );
            } else if let Some((other, _)) = hashes.iter().find(|(_, h)| *h == key.as_str()) {
                err(
                    format!("tenants.{name}.api_keys[{i}]"),
                    format!("the same key belongs to tenant `{other}`"),
                );
            } else {
                hashes.push((name, key));
            }
        }
        for class in t.class.iter().chain(&t.allowed_classes) {
            if !class_known(class) {
                err(
                    path("class"),
                    format!("`{class}` is not one of the classes under `sla.classes`"),
                );
            }
        }
        if t.max_concurrent == Some(0) {
            err(path("max_concurrent"), "must be at least 1, got 0".into());
        }
        if t.tokens_per_minute == Some(0) {
            err(
                path("tokens_per_minute"),
                "must be at least 1, got 0".into(),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::parse_str;
    use super::*;

    #[test]
    fn every_semantic_error_is_reported_with_its_path() {
        let errs = parse_str(
            "listen: \"nowhere\"\nreplicas:\n  - url: \"ftp://x\"\n  - url: \"http://127.0.0.1:1\"\n    id: a\n  - url: \"http://127.0.0.1:2\"\n    id: a\nretries: {attempts: 0}\npolicy: {load_factor: 0.5, recompute_penalty_full_at: 200000000}\n",
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
                "policy.load_factor",
                "policy.recompute_penalty_full_at"
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
        let token = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(&token, "t0ken\n").unwrap();
        let token = token.path();
        let ok = parse_str(&format!(
            "listen: \"127.0.0.1:1\"\nadmin_listen: \"127.0.0.1:2\"\nreplicas: []\nagents: {{token_file: {}, join: open}}\n",
            token.display()
        ));
        assert!(ok.is_ok(), "{ok:?}");
        assert_eq!(super::super::read_token(token).unwrap(), "t0ken");
    }

    #[test]
    fn peer_settings_are_checked() {
        let base = "listen: \"127.0.0.1:1\"\nreplicas:\n  - url: \"http://127.0.0.1:9001\"\n";
        let errs = parse_str(&format!(
            "{base}peers: {{urls: [], token_file: /nonexistent/token, interval_ms: 0, max_pending: 0, timeout_ms: 60001}}\n"
        ))
        .unwrap_err();
        let paths: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "peers.urls",
                "peers",
                "peers.token_file",
                "peers.interval_ms",
                "peers.max_pending",
                "peers.timeout_ms"
            ],
            "{errs:?}"
        );
        let token = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(&token, "p33r\n").unwrap();
        let token = token.path();
        let with = |urls: &str| {
            parse_str(&format!(
                "{base}admin_listen: \"127.0.0.1:8081\"\npeers: {{urls: {urls}, token_file: {}}}\n",
                token.display()
            ))
        };
        let errs = with("[\"http://127.0.0.1:8081\", \"ftp://x\"]").unwrap_err();
        let paths: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, ["peers.urls[0]", "peers.urls[1]"], "{errs:?}");
        assert!(
            errs[0].message.contains("own admin listener"),
            "{}",
            errs[0]
        );
        let ok = with("[\"http://127.0.0.1:8082\"]").unwrap();
        let peers = ok.peers.unwrap();
        assert_eq!(
            (peers.interval_ms, peers.max_pending, peers.timeout_ms),
            (2, 4_096, 500)
        );
    }

    #[test]
    fn one_server_cannot_be_two_replicas() {
        let errs = parse_str(
            "listen: \"127.0.0.1:1\"\nreplicas:\n  - url: \"http://127.0.0.1:9001\"\n  - url: \"http://localhost:9001/\"\n    id: b\n",
        )
        .unwrap_err();
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert_eq!(errs[0].path, "replicas[1].url");
        assert!(errs[0].message.contains("replicas[0]"), "{}", errs[0]);
    }

    #[test]
    fn the_admin_api_beyond_loopback_needs_a_token() {
        let base = "listen: \"127.0.0.1:1\"\nreplicas:\n  - url: \"http://127.0.0.1:9001\"\n";
        let errs = parse_str(&format!("{base}admin_listen: \"0.0.0.0:8081\"\n")).unwrap_err();
        assert_eq!(errs[0].path, "admin_token_file");
        assert!(parse_str(&format!("{base}admin_listen: \"127.0.0.1:8081\"\n")).is_ok());
        let token = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(&token, "s3cret\n").unwrap();
        let token = token.path();
        let with_token = format!(
            "{base}admin_listen: \"0.0.0.0:8081\"\nadmin_token_file: {}\n",
            token.display()
        );
        assert!(parse_str(&with_token).is_ok());
        let errs =
            parse_str(&format!("{base}admin_token_file: {}\n", token.display())).unwrap_err();
        assert_eq!(errs[0].path, "admin_token_file", "no admin listener");
    }

    #[test]
    fn tenants_hold_hashes_of_known_classes() {
        let hash = crate::tenants::hash_api_key(b"sk-1");
        let base = "listen: \"127.0.0.1:1\"\nreplicas:\n  - url: \"http://127.0.0.1:9001\"\nsla:\n  default_class: a\n  classes: {a: {}, b: {}}\n";
        let ok = format!("{base}tenants:\n  t1: {{api_keys: [\"{hash}\"], class: b, allowed_classes: [a], max_concurrent: 4, tokens_per_minute: 1000}}\n");
        assert!(parse_str(&ok).is_ok(), "{:?}", parse_str(&ok));
        let bad = format!(
            "{base}tenants:\n  t1: {{api_keys: [sk-in-clear], class: c, max_concurrent: 0}}\n  t2: {{api_keys: [\"{hash}\", \"{hash}\"]}}\n  t3: {{api_keys: [\"{hash}\"]}}\n"
        );
        let errs = parse_str(&bad).unwrap_err();
        let paths: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "tenants.t1.api_keys[0]",
                "tenants.t1.class",
                "tenants.t1.max_concurrent",
                "tenants.t2.api_keys[1]",
                "tenants.t3.api_keys[0]"
            ],
            "{errs:?}"
        );
        assert!(
            errs.iter().all(|e| !e.message.contains("sk-in-clear")),
            "{errs:?}"
        );
    }

    #[test]
    fn urls_resolve_to_socket_addresses() {
        let u = resolve_url("http://127.0.0.1:9001/").unwrap();
        assert_eq!(u.addr, "127.0.0.1:9001".parse().unwrap());
        assert_eq!(u.authority, "127.0.0.1:9001");
        assert!(resolve_url("http://localhost:80").is_ok());
        let tls = resolve_url("https://localhost:8443").unwrap();
        assert!(tls.tls);
        assert_eq!(
            (tls.host.as_str(), tls.authority.as_str()),
            ("localhost", "localhost:8443")
        );
        assert!(!u.tls);
        assert!(resolve_url("ftp://127.0.0.1:1").is_err());
        assert!(resolve_url("http://127.0.0.1").is_err());
        assert!(resolve_url("http://127.0.0.1:1/v1").is_err());
    }
}
