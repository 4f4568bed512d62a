//! engine-shim: kvmesh's native engine on libtorch.
//!
//! - [`gguf`]: GGUF v3 reader and dequantisation;
//! - [`model`]: the Llama forward pass on libtorch, with a per-sequence KV cache;
//! - [`tokenizer`]: the model's tokenizer and chat template, built from GGUF metadata.
//!
//! Status (docs/engine-shim.md): the model loader, tokenizer and chat template are built; the
//! forward pass, serving, paged prefix cache and kvagent spilling are not built yet.

pub mod gguf;
pub mod model;
pub mod tokenizer;
