//! Parsing and validation of OpenAI request bodies, and their canonical prompt bytes.
//!
//! The proxy forwards the original body bytes unchanged; what is parsed here only decides where
//! they go. Canonical text (DESIGN section 2):
//! - chat: the `tools` array (if any) as compact JSON, then per message
//!   `role ++ "\n" ++ text parts concatenated ++ "\n\n"`; image and audio parts are not hashed;
//! - completions (`prompt`) and embeddings (`input`): a string as is; an array of strings joined
//!   with `"\n\n"`; token ids as u32 little-endian bytes.

use serde::Deserialize;
use serde_json::Value;

use crate::error::{ApiError, ErrorKind};

/// The OpenAI endpoints whose bodies kvmesh parses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`
    ChatCompletions,
    /// `POST /v1/completions`
    Completions,
    /// `POST /v1/embeddings`
    Embeddings,
}

impl Endpoint {
    /// The endpoint served at `path` (query string already removed), if any.
    pub fn from_path(path: &str) -> Option<Self> {
        match path.trim_end_matches('/') {
            "/v1/chat/completions" => Some(Endpoint::ChatCompletions),
            "/v1/completions" => Some(Endpoint::Completions),
            "/v1/embeddings" => Some(Endpoint::Embeddings),
            _ => None,
        }
    }

    /// A short label for metrics.
    pub fn label(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "chat",
            Endpoint::Completions => "completions",
            Endpoint::Embeddings => "embeddings",
        }
    }
}

/// What the router needs from a request body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedRequest {
    /// Which endpoint the body was parsed for.
    pub endpoint: Endpoint,
    /// The `model` field.
    pub model: String,
    /// `stream: true` was asked for.
    pub stream: bool,
    /// The `user` field, used by the `session` policy.
    pub user: Option<String>,
    /// vLLM's `cache_salt` field: separates the digest namespace per tenant.
    pub cache_salt: Option<String>,
    /// The canonical prompt bytes that the digest chain is computed over.
    pub canonical: Vec<u8>,
}

#[derive(Deserialize)]
struct ChatBody {
    model: String,
    messages: Vec<ChatMessage>,
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    cache_salt: Option<String>,
}

#[derive(Deserialize)]
struct ChatMessage {
    role: String,
    #[serde(default)]
    content: Option<Value>,
}

#[derive(Deserialize)]
struct CompletionBody {
    model: String,
    prompt: Value,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    cache_salt: Option<String>,
}

#[derive(Deserialize)]
struct EmbeddingBody {
    model: String,
    input: Value,
    #[serde(default)]
    user: Option<String>,
}

fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::new(ErrorKind::InvalidRequest, message)
}

fn deserialize<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, ApiError> {
    if body.is_empty() {
        return Err(invalid("request body is empty; expected a JSON object"));
    }
    // Fast path without path tracking; on failure, parse again to name the faulty field.
    if let Ok(parsed) = serde_json::from_slice::<T>(body) {
        return Ok(parsed);
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let parsed: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let what = if inner.is_syntax() || inner.is_eof() {
            "invalid JSON body"
        } else {
            "invalid request body"
        };
        let err = invalid(if path == "." || path.is_empty() {
            format!("{what}: {inner}")
        } else {
            format!("{what}: `{path}`: {inner}")
        });
        if path == "." || path.is_empty() {
            err
        } else {
            err.with_param(path)
        }
    })?;
    de.end()
        .map_err(|e| invalid(format!("invalid JSON body: trailing characters: {e}")))?;
    Ok(parsed)
}

/// Parses and validates `body` for `endpoint`.
pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<ParsedRequest, ApiError> {
    // Each endpoint yields (model, stream, user, cache_salt, canonical prompt).
    let (model, stream, user, cache_salt, canonical) = match endpoint {
        Endpoint::ChatCompletions => {
            let b: ChatBody = deserialize(body)?;
            (
                b.model,
                b.stream,
                b.user,
                b.cache_salt,
                chat_canonical(b.tools.as_ref(), &b.messages)?,
            )
        }
        Endpoint::Completions => {
            let b: CompletionBody = deserialize(body)?;
            let canonical = prompt_bytes(&b.prompt, "prompt")?;
            (b.model, b.stream, b.user, b.cache_salt, canonical)
        }
        Endpoint::Embeddings => {
            let b: EmbeddingBody = deserialize(body)?;
            (
                b.model,
                None,
                b.user,
                None,
                prompt_bytes(&b.input, "input")?,
            )
        }
    };
    require_model(&model)?;
    Ok(ParsedRequest {
        endpoint,
        model,
        stream: stream.unwrap_or(false),
        user,
        cache_salt,
        canonical,
    })
}

