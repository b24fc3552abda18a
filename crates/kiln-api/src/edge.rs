//! What every call passes through before a front door reads it, the same on every door: the
//! request id (the client's when usable, else a fresh one) and the API key.

use http::{HeaderMap, HeaderValue, header};

/// The header a request id travels in (taken from the client or made here; echoed back).
pub const REQUEST_ID: &str = "x-request-id";

/// Anthropic's clients send the key here rather than as a bearer token.
pub const X_API_KEY: &str = "x-api-key";

/// The call's request id: the client's when usable (1 to 128 printable ASCII characters),
/// else a fresh one, which is written into `headers` so the door's handlers see it too.
pub fn request_id(headers: &mut HeaderMap) -> HeaderValue {
    if let Some(v) = headers
        .get(REQUEST_ID)
        .filter(|v| usable_request_id(v.as_bytes()))
    {
        return v.clone();
    }
    // Hex digits are always a valid header value.
    let v = HeaderValue::from_str(&new_request_id())
        .unwrap_or_else(|_| HeaderValue::from_static("unknown"));
    headers.insert(REQUEST_ID, v.clone());
    v
}

/// Whether a call may pass: no key is set, or it carries the key as `Authorization: Bearer
/// <key>` or `x-api-key: <key>`.
pub fn authorized(headers: &HeaderMap, key: Option<&str>) -> bool {
    let Some(key) = key else {
        return true;
    };
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "));
    let x_api_key = headers.get(X_API_KEY).map(HeaderValue::as_bytes);
    [bearer, x_api_key]
        .into_iter()
        .flatten()
        .any(|given| same_key(given, key.as_bytes()))
}

/// Compared in constant time, so the key cannot be guessed byte by byte from response times.
fn same_key(given: &[u8], key: &[u8]) -> bool {
    given.len() == key.len() && given.iter().zip(key).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Whether a client's request id may be echoed into logs and headers: 1 to 128 printable
/// ASCII characters.
pub fn usable_request_id(id: &[u8]) -> bool {
    !id.is_empty() && id.len() <= 128 && id.iter().all(|c| c.is_ascii_graphic())
}

/// A fresh request id (16 hex digits) for a call that brought none.
pub fn new_request_id() -> String {
    format!("{:016x}", rand::random::<u64>())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(name: &'static str, value: &'static str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(name, HeaderValue::from_static(value));
        h
    }

    #[test]
    fn keys_as_bearer_or_x_api_key() {
        assert!(authorized(&HeaderMap::new(), None));
        assert!(!authorized(&HeaderMap::new(), Some("k3y")));
        assert!(authorized(
            &with("authorization", "Bearer k3y"),
            Some("k3y")
        ));
        assert!(authorized(&with("x-api-key", "k3y"), Some("k3y")));
        assert!(!authorized(
            &with("authorization", "Bearer k3z"),
            Some("k3y")
        ));
        assert!(!authorized(
            &with("authorization", "Bearer k3yy"),
            Some("k3y")
        ));
        assert!(!authorized(
            &with("authorization", "Basic k3y"),
            Some("k3y")
        ));
        assert!(!authorized(&with("x-api-key", "Bearer k3y"), Some("k3y")));
    }

    #[test]
    fn request_ids() {
        assert!(usable_request_id(b"abc-123"));
        assert!(!usable_request_id(b""));
        assert!(!usable_request_id(b"a b"));
        assert!(!usable_request_id(&[b'a'; 129]));
        assert!(usable_request_id(new_request_id().as_bytes()));
        let mut kept = with("x-request-id", "mine-1");
        assert_eq!(request_id(&mut kept), "mine-1");
        let mut made = with("x-request-id", "has space");
        let id = request_id(&mut made);
        assert_eq!(id.len(), 16);
        assert_eq!(made.get(REQUEST_ID), Some(&id));
    }
}
