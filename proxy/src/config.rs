//! The proxy's one typed configuration: TOML file, then environment overrides, then validation.
//! Every key has a default; docs/configuration.md lists them all.

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::Path;
use std::time::Duration;

use kvmesh_filters::route::{Policy, PrefixParams};
use serde::{Deserialize, Serialize};

pub mod env;
pub mod keys;
pub mod otel;
pub mod reload;
pub mod security;

pub use otel::OtelConfig;
pub use security::{AdmissionConfig, ApiKeyConfig, AuthConfig, TlsConfig};

/// Errors loading or validating a configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid TOML for this schema.
    #[error("{path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// The TOML parser's message (names the key and line), or the list of unknown and
        /// mistyped keys followed by that message.
        message: String,
    },
    /// A value is out of range or inconsistent.
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

/// The largest `max_body_bytes` accepted (1 GiB): a proxy that buffers whole bodies has no use
/// for more, and the body scanners count in `u32`.
pub const MAX_BODY_BYTES_LIMIT: usize = 1 << 30;
/// The largest `cluster.bulk_sync_max_bytes` accepted.
pub const MAX_BULK_SYNC_BYTES: usize = 1 << 30;
/// The largest `cluster.load_beacon_interval_ms` accepted: beyond it, the heartbeat beacon
/// (every 250 ms) would be the only one.
const MAX_LOAD_BEACON_INTERVAL_MS: u64 = 250;
/// The largest `cluster.residency_full_interval_ms` accepted: removals reach peers this late.
pub const MAX_RESIDENCY_FULL_INTERVAL_MS: u64 = 60_000;
/// The largest `residency.capacity_per_node`: maps sized by it are allocated up front (a KV
/// events feed's hash map), so a typo must not take gigabytes.
pub const MAX_CAPACITY_PER_NODE: usize = 10_000_000;

/// The whole `kvmesh-proxy` configuration.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProxyConfig {
    /// Address the OpenAI API (and /metrics, /health, /ready) listens on. Env: `KVMESH_LISTEN`.
    /// Not used in `picker` mode, which listens on the `[picker]` addresses.
    pub listen: String,
    /// `gateway` (in front of the configured engines), `sidecar` (beside one engine, forwarding
    /// to a better peer found by gossip; needs `[cluster]`) or `picker` (an Envoy ext_proc
    /// endpoint picker; see `[picker]`).
    pub mode: Mode,
    /// Routing policy: `prefix`, `round_robin`, `least_inflight`, `power_of_two`, `session`.
    pub policy: Policy,
    /// Largest accepted request body, bytes; larger bodies get 413. At most 1 GiB.
    pub max_body_bytes: usize,
    /// Most seconds a client may take to send a request body, from the request head (or the
    /// `100 Continue`) to its last byte; past it, 408 and the connection is closed.
    pub body_read_timeout_secs: u64,
    /// Most requests in flight through this proxy, counted from admission (before the body is
    /// read) to the end of the response: a hard cap; past it, 429 with `Retry-After`.
    pub max_inflight: u64,
    /// Most request-body bytes held by the proxy at once, over all requests: reserved as they
    /// arrive (a `Content-Length` only bounds the buffer, nothing is reserved for bytes not yet
    /// received), released once the body has been sent and the engine has answered. A request
    /// that would pass it gets 429 with `Retry-After`.
    pub body_budget_bytes: usize,
    /// Worker threads of the proxy (0: one per CPU).
    pub threads: usize,
    /// Log filter (tracing `EnvFilter` syntax). Env: `KVMESH_LOG`.
    pub log: String,
    /// Log line format: `text` or `json` (one object per line). Env: `KVMESH_LOG_FORMAT`.
    pub log_format: LogFormat,
    /// How often the configuration file is checked for changes, seconds (0: only on SIGHUP).
    /// A changed file is reloaded: the keys listed in docs/configuration.md ("Reloading") take
    /// effect, the others wait for a restart and are named in the log.
    pub config_reload_interval_secs: u64,
    /// The engines behind this gateway.
    pub engines: Vec<EngineConfig>,
    /// Token mode per model (none: every model in text mode; docs/configuration.md).
    pub tokenizers: Vec<TokenizerConfig>,
    /// Knobs of routing and of the `prefix` policy.
    pub routing: RoutingConfig,
    /// Bounds and lifetimes of the residency index.
    pub residency: ResidencyConfigToml,
    /// Timeouts and retries towards engines.
    pub upstream: UpstreamConfig,
    /// Active health checks of engines.
    pub health: HealthConfig,
    /// Graceful shutdown.
    pub shutdown: ShutdownConfig,
    /// Gossip with peer proxies (off unless `cluster.enabled`).
    pub cluster: ClusterToml,
    /// Sidecar-mode forwarding knobs.
    pub sidecar: SidecarConfig,
    /// Picker-mode listeners and knobs.
    pub picker: PickerConfig,
    /// TLS on the listener (off unless `tls.cert_file` is set).
    pub tls: TlsConfig,
    /// API keys (off unless keys or a key file are configured).
    pub auth: AuthConfig,
    /// Per-model caps on requests in flight.
    pub admission: AdmissionConfig,
    /// A separate listener for `/metrics`, `/health` and `/ready` (off unless `admin.listen` is
    /// set; gateway and sidecar modes, the picker has `picker.metrics_listen`).
    pub admin: AdminConfig,
    /// OpenTelemetry traces over OTLP (off unless `otel.endpoint` is set).
    pub otel: OtelConfig,
}

/// The `[admin]` table: where operators' endpoints listen.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// `IP:port` of a plain-HTTP listener serving only `/metrics`, `/health` and `/ready`;
    /// empty (the default): none, they are served on `listen` only. Env: `KVMESH_ADMIN__LISTEN`.
    pub listen: String,
    /// Whether `listen` (the API listener) also answers `/metrics` and `/ready`. `false` needs
    /// `admin.listen`: clients then see 404 for those two, and only the admin port exposes the
    /// fleet's metrics. `/health` stays on `listen` either way (peers probe it there).
    pub on_api_listener: bool,
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            listen: String::new(),
            on_api_listener: true,
        }
    }
}

/// The most fallbacks the picker lists (`picker.fallbacks`).
pub const MAX_PICKER_FALLBACKS: usize = 16;
/// The least `picker.max_message_bytes`: a 64 KiB body chunk and its message's fields.
pub const MIN_PICKER_MESSAGE_BYTES: usize = 80 << 10;
/// The most `picker.max_message_bytes` (64 MiB).
pub const MAX_PICKER_MESSAGE_BYTES: usize = 64 << 20;

/// The `[picker]` table: the Envoy ext_proc endpoint picker (`mode = "picker"`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PickerConfig {
    /// gRPC address of the `envoy.service.ext_proc.v3.ExternalProcessor` service (HTTP/2).
    pub listen: String,
    /// gRPC health address (`grpc.health.v1.Health`: `liveness`, `readiness`, and the ext_proc
    /// service name).
    pub health_listen: String,
    /// HTTP address of `/metrics`, `/health` and `/ready`.
    pub metrics_listen: String,
    /// Fallback endpoints listed after the choice in the `envoy.lb` dynamic metadata (the
    /// destination header always names one endpoint, so with fallbacks the two differ). At
    /// most [`MAX_PICKER_FALLBACKS`].
    pub fallbacks: usize,
    /// Largest ext_proc message accepted from Envoy; a longer one ends its stream with
    /// `OUT_OF_RANGE`. Between [`MIN_PICKER_MESSAGE_BYTES`] and [`MAX_PICKER_MESSAGE_BYTES`].
    pub max_message_bytes: usize,
    /// Most bytes of ext_proc messages on their way in, over all streams: each stream is
    /// charged with what the gRPC decoder may hold for it (four times its largest message
    /// begun and largest frame, and 16 KiB) until it ends; past it, the stream ends with
    /// `RESOURCE_EXHAUSTED`. At least 4 x `max_message_bytes` + 128 KiB.
    pub message_budget_bytes: usize,
}

impl Default for PickerConfig {
    fn default() -> Self {
        PickerConfig {
            listen: "127.0.0.1:9002".into(),
            health_listen: "127.0.0.1:9003".into(),
            metrics_listen: "127.0.0.1:9090".into(),
            fallbacks: 0,
            max_message_bytes: 2 << 20,
            message_budget_bytes: 512 << 20,
        }
    }
}

/// How log lines are written (`log_format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    /// Human-readable lines (colour only when stderr is a terminal).
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// How the proxy is deployed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// In front of N engines.
    #[default]
    Gateway,
    /// Beside one engine; other engines are reached through their own sidecars.
    Sidecar,
    /// An Envoy ext_proc endpoint picker (Gateway API Inference Extension protocol): Envoy
    /// carries the traffic, kvmesh names the engine (see `[picker]`, docs/envoy.md).
    Picker,
}

/// Who may send a request carrying `x-kvmesh-hop` (which is always served locally).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum HopTrust {
    /// Only clients on a loopback address (peers on the same host).
    #[default]
    Loopback,
    /// Loopback, and the IP addresses of live gossip members.
    Members,
    /// Only clients that presented, over TLS, a certificate signed by `tls.client_ca_file`
    /// whose identity matches `sidecar.peer_identity` (mTLS between kvmesh nodes); loopback is
    /// not trusted on its own.
    ClusterCert,
}