/// Chat canonical text: compact `tools`, then `role\ntext\n\n` per message.
fn chat_canonical(tools: Option<&Value>, messages: &[ChatMessage]) -> Result<Vec<u8>, ApiError> {
    if messages.is_empty() {
        return Err(invalid("`messages` must contain at least one message").with_param("messages"));
    }
    let mut canonical = Vec::new();
    if let Some(tools) = tools.filter(|t| !t.is_null()) {
        if !tools.is_array() {
            return Err(invalid("`tools` must be an array").with_param("tools"));
        }
        // Compact JSON of an in-memory Value cannot fail.
        canonical.extend_from_slice(&serde_json::to_vec(tools).unwrap_or_default());
    }
    for (i, m) in messages.iter().enumerate() {
        canonical.extend_from_slice(m.role.as_bytes());
        canonical.push(b'\n');
        append_content(&mut canonical, m.content.as_ref(), i)?;
        canonical.extend_from_slice(b"\n\n");
    }
    Ok(canonical)
}

fn require_model(model: &str) -> Result<(), ApiError> {
    if model.trim().is_empty() {
        return Err(invalid("`model` must not be empty").with_param("model"));
    }
    Ok(())
}

fn append_content(
    out: &mut Vec<u8>,
    content: Option<&Value>,
    index: usize,
) -> Result<(), ApiError> {
    let param = || format!("messages[{index}].content");
    match content {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(s)) => {
            out.extend_from_slice(s.as_bytes());
            Ok(())
        }
        Some(Value::Array(parts)) => {
            for (j, part) in parts.iter().enumerate() {
                let Some(obj) = part.as_object() else {
                    return Err(invalid(format!("`{}[{j}]` must be an object", param()))
                        .with_param(param()));
                };
                match obj.get("type").and_then(Value::as_str) {
                    Some("text") => match obj.get("text") {
                        Some(Value::String(t)) => out.extend_from_slice(t.as_bytes()),
                        _ => {
                            return Err(invalid(format!(
                                "`{}[{j}].text` must be a string",
                                param()
                            ))
                            .with_param(param()))
                        }
                    },
                    // Images, audio, files: passed through to the engine, never hashed.
                    Some(_) => {}
                    None => {
                        return Err(invalid(format!("`{}[{j}].type` must be a string", param()))
                            .with_param(param()))
                    }
                }
            }
            Ok(())
        }
        Some(_) => Err(invalid(format!(
            "`{}` must be a string or an array of content parts",
            param()
        ))
        .with_param(param())),
    }
}

fn token_id(v: &Value, param: &str) -> Result<u32, ApiError> {
    v.as_u64()
        .and_then(|t| u32::try_from(t).ok())
        .ok_or_else(|| {
            invalid(format!("`{param}` token ids must be integers in 0..2^32")).with_param(param)
        })
}

