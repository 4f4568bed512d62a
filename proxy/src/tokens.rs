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

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use kvmesh_filters::chain::{token_chain, Digest, Namespace};
use kvmesh_filters::request::Endpoint;
use kvmesh_tokenize::gguf::Gguf;
use kvmesh_tokenize::{ModelTokenizer, PrefixCache};
use serde_json::Value;

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

/// The token-mode models, read at start.
#[derive(Default, Clone)]
pub struct TokenModes {
    models: Arc<HashMap<String, ModelTokens>>,
}

impl std::fmt::Debug for TokenModes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.models.keys()).finish()
    }
}

impl TokenModes {
    /// Reads every configured tokenizer (its GGUF's metadata; the weights are read and
    /// dropped). The error names the file and what is wrong with it.
    pub fn load(configs: &[TokenizerConfig]) -> Result<Self, String> {
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
        })
    }

    /// `model`'s KV block size, tokens, when it is in token mode (`None`: text mode).
    pub fn block_tokens(&self, model: &str) -> Option<usize> {
        self.models.get(model).map(|m| m.block_tokens)
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
        let v: Value = serde_json::from_slice(body).map_err(|_| Fallback::Body)?;
        let tokens_and_bytes = match endpoint {
            Endpoint::ChatCompletions => {
                let turns = kvmesh_tokenize::chat::turns(v.get("messages"))
                    .map_err(|_| Fallback::Template)?;
                let text = m
                    .tokenizer
                    .render_chat(&turns)
                    .map_err(|_| Fallback::Template)?;
                (m.encode(&text, want, ns)?, text.len())
            }
            Endpoint::Completions => match v.get("prompt") {
                Some(Value::String(s)) => (m.encode(s, want, ns)?, s.len()),
                // Token ids, as vLLM accepts them: the engine's tokens already.
                Some(Value::Array(ids)) if !ids.is_empty() => {
                    let kept = ids
                        .iter()
                        .take(want)
                        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                        .collect::<Option<Vec<u32>>>()
                        .ok_or(Fallback::Prompt)?;
                    // Four bytes of text per token: the scale text mode would see.
                    let bytes = kept.len() * 4;
                    ((kept, bytes), ids.len().saturating_mul(4))
                }
                _ => return Err(Fallback::Prompt),
            },
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
