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

    /// Bytes that may still be kept.
    fn room(&self) -> usize {
        self.cap.saturating_sub(self.kept.len())
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
    tools: Option<Canon>,
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
        let mut tools: Option<Option<Canon>> = None;
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
                Key::Tools if chat => set_once(
                    &mut tools,
                    map.next_value_seed(Tools { cap: self.cap })?,
                    "tools",
                )?,
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

/// Deepest nesting of arrays and objects accepted in `tools`, the `tools` array itself
/// counting as level 1. Deeper values are refused (400): real tool schemas nest a few levels.
pub const MAX_TOOLS_DEPTH: usize = 32;

/// Most bytes of `tools` written as compact JSON (keys in input order, duplicates included);
/// larger `tools` are refused (400): it bounds the canonicaliser's buffer and bookkeeping,
/// which the body budget does not see. Real tool lists are a few KiB to a few hundred KiB.
pub const MAX_TOOLS_BYTES: usize = 1 << 20;

/// Most entries of one object inside `tools`; objects with more are refused (400).
pub const MAX_TOOLS_ENTRIES: usize = 4096;

/// `tools`: null, or an array, canonicalised as compact JSON with sorted object keys (exactly
/// what `serde_json::to_vec(&Value)` writes, later duplicate keys replacing earlier ones), of
/// which the first `cap` bytes are kept and all are counted.
///
/// Linear work whatever the nesting: each top-level element is written once, in input order,
/// into one buffer ([`ToolsArena`]); an object whose keys are not already in order records where
/// its entries lie, and the element is then emitted once in canonical order, only as far as the
/// cap. Once the cap is reached, elements are still validated and counted but no bytes are kept.
struct Tools {
    cap: usize,
}

impl<'de> DeserializeSeed<'de> for Tools {
    type Value = Option<Canon>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Tools {
    type Value = Option<Canon>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array of tools")
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out = Canon::new(self.cap);
        let mut arena = ToolsArena::default();
        out.push(b"[");
        let mut first = true;
        loop {
            arena.reset(out.room() > 0);
            let element = JsonValue {
                arena: &mut arena,
                depth: 2,
            };
            let Some(len) = seq.next_element_seed(element)? else {
                break;
            };
            if !first {
                out.push(b",");
            }
            first = false;
            arena.emit(&mut out, len);
        }
        out.push(b"]");
        Ok(Some(out))
    }
}

// Bytes written or copied while canonicalising `tools`, per thread (tests check the work is
// linear in the input).
#[cfg(test)]
thread_local! {
    static TOOLS_WORK: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

fn count_work(_n: usize) {
    #[cfg(test)]
    TOOLS_WORK.with(|w| w.set(w.get() + _n));
}

/// An object of a `tools` element whose entries must be reordered (keys out of order, or
/// duplicated): where it lies in [`ToolsArena::raw`], and its surviving entries in canonical
/// order (a range of [`ToolsArena::sorted`]).
struct Reordered {
    start: usize,
    end: usize,
    entries: std::ops::Range<usize>,
}

/// An entry of an object still being read.
struct OpenEntry {
    /// The unescaped key, in [`ToolsArena::keys`].
    key: std::ops::Range<usize>,
    /// `"key":value` in [`ToolsArena::raw`].
    raw: std::ops::Range<usize>,
    /// Canonical length of `"key":value`.
    len: usize,
}

/// One top-level `tools` element, as compact JSON in input order plus what it takes to emit it
/// in canonical order.
#[derive(Default)]
struct ToolsArena {
    /// Keep `raw` (false once the cap is reached: lengths are still computed).
    store: bool,
    /// Compact JSON of the element, object keys in input order.
    raw: Vec<u8>,
    /// Unescaped keys of the objects being read (a stack).
    keys: Vec<u8>,
    /// Entries of the objects being read (a stack).
    open: Vec<OpenEntry>,
    /// Objects to reorder, in the order they closed.
    reordered: Vec<Reordered>,
    /// `raw` ranges of reordered objects' entries, in canonical order.
    sorted: Vec<std::ops::Range<usize>>,
    /// Scratch space for sorting an object's entries.
    order: Vec<usize>,
    /// Compact JSON bytes of the whole `tools` array so far (not reset between elements).
    total: usize,
    /// `total` passed [`MAX_TOOLS_BYTES`]: nothing more is stored, the parse fails.
    over: bool,
}

impl ToolsArena {
    fn reset(&mut self, store: bool) {
        self.store = store;
        self.raw.clear();
        self.keys.clear();
        self.open.clear();
        self.reordered.clear();
        self.sorted.clear();
    }

    fn pos(&self) -> usize {
        self.raw.len()
    }

    fn write(&mut self, b: &[u8]) -> usize {
        self.total = self.total.saturating_add(b.len());
        if self.total > MAX_TOOLS_BYTES {
            self.over = true;
        }
        if self.store && !self.over {
            count_work(b.len());
            self.raw.extend_from_slice(b);
        }
        b.len()
    }

    fn write_json<T: serde::Serialize + ?Sized, E: de::Error>(
        &mut self,
        v: &T,
    ) -> Result<usize, E> {
        let mut w = RawWriter {
            arena: self,
            written: 0,
        };
        let written = serde_json::to_writer(&mut w, v).map(|()| w.written);
        self.check()?;
        written.map_err(E::custom)
    }

    /// Takes back the comma just written before a container turned out to end.
    fn unwrite_comma(&mut self) {
        self.total = self.total.saturating_sub(1);
        if self.store && !self.over {
            self.raw.pop();
        }
    }

    /// Fails once `tools` has passed [`MAX_TOOLS_BYTES`].
    fn check<E: de::Error>(&self) -> Result<(), E> {
        if self.over {
            return Err(E::custom(format_args!(
                "`tools` is larger than {MAX_TOOLS_BYTES} bytes as compact JSON"
            )));
        }
        Ok(())
    }

    /// Appends the element's canonical form (`len` bytes) to `out`, keeping at most its room.
    fn emit(&mut self, out: &mut Canon, len: usize) {
        let room = out.room();
        if self.store && room > 0 {
            self.reordered.sort_unstable_by_key(|r| r.start);
            let mut e = Emitter {
                arena: self,
                out: &mut out.kept,
                room,
            };
            e.range(0, e.arena.raw.len());
        }
        out.len = out.len.saturating_add(len);
    }
}

/// `io::Write` into a [`ToolsArena`], counting what it is given.
struct RawWriter<'a> {
    arena: &'a mut ToolsArena,
    written: usize,
}

impl std::io::Write for RawWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.written += self.arena.write(buf);
        if self.arena.over {
            // Stop serialising a value past the cap.
            return Err(std::io::Error::other("`tools` too large"));
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Copies an element's `raw` bytes into the canonical output, reordered objects in key order,
/// until `room` is used up.
struct Emitter<'a> {
    arena: &'a ToolsArena,
    out: &'a mut Vec<u8>,
    room: usize,
}

impl Emitter<'_> {
    fn copy(&mut self, b: &[u8]) {
        let n = b.len().min(self.room);
        count_work(n);
        self.out.extend_from_slice(&b[..n]);
        self.room -= n;
    }

    /// Emits `raw[a..b]`, a sequence of whole values or entries.
    fn range(&mut self, a: usize, b: usize) {
        let a_ = self.arena;
        let mut pos = a;
        let mut next = a_.reordered.partition_point(|r| r.start < a);
        while pos < b && self.room > 0 {
            match a_.reordered.get(next).filter(|r| r.start < b) {
                Some(r) => {
                    self.copy(&a_.raw[pos..r.start]);
                    self.copy(b"{");
                    for (i, e) in a_.sorted[r.entries.clone()].iter().enumerate() {
                        if i > 0 {
                            self.copy(b",");
                        }
                        self.range(e.start, e.end);
                    }
                    self.copy(b"}");
                    pos = r.end;
                    next = a_.reordered.partition_point(|x| x.start < r.end);
                }
                None => {
                    self.copy(&a_.raw[pos..b]);
                    pos = b;
                }
            }
        }
    }
}

