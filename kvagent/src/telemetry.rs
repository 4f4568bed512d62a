//! Engine telemetry: scrape the co-located engine's Prometheus `/metrics` and reduce it to the
//! node's load (running, waiting, KV usage) for the `NodeLoad` RPC.
//!
//! Recognised metric families (the first family with any sample wins):
//!
//! | flavor | running | waiting | KV usage (0..1) |
//! |---|---|---|---|
//! | `vllm` (also kvmesh-sim-engine, engine-shim) | `vllm:num_requests_running` | `vllm:num_requests_waiting` | `vllm:kv_cache_usage_perc` or `vllm:gpu_cache_usage_perc` |
//! | `sglang` | `sglang:num_running_reqs` | `sglang:num_queue_reqs` | `sglang:token_usage` |
//! | `llamacpp` | `llamacpp:requests_processing` | `llamacpp:requests_deferred` | `llamacpp:kv_cache_usage_ratio` |
//!
//! Counts are summed over label sets (one per model); usage is the largest.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use parking_lot::Mutex;

use crate::metrics::Metrics;

/// The node's load as last scraped.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeLoad {
    /// A scrape succeeded and recognised a family.
    pub available: bool,
    /// Requests running.
    pub running: f64,
    /// Requests waiting.
    pub waiting: f64,
    /// KV cache in use, 0..1.
    pub kv_usage: f64,
    /// `vllm`, `sglang` or `llamacpp`.
    pub flavor: &'static str,
    /// When, in milliseconds since the Unix epoch.
    pub scraped_unix_ms: u64,
    /// Why the last scrape failed.
    pub error: String,
}

struct Family {
    flavor: &'static str,
    running: &'static str,
    waiting: &'static str,
    usage: &'static [&'static str],
}

const FAMILIES: &[Family] = &[
    Family {
        flavor: "vllm",
        running: "vllm:num_requests_running",
        waiting: "vllm:num_requests_waiting",
        usage: &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
    },
    Family {
        flavor: "sglang",
        running: "sglang:num_running_reqs",
        waiting: "sglang:num_queue_reqs",
        usage: &["sglang:token_usage"],
    },
    Family {
        flavor: "llamacpp",
        running: "llamacpp:requests_processing",
        waiting: "llamacpp:requests_deferred",
        usage: &["llamacpp:kv_cache_usage_ratio"],
    },
];

/// One sample line of the Prometheus text format: `name{labels} value [timestamp]`.
fn sample(line: &str) -> Option<(&str, f64)> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let (name, rest) = match line.find(['{', ' ', '\t']) {
        Some(i) if line.as_bytes()[i] == b'{' => {
            let close = line[i..].rfind('}')? + i;
            (&line[..i], &line[close + 1..])
        }
        Some(i) => (&line[..i], &line[i..]),
        None => return None,
    };
    // NaN and the infinities are valid exposition values, but no load to route on.
    let value = rest
        .split_whitespace()
        .next()?
        .parse::<f64>()
        .ok()
        .filter(|v| v.is_finite())?;
    Some((name, value))
}

/// Reduces a Prometheus text exposition to the node's load; `None` when no family is present.
pub fn parse_load(text: &str) -> Option<NodeLoad> {
    let samples: Vec<(&str, f64)> = text.lines().filter_map(sample).collect();
    FAMILIES.iter().find_map(|f| {
        let sum = |name: &str| {
            samples
                .iter()
                .filter(|(n, _)| *n == name)
                // A negative count is nonsense: 0.
                .map(|(_, v)| v.max(0.0))
                .reduce(|a, b| a + b)
        };
        let running = sum(f.running);
        let waiting = sum(f.waiting);
        let usage = f.usage.iter().find_map(|u| {
            samples
                .iter()
                .filter(|(n, _)| n == u)
                .map(|(_, v)| *v)
                .reduce(f64::max)
        });
        if running.is_none() && waiting.is_none() && usage.is_none() {
            return None;
        }
        // A sum that overflowed is as loaded as can be.
        let count = |v: Option<f64>| v.unwrap_or(0.0).min(f64::MAX);
        Some(NodeLoad {
            available: true,
            running: count(running),
            waiting: count(waiting),
            kv_usage: usage.unwrap_or(0.0).clamp(0.0, 1.0),
            flavor: f.flavor,
            scraped_unix_ms: 0,
            error: String::new(),
        })
    })
}

/// Checks that `url` is a plain `http://host:port/path` URL (the scraper speaks HTTP/1.1 only).
pub fn parse_http_url(url: &str) -> Result<hyper::Uri, String> {
    let uri: hyper::Uri = url.parse().map_err(|e| format!("{url:?}: {e}"))?;
    if uri.scheme_str() != Some("http") || uri.authority().is_none() {
        return Err(format!("{url:?} is not an http://host:port/path URL"));
    }
    Ok(uri)
}

