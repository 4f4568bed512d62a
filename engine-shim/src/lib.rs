//! engine-shim: kvmesh's native engine on libtorch.
//!
//! - [`gguf`]: the GGUF v3 reader and dequantisation (the `kvmesh-gguf` crate, re-exported);
//! - [`model`]: the Llama forward pass on libtorch, with a per-sequence KV cache;
//! - [`tokenizer`]: the model's tokenizer and chat template, built from GGUF metadata (the
//!   `kvmesh-tokenize` crate, re-exported: the proxy's token mode uses the same one);
//!
//! - [`cache`]: the paged prefix cache (16-token blocks named by the token digest chain);
//! - [`evict`]: KV budgets and eviction policies (segment relevance, H2O, StreamingLLM);
//! - [`segments`]: a request's `kv_eviction` field and its segments' token spans;
//! - [`engine`]: the worker: continuous batching, prefix reuse, chunked prefill, preemption,
//!   sampling;
//! - [`kvstore`]: blocks written through to kvagent and paged back in, sealed with a MAC;
//! - [`server`]: the OpenAI HTTP surface.

pub mod cache;
pub mod engine;
pub mod evict;
pub mod kvstore;
pub mod model;
pub mod segments;
pub mod server;

pub use kvmesh_gguf as gguf;
pub use kvmesh_tokenize as tokenizer;
