//! The turns of an OpenAI chat request as the chat template sees them: one `(role, content)`
//! pair per message, the content a string, or the `text` parts of an array joined with nothing
//! between them (other parts, e.g. images, carry no text), or empty when null or absent.

use serde_json::Value;

/// Why a `messages` array cannot be rendered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChatError {
    /// `messages` is missing, not an array, or empty.
    #[error("`messages` (a non-empty array) is required")]
    NoMessages,
    /// A message has no string `role`.
    #[error("messages[{0}].role must be a string")]
    Role(usize),
    /// A message's `content` is neither a string, an array of parts, nor null.
    #[error("messages[{0}].content must be a string or an array of parts")]
    Content(usize),
}

impl ChatError {
    /// The request field the error is about, as an OpenAI error's `param`.
    pub fn param(&self) -> String {
        match self {
            ChatError::NoMessages => "messages".into(),
            ChatError::Role(i) => format!("messages[{i}].role"),
            ChatError::Content(i) => format!("messages[{i}].content"),
        }
    }
}

/// The text a message's `content` stands for (message `i`, for the error).
pub fn content_text(content: &Value, i: usize) -> Result<String, ChatError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => Ok(parts
            .iter()
            .filter(|p| p.get("type").and_then(Value::as_str) == Some("text"))
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("")),
        Value::Null => Ok(String::new()),
        _ => Err(ChatError::Content(i)),
    }
}

/// The `(role, content)` turns of `messages` (the request's `messages` field, if any).
pub fn turns(messages: Option<&Value>) -> Result<Vec<(String, String)>, ChatError> {
    let msgs = messages
        .and_then(Value::as_array)
        .filter(|m| !m.is_empty())
        .ok_or(ChatError::NoMessages)?;
    msgs.iter()
        .enumerate()
        .map(|(i, m)| {
            let role = m
                .get("role")
                .and_then(Value::as_str)
                .ok_or(ChatError::Role(i))?;
            let content = content_text(m.get("content").unwrap_or(&Value::Null), i)?;
            Ok((role.to_string(), content))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn strings_parts_and_null_become_text() {
        let m = json!([
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [
                {"type": "text", "text": "a"},
                {"type": "image_url", "image_url": {"url": "x"}},
                {"type": "text", "text": "b"}
            ]},
            {"role": "assistant", "content": null},
            {"role": "tool"}
        ]);
        let t = turns(Some(&m)).expect("valid");
        let want = [
            ("system", "be brief"),
            ("user", "ab"),
            ("assistant", ""),
            ("tool", ""),
        ];
        assert_eq!(t.len(), want.len());
        for ((r, c), (wr, wc)) in t.iter().zip(want) {
            assert_eq!((r.as_str(), c.as_str()), (wr, wc));
        }
    }

    #[test]
    fn malformed_messages_name_the_field() {
        assert_eq!(turns(None), Err(ChatError::NoMessages));
        assert_eq!(turns(Some(&json!([]))), Err(ChatError::NoMessages));
        assert_eq!(turns(Some(&json!("hi"))), Err(ChatError::NoMessages));
        let e = turns(Some(
            &json!([{"role": "user", "content": "x"}, {"content": "y"}]),
        ));
        assert_eq!(e, Err(ChatError::Role(1)));
        assert_eq!(ChatError::Role(1).param(), "messages[1].role");
        let e = turns(Some(&json!([{"role": "user", "content": 7}])));
        assert_eq!(e, Err(ChatError::Content(0)));
        assert_eq!(ChatError::Content(0).param(), "messages[0].content");
    }
}
