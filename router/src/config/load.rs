//! Reading a config file: YAML parsing (the only use of the YAML library), then validation.
//! Every error carries the YAML path and, where the parser knows it, the line.

use super::GatewayConfig;
use std::fmt;
use std::path::Path;

/// One problem with a config, located by YAML path (`replicas[1].url`) and line if known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub path: String,
    pub line: Option<usize>,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "line {line}: {}: {}", self.path, self.message),
            None => write!(f, "{}: {}", self.path, self.message),
        }
    }
}

/// A config file, read, parsed and validated, with its warnings (deprecated keys).
pub struct Loaded {
    pub config: GatewayConfig,
    pub warnings: Vec<String>,
}

fn read(path: &Path) -> Result<String, Vec<ConfigError>> {
    std::fs::read_to_string(path).map_err(|e| {
        vec![ConfigError {
            path: ".".into(),
            line: None,
            message: format!("cannot read {}: {e}", path.display()),
        }]
    })
}

/// Reads, parses and validates a config file (once).
pub fn load_file(path: &Path) -> Result<Loaded, Vec<ConfigError>> {
    let text = read(path)?;
    Ok(Loaded {
        config: parse_str(&text)?,
        warnings: deprecations(&text),
    })
}

/// [`load_file`], its warnings logged.
pub fn load_file_warning(path: &Path) -> Result<GatewayConfig, Vec<ConfigError>> {
    let loaded = load_file(path)?;
    for warning in &loaded.warnings {
        tracing::warn!("{}: {warning}", path.display());
    }
    Ok(loaded.config)
}

/// Keys still read under an old name: (path, its name now).
const RENAMED: [(&str, &str, &str); 1] = [("policy", "speculative_ttl_ms", "assumed_ttl_ms")];

/// Warnings about deprecated keys in config text (which is otherwise valid).
fn deprecations(text: &str) -> Vec<String> {
    let Ok(value) = serde_yaml_ng::from_str::<serde_yaml_ng::Value>(text) else {
        return Vec::new();
    };
    RENAMED
        .iter()
        .filter(|(section, old, _)| value.get(section).and_then(|s| s.get(old)).is_some())
        .map(|(section, old, new)| {
            format!("{section}.{old} is deprecated: it is now {section}.{new}")
        })
        .collect()
}

/// Policy presets (`policy: {preset: NAME}`), from `config/policies/`.
const PRESETS: [(&str, &str); 3] = [
    (
        "balanced",
        include_str!("../../../config/policies/balanced.yaml"),
    ),
    (
        "cache-first",
        include_str!("../../../config/policies/cache-first.yaml"),
    ),
    (
        "latency-first",
        include_str!("../../../config/policies/latency-first.yaml"),
    ),
];

/// The presets' names.
pub fn preset_names() -> Vec<&'static str> {
    PRESETS.iter().map(|(n, _)| *n).collect()
}

/// The policy settings of preset `name`.
pub fn preset(name: &str) -> Result<kvgate_policies::PolicyConfig, String> {
    let known = preset_names();
    let (_, text) = PRESETS
        .iter()
        .find(|(n, _)| *n == name)
        .ok_or_else(|| format!("unknown preset `{name}` (known: {})", known.join(", ")))?;
    serde_yaml_ng::from_str(text).map_err(|e| format!("preset {name}: {e}"))
}

/// A policy file (`kvgate sim --policy FILE`): a gateway config, of which only `policy:` is
/// read, or that section alone at the top level. Presets, defaults and checks are the gateway
/// config's; errors name the path as `check-config` does (`policy.load_factor`).
pub fn load_policy_file(path: &Path) -> Result<kvgate_policies::PolicyConfig, Vec<ConfigError>> {
    parse_policy_str(&read(path)?)
}

