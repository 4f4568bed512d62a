//! Parsing and validation of OpenAI request bodies, and their canonical prompt bytes.
//!
//! The proxy forwards the original body bytes unchanged; what is parsed here only decides where
//! they go. Canonical text (DESIGN section 2):
//! - chat: the `tools` array (if any) as compact JSON (object keys sorted), then per message
//!   `role ++ "\n" ++ text parts concatenated ++ "\n\n"`; image and audio parts are not hashed;
//! - completions (`prompt`) and embeddings (`input`): a string as is; an array of strings joined
//!   with `"\n\n"`; token ids as u32 little-endian bytes.
//!
//! The body is parsed in one streaming pass with serde visitors that write the canonical bytes
//! as they go: no `serde_json::Value` tree is built, so a 32 MiB prompt of `[0,0,0,...]` costs
//! its canonical bytes (which [`parse_limited`] also caps), not half a gigabyte of `Value`s.
//! Fields the router does not need are skipped with [`serde::de::IgnoredAny`].

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

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
    /// The canonical prompt bytes that the digest chain is computed over: all of them from
    /// [`parse`], the first `max_canonical_bytes` from [`parse_limited`].
    pub canonical: Vec<u8>,
    /// Length of the whole canonical prompt, bytes (at least `canonical.len()`).
    pub canonical_len: usize,
}

fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::new(ErrorKind::InvalidRequest, message)
}

/// Canonical bytes being built: keeps the first `cap`, counts all.
struct Canon {
    kept: Vec<u8>,
    len: usize,
    cap: usize,
}

impl Canon {
    fn new(cap: usize) -> Self {
        Canon {
            kept: Vec::new(),
            len: 0,
            cap,
        }
    }

    fn push(&mut self, b: &[u8]) {
        self.len = self.len.saturating_add(b.len());
        let room = self.cap.saturating_sub(self.kept.len());
        if room > 0 {
            self.kept.extend_from_slice(&b[..b.len().min(room)]);
        }
    }

    /// Appends `other` (built with a cap at least this one's).
    fn append(&mut self, other: Canon) {
        self.push(&other.kept);
        self.len = self
            .len
            .saturating_add(other.len.saturating_sub(other.kept.len()));
    }
}

/// Field names of a request body (and of a message object); unknown names are skipped.
enum Key {
    Model,
    Stream,
    User,
    CacheSalt,
    Messages,
    Tools,
    Prompt,
    Input,
    Role,
    Content,
    Type,
    Text,
    Other,
}

impl<'de> de::Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Key;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a field name")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Key, E> {
                Ok(match v {
                    "model" => Key::Model,
                    "stream" => Key::Stream,
                    "user" => Key::User,
                    "cache_salt" => Key::CacheSalt,
                    "messages" => Key::Messages,
                    "tools" => Key::Tools,
                    "prompt" => Key::Prompt,
                    "input" => Key::Input,
                    "role" => Key::Role,
                    "content" => Key::Content,
                    "type" => Key::Type,
                    "text" => Key::Text,
                    _ => Key::Other,
                })
            }
        }
        d.deserialize_identifier(V)
    }
}

/// What the body visitor collects; combined and checked by [`parse_limited`].
struct Fields {
    model: String,
    stream: Option<bool>,
    user: Option<String>,
    cache_salt: Option<String>,
    tools: Option<Vec<u8>>,
    prompt: Canon,
}

/// The whole body: a JSON object whose fields depend on the endpoint.
#[derive(Clone, Copy)]
struct Body {
    endpoint: Endpoint,
    cap: usize,
}

impl<'de> DeserializeSeed<'de> for Body {
    type Value = Fields;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Fields, D::Error> {
        d.deserialize_map(self)
    }
}

fn set_once<T, E: de::Error>(slot: &mut Option<T>, v: T, name: &'static str) -> Result<(), E> {
    if slot.is_some() {
        return Err(E::duplicate_field(name));
    }
    *slot = Some(v);
    Ok(())
}

