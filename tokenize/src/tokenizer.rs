//! The model's tokenizer and chat template, built from GGUF metadata (nothing hard-coded): the
//! BPE vocabulary and merges with the `tokenizers` crate, control tokens as special tokens, and
//! the Jinja chat template (`tokenizer.chat_template`), compiled once and rendered with minijinja.

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, Tokenizer};

use std::sync::Arc;

use kvmesh_gguf::{Gguf, GgufError, Value};
use lru::LruCache;
use parking_lot::Mutex;

/// Why tokenizing or templating failed.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// The GGUF metadata is missing something.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// The tokenizer kind or pre-tokenizer is not one this engine implements.
    #[error("unsupported tokenizer: {0}")]
    Unsupported(String),
    /// The vocabulary in the metadata is out of bounds or inconsistent.
    #[error("tokenizer metadata: {0}")]
    Vocabulary(String),
    /// The tokenizers crate failed.
    #[error("tokenizer: {0}")]
    Tokenizers(String),
    /// The chat template failed to compile or render.
    #[error("chat template: {0}")]
    Template(String),
}

/// The state of one sequence's text as its ids come ([`ModelTokenizer::decode_step`]): the ids
/// since the last piece's start and that piece's text.
#[derive(Debug, Default)]
pub struct TextStream {
    ids: Vec<u32>,
    prefix: String,
    prefix_index: usize,
}

/// ggml token type of control tokens (`<|im_start|>` and the like).
const CONTROL: i64 = 3;

/// A model's tokenizer plus its chat template and special ids.
pub struct ModelTokenizer {
    tokenizer: Tokenizer,
    /// The compiled chat template, or why there is none (no template, or one that does not
    /// compile: reported when a chat is rendered, as completions need no template).
    chat: Result<minijinja::Environment<'static>, String>,
    /// Beginning-of-sequence id.
    pub bos: u32,
    /// End-of-sequence id (generation stops on it).
    pub eos: u32,
    bos_text: String,
    eos_text: String,
    /// Whether BOS is prepended to prompts.
    pub add_bos: bool,
    /// Most bytes of text one token can stand for (at least 1).
    max_token_bytes: usize,
    /// No special token's text holds whitespace, so [`ModelTokenizer::encode_prefix`] may cut
    /// the text before a space (see there).
    prefix_safe: bool,
}

/// The name of the chat template in the environment.
const CHAT: &str = "chat";

/// Template instructions one chat rendering may run (minijinja's fuel). A chat template runs
/// a few dozen per message, so this allows conversations of hundreds of thousands of
/// messages, while a template that loops without end (it comes from a model file) fails
/// within about a second instead of holding a request thread.
pub const MAX_TEMPLATE_FUEL: u64 = 50_000_000;

/// Most bytes a chat rendering may produce, beyond twice its messages' own bytes: a template
/// adds a few tags per message, never a copy of the conversation many times over.
pub const TEMPLATE_SLACK_BYTES: usize = 1 << 20;

/// Most tokens (and most merges) a vocabulary may have: real ones have up to ~260k.
pub const MAX_VOCAB: usize = 1 << 21;

/// Longest text one vocabulary entry may have, bytes: real ones have under 200, and the
/// longest sizes the prompt bound checked before tokenising.
pub const MAX_TOKEN_TEXT_BYTES: usize = 1024;

/// Longest chat template accepted, bytes: real ones are a few KiB (tool-calling ones tens).
pub const MAX_TEMPLATE_BYTES: usize = 256 << 10;

/// Widest `indent` a chat template may ask for: minijinja's own builds its indentation at
/// whatever width it is given, so `indent(2**40)` alone asked for a terabyte and aborted
/// the process.
pub const MAX_TEMPLATE_INDENT: usize = 256;

/// Longest string the `replace` and `indent` filters may build in a chat template:
/// minijinja's own have no bound, and one call can multiply a long string by the length of
/// another (`replace`) or its line count by the width (`indent`).
pub const MAX_TEMPLATE_FILTER_BYTES: usize = 64 << 20;

/// A template error that says what was refused.
fn refused(what: String) -> minijinja::Error {
    minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, what)
}

/// The chat template compiled, with the `raise_exception` function HF templates call.
fn compile_chat(template: Option<&str>) -> Result<minijinja::Environment<'static>, String> {
    compile_chat_fueled(template, MAX_TEMPLATE_FUEL)
}