/// [`load_policy_file`] from its text.
pub fn parse_policy_str(text: &str) -> Result<kvgate_policies::PolicyConfig, Vec<ConfigError>> {
    use serde_yaml_ng::{Deserializer, Value};
    #[derive(serde::Deserialize)]
    struct Section {
        #[serde(default)]
        policy: kvgate_policies::PolicyConfig,
    }
    check_shape(text)?;
    let value: Value = serde_yaml_ng::from_str(text).map_err(|e| {
        vec![ConfigError {
            path: ".".into(),
            line: e.location().map(|l| l.line()),
            message: e.to_string(),
        }]
    })?;
    if !value.is_mapping() {
        return Err(vec![ConfigError {
            path: ".".into(),
            line: None,
            message: "a policy file is a mapping: a gateway config with `policy:`, or the policy's fields".into(),
        }]);
    }
    let nested = value.get("policy").is_some();
    let section = if nested {
        value.get("policy")
    } else {
        Some(&value)
    };
    let policy = match section.and_then(|p| p.get("preset")).cloned() {
        None if nested => deserialize::<_, Section>(Deserializer::from_str(text))?.policy,
        None => deserialize(Deserializer::from_str(text)).map_err(|errors| {
            errors
                .into_iter()
                .map(|e| ConfigError {
                    path: match e.path.as_str() {
                        "." => "policy".into(),
                        p => format!("policy.{p}"),
                    },
                    ..e
                })
                .collect::<Vec<_>>()
        })?,
        Some(name) => {
            let wrapped;
            let text = if nested {
                text
            } else {
                let mut top = serde_yaml_ng::Mapping::new();
                top.insert("policy".into(), value.clone());
                wrapped = serde_yaml_ng::to_string(&top).unwrap_or_default();
                &wrapped
            };
            deserialize::<_, Section>(with_preset(text, &name)?)?.policy
        }
    };
    let errors: Vec<ConfigError> = policy
        .validate()
        .into_iter()
        .map(|(path, message)| ConfigError {
            path: format!("policy.{path}"),
            line: None,
            message,
        })
        .collect();
    if errors.is_empty() {
        Ok(policy)
    } else {
        Err(errors)
    }
}

/// Largest config accepted, in bytes.
const MAX_CONFIG_BYTES: usize = 1 << 20;
/// Deepest nesting of flow collections (`[`, `{`) accepted: the YAML parser takes time
/// quadratic in it (a 40 KB file of nested brackets took seconds).
const MAX_FLOW_DEPTH: usize = 64;

/// Refuses text the YAML parser would take too long on, before it sees it.
fn check_shape(text: &str) -> Result<(), Vec<ConfigError>> {
    let error = |line: Option<usize>, message: String| {
        Err(vec![ConfigError {
            path: ".".into(),
            line,
            message,
        }])
    };
    if text.len() > MAX_CONFIG_BYTES {
        return error(
            None,
            format!(
                "the config has {} bytes, more than the {MAX_CONFIG_BYTES} accepted",
                text.len()
            ),
        );
    }
    let (mut depth, mut line) = (0usize, 1);
    let mut quote: Option<char> = None;
    let mut chars = text.chars().peekable();
    let mut previous = '\n';
    while let Some(c) = chars.next() {
        match (quote, c) {
            (_, '\n') => {
                line += 1;
                // A single-quoted or plain scalar never spans a comment; a double-quoted
                // one may span lines.
                if quote == Some('\'') {
                    quote = None;
                }
            }
            (Some('"'), '\\') => {
                chars.next();
            }
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '"' | '\'') => quote = Some(c),
            (None, '#') if previous.is_whitespace() => {
                while chars.peek().is_some_and(|&c| c != '\n') {
                    chars.next();
                }
            }
            (None, '[' | '{') => {
                depth += 1;
                if depth > MAX_FLOW_DEPTH {
                    return error(
                        Some(line),
                        format!("collections nested deeper than {MAX_FLOW_DEPTH} levels"),
                    );
                }
            }
            (None, ']' | '}') => depth = depth.saturating_sub(1),
            _ => {}
        }
        previous = c;
    }
    Ok(())
}

/// Parses and validates config text.
pub fn parse_str(text: &str) -> Result<GatewayConfig, Vec<ConfigError>> {
    check_shape(text)?;
    let preset = serde_yaml_ng::from_str::<serde_yaml_ng::Value>(text)
        .ok()
        .and_then(|v| v.get("policy")?.get("preset").cloned());
    let config = match preset {
        // No preset: straight from the text, so that errors keep their line numbers.
        None => deserialize(serde_yaml_ng::Deserializer::from_str(text))?,
        Some(name) => deserialize(with_preset(text, &name)?)?,
    };
    let errors = super::validate::validate(&config);
    if errors.is_empty() {
        Ok(config)
    } else {
        Err(errors)
    }
}