impl<'de> Visitor<'de> for Body {
    type Value = Fields;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Fields, A::Error> {
        let chat = self.endpoint == Endpoint::ChatCompletions;
        let embeddings = self.endpoint == Endpoint::Embeddings;
        let prompt_name = match self.endpoint {
            Endpoint::ChatCompletions => "messages",
            Endpoint::Completions => "prompt",
            Endpoint::Embeddings => "input",
        };
        let mut model = None;
        let mut stream: Option<Option<bool>> = None;
        let mut user: Option<Option<String>> = None;
        let mut cache_salt: Option<Option<String>> = None;
        let mut tools: Option<Option<Vec<u8>>> = None;
        let mut prompt: Option<Canon> = None;
        while let Some(key) = map.next_key::<Key>()? {
            let is_prompt = matches!(
                (&key, self.endpoint),
                (Key::Messages, Endpoint::ChatCompletions)
                    | (Key::Prompt, Endpoint::Completions)
                    | (Key::Input, Endpoint::Embeddings)
            );
            if is_prompt {
                if prompt.is_some() {
                    return Err(de::Error::duplicate_field(prompt_name));
                }
                let mut c = Canon::new(self.cap);
                if chat {
                    map.next_value_seed(Messages(&mut c))?;
                } else {
                    map.next_value_seed(Prompt {
                        out: &mut c,
                        param: prompt_name,
                    })?;
                }
                prompt = Some(c);
                continue;
            }
            match key {
                Key::Model => set_once(&mut model, map.next_value::<String>()?, "model")?,
                Key::Stream if !embeddings => {
                    set_once(&mut stream, map.next_value::<Option<bool>>()?, "stream")?
                }
                Key::User => set_once(&mut user, map.next_value::<Option<String>>()?, "user")?,
                Key::CacheSalt if !embeddings => set_once(
                    &mut cache_salt,
                    map.next_value::<Option<String>>()?,
                    "cache_salt",
                )?,
                Key::Tools if chat => set_once(&mut tools, map.next_value_seed(Tools)?, "tools")?,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        let model = model.ok_or_else(|| de::Error::missing_field("model"))?;
        let prompt = prompt.ok_or_else(|| de::Error::missing_field(prompt_name))?;
        Ok(Fields {
            model,
            stream: stream.flatten(),
            user: user.flatten(),
            cache_salt: cache_salt.flatten(),
            tools: tools.flatten(),
            prompt,
        })
    }
}

/// `tools`: null, or an array, canonicalised as compact JSON with sorted object keys.
struct Tools;

impl<'de> DeserializeSeed<'de> for Tools {
    type Value = Option<Vec<u8>>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Tools {
    type Value = Option<Vec<u8>>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array of tools")
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::new();
        CompactJson(&mut out).visit_seq(seq)?;
        Ok(Some(out))
    }
}

/// Writes a JSON value as compact JSON with object keys in byte order, exactly as
/// `serde_json::to_vec(&Value)` does with serde_json's default (sorted) map, without the tree.
struct CompactJson<'a>(&'a mut Vec<u8>);

impl<'de> DeserializeSeed<'de> for CompactJson<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

fn write_json<T: serde::Serialize + ?Sized, E: de::Error>(
    out: &mut Vec<u8>,
    v: &T,
) -> Result<(), E> {
    serde_json::to_writer(out, v).map_err(E::custom)
}

impl<'de> Visitor<'de> for CompactJson<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<(), E> {
        write_json(self.0, &v)
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<(), E> {
        write_json(self.0, &v)
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<(), E> {
        write_json(self.0, &v)
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        write_json(self.0, &v)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        write_json(self.0, v)
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        self.0.extend_from_slice(b"null");
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let out = self.0;
        out.push(b'[');
        let mut first = true;
        loop {
            if !first {
                out.push(b',');
            }
            if seq.next_element_seed(CompactJson(out))?.is_none() {
                if !first {
                    out.pop();
                }
                break;
            }
            first = false;
        }
        out.push(b']');
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        // Later duplicates replace earlier ones, as in serde_json's map.
        let mut entries: BTreeMap<String, Vec<u8>> = BTreeMap::new();
        while let Some(k) = map.next_key::<String>()? {
            let mut v = Vec::new();
            map.next_value_seed(CompactJson(&mut v))?;
            entries.insert(k, v);
        }
        let out = self.0;
        out.push(b'{');
        for (i, (k, v)) in entries.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            write_json(out, k.as_str())?;
            out.push(b':');
            out.extend_from_slice(v);
        }
        out.push(b'}');
        Ok(())
    }
}

/// `messages`: a non-empty array of message objects.
struct Messages<'a>(&'a mut Canon);

impl<'de> DeserializeSeed<'de> for Messages<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for Messages<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array of messages")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut n = 0usize;
        while seq.next_element_seed(Message(&mut *self.0))?.is_some() {
            n += 1;
        }
        if n == 0 {
            return Err(de::Error::custom("must contain at least one message"));
        }
        Ok(())
    }
}

/// One message: `role ++ "\n" ++ text ++ "\n\n"`, whatever the order of its fields.
struct Message<'a>(&'a mut Canon);