/// [`compile_chat`] with `fuel` template instructions a rendering.
fn compile_chat_fueled(
    template: Option<&str>,
    fuel: u64,
) -> Result<minijinja::Environment<'static>, String> {
    let template = template.ok_or("the model has no tokenizer.chat_template")?;
    if template.len() > MAX_TEMPLATE_BYTES {
        return Err(format!(
            "the chat template has {} bytes, more than {MAX_TEMPLATE_BYTES}",
            template.len()
        ));
    }
    let mut env = minijinja::Environment::new();
    env.set_fuel(Some(fuel));
    // The two builtin filters whose output one call can make huge, bounded. Fuel counts
    // instructions, not the work or memory of one; what a template writes out is bounded
    // by `render`. What a template builds and never writes (`~`, `*` up to minijinja's 100
    // MB) is not bounded here: docs/engine-shim.md, "A model file is hostile input".
    env.add_filter(
        "indent",
        |value: minijinja::value::StringInput<'_>,
         width: Option<usize>,
         first: Option<bool>,
         blank: Option<bool>,
         kwargs: minijinja::value::Kwargs|
         -> Result<minijinja::Value, minijinja::Error> {
            let asked = match width {
                Some(w) => Some(w),
                None => kwargs.peek::<Option<usize>>("width")?,
            };
            if asked.is_some_and(|w| w > MAX_TEMPLATE_INDENT) {
                return Err(refused(format!(
                    "indent wider than {MAX_TEMPLATE_INDENT} in the chat template"
                )));
            }
            // Every line gets the indentation (blank ones too, when asked): what it builds.
            // No width given: minijinja's default, 4.
            let v = value.as_str();
            let lines = v.matches('\n').count().saturating_add(1);
            let longest = lines
                .saturating_mul(asked.unwrap_or(4))
                .saturating_add(v.len());
            if longest > MAX_TEMPLATE_FILTER_BYTES {
                return Err(refused(format!(
                    "indent would build more than {MAX_TEMPLATE_FILTER_BYTES} bytes in the chat template"
                )));
            }
            minijinja::filters::indent(value, width, first, blank, kwargs)
        },
    );
    env.add_filter(
        "replace",
        |state: &minijinja::State<'_, '_>,
         value: minijinja::value::StringInput<'_>,
         from: minijinja::value::StringInput<'_>,
         to: minijinja::value::StringInput<'_>|
         -> Result<minijinja::Value, minijinja::Error> {
            // What `str::replace` would build (an empty `from` matches between every char).
            let (v, f) = (value.as_str(), from.as_str());
            let hits = if f.is_empty() {
                v.chars().count().saturating_add(1)
            } else {
                v.matches(f).count()
            };
            let longest = hits
                .saturating_mul(to.as_str().len())
                .saturating_add(v.len());
            if longest > MAX_TEMPLATE_FILTER_BYTES {
                return Err(refused(format!(
                    "replace would build more than {MAX_TEMPLATE_FILTER_BYTES} bytes in the chat template"
                )));
            }
            minijinja::filters::replace(state, value, from, to)
        },
    );
    env.add_function(
        "raise_exception",
        |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        },
    );
    env.add_template_owned(CHAT, template.to_string())
        .map_err(|e| e.to_string())?;
    Ok(env)
}

