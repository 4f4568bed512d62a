//! OpenAI-style API errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

use serde::Serialize;

/// The class of an [`ApiError`]; decides the HTTP status and the OpenAI `type`/`code` fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The body is not valid JSON, not UTF-8, has wrong field types or misses a required field (400).
    InvalidRequest,
    /// The body is larger than the configured limit (413).
    BodyTooLarge,
    /// The client did not send its whole body within the configured time (408).
    RequestTimeout,
    /// No engine serves the requested model (404).
    ModelNotFound,
    /// No route matches the method and path (404).
    NotFound,
    /// The method is not allowed on this path (405).
    MethodNotAllowed,
    /// No API key, or one that is not (or no longer) valid (401).
    Unauthorized,
    /// The client may not make this request, e.g. a peer-only header from an untrusted source (403).
    Forbidden,
    /// Admission control refused the request; retry later (429).
    Overloaded,
    /// No engine is reachable (503).
    NoEngine,
    /// The chosen engine failed before answering (502).
    UpstreamFailed,
    /// The chosen engine sent nothing within the read timeout (504).
    UpstreamTimeout,
    /// A bug or an unexpected state inside the proxy (500).
    Internal,
}

impl ErrorKind {
    /// The HTTP status code for this kind.
    pub fn status(self) -> u16 {
        match self {
            ErrorKind::InvalidRequest => 400,
            ErrorKind::BodyTooLarge => 413,
            ErrorKind::RequestTimeout => 408,
            ErrorKind::ModelNotFound | ErrorKind::NotFound => 404,
            ErrorKind::MethodNotAllowed => 405,
            ErrorKind::Unauthorized => 401,
            ErrorKind::Forbidden => 403,
            ErrorKind::Overloaded => 429,
            ErrorKind::NoEngine => 503,
            ErrorKind::UpstreamFailed => 502,
            ErrorKind::UpstreamTimeout => 504,
            ErrorKind::Internal => 500,
        }
    }

    /// The OpenAI `type` field.
    pub fn error_type(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest
            | ErrorKind::BodyTooLarge
            | ErrorKind::RequestTimeout
            | ErrorKind::ModelNotFound
            | ErrorKind::NotFound
            | ErrorKind::MethodNotAllowed
            | ErrorKind::Unauthorized => "invalid_request_error",
            ErrorKind::Forbidden => "permission_error",
            ErrorKind::Overloaded => "rate_limit_error",
            ErrorKind::NoEngine
            | ErrorKind::UpstreamFailed
            | ErrorKind::UpstreamTimeout
            | ErrorKind::Internal => "server_error",
        }
    }

    /// The OpenAI `code` field.
    pub fn code(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest => "invalid_request",
            ErrorKind::BodyTooLarge => "request_too_large",
            ErrorKind::RequestTimeout => "request_timeout",
            ErrorKind::ModelNotFound => "model_not_found",
            ErrorKind::NotFound => "not_found",
            ErrorKind::MethodNotAllowed => "method_not_allowed",
            ErrorKind::Unauthorized => "invalid_api_key",
            ErrorKind::Forbidden => "forbidden",
            ErrorKind::Overloaded => "overloaded",
            ErrorKind::NoEngine => "no_engine_available",
            ErrorKind::UpstreamFailed => "upstream_failed",
            ErrorKind::UpstreamTimeout => "upstream_timeout",
            ErrorKind::Internal => "internal_error",
        }
    }
}

/// An error to be answered to the client as OpenAI-style JSON.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind:?}: {message}")]
pub struct ApiError {
    /// What went wrong, in general.
    pub kind: ErrorKind,
    /// What went wrong, for a person.
    pub message: String,
    /// The request field at fault, when known (OpenAI's `param`).
    pub param: Option<String>,
    /// With [`ErrorKind::MethodNotAllowed`]: the methods the path takes, for the `Allow`
    /// header a 405 must carry (RFC 9110, 15.5.6).
    pub allow: Option<&'static str>,
}

#[derive(Serialize)]
struct Envelope<'a> {
    error: Body<'a>,
}

#[derive(Serialize)]
struct Body<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    error_type: &'a str,
    param: Option<&'a str>,
    code: &'a str,
}

impl ApiError {
    /// An error of `kind` with a message.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        ApiError {
            kind,
            message: message.into(),
            param: None,
            allow: None,
        }
    }

    /// The `Allow` list of a path that is only read: `GET`, and `HEAD`, which answers as `GET`
    /// without the body (RFC 9110, 9.3.2).
    pub const READ_ONLY: &'static str = "GET, HEAD";

    /// 405: `path` takes only `allow` (one method, or a list as the `Allow` header spells it).
    pub fn method_not_allowed(path: &str, allow: &'static str) -> Self {
        ApiError {
            allow: Some(allow),
            ..ApiError::new(
                ErrorKind::MethodNotAllowed,
                format!("{path} accepts {allow} only"),
            )
        }
    }

    /// Names the request field at fault.
    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// The HTTP status code.
    pub fn status(&self) -> u16 {
        self.kind.status()
    }

    /// The JSON body: `{"error":{"message":..,"type":..,"param":..,"code":..}}`.
    pub fn to_json(&self) -> Vec<u8> {
        let envelope = Envelope {
            error: Body {
                message: &self.message,
                error_type: self.kind.error_type(),
                param: self.param.as_deref(),
                code: self.kind.code(),
            },
        };
        // Serializing plain strings into a Vec cannot fail.
        serde_json::to_vec(&envelope).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_shape_is_openai_style() {
        let e = ApiError::new(ErrorKind::BodyTooLarge, "too \"big\"").with_param("body");
        let v: serde_json::Value = serde_json::from_slice(&e.to_json()).unwrap();
        assert_eq!(e.status(), 413);
        assert_eq!(v["error"]["message"], "too \"big\"");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["code"], "request_too_large");
        assert_eq!(v["error"]["param"], "body");
        let t = ApiError::new(ErrorKind::RequestTimeout, "slow");
        let v: serde_json::Value = serde_json::from_slice(&t.to_json()).unwrap();
        assert_eq!(t.status(), 408);
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["code"], "request_timeout");
    }
}