impl<'de> DeserializeSeed<'de> for Message<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Message<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a message object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let out = self.0;
        let mut role: Option<String> = None;
        // Content seen before the role waits here; content after it goes straight to `out`.
        let mut pending: Option<Canon> = None;
        let mut content_seen = false;
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::Role => {
                    let r = map.next_value::<String>()?;
                    set_once(&mut role, r, "role")?;
                }
                Key::Content => {
                    if content_seen {
                        return Err(de::Error::duplicate_field("content"));
                    }
                    content_seen = true;
                    if let Some(r) = role.as_deref() {
                        out.push(r.as_bytes());
                        out.push(b"\n");
                        map.next_value_seed(Content(&mut *out))?;
                    } else {
                        let mut tmp = Canon::new(out.cap);
                        map.next_value_seed(Content(&mut tmp))?;
                        pending = Some(tmp);
                    }
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        let Some(role) = role else {
            return Err(de::Error::missing_field("role"));
        };
        if !content_seen || pending.is_some() {
            out.push(role.as_bytes());
            out.push(b"\n");
            if let Some(p) = pending {
                out.append(p);
            }
        }
        out.push(b"\n\n");
        Ok(())
    }
}

/// A message's `content`: null, a string, or an array of content parts.
struct Content<'a>(&'a mut Canon);

impl<'de> DeserializeSeed<'de> for Content<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Content<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string or an array of content parts")
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        self.0.push(v.as_bytes());
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Part(&mut *self.0))?.is_some() {}
        Ok(())
    }
}

/// One content part: a `text` part's text is hashed; images, audio, files are not.
struct Part<'a>(&'a mut Canon);

impl<'de> DeserializeSeed<'de> for Part<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Part<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a content part object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut kind: Option<String> = None;
        let mut text: Option<Option<String>> = None;
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::Type => {
                    let t = map.next_value::<String>()?;
                    set_once(&mut kind, t, "type")?;
                }
                Key::Text => {
                    let t = map.next_value::<TextField>()?;
                    set_once(&mut text, t.0, "text")?;
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        match kind.as_deref() {
            Some("text") => match text.flatten() {
                Some(t) => {
                    self.0.push(t.as_bytes());
                    Ok(())
                }
                None => Err(de::Error::custom("a `text` part needs a string `text`")),
            },
            // Images, audio, files: passed through to the engine, never hashed.
            Some(_) => Ok(()),
            None => Err(de::Error::custom("a content part needs a string `type`")),
        }
    }
}

/// A part's `text`: `Some` when it is a string; any other value is skipped (it only matters
/// for `text` parts, which then get an error).
struct TextField(Option<String>);

impl<'de> de::Deserialize<'de> for TextField {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TextField;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<TextField, E> {
                Ok(TextField(Some(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<TextField, E> {
                Ok(TextField(Some(v)))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<TextField, E> {
                Ok(TextField(None))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<TextField, E> {
                Ok(TextField(None))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<TextField, E> {
                Ok(TextField(None))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<TextField, E> {
                Ok(TextField(None))
            }
            fn visit_unit<E: de::Error>(self) -> Result<TextField, E> {
                Ok(TextField(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<TextField, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(TextField(None))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<TextField, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(TextField(None))
            }
        }
        d.deserialize_any(V)
    }
}

/// `prompt` / `input`: a string, or a non-empty array of strings, token ids or token-id arrays.
struct Prompt<'a> {
    out: &'a mut Canon,
    param: &'static str,
}

impl<'de> DeserializeSeed<'de> for Prompt<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Prompt<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(
            "a string, an array of strings, an array of token ids or an array of token-id arrays",
        )
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        self.out.push(v.as_bytes());
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut form = None;
        let mut n = 0usize;
        while seq
            .next_element_seed(PromptItem {
                out: &mut *self.out,
                form: &mut form,
                first: n == 0,
            })?
            .is_some()
        {
            n += 1;
        }
        if n == 0 {
            return Err(de::Error::custom(format_args!(
                "`{}` must not be empty",
                self.param
            )));
        }
        Ok(())
    }
}

/// The form of a prompt array, set by its first element.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Form {
    Strings,
    Tokens,
    TokenArrays,
}

const MIXED: &str = "all elements must be of one kind: strings, token ids or token-id arrays";
const TOKEN_RANGE: &str = "token ids must be integers in 0..2^32";

/// One element of a prompt array.
struct PromptItem<'a> {
    out: &'a mut Canon,
    form: &'a mut Option<Form>,
    first: bool,
}

impl PromptItem<'_> {
    fn form<E: de::Error>(&mut self, f: Form) -> Result<(), E> {
        match *self.form {
            None => {
                *self.form = Some(f);
                Ok(())
            }
            Some(g) if g == f => Ok(()),
            Some(_) => Err(E::custom(MIXED)),
        }
    }
}

impl<'de> DeserializeSeed<'de> for PromptItem<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for PromptItem<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string, a token id or an array of token ids")
    }
    fn visit_str<E: de::Error>(mut self, v: &str) -> Result<(), E> {
        self.form(Form::Strings)?;
        if !self.first {
            self.out.push(b"\n\n");
        }
        self.out.push(v.as_bytes());
        Ok(())
    }
    fn visit_u64<E: de::Error>(mut self, v: u64) -> Result<(), E> {
        self.form(Form::Tokens)?;
        Token(&mut *self.out).visit_u64(v)
    }
    fn visit_i64<E: de::Error>(mut self, v: i64) -> Result<(), E> {
        self.form(Form::Tokens)?;
        Token(&mut *self.out).visit_i64(v)
    }
    fn visit_f64<E: de::Error>(mut self, v: f64) -> Result<(), E> {
        self.form(Form::Tokens)?;
        Token(&mut *self.out).visit_f64(v)
    }
    fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<(), A::Error> {
        self.form(Form::TokenArrays)?;
        while seq.next_element_seed(Token(&mut *self.out))?.is_some() {}
        Ok(())
    }
}