/// The config with its `policy` laid over the named preset (fields set beside `preset` win;
/// `weights` merge key by key).
fn with_preset(
    text: &str,
    name: &serde_yaml_ng::Value,
) -> Result<serde_yaml_ng::Value, Vec<ConfigError>> {
    use serde_yaml_ng::Value;
    let error = |message: String| {
        vec![ConfigError {
            path: "policy.preset".into(),
            line: None,
            message,
        }]
    };
    let known = preset_names();
    let preset = name
        .as_str()
        .and_then(|n| PRESETS.iter().find(|(p, _)| *p == n))
        .ok_or_else(|| {
            error(format!(
                "unknown preset {name:?} (known: {})",
                known.join(", ")
            ))
        })?;
    let mut merged: Value = serde_yaml_ng::from_str(preset.1)
        .map_err(|e| error(format!("preset {}: {e}", preset.0)))?;
    let mut config: Value =
        serde_yaml_ng::from_str(text).map_err(|e| error(format!("cannot read the config: {e}")))?;
    if let (Some(Value::Mapping(user)), Value::Mapping(base)) =
        (config.get("policy").cloned(), &mut merged)
    {
        for (k, v) in user {
            match (base.get_mut(&k), v) {
                (Some(Value::Mapping(b)), Value::Mapping(u)) => b.extend(u),
                (_, v) => {
                    base.insert(k, v);
                }
            }
        }
        base.remove("preset");
    }
    if let Value::Mapping(top) = &mut config {
        top.insert("policy".into(), merged);
    }
    Ok(config)
}

