//! kvagent's one typed configuration: TOML file, then environment overrides, then validation.
//! Every key has a default; docs/kvagent.md lists them all.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

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
        /// The TOML parser's message (names the key and line).
        message: String,
    },
    /// A value is out of range or inconsistent.
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

/// The whole `kvagent` configuration.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AgentConfig {
    /// gRPC listen address. Env: `KVAGENT_LISTEN`.
    pub listen: SocketAddr,
    /// Plain-HTTP address for `/metrics` and `/health`; empty string disables it.
    /// Env: `KVAGENT_METRICS_LISTEN`.
    pub metrics_listen: String,
    /// Log filter (tracing `EnvFilter` syntax). Env: `KVAGENT_LOG`.
    pub log: String,
    /// The RAM tier.
    pub ram: RamConfig,
    /// The SSD tier.
    pub ssd: SsdConfig,
    /// Bounds on what clients may send.
    pub limits: Limits,
    /// Scraping the co-located engine's load.
    pub telemetry: TelemetryConfig,
    /// Who may call (bearer tokens).
    pub auth: AuthConfig,
    /// TLS on the gRPC port (off unless `tls.cert_file` is set).
    pub tls: TlsConfig,
}

pub use kvmesh_tls::TlsConfig;

/// The `[auth]` table: bearer tokens on every gRPC call (see [`crate::access`]).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// File whose first line is the engine's token: every call, PutBlocks and Delete included.
    /// Empty: no token is asked for.
    pub token_file: String,
    /// File whose first line is a read-only token (GetBlocks, Lookup, Stats, WatchResidency,
    /// NodeLoad). Needs `token_file`.
    pub read_token_file: String,
    /// Allow `listen` beyond loopback without `token_file` (any host that reaches the port could
    /// then delete or overwrite blocks).
    pub insecure_no_auth: bool,
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 50151)),
            metrics_listen: "127.0.0.1:9151".into(),
            log: "info".into(),
            ram: RamConfig::default(),
            ssd: SsdConfig::default(),
            limits: Limits::default(),
            telemetry: TelemetryConfig::default(),
            auth: AuthConfig::default(),
            tls: TlsConfig::default(),
        }
    }
}

/// The RAM tier: a byte budget with watermarks.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RamConfig {
    /// Bytes the RAM tier may hold, each block charged its payload, its model name and a fixed
    /// per-block overhead (`store::RAM_BLOCK_OVERHEAD_BYTES`). A put that would pass it waits
    /// for a spill.
    pub capacity_bytes: u64,
    /// Fraction of `capacity_bytes` above which the coldest blocks spill to SSD.
    pub high_watermark: f64,
    /// Fraction of `capacity_bytes` a spill brings the tier down to.
    pub low_watermark: f64,
}

impl Default for RamConfig {
    fn default() -> Self {
        RamConfig {
            capacity_bytes: 1 << 30,
            high_watermark: 0.9,
            low_watermark: 0.75,
        }
    }
}

/// The SSD tier: one file per block in a directory.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SsdConfig {
    /// Directory of block files (created if missing). Env: `KVAGENT_SSD_DIR`.
    pub dir: PathBuf,
    /// Bytes the SSD tier may hold, each block charged its file's length rounded up to 4 KiB
    /// (`store::SSD_ALLOCATION_UNIT_BYTES`); 0 disables the tier (RAM overflow is then dropped).
    pub capacity_bytes: u64,
    /// Seconds a block may sit on SSD without being read or written before it is deleted.
    pub ttl_secs: u64,
    /// Seconds between TTL sweeps.
    pub sweep_interval_secs: u64,
    /// fsync each block file and the directory before a spill counts as done. Turning it off
    /// trades crash durability of the newest spills for speed; checksums still hold.
    pub fsync: bool,
}

impl Default for SsdConfig {
    fn default() -> Self {
        SsdConfig {
            dir: PathBuf::from("kvagent-data"),
            capacity_bytes: 8 << 30,
            ttl_secs: 24 * 3600,
            sweep_interval_secs: 30,
            fsync: true,
        }
    }
}

impl SsdConfig {
    /// The TTL as a duration.
    pub fn ttl(&self) -> Duration {
        Duration::from_secs(self.ttl_secs)
    }
}

/// Largest HTTP/2 frame the agent accepts (clients may set theirs for what they receive).
pub const MAX_FRAME_BYTES: usize = 1 << 20;

