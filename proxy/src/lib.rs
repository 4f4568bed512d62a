//! `kvmesh_proxy`: the routing core and the Pingora request path of the KV-cache-aware gateway
//! in front of OpenAI-compatible engines. The `kvmesh-proxy` binary (`main.rs`) assembles a
//! server from these modules.

pub mod cluster;
pub mod config;
pub mod fleet;
pub mod metrics;
pub mod service;
