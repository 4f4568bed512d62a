//! The model's tokenizer and chat template, built from GGUF metadata (nothing hard-coded): the
//! BPE vocabulary and merges with the `tokenizers` crate, control tokens as special tokens, and
//! the Jinja chat template (`tokenizer.chat_template`) rendered with minijinja.

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, Tokenizer};

use crate::gguf::{Gguf, GgufError, Value};

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
    template: Option<String>,
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
        Ok(ModelTokenizer {
            max_token_bytes,
            bos_text: text_of(bos),
            eos_text: text_of(eos),
            tokenizer,
            template: g.get_str("tokenizer.chat_template").ok().map(String::from),
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
        let template = self.template.as_deref().ok_or_else(|| {
            TokenizerError::Template("the model has no tokenizer.chat_template".into())
        })?;
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
        env.add_template("chat", template)
            .map_err(|e| TokenizerError::Template(e.to_string()))?;
        let msgs: Vec<minijinja::Value> = messages
            .iter()
            .map(|(role, content)| minijinja::context! { role => role, content => content })
            .collect();
        env.get_template("chat")
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