/// The `[cluster]` table: membership and residency gossip (chitchat over UDP).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterToml {
    /// Join the gossip. Required in sidecar mode; a gateway may join to learn engines.
    pub enabled: bool,
    /// Nodes gossip only with nodes of the same id.
    pub cluster_id: String,
    /// This proxy's id, unique in the cluster (default: `kvmesh-<listen address>`).
    pub node_id: String,
    /// UDP address gossip binds.
    pub gossip_listen: String,
    /// UDP address peers reach this node's gossip at (default: `gossip_listen`).
    pub advertise: String,
    /// URL peers forward requests to (default: `http://<listen>`).
    pub proxy_url: String,
    /// `host:port` of gossip seeds.
    pub seeds: Vec<String>,
    /// Milliseconds between gossip rounds (and between publishing this node's state).
    pub gossip_interval_ms: u64,
    /// Failure detector threshold (phi accrual); higher: slower but surer death verdicts.
    pub phi_threshold: f64,
    /// Seconds a dead node's state is kept before it is forgotten.
    pub dead_node_grace_secs: u64,
    /// Gossip keys, base64 of 32 bytes each (`kvmesh-proxy gossip-keygen` makes one): the first
    /// seals what this node sends, every one opens what it receives (rotation: install the new
    /// key second everywhere, then first everywhere, then drop the old). Env:
    /// `KVMESH_GOSSIP_KEYS` (comma-separated). Required unless `insecure_plaintext`.
    pub gossip_keys: Vec<String>,
    /// A file with one base64 key per line (`#` comments), used after `gossip_keys`.
    pub gossip_key_file: String,
    /// Seal outgoing gossip. Off only during a migration to encryption (step 1 of 3).
    pub encrypt_outgoing: bool,
    /// Refuse unsealed incoming gossip. Off only during a migration to encryption.
    pub verify_incoming: bool,
    /// Run gossip without keys: any host that reaches the gossip port can then join the cluster
    /// and take traffic. Only for networks where every host is trusted.
    pub insecure_plaintext: bool,
    /// Seconds a new sender's clock may differ from ours (bounds replays of old datagrams).
    pub max_clock_skew_secs: u64,
    /// The most peers tracked; further nodes are ignored (and counted) until some leave.
    pub max_peers: usize,
    /// Networks (CIDR, or single IPs) a peer's published URL may point into. Empty (default):
    /// the URL must resolve to the IP the peer advertises for gossip, and authenticated gossip
    /// must have come from that IP (loopback to loopback allowed).
    pub peer_networks: Vec<String>,
    /// Serve the cluster's state over TCP on the gossip port, and pull it from a seed at join
    /// (and after a gossip restart), so a (re)started node routes with its peers' residency
    /// within about a second instead of waiting for gossip to deliver it (docs/sidecar.md).
    /// Needs TCP open on `gossip_listen`'s port between nodes, beside UDP.
    pub bulk_sync: bool,
    /// The most bytes of state one transfer may carry, sent or pulled (about 11 bytes per
    /// digest: the default holds 6 million). A larger one is refused and gossip delivers the
    /// state instead.
    pub bulk_sync_max_bytes: usize,
    /// Least milliseconds between two publications of this node's whole residency (but for a
    /// restarted engine's, or gains that overflow the recent keys); in between, each round
    /// publishes only the digests added since (one small key), so removals wait. 0: the whole
    /// residency's changed shards every round.
    pub residency_full_interval_ms: u64,
    /// Longest milliseconds a removal waits for a whole publication (at least
    /// `residency_full_interval_ms`). Unset: 10000, or `residency_full_interval_ms` when that
    /// is longer.
    pub residency_full_max_interval_ms: Option<u64>,
    /// The removals, as a share of the digests this node published, that make a whole
    /// publication due once `residency_full_interval_ms` has passed (0 to 1).
    pub residency_stale_ratio: f64,
    /// The least milliseconds between two load beacons: this node's engine load sent straight
    /// to each peer as it changes (and every 250 ms regardless), sealed like gossip, rather
    /// than only inside the record gossip rounds carry. 0: no beacons sent or taken.
    pub load_beacon_interval_ms: u64,
}

impl Default for ClusterToml {
    fn default() -> Self {
        ClusterToml {
            enabled: false,
            cluster_id: "kvmesh".into(),
            node_id: String::new(),
            gossip_listen: "127.0.0.1:7946".into(),
            advertise: String::new(),
            proxy_url: String::new(),
            seeds: Vec::new(),
            gossip_interval_ms: 200,
            phi_threshold: 8.0,
            dead_node_grace_secs: 60,
            gossip_keys: Vec::new(),
            gossip_key_file: String::new(),
            encrypt_outgoing: true,
            verify_incoming: true,
            insecure_plaintext: false,
            max_clock_skew_secs: 60,
            max_peers: 256,
            peer_networks: Vec::new(),
            bulk_sync: true,
            bulk_sync_max_bytes: kvmesh_cluster::bulk::DEFAULT_MAX_BYTES,
            residency_full_interval_ms: kvmesh_cluster::DEFAULT_RESIDENCY_FULL_INTERVAL.as_millis()
                as u64,
            residency_full_max_interval_ms: None,
            residency_stale_ratio: kvmesh_cluster::DEFAULT_RESIDENCY_STALE_RATIO,
            load_beacon_interval_ms: 10,
        }
    }
}

/// The `[sidecar]` table.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SidecarConfig {
    /// Forward to a peer only when it saves at least this much of the `prefix` policy's cost
    /// (weighted prompt bytes: `uncached_weight` x uncached bytes + queued prefill + decode
    /// pressure) against serving locally.
    pub forward_min_saving: u64,
    /// Who may send `x-kvmesh-hop`: `loopback`, `members` or `cluster_cert`. Others get 403.
    pub accept_hop_from: HopTrust,
    /// With `accept_hop_from = "cluster_cert"`: the identity a peer's certificate must carry,
    /// either a URI SAN prefix (`spiffe://kvmesh.local/`: any URI SAN starting with it) or a
    /// DNS name pattern (`*.kvmesh.svc`: one leading label wildcard; else an exact name).
    pub peer_identity: String,
    /// Seconds a peer that refused a connection is skipped, whatever gossip says.
    pub peer_down_secs: u64,
    /// Where a request goes when no node holds any of its prefix: `local` (this engine) or
    /// `home` (the node chosen by rendezvous hashing of the prompt's first block digest, which
    /// every sidecar computes alike, so a new prefix's followers meet on one engine before
    /// gossip has spread it).
    pub cold_placement: ColdPlacement,
    /// With `cold_placement = "home"`: a node whose queued prefill exceeds this many times the
    /// candidates' mean is passed over for the next in rendezvous order (consistent hashing
    /// with bounded loads), so that a busy home does not collect every new prefix. 0: the
    /// home, whatever its load.
    pub home_load_bound: f64,
    /// With `cold_placement = "home"`: how many nodes, first in rendezvous order, a new prefix
    /// may go to; the one with the lowest `prefix` cost (queued prefill, requests in flight)
    /// comes first, then `home_load_bound` applies (1: rendezvous order alone). 1 to 16.
    pub home_choices: usize,
}

/// Placement of requests whose prefix no node holds (`sidecar.cold_placement`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ColdPlacement {
    /// Serve on the local engine.
    #[default]
    Local,
    /// Send to the prefix's rendezvous-hash home node.
    Home,
}

impl Default for SidecarConfig {
    fn default() -> Self {
        SidecarConfig {
            forward_min_saving: 4096,
            accept_hop_from: HopTrust::Loopback,
            peer_identity: String::new(),
            peer_down_secs: 5,
            cold_placement: ColdPlacement::Local,
            home_load_bound: 1.25,
            home_choices: 1,
        }
    }
}

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
            listen: "127.0.0.1:8080".into(),
            mode: Mode::Gateway,
            policy: Policy::Prefix,
            max_body_bytes: 32 << 20,
            body_read_timeout_secs: 30,
            max_inflight: 4096,
            body_budget_bytes: 256 << 20,
            threads: 0,
            log: "info,pingora_core=warn,pingora_proxy=warn".into(),
            log_format: LogFormat::Text,
            config_reload_interval_secs: 5,
            engines: Vec::new(),
            tokenizers: Vec::new(),
            routing: RoutingConfig::default(),
            residency: ResidencyConfigToml::default(),
            upstream: UpstreamConfig::default(),
            health: HealthConfig::default(),
            shutdown: ShutdownConfig::default(),
            cluster: ClusterToml::default(),
            sidecar: SidecarConfig::default(),
            picker: PickerConfig::default(),
            tls: TlsConfig::default(),
            auth: AuthConfig::default(),
            admission: AdmissionConfig::default(),
            admin: AdminConfig::default(),
            otel: OtelConfig::default(),
        }
    }
}

/// One engine behind the gateway.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineConfig {
    /// A unique name, used in metrics and logs.
    pub name: String,
    /// Base URL, `http://host:port` (no path; TLS to engines is not supported yet).
    pub url: String,
    /// Models this engine serves; empty (the default) means: ask its `/v1/models`.
    #[serde(default)]
    pub models: Vec<String>,
    /// The engine's kvagent (`http://host:port`, or `https://` verified with `upstream.ca_file`),
    /// whose `WatchResidency` feed is this engine's residency (source `engine_feed`); empty
    /// (the default): none.
    #[serde(default)]
    pub kvagent: String,
    /// A file whose first line is the kvagent's read-only token (its `auth.read_token_file`);
    /// empty: none.
    #[serde(default)]
    pub kvagent_token_file: String,
    /// The engine's KV events publisher (vLLM's or SGLang's `--kv-events-config` `endpoint`),
    /// `tcp://host:port`: the blocks it reports stored are this engine's residency (source
    /// `engine_feed`). The engine must list one model in `models`, in token mode
    /// (`[[tokenizers]]`, whose `block_tokens` is the engine's block size). Empty (the
    /// default): none.
    #[serde(default)]
    pub kv_events: String,
    /// The publisher's replay socket (`replay_endpoint`), `tcp://host:port`: missed batches are
    /// fetched from it. Empty (the default): none; then a gap in the sequence withdraws the
    /// engine's fed residency.
    #[serde(default)]
    pub kv_events_replay: String,
    /// Topic prefix subscribed to (the publisher's `topic`); empty (the default): every topic.
    #[serde(default)]
    pub kv_events_topic: String,
}

