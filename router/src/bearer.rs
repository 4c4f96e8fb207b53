//! Bearer tokens on the admin listener's routes between machines (agents' reports, peer
//! gateways' pushes): each has its own token file, compared in constant time.

use kvgate_protocol::telemetry::token_matches;
use kvgate_protocol::{ApiError, ErrorKind};

/// Checks the `Authorization` header against `configured`; `off` explains a 404 when no token
/// is configured (the route's feature is off), `file` names the token file in a 401.
pub fn check(
    configured: Option<String>,
    authorization: Option<&[u8]>,
    off: &str,
    file: &str,
) -> Result<(), ApiError> {
    let Some(token) = configured else {
        return Err(ApiError::new(ErrorKind::NotFound, off));
    };
    let presented = authorization
        .and_then(|h| h.strip_prefix(b"Bearer "))
        .unwrap_or_default();
    if !token_matches(presented, token.as_bytes()) {
        return Err(ApiError::new(
            ErrorKind::Unauthorized,
            format!("missing or wrong bearer token ({file})"),
        ));
    }
    Ok(())
}
