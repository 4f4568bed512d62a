//! The access log (one line per request, target `kvmesh::access`, at info) and request ids.

use std::time::Duration;

/// The request-id header: taken from the client when usable, else generated; forwarded to the
/// engine and echoed to the client.
pub const REQUEST_ID: &str = "x-request-id";
/// The header the client address is appended to on the way to the engine.
pub const FORWARDED_FOR: &str = "x-forwarded-for";
/// Longest client-given request id kept (longer ones are replaced).
const MAX_REQUEST_ID: usize = 128;
/// Longest `x-forwarded-for` kept from the client before ours is appended (longer: replaced).
const MAX_FORWARDED_FOR: usize = 4096;

/// The client's request id if it is 1 to 128 visible ASCII characters, else a fresh random one
/// (32 hex digits).
pub fn request_id(given: Option<&str>) -> String {
    match given {
        Some(id)
            if !id.is_empty()
                && id.len() <= MAX_REQUEST_ID
                && id.bytes().all(|b| b.is_ascii_graphic()) =>
        {
            id.to_string()
        }
        _ => format!("{:032x}", fastrand::u128(..)),
    }
}

/// `x-forwarded-for` for the engine: the client's list (when short enough) with `client`
/// appended.
pub fn forwarded_for(existing: Option<&str>, client: &str) -> String {
    match existing.map(str::trim) {
        Some(e) if !e.is_empty() && e.len() <= MAX_FORWARDED_FOR => format!("{e}, {client}"),
        _ => client.to_string(),
    }
}

/// One access-log line.
pub struct Line<'a> {
    /// The request id.
    pub request_id: &'a str,
    /// HTTP method.
    pub method: &'a str,
    /// Request path.
    pub path: &'a str,
    /// Model asked for (empty before parsing).
    pub model: &'a str,
    /// Status the client got (499: it went away before the answer ended).
    pub status: u16,
    /// Engine that served (empty if none).
    pub engine: &'a str,
    /// Why that engine (the decision's reason; empty if none).
    pub reason: &'a str,
    /// Leading blocks the index predicted the engine held.
    pub overlap_blocks: usize,
    /// Cached prompt tokens the engine reported.
    pub cached_tokens: Option<u64>,
    /// Completion tokens the engine reported.
    pub completion_tokens: Option<u64>,
    /// Time to the first response byte.
    pub ttft: Option<Duration>,
    /// Time to the end of the request.
    pub duration: Duration,
    /// Request body bytes.
    pub bytes_in: usize,
    /// Response body bytes.
    pub bytes_out: u64,
    /// Client IP address.
    pub client: &'a str,
    /// Name of the API key used (empty without `[auth]`); never the key.
    pub key: &'a str,
}

/// The first `max` bytes of `s` at most, cut at a character boundary (what clients send is
/// shown or recorded only this far: the dashboard, span attributes).
pub fn prefix(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Writes `l` at info level under target `kvmesh::access`.
pub fn log(l: &Line<'_>) {
    tracing::info!(
        target: "kvmesh::access",
        request_id = l.request_id,
        method = l.method,
        path = l.path,
        model = l.model,
        status = l.status,
        engine = l.engine,
        reason = l.reason,
        overlap_blocks = l.overlap_blocks,
        cached_tokens = l.cached_tokens,
        completion_tokens = l.completion_tokens,
        ttft_ms = l.ttft.map(|d| d.as_secs_f64() * 1e3),
        duration_ms = l.duration.as_secs_f64() * 1e3,
        bytes_in = l.bytes_in,
        bytes_out = l.bytes_out,
        client = l.client,
        key = l.key,
        "request"
    );
}

#[cfg(test)]
mod tests {
    use super::{forwarded_for, request_id};

    #[test]
    fn a_usable_client_id_is_kept_and_anything_else_replaced() {
        assert_eq!(request_id(Some("abc-123")), "abc-123");
        for bad in [None, Some(""), Some("has space"), Some("é")] {
            let id = request_id(bad);
            assert_eq!(id.len(), 32, "{bad:?}");
            assert!(id.bytes().all(|b| b.is_ascii_hexdigit()));
        }
        assert_eq!(request_id(Some(&"x".repeat(129))).len(), 32);
        assert_ne!(request_id(None), request_id(None));
    }

    #[test]
    fn the_client_is_appended_to_forwarded_for() {
        assert_eq!(forwarded_for(None, "10.0.0.1"), "10.0.0.1");
        assert_eq!(
            forwarded_for(Some(" 1.2.3.4 "), "10.0.0.1"),
            "1.2.3.4, 10.0.0.1"
        );
        assert_eq!(
            forwarded_for(Some(&"9".repeat(5000)), "10.0.0.1"),
            "10.0.0.1"
        );
    }
}
