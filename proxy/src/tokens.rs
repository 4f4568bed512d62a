//! Token mode: for the models configured in `[[tokenizers]]`, the digest chain is computed over
//! the token ids the engine itself computes (the model's chat template rendered and tokenized
//! with the model's own vocabulary, `kvmesh-tokenize`, the crate engine-shim uses), cut into the
//! engine's KV blocks. The digests then name the blocks the engine caches, so residency the
//! engine reports (kvagent's feed of engine-shim's blocks) and the proxy's own predictions
//! agree. The template is rendered from the messages' roles and text (as engine-shim does):
//! an engine that also renders `tools` or template arguments into the prompt gets other ids.
//! Models without a tokenizer keep text mode.
//!
//! Only the leading tokens routing compares are computed: the prompt is tokenized up to
//! `routing.max_prefix_blocks` blocks, in chunks of about 1 KiB (at most 4 KiB: a prompt with no
//! whitespace for that long is hashed up to there) whose token ids are cached per model and
//! tenant (at most 2M ids, 8 MiB), so a prefix seen before (a system prompt, a shared
//! document) is not tokenized again ([`ModelTokenizer::encode_prefix`]).

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use kvmesh_filters::chain::{token_chain, Digest, Namespace};
use kvmesh_filters::request::Endpoint;
use kvmesh_tokenize::gguf::Gguf;
use kvmesh_tokenize::{ModelTokenizer, PrefixCache};
use serde::de::{self, Deserializer as _, IgnoredAny, SeqAccess, Visitor};
use serde_json::value::RawValue;

use crate::config::TokenizerConfig;

/// The token-mode chain of one request.
#[derive(Debug)]
pub struct TokenChain {
    /// Digests of the leading full blocks of the prompt's tokens.
    pub chain: Vec<Digest>,
    /// The prompt as the engine sees it (the rendered template, or the prompt), bytes.
    pub total_bytes: usize,
    /// Bytes of prompt text one block stood for, measured on the tokenized prefix (at least 1).
    pub block_bytes: usize,
}

/// Why a request of a token-mode model got no token chain (it is then routed on load alone,
/// and counted by reason in `kvmesh_token_mode_fallbacks_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// The body is not the JSON object it was parsed as (the parser accepted it, this reading
    /// did not: a body the engine will refuse too).
    Body,
    /// The messages do not render with the model's chat template (the engine refuses them too).
    Template,
    /// The prompt is not a string or a list of token ids.
    Prompt,
    /// The tokenizer failed.
    Tokenizer,
}

impl Fallback {
    /// Every reason, for the metric's labels.
    pub const ALL: [Fallback; 4] = [
        Fallback::Body,
        Fallback::Template,
        Fallback::Prompt,
        Fallback::Tokenizer,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Fallback::Body => "body",
            Fallback::Template => "template",
            Fallback::Prompt => "prompt",
            Fallback::Tokenizer => "tokenizer",
        }
    }
}

/// Bytes of prompt per cached chunk of token ids.
const CHUNK_BYTES: usize = 1024;
/// Most token ids cached per model (8 MiB of ids, about 8 MiB of English prompt).
const MAX_CACHED_IDS: usize = 2 << 20;

/// One model's tokenizer and KV block size.
struct ModelTokens {
    tokenizer: ModelTokenizer,
    block_tokens: usize,
    /// Token ids of recent prompt chunks: a prefix seen before is not tokenized again.
    cache: PrefixCache,
}

/// Token-mode prompts whose body is at most this long are tokenized where the request is
/// handled; longer ones on a blocking thread ([`TokenModes::chain_off_worker`]). Tokenizing
/// new text takes about 0.25 ms a KiB, so this bounds what one request holds up its runtime
/// worker by to about a millisecond, where a hand-off to another thread would cost about as
/// much as the work.
pub const INLINE_TOKENIZE_BYTES: usize = 4096;

/// The token-mode models, read at start.
#[derive(Clone)]
pub struct TokenModes {
    models: Arc<HashMap<String, ModelTokens>>,
    /// Requests whose routing runs off the runtime's workers at once
    /// ([`TokenModes::run_off_worker`]): as many as the proxy has workers, as many as ran at
    /// once when routing ran on them. More would not finish sooner on the same cores (measured
    /// with two per worker: 8 one-worker sidecars on 2 cores took 38.8 ms a prompt in one run
    /// of two, against 18.9), and a burst queues here rather than in as many threads.
    slots: Arc<tokio::sync::Semaphore>,
}

impl Default for TokenModes {
    fn default() -> Self {
        TokenModes {
            models: Arc::default(),
            slots: Arc::new(tokio::sync::Semaphore::new(1)),
        }
    }
}

