//! Prometheus metrics, all prefixed `kvmesh_`.

use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

use kvmesh_filters::residency::ResidencyIndex;
use kvmesh_filters::usage::Usage;

use crate::fleet::Fleet;

/// Every metric the proxy exports.
pub struct Metrics {
    registry: Registry,
    /// Requests by route and status code.
    pub requests: IntCounterVec,
    /// End-to-end latency by route.
    pub latency: HistogramVec,
    /// Time to first response byte by route.
    pub ttft: HistogramVec,
    /// Routing decisions by policy and reason.
    pub decisions: IntCounterVec,
    /// Prompt tokens engines reported.
    pub prompt_tokens: IntCounter,
    /// Of those, tokens engines reported as cached.
    pub cached_tokens: IntCounter,
    /// Completion tokens engines reported.
    pub completion_tokens: IntCounter,
    /// cached / prompt tokens since start.
    pub hit_ratio: Gauge,
    /// Engine answers that confirmed or refuted the index's prediction.
    pub residency_verdicts: IntCounterVec,
    /// Distinct digests in the residency index.
    pub index_digests: IntGauge,
    /// Requests in flight per engine.
    pub engine_inflight: IntGaugeVec,
    /// Pending prefill bytes per engine.
    pub engine_pending_prefill: IntGaugeVec,
    /// 1 when the engine is healthy.
    pub engine_healthy: IntGaugeVec,
    /// Failovers to another engine, by cause.
    pub retries: IntCounterVec,
    /// Requests refused by admission control, by reason.
    pub admission_rejections: IntCounterVec,
    /// Requests forwarded to a peer proxy, by peer and reason.
    pub forwards: IntCounterVec,
    /// Live gossip peers.
    pub gossip_peers: IntGauge,
    /// Gossip bytes, by direction (`in`, `out`).
    pub gossip_bytes: IntCounterVec,
    /// Gossip datagrams dropped, by reason (`forged`, `replayed`, `stale`, `plaintext`,
    /// `malformed`).
    pub gossip_dropped: IntCounterVec,
    /// Authenticated gossip frames that came from another IP than the one their sender named.
    pub gossip_other_source: IntCounter,
    /// Times the gossip task was restarted after it stopped.
    pub gossip_restarts: IntCounter,
    /// Bulk state transfers, by result (`pulled`, `pull_failed`, `served`, `refused`).
    pub gossip_bulk: IntCounterVec,
    /// Load beacons, by result (`sent`, `received`, `refused`, `unknown`).
    pub gossip_beacons: IntCounterVec,
    /// Peer records refused, by reason (`url`, `network`, `unverified`, `probe`, `over_cap`,
    /// `misnamed`).
    pub gossip_peers_refused: IntCounterVec,
    /// Requests of token-mode models routed without a token chain, by reason.
    pub token_mode_fallbacks: IntCounterVec,
    /// Time to render and tokenize a token-mode request's prompt prefix.
    pub tokenize_seconds: Histogram,
    /// Engine residency feeds (kvagent `WatchResidency`), by engine and event.
    pub engine_feed: IntCounterVec,
    /// Residency index entries by source.
    pub residency_entries: IntGaugeVec,
    /// Digests the index holds per engine.
    pub engine_residency: IntGaugeVec,
    /// Per-engine request, latency and token series (engine and model labels).
    pub per_engine: EngineSeries,
    /// The `max_inflight` cap, beside `kvmesh_inflight_requests`.
    pub max_inflight: IntGauge,
    /// Requests admitted and not finished (the `max_inflight` cap's count).
    pub inflight_requests: IntGauge,
    /// Request-body bytes reserved from `body_budget_bytes`.
    pub body_bytes: IntGauge,
    /// ext_proc request bytes on their way in, charged to `picker.message_budget_bytes`.
    pub ext_proc_message_bytes: IntGauge,
    /// Reloads of the configuration file by outcome (`applied`, `unchanged`, `refused`).
    pub config_reloads: IntCounterVec,
    /// 1 when the last reload of the configuration file was put in force (or found nothing to
    /// change), 0 when it was refused.
    pub config_last_reload_successful: IntGauge,
    /// Changed keys of the configuration file that wait for a restart.
    pub config_restart_pending: IntGauge,
    /// OpenTelemetry spans by outcome (`ended`, `exported`, `failed`; `[otel]`).
    pub otel_spans: IntCounterVec,
    /// Recent activity for the dashboard (not exported to Prometheus).
    pub recent: crate::dashboard::Recent,
}