/// Deserializes a config; an error names its YAML path (and line, when read from text).
fn deserialize<'de, D, T>(deserializer: D) -> Result<T, Vec<ConfigError>>
where
    D: serde::Deserializer<'de, Error = serde_yaml_ng::Error>,
    T: serde::Deserialize<'de>,
{
    serde_path_to_error::deserialize(deserializer).map_err(|e| {
        let path = match e.path().to_string() {
            p if p == "." || p.is_empty() => ".".to_string(),
            p => p,
        };
        let inner = e.into_inner();
        let line = inner.location().map(|l| l.line());
        // The parser's message repeats the location; keep only what went wrong.
        let message = inner.to_string();
        let message = message.split(" at line ").next().unwrap_or(&message);
        let message = message
            .strip_prefix(&format!("{path}: "))
            .unwrap_or(message)
            .to_string();
        vec![ConfigError {
            path,
            line,
            message,
        }]
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_policy_file_is_a_gateway_config_or_its_policy_alone() {
        let alone = parse_policy_str("preset: cache-first\nload_factor: 2.0\n").unwrap();
        assert_eq!((alone.load_factor, alone.imbalance_factor), (2.0, 3.0));
        let nested = parse_policy_str(
            "listen: \"127.0.0.1:8080\"\npolicy:\n  load_factor: 1.7\n  weights: {prefix: 9}\n",
        )
        .unwrap();
        assert_eq!(nested.load_factor, 1.7);
        assert_eq!(nested.weights, {
            let mut w = kvgate_policies::PolicyConfig::default().weights;
            w.0[kvgate_policies::Signal::Prefix] = 9.0;
            w
        });
        assert_eq!(
            parse_policy_str("load_factor: 1.7\n").unwrap(),
            parse_policy_str("policy: {load_factor: 1.7}\n").unwrap()
        );
    }

    #[test]
    fn a_policy_file_error_names_its_yaml_path() {
        let at = |text: &str| {
            let e = parse_policy_str(text).unwrap_err();
            (e[0].path.clone(), e[0].line)
        };
        assert_eq!(
            at("load_factor: 1.5\nweights: {prefx: 1}\n"),
            ("policy.weights".into(), Some(2))
        );
        assert_eq!(at("policy:\n  load_factor: fast\n").0, "policy.load_factor");
        assert_eq!(at("preset: fastest\n").0, "policy.preset");
        assert_eq!(at("load_factor: 0.5\n").0, "policy.load_factor");
        assert_eq!(at("- 1\n").0, ".");
        assert_eq!(at("load_factor: [\n").0, ".");
    }

    #[test]
    fn presets_lay_under_what_the_config_sets() {
        let base = "listen: \"127.0.0.1:8080\"\nreplicas:\n  - url: \"http://127.0.0.1:9001\"\n";
        let c = parse_str(&format!(
            "{base}policy:\n  preset: latency-first\n  queue_saturation: 9\n  weights: {{prefix: 2.5}}\n"
        ))
        .unwrap();
        let p = &c.policy;
        assert_eq!((p.load_factor, p.queue_saturation), (1.1, 9));
        assert_eq!(
            (
                p.weights[kvgate_policies::Signal::Prefix],
                p.weights[kvgate_policies::Signal::Load]
            ),
            (2.5, 3.0)
        );
        assert_eq!(
            p.chunk_bytes, 256,
            "fields no preset sets keep their defaults"
        );
        for name in ["balanced", "cache-first", "latency-first"] {
            assert!(
                parse_str(&format!("{base}policy: {{preset: {name}}}\n")).is_ok(),
                "{name}"
            );
        }
        let balanced = parse_str(&format!("{base}policy: {{preset: balanced}}\n")).unwrap();
        assert_eq!(
            balanced.policy,
            parse_str(base).unwrap().policy,
            "balanced is the default"
        );
        let errs = parse_str(&format!("{base}policy: {{preset: fastest}}\n")).unwrap_err();
        assert_eq!(errs[0].path, "policy.preset");
        assert!(
            errs[0].message.contains("cache-first"),
            "{}",
            errs[0].message
        );
        let errs = parse_str(&format!(
            "{base}policy: {{preset: balanced, load_factor: 0.5}}\n"
        ))
        .unwrap_err();
        assert_eq!(errs[0].path, "policy.load_factor");
    }

    #[test]
    fn a_renamed_key_is_read_and_warned_about() {
        let base = "listen: \"127.0.0.1:8080\"\nreplicas:\n  - url: \"http://127.0.0.1:9001\"\n";
        let text = &format!("{base}policy:\n  speculative_ttl_ms: 250\n");
        assert_eq!(parse_str(text).unwrap().policy.assumed_ttl_ms, 250);
        let warnings = deprecations(text);
        assert_eq!(warnings.len(), 1);
        assert!(
            warnings[0].contains("policy.assumed_ttl_ms"),
            "{warnings:?}"
        );
        assert!(deprecations("policy:\n  assumed_ttl_ms: 250\n").is_empty());
        let both = format!("{base}policy:\n  speculative_ttl_ms: 1\n  assumed_ttl_ms: 2\n");
        let errs = parse_str(&both).unwrap_err();
        assert!(errs[0].message.contains("duplicate field"), "{errs:?}");
    }

    #[test]
    fn the_minimal_config_is_accepted() {
        let c = parse_str(
            "listen: \"127.0.0.1:8080\"\nreplicas:\n  - url: \"http://127.0.0.1:9001\"\n  - url: \"http://127.0.0.1:9002\"\n",
        )
        .unwrap();
        assert_eq!(c.replicas.len(), 2);
        assert_eq!(c.retries.attempts, 3);
        assert_eq!(c.limits.max_body_bytes, 32 << 20);
        assert_eq!(c.policy.load_factor, 0.0);
        assert_eq!(c.policy.recompute_penalty, 2.0);
        assert_eq!(c.policy.recompute_penalty_full_at, 2_048);
    }

    #[test]
    fn unknown_field_names_its_path_and_line() {
        let errs = parse_str(
            "listen: \"127.0.0.1:1\"\nreplicas:\n  - url: \"http://127.0.0.1:2\"\n    wieght: 3\n",
        )
        .unwrap_err();
        assert_eq!(errs.len(), 1);
        assert_eq!(errs[0].path, "replicas[0].wieght");
        assert_eq!(errs[0].line, Some(4));
        assert!(errs[0].message.contains("wieght"), "{}", errs[0]);
    }

    #[test]
    fn wrong_type_names_its_path() {
        let errs = parse_str("listen: \"127.0.0.1:1\"\nreplicas: []\nretries:\n  attempts: many\n")
            .unwrap_err();
        assert_eq!(errs[0].path, "retries.attempts");
        assert_eq!(errs[0].line, Some(4));
    }

    #[test]
    fn deep_nesting_and_huge_files_are_refused_before_parsing() {
        let base = "listen: \"127.0.0.1:1\"\nreplicas: []\n";
        let deep = format!("{base}x: {}{}\n", "[".repeat(20_000), "]".repeat(20_000));
        let errs = parse_str(&deep).unwrap_err();
        assert!(errs[0].message.contains("nested deeper"), "{}", errs[0]);
        assert_eq!(errs[0].line, Some(3));
        // Brackets inside quotes and comments are text.
        let quoted = format!(
            "{base}# {}\npolicy: {{preset: \"{}\"}}\n",
            "[".repeat(100),
            "{".repeat(100)
        );
        let errs = parse_str(&quoted).unwrap_err();
        assert_eq!(errs[0].path, "policy.preset", "{errs:?}");
        let huge = format!("{base}#{}\n", "x".repeat(MAX_CONFIG_BYTES));
        assert!(parse_str(&huge).unwrap_err()[0].message.contains("bytes"));
    }

    #[test]
    fn broken_yaml_reports_a_line() {
        let errs = parse_str("listen: [\nreplicas:\n").unwrap_err();
        assert!(errs[0].line.is_some(), "{}", errs[0]);
    }
}