impl ModelTokenizer {
    /// Builds the tokenizer described by the GGUF metadata. Supports `gpt2` byte-level BPE with
    /// the pre-tokenizers `smollm` (digits split individually, then byte level), `gpt2` and
    /// `default` (byte level); anything else is refused by name.
    pub fn from_gguf(g: &Gguf) -> Result<Self, TokenizerError> {
        let model = g.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(TokenizerError::Unsupported(format!(
                "tokenizer.ggml.model = {model:?} (only \"gpt2\" byte-level BPE is implemented)"
            )));
        }
        let pre = g.get_str("tokenizer.ggml.pre").unwrap_or("default");
        let split_digits = match pre {
            "smollm" => true,
            "gpt2" | "default" => false,
            other => {
                return Err(TokenizerError::Unsupported(format!(
                    "tokenizer.ggml.pre = {other:?} (implemented: smollm, gpt2, default)"
                )))
            }
        };
        let tokens = g.get_strings("tokenizer.ggml.tokens")?;
        let merge_lines = g.get_strings("tokenizer.ggml.merges")?;
        // The vocabulary comes from the file: sized before anything is built from it (each
        // entry is copied into several maps), and every id must fit the u32 ids are.
        if tokens.is_empty() || tokens.len() > MAX_VOCAB {
            return Err(TokenizerError::Vocabulary(format!(
                "a vocabulary of {} tokens (1 to {MAX_VOCAB})",
                tokens.len()
            )));
        }
        if merge_lines.len() > MAX_VOCAB {
            return Err(TokenizerError::Vocabulary(format!(
                "{} merges (at most {MAX_VOCAB})",
                merge_lines.len()
            )));
        }
        if let Some(long) = tokens.iter().position(|t| t.len() > MAX_TOKEN_TEXT_BYTES) {
            return Err(TokenizerError::Vocabulary(format!(
                "token {long} is longer than {MAX_TOKEN_TEXT_BYTES} bytes"
            )));
        }
        let merges: Vec<(String, String)> = merge_lines
            .into_iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| TokenizerError::Tokenizers(format!("bad merge {m:?}")))
            })
            .collect::<Result<_, _>>()?;
        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| TokenizerError::Tokenizers(e.to_string()))?;
        let mut tokenizer = Tokenizer::new(bpe);
        let byte_level = ByteLevel::new(false, true, true);
        if split_digits {
            tokenizer.with_pre_tokenizer(Some(Sequence::new(vec![
                Digits::new(true).into(),
                byte_level.into(),
            ])));
        } else {
            tokenizer.with_pre_tokenizer(Some(byte_level));
        }
        tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
        let types = g
            .get("tokenizer.ggml.token_type")?
            .as_array()
            .ok_or_else(|| GgufError::Metadata("tokenizer.ggml.token_type".into()))?;
        let is_control = |t: &Value| matches!(t, Value::I64(CONTROL) | Value::U64(3));
        let specials: Vec<AddedToken> = types
            .iter()
            .zip(&tokens)
            .filter(|(t, _)| is_control(t))
            .map(|(_, tok)| AddedToken::from(tok.to_string(), true))
            .collect();
        tokenizer
            .add_special_tokens(specials)
            .map_err(|e| TokenizerError::Tokenizers(e.to_string()))?;
        // Ids past the vocabulary were cut to 32 bits (2^32 + 1 became 1) or named no token.
        let special_id = |key: &str| -> Result<u32, TokenizerError> {
            let id = g.get_u64(key)?;
            usize::try_from(id)
                .ok()
                .filter(|&i| i < tokens.len())
                .and_then(|i| u32::try_from(i).ok())
                .ok_or_else(|| {
                    TokenizerError::Vocabulary(format!(
                        "{key} = {id}, past the vocabulary of {} tokens",
                        tokens.len()
                    ))
                })
        };
        let bos = special_id("tokenizer.ggml.bos_token_id")?;
        let eos = special_id("tokenizer.ggml.eos_token_id")?;
        let text_of = |id: u32| {
            tokens
                .get(id as usize)
                .map(|s| s.to_string())
                .unwrap_or_default()
        };
        // The bytes of text each entry stands for: a control token its literal text; a BPE entry
        // one byte per character of the byte-level alphabet (whose characters above U+007F take
        // two bytes in UTF-8 but stand for one); an entry with a character outside the alphabet
        // (BPE never produces one from text) is counted at its UTF-8 length, to stay an upper bound.
        let alphabet = ByteLevel::alphabet();
        let mut is_special = vec![false; tokens.len()];
        for (flag, t) in is_special.iter_mut().zip(types) {
            *flag = is_control(t);
        }
        let max_token_bytes = tokens
            .iter()
            .zip(&is_special)
            .map(|(t, &special)| {
                if !special && t.chars().all(|c| alphabet.contains(&c)) {
                    t.chars().count()
                } else {
                    t.len()
                }
            })
            .max()
            .unwrap_or(1)
            .max(1);
        let prefix_safe = tokens
            .iter()
            .zip(&is_special)
            .all(|(t, &special)| !special || !t.chars().any(char::is_whitespace));
        Ok(ModelTokenizer {
            max_token_bytes,
            prefix_safe,
            bos_text: text_of(bos),
            eos_text: text_of(eos),
            tokenizer,
            chat: compile_chat(g.get_str("tokenizer.chat_template").ok()),
            bos,
            eos,
            add_bos: matches!(
                g.metadata.get("tokenizer.ggml.add_bos_token"),
                Some(Value::Bool(true))
            ),
        })
    }

    /// Token ids of `text` (special tokens in the text are recognised; BOS added when the model
    /// asks for it).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let enc = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| TokenizerError::Tokenizers(e.to_string()))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if self.add_bos {
            ids.push(self.bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// [`ModelTokenizer::encode`] and each token's byte range in `text` (BOS as `(0, 0)`;
    /// tokens that split one character each get that character's range).
    pub fn encode_with_offsets(&self, text: &str) -> Result<(Vec<u32>, Offsets), TokenizerError> {
        let enc = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| TokenizerError::Tokenizers(e.to_string()))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        let mut offsets = Vec::with_capacity(enc.len() + 1);
        if self.add_bos {
            ids.push(self.bos);
            offsets.push((0, 0));
        }
        ids.extend_from_slice(enc.get_ids());
        offsets.extend_from_slice(enc.get_offsets());
        Ok((ids, offsets))
    }

    /// A prefix of [`ModelTokenizer::encode`]`(text)` at least `min_tokens` long when the text
    /// allows (see below), tokenizing only as much of the text as that takes, and the bytes of
    /// text that prefix covers.
    ///
    /// The text is tokenized in chunks of about `cache.chunk_bytes()`, each cut before a
    /// whitespace character that follows a non-whitespace one. Such a position is a boundary of
    /// the byte-level pre-tokenizer whatever comes before or after it (its word, number and
    /// punctuation runs take no whitespace after their first character, a whitespace run takes
    /// no non-whitespace one, and the pattern looks neither behind nor more than one character
    /// ahead), BPE merges never cross it, and no special token spans it (checked at load: none
    /// holds whitespace). So the chunks' tokens, in order, are the whole text's tokens, and a
    /// chunk's tokens can be looked up in `cache` by its bytes within `scope` (a tenant: one
    /// tenant cannot time another's chunks): prompts that share a prefix share its chunks,
    /// which are tokenized once.
    ///
    /// The work is bounded: a chunk is at most four times `chunk_bytes`, and where a text has
    /// no boundary that far past the last cut, the prefix stops at that cut (shorter than
    /// `min_tokens`, still exact). A tokenizer where the cut is not known to be exact (a special
    /// token holding whitespace) tokenizes the whole text, at most [`MAX_UNCUT_BYTES`] of it.
    pub fn encode_prefix(
        &self,
        text: &str,
        min_tokens: usize,
        cache: &PrefixCache,
        scope: &[u8],
    ) -> Result<(Vec<u32>, usize), TokenizerError> {
        if !self.prefix_safe {
            if text.len() > MAX_UNCUT_BYTES {
                return Err(TokenizerError::Unsupported(format!(
                    "a {}-byte prompt: a tokenizer whose special tokens hold whitespace tokenizes prompts whole, at most {MAX_UNCUT_BYTES} bytes",
                    text.len()
                )));
            }
            return Ok((self.encode(text)?, text.len()));
        }
        let mut ids = Vec::new();
        if self.add_bos {
            ids.push(self.bos);
        }
        let chunk = cache.chunk_bytes;
        let mut start = 0;
        while start < text.len() && ids.len() < min_tokens {
            let from = start.saturating_add(chunk);
            let until = start.saturating_add(chunk.saturating_mul(4));
            let end = match next_cut(text, from, until) {
                Some(cut) => cut,
                // The rest is one last chunk within the bound.
                None if until >= text.len() => text.len(),
                // No boundary within the bound: the prefix ends here.
                None => break,
            };
            let piece = &text[start..end];
            let key = cache.key(scope, piece);
            match cache.get(&key) {
                Some(hit) => ids.extend_from_slice(&hit),
                None => {
                    let enc = self
                        .tokenizer
                        .encode(piece, false)
                        .map_err(|e| TokenizerError::Tokenizers(e.to_string()))?;
                    ids.extend_from_slice(enc.get_ids());
                    cache.put(key, enc.get_ids());
                }
            }
            start = end;
        }
        Ok((ids, start))
    }

    /// Most bytes of text one token can stand for: a text of `n` bytes has at least
    /// `n.div_ceil(max_token_bytes())` tokens, a bound known before tokenising it.
    pub fn max_token_bytes(&self) -> usize {
        self.max_token_bytes
    }

    /// The fewest tokens [`ModelTokenizer::encode`] can give for a text of `bytes` bytes (BOS
    /// included), without tokenising it.
    pub fn min_tokens(&self, bytes: usize) -> usize {
        bytes.div_ceil(self.max_token_bytes) + usize::from(self.add_bos)
    }

    /// Text of `ids` (special tokens skipped).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| TokenizerError::Tokenizers(e.to_string()))
    }

    /// The text `id` adds to the ids `stream` was given before, or `None` while that text ends
    /// in an incomplete UTF-8 sequence (a later id completes it). Each call decodes only the
    /// ids since the last piece's start (the tokenizers crate's stream decoding), so a sequence
    /// of n ids costs O(n), where decoding all of them after each one cost O(n²). The pieces
    /// joined, then [`ModelTokenizer::decode_rest`], are [`ModelTokenizer::decode`] of all ids.
    pub fn decode_step(
        &self,
        stream: &mut TextStream,
        id: u32,
    ) -> Result<Option<String>, TokenizerError> {
        tokenizers::tokenizer::step_decode_stream(
            &self.tokenizer,
            vec![id],
            true,
            &mut stream.ids,
            &mut stream.prefix,
            &mut stream.prefix_index,
        )
        .map_err(|e| TokenizerError::Tokenizers(e.to_string()))
    }

    /// What `stream` holds back at the end: the text of ids that ended in an incomplete UTF-8
    /// sequence, with U+FFFD for it, as [`ModelTokenizer::decode`] gives it.
    pub fn decode_rest(&self, stream: &TextStream) -> Result<String, TokenizerError> {
        let whole = self.decode(&stream.ids)?;
        Ok(whole
            .strip_prefix(stream.prefix.as_str())
            .unwrap_or_default()
            .to_string())
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// The model's chat template applied to `(role, content)` messages, with the generation
    /// prompt appended.
    pub fn render_chat(&self, messages: &[(String, String)]) -> Result<String, TokenizerError> {
        let env = self
            .chat
            .as_ref()
            .map_err(|e| TokenizerError::Template(e.clone()))?;
        render(env, messages, &self.bos_text, &self.eos_text)
    }
}