/// Bounds on requests.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Largest payload of one block, bytes; larger blocks get `InvalidArgument`.
    pub max_block_bytes: u64,
    /// Largest gRPC message accepted or sent, bytes.
    pub max_message_bytes: usize,
    /// Most blocks or digests in one request.
    pub max_batch: usize,
    /// Longest model name, bytes.
    pub max_model_bytes: usize,
    /// Most concurrent `WatchResidency` subscribers.
    pub max_watchers: usize,
    /// Most concurrent gRPC calls (HTTP/2 streams) on one client connection.
    pub max_concurrent_streams: u32,
    /// Most bytes of requests on their way in, over all calls and connections: each call is
    /// charged with what gRPC's decoder may hold for its one request message (the message,
    /// twice its largest HTTP/2 frame, and 16 KiB), from its first frame until the request
    /// ends; a message past what is left gets `ResourceExhausted`. At least
    /// `max_message_bytes` + 2 MiB + 64 KiB.
    pub message_budget_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_block_bytes: 16 << 20,
            max_message_bytes: 64 << 20,
            max_batch: 4096,
            max_model_bytes: 256,
            max_watchers: 64,
            max_concurrent_streams: 256,
            message_budget_bytes: 1 << 30,
        }
    }
}

/// Engine telemetry.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// The engine's Prometheus endpoint, e.g. `http://127.0.0.1:8000/metrics`; empty: no scraping
    /// (`NodeLoad` then answers `available = false`). Env: `KVAGENT_ENGINE_METRICS`.
    pub engine_metrics_url: String,
    /// Milliseconds between scrapes.
    pub scrape_interval_ms: u64,
    /// Milliseconds a scrape may take.
    pub scrape_timeout_ms: u64,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            engine_metrics_url: String::new(),
            scrape_interval_ms: 1000,
            scrape_timeout_ms: 500,
        }
    }
}