impl std::fmt::Debug for TokenModes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.models.keys()).finish()
    }
}

impl TokenModes {
    /// Reads every configured tokenizer (its GGUF's metadata; the weights are read and
    /// dropped), for a proxy of `workers` runtime workers. The error names the file and what
    /// is wrong with it.
    pub fn load(configs: &[TokenizerConfig], workers: usize) -> Result<Self, String> {
        let mut models = HashMap::new();
        for c in configs {
            let path = Path::new(&c.gguf);
            let g = Gguf::open(path).map_err(|e| format!("tokenizer of `{}`: {e}", c.model))?;
            let tokenizer = ModelTokenizer::from_gguf(&g)
                .map_err(|e| format!("tokenizer of `{}` ({}): {e}", c.model, path.display()))?;
            models.insert(
                c.model.clone(),
                ModelTokens {
                    tokenizer,
                    block_tokens: c.block_tokens,
                    cache: PrefixCache::new(CHUNK_BYTES, MAX_CACHED_IDS),
                },
            );
        }
        Ok(TokenModes {
            models: Arc::new(models),
            slots: Arc::new(tokio::sync::Semaphore::new(workers.max(1))),
        })
    }

    /// Runs `work` (routing a request: parsing, tokenizing) on a blocking thread once one of
    /// the proxy's slots is free, so that the runtime worker that handles the request keeps
    /// serving its other requests and streams meanwhile; `None` when `work` panicked.
    pub async fn run_off_worker<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Option<T> {
        // The semaphore is never closed. The permit goes with the work, so that a caller that
        // stops waiting does not free a slot while the work still runs.
        let slot = self.slots.clone().acquire_owned().await.ok();
        tokio::task::spawn_blocking(move || {
            let _slot = slot;
            work()
        })
        .await
        .ok()
    }

    /// `model`'s KV block size, tokens, when it is in token mode (`None`: text mode).
    pub fn block_tokens(&self, model: &str) -> Option<usize> {
        self.models.get(model).map(|m| m.block_tokens)
    }

    /// [`Self::chain`], and how long tokenizing took (zero when it panicked; the wait for a
    /// slot is not counted); on a blocking thread when the body is
    /// longer than [`INLINE_TOKENIZE_BYTES`], so that the runtime worker that handles the
    /// request keeps serving its other requests meanwhile (a sidecar runs one worker, and a
    /// 32 KB prompt took it 8-45 ms). A tokenizer that panics fails only this request's chain.
    pub async fn chain_off_worker(
        &self,
        model: &str,
        endpoint: Endpoint,
        body: &bytes::Bytes,
        ns: &Namespace,
        max_blocks: usize,
    ) -> (Result<TokenChain, Fallback>, std::time::Duration) {
        if body.len() <= INLINE_TOKENIZE_BYTES {
            return self.chain_timed(model, endpoint, body, ns, max_blocks);
        }
        let (modes, model, body, ns) = (self.clone(), model.to_string(), body.clone(), ns.clone());
        self.run_off_worker(move || modes.chain_timed(&model, endpoint, &body, &ns, max_blocks))
            .await
            .unwrap_or((Err(Fallback::Tokenizer), std::time::Duration::ZERO))
    }

    /// [`Self::chain`] where it is called, and how long it took.
    pub fn chain_timed(
        &self,
        model: &str,
        endpoint: Endpoint,
        body: &[u8],
        ns: &Namespace,
        max_blocks: usize,
    ) -> (Result<TokenChain, Fallback>, std::time::Duration) {
        let started = std::time::Instant::now();
        let chain = self.chain(model, endpoint, body, ns, max_blocks);
        (chain, started.elapsed())
    }