/// Renders `messages` with the compiled chat template of `env`, within
/// [`MAX_TEMPLATE_FUEL`] and twice the messages' bytes plus [`TEMPLATE_SLACK_BYTES`] of output.
fn render(
    env: &minijinja::Environment<'static>,
    messages: &[(String, String)],
    bos: &str,
    eos: &str,
) -> Result<String, TokenizerError> {
    let msgs: Vec<minijinja::Value> = messages
        .iter()
        .map(|(role, content)| minijinja::context! { role => role, content => content })
        .collect();
    let given: usize = messages.iter().map(|(r, c)| r.len() + c.len()).sum();
    let mut out = Bounded {
        buf: Vec::new(),
        max: given.saturating_mul(2).saturating_add(TEMPLATE_SLACK_BYTES),
    };
    let template = env
        .get_template(CHAT)
        .map_err(|e| TokenizerError::Template(e.to_string()))?;
    let rendered = template.render_captured_to(
        minijinja::context! {
            messages => msgs,
            add_generation_prompt => true,
            bos_token => bos,
            eos_token => eos,
        },
        &mut out,
    );
    if let Err(e) = rendered {
        return Err(TokenizerError::Template(if out.buf.len() >= out.max {
            format!("the chat template's output passed {} bytes", out.max)
        } else {
            e.to_string()
        }));
    }
    String::from_utf8(out.buf)
        .map_err(|_| TokenizerError::Template("the chat template's output is not UTF-8".into()))
}