/// Most tokens in one KV block `[[tokenizers]]` accepts (vLLM's largest block is 256; engine-shim
/// and vLLM's default are 16).
pub const MAX_BLOCK_TOKENS: usize = 4096;

/// One model in token mode: its digest chain is computed over the engine's own token ids.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizerConfig {
    /// The model, as requests name it (the `model` field).
    pub model: String,
    /// A GGUF file of the model: its vocabulary, merges and chat template are used (read at
    /// start; the weights are not kept).
    pub gguf: String,
    /// The engine's KV block size, tokens (default 16: engine-shim's, and vLLM's default).
    #[serde(default = "default_block_tokens")]
    pub block_tokens: usize,
}

fn default_block_tokens() -> usize {
    16
}

/// Routing knobs; the first four are the `prefix` policy's (see docs/architecture.md).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RoutingConfig {
    /// Text-mode block size of the digest chain, bytes of canonical prompt.
    pub block_bytes: usize,
    /// The cost of one request in flight, in prompt bytes to prefill (decode pressure).
    pub decode_cost_bytes: u64,
    /// Weight of a request's own uncached bytes against work already queued (>1 favours holders).
    pub uncached_weight: f64,
    /// The fleet is imbalanced when max - min in-flight exceeds this ...
    pub balance_abs_threshold: u64,
    /// ... and max in-flight exceeds this times min in-flight; then prefixes are ignored.
    pub balance_rel_threshold: f64,
    /// Header holding the session key for the `session` policy; the body's `user` is the fallback.
    pub session_header: String,
    /// How many leading digests to send engines in `x-kvmesh-prefix-digests` (0: none).
    pub forward_digests: usize,
    /// Most blocks of a prompt hashed and recorded in the residency index per request (the
    /// leading ones, which routing compares); bounds what one huge prompt can evict.
    pub max_prefix_blocks: usize,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        let p = PrefixParams::default();
        RoutingConfig {
            block_bytes: 256,
            decode_cost_bytes: p.decode_cost_bytes,
            uncached_weight: p.uncached_weight,
            balance_abs_threshold: p.balance_abs_threshold,
            balance_rel_threshold: p.balance_rel_threshold,
            session_header: "x-session-id".into(),
            forward_digests: 32,
            max_prefix_blocks: 1024,
        }
    }
}

impl RoutingConfig {
    /// The `prefix` policy's parameters.
    pub fn prefix_params(&self) -> PrefixParams {
        PrefixParams {
            decode_cost_bytes: self.decode_cost_bytes,
            uncached_weight: self.uncached_weight,
            balance_abs_threshold: self.balance_abs_threshold,
            balance_rel_threshold: self.balance_rel_threshold,
        }
    }
}

/// Residency index bounds, as written in TOML.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ResidencyConfigToml {
    /// Most digests one engine may hold in the index (it adapts downwards, see docs).
    pub capacity_per_node: usize,
    /// Seconds an unconfirmed (optimistic) entry lives.
    pub optimistic_ttl_secs: u64,
    /// Seconds an entry confirmed by an engine's `cached_tokens` lives.
    pub reported_ttl_secs: u64,
}

impl Default for ResidencyConfigToml {
    fn default() -> Self {
        ResidencyConfigToml {
            capacity_per_node: 100_000,
            optimistic_ttl_secs: 60,
            reported_ttl_secs: 600,
        }
    }
}

/// Timeouts and retries towards engines.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamConfig {
    /// TCP connect timeout, milliseconds.
    pub connect_timeout_ms: u64,
    /// Longest wait for any read from an engine (first byte included), seconds.
    pub read_timeout_secs: u64,
    /// Most milliseconds bytes sent to an engine or peer may stay unacknowledged by its TCP
    /// stack before the connection counts as dead (Linux `TCP_USER_TIMEOUT`, with keepalive
    /// probes every fifth of it on quiet connections). Bounds how long a request sent to a host
    /// that fell off the network waits (else up to `read_timeout_secs`); it is then failed
    /// over as a broken connection. 0: the system's default (many minutes); else 1000 to
    /// 3600000.
    pub tcp_user_timeout_ms: u64,
    /// Most engines tried for one request (failover happens only before the first response byte).
    pub max_attempts: u32,
    /// PEM CA bundle that `https://` engines and peers are verified against. Empty: the system's
    /// roots (`SSL_CERT_FILE` / `SSL_CERT_DIR` respected).
    pub ca_file: String,
    /// PEM client certificate chain presented to `https://` engines and peers (mTLS between
    /// kvmesh nodes: a certificate of the cluster CA). Empty: none.
    pub client_cert_file: String,
    /// PEM private key of `client_cert_file`.
    pub client_key_file: String,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        UpstreamConfig {
            connect_timeout_ms: 1000,
            read_timeout_secs: 600,
            tcp_user_timeout_ms: 10_000,
            max_attempts: 3,
            ca_file: String::new(),
            client_cert_file: String::new(),
            client_key_file: String::new(),
        }
    }
}

/// Active health checks: `GET /v1/models` on every engine.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HealthConfig {
    /// Milliseconds between probes.
    pub interval_ms: u64,
    /// Probe timeout, milliseconds.
    pub timeout_ms: u64,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            interval_ms: 2000,
            timeout_ms: 1000,
        }
    }
}

/// Graceful shutdown on SIGTERM.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ShutdownConfig {
    /// Seconds to keep accepting after SIGTERM (lets load balancers notice).
    pub grace_period_secs: u64,
    /// Seconds in-flight requests get to finish after that.
    pub drain_timeout_secs: u64,
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        ShutdownConfig {
            grace_period_secs: 0,
            drain_timeout_secs: 5,
        }
    }
}

/// A validated engine address.
#[derive(Debug, Clone)]
pub struct EngineAddr {
    /// The engine's name.
    pub name: String,
    /// The URL as configured.
    pub url: String,
    /// The resolved socket address.
    pub addr: SocketAddr,
    /// Statically configured models (empty: discover).
    pub models: Vec<String>,
    /// Why the host did not resolve at start (`addr` is then `0.0.0.0:port`, and the engine
    /// stays down until a health probe resolves it).
    pub unresolved: Option<String>,
}

/// Command-line overrides of the common keys, applied after the file and the environment.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    /// `--listen`: `listen`.
    pub listen: Option<String>,
    /// `--engine URL`, repeated: replaces `[[engines]]` with engines named `engine-0`, ...
    pub engines: Vec<String>,
    /// `--policy`: `policy`.
    pub policy: Option<String>,
    /// `--mode`: `mode`.
    pub mode: Option<String>,
    /// `--log-format`: `log_format`.
    pub log_format: Option<String>,
}

/// `value` as one of a unit enum's snake_case names; the error names `flag` and the choices.
fn enum_value<T: serde::de::DeserializeOwned>(
    flag: &str,
    value: &str,
    choices: &str,
) -> Result<T, ConfigError> {
    use serde::de::IntoDeserializer;
    let de: serde::de::value::StrDeserializer<'_, serde::de::value::Error> =
        value.into_deserializer();
    T::deserialize(de)
        .map_err(|_| ConfigError::Invalid(format!("{flag} {value:?}: expected one of {choices}")))
}

impl Overrides {
    fn apply(&self, cfg: &mut ProxyConfig) -> Result<(), ConfigError> {
        if let Some(v) = &self.listen {
            cfg.listen.clone_from(v);
        }
        if !self.engines.is_empty() {
            cfg.engines = self
                .engines
                .iter()
                .enumerate()
                .map(|(i, url)| EngineConfig {
                    name: format!("engine-{i}"),
                    url: url.clone(),
                    models: Vec::new(),
                    kvagent: String::new(),
                    kvagent_token_file: String::new(),
                    kv_events: String::new(),
                    kv_events_replay: String::new(),
                    kv_events_topic: String::new(),
                })
                .collect();
        }
        if let Some(v) = &self.policy {
            cfg.policy = enum_value(
                "--policy",
                v,
                "prefix, round_robin, least_inflight, power_of_two, session",
            )?;
        }
        if let Some(v) = &self.mode {
            cfg.mode = enum_value("--mode", v, "gateway, sidecar, picker")?;
        }
        if let Some(v) = &self.log_format {
            cfg.log_format = enum_value("--log-format", v, "text, json")?;
        }
        Ok(())
    }
}

impl ConfigError {
    /// The message without the variant's prefix (for lists of problems).
    fn message(&self) -> String {
        match self {
            ConfigError::Invalid(m) => m.clone(),
            other => other.to_string(),
        }
    }
}

/// `Ok` when there is no problem; else one [`ConfigError::Invalid`] that lists them all.
fn problems_to_result(problems: Vec<String>) -> Result<(), ConfigError> {
    match problems.len() {
        0 => Ok(()),
        1 => Err(ConfigError::Invalid(problems.concat())),
        _ => Err(ConfigError::Invalid(list(&problems))),
    }
}

/// Several problems as one message, one per line.
fn list(problems: &[String]) -> String {
    format!(
        "{} problems:\n  - {}",
        problems.len(),
        problems.join("\n  - ")
    )
}

impl ProxyConfig {
    /// The worker threads the proxy runs: `threads`, or one per CPU when 0.
    pub fn worker_threads(&self) -> usize {
        match self.threads {
            0 => std::thread::available_parallelism().map_or(2, |n| n.get()),
            n => n,
        }
    }

