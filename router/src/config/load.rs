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

/// Reads, parses and validates a config file.
pub fn load_file(path: &Path) -> Result<GatewayConfig, Vec<ConfigError>> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        vec![ConfigError {
            path: ".".into(),
            line: None,
            message: format!("cannot read {}: {e}", path.display()),
        }]
    })?;
    parse_str(&text)
}

/// Parses and validates config text.
pub fn parse_str(text: &str) -> Result<GatewayConfig, Vec<ConfigError>> {
    let deserializer = serde_yaml_ng::Deserializer::from_str(text);
    let config: GatewayConfig = serde_path_to_error::deserialize(deserializer).map_err(|e| {
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
    })?;
    let errors = super::validate::validate(&config);
    if errors.is_empty() {
        Ok(config)
    } else {
        Err(errors)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_minimal_config_is_accepted() {
        let c = parse_str(
            "listen: \"127.0.0.1:8080\"\nreplicas:\n  - url: \"http://127.0.0.1:9001\"\n  - url: \"http://127.0.0.1:9002\"\n",
        )
        .unwrap();
        assert_eq!(c.replicas.len(), 2);
        assert_eq!(c.retries.attempts, 3);
        assert_eq!(c.limits.max_body_bytes, 32 << 20);
        assert_eq!(c.policy.load_factor, 1.25);
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
    fn broken_yaml_reports_a_line() {
        let errs = parse_str("listen: [\nreplicas:\n").unwrap_err();
        assert!(errs[0].line.is_some(), "{}", errs[0]);
    }
}