/// An output buffer that refuses to grow past `max` bytes.
struct Bounded {
    buf: Vec<u8>,
    max: usize,
}

impl std::io::Write for Bounded {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.buf.len().saturating_add(b.len()) > self.max {
            self.buf.resize(self.max, 0);
            return Err(std::io::Error::other("output limit"));
        }
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Each token's byte range in the text it came from ([`ModelTokenizer::encode_with_offsets`]).
pub type Offsets = Vec<(usize, usize)>;

/// Most bytes [`ModelTokenizer::encode_prefix`] tokenizes whole when it cannot cut a text.
pub const MAX_UNCUT_BYTES: usize = 256 << 10;

/// The first position in `from..until` (byte offsets, clamped to the text; `from` at least 1)
/// where `text` has a whitespace character after a non-whitespace one: a chunk boundary of
/// [`ModelTokenizer::encode_prefix`].
fn next_cut(text: &str, from: usize, until: usize) -> Option<usize> {
    let mut from = from.max(1);
    let mut until = until.min(text.len());
    // A character that starts before `until` is in the window.
    while until < text.len() && !text.is_char_boundary(until) {
        until += 1;
    }
    while from < until && !text.is_char_boundary(from) {
        from += 1;
    }
    if from >= until {
        return None;
    }
    let mut prev_ws = text[..from]
        .chars()
        .next_back()
        .is_none_or(char::is_whitespace);
    for (i, c) in text[from..until].char_indices() {
        let ws = c.is_whitespace();
        if ws && !prev_ws {
            return Some(from + i);
        }
        prev_ws = ws;
    }
    None
}

/// Token ids of text chunks, by the chunks' BLAKE3 digest within a scope, for one tokenizer:
/// what [`ModelTokenizer::encode_prefix`] reuses across prompts. Bounded by the ids it holds,
/// each chunk counting [`ENTRY_COST_IDS`] more for its own keeping (least recently used chunks
/// go first); safe to share between threads.
pub struct PrefixCache {
    chunk_bytes: usize,
    chunks: Option<Mutex<ChunkIds>>,
}

/// What a cached chunk costs beyond its ids, in ids (4 bytes each): its 32-byte key, its LRU
/// node and its `Arc` header, about 128 bytes. So many tiny chunks (short prompts, or text a
/// vocabulary drops to no ids at all) are bounded as surely as a few long ones.
pub const ENTRY_COST_IDS: usize = 32;

/// Token ids by chunk digest, and what they cost ([`ENTRY_COST_IDS`] included).
struct ChunkIds {
    lru: LruCache<[u8; 32], Arc<[u32]>>,
    ids: usize,
    max_ids: usize,
}

impl PrefixCache {
    /// A cache of chunks of about `chunk_bytes` bytes (at least 1) holding at most `max_ids`
    /// token ids in all, [`ENTRY_COST_IDS`] a chunk included (0: nothing is kept).
    pub fn new(chunk_bytes: usize, max_ids: usize) -> Self {
        PrefixCache {
            chunk_bytes: chunk_bytes.max(1),
            chunks: (max_ids > 0).then(|| {
                Mutex::new(ChunkIds {
                    lru: LruCache::unbounded(),
                    ids: 0,
                    max_ids,
                })
            }),
        }
    }

