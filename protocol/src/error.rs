//! OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`.

use serde::{Deserialize, Serialize};

/// What went wrong, which fixes the HTTP status and the OpenAI `type`/`code`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    InvalidRequest,
    /// A missing or wrong bearer token.
    Unauthorized,
    /// A known client asking for what it may not have.
    Forbidden,
    ModelNotFound,
    NotFound,
    MethodNotAllowed,
    /// The client took too long to send its request.
    RequestTimeout,
    PayloadTooLarge,
    /// Too many request headers, or too large.
    HeadersTooLarge,
    RateLimited,
    Unavailable,
    BadGateway,
    GatewayTimeout,
    Internal,
}

impl ErrorKind {
    pub fn status(self) -> u16 {
        match self {
            ErrorKind::InvalidRequest => 400,
            ErrorKind::Unauthorized => 401,
            ErrorKind::Forbidden => 403,
            ErrorKind::ModelNotFound | ErrorKind::NotFound => 404,
            ErrorKind::MethodNotAllowed => 405,
            ErrorKind::RequestTimeout => 408,
            ErrorKind::PayloadTooLarge => 413,
            ErrorKind::HeadersTooLarge => 431,
            ErrorKind::RateLimited => 429,
            ErrorKind::Internal => 500,
            ErrorKind::BadGateway => 502,
            ErrorKind::Unavailable => 503,
            ErrorKind::GatewayTimeout => 504,
        }
    }

    fn type_and_code(self) -> (&'static str, &'static str) {
        match self {
            ErrorKind::InvalidRequest => ("invalid_request_error", "invalid_request"),
            ErrorKind::Unauthorized => ("authentication_error", "invalid_api_key"),
            ErrorKind::Forbidden => ("permission_error", "permission_denied"),
            ErrorKind::ModelNotFound => ("invalid_request_error", "model_not_found"),
            ErrorKind::NotFound => ("invalid_request_error", "not_found"),
            ErrorKind::MethodNotAllowed => ("invalid_request_error", "method_not_allowed"),
            ErrorKind::RequestTimeout => ("invalid_request_error", "request_timeout"),
            ErrorKind::PayloadTooLarge => ("invalid_request_error", "payload_too_large"),
            ErrorKind::HeadersTooLarge => ("invalid_request_error", "headers_too_large"),
            ErrorKind::RateLimited => ("rate_limit_error", "rate_limited"),
            ErrorKind::Unavailable => ("service_unavailable", "no_healthy_replica"),
            ErrorKind::BadGateway => ("upstream_error", "bad_gateway"),
            ErrorKind::GatewayTimeout => ("upstream_error", "upstream_timeout"),
            ErrorKind::Internal => ("server_error", "internal_error"),
        }
    }
}

/// An error as returned to an OpenAI client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub kind: ErrorKind,
    pub message: String,
    /// The request field at fault, when there is one.
    pub param: Option<String>,
}

impl ApiError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        ApiError {
            kind,
            message: message.into(),
            param: None,
        }
    }

    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    pub fn status(&self) -> u16 {
        self.kind.status()
    }

    pub fn body(&self) -> ErrorBody {
        let (kind, code) = self.kind.type_and_code();
        ErrorBody {
            error: ErrorDetail {
                message: self.message.clone(),
                kind: kind.to_string(),
                param: self.param.clone(),
                code: Some(code.to_string()),
            },
        }
    }

    /// The JSON body, ready to send.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(&self.body()).unwrap_or_else(|_| b"{\"error\":{}}".to_vec())
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ApiError {}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub param: Option<String>,
    pub code: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_body_has_the_openai_shape() {
        let e = ApiError::new(ErrorKind::InvalidRequest, "bad").with_param("messages");
        let v: serde_json::Value = serde_json::from_slice(&e.to_json()).unwrap_or_default();
        assert_eq!(v["error"]["message"], "bad");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["param"], "messages");
        assert_eq!(e.status(), 400);
        assert_eq!(ApiError::new(ErrorKind::ModelNotFound, "x").status(), 404);
    }
}
