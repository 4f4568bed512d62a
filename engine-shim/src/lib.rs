//! engine-shim: kvmesh's native engine on libtorch.
//!
//! - [`gguf`]: the GGUF v3 reader and dequantisation (the `kvmesh-gguf` crate, re-exported);
//! - [`model`]: the Llama forward pass on libtorch, with a per-sequence KV cache;
//! - [`tokenizer`]: the model's tokenizer and chat template, built from GGUF metadata.
//!
//! - [`cache`]: the paged prefix cache (16-token blocks named by the token digest chain);
//! - [`engine`]: the worker: FIFO queue, prefix reuse, chunked prefill, sampling;
//! - [`kvstore`]: blocks written through to kvagent and paged back in, sealed with a MAC;
//! - [`server`]: the OpenAI HTTP surface.
//!
//! Not built yet (docs/engine-shim.md): continuous batching of decode steps (requests are served
//! one at a time, first come first served).

pub mod cache;
pub mod engine;
pub mod kvstore;
pub mod model;
pub mod server;
pub mod tokenizer;

pub use kvmesh_gguf as gguf;
