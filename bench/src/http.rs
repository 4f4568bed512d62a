//! Small HTTP helpers shared by the instruments.

use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};

/// The response body type of the instruments' servers.
pub type Body = BoxBody<Bytes, Infallible>;

/// A whole body from bytes.
pub fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into()).boxed()
}

/// A JSON response with `status`.
pub fn json(status: u16, v: &serde_json::Value) -> http::Response<Body> {
    let body = serde_json::to_vec(v).unwrap_or_default();
    http::Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(full(body))
        .unwrap_or_else(|_| http::Response::new(full(Bytes::new())))
}

/// An OpenAI-style error response.
pub fn error(status: u16, message: &str) -> http::Response<Body> {
    json(
        status,
        &serde_json::json!({"error": {"message": message, "type": "invalid_request_error", "param": null, "code": null}}),
    )
}