    /// The problems of an engine's `kv_events` settings.
    fn check_kv_events(&self, e: &EngineConfig, p: &mut Vec<String>) {
        if e.kv_events.is_empty() {
            for (key, v) in [
                ("kv_events_replay", &e.kv_events_replay),
                ("kv_events_topic", &e.kv_events_topic),
            ] {
                if !v.is_empty() {
                    p.push(format!(
                        "engine {:?}: `{key}` is set without `kv_events`",
                        e.name
                    ));
                }
            }
            return;
        }
        for (key, v) in [
            ("kv_events", &e.kv_events),
            ("kv_events_replay", &e.kv_events_replay),
        ] {
            if !v.is_empty() {
                if let Err(m) = zmq_tcp_addr(v) {
                    p.push(format!("engine {:?}: `{key}`: {m}", e.name));
                }
            }
        }
        if !e.kvagent.is_empty() {
            p.push(format!(
                "engine {:?}: one residency feed per engine: `kvagent` or `kv_events`, not both",
                e.name
            ));
        }
        match e.models.as_slice() {
            [m] if self.tokenizers.iter().any(|t| &t.model == m) => {}
            [m] => p.push(format!(
                "engine {:?}: `kv_events` needs its model {m:?} in token mode (a [[tokenizers]] entry): the events name blocks by token ids",
                e.name
            )),
            _ => p.push(format!(
                "engine {:?}: `kv_events` needs exactly one model in `models` (the one its events are for)",
                e.name
            )),
        }
    }

    /// Reads `path` (or defaults when `None`), applies env overrides, validates.
    pub fn load(path: Option<&Path>) -> Result<Self, ConfigError> {
        Self::load_with(path, &Overrides::default())
    }