/// Any JSON value inside `tools`, at nesting level `depth`: written compactly into the arena;
/// the value is its canonical length.
struct JsonValue<'a> {
    arena: &'a mut ToolsArena,
    depth: usize,
}

impl<'de> DeserializeSeed<'de> for JsonValue<'_> {
    type Value = usize;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<usize, D::Error> {
        d.deserialize_any(self)
    }
}

fn too_deep<E: de::Error>() -> E {
    E::custom(format_args!(
        "`tools` nests arrays and objects deeper than {MAX_TOOLS_DEPTH} levels"
    ))
}

impl<'de> Visitor<'de> for JsonValue<'_> {
    type Value = usize;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<usize, E> {
        self.arena.write_json(&v)
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<usize, E> {
        self.arena.write_json(&v)
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<usize, E> {
        self.arena.write_json(&v)
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<usize, E> {
        self.arena.write_json(&v)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<usize, E> {
        self.arena.write_json(v)
    }
    fn visit_unit<E: de::Error>(self) -> Result<usize, E> {
        let n = self.arena.write(b"null");
        self.arena.check()?;
        Ok(n)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<usize, A::Error> {
        if self.depth > MAX_TOOLS_DEPTH {
            return Err(too_deep());
        }
        let arena = self.arena;
        let mut len = arena.write(b"[");
        let mut first = true;
        loop {
            let comma = if first { 0 } else { arena.write(b",") };
            let item = JsonValue {
                arena: &mut *arena,
                depth: self.depth + 1,
            };
            match seq.next_element_seed(item)? {
                Some(n) => len += comma + n,
                None => {
                    if comma > 0 {
                        arena.unwrite_comma();
                    }
                    break;
                }
            }
            first = false;
            arena.check()?;
        }
        let len = len + arena.write(b"]");
        arena.check()?;
        Ok(len)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<usize, A::Error> {
        if self.depth > MAX_TOOLS_DEPTH {
            return Err(too_deep());
        }
        let arena = self.arena;
        let start = arena.pos();
        arena.write(b"{");
        let key_base = arena.keys.len();
        let open_base = arena.open.len();
        loop {
            arena.check()?;
            if arena.open.len() > open_base {
                arena.write(b",");
            }
            let entry_start = arena.pos();
            let key_start = arena.keys.len();
            let Some(key_len) = map.next_key_seed(KeyInto(&mut *arena))? else {
                if arena.open.len() > open_base {
                    arena.unwrite_comma();
                }
                break;
            };
            if arena.open.len() - open_base >= MAX_TOOLS_ENTRIES {
                return Err(de::Error::custom(format_args!(
                    "`tools` has an object with more than {MAX_TOOLS_ENTRIES} entries"
                )));
            }
            let key = key_start..arena.keys.len();
            arena.write(b":");
            let value = JsonValue {
                arena: &mut *arena,
                depth: self.depth + 1,
            };
            let value_len = map.next_value_seed(value)?;
            let raw = entry_start..arena.pos();
            arena.open.push(OpenEntry {
                key,
                raw,
                len: key_len + 1 + value_len,
            });
        }
        arena.write(b"}");
        arena.check()?;
        let end = arena.pos();
        let keys = &arena.keys;
        let entries = &arena.open[open_base..];
        let key = |e: &OpenEntry| &keys[e.key.clone()];
        let in_order = entries.windows(2).all(|w| key(&w[0]) < key(&w[1]));
        let mut len = 2;
        if in_order {
            len += entries.iter().map(|e| e.len).sum::<usize>() + entries.len().saturating_sub(1);
        } else {
            let mut order = std::mem::take(&mut arena.order);
            order.clear();
            order.extend(0..entries.len());
            // Stable: among equal keys the last one, which replaces the others, stays last.
            order.sort_by(|&i, &j| key(&entries[i]).cmp(key(&entries[j])));
            let sorted_base = arena.sorted.len();
            let mut kept = 0;
            for (n, &i) in order.iter().enumerate() {
                let replaced = order
                    .get(n + 1)
                    .is_some_and(|&j| key(&entries[j]) == key(&entries[i]));
                if replaced {
                    continue;
                }
                len += entries[i].len;
                kept += 1;
                if arena.store {
                    arena.sorted.push(entries[i].raw.clone());
                }
            }
            len += kept - 1;
            arena.order = order;
            if arena.store {
                arena.reordered.push(Reordered {
                    start,
                    end,
                    entries: sorted_base..arena.sorted.len(),
                });
            }
        }
        arena.open.truncate(open_base);
        arena.keys.truncate(key_base);
        Ok(len)
    }
}

/// An object key inside `tools`: its unescaped bytes go to the arena's key stack (for ordering),
/// its JSON form to `raw`; the value is the length of that JSON form.
struct KeyInto<'a>(&'a mut ToolsArena);

impl<'de> DeserializeSeed<'de> for KeyInto<'_> {
    type Value = usize;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<usize, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeyInto<'_> {
    type Value = usize;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object key")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<usize, E> {
        // Written (and checked against the cap) before the key is kept.
        let n = self.0.write_json(v)?;
        self.0.keys.extend_from_slice(v.as_bytes());
        Ok(n)
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

/// Largest body that, when invalid, is parsed a second time with path tracking to name the
/// field at fault; a larger one is refused with the first pass's message (line and column).
pub const MAX_PATH_TRACKED_BODY: usize = 1 << 20;

/// Runs the body visitor over `body`; on failure of a body of at most
/// [`MAX_PATH_TRACKED_BODY`] bytes, again with path tracking to name the field.
fn deserialize(seed: Body, body: &[u8]) -> Result<Fields, ApiError> {
    if body.is_empty() {
        return Err(invalid("request body is empty; expected a JSON object"));
    }
    // Fast path without path tracking.
    let mut de = serde_json::Deserializer::from_slice(body);
    let first = match seed.deserialize(&mut de) {
        Ok(fields) => {
            return de
                .end()
                .map(|()| fields)
                .map_err(|e| invalid(format!("invalid JSON body: trailing characters: {e}")));
        }
        Err(e) => e,
    };
    if body.len() > MAX_PATH_TRACKED_BODY {
        let what = if first.is_syntax() || first.is_eof() {
            "invalid JSON body"
        } else {
            "invalid request body"
        };
        return Err(invalid(format!("{what}: {first}")));
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
    if let Some(tools) = f.tools {
        canonical.append(tools);
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

    fn tools_body(tools: &str, content: &str) -> String {
        format!(
            r#"{{"model":"m","tools":{tools},"messages":[{{"role":"user","content":{}}}]}}"#,
            serde_json::to_string(content).unwrap()
        )
    }

    /// The canonical bytes `serde_json::to_vec(&Value)` gives `tools`, then the user message.
    fn want_canonical(tools: &str, content: &str) -> Vec<u8> {
        let v: serde_json::Value = serde_json::from_str(tools).unwrap();
        let mut want = serde_json::to_vec(&v).unwrap();
        want.extend_from_slice(format!("user\n{content}\n\n").as_bytes());
        want
    }

    #[test]
    fn canonical_bytes_of_ordinary_tools_are_unchanged() {
        let tools = r#"[{"type":"function","function":{"name":"get_weather","description":"Weather at a place","parameters":{"type":"object","properties":{"location":{"type":"string","description":"City, e.g. \"Paris\""},"unit":{"type":"string","enum":["celsius","fahrenheit"]}},"required":["location"],"additionalProperties":false},"strict":true}}]"#;
        let r = chat(&tools_body(tools, "hi")).unwrap();
        // The bytes the previous (Value-tree) canonicalisation wrote, spelt out.
        let golden = r#"[{"function":{"description":"Weather at a place","name":"get_weather","parameters":{"additionalProperties":false,"properties":{"location":{"description":"City, e.g. \"Paris\"","type":"string"},"unit":{"enum":["celsius","fahrenheit"],"type":"string"}},"required":["location"],"type":"object"},"strict":true},"type":"function"}]user
hi

"#;
        assert_eq!(String::from_utf8(r.canonical.clone()).unwrap(), golden);
        assert_eq!(r.canonical, want_canonical(tools, "hi"));
        // Orderings a byte-wise comparison of escaped keys would get wrong, duplicates inside
        // reordered and in-order objects, nesting under single-entry objects, empty values.
        for tools in [
            r#"[{"A":1,"\n":2,"é":3,"z":[{"y":1,"x":2}]}]"#,
            r#"[{"a":{"x":1,"x":{"q":2,"p":1}},"b":[{"d":1,"c":2},[],{}]}]"#,
            r#"[{"only":{"only":{"b":1,"a":[{"d":null,"c":true}]}}}, {"k":"v"}, [1,2.5,-3]]"#,
            r#"[{"b":1,"a":2,"b":3,"a":{"z":0,"y":0}}]"#,
            r#"[]"#,
            r#"[{}]"#,
        ] {
            let r = chat(&tools_body(tools, "x")).unwrap();
            let want = want_canonical(tools, "x");
            assert_eq!(
                String::from_utf8_lossy(&r.canonical),
                String::from_utf8_lossy(&want),
                "{tools}"
            );
            assert_eq!(r.canonical_len, want.len(), "{tools}");
            // A capped parse keeps exactly a prefix of the same bytes.
            for cap in 0..want.len() + 2 {
                let c = parse_limited(
                    Endpoint::ChatCompletions,
                    tools_body(tools, "x").as_bytes(),
                    cap,
                )
                .unwrap();
                assert_eq!(
                    c.canonical,
                    want[..cap.min(want.len())],
                    "{tools} cap {cap}"
                );
                assert_eq!(c.canonical_len, want.len(), "{tools} cap {cap}");
            }
        }
    }

    /// `levels` objects nested in one another, keys out of order at every level, each level
    /// with `pad` bytes of string of its own.
    fn nested_tools(levels: usize, pad: usize) -> String {
        let filler = "p".repeat(pad);
        let mut t = String::from("0");
        for _ in 0..levels {
            t = format!(r#"{{"z":"{filler}","a":{t}}}"#);
        }
        format!("[{t}]")
    }

    #[test]
    fn deeply_nested_tools_are_refused_naming_tools() {
        // The `tools` array is level 1: 31 objects inside it reach the limit, 32 pass it.
        let ok = nested_tools(MAX_TOOLS_DEPTH - 1, 8);
        let r = chat(&tools_body(&ok, "x")).unwrap();
        assert_eq!(r.canonical, want_canonical(&ok, "x"));
        for levels in [MAX_TOOLS_DEPTH, 120] {
            let deep = nested_tools(levels, 8);
            let e = chat(&tools_body(&deep, "x")).unwrap_err();
            assert_eq!(e.status(), 400);
            assert!(e.message.contains("`tools`"), "{}", e.message);
            assert!(e.message.contains("deeper than 32"), "{}", e.message);
            assert!(e.param.as_deref().is_some_and(|p| p.starts_with("tools")));
            // Arrays count as well as objects.
            let arrays = format!("{}{}", "[".repeat(levels + 1), "]".repeat(levels + 1));
            let e = chat(&tools_body(&arrays, "x")).unwrap_err();
            assert!(e.message.contains("deeper than 32"), "{}", e.message);
        }
        // A large invalid body is refused from the first pass, still naming `tools`.
        let deep = nested_tools(120, 8);
        let big = tools_body(&deep, &"y".repeat(MAX_PATH_TRACKED_BODY));
        let e = chat(&big).unwrap_err();
        assert_eq!(e.status(), 400);
        assert!(e.message.contains("`tools`"), "{}", e.message);
        let fine = tools_body(&nested_tools(3, 8), &"y".repeat(MAX_PATH_TRACKED_BODY));
        let e = chat(&format!("{fine} trailing")).unwrap_err();
        assert!(e.message.contains("trailing"), "{}", e.message);
        let bad = format!(
            r#"{{"model":"m","x":"{}","messages":5}}"#,
            "y".repeat(MAX_PATH_TRACKED_BODY)
        );
        let e = chat(&bad).unwrap_err();
        assert!(e.message.contains("invalid type"), "{}", e.message);
    }

    #[test]
    fn nested_tools_cost_work_linear_in_their_size() {
        // 31 levels, every one out of order: copying each level into its parent (the previous
        // canonicaliser) wrote ~16x the input; one buffer and one ordered emission write ~2x.
        let tools = nested_tools(MAX_TOOLS_DEPTH - 1, 4096);
        let body = tools_body(&tools, "x");
        TOOLS_WORK.with(|w| w.set(0));
        let r = chat(&body).unwrap();
        let work = TOOLS_WORK.with(|w| w.get());
        assert_eq!(r.canonical, want_canonical(&tools, "x"));
        assert!(
            work <= 2 * tools.len() + 64,
            "{work} bytes of work for {} bytes of tools",
            tools.len()
        );
        // Under a cap, what is emitted stops at the cap.
        TOOLS_WORK.with(|w| w.set(0));
        let r = parse_limited(Endpoint::ChatCompletions, body.as_bytes(), 1000).unwrap();
        let work = TOOLS_WORK.with(|w| w.get());
        assert_eq!(r.canonical.len(), 1000);
        assert!(work <= tools.len() + 1000 + 64, "{work}");
        // Past the cap, later elements are validated and counted, not kept.
        let two = format!(
            "[{},{}]",
            &tools[1..tools.len() - 1],
            &tools[1..tools.len() - 1]
        );
        TOOLS_WORK.with(|w| w.set(0));
        let r = parse_limited(
            Endpoint::ChatCompletions,
            tools_body(&two, "x").as_bytes(),
            1000,
        )
        .unwrap();
        let work = TOOLS_WORK.with(|w| w.get());
        assert_eq!(r.canonical_len, want_canonical(&two, "x").len());
        assert!(work <= tools.len() + 1000 + 64, "{work}");
    }

    #[test]
    fn tools_with_too_many_entries_are_refused_naming_tools() {
        let object = |n: usize| {
            let entries: Vec<String> = (0..n).map(|i| format!("\"k{i:05}\":0")).collect();
            format!("[{{{}}}]", entries.join(","))
        };
        let ok = object(MAX_TOOLS_ENTRIES);
        let r = chat(&tools_body(&ok, "x")).unwrap();
        assert_eq!(r.canonical, want_canonical(&ok, "x"));
        let e = chat(&tools_body(&object(MAX_TOOLS_ENTRIES + 1), "x")).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidRequest);
        assert!(e.message.contains("`tools`"), "{}", e.message);
        assert!(e.message.contains("entries"), "{}", e.message);
        // Duplicated keys count too: `{"a":0,"a":0,...}` canonicalises to `{"a":0}`, but each
        // entry costs bookkeeping while it is read.
        let dup = format!("[{{{}}}]", vec!["\"a\":0"; MAX_TOOLS_ENTRIES + 1].join(","));
        let e = chat(&tools_body(&dup, "x")).unwrap_err();
        assert!(e.message.contains("`tools`"), "{}", e.message);
    }

    #[test]
    fn oversize_tools_are_refused_naming_tools() {
        // Many small out-of-order objects, within the entry cap but past the size cap.
        let one = r#"{"b":1,"a":[2,3]}"#;
        let n = MAX_TOOLS_BYTES / one.len() + 1;
        let many = format!("[{}]", vec![one; n].join(","));
        let e = chat(&tools_body(&many, "x")).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidRequest);
        assert!(e.message.contains("`tools`"), "{}", e.message);
        assert!(e.message.contains("larger than"), "{}", e.message);
        // One element (a single string) larger than the cap: refused as well, and its bytes are
        // not copied past the cap.
        let big = format!(
            "[{{\"description\":\"{}\"}}]",
            "d".repeat(4 * MAX_TOOLS_BYTES)
        );
        TOOLS_WORK.with(|w| w.set(0));
        let e = chat(&tools_body(&big, "x")).unwrap_err();
        let work = TOOLS_WORK.with(|w| w.get());
        assert!(e.message.contains("`tools`"), "{}", e.message);
        assert!(work <= MAX_TOOLS_BYTES + 64, "{work} bytes copied");
        // Just under the cap is fine, and canonical.
        let fits = format!(
            "[{}]",
            vec![one; MAX_TOOLS_BYTES / (one.len() + 1) - 1].join(",")
        );
        let r = chat(&tools_body(&fits, "x")).unwrap();
        assert_eq!(r.canonical, want_canonical(&fits, "x"));
    }
}