/// Largest `/metrics` body read from the engine.
const MAX_METRICS_BYTES: usize = 4 << 20;

/// Scrapes an engine periodically; [`Scraper::load`] returns the latest result.
pub struct Scraper {
    latest: Mutex<NodeLoad>,
}

impl Scraper {
    /// A scraper with nothing scraped yet.
    pub fn new() -> Arc<Self> {
        Arc::new(Scraper {
            latest: Mutex::new(NodeLoad {
                error: "no engine configured".into(),
                ..Default::default()
            }),
        })
    }

    /// The latest load.
    pub fn load(&self) -> NodeLoad {
        self.latest.lock().clone()
    }

    /// Scrapes `url` every `interval` forever (each scrape bounded by `timeout`).
    pub async fn run(
        self: Arc<Self>,
        url: hyper::Uri,
        interval: Duration,
        timeout: Duration,
        metrics: Arc<Metrics>,
    ) {
        let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let result = tokio::time::timeout(timeout, async {
                let resp = client.get(url.clone()).await.map_err(|e| e.to_string())?;
                if !resp.status().is_success() {
                    return Err(format!("engine answered {}", resp.status()));
                }
                let body = Limited::new(resp.into_body(), MAX_METRICS_BYTES)
                    .collect()
                    .await
                    .map_err(|e| e.to_string())?
                    .to_bytes();
                let text =
                    std::str::from_utf8(&body).map_err(|_| "metrics are not UTF-8".to_string())?;
                parse_load(text)
                    .ok_or_else(|| "no known engine metric family in /metrics".to_string())
            })
            .await
            .unwrap_or_else(|_| Err(format!("scrape took longer than {timeout:?}")));
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0);
            let next = match result {
                Ok(mut load) => {
                    load.scraped_unix_ms = now;
                    load
                }
                Err(error) => {
                    metrics.scrape_errors.inc();
                    tracing::debug!(%error, "engine scrape failed");
                    NodeLoad {
                        scraped_unix_ms: now,
                        error,
                        ..Default::default()
                    }
                }
            };
            *self.latest.lock() = next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fuzzing regression (engine_replies): NaN, infinities, negative counts and sums that
    /// overflow are valid Prometheus text but must not become a load to route on.
    #[test]
    fn non_finite_and_negative_samples_give_a_sane_load() {
        let l = parse_load(
            "vllm:num_requests_running NaN\nvllm:num_requests_waiting -4\n\
             vllm:kv_cache_usage_perc +Inf\nvllm:num_requests_running 2\n\
             vllm:num_requests_running{model_name=\"b\"} -2\n",
        )
        .expect("vllm");
        // Each negative sample counts 0 (not -2 against the 2).
        assert_eq!((l.running, l.waiting, l.kv_usage), (2.0, 0.0, 0.0));
        let big = "vllm:num_requests_running 1e308\n".repeat(3);
        let l = parse_load(&big).expect("vllm");
        assert_eq!(l.running, f64::MAX);
        assert!(parse_load("vllm:num_requests_running NaN\n").is_none());
    }

    #[test]
    fn each_engine_flavor_is_read_and_summed_over_models() {
        let vllm = "# HELP x\n# TYPE vllm:num_requests_running gauge\n\
            vllm:num_requests_running{model_name=\"a\"} 3\n\
            vllm:num_requests_running{model_name=\"b b\"} 2 1700000000\n\
            vllm:num_requests_waiting{model_name=\"a\"} 7\n\
            vllm:kv_cache_usage_perc{model_name=\"a\"} 0.25\n";
        let l = parse_load(vllm).expect("vllm");
        assert_eq!(
            (l.flavor, l.running, l.waiting, l.kv_usage),
            ("vllm", 5.0, 7.0, 0.25)
        );

        let sglang = "sglang:num_running_reqs{tp_rank=\"0\"} 4.0\nsglang:num_queue_reqs 1\nsglang:token_usage 0.5\n";
        let l = parse_load(sglang).expect("sglang");
        assert_eq!(
            (l.flavor, l.running, l.waiting, l.kv_usage),
            ("sglang", 4.0, 1.0, 0.5)
        );

        let llama = "llamacpp:requests_processing 1\nllamacpp:requests_deferred 0\nllamacpp:kv_cache_usage_ratio 0.9\n";
        let l = parse_load(llama).expect("llamacpp");
        assert_eq!((l.flavor, l.running, l.kv_usage), ("llamacpp", 1.0, 0.9));

        assert!(parse_load("process_cpu_seconds_total 1\n").is_none());
        assert!(parse_load("vllm:num_requests_running{broken 1\n").is_none());
    }

    #[test]
    fn only_plain_http_urls_are_accepted() {
        assert!(parse_http_url("http://127.0.0.1:8000/metrics").is_ok());
        assert!(parse_http_url("https://h/metrics").is_err());
        assert!(parse_http_url("/metrics").is_err());
    }
}
