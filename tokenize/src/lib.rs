//! A model's tokenizer and chat template, built from its GGUF metadata, shared by engine-shim
//! and the proxy's token mode: both turn a request into the same token ids, so the proxy's
//! token digest chain names the blocks the engine caches.
//!
//! - [`ModelTokenizer`]: the BPE vocabulary and merges (the `tokenizers` crate), the control
//!   tokens, and the Jinja chat template (minijinja), compiled once at load;
//! - [`chat`]: the `(role, content)` turns of an OpenAI `messages` array, as the template sees
//!   them.

pub mod chat;
mod tokenizer;

pub use kvmesh_gguf as gguf;
pub use tokenizer::{ModelTokenizer, PrefixCache, TextStream, TokenizerError, MAX_UNCUT_BYTES};
