//! kvagent: the kvmesh node agent.
//!
//! A tiered KV block store ([`store`]: RAM with watermarks spilling to checksummed block files,
//! [`disk`]) served over gRPC ([`service`], proto in `proto/kvagent.proto`), the node's residency
//! feed (`WatchResidency`), and the co-located engine's load ([`telemetry`]). Blocks are named by
//! digests of the kvmesh prefix chain ([`kvmesh_filters::chain`]); payloads are opaque.

pub mod config;
pub mod disk;
pub mod metrics;
pub mod service;
pub mod store;
pub mod telemetry;

/// Generated protobuf messages, client and server for `kvmesh.kvagent.v1`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod pb {
    tonic::include_proto!("kvmesh.kvagent.v1");
}

pub use pb::kv_agent_client::KvAgentClient;

/// Connects a client to the agent at `url` (`http://host:port`) with the HTTP/2 settings the
/// benchmarks were measured with: large flow-control windows and 1 MiB DATA frames, so
/// multi-megabyte blocks stream without stalls; messages up to `max_message_bytes` both ways.
pub async fn connect(
    url: String,
    max_message_bytes: usize,
) -> Result<KvAgentClient<tonic::transport::Channel>, tonic::transport::Error> {
    let channel = tonic::transport::Endpoint::from_shared(url)?
        .initial_stream_window_size(8 << 20)
        .initial_connection_window_size(32 << 20)
        .max_frame_size(1 << 20)
        .tcp_nodelay(true)
        .connect()
        .await?;
    Ok(KvAgentClient::new(channel)
        .max_decoding_message_size(max_message_bytes)
        .max_encoding_message_size(max_message_bytes))
}
