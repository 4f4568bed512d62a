//! kvagent's Prometheus metrics (`kvagent_` prefix). The store's counters live here, so the `Stats`
//! RPC and `/metrics` read the same numbers.

use prometheus::{IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

/// Every metric kvagent exports.
pub struct Metrics {
    /// The registry `/metrics` encodes.
    pub registry: Registry,
    /// Blocks held, by tier (`ram`, `ssd`).
    pub blocks: IntGaugeVec,
    /// Payload bytes held, by tier.
    pub bytes: IntGaugeVec,
    /// Configured capacity in payload bytes, by tier.
    pub capacity_bytes: IntGaugeVec,
    /// Blocks served, by the tier they were found in.
    pub hits: IntCounterVec,
    /// Requested digests not found.
    pub misses: IntCounter,
    /// Blocks stored by `PutBlocks`.
    pub put_blocks: IntCounter,
    /// Payload bytes stored by `PutBlocks`.
    pub put_bytes: IntCounter,
    /// Blocks moved from RAM to SSD.
    pub spilled_blocks: IntCounter,
    /// Payload bytes moved from RAM to SSD.
    pub spilled_bytes: IntCounter,
    /// Blocks moved from SSD back to RAM by a read.
    pub promoted_blocks: IntCounter,
    /// Payload bytes moved from SSD back to RAM by a read.
    pub promoted_bytes: IntCounter,
    /// Block files dropped because they were truncated or failed their checksum.
    pub corrupt_dropped: IntCounter,
    /// SSD blocks deleted by the TTL.
    pub expired: IntCounter,
    /// Blocks dropped for capacity, by tier (`ram` when no SSD tier takes them, `ssd`).
    pub evicted: IntCounterVec,
    /// File-system errors while spilling, reading or deleting.
    pub disk_errors: IntCounter,
    /// The current residency epoch.
    pub kv_epoch: IntGauge,
    /// Open `WatchResidency` streams.
    pub watchers: IntGauge,
    /// Bytes of requests on their way in (`limits.message_budget_bytes`), set at each scrape.
    pub message_bytes: IntGauge,
    /// Engine scrapes that failed.
    pub scrape_errors: IntCounter,
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Self {
        let registry = Registry::new();
        // process_cpu_seconds_total, process_resident_memory_bytes, process_open_fds, ... (read
        // from /proc: the collector exists on Linux only).
        #[cfg(target_os = "linux")]
        registry
            .register(Box::new(
                prometheus::process_collector::ProcessCollector::for_self(),
            ))
            .expect("unique metric");
        let gauge_vec = |name: &str, help: &str| {
            let g = IntGaugeVec::new(Opts::new(name, help), &["tier"]).expect("valid metric");
            registry
                .register(Box::new(g.clone()))
                .expect("unique metric");
            g
        };
        let counter_vec = |name: &str, help: &str| {
            let c = IntCounterVec::new(Opts::new(name, help), &["tier"]).expect("valid metric");
            registry
                .register(Box::new(c.clone()))
                .expect("unique metric");
            c
        };
        let counter = |name: &str, help: &str| {
            let c = IntCounter::new(name, help).expect("valid metric");
            registry
                .register(Box::new(c.clone()))
                .expect("unique metric");
            c
        };
        let gauge = |name: &str, help: &str| {
            let g = IntGauge::new(name, help).expect("valid metric");
            registry
                .register(Box::new(g.clone()))
                .expect("unique metric");
            g
        };
        Metrics {
            blocks: gauge_vec("kvagent_blocks", "Blocks held, by tier."),
            bytes: gauge_vec("kvagent_bytes", "Payload bytes held, by tier."),
            capacity_bytes: gauge_vec(
                "kvagent_capacity_bytes",
                "Capacity in payload bytes, by tier.",
            ),
            hits: counter_vec(
                "kvagent_hits_total",
                "Blocks served, by the tier they were in.",
            ),
            misses: counter("kvagent_misses_total", "Requested digests not found."),
            put_blocks: counter("kvagent_put_blocks_total", "Blocks stored by PutBlocks."),
            put_bytes: counter(
                "kvagent_put_bytes_total",
                "Payload bytes stored by PutBlocks.",
            ),
            spilled_blocks: counter(
                "kvagent_spilled_blocks_total",
                "Blocks moved from RAM to SSD.",
            ),
            spilled_bytes: counter(
                "kvagent_spilled_bytes_total",
                "Payload bytes moved from RAM to SSD.",
            ),
            promoted_blocks: counter(
                "kvagent_promoted_blocks_total",
                "Blocks moved from SSD to RAM by a read.",
            ),
            promoted_bytes: counter(
                "kvagent_promoted_bytes_total",
                "Payload bytes moved from SSD to RAM by a read.",
            ),
            corrupt_dropped: counter(
                "kvagent_corrupt_dropped_total",
                "Block files dropped: truncated or failed checksum.",
            ),
            expired: counter("kvagent_expired_total", "SSD blocks deleted by the TTL."),
            evicted: counter_vec(
                "kvagent_evicted_total",
                "Blocks dropped for capacity, by tier.",
            ),
            disk_errors: counter("kvagent_disk_errors_total", "File-system errors."),
            kv_epoch: gauge("kvagent_kv_epoch", "Current residency epoch (low 63 bits)."),
            watchers: gauge("kvagent_watchers", "Open WatchResidency streams."),
            message_bytes: gauge(
                "kvagent_message_bytes",
                "Bytes of requests on their way in, charged to limits.message_budget_bytes.",
            ),
            scrape_errors: counter(
                "kvagent_engine_scrape_errors_total",
                "Failed engine scrapes.",
            ),
            registry,
        }
    }

    /// Prometheus text exposition of every metric.
    pub fn encode(&self) -> String {
        prometheus::TextEncoder::new()
            .encode_to_string(&self.registry.gather())
            .unwrap_or_else(|e| format!("# encoding failed: {e}\n"))
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
