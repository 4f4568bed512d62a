//! Benchmark and test instruments for kvmesh. Nothing here is part of the product.
//!
//! - [`sim`]: `kvmesh-sim-engine`, an OpenAI-compatible engine simulator with a real prefix cache
//!   and a documented latency model, so routers can be compared on equal, repeatable engines.
//! - [`load`]: workload generators and an OpenAI streaming client that measures TTFT and reads
//!   `usage`, used by `kvmesh-bench`.
//! - [`engine_shim`]: the native engine's speed, memory and prefix-reuse TTFT.
//! - [`eval`]: long-context quality under KV eviction (segment, H2O, StreamingLLM).
//! - [`gossip`]: residency convergence and gossip bandwidth of N in-process gossip nodes.
//! - [`kvagent`]: kvagent's data path against plain copy and sequential-file baselines.

pub mod engine_shim;
pub mod eval;
pub mod gossip;
pub mod http;
pub mod kvagent;
pub mod load;
pub mod procs;
pub mod sim;
pub mod soak;
pub mod tls;
pub mod trace;
pub mod workload;