    /// [`Self::load`], with command-line `overrides` applied after the environment.
    pub fn load_with(path: Option<&Path>, overrides: &Overrides) -> Result<Self, ConfigError> {
        let (text, origin) = match path {
            Some(p) => (
                std::fs::read_to_string(p).map_err(|source| ConfigError::Read {
                    path: p.display().to_string(),
                    source,
                })?,
                p.display().to_string(),
            ),
            None => (String::new(), "(no file)".to_string()),
        };
        let vars = utf8_env()?;
        let mut cfg =
            Self::from_toml_with_env(&text, vars).map_err(|message| ConfigError::Parse {
                path: origin,
                message,
            })?;
        if let Ok(v) = std::env::var("KVMESH_GOSSIP_KEYS") {
            cfg.cluster.gossip_keys = v
                .split(',')
                .map(str::trim)
                .filter(|k| !k.is_empty())
                .map(String::from)
                .collect();
        }
        overrides.apply(&mut cfg)?;
        // A host name is resolved once, here: node_id and proxy_url derive from it on every
        // gossip round, which must not wait for DNS (nor disagree with the gossip identity).
        if cfg.cluster.enabled
            && !cfg.cluster.advertise.is_empty()
            && cfg.cluster.advertise.parse::<SocketAddr>().is_err()
        {
            let addr = resolve_advertise(&cfg.cluster.advertise).map_err(ConfigError::Invalid)?;
            cfg.cluster.advertise = addr.to_string();
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Parses TOML text (no env, no validation).
    /// serde stops at the first error; when the tables hold several unknown or mistyped keys,
    /// the error lists them all ([`keys`]), then serde's own message (with its line), which may
    /// be about something else (a bad enum value, an entry of `[[engines]]`).
    pub fn from_toml(text: &str) -> Result<Self, String> {
        toml::from_str(text).map_err(|e| {
            let listed = toml::from_str::<toml::Table>(text).ok().and_then(|file| {
                let schema = toml::Table::try_from(ProxyConfig::default()).ok()?;
                let problems = keys::problems(&file, &schema);
                (problems.len() > 1).then(|| {
                    format!(
                        "{} unknown or mistyped keys:\n  - {}\nthe TOML reader's first error: {}",
                        problems.len(),
                        problems.join("\n  - "),
                        e.to_string().trim_end()
                    )
                })
            });
            listed.unwrap_or_else(|| e.to_string())
        })
    }

    /// Parses TOML text with the `KVMESH_*` overrides among `vars` applied ([`env`]; no
    /// validation). The text's own errors (with its line numbers) are reported first, before
    /// any override can mask them or be blamed for them.
    pub fn from_toml_with_env(
        text: &str,
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, String> {
        let from_file = Self::from_toml(text)?;
        let mut table: toml::Table = toml::from_str(text).map_err(|e| e.to_string())?;
        let schema = toml::Table::try_from(ProxyConfig::default())
            .map_err(|e| format!("internal: the default configuration as TOML: {e}"))?;
        let applied = env::apply(&mut table, &schema, vars).map_err(|e| e.to_string())?;
        if applied.is_empty() {
            return Ok(from_file);
        }
        // Re-read as text so errors name the key (toml reports paths from documents).
        let merged = toml::to_string(&table).map_err(|e| e.to_string())?;
        Self::from_toml(&merged)
            .map_err(|e| format!("with the overrides {}: {e}", applied.join(", ")))
    }

    /// Checks every value; the error names the key, and lists every problem found, not only the
    /// first.
    pub fn validate(&self) -> Result<(), ConfigError> {
        problems_to_result(self.problems())
    }

    /// Every problem [`Self::validate`] reports, each naming its key, each once; empty when
    /// valid.
    pub fn problems(&self) -> Vec<String> {
        let mut p = self.problems_in_order();
        let mut seen = std::collections::HashSet::new();
        p.retain(|m| seen.insert(m.clone()));
        p
    }

    fn problems_in_order(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.listen.parse::<SocketAddr>().is_err() {
            p.push(format!(
                "`listen` = {:?} is not an IP:port address",
                self.listen
            ));
        }
        if self.engines.is_empty() && !(self.cluster.enabled && self.mode != Mode::Sidecar) {
            p.push("`engines` is empty: list at least one [[engines]] with a name and url".into());
        }
        let mut tokenized = std::collections::HashSet::new();
        for t in &self.tokenizers {
            if t.model.is_empty() {
                p.push("`tokenizers[].model` must not be empty".into());
            } else if !tokenized.insert(t.model.as_str()) {
                p.push(format!("model {:?} has two [[tokenizers]]", t.model));
            }
            if t.gguf.is_empty() {
                p.push(format!(
                    "tokenizer of {:?}: `gguf` (a file) is required",
                    t.model
                ));
            }
            if !(1..=MAX_BLOCK_TOKENS).contains(&t.block_tokens) {
                p.push(format!(
                    "tokenizer of {:?}: `block_tokens` = {} must be between 1 and {MAX_BLOCK_TOKENS}",
                    t.model, t.block_tokens
                ));
            }
        }
        let mut names = std::collections::HashSet::new();
        for e in &self.engines {
            if !names.insert(e.name.as_str()) {
                p.push(format!("engine name {:?} appears twice", e.name));
            }
            // Syntax only: a name that does not resolve yet (a container or pod not started)
            // is resolved again at every health probe.
            if let Err(m) = engine_url_host(&e.url) {
                p.push(format!("engine {:?}: {m}", e.name));
            }
            if !e.kvagent.is_empty() {
                if let Err(m) = engine_url_host(&e.kvagent) {
                    p.push(format!("engine {:?}: `kvagent`: {m}", e.name));
                } else if e.kvagent.starts_with("https://") && self.upstream.ca_file.is_empty() {
                    p.push(format!(
                        "engine {:?}: an https:// `kvagent` is verified against `upstream.ca_file`, which is not set",
                        e.name
                    ));
                }
            } else if !e.kvagent_token_file.is_empty() {
                p.push(format!(
                    "engine {:?}: `kvagent_token_file` is set without a `kvagent`",
                    e.name
                ));
            }
            self.check_kv_events(e, &mut p);
        }
        if self.max_body_bytes == 0 {
            p.push("`max_body_bytes` must be > 0".into());
        }
        if self.max_body_bytes > MAX_BODY_BYTES_LIMIT {
            p.push(format!(
                "`max_body_bytes` ({}) must be at most {MAX_BODY_BYTES_LIMIT} (1 GiB)",
                self.max_body_bytes
            ));
        }
        if self.body_read_timeout_secs == 0 || self.body_read_timeout_secs > 86_400 {
            p.push("`body_read_timeout_secs` must be between 1 and 86400".into());
        }
        if self.max_inflight == 0 {
            p.push("`max_inflight` must be > 0".into());
        }
        if self.body_budget_bytes < self.max_body_bytes {
            p.push(format!(
                "`body_budget_bytes` ({}) must be >= `max_body_bytes` ({})",
                self.body_budget_bytes, self.max_body_bytes
            ));
        }
        if self.routing.max_prefix_blocks == 0 {
            p.push("`routing.max_prefix_blocks` must be > 0".into());
        }
        if self.routing.block_bytes == 0 {
            p.push("`routing.block_bytes` must be > 0".into());
        }
        if !self.routing.uncached_weight.is_finite() || self.routing.uncached_weight < 0.0 {
            p.push("`routing.uncached_weight` must be a finite number >= 0".into());
        }
        if self.routing.balance_rel_threshold.is_nan() || self.routing.balance_rel_threshold < 1.0 {
            p.push("`routing.balance_rel_threshold` must be >= 1.0".into());
        }
        if !(1..=MAX_CAPACITY_PER_NODE).contains(&self.residency.capacity_per_node) {
            p.push(format!(
                "`residency.capacity_per_node` must be between 1 and {MAX_CAPACITY_PER_NODE}"
            ));
        }
        // Pingora retries a request at most 16 times (its `max_retries`): more would be
        // silently fewer.
        if !(1..=16).contains(&self.upstream.max_attempts) {
            p.push("`upstream.max_attempts` must be in 1..=16".into());
        }
        if self.upstream.connect_timeout_ms == 0 || self.upstream.read_timeout_secs == 0 {
            p.push("`upstream` timeouts must be > 0".into());
        }
        // Under a second, one lost segment (TCP retransmits after 200 ms at least) would
        // break a healthy connection; TCP_USER_TIMEOUT takes milliseconds as a u32.
        let t = self.upstream.tcp_user_timeout_ms;
        if t != 0 && !(1000..=3_600_000).contains(&t) {
            p.push(format!(
                "`upstream.tcp_user_timeout_ms` ({t}) must be 0 (the system's default) or from \
                 1000 to 3600000"
            ));
        }
        if self.health.interval_ms == 0 || self.health.timeout_ms == 0 {
            p.push("`health` interval and timeout must be > 0".into());
        }
        if self.mode == Mode::Sidecar {
            if self.engines.len() != 1 {
                p.push(format!(
                    "`mode = \"sidecar\"` fronts exactly one engine; {} are listed",
                    self.engines.len()
                ));
            }
            if !self.cluster.enabled {
                p.push("`mode = \"sidecar\"` needs `[cluster] enabled = true`".into());
            }
        }
        p.extend(self.otel.problems());
        let a = &self.admin;
        // One port, two spellings (0.0.0.0 covers every IP): the second bind would fail.
        let clash = |x: SocketAddr, y: SocketAddr| {
            x.port() == y.port()
                && (x.ip() == y.ip() || x.ip().is_unspecified() || y.ip().is_unspecified())
        };
        if self.mode == Mode::Picker {
            if !a.listen.is_empty() {
                p.push(
                    "`admin.listen` is for gateway and sidecar modes; the picker's is \
                     `picker.metrics_listen`"
                        .into(),
                );
            }
        } else if !a.listen.is_empty() {
            match a.listen.parse::<SocketAddr>() {
                Err(_) => p.push(format!(
                    "`admin.listen` = {:?} is not an IP:port address",
                    a.listen
                )),
                Ok(addr) if addr.port() == 0 => p.push(format!(
                    "`admin.listen` = {:?}: port 0 would be a port nobody knows",
                    a.listen
                )),
                Ok(addr)
                    if self
                        .listen
                        .parse::<SocketAddr>()
                        .is_ok_and(|api| clash(api, addr)) =>
                {
                    p.push(format!(
                        "`admin.listen` = {:?} takes the port of `listen` = {:?}",
                        a.listen, self.listen
                    ))
                }
                Ok(_) => {}
            }
        } else if !a.on_api_listener {
            p.push(
                "`admin.on_api_listener = false` needs `admin.listen`: else /metrics and /ready \
                 are served nowhere"
                    .into(),
            );
        }
        if self.mode == Mode::Picker {
            let pk = &self.picker;
            if !self.tls.client_ca_file.is_empty() && !self.tls.require_client_cert {
                p.push(
                    "in picker mode `tls.client_ca_file` needs `tls.require_client_cert = true`: \
                     the picker never looks at who a client is, so a certificate it may leave \
                     out protects nothing"
                        .into(),
                );
            }
            if pk.fallbacks > MAX_PICKER_FALLBACKS {
                p.push(format!(
                    "`picker.fallbacks` ({}) must be at most {MAX_PICKER_FALLBACKS}",
                    pk.fallbacks
                ));
            }
            if !(MIN_PICKER_MESSAGE_BYTES..=MAX_PICKER_MESSAGE_BYTES)
                .contains(&pk.max_message_bytes)
            {
                p.push(format!(
                    "`picker.max_message_bytes` ({}) must be from {MIN_PICKER_MESSAGE_BYTES} \
                     (80 KiB) to {MAX_PICKER_MESSAGE_BYTES} (64 MiB)",
                    pk.max_message_bytes
                ));
            } else if pk.message_budget_bytes
                < pk.max_message_bytes
                    .saturating_mul(4)
                    .saturating_add(128 << 10)
            {
                p.push(format!(
                    "`picker.message_budget_bytes` ({}) must be at least 4 x \
                     `picker.max_message_bytes` ({}) + 131072: a stream with one such message \
                     is charged that much",
                    pk.message_budget_bytes, pk.max_message_bytes
                ));
            }
            let mut seen = std::collections::HashSet::new();
            for (key, value) in [
                ("picker.listen", &pk.listen),
                ("picker.health_listen", &pk.health_listen),
                ("picker.metrics_listen", &pk.metrics_listen),
            ] {
                let Ok(addr) = value.parse::<SocketAddr>() else {
                    p.push(format!("`{key}` = {value:?} is not an IP:port address"));
                    continue;
                };
                if addr.port() != 0 && !seen.insert(addr) {
                    p.push(format!(
                        "`{key}` = {value:?} is used by another picker listener"
                    ));
                }
            }
        }
        if self.cluster.enabled {
            if let Err(e) = self.cluster_config() {
                p.push(e.message());
            }
            let c = &self.cluster;
            if c.gossip_interval_ms == 0 || c.phi_threshold.is_nan() || c.phi_threshold <= 0.0 {
                p.push(
                    "`cluster.gossip_interval_ms` and `cluster.phi_threshold` must be > 0".into(),
                );
            }
            if c.max_peers == 0 || c.max_clock_skew_secs == 0 {
                p.push("`cluster.max_peers` and `cluster.max_clock_skew_secs` must be > 0".into());
            }
            if c.bulk_sync && !(1024..=MAX_BULK_SYNC_BYTES).contains(&c.bulk_sync_max_bytes) {
                p.push(format!(
                    "`cluster.bulk_sync_max_bytes` must be between 1024 and {MAX_BULK_SYNC_BYTES}"
                ));
            }
            if c.residency_full_interval_ms > MAX_RESIDENCY_FULL_INTERVAL_MS {
                p.push(format!(
                    "`cluster.residency_full_interval_ms` must be at most {MAX_RESIDENCY_FULL_INTERVAL_MS} (removals reach peers that late)"
                ));
            }
            if c.residency_full_max_interval_ms.is_some_and(|m| {
                m > MAX_RESIDENCY_FULL_INTERVAL_MS || m < c.residency_full_interval_ms
            }) {
                p.push(format!(
                    "`cluster.residency_full_max_interval_ms` must be between `residency_full_interval_ms` ({}) and {MAX_RESIDENCY_FULL_INTERVAL_MS} (removals reach peers that late)",
                    c.residency_full_interval_ms
                ));
            }
            if !(0.0..=1.0).contains(&c.residency_stale_ratio) {
                p.push("`cluster.residency_stale_ratio` must be between 0 and 1 (a share of the digests published)".into());
            }
            if c.load_beacon_interval_ms > MAX_LOAD_BEACON_INTERVAL_MS {
                p.push(format!(
                    "`cluster.load_beacon_interval_ms` must be at most {MAX_LOAD_BEACON_INTERVAL_MS} (0 turns beacons off)"
                ));
            }
            if let Err(e) = self.peer_networks() {
                p.push(e.message());
            }
        }
        self.security_problems(&mut p);
        if tracing_subscriber::EnvFilter::try_new(&self.log).is_err() {
            p.push(format!("`log` = {:?} is not a valid log filter", self.log));
        }
        p
    }

    /// The `[tls]`, `[auth]`, `[admission]` and upstream TLS checks (files are read: a key file
    /// that does not parse, or a missing certificate, is reported here, not at the first
    /// request).
    fn security_problems(&self, p: &mut Vec<String>) {
        let t = &self.tls;
        if let Err(m) = t.check() {
            p.push(m);
        }
        if self.auth.reload_interval_secs == 0 {
            p.push("`auth.reload_interval_secs` must be > 0".into());
        }
        let u = &self.upstream;
        let pair_ok = u.client_cert_file.is_empty() == u.client_key_file.is_empty();
        if !pair_ok {
            p.push("`upstream.client_cert_file` and `upstream.client_key_file` go together".into());
        }
        // Loading a half-given pair would only repeat that error less clearly.
        if pair_ok {
            if let Err(e) = crate::tls::UpstreamTls::from_config(u) {
                p.push(format!("`[upstream]` TLS: {e}"));
            }
        }
        let bound = self.sidecar.home_load_bound;
        if !(bound == 0.0 || (1.0..=100.0).contains(&bound)) {
            p.push("`sidecar.home_load_bound` must be 0 (off) or between 1 and 100".into());
        }
        if !(1..=16).contains(&self.sidecar.home_choices) {
            p.push("`sidecar.home_choices` must be between 1 and 16".into());
        }
        if self.sidecar.accept_hop_from == HopTrust::ClusterCert {
            if t.client_ca_file.is_empty() {
                p.push("`sidecar.accept_hop_from = \"cluster_cert\"` needs `tls.client_ca_file` (the cluster CA)".into());
            }
            if let Err(e) = crate::tls::PeerIdentity::parse(&self.sidecar.peer_identity) {
                p.push(format!("`sidecar.peer_identity`: {e}"));
            }
            if self.mode == Mode::Sidecar && u.client_cert_file.is_empty() {
                p.push("`sidecar.accept_hop_from = \"cluster_cert\"` needs `upstream.client_cert_file`: \
                     forwards to peers must present this node's cluster certificate".into());
            }
        }
        if self.mode == Mode::Picker {
            let a = &self.admission;
            if !a.model_max_inflight.is_empty() || a.default_model_max_inflight > 0 {
                p.push(
                    "`[admission]` per-model caps are not supported in `mode = \"picker\"` yet"
                        .into(),
                );
            }
        }
        if self.auth.enabled() {
            if self.mode == Mode::Picker {
                p.push(
                    "`[auth]` API keys are not supported in `mode = \"picker\"` yet: \
                     authenticate in Envoy (ext_authz) in front of the picker"
                        .into(),
                );
            }
            if let Err(e) = crate::auth::load_keys(&self.auth) {
                p.push(format!("`[auth]`: {e}"));
            }
        }
        if let Err(m) = self.admission.check() {
            p.push(m);
        }
    }

    /// The engines with resolved addresses (call after [`Self::validate`]).
    pub fn engine_addrs(&self) -> Result<Vec<EngineAddr>, ConfigError> {
        self.engines
            .iter()
            .map(|e| {
                let invalid = |m: String| ConfigError::Invalid(format!("engine {:?}: {m}", e.name));
                let (_, port) = engine_url_host(&e.url).map_err(invalid)?;
                let (addr, unresolved) = match parse_engine_url(&e.url) {
                    Ok(addr) => (addr, None),
                    // Down until a probe resolves it.
                    Err(m) => (
                        SocketAddr::from((std::net::Ipv4Addr::UNSPECIFIED, port)),
                        Some(m),
                    ),
                };
                Ok(EngineAddr {
                    name: e.name.clone(),
                    url: e.url.clone(),
                    addr,
                    unresolved,
                    models: e.models.clone(),
                })
            })
            .collect()
    }

    /// The gossip configuration, with defaults filled in (call when `cluster.enabled`).
    pub fn cluster_config(&self) -> Result<kvmesh_cluster::ClusterConfig, ConfigError> {
        let c = &self.cluster;
        let bad = |m: String| ConfigError::Invalid(m);
        let listen: SocketAddr = c.gossip_listen.parse().map_err(|_| {
            bad(format!(
                "`cluster.gossip_listen` = {:?} is not an IP:port address",
                c.gossip_listen
            ))
        })?;
        let advertise: SocketAddr = if c.advertise.is_empty() {
            listen
        } else {
            resolve_advertise(&c.advertise).map_err(bad)?
        };
        if advertise.ip().is_unspecified() {
            return Err(bad(
                "`cluster.advertise` must be an address peers can reach, not 0.0.0.0".into(),
            ));
        }
        for s in &c.seeds {
            if !s.contains(':') {
                return Err(bad(format!("`cluster.seeds`: {s:?} is not host:port")));
            }
        }
        Ok(kvmesh_cluster::ClusterConfig {
            cluster_id: c.cluster_id.clone(),
            node_id: self.node_id(),
            listen,
            advertise,
            seeds: c.seeds.clone(),
            gossip_interval: Duration::from_millis(c.gossip_interval_ms),
            phi_threshold: c.phi_threshold,
            dead_node_grace: Duration::from_secs(c.dead_node_grace_secs),
            security: self.gossip_security()?,
            max_peers: c.max_peers,
            bulk_sync: c.bulk_sync,
            bulk_max_bytes: c.bulk_sync_max_bytes,
            residency_full: kvmesh_cluster::FullPublication {
                min_interval: Duration::from_millis(c.residency_full_interval_ms),
                max_interval: Duration::from_millis(c.residency_full_max_interval_ms.unwrap_or(
                    c.residency_full_interval_ms.max(
                        kvmesh_cluster::DEFAULT_RESIDENCY_FULL_MAX_INTERVAL.as_millis() as u64,
                    ),
                )),
                stale_ratio: c.residency_stale_ratio,
            },
        })
    }

    /// Gossip keys and switches from `[cluster]` (reads `gossip_key_file`).
    fn gossip_security(&self) -> Result<kvmesh_cluster::GossipSecurity, ConfigError> {
        let c = &self.cluster;
        let bad = |m: String| ConfigError::Invalid(m);
        let mut keys = c.gossip_keys.clone();
        if !c.gossip_key_file.is_empty() {
            let text = std::fs::read_to_string(&c.gossip_key_file).map_err(|e| {
                bad(format!(
                    "`cluster.gossip_key_file` = {:?}: {e}",
                    c.gossip_key_file
                ))
            })?;
            keys.extend(
                text.lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty() && !l.starts_with('#'))
                    .map(String::from),
            );
        }
        if keys.is_empty() {
            if !c.insecure_plaintext {
                return Err(bad(
                    "gossip needs a key: set `cluster.gossip_keys` or `cluster.gossip_key_file` \
                     (make one with `kvmesh-proxy gossip-keygen`), or set \
                     `cluster.insecure_plaintext = true` on a network where every host is trusted"
                        .into(),
                ));
            }
            return Ok(kvmesh_cluster::GossipSecurity::plaintext());
        }
        if c.insecure_plaintext {
            return Err(bad(
                "`cluster.insecure_plaintext = true` contradicts the configured gossip keys".into(),
            ));
        }
        let keyring = kvmesh_cluster::Keyring::from_base64(&keys)
            .map_err(|e| bad(format!("`cluster.gossip_keys`: {e}")))?;
        Ok(kvmesh_cluster::GossipSecurity {
            keyring: Some(keyring),
            encrypt_outgoing: c.encrypt_outgoing,
            verify_incoming: c.verify_incoming,
            max_clock_skew: Duration::from_secs(c.max_clock_skew_secs),
        })
    }

    /// `cluster.peer_networks`, parsed (a bare IP is a one-address network).
    pub fn peer_networks(&self) -> Result<Vec<ipnet::IpNet>, ConfigError> {
        self.cluster
            .peer_networks
            .iter()
            .map(|n| {
                n.parse::<ipnet::IpNet>()
                    .or_else(|_| n.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
                    .map_err(|_| {
                        ConfigError::Invalid(format!(
                            "`cluster.peer_networks`: {n:?} is not a CIDR network or an IP address"
                        ))
                    })
            })
            .collect()
    }

    /// This proxy's node id in the cluster (default: `kvmesh-<reachable listen address>`).
    pub fn node_id(&self) -> String {
        if self.cluster.node_id.is_empty() {
            format!("kvmesh-{}", self.reachable_listen())
        } else {
            self.cluster.node_id.clone()
        }
    }

    /// The URL peers forward to (default: `http(s)://<reachable listen address>`; `https://`
    /// when the listener speaks TLS).
    pub fn proxy_url(&self) -> String {
        if self.cluster.proxy_url.is_empty() {
            let scheme = if self.tls.enabled() { "https" } else { "http" };
            format!("{scheme}://{}", self.reachable_listen())
        } else {
            self.cluster.proxy_url.clone()
        }
    }

    /// `listen`, with an unspecified IP (`0.0.0.0`, `::`) replaced by the advertised gossip IP:
    /// a peer cannot forward to `0.0.0.0`, and every container listening on `0.0.0.0:8080`
    /// would otherwise default to the same node id.
    fn reachable_listen(&self) -> String {
        let Ok(listen) = self.listen.parse::<SocketAddr>() else {
            return self.listen.clone();
        };
        if !listen.ip().is_unspecified() {
            return self.listen.clone();
        }
        let gossip = if self.cluster.advertise.is_empty() {
            &self.cluster.gossip_listen
        } else {
            &self.cluster.advertise
        };
        match resolve_advertise(gossip) {
            Ok(a) if !a.ip().is_unspecified() => SocketAddr::new(a.ip(), listen.port()).to_string(),
            _ => self.listen.clone(),
        }
    }

    /// The residency index configuration.
    pub fn residency_config(&self) -> kvmesh_filters::residency::ResidencyConfig {
        kvmesh_filters::residency::ResidencyConfig {
            capacity_per_node: self.residency.capacity_per_node,
            optimistic_ttl: Duration::from_secs(self.residency.optimistic_ttl_secs),
            reported_ttl: Duration::from_secs(self.residency.reported_ttl_secs),
            ..Default::default()
        }
    }
}

/// `http://host:port` -> a socket address (the host is resolved now).
pub fn parse_engine_url(url: &str) -> Result<SocketAddr, String> {
    let (host, port) = engine_url_host(url)?;
    (host.as_str(), port)
        .to_socket_addrs()
        .map_err(|e| format!("url {url:?}: cannot resolve host: {e}"))?
        .next()
        .ok_or_else(|| format!("url {url:?}: host resolves to no address"))
}

/// The process environment's variables that are valid UTF-8; a `KVMESH_*` one that is not is
/// an error (it cannot be applied, and must not be ignored). Others are not ours to judge.
fn utf8_env() -> Result<Vec<(String, String)>, ConfigError> {
    let mut vars = Vec::new();
    for (k, v) in std::env::vars_os() {
        match (k.into_string(), v.into_string()) {
            (Ok(k), Ok(v)) => vars.push((k, v)),
            (Ok(k), Err(_)) if k.starts_with(env::PREFIX) => {
                return Err(ConfigError::Invalid(format!("{k}: the value is not UTF-8")))
            }
            (Err(k), _) if k.as_encoded_bytes().starts_with(env::PREFIX.as_bytes()) => {
                return Err(ConfigError::Invalid(format!(
                    "{}: the variable's name is not UTF-8",
                    k.to_string_lossy()
                )))
            }
            _ => {}
        }
    }
    Ok(vars)
}

/// `cluster.advertise`: an `IP:port`, or a `host:port` resolved once at start (a container's
/// or pod's own name), IPv4 preferred.
fn resolve_advertise(value: &str) -> Result<SocketAddr, String> {
    if let Ok(addr) = value.parse() {
        return Ok(addr);
    }
    let addrs: Vec<SocketAddr> = value
        .to_socket_addrs()
        .map_err(|e| {
            format!("`cluster.advertise` = {value:?} is neither IP:port nor a host:port that resolves: {e}")
        })?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| format!("`cluster.advertise` = {value:?} resolves to no address"))
}

/// `host:port` of a ZeroMQ `tcp://host:port` endpoint (a name, an IPv4 address, or an IPv6
/// address in brackets).
pub fn zmq_tcp_addr(endpoint: &str) -> Result<String, String> {
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| format!("{endpoint:?} must be tcp://host:port (ipc:// is not supported)"))?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| format!("{endpoint:?} has no port"))?;
    if host.is_empty() || host == "*" {
        return Err(format!(
            "{endpoint:?} names no host: give the address the engine publishes on, not its bind address"
        ));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(rest.to_string()),
        _ => Err(format!("{endpoint:?}: port {port:?} is not 1 to 65535")),
    }
}

