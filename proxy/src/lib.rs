//! `kvmesh_proxy`: the routing core and the Pingora request path of the KV-cache-aware gateway
//! in front of OpenAI-compatible engines, and the Envoy ext_proc endpoint picker that shares
//! its routing core ([`picker`]). The `kvmesh-proxy` binary (`main.rs`) assembles a server from
//! these modules.

/// The version and the commit it was built from (`--version`, the dashboard).
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (",
    env!("KVMESH_GIT_HASH"),
    ")"
);

pub mod access;
pub mod admin;
pub mod admission;
pub mod auth;
pub mod body;
pub mod cluster;
pub mod config;
pub mod dashboard;
pub mod feed;
pub mod feedback;
pub mod fleet;
pub mod guard;
pub mod metrics;
pub mod otel;
pub mod picker;
pub mod placement;
pub mod plan;
pub mod reload;
pub mod service;
#[cfg(test)]
mod testing;
pub mod tls;
pub mod tokens;
pub mod trust;