    /// The token chain of a request body for `model` (which must be covered), at most
    /// `max_blocks` blocks, in namespace `ns`.
    pub fn chain(
        &self,
        model: &str,
        endpoint: Endpoint,
        body: &[u8],
        ns: &Namespace,
        max_blocks: usize,
    ) -> Result<TokenChain, Fallback> {
        let m = self.models.get(model).ok_or(Fallback::Tokenizer)?;
        let want = max_blocks.saturating_mul(m.block_tokens);
        let read: TokenFields = serde_json::from_slice(body).map_err(|_| Fallback::Body)?;
        let tokens_and_bytes = match endpoint {
            Endpoint::ChatCompletions => {
                let turns = read.messages.map(turns).ok_or(Fallback::Template)??;
                let text = m
                    .tokenizer
                    .render_chat(&turns)
                    .map_err(|_| Fallback::Template)?;
                (m.encode(&text, want, ns)?, text.len())
            }
            Endpoint::Completions => {
                let raw = read.prompt.ok_or(Fallback::Prompt)?;
                match raw.get().as_bytes().first() {
                    Some(b'"') => {
                        let s: String =
                            serde_json::from_str(raw.get()).map_err(|_| Fallback::Prompt)?;
                        (m.encode(&s, want, ns)?, s.len())
                    }
                    // Token ids, as vLLM accepts them: the engine's tokens already.
                    Some(b'[') => {
                        let ids = serde_json::Deserializer::from_str(raw.get())
                            .deserialize_seq(LeadingIds { want })
                            .map_err(|_| Fallback::Prompt)?;
                        if ids.total == 0 {
                            return Err(Fallback::Prompt);
                        }
                        // Four bytes of text per token: the scale text mode would see.
                        let bytes = ids.kept.len() * 4;
                        ((ids.kept, bytes), ids.total.saturating_mul(4))
                    }
                    _ => return Err(Fallback::Prompt),
                }
            }
            // Embeddings reuse no KV cache; the caller keeps them in text mode.
            Endpoint::Embeddings => return Err(Fallback::Prompt),
        };
        let ((tokens, bytes), total_bytes) = tokens_and_bytes;
        let kept = &tokens[..tokens.len().min(want)];
        let block_bytes = (bytes.saturating_mul(m.block_tokens) / tokens.len().max(1)).max(1);
        Ok(TokenChain {
            chain: token_chain(ns, kept, m.block_tokens),
            total_bytes,
            block_bytes,
        })
    }
}

/// The members of a request body token mode reads, each kept as its raw JSON text: the other
/// members are skipped as they are read, and these are read below element by element, so no
/// tree of the body is built (the streaming parser that checked the body built none either;
/// a `serde_json::Value` of a 32 MiB `[0,0,...]` would take about 0.5 GB).
#[derive(serde::Deserialize)]
struct TokenFields<'a> {
    #[serde(borrow, default)]
    messages: Option<&'a RawValue>,
    #[serde(borrow, default)]
    prompt: Option<&'a RawValue>,
}

/// A message's members the chat template sees.
#[derive(serde::Deserialize)]
struct MessageFields<'a> {
    #[serde(borrow, default)]
    role: Option<&'a RawValue>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
}

/// A content part's members that carry text.
#[derive(serde::Deserialize)]
struct PartFields<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<&'a RawValue>,
    #[serde(borrow, default)]
    text: Option<&'a RawValue>,
}

/// `raw` as a string, if it is one.
fn string_of(raw: &RawValue) -> Option<Cow<'_, str>> {
    serde_json::from_str(raw.get()).ok()
}

/// The `(role, content)` turns of `messages`, as [`kvmesh_tokenize::chat::turns`] reads them
/// from a tree: a non-empty array of messages, each with a string role and a content that is a
/// string, null (or absent), or an array whose `text` parts are joined; other parts and members
/// are skipped.
fn turns(messages: &RawValue) -> Result<Vec<(String, String)>, Fallback> {
    let turns = serde_json::Deserializer::from_str(messages.get())
        .deserialize_seq(Turns)
        .map_err(|_| Fallback::Template)?;
    if turns.is_empty() {
        return Err(Fallback::Template);
    }
    Ok(turns)
}

/// Reads `messages` one message at a time ([`turns`]).
struct Turns;

impl<'de> Visitor<'de> for Turns {
    type Value = Vec<(String, String)>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an array of messages")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Self::Value, A::Error> {
        let bad = |what: &str| de::Error::custom(what);
        let mut out = Vec::new();
        while let Some(m) = a.next_element::<MessageFields<'de>>()? {
            let role = m.role.and_then(string_of).ok_or_else(|| bad("role"))?;
            let content = match m.content {
                None => String::new(),
                Some(raw) => match raw.get().as_bytes().first() {
                    Some(b'"') => string_of(raw).ok_or_else(|| bad("content"))?.into_owned(),
                    Some(b'n') => String::new(),
                    Some(b'[') => serde_json::Deserializer::from_str(raw.get())
                        .deserialize_seq(TextParts)
                        .map_err(|_| bad("content"))?,
                    _ => return Err(bad("content")),
                },
            };
            out.push((role.into_owned(), content));
        }
        Ok(out)
    }
}

/// Joins the `text` parts of a content array, one part at a time.
struct TextParts;

