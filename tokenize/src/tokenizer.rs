//! The model's tokenizer and chat template, built from GGUF metadata (nothing hard-coded): the
//! BPE vocabulary and merges with the `tokenizers` crate, control tokens as special tokens, and
//! the Jinja chat template (`tokenizer.chat_template`), compiled once and rendered with minijinja.

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, Tokenizer};

use std::num::NonZeroUsize;
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
    /// The tokenizers crate failed.
    #[error("tokenizer: {0}")]
    Tokenizers(String),
    /// The chat template failed to compile or render.
    #[error("chat template: {0}")]
    Template(String),
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

/// The chat template compiled, with the `raise_exception` function HF templates call.
fn compile_chat(template: Option<&str>) -> Result<minijinja::Environment<'static>, String> {
    let template = template.ok_or("the model has no tokenizer.chat_template")?;
    let mut env = minijinja::Environment::new();
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
        let merges: Vec<(String, String)> = g
            .get_strings("tokenizer.ggml.merges")?
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
        let bos = g.get_u64("tokenizer.ggml.bos_token_id")? as u32;
        let eos = g.get_u64("tokenizer.ggml.eos_token_id")? as u32;
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

    /// A prefix of [`ModelTokenizer::encode`]`(text)` at least `min_tokens` long (all of it when
    /// the text has fewer), tokenizing only as much of the text as that takes, and the bytes of
    /// text that prefix covers.
    ///
    /// The text is tokenized in chunks of about `cache.chunk_bytes()`, each cut before a space
    /// that follows a non-whitespace character. Such a position is a boundary of the byte-level
    /// pre-tokenizer whatever comes before or after it (its word, number and punctuation runs
    /// never take a space after their first character, a whitespace run never takes a
    /// non-whitespace one, and the pattern looks neither behind nor more than one character
    /// ahead), BPE merges never cross it, and no special token spans it (checked at load: none
    /// holds whitespace). So the chunks' tokens, in order, are the whole text's tokens, and a
    /// chunk's tokens can be looked up in `cache` by its bytes: prompts that share a prefix
    /// share its chunks, which are tokenized once. Tokenizers where that does not hold are
    /// tokenized whole.
    pub fn encode_prefix(
        &self,
        text: &str,
        min_tokens: usize,
        cache: &PrefixCache,
    ) -> Result<(Vec<u32>, usize), TokenizerError> {
        if !self.prefix_safe {
            return Ok((self.encode(text)?, text.len()));
        }
        let mut ids = Vec::new();
        if self.add_bos {
            ids.push(self.bos);
        }
        let mut start = 0;
        while start < text.len() && ids.len() < min_tokens {
            let end = next_cut(text, start.saturating_add(cache.chunk_bytes)).unwrap_or(text.len());
            let chunk = &text[start..end];
            match cache.get(chunk) {
                Some(hit) => ids.extend_from_slice(&hit),
                None => {
                    let enc = self
                        .tokenizer
                        .encode(chunk, false)
                        .map_err(|e| TokenizerError::Tokenizers(e.to_string()))?;
                    ids.extend_from_slice(enc.get_ids());
                    cache.put(chunk, enc.get_ids());
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
        let msgs: Vec<minijinja::Value> = messages
            .iter()
            .map(|(role, content)| minijinja::context! { role => role, content => content })
            .collect();
        env.get_template(CHAT)
            .and_then(|t| {
                t.render(minijinja::context! {
                    messages => msgs,
                    add_generation_prompt => true,
                    bos_token => self.bos_text,
                    eos_token => self.eos_text,
                })
            })
            .map_err(|e| TokenizerError::Template(e.to_string()))
    }
}

/// The first position at or after `from` where `text` has a space after a non-whitespace
/// character (a chunk boundary of [`ModelTokenizer::encode_prefix`]); `None` past the text or
/// when there is none.
fn next_cut(text: &str, from: usize) -> Option<usize> {
    let bytes = text.as_bytes();
    // A space is one byte in UTF-8, so every candidate is a char boundary.
    (from.max(1)..bytes.len()).find(|&i| {
        bytes[i] == b' '
            && text[..i]
                .chars()
                .next_back()
                .is_some_and(|c| !c.is_whitespace())
    })
}

/// Token ids of text chunks, by the chunks' BLAKE3 digest, for one tokenizer: what
/// [`ModelTokenizer::encode_prefix`] reuses across prompts. Bounded (least recently used chunks
/// go first); safe to share between threads.
pub struct PrefixCache {
    chunk_bytes: usize,
    chunks: Option<Mutex<ChunkIds>>,
}

/// Token ids by chunk digest.
type ChunkIds = LruCache<[u8; 32], Arc<[u32]>>;

impl PrefixCache {
    /// A cache of at most `max_chunks` chunks (0: none kept) of about `chunk_bytes` bytes (at
    /// least 1).
    pub fn new(chunk_bytes: usize, max_chunks: usize) -> Self {
        PrefixCache {
            chunk_bytes: chunk_bytes.max(1),
            chunks: NonZeroUsize::new(max_chunks).map(|n| Mutex::new(LruCache::new(n))),
        }
    }

    /// The chunk size, bytes.
    pub fn chunk_bytes(&self) -> usize {
        self.chunk_bytes
    }

    /// Chunks held.
    pub fn len(&self) -> usize {
        self.chunks.as_ref().map_or(0, |c| c.lock().len())
    }

    /// Whether no chunk is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn get(&self, chunk: &str) -> Option<Arc<[u32]>> {
        let key = *blake3::hash(chunk.as_bytes()).as_bytes();
        self.chunks.as_ref()?.lock().get(&key).cloned()
    }

    fn put(&self, chunk: &str, ids: &[u32]) {
        if let Some(c) = &self.chunks {
            let key = *blake3::hash(chunk.as_bytes()).as_bytes();
            c.lock().put(key, Arc::from(ids));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::next_cut;

    #[test]
    fn cuts_fall_before_a_space_after_a_non_space() {
        assert_eq!(next_cut("hello world again", 0), Some(5));
        assert_eq!(next_cut("hello world again", 6), Some(11));
        assert_eq!(next_cut("hello world again", 12), None);
        assert_eq!(next_cut("hello world again", 100), None);
        // Not inside a whitespace run, and not at the very start.
        assert_eq!(next_cut("ab   cd ef", 3), Some(7));
        assert_eq!(next_cut(" abcdef", 0), None);
        assert_eq!(next_cut("a\n b", 0), None);
        // Multi-byte characters before the space; `from` inside a character.
        assert_eq!(next_cut("été là-bas", 1), Some(5));
    }
}