impl AgentConfig {
    /// Reads `path` (or starts from the defaults), applies `KVAGENT_*` env overrides, validates.
    pub fn load(path: Option<&Path>) -> Result<Self, ConfigError> {
        let mut cfg = match path {
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|source| ConfigError::Read {
                    path: p.display().to_string(),
                    source,
                })?;
                Self::from_toml(&text).map_err(|message| ConfigError::Parse {
                    path: p.display().to_string(),
                    message,
                })?
            }
            None => AgentConfig::default(),
        };
        if let Ok(v) = std::env::var("KVAGENT_LISTEN") {
            cfg.listen = v
                .parse()
                .map_err(|e| ConfigError::Invalid(format!("KVAGENT_LISTEN={v:?}: {e}")))?;
        }
        if let Ok(v) = std::env::var("KVAGENT_METRICS_LISTEN") {
            cfg.metrics_listen = v;
        }
        if let Ok(v) = std::env::var("KVAGENT_LOG") {
            cfg.log = v;
        }
        if let Ok(v) = std::env::var("KVAGENT_SSD_DIR") {
            cfg.ssd.dir = PathBuf::from(v);
        }
        if let Ok(v) = std::env::var("KVAGENT_ENGINE_METRICS") {
            cfg.telemetry.engine_metrics_url = v;
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Parses TOML text against this schema (unknown keys are errors).
    pub fn from_toml(text: &str) -> Result<Self, String> {
        toml::from_str(text).map_err(|e| e.to_string())
    }

    /// Checks ranges and consistency.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        let r = &self.ram;
        if r.capacity_bytes == 0 {
            return bad("ram.capacity_bytes must be > 0".into());
        }
        if !(r.low_watermark > 0.0 && r.low_watermark < r.high_watermark && r.high_watermark <= 1.0)
        {
            return bad(format!(
                "need 0 < ram.low_watermark ({}) < ram.high_watermark ({}) <= 1",
                r.low_watermark, r.high_watermark
            ));
        }
        let l = &self.limits;
        if l.max_model_bytes == 0 || l.max_model_bytes > usize::from(u16::MAX) {
            return bad(format!(
                "limits.max_model_bytes ({}) must be in 1..=65535 (the block file format)",
                l.max_model_bytes
            ));
        }
        // The largest block, with the longest model name and the per-block overhead, must fit.
        let largest = crate::store::ram_charge(l.max_model_bytes, l.max_block_bytes);
        if l.max_block_bytes == 0 || largest > r.capacity_bytes {
            return bad(format!(
                "limits.max_block_bytes ({}) must be in 1..=ram.capacity_bytes ({}) - \
                 limits.max_model_bytes ({}) - {} (the per-block overhead)",
                l.max_block_bytes,
                r.capacity_bytes,
                l.max_model_bytes,
                crate::store::RAM_BLOCK_OVERHEAD_BYTES
            ));
        }
        if (l.max_message_bytes as u64) < l.max_block_bytes.saturating_add(4096) {
            return bad(format!(
                "limits.max_message_bytes ({}) must exceed limits.max_block_bytes ({}) by at least 4096",
                l.max_message_bytes, l.max_block_bytes
            ));
        }
        let least = l
            .max_message_bytes
            .saturating_add(2 * MAX_FRAME_BYTES)
            .saturating_add(64 << 10);
        if l.message_budget_bytes < least {
            return bad(format!(
                "limits.message_budget_bytes ({}) must be at least limits.max_message_bytes ({}) \
                 + 2 MiB (two 1 MiB frames) + 64 KiB = {least}",
                l.message_budget_bytes, l.max_message_bytes
            ));
        }
        if l.max_batch == 0 || l.max_watchers == 0 || l.max_concurrent_streams == 0 {
            return bad(
                "limits.max_batch, max_watchers and max_concurrent_streams must be > 0".into(),
            );
        }
        if self.ssd.capacity_bytes > 0 {
            if self.ssd.dir.as_os_str().is_empty() {
                return bad("ssd.dir must be set when ssd.capacity_bytes > 0".into());
            }
            if self.ssd.ttl_secs == 0 || self.ssd.sweep_interval_secs == 0 {
                return bad("ssd.ttl_secs and ssd.sweep_interval_secs must be > 0".into());
            }
        }
        if !self.metrics_listen.is_empty() && self.metrics_listen.parse::<SocketAddr>().is_err() {
            return bad(format!(
                "metrics_listen {:?} is not an address like 127.0.0.1:9151",
                self.metrics_listen
            ));
        }
        self.tls.check().map_err(ConfigError::Invalid)?;
        let access = crate::access::AccessControl::from_config(&self.auth)?;
        if !self.listen.ip().is_loopback() && !access.enabled() && !self.auth.insecure_no_auth {
            return bad(format!(
                "listen {} is beyond loopback: set auth.token_file (the engine's token) or, on a \
                 network where every host is trusted, auth.insecure_no_auth = true",
                self.listen
            ));
        }
        let t = &self.telemetry;
        if !t.engine_metrics_url.is_empty() {
            crate::telemetry::parse_http_url(&t.engine_metrics_url)
                .map_err(|e| ConfigError::Invalid(format!("telemetry.engine_metrics_url: {e}")))?;
            if t.scrape_interval_ms == 0 || t.scrape_timeout_ms == 0 {
                return bad(
                    "telemetry.scrape_interval_ms and scrape_timeout_ms must be > 0".into(),
                );
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_example_is_valid_and_spells_out_the_defaults() {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../examples/kvagent.toml"
        ))
        .expect("examples/kvagent.toml");
        let cfg = AgentConfig::from_toml(&text).expect("parses");
        cfg.validate().expect("valid");
        assert_eq!(cfg, AgentConfig::default());
    }

    #[test]
    fn bad_configs_name_the_problem() {
        let e = AgentConfig::from_toml("[ram]\ncapacity = 5\n").unwrap_err();
        assert!(e.contains("capacity"), "{e}");
        let cfg = AgentConfig::from_toml("[ram]\nhigh_watermark = 0.5\nlow_watermark = 0.6\n")
            .expect("parses");
        let e = cfg.validate().unwrap_err().to_string();
        assert!(e.contains("low_watermark"), "{e}");
        // The largest block must fit with its model name and the per-block overhead.
        let cfg = AgentConfig::from_toml(
            "[ram]\ncapacity_bytes = 65536\n[limits]\nmax_block_bytes = 65536\n",
        )
        .expect("parses");
        let e = cfg.validate().unwrap_err().to_string();
        assert!(
            e.contains("max_block_bytes") && e.contains("overhead"),
            "{e}"
        );
        let cfg = AgentConfig::from_toml("[limits]\nmax_model_bytes = 70000\n").expect("parses");
        let e = cfg.validate().unwrap_err().to_string();
        assert!(e.contains("max_model_bytes"), "{e}");
        let cfg = AgentConfig::from_toml("[telemetry]\nengine_metrics_url = \"ftp://x\"\n")
            .expect("parses");
        let e = cfg.validate().unwrap_err().to_string();
        assert!(e.contains("engine_metrics_url"), "{e}");
    }
}