impl<'de> Visitor<'de> for TextParts {
    type Value = String;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an array of content parts")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<String, A::Error> {
        let mut text = String::new();
        while let Some(raw) = a.next_element::<&'de RawValue>()? {
            if !raw.get().starts_with('{') {
                continue;
            }
            let p: PartFields<'_> = serde_json::from_str(raw.get()).map_err(de::Error::custom)?;
            if p.kind.and_then(string_of).as_deref() == Some("text") {
                if let Some(t) = p.text.and_then(string_of) {
                    text.push_str(&t);
                }
            }
        }
        Ok(text)
    }
}

/// A prompt of token ids: the first `want` kept (each a u32), the rest counted, not kept.
struct LeadingIds {
    want: usize,
}

/// What [`LeadingIds`] read.
struct Ids {
    kept: Vec<u32>,
    total: usize,
}

impl<'de> Visitor<'de> for LeadingIds {
    type Value = Ids;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an array of token ids")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Ids, A::Error> {
        let mut ids = Ids {
            kept: Vec::new(),
            total: 0,
        };
        loop {
            let more = if ids.kept.len() < self.want {
                a.next_element::<u32>()?.map(|t| ids.kept.push(t)).is_some()
            } else {
                a.next_element::<IgnoredAny>()?.is_some()
            };
            if !more {
                return Ok(ids);
            }
            ids.total += 1;
        }
    }
}

impl ModelTokens {
    /// The first `want` tokens of `text` or more (fewer where the text has no boundary to
    /// cut at, see [`ModelTokenizer::encode_prefix`]), and the bytes of text they came from;
    /// cached within `ns` (a tenant's chunks are not another's).
    fn encode(
        &self,
        text: &str,
        want: usize,
        ns: &Namespace,
    ) -> Result<(Vec<u32>, usize), Fallback> {
        self.tokenizer
            .encode_prefix(text, want, &self.cache, ns.key())
            .map_err(|_| Fallback::Tokenizer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    /// The turns read member by member are those the tree reading gives (the one the engines'
    /// side uses), for every shape a message can take; what the tree reading refuses is
    /// refused.
    #[test]
    fn turns_read_without_a_tree_are_the_trees_turns() {
        let good = json!([
            {"role": "system", "content": "be brief, \"quoted\" é ✓ \n", "name": "x"},
            {"role": "user", "content": [
                {"type": "text", "text": "a"},
                {"type": "image_url", "image_url": {"url": "x"}},
                7, "loose", null,
                {"type": "text", "text": "b", "extra": [0, 0, 0]},
                {"type": 3, "text": "no"},
                {"type": "text", "text": 4}
            ]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "t"}]},
            {"role": "user"}
        ]);
        let raw = serde_json::to_string(&good).unwrap();
        let raw: &RawValue = serde_json::from_str(&raw).unwrap();
        let want = kvmesh_tokenize::chat::turns(Some(&good)).unwrap();
        assert_eq!(turns(raw).unwrap(), want);
        assert_eq!(want[1].1, "ab");
        for bad in [
            json!([]),
            json!("text"),
            json!({"role": "user"}),
            json!([{"content": "no role"}]),
            json!([{"role": 1, "content": "x"}]),
            json!([{"role": "user", "content": 5}]),
            json!([{"role": "user", "content": {"text": "x"}}]),
            json!(["not a message"]),
        ] {
            assert!(kvmesh_tokenize::chat::turns(Some(&bad)).is_err(), "{bad}");
            let text = serde_json::to_string(&bad).unwrap();
            let raw: &RawValue = serde_json::from_str(&text).unwrap();
            assert_eq!(turns(raw), Err(Fallback::Template), "{bad}");
        }
    }

    /// Token ids: the first `want` kept and checked, the rest only counted.
    #[test]
    fn leading_ids_keep_want_and_count_the_rest() {
        let read = |text: &str, want| {
            serde_json::Deserializer::from_str(text)
                .deserialize_seq(LeadingIds { want })
                .map(|ids| (ids.kept, ids.total))
                .ok()
        };
        assert_eq!(read("[1, 2, 3, 4]", 2), Some((vec![1, 2], 4)));
        assert_eq!(read("[1, 2, \"x\", {}]", 2), Some((vec![1, 2], 4)));
        assert_eq!(read("[1, -2]", 2), None);
        assert_eq!(read("[4294967296]", 2), None);
        assert_eq!(read("[]", 2), Some((vec![], 0)));
        let body: Value = json!({"prompt": [1, 2], "pad": [0, 0, [0, {"a": 0}]]});
        let text = serde_json::to_vec(&body).unwrap();
        let fields: TokenFields<'_> = serde_json::from_slice(&text).unwrap();
        assert_eq!(fields.prompt.map(RawValue::get), Some("[1,2]"));
        assert!(fields.messages.is_none());
    }
}