/// Checks an engine or peer URL (`http://host[:port]` or `https://host[:port]`, no path)
/// without resolving it: host and port.
pub fn engine_url_host(url: &str) -> Result<(String, u16), String> {
    let uri: http::Uri = url
        .parse()
        .map_err(|e| format!("url {url:?} is not a URL: {e}"))?;
    let default_port = match uri.scheme_str() {
        Some("http") => 80,
        Some("https") => 443,
        _ => return Err(format!("url {url:?} must start with http:// or https://")),
    };
    if !matches!(uri.path(), "" | "/") {
        return Err(format!(
            "url {url:?} must not have a path; kvmesh appends the OpenAI paths itself"
        ));
    }
    let host = uri
        .host()
        .ok_or_else(|| format!("url {url:?} has no host"))?;
    let port = uri.port_u16().unwrap_or(default_port);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Ok((host.to_string(), port))
}

/// Whether an engine or peer URL is `https://`.
pub fn url_is_tls(url: &str) -> bool {
    url.get(..8)
        .is_some_and(|s| s.eq_ignore_ascii_case("https://"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_overrides_reach_every_table_and_unspecified_listen_defaults_are_reachable() {
        let vars = [
            ("KVMESH_LISTEN", "0.0.0.0:8080"),
            ("KVMESH_MODE", "sidecar"),
            (
                "KVMESH_ENGINES",
                r#"[{ name = "e", url = "http://127.0.0.1:9" }]"#,
            ),
            ("KVMESH_CLUSTER__ENABLED", "true"),
            ("KVMESH_CLUSTER__INSECURE_PLAINTEXT", "true"),
            ("KVMESH_CLUSTER__GOSSIP_LISTEN", "0.0.0.0:7946"),
            ("KVMESH_CLUSTER__ADVERTISE", "localhost:7946"),
            ("KVMESH_SIDECAR__ACCEPT_HOP_FROM", "members"),
            ("KVMESH_ADMISSION__MODEL_MAX_INFLIGHT", "{ m = 2 }"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        let c = ProxyConfig::from_toml_with_env("policy = \"round_robin\"\n", vars).unwrap();
        c.validate().unwrap();
        assert_eq!(c.mode, Mode::Sidecar);
        assert_eq!(c.policy, Policy::RoundRobin, "the file's keys stay");
        assert_eq!(c.sidecar.accept_hop_from, HopTrust::Members);
        assert_eq!(c.admission.cap("m"), Some(2));
        // Not 0.0.0.0: the advertised host's address, with the listen port.
        let gossip = c.cluster_config().unwrap();
        assert!(gossip.advertise.ip().is_loopback(), "{}", gossip.advertise);
        let ip = gossip.advertise.ip();
        assert_eq!(c.proxy_url(), format!("http://{ip}:8080"));
        assert_eq!(c.node_id(), format!("kvmesh-{ip}:8080"));
        let err = ProxyConfig::from_toml_with_env(
            "",
            [("KVMESH_ROUTING__BLOCK_BYTE".to_string(), "1".to_string())],
        )
        .unwrap_err();
        assert!(err.contains("KVMESH_ROUTING__BLOCK_BYTES"), "{err}");
        let err = ProxyConfig::from_toml_with_env(
            "",
            [("KVMESH_POLICY".to_string(), "fastest".to_string())],
        )
        .unwrap_err();
        assert!(
            err.contains("KVMESH_POLICY") && err.contains("policy"),
            "{err}"
        );
    }

    #[test]
    fn a_pickers_client_ca_needs_required_certificates_and_capacity_is_bounded() {
        let base = "mode = \"picker\"\n[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:9\"\n";
        let tls =
            "[tls]\ncert_file = \"c.pem\"\nkey_file = \"k.pem\"\nclient_ca_file = \"ca.pem\"\n";
        let mentions = |toml: String, needle: &str| {
            ProxyConfig::from_toml(&toml)
                .unwrap()
                .problems()
                .iter()
                .any(|p| p.contains(needle))
        };
        assert!(mentions(format!("{base}{tls}"), "require_client_cert"));
        assert!(!mentions(
            format!("{base}{tls}require_client_cert = true\n"),
            "require_client_cert"
        ));
        let message = |n: usize, budget: usize| {
            format!("{base}[picker]\nmax_message_bytes = {n}\nmessage_budget_bytes = {budget}\n")
        };
        let budget = 1 << 30;
        assert!(mentions(
            message(MIN_PICKER_MESSAGE_BYTES - 1, budget),
            "(80 KiB)"
        ));
        assert!(mentions(
            message(MAX_PICKER_MESSAGE_BYTES + 1, budget),
            "(64 MiB)"
        ));
        assert!(!mentions(
            message(MIN_PICKER_MESSAGE_BYTES, budget),
            "message_bytes"
        ));
        assert!(!mentions(
            message(MAX_PICKER_MESSAGE_BYTES, budget),
            "message_bytes"
        ));
        let least = (4 << 21) + (128 << 10);
        assert!(mentions(message(2 << 20, least - 1), "at least 4 x"));
        assert!(!mentions(message(2 << 20, least), "message_bytes"));
        let capacity = |n: usize| format!("{base}[residency]\ncapacity_per_node = {n}\n");
        assert!(mentions(
            capacity(MAX_CAPACITY_PER_NODE + 1),
            "capacity_per_node"
        ));
        assert!(!mentions(
            capacity(MAX_CAPACITY_PER_NODE),
            "capacity_per_node"
        ));
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let c = ProxyConfig::from_toml("[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:9\"\n")
            .unwrap();
        c.validate().unwrap();
        assert_eq!(c.listen, "127.0.0.1:8080");
        assert_eq!(c.policy, Policy::Prefix);
        assert_eq!(c.max_body_bytes, 32 << 20);
        assert_eq!(c.engine_addrs().unwrap()[0].addr.port(), 9);
    }

    #[test]
    fn shipped_example_is_valid_and_spells_out_the_defaults() {
        let text = include_str!("../../examples/gateway.toml");
        let c = ProxyConfig::from_toml(text).unwrap();
        c.validate().unwrap();
        assert_eq!(c.engines.len(), 3);
        assert!(c.tokenizers.is_empty());
        let d = ProxyConfig::default();
        assert_eq!(
            toml::to_string(&RoutingConfig::default()).unwrap(),
            toml::to_string(&c.routing).unwrap()
        );
        assert_eq!(
            (
                c.listen.as_str(),
                c.max_body_bytes,
                c.body_read_timeout_secs,
                c.max_inflight,
                c.body_budget_bytes,
                c.log.as_str()
            ),
            (
                d.listen.as_str(),
                d.max_body_bytes,
                d.body_read_timeout_secs,
                d.max_inflight,
                d.body_budget_bytes,
                d.log.as_str()
            )
        );
        assert_eq!(
            toml::to_string(&d.residency).unwrap(),
            toml::to_string(&c.residency).unwrap()
        );
        assert_eq!(
            toml::to_string(&d.upstream).unwrap(),
            toml::to_string(&c.upstream).unwrap()
        );
        assert_eq!(
            toml::to_string(&d.health).unwrap(),
            toml::to_string(&c.health).unwrap()
        );
        assert_eq!(
            toml::to_string(&d.shutdown).unwrap(),
            toml::to_string(&c.shutdown).unwrap()
        );
        assert_eq!(c.mode, d.mode);
        assert_eq!(
            toml::to_string(&d.cluster).unwrap(),
            toml::to_string(&c.cluster).unwrap()
        );
        assert_eq!(
            toml::to_string(&d.sidecar).unwrap(),
            toml::to_string(&c.sidecar).unwrap()
        );
        for (what, default, shipped) in [
            ("tls", toml::to_string(&d.tls), toml::to_string(&c.tls)),
            ("auth", toml::to_string(&d.auth), toml::to_string(&c.auth)),
            (
                "admission",
                toml::to_string(&d.admission),
                toml::to_string(&c.admission),
            ),
        ] {
            assert_eq!(default.unwrap(), shipped.unwrap(), "[{what}]");
        }
        for key in [
            "ca_file",
            "peer_identity",
            "[tls]",
            "require_client_cert",
            "[auth]",
            "key_file",
            "[admission]",
            "queue_depth",
            "[[tokenizers]]",
            "block_tokens",
        ] {
            assert!(text.contains(key), "examples/gateway.toml lacks {key}");
        }
    }

    #[test]
    fn shipped_picker_example_is_valid_and_spells_out_the_picker_defaults() {
        let c = ProxyConfig::from_toml(include_str!("../../examples/envoy/picker.toml")).unwrap();
        c.validate().unwrap();
        assert_eq!((c.mode, c.engines.len()), (Mode::Picker, 3));
        assert_eq!(
            toml::to_string(&PickerConfig::default()).unwrap(),
            toml::to_string(&c.picker).unwrap()
        );
        let mut clash = c.clone();
        clash.picker.metrics_listen = clash.picker.listen.clone();
        let e = clash.validate().unwrap_err().to_string();
        assert!(e.contains("`picker.metrics_listen`"), "{e}");
        let mut bad = c;
        bad.picker.health_listen = "localhost".into();
        let e = bad.validate().unwrap_err().to_string();
        assert!(
            e.contains("`picker.health_listen` = \"localhost\" is not an IP:port"),
            "{e}"
        );
    }

    #[test]
    fn shipped_sidecar_example_is_valid() {
        let c = ProxyConfig::from_toml(include_str!("../../examples/sidecar.toml")).unwrap();
        c.validate().unwrap();
        assert_eq!(
            (c.mode, c.engines.len(), c.cluster.enabled),
            (Mode::Sidecar, 1, true)
        );
        // Sidecar mode needs gossip and exactly one engine.
        let mut no_gossip = c.clone();
        no_gossip.cluster.enabled = false;
        assert!(no_gossip
            .validate()
            .unwrap_err()
            .to_string()
            .contains("[cluster]"));
        let mut two = c.clone();
        two.engines.push(two.engines[0].clone());
        two.engines[1].name = "other".into();
        assert!(two
            .validate()
            .unwrap_err()
            .to_string()
            .contains("exactly one engine"));
        let mut bad = c;
        bad.cluster.advertise = "0.0.0.0:7946".into();
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("advertise"));
    }

    #[test]
    fn gossip_needs_a_valid_key_unless_explicitly_plaintext() {
        let base = "mode = \"sidecar\"\n[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\n[cluster]\nenabled = true\n";
        let check = |extra: &str| {
            ProxyConfig::from_toml(&format!("{base}{extra}"))
                .unwrap()
                .validate()
                .map_err(|e| e.to_string())
        };
        let no_key = check("").unwrap_err();
        assert!(
            no_key.contains("gossip needs a key") && no_key.contains("gossip-keygen"),
            "{no_key}"
        );
        assert!(check("insecure_plaintext = true\n").is_ok());
        let key = kvmesh_cluster::Keyring::generate_base64();
        assert!(check(&format!("gossip_keys = [\"{key}\"]\n")).is_ok());
        let both = check(&format!(
            "gossip_keys = [\"{key}\"]\ninsecure_plaintext = true\n"
        ))
        .unwrap_err();
        assert!(both.contains("contradicts"), "{both}");
        let bad = check(&format!("gossip_keys = [\"{key}\", \"c2hvcnQ=\"]\n")).unwrap_err();
        assert!(bad.contains("gossip key #1"), "{bad}");
        let missing = check("gossip_key_file = \"/nonexistent/kvmesh.key\"\n").unwrap_err();
        assert!(missing.contains("gossip_key_file"), "{missing}");
        let file = std::env::temp_dir().join(format!("kvmesh-key-{}", std::process::id()));
        std::fs::write(&file, format!("# rotation: new key first\n{key}\n\n")).unwrap();
        let from_file = check(&format!(
            "gossip_key_file = {:?}\n",
            file.display().to_string()
        ));
        let _ = std::fs::remove_file(&file);
        assert!(from_file.is_ok(), "{from_file:?}");
        let nets = check(&format!("gossip_keys = [\"{key}\"]\npeer_networks = [\"10.0.0.0/8\", \"192.0.2.7\", \"nope\"]\n"))
            .unwrap_err();
        assert!(
            nets.contains("peer_networks") && nets.contains("nope"),
            "{nets}"
        );
        let zero = check(&format!("gossip_keys = [\"{key}\"]\nmax_peers = 0\n")).unwrap_err();
        assert!(zero.contains("max_peers"), "{zero}");
        let tiny = check(&format!(
            "gossip_keys = [\"{key}\"]\nbulk_sync_max_bytes = 10\n"
        ))
        .unwrap_err();
        assert!(tiny.contains("bulk_sync_max_bytes"), "{tiny}");
        // Off, the bound is not used, so not judged.
        let off = check(&format!(
            "gossip_keys = [\"{key}\"]\nbulk_sync = false\nbulk_sync_max_bytes = 10\n"
        ));
        assert!(off.is_ok(), "{off:?}");
        let slow = check(&format!(
            "gossip_keys = [\"{key}\"]\nload_beacon_interval_ms = 251\n"
        ))
        .unwrap_err();
        assert!(slow.contains("load_beacon_interval_ms"), "{slow}");
        for ok in [0, 250] {
            let beacons = check(&format!(
                "gossip_keys = [\"{key}\"]\nload_beacon_interval_ms = {ok}\n"
            ));
            assert!(beacons.is_ok(), "{ok}: {beacons:?}");
        }
        // Full publications: the longest wait at least the least, a ratio within 0..=1.
        for bad in [
            "residency_full_interval_ms = 20000\nresidency_full_max_interval_ms = 10000\n",
            "residency_full_max_interval_ms = 1000\n",
            "residency_full_max_interval_ms = 60001\n",
        ] {
            let e = check(&format!("gossip_keys = [\"{key}\"]\n{bad}")).unwrap_err();
            assert!(e.contains("residency_full_max_interval_ms"), "{bad}: {e}");
        }
        for bad in ["-0.1", "1.5", "nan"] {
            let e = check(&format!(
                "gossip_keys = [\"{key}\"]\nresidency_stale_ratio = {bad}\n"
            ))
            .unwrap_err();
            assert!(e.contains("residency_stale_ratio"), "{bad}: {e}");
        }
        for ok in [
            // Unset, the longest wait follows a least one over its default.
            "residency_full_interval_ms = 20000\n",
            "residency_full_interval_ms = 20000\nresidency_full_max_interval_ms = 20000\nresidency_stale_ratio = 0\n",
        ] {
            let r = check(&format!("gossip_keys = [\"{key}\"]\n{ok}"));
            assert!(r.is_ok(), "{ok}: {r:?}");
        }
    }

    #[test]
    fn bad_configs_name_the_problem() {
        let cases = [
            ("listen = 5", "listen"),
            ("polcy = \"prefix\"", "unknown field `polcy`"),
            ("policy = \"fastest\"", "fastest"),
            ("", "`engines` is empty"),
            ("[[engines]]\nname = \"a\"\nurl = \"ftp://x:1\"", "must start with http:// or https://"),
            ("[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:1/v1\"", "path"),
            ("[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\n[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:2\"", "twice"),
            ("max_body_bytes = 0\n[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"", "max_body_bytes"),
            ("max_body_bytes = 1073741825\nbody_budget_bytes = 2147483648\n[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"", "at most 1073741824"),
            ("[routing]\nblock_bytes = 0\n[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"", "block_bytes"),
            ("[routing]\nmax_prefix_blocks = 0\n[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"", "max_prefix_blocks"),
            ("body_read_timeout_secs = 0\n[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"", "body_read_timeout_secs"),
            ("body_budget_bytes = 1000\n[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"", "body_budget_bytes"),
            ("[[tokenizers]]\nmodel = \"m\"\ngguf = \"m.gguf\"\nblock_tokens = 4097\n[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"", "between 1 and 4096"),
            ("[[tokenizers]]\nmodel = \"m\"\ngguf = \"\"\n[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"", "`gguf` (a file) is required"),
            ("[[tokenizers]]\nmodel = \"\"\ngguf = \"m.gguf\"\n[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"", "must not be empty"),
            ("[[tokenizers]]\nmodel = \"m\"\ngguf = \"a.gguf\"\n[[tokenizers]]\nmodel = \"m\"\ngguf = \"b.gguf\"\n[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"", "two [[tokenizers]]"),
            ("[[tokenizers]]\nmodel = \"m\"\n[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"", "missing field `gguf`"),
            ("[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\nkvagent = \"grpc://x:1\"", "`kvagent`: url \"grpc://x:1\" must start with http://"),
            ("[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\nkvagent = \"https://x:1\"", "`upstream.ca_file`, which is not set"),
            ("[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\nkvagent_token_file = \"t\"", "without a `kvagent`"),
            ("[[tokenizers]]\nmodel = \"m\"\ngguf = \"m.gguf\"\n[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\nmodels = [\"m\"]\nkv_events = \"ipc:///tmp/x\"", "must be tcp://host:port"),
            ("[[tokenizers]]\nmodel = \"m\"\ngguf = \"m.gguf\"\n[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\nmodels = [\"m\"]\nkv_events = \"tcp://*:5557\"", "not its bind address"),
            ("[[tokenizers]]\nmodel = \"m\"\ngguf = \"m.gguf\"\n[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\nmodels = [\"m\"]\nkv_events = \"tcp://h:0\"", "is not 1 to 65535"),
            ("[[tokenizers]]\nmodel = \"m\"\ngguf = \"m.gguf\"\n[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\nmodels = [\"m\"]\nkv_events = \"tcp://h\"", "has no port"),
            ("[[tokenizers]]\nmodel = \"m\"\ngguf = \"m.gguf\"\n[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\nmodels = [\"m\"]\nkv_events = \"tcp://h:1\"\nkv_events_replay = \"h:2\"", "`kv_events_replay`: \"h:2\" must be tcp://"),
            ("[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\nmodels = [\"m\"]\nkv_events = \"tcp://h:1\"", "in token mode"),
            ("[[tokenizers]]\nmodel = \"m\"\ngguf = \"m.gguf\"\n[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\nkv_events = \"tcp://h:1\"", "exactly one model"),
            ("[[tokenizers]]\nmodel = \"m\"\ngguf = \"m.gguf\"\n[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\nmodels = [\"m\"]\nkv_events = \"tcp://h:1\"\nkvagent = \"http://h:2\"", "not both"),
            ("[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\nkv_events_topic = \"t\"", "`kv_events_topic` is set without `kv_events`"),
            ("[sidecar]\nhome_choices = 0\n[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"", "`sidecar.home_choices` must be between 1 and 16"),
            ("[sidecar]\nhome_choices = 17\n[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"", "`sidecar.home_choices` must be between 1 and 16"),
            ("[upstream]\nmax_attempts = 0\n[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"", "`upstream.max_attempts` must be in 1..=16"),
            ("[upstream]\nmax_attempts = 17\n[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"", "`upstream.max_attempts` must be in 1..=16"),
        ];
        for (text, needle) in cases {
            let msg = match ProxyConfig::from_toml(text) {
                Err(m) => m,
                Ok(c) => c
                    .validate()
                    .map(|_| String::new())
                    .unwrap_or_else(|e| e.to_string()),
            };
            assert!(msg.contains(needle), "{text:?}: {msg}");
        }
    }
}
