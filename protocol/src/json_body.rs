//! Request bodies read as JSON, with errors that name the field at fault.

use crate::{ApiError, ErrorKind};
use serde::de::DeserializeOwned;

/// Deserializes a whole body (nothing but whitespace may follow the value), with the failing
/// field's path in the error (`messages[0].role`).
pub fn deserialize<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    // Tracking the path costs on every request; only a failure needs it, so a failed body is
    // read again to explain itself.
    let mut de = serde_json::Deserializer::from_slice(body);
    match T::deserialize(&mut de).and_then(|value| de.end().map(|()| value)) {
        Ok(value) => Ok(value),
        Err(plain) => Err(explain::<T>(body, plain)),
    }
}

/// The error for a body that failed to deserialize with `plain`.
fn explain<T: DeserializeOwned>(body: &[u8], plain: serde_json::Error) -> ApiError {
    let mut de = serde_json::Deserializer::from_slice(body);
    let (path, inner) = match serde_path_to_error::deserialize::<_, T>(&mut de) {
        Err(e) => (e.path().to_string(), e.into_inner()),
        // The value was whole; what followed it was not whitespace.
        Ok(_) => (String::new(), plain),
    };
    let message = inner.to_string();
    // A missing field is reported at its parent; name the field itself.
    let missing = message
        .strip_prefix("missing field `")
        .and_then(|rest| rest.split('`').next())
        .map(str::to_string);
    let param = match (missing, path.as_str()) {
        (Some(field), "." | "") => Some(field),
        (Some(field), parent) => Some(format!("{parent}.{field}")),
        (None, "." | "") => None,
        (None, p) => Some(p.to_string()),
    };
    let message = if inner.is_syntax() || inner.is_eof() {
        format!("request body is not valid JSON: {message}")
    } else {
        match &param {
            Some(p) => format!("invalid field `{p}`: {message}"),
            None => format!("invalid request: {message}"),
        }
    };
    let error = ApiError::new(ErrorKind::InvalidRequest, message);
    match param {
        Some(p) => error.with_param(p),
        None => error,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;
    use std::collections::BTreeMap;

    #[derive(Debug, Deserialize, PartialEq)]
    struct Body {
        model: String,
        messages: Vec<Message>,
    }

    #[derive(Debug, Deserialize, PartialEq)]
    struct Message {
        role: String,
    }

    #[test]
    fn a_whole_body_is_read_and_whitespace_may_follow_it() {
        let body: Body =
            deserialize(b" {\"model\":\"m\",\"messages\":[{\"role\":\"user\"}]}\r\n ").unwrap();
        assert_eq!(body.messages[0].role, "user");
    }

    #[test]
    fn errors_name_the_field_at_fault() {
        let e = deserialize::<Body>(br#"{"model":"m","messages":[{"role":7}]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        assert!(e
            .message
            .starts_with("invalid field `messages[0].role`: invalid type"));
        let e = deserialize::<Body>(br#"{"model":"m","messages":[{}]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        let e = deserialize::<Body>(br#"{"messages":[]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("model"));
        let e = deserialize::<Body>(br#"{"model":"m","#).unwrap_err();
        assert!(e.message.starts_with("request body is not valid JSON"));
        assert_eq!(e.kind, ErrorKind::InvalidRequest);
    }

    #[test]
    fn bytes_after_the_value_are_refused() {
        // Two bodies back to back, or a body with junk after it, are not one request.
        for body in [
            &br#"{"model":"m","messages":[]} {"model":"n","messages":[]}"#[..],
            br#"{"model":"m","messages":[]}x"#,
            br#"{"model":"m","messages":[]}]"#,
        ] {
            let e = deserialize::<Body>(body).unwrap_err();
            assert!(
                e.message
                    .starts_with("request body is not valid JSON: trailing characters"),
                "{}",
                e.message
            );
            assert_eq!(e.param, None);
        }
        let e = deserialize::<BTreeMap<String, u32>>(b"{} 1").unwrap_err();
        assert!(e.message.contains("trailing characters"), "{}", e.message);
    }
}