fn prompt_bytes(v: &Value, param: &str) -> Result<Vec<u8>, ApiError> {
    let bad = || {
        invalid(format!(
            "`{param}` must be a string, an array of strings, an array of token ids or an array of token-id arrays"
        ))
        .with_param(param)
    };
    match v {
        Value::String(s) => Ok(s.as_bytes().to_vec()),
        Value::Array(items) if items.is_empty() => {
            Err(invalid(format!("`{param}` must not be empty")).with_param(param))
        }
        Value::Array(items) => {
            let mut out = Vec::new();
            match &items[0] {
                Value::String(_) => {
                    for (i, item) in items.iter().enumerate() {
                        let s = item.as_str().ok_or_else(bad)?;
                        if i > 0 {
                            out.extend_from_slice(b"\n\n");
                        }
                        out.extend_from_slice(s.as_bytes());
                    }
                }
                Value::Number(_) => {
                    for item in items {
                        out.extend_from_slice(&token_id(item, param)?.to_le_bytes());
                    }
                }
                Value::Array(_) => {
                    for item in items {
                        let inner = item.as_array().ok_or_else(bad)?;
                        for t in inner {
                            out.extend_from_slice(&token_id(t, param)?.to_le_bytes());
                        }
                    }
                }
                _ => return Err(bad()),
            }
            Ok(out)
        }
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<ParsedRequest, ApiError> {
        parse(Endpoint::ChatCompletions, body.as_bytes())
    }

    #[test]
    fn chat_canonical_text() {
        let r = chat(
            r#"{"model":"m","stream":true,"user":"u1","tools":[{"type":"function", "function":{"name":"f"}}],
                "messages":[{"role":"system","content":"sys"},
                            {"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"b"}]}]}"#,
        )
        .unwrap();
        assert_eq!(r.model, "m");
        assert!(r.stream);
        assert_eq!(r.user.as_deref(), Some("u1"));
        assert_eq!(
            String::from_utf8(r.canonical).unwrap(),
            "[{\"function\":{\"name\":\"f\"},\"type\":\"function\"}]system\nsys\n\nuser\nab\n\n"
        );
    }

    #[test]
    fn image_parts_do_not_change_the_prefix() {
        let a = chat(
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#,
        )
        .unwrap();
        let b = chat(
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:x"}},{"type":"text","text":"hi"}]}]}"#,
        )
        .unwrap();
        assert_eq!(a.canonical, b.canonical);
    }

    #[test]
    fn completions_prompt_forms() {
        let p = |s: &str| parse(Endpoint::Completions, s.as_bytes()).map(|r| r.canonical);
        assert_eq!(p(r#"{"model":"m","prompt":"abc"}"#).unwrap(), b"abc");
        assert_eq!(p(r#"{"model":"m","prompt":["a","b"]}"#).unwrap(), b"a\n\nb");
        assert_eq!(
            p(r#"{"model":"m","prompt":[1,2]}"#).unwrap(),
            vec![1, 0, 0, 0, 2, 0, 0, 0]
        );
        assert_eq!(
            p(r#"{"model":"m","prompt":[[1],[2]]}"#).unwrap(),
            vec![1, 0, 0, 0, 2, 0, 0, 0]
        );
        assert!(p(r#"{"model":"m","prompt":[-1]}"#).is_err());
        assert!(p(r#"{"model":"m","prompt":[]}"#).is_err());
        assert!(p(r#"{"model":"m","prompt":{}}"#).is_err());
        let e = parse(Endpoint::Embeddings, br#"{"model":"m","input":["x"]}"#).unwrap();
        assert_eq!(e.canonical, b"x");
    }

    #[test]
    fn bad_inputs_are_400_with_clear_messages() {
        let cases: &[(&str, &str)] = &[
            ("", "empty"),
            ("{", "invalid JSON"),
            ("[1]", "invalid request body"),
            (r#"{"model":"m"}"#, "missing field `messages`"),
            (
                r#"{"messages":[{"role":"user","content":"x"}]}"#,
                "missing field `model`",
            ),
            (r#"{"model":5,"messages":[]}"#, "`model`"),
            (r#"{"model":"m","messages":[]}"#, "at least one"),
            (
                r#"{"model":"m","messages":[{"role":"user","content":5}]}"#,
                "messages[0].content",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"stream":"yes"}"#,
                "`stream`",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}]} x"#,
                "trailing",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"\ud800"}]}"#,
                "escape",
            ),
        ];
        for (body, needle) in cases {
            let e = chat(body).expect_err(body);
            assert_eq!(e.status(), 400, "{body}");
            assert!(e.message.contains(needle), "{body}: {}", e.message);
        }
        let mut non_utf8 = br#"{"model":"m","messages":[{"role":"user","content":""#.to_vec();
        non_utf8.extend_from_slice(&[0xff, 0xfe]);
        non_utf8.extend_from_slice(br#""}]}"#);
        let e = parse(Endpoint::ChatCompletions, &non_utf8).unwrap_err();
        assert_eq!(e.status(), 400);
        assert!(e.message.contains("invalid"), "{}", e.message);
    }

    #[test]
    fn endpoints_by_path() {
        assert_eq!(
            Endpoint::from_path("/v1/chat/completions"),
            Some(Endpoint::ChatCompletions)
        );
        assert_eq!(
            Endpoint::from_path("/v1/completions/"),
            Some(Endpoint::Completions)
        );
        assert_eq!(
            Endpoint::from_path("/v1/embeddings"),
            Some(Endpoint::Embeddings)
        );
        assert_eq!(Endpoint::from_path("/v1/other"), None);
    }
}