/// A latency histogram, in seconds, over buckets from 0.5 ms to 60 s.
fn latency_histogram(name: &str, help: &str, labels: &[&str]) -> prometheus::Result<HistogramVec> {
    HistogramVec::new(
        HistogramOpts::new(name, help).buckets(vec![
            0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            30.0, 60.0,
        ]),
        labels,
    )
}

impl Metrics {
    /// Registers every metric in a fresh registry.
    pub fn new() -> prometheus::Result<Self> {
        let registry = Registry::new();
        // process_cpu_seconds_total, process_resident_memory_bytes, process_open_fds, ... (read
        // from /proc: the collector exists on Linux only).
        #[cfg(target_os = "linux")]
        registry.register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ))?;
        // Constant 1: joins any series to the build that produced it (version, commit).
        let build_info = IntGaugeVec::new(
            Opts::new("kvmesh_build_info", "The running build: always 1"),
            &["version", "commit"],
        )?;
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION"), env!("KVMESH_GIT_HASH")])
            .set(1);
        registry.register(Box::new(build_info))?;
        let requests = IntCounterVec::new(
            Opts::new("kvmesh_requests_total", "Requests by route and status"),
            &["route", "status"],
        )?;
        let latency = latency_histogram(
            "kvmesh_request_duration_seconds",
            "End-to-end request latency",
            &["route"],
        )?;
        let ttft = latency_histogram(
            "kvmesh_ttft_seconds",
            "Time from request start to the first response body byte",
            &["route"],
        )?;
        let decisions = IntCounterVec::new(
            Opts::new(
                "kvmesh_routing_decisions_total",
                "Routing decisions by policy and reason",
            ),
            &["policy", "reason"],
        )?;
        let prompt_tokens = IntCounter::new(
            "kvmesh_prompt_tokens_total",
            "Prompt tokens reported by engines",
        )?;
        let cached_tokens = IntCounter::new(
            "kvmesh_cached_tokens_total",
            "Prompt tokens engines reported as cached",
        )?;
        let completion_tokens = IntCounter::new(
            "kvmesh_completion_tokens_total",
            "Completion tokens reported by engines",
        )?;
        let hit_ratio = Gauge::new(
            "kvmesh_prefix_hit_ratio",
            "Cached over prompt tokens reported by engines, since start",
        )?;
        let residency_verdicts = IntCounterVec::new(
            Opts::new(
                "kvmesh_residency_verdicts_total",
                "Engine-reported cached tokens vs the index's prediction",
            ),
            &["verdict"],
        )?;
        let index_digests = IntGauge::new(
            "kvmesh_residency_index_digests",
            "Distinct prefix digests in the residency index",
        )?;
        let engine_inflight = IntGaugeVec::new(
            Opts::new("kvmesh_engine_inflight", "Requests in flight per engine"),
            &["engine"],
        )?;
        let engine_pending_prefill = IntGaugeVec::new(
            Opts::new(
                "kvmesh_engine_pending_prefill_bytes",
                "Uncached prompt bytes awaiting their first byte, per engine",
            ),
            &["engine"],
        )?;
        let engine_healthy = IntGaugeVec::new(
            Opts::new(
                "kvmesh_engine_healthy",
                "1 when the engine passes health checks",
            ),
            &["engine"],
        )?;
        let retries = IntCounterVec::new(
            Opts::new(
                "kvmesh_upstream_retries_total",
                "Failovers to another engine",
            ),
            &["cause"],
        )?;
        let admission_rejections = IntCounterVec::new(
            Opts::new(
                "kvmesh_admission_rejections_total",
                "Requests refused by admission control",
            ),
            &["reason"],
        )?;
        let forwards = IntCounterVec::new(
            Opts::new(
                "kvmesh_forwards_total",
                "Requests forwarded to a peer proxy, by peer and reason",
            ),
            &["peer", "reason"],
        )?;
        let gossip_peers = IntGauge::new("kvmesh_gossip_peers", "Live gossip peers")?;
        let gossip_bytes = IntCounterVec::new(
            Opts::new("kvmesh_gossip_bytes_total", "Gossip bytes by direction"),
            &["direction"],
        )?;
        let gossip_dropped = IntCounterVec::new(
            Opts::new(
                "kvmesh_gossip_dropped_total",
                "Gossip datagrams dropped before chitchat saw them, by reason",
            ),
            &["reason"],
        )?;
        let gossip_other_source = IntCounter::new(
            "kvmesh_gossip_frames_from_other_source_total",
            "Authenticated gossip frames that came from another IP than the one their sender names (opened, their host not counted as heard from)",
        )?;
        let gossip_restarts = IntCounter::new(
            "kvmesh_gossip_restarts_total",
            "Gossip restarts after its server task stopped",
        )?;
        let gossip_bulk = IntCounterVec::new(
            Opts::new(
                "kvmesh_gossip_bulk_transfers_total",
                "Bulk state transfers over TCP on the gossip port, by result",
            ),
            &["result"],
        )?;
        let gossip_beacons = IntCounterVec::new(
            Opts::new(
                "kvmesh_gossip_load_beacons_total",
                "Load beacons sent to peers, taken from peers, refused, or from unknown nodes, by result",
            ),
            &["result"],
        )?;
        let token_mode_fallbacks = IntCounterVec::new(
            Opts::new(
                "kvmesh_token_mode_fallbacks_total",
                "Requests of token-mode models routed without a token chain, by reason",
            ),
            &["reason"],
        )?;
        let tokenize_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "kvmesh_tokenize_seconds",
                "Time to render and tokenize a token-mode prompt's leading blocks",
            )
            .buckets(vec![1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1]),
        )?;
        let engine_feed = IntCounterVec::new(
            Opts::new(
                "kvmesh_engine_feed_events_total",
                "Engine residency feeds (kvagent WatchResidency), by engine and event",
            ),
            &["engine", "event"],
        )?;
        let gossip_peers_refused = IntCounterVec::new(
            Opts::new(
                "kvmesh_peer_urls_refused_total",
                "Peer records not used for routing, by reason",
            ),
            &["reason"],
        )?;
        let residency_entries = IntGaugeVec::new(
            Opts::new(
                "kvmesh_residency_entries",
                "Residency index entries (digest, node) by source",
            ),
            &["source"],
        )?;
        let engine_residency = IntGaugeVec::new(
            Opts::new(
                "kvmesh_engine_residency_digests",
                "Digests the residency index holds per engine",
            ),
            &["engine"],
        )?;
        let inflight_requests = IntGauge::new(
            "kvmesh_inflight_requests",
            "Requests admitted and not finished (capped by max_inflight)",
        )?;
        let body_bytes = IntGauge::new(
            "kvmesh_request_body_bytes",
            "Request-body bytes held, out of body_budget_bytes",
        )?;
        registry.register(Box::new(inflight_requests.clone()))?;
        registry.register(Box::new(body_bytes.clone()))?;
        let ext_proc_message_bytes = IntGauge::new(
            "kvmesh_ext_proc_message_bytes",
            "ext_proc request bytes on their way in (picker mode), out of picker.message_budget_bytes",
        )?;
        registry.register(Box::new(ext_proc_message_bytes.clone()))?;
        registry.register(Box::new(forwards.clone()))?;
        registry.register(Box::new(gossip_peers.clone()))?;
        registry.register(Box::new(gossip_bytes.clone()))?;
        registry.register(Box::new(gossip_dropped.clone()))?;
        registry.register(Box::new(gossip_other_source.clone()))?;
        registry.register(Box::new(gossip_restarts.clone()))?;
        registry.register(Box::new(gossip_bulk.clone()))?;
        registry.register(Box::new(gossip_beacons.clone()))?;
        registry.register(Box::new(token_mode_fallbacks.clone()))?;
        registry.register(Box::new(tokenize_seconds.clone()))?;
        registry.register(Box::new(engine_feed.clone()))?;
        registry.register(Box::new(gossip_peers_refused.clone()))?;
        registry.register(Box::new(residency_entries.clone()))?;
        registry.register(Box::new(engine_residency.clone()))?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(latency.clone()))?;
        registry.register(Box::new(ttft.clone()))?;
        registry.register(Box::new(decisions.clone()))?;
        registry.register(Box::new(prompt_tokens.clone()))?;
        registry.register(Box::new(cached_tokens.clone()))?;
        registry.register(Box::new(completion_tokens.clone()))?;
        registry.register(Box::new(hit_ratio.clone()))?;
        registry.register(Box::new(residency_verdicts.clone()))?;
        registry.register(Box::new(index_digests.clone()))?;
        registry.register(Box::new(engine_inflight.clone()))?;
        registry.register(Box::new(engine_pending_prefill.clone()))?;
        registry.register(Box::new(engine_healthy.clone()))?;
        registry.register(Box::new(retries.clone()))?;
        registry.register(Box::new(admission_rejections.clone()))?;
        let per_engine = EngineSeries::new(&registry)?;
        let max_inflight = IntGauge::new(
            "kvmesh_max_inflight",
            "The cap on requests in flight (max_inflight)",
        )?;
        registry.register(Box::new(max_inflight.clone()))?;
        let config_reloads = IntCounterVec::new(
            Opts::new(
                "kvmesh_config_reloads_total",
                "Reloads of the configuration file by outcome",
            ),
            &["outcome"],
        )?;
        for o in labels::RELOAD_OUTCOMES {
            config_reloads.with_label_values(&[o]);
        }
        let config_last_reload_successful = IntGauge::new(
            "kvmesh_config_last_reload_successful",
            "1 when the last reload of the configuration file was not refused",
        )?;
        config_last_reload_successful.set(1);
        let config_restart_pending = IntGauge::new(
            "kvmesh_config_restart_pending_keys",
            "Changed configuration keys that take effect only after a restart",
        )?;
        registry.register(Box::new(config_reloads.clone()))?;
        registry.register(Box::new(config_last_reload_successful.clone()))?;
        registry.register(Box::new(config_restart_pending.clone()))?;
        let otel_spans = IntCounterVec::new(
            Opts::new(
                "kvmesh_otel_spans_total",
                "OpenTelemetry spans ended, exported, and failed to export",
            ),
            &["outcome"],
        )?;
        for o in labels::OTEL_OUTCOMES {
            otel_spans.with_label_values(&[o]);
        }
        registry.register(Box::new(otel_spans.clone()))?;
        Ok(Metrics {
            otel_spans,
            recent: crate::dashboard::Recent::default(),
            config_reloads,
            config_last_reload_successful,
            config_restart_pending,
            per_engine,
            max_inflight,
            registry,
            requests,
            latency,
            ttft,
            decisions,
            prompt_tokens,
            cached_tokens,
            completion_tokens,
            hit_ratio,
            residency_verdicts,
            index_digests,
            engine_inflight,
            engine_pending_prefill,
            engine_healthy,
            retries,
            admission_rejections,
            forwards,
            gossip_peers,
            gossip_bytes,
            gossip_dropped,
            gossip_other_source,
            gossip_restarts,
            gossip_bulk,
            gossip_beacons,
            token_mode_fallbacks,
            tokenize_seconds,
            engine_feed,
            gossip_peers_refused,
            residency_entries,
            engine_residency,
            inflight_requests,
            body_bytes,
            ext_proc_message_bytes,
        })
    }

    /// Cached / prompt tokens engines reported since start (0 before any).
    pub fn hit_ratio_now(&self) -> f64 {
        let prompt = self.prompt_tokens.get();
        if prompt == 0 {
            0.0
        } else {
            self.cached_tokens.get() as f64 / prompt as f64
        }
    }

    /// The Prometheus text exposition, with gauges refreshed from live state.
    pub fn render(&self, fleet: &Fleet, index: &ResidencyIndex) -> Vec<u8> {
        // Peers come and go: start from empty label sets.
        self.engine_inflight.reset();
        self.engine_pending_prefill.reset();
        self.engine_healthy.reset();
        self.engine_residency.reset();
        for (source, n) in index.count_by_source() {
            self.residency_entries
                .with_label_values(&[source.label()])
                .set(n as i64);
        }
        let index_len = index.len();
        for e in fleet.engines().iter() {
            self.engine_residency
                .with_label_values(&[&e.name])
                .set(index.node_usage(e.id).0 as i64);
            self.engine_inflight
                .with_label_values(&[&e.name])
                .set(e.inflight() as i64);
            self.engine_pending_prefill
                .with_label_values(&[&e.name])
                .set(e.pending_prefill() as i64);
            self.engine_healthy
                .with_label_values(&[&e.name])
                .set(e.healthy() as i64);
            self.per_engine
                .touch(&e.name, e.models().as_deref().map_or(&[], |m| m.as_slice()));
        }
        self.index_digests.set(index_len as i64);
        self.hit_ratio.set(self.hit_ratio_now());
        let mut out = Vec::new();
        // Encoding gathered families into a Vec cannot fail.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        out
    }
}

