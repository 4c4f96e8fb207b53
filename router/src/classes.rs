//! SLA classes: which class a request belongs to (the class header, else its API key, else
//! the default class), and what the class means: its priority and queue in admission, whether
//! it is shed instead of queued, the pool of replicas it may use and its routing weights.

use crate::config::SlaConfig;
use kvgate_policies::{PolicyConfig, Weights};
use kvgate_protocol::telemetry::token_matches;
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
    api_keys: Vec<(String, Arc<Class>)>,
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
        let mut api_keys = Vec::new();
        for (key, class) in &sla.api_keys {
            match by_name.get(class) {
                _ if key.is_empty() => {
                    errors.push(("api_keys".into(), "an API key is empty".into()))
                }
                Some(c) => api_keys.push((key.clone(), Arc::clone(c))),
                None => errors.push((
                    format!("api_keys.{}…", key.chars().take(4).collect::<String>()),
                    format!("class `{class}` is not one of the classes"),
                )),
            }
        }
        match default {
            Some(default) if errors.is_empty() => Ok(Classes {
                header: sla.header.clone(),
                default,
                by_name,
                api_keys,
            }),
            _ => Err(errors),
        }
    }

    /// The header that names a request's class.
    pub fn header(&self) -> &str {
        &self.header
    }

    /// A request's class: the one its header names (400 if unknown), else its API key's, else
    /// the default.
    pub fn classify(
        &self,
        header: Option<&[u8]>,
        authorization: Option<&[u8]>,
    ) -> Result<Arc<Class>, ApiError> {
        if let Some(name) = header {
            let name = String::from_utf8_lossy(name);
            return self.by_name.get(name.as_ref()).cloned().ok_or_else(|| {
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
            });
        }
        let key = authorization.and_then(|a| a.strip_prefix(b"Bearer "));
        if let Some(key) = key {
            // Every key is compared, in constant time each, so timing does not tell which
            // matched.
            let mut found = None;
            for (k, class) in &self.api_keys {
                if token_matches(key, k.as_bytes()) {
                    found = Some(class);
                }
            }
            if let Some(class) = found {
                return Ok(Arc::clone(class));
            }
        }
        Ok(Arc::clone(&self.default))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ClassConfig;

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

    fn sla() -> SlaConfig {
        let mut batch = class(0);
        batch.weights.insert("load".into(), 7.0);
        batch.pool.insert("tier".into(), "batch".into());
        SlaConfig {
            header: "x-kvgate-class".into(),
            default_class: "interactive".into(),
            classes: [("interactive".into(), class(2)), ("batch".into(), batch)].into(),
            api_keys: [("sk-batch".into(), "batch".into())].into(),
        }
    }

    #[test]
    fn header_then_api_key_then_default() -> Result<(), String> {
        let classes =
            Classes::build(&sla(), &PolicyConfig::default()).map_err(|e| format!("{e:?}"))?;
        let name =
            |h: Option<&[u8]>, a: Option<&[u8]>| classes.classify(h, a).map(|c| c.name.clone());
        assert_eq!(name(Some(b"batch"), None).ok(), Some("batch".into()));
        assert_eq!(
            name(Some(b"interactive"), Some(b"Bearer sk-batch")).ok(),
            Some("interactive".into())
        );
        assert_eq!(
            name(None, Some(b"Bearer sk-batch")).ok(),
            Some("batch".into())
        );
        assert_eq!(
            name(None, Some(b"Bearer other")).ok(),
            Some("interactive".into())
        );
        let e = classes
            .classify(Some(b"gold"), None)
            .err()
            .map(|e| e.message)
            .unwrap_or_default();
        assert!(e.contains("known: batch, interactive"), "{e}");
        let batch = classes
            .classify(Some(b"batch"), None)
            .map_err(|e| e.message)?;
        assert_eq!(batch.weights.load, 7.0);
        assert_eq!(batch.weights.prefix, PolicyConfig::default().weights.prefix);
        assert!(
            batch.admits(&[("tier".into(), "batch".into()), ("zone".into(), "a".into())].into())
        );
        assert!(!batch.admits(&BTreeMap::new()));
        Ok(())
    }

    #[test]
    fn every_problem_is_reported() {
        let mut bad = sla();
        bad.default_class = "gold".into();
        bad.api_keys.insert("sk-x".into(), "silver".into());
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
            "api_keys.sk-x…",
            "classes.odd.weights.speed",
            "classes.odd.preset",
            "classes.odd.max_queue",
        ] {
            assert!(paths.contains(&want), "{want} in {errors:?}");
        }
    }
}
