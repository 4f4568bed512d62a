//! kvagent: the kvmesh node agent.
//!
//! A tiered KV block store ([`store`]: RAM with watermarks spilling to checksummed block files,
//! [`disk`]) served over gRPC ([`service`], proto in `proto/kvagent.proto`), the node's residency
//! feed (`WatchResidency`), and the co-located engine's load ([`telemetry`]). Blocks are named by
//! digests of the kvmesh prefix chain ([`kvmesh_filters::chain`]); payloads are opaque.

pub mod access;
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

/// Adds `authorization: Bearer <token>` to every call, when a token is set.
#[derive(Clone, Default)]
pub struct BearerToken(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl std::fmt::Debug for BearerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "BearerToken(..)"
        } else {
            "BearerToken(none)"
        })
    }
}

impl tonic::service::Interceptor for BearerToken {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = self.0.as_ref() {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

/// A client of the agent, sending its token (if any) with every call.
pub type Client = KvAgentClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, BearerToken>,
>;

/// Why a client could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The URL, the TLS settings, or the connection.
    #[error(transparent)]
    Transport(#[from] tonic::transport::Error),
    /// The token cannot go into a header.
    #[error("the kvagent token must be printable ASCII")]
    Token,
    /// The agent did not finish the TCP, TLS and HTTP/2 handshakes within [`CONNECT_TIMEOUT`]
    /// (a peer that accepts connections and never answers).
    #[error("no connection to the kvagent within {}s", CONNECT_TIMEOUT.as_secs())]
    Timeout,
    /// A TLS file cannot be read.
    #[error("reading {path}: {source}")]
    File {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
}

/// TLS towards an `https://` agent: the CA it is verified against (for the URL's host) and,
/// for agents that ask for one, a client certificate.
#[derive(Debug, Clone, Default)]
pub struct ClientTls {
    /// PEM CA bundle.
    pub ca_file: String,
    /// PEM client certificate chain; empty: none.
    pub cert_file: String,
    /// Its PEM private key.
    pub key_file: String,
}

fn read(path: &str) -> Result<Vec<u8>, ConnectError> {
    std::fs::read(path).map_err(|source| ConnectError::File {
        path: path.to_string(),
        source,
    })
}

impl ClientTls {
    fn config(&self) -> Result<tonic::transport::ClientTlsConfig, ConnectError> {
        let mut c = tonic::transport::ClientTlsConfig::new().ca_certificate(
            tonic::transport::Certificate::from_pem(read(&self.ca_file)?),
        );
        if !self.cert_file.is_empty() {
            c = c.identity(tonic::transport::Identity::from_pem(
                read(&self.cert_file)?,
                read(&self.key_file)?,
            ));
        }
        Ok(c)
    }
}

/// The longest a connection to the agent may take, handshakes (TCP, TLS, HTTP/2) included.
pub const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Connects a client to the agent at `url` (`http://host:port`) with the HTTP/2 settings the
/// benchmarks were measured with: large flow-control windows and 1 MiB DATA frames, so
/// multi-megabyte blocks stream without stalls; messages up to `max_message_bytes` both ways.
/// Connecting gives up after [`CONNECT_TIMEOUT`]; an idle channel is pinged every 10 s and
/// dropped when a ping goes 5 s unanswered.
pub async fn connect(url: String, max_message_bytes: usize) -> Result<Client, ConnectError> {
    connect_with_token(url, max_message_bytes, None).await
}

/// [`connect`], sending `token` as `authorization: Bearer <token>` with every call.
pub async fn connect_with_token(
    url: String,
    max_message_bytes: usize,
    token: Option<&str>,
) -> Result<Client, ConnectError> {
    connect_with(url, max_message_bytes, token, None).await
}

/// [`connect_with_token`], over TLS with `tls` (for an `https://` URL).
pub async fn connect_with(
    url: String,
    max_message_bytes: usize,
    token: Option<&str>,
    tls: Option<&ClientTls>,
) -> Result<Client, ConnectError> {
    let bearer = match token {
        None => BearerToken(None),
        Some(t) => BearerToken(Some(
            format!("Bearer {}", t.trim())
                .parse()
                .map_err(|_| ConnectError::Token)?,
        )),
    };
    let mut endpoint = tonic::transport::Endpoint::from_shared(url)?;
    if let Some(t) = tls {
        endpoint = endpoint.tls_config(t.config()?)?;
    }
    // Keepalive pings find a dead peer or path on an idle channel (a watch stream that hears
    // nothing would otherwise wait forever). tonic's connect timeout covers the TCP connect
    // only: a peer that accepts and then never answers the TLS ClientHello held the caller
    // forever, so the whole connection is bounded.
    let endpoint = endpoint
        .initial_stream_window_size(8 << 20)
        .initial_connection_window_size(32 << 20)
        .max_frame_size(1 << 20)
        .tcp_nodelay(true)
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_keepalive(Some(std::time::Duration::from_secs(30)))
        .http2_keep_alive_interval(std::time::Duration::from_secs(10))
        .keep_alive_timeout(std::time::Duration::from_secs(5))
        .keep_alive_while_idle(true);
    let channel = tokio::time::timeout(CONNECT_TIMEOUT, endpoint.connect())
        .await
        .map_err(|_| ConnectError::Timeout)??;
    Ok(KvAgentClient::with_interceptor(channel, bearer)
        .max_decoding_message_size(max_message_bytes)
        .max_encoding_message_size(max_message_bytes))
}