/// What each engine served: `kvmesh_engine_requests_total{engine,model,class}`,
/// `kvmesh_engine_ttft_seconds{engine,model}`, `kvmesh_engine_itl_seconds{engine,model}` and
/// `kvmesh_engine_tokens_total{engine,kind}`
/// (`prompt`, `cached`: their ratio is the engine's hit ratio; `completion`). Models are those an engine was
/// routed for, so the label set is bounded by the fleet's models.
pub struct EngineSeries {
    requests: IntCounterVec,
    ttft: HistogramVec,
    itl: HistogramVec,
    tokens: IntCounterVec,
}

/// `class` of `kvmesh_engine_requests_total`: the status class, or `aborted` for a client
/// gone or an upstream cut after the first byte.
pub const STATUS_CLASSES: [&str; 4] = ["2xx", "4xx", "5xx", "aborted"];

/// `kind` of `kvmesh_engine_tokens_total`.
const TOKEN_KINDS: [&str; 3] = ["prompt", "cached", "completion"];

impl EngineSeries {
    fn new(registry: &Registry) -> prometheus::Result<Self> {
        let requests = IntCounterVec::new(
            Opts::new(
                "kvmesh_engine_requests_total",
                "Requests an engine (or peer) served, by model and status class",
            ),
            &["engine", "model", "class"],
        )?;
        let ttft = latency_histogram(
            "kvmesh_engine_ttft_seconds",
            "Time from request start to the first response body byte, per engine and model",
            &["engine", "model"],
        )?;
        let itl = latency_histogram(
            "kvmesh_engine_itl_seconds",
            "Gaps between the body chunks of an SSE answer (one or more tokens each), per engine \
             and model",
            &["engine", "model"],
        )?;
        let tokens = IntCounterVec::new(
            Opts::new(
                "kvmesh_engine_tokens_total",
                "Tokens an engine reported: prompt, of those cached, and completion",
            ),
            &["engine", "kind"],
        )?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(ttft.clone()))?;
        registry.register(Box::new(itl.clone()))?;
        registry.register(Box::new(tokens.clone()))?;
        Ok(EngineSeries {
            requests,
            ttft,
            itl,
            tokens,
        })
    }

    /// One finished request that `engine` answered (`status` 0 or 499: aborted).
    pub fn served(
        &self,
        engine: &str,
        model: &str,
        status: u16,
        ttft: Option<std::time::Duration>,
    ) {
        let class = match status {
            200..=399 => "2xx",
            400..=498 => "4xx",
            500..=599 => "5xx",
            _ => "aborted",
        };
        self.requests
            .with_label_values(&[engine, model, class])
            .inc();
        if let Some(t) = ttft {
            self.ttft
                .with_label_values(&[engine, model])
                .observe(t.as_secs_f64());
        }
    }

    /// The inter-chunk histogram of `engine` and `model` (held by a streaming request).
    pub fn itl(&self, engine: &str, model: &str) -> prometheus::Histogram {
        self.itl.with_label_values(&[engine, model])
    }

    /// Tokens `engine` reported for one request.
    pub fn tokens(&self, engine: &str, u: &Usage) {
        self.tokens
            .with_label_values(&[engine, "prompt"])
            .inc_by(u.prompt_tokens);
        if let Some(c) = u.cached_tokens {
            self.tokens.with_label_values(&[engine, "cached"]).inc_by(c);
        }
        if let Some(c) = u.completion_tokens {
            self.tokens
                .with_label_values(&[engine, "completion"])
                .inc_by(c);
        }
    }

    /// Creates `engine`'s series for `models` at zero (alerts see 0, not no data).
    fn touch(&self, engine: &str, models: &[String]) {
        for kind in TOKEN_KINDS {
            self.tokens.with_label_values(&[engine, kind]);
        }
        for m in models {
            for class in STATUS_CLASSES {
                self.requests.with_label_values(&[engine, m, class]);
            }
            self.ttft.with_label_values(&[engine, m]);
            self.itl.with_label_values(&[engine, m]);
        }
    }

    /// Drops a departed peer's series (`models`: those it served).
    pub fn forget(&self, engine: &str, models: &[String]) {
        for kind in TOKEN_KINDS {
            let _ = self.tokens.remove_label_values(&[engine, kind]);
        }
        self.forget_models(engine, models);
    }

    /// Drops `engine`'s series of `models` (those it no longer serves).
    pub fn forget_models(&self, engine: &str, models: &[String]) {
        for m in models {
            for class in STATUS_CLASSES {
                let _ = self.requests.remove_label_values(&[engine, m, class]);
            }
            let _ = self.ttft.remove_label_values(&[engine, m]);
            let _ = self.itl.remove_label_values(&[engine, m]);
        }
    }
}

/// Label values known in advance: their series are created at zero, so that alerts see `0`
/// rather than no data.
pub mod labels {
    /// `reason` of `kvmesh_admission_rejections_total`.
    pub const REFUSALS: [&str; 10] = [
        "max_inflight",
        "body_budget",
        "body_timeout",
        "untrusted_hop",
        "unauthenticated",
        "key_inflight",
        "model_forbidden",
        "model_queue_full",
        "model_queue_timeout",
        "deadline",
    ];
    /// `outcome` of `kvmesh_config_reloads_total`.
    pub const RELOAD_OUTCOMES: [&str; 3] = ["applied", "unchanged", "refused"];
    /// `kvmesh_otel_spans_total` outcomes.
    pub const OTEL_OUTCOMES: [&str; 3] = ["ended", "exported", "failed"];
}