/// One token id, written as u32 little-endian.
struct Token<'a>(&'a mut Canon);

impl<'de> DeserializeSeed<'de> for Token<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Token<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a token id (an integer in 0..2^32)")
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<(), E> {
        let t = u32::try_from(v).map_err(|_| E::custom(TOKEN_RANGE))?;
        self.0.push(&t.to_le_bytes());
        Ok(())
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<(), E> {
        match u64::try_from(v) {
            Ok(u) => self.visit_u64(u),
            Err(_) => Err(E::custom(TOKEN_RANGE)),
        }
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        Err(E::custom(TOKEN_RANGE))
    }
}

/// Runs the body visitor over `body`; on failure, again with path tracking to name the field.
fn deserialize(seed: Body, body: &[u8]) -> Result<Fields, ApiError> {
    if body.is_empty() {
        return Err(invalid("request body is empty; expected a JSON object"));
    }
    // Fast path without path tracking.
    let mut de = serde_json::Deserializer::from_slice(body);
    if let Ok(fields) = seed.deserialize(&mut de) {
        return de
            .end()
            .map(|()| fields)
            .map_err(|e| invalid(format!("invalid JSON body: trailing characters: {e}")));
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let mut track = serde_path_to_error::Track::new();
    let result = seed.deserialize(serde_path_to_error::Deserializer::new(&mut de, &mut track));
    let inner = match result {
        Ok(_) => {
            return Err(invalid("invalid JSON body"));
        }
        Err(e) => e,
    };
    let path = track.path().to_string();
    let what = if inner.is_syntax() || inner.is_eof() {
        "invalid JSON body"
    } else {
        "invalid request body"
    };
    if path == "." || path.is_empty() {
        Err(invalid(format!("{what}: {inner}")))
    } else {
        Err(invalid(format!("{what}: `{path}`: {inner}")).with_param(path))
    }
}

/// Parses and validates `body` for `endpoint`, keeping the whole canonical prompt.
pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<ParsedRequest, ApiError> {
    parse_limited(endpoint, body, usize::MAX)
}

/// Parses and validates `body` for `endpoint`, keeping only the first `max_canonical_bytes`
/// of the canonical prompt (its length is still counted in full): what a capped digest chain
/// needs, at a memory cost independent of the prompt's size.
pub fn parse_limited(
    endpoint: Endpoint,
    body: &[u8],
    max_canonical_bytes: usize,
) -> Result<ParsedRequest, ApiError> {
    let f = deserialize(
        Body {
            endpoint,
            cap: max_canonical_bytes,
        },
        body,
    )?;
    require_model(&f.model)?;
    let mut canonical = Canon::new(max_canonical_bytes);
    if let Some(tools) = &f.tools {
        canonical.push(tools);
    }
    canonical.append(f.prompt);
    Ok(ParsedRequest {
        endpoint,
        model: f.model,
        stream: f.stream.unwrap_or(false),
        user: f.user,
        cache_salt: f.cache_salt,
        canonical_len: canonical.len,
        canonical: canonical.kept,
    })
}

fn require_model(model: &str) -> Result<(), ApiError> {
    if model.trim().is_empty() {
        return Err(invalid("`model` must not be empty").with_param("model"));
    }
    Ok(())
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

    #[test]
    fn tools_canonical_matches_serde_json_value() {
        let tools = r#"[{"type":"function","function":{"name":"f","b":[1,-2,3.5,1e300,true,null,"\u00e9\n"],"a":{"z":1,"y":{}}},"type":"dup"},[],{}]"#;
        let body = format!(
            r#"{{"model":"m","tools":{tools},"messages":[{{"role":"user","content":"x"}}]}}"#
        );
        let r = chat(&body).unwrap();
        let v: serde_json::Value = serde_json::from_str(tools).unwrap();
        let mut want = serde_json::to_vec(&v).unwrap();
        want.extend_from_slice(b"user\nx\n\n");
        assert_eq!(
            String::from_utf8(r.canonical).unwrap(),
            String::from_utf8(want).unwrap()
        );
        let e = chat(r#"{"model":"m","tools":{},"messages":[{"role":"user","content":"x"}]}"#)
            .unwrap_err();
        assert!(e.message.contains("tools"), "{}", e.message);
    }

    #[test]
    fn field_order_does_not_change_the_canonical_text() {
        let a = chat(r#"{"model":"m","messages":[{"role":"user","content":"hi","name":{"x":[1]}}],"tools":[{"a":1}]}"#).unwrap();
        let b = chat(r#"{"tools":[{"a":1}],"messages":[{"content":"hi","role":"user"}],"model":"m","extra":[1,{"k":"v"}]}"#).unwrap();
        assert_eq!(a.canonical, b.canonical);
        assert_eq!(a.canonical, b"[{\"a\":1}]user\nhi\n\n");
        let parts = chat(r#"{"model":"m","messages":[{"content":[{"text":"a","type":"text"},{"type":"image_url","text":5}],"role":"user"},{"role":"assistant"}]}"#).unwrap();
        assert_eq!(parts.canonical, b"user\na\n\nassistant\n\n\n");
        assert!(chat(r#"{"model":"m","messages":[{"content":"x"}]}"#)
            .unwrap_err()
            .message
            .contains("role"));
        assert!(
            chat(r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text"}]}]}"#)
                .unwrap_err()
                .message
                .contains("text")
        );
        assert!(
            chat(r#"{"model":"m","messages":[{"role":"user","content":[{"text":"a"}]}]}"#)
                .unwrap_err()
                .message
                .contains("type")
        );
        assert!(
            chat(r#"{"model":"m","model":"n","messages":[{"role":"user","content":"x"}]}"#)
                .unwrap_err()
                .message
                .contains("duplicate")
        );
    }

    #[test]
    fn limited_parse_keeps_a_prefix_and_counts_the_whole() {
        let body = br#"{"model":"m","prompt":"abcdefghij"}"#;
        let r = parse_limited(Endpoint::Completions, body, 4).unwrap();
        assert_eq!(
            (r.canonical.as_slice(), r.canonical_len),
            (&b"abcd"[..], 10)
        );
        let full = parse(Endpoint::Completions, body).unwrap();
        assert_eq!((full.canonical.len(), full.canonical_len), (10, 10));
        let chat_body = br#"{"model":"m","messages":[{"content":"abcdefgh","role":"u"},{"role":"v","content":"xy"}]}"#;
        let full = parse(Endpoint::ChatCompletions, chat_body).unwrap();
        for cap in 0..full.canonical.len() + 2 {
            let r = parse_limited(Endpoint::ChatCompletions, chat_body, cap).unwrap();
            assert_eq!(r.canonical_len, full.canonical.len());
            assert_eq!(r.canonical, full.canonical[..cap.min(full.canonical.len())]);
        }
    }

    #[test]
    fn long_token_prompts_parse_in_one_pass() {
        // 4M token ids: built as a Value tree this was ~128 MB; here it is the capped bytes.
        let mut body = br#"{"model":"m","prompt":["#.to_vec();
        for i in 0..4_000_000u32 {
            if i > 0 {
                body.push(b',');
            }
            body.push(b'0' + (i % 10) as u8);
        }
        body.extend_from_slice(b"]}");
        let r = parse_limited(Endpoint::Completions, &body, 1024).unwrap();
        assert_eq!((r.canonical.len(), r.canonical_len), (1024, 16_000_000));
        assert_eq!(&r.canonical[4..8], &1u32.to_le_bytes());
        let e = parse(Endpoint::Completions, br#"{"model":"m","prompt":[1,"a"]}"#).unwrap_err();
        assert!(e.message.contains("one kind"), "{}", e.message);
        let e = parse(
            Endpoint::Completions,
            br#"{"model":"m","prompt":[4294967296]}"#,
        )
        .unwrap_err();
        assert!(e.message.contains("0..2^32"), "{}", e.message);
        assert_eq!(e.param.as_deref(), Some("prompt[0]"));
    }
}