    /// The chunk size, bytes.
    pub fn chunk_bytes(&self) -> usize {
        self.chunk_bytes
    }

    /// Chunks held.
    pub fn len(&self) -> usize {
        self.chunks.as_ref().map_or(0, |c| c.lock().lru.len())
    }

    /// Token ids held, over all chunks, plus [`ENTRY_COST_IDS`] a chunk: what the bound counts.
    pub fn ids(&self) -> usize {
        self.chunks.as_ref().map_or(0, |c| c.lock().ids)
    }

    /// Whether no chunk is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn key(&self, scope: &[u8], chunk: &str) -> [u8; 32] {
        let mut h = blake3::Hasher::new();
        h.update(&(scope.len() as u64).to_le_bytes());
        h.update(scope);
        h.update(chunk.as_bytes());
        *h.finalize().as_bytes()
    }

    fn get(&self, key: &[u8; 32]) -> Option<Arc<[u32]>> {
        self.chunks.as_ref()?.lock().lru.get(key).cloned()
    }

    fn put(&self, key: [u8; 32], ids: &[u32]) {
        let Some(c) = &self.chunks else {
            return;
        };
        let mut c = c.lock();
        let cost = |ids: &[u32]| ids.len().saturating_add(ENTRY_COST_IDS);
        if cost(ids) > c.max_ids {
            return;
        }
        if let Some(old) = c.lru.put(key, Arc::from(ids)) {
            c.ids -= cost(&old);
        }
        c.ids += cost(ids);
        while c.ids > c.max_ids {
            match c.lru.pop_lru() {
                Some((_, gone)) => c.ids -= cost(&gone),
                None => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{compile_chat_fueled, next_cut, render, PrefixCache, TokenizerError};

    /// A chat template comes from a model file: one that loops without end or copies the
    /// conversation over and over fails with an error instead of running for minutes or
    /// filling memory; a plain one renders. (Less fuel than the models get, so that the
    /// unoptimised test build runs out of it quickly.)
    #[test]
    fn a_hostile_chat_template_runs_out_of_fuel_or_room() {
        let msgs = vec![("user".to_string(), "x".repeat(1 << 20))];
        let run = |t: &str| {
            let env = compile_chat_fueled(Some(t), 1_000_000).unwrap();
            render(&env, &msgs, "<s>", "</s>")
        };
        let fails = |t: &str, why: &str| match run(t) {
            Err(TokenizerError::Template(e)) => assert!(e.contains(why), "{t}: {e}"),
            other => panic!("{t}: {:?}", other.map(|s| s.len())),
        };
        fails(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "fuel",
        );
        fails(
            "{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}",
            "passed",
        );
        let plain = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}";
        assert_eq!(run(plain).unwrap().len(), (1 << 20) + "<|user|>".len());
        // One filter call that would build a terabyte (the process aborted), or multiply a
        // megabyte by a megabyte: refused, while the same filters at sane sizes still work.
        fails(
            "{{ messages[0].role|indent(1099511627776) }}",
            "indent wider",
        );
        fails(
            "{{ messages[0].role|indent(width=1099511627776) }}",
            "indent wider",
        );
        fails(
            "{{ messages[0].content|replace('x', messages[0].content)|length }}",
            "replace would build",
        );
        fails(
            "{{ ('\\n' * 1000000)|indent(256, true, true)|length }}",
            "indent would build",
        );
        let sane = "{{ 'a\nb'|indent(2, true) }}|{{ messages[0].role|replace('u', 'U') }}|{{ 'ab'|replace('', '-') }}";
        assert_eq!(run(sane).unwrap(), "  a\n  b|User|-a-b-");
        let huge = "x".repeat(super::MAX_TEMPLATE_BYTES + 1);
        assert!(compile_chat_fueled(Some(&huge), 1).is_err());
    }

    #[test]
    fn cuts_fall_before_whitespace_after_a_non_whitespace() {
        let all = usize::MAX;
        assert_eq!(next_cut("hello world again", 0, all), Some(5));
        assert_eq!(next_cut("hello world again", 6, all), Some(11));
        assert_eq!(next_cut("hello world again", 12, all), None);
        assert_eq!(next_cut("hello world again", 100, all), None);
        // Within the window only.
        assert_eq!(next_cut("hello world again", 6, 11), None);
        // Not inside a whitespace run, and not at the very start.
        assert_eq!(next_cut("ab   cd ef", 3, all), Some(7));
        assert_eq!(next_cut(" abcdef", 0, all), None);
        // Any whitespace: a newline, an ideographic space.
        assert_eq!(next_cut("a\n b", 0, all), Some(1));
        assert_eq!(next_cut("日本\u{3000}語", 0, all), Some(6));
        // Multi-byte characters before the cut; `from` inside a character.
        assert_eq!(next_cut("été là-bas", 1, all), Some(5));
        assert_eq!(next_cut("ééé", 1, all), None);
    }

    #[test]
    fn the_cache_is_bounded_by_the_ids_it_holds() {
        const E: usize = super::ENTRY_COST_IDS;
        let c = PrefixCache::new(8, 2 * (4 + E) + 2);
        let k = |i: u8| c.key(b"", &i.to_string());
        c.put(k(1), &[1; 4]);
        c.put(k(2), &[2; 4]);
        assert_eq!((c.len(), c.ids()), (2, 2 * (4 + E)));
        // A third pushes out the least recently used (1; 2 was just read).
        assert!(c.get(&k(2)).is_some());
        c.put(k(3), &[3; 4]);
        assert_eq!((c.len(), c.ids()), (2, 2 * (4 + E)));
        assert!(c.get(&k(1)).is_none());
        // Larger than the whole bound: not kept.
        c.put(k(4), &[4; 2 * 4 + E + 3]);
        assert!(c.get(&k(4)).is_none());
        // Chunks of no ids at all still count: many of them stay bounded.
        let empty = PrefixCache::new(8, 10 * E);
        for i in 0..1000u32 {
            empty.put(empty.key(b"", &i.to_string()), &[]);
        }
        assert_eq!((empty.len(), empty.ids()), (10, 10 * E));
        // Scopes do not share entries.
        assert_ne!(c.key(b"a", "x"), c.key(b"b", "x"));
        assert_eq!(PrefixCache::new(8, 0).len(), 0);
    }
}
