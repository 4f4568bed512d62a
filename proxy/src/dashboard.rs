//! The fleet dashboard: `GET /dashboard`, one static page (its script and style served beside
//! it, nothing from elsewhere), polling `GET /dashboard/status`, a JSON summary of this node:
//! the engines with their load and residency, the hit ratio, TTFT percentiles and the request
//! rate of the last seconds, gossip peers, the last refusals and the reload state of the
//! configuration. Served wherever `/metrics` is (the admin listener, and the API listener
//! unless `admin.on_api_listener = false`).
//!
//! [`Recent`] keeps what Prometheus counters cannot answer without a Prometheus: a rate over
//! the last seconds, percentiles over the last minute, the last refusals. All of it is bounded.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant, SystemTime};

use parking_lot::Mutex;
use serde::Serialize;

use kvmesh_filters::error::ApiError;

use crate::access::Line;

/// The page.
pub const PAGE: &str = include_str!("dashboard/page.html");
/// Its script.
pub const SCRIPT: &str = include_str!("dashboard/app.js");
/// Its style sheet.
pub const STYLE: &str = include_str!("dashboard/app.css");

/// The page's Content-Security-Policy: its own script, style and status only (and an empty
/// icon, so that browsers do not ask for `/favicon.ico`).
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
                       connect-src 'self'; img-src data:; base-uri 'none'; \
                       form-action 'none'; frame-ancestors 'none'";

/// Whether `path` is one of the dashboard's.
pub fn is_dashboard_path(path: &str) -> bool {
    path == "/dashboard" || path.starts_with("/dashboard/")
}

/// Seconds of per-second request counts kept (the ring's length).
const RATE_SLOTS: usize = 64;
/// The request rate is over this many complete seconds.
const RATE_WINDOW_SECS: u64 = 10;
/// TTFT percentiles are over answers of this last stretch of time...
const TTFT_WINDOW: Duration = Duration::from_secs(60);
/// ... and at most this many of them (the most recent).
const MAX_ANSWERS: usize = 4096;
/// Refusals kept.
const MAX_REFUSALS: usize = 32;
/// Longest text kept from a request in a refusal record (path, model, message), bytes.
const MAX_TEXT: usize = 160;

/// One answered request: which engine, how soon.
struct Answer {
    at: Instant,
    engine: String,
    ttft_ms: f64,
}

/// One request the proxy refused (answered with an error itself).
#[derive(Debug, Clone, Serialize)]
pub struct Refusal {
    /// When, milliseconds since the Unix epoch.
    pub at_unix_ms: u64,
    /// The status sent.
    pub status: u16,
    /// The OpenAI-style error code.
    pub code: &'static str,
    /// The error message (cut at 160 bytes).
    pub message: String,
    /// The method (cut).
    pub method: String,
    /// The path (cut).
    pub path: String,
    /// The model asked for, if read (cut).
    pub model: String,
    /// The client's address (empty where unknown).
    pub client: String,
    /// The request id.
    pub request_id: String,
}

/// Recent activity for the dashboard: bounded, updated once per finished request.
pub struct Recent {
    started: Instant,
    /// (second since `started`, requests finished in it), by second modulo the length.
    seconds: Mutex<[(u64, u64); RATE_SLOTS]>,
    answers: Mutex<VecDeque<Answer>>,
    refusals: Mutex<VecDeque<Refusal>>,
    /// The last status documents served (with and without clients' details) and when: a
    /// poll walks the residency index, so one is rendered at most once a second.
    status: Mutex<[Option<(Instant, bytes::Bytes)>; 2]>,
}

impl Default for Recent {
    fn default() -> Self {
        Recent {
            started: Instant::now(),
            seconds: Mutex::new([(u64::MAX, 0); RATE_SLOTS]),
            answers: Mutex::new(VecDeque::new()),
            refusals: Mutex::new(VecDeque::new()),
            status: Mutex::new([None, None]),
        }
    }
}

/// How long a rendered status document is served again.
const STATUS_TTL: Duration = Duration::from_secs(1);

/// `s` cut to at most [`MAX_TEXT`] bytes, at a character boundary.
fn cut(s: &str) -> String {
    crate::access::prefix(s, MAX_TEXT).to_string()
}

/// The nearest-rank percentile `q` (0..=1) of sorted `v`.
fn percentile(v: &[f64], q: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    Some(v[rank - 1])
}

/// TTFT percentiles, milliseconds, over the answers of the last minute.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Percentiles {
    /// Answers they are over.
    pub samples: usize,
    /// Median.
    pub p50: Option<f64>,
    /// 90th percentile.
    pub p90: Option<f64>,
    /// 99th percentile.
    pub p99: Option<f64>,
}

impl Percentiles {
    fn of(mut v: Vec<f64>) -> Self {
        v.sort_by(f64::total_cmp);
        Percentiles {
            samples: v.len(),
            p50: percentile(&v, 0.5),
            p90: percentile(&v, 0.9),
            p99: percentile(&v, 0.99),
        }
    }
}

impl Recent {
    /// Notes a finished request (its access-log line) and, when the proxy refused it, why.
    pub fn finished(&self, line: &Line<'_>, refused: Option<&ApiError>) {
        let now = Instant::now();
        let sec = now.duration_since(self.started).as_secs();
        {
            let mut s = self.seconds.lock();
            let slot = &mut s[(sec % RATE_SLOTS as u64) as usize];
            if slot.0 != sec {
                *slot = (sec, 0);
            }
            slot.1 += 1;
        }
        // An answer is an engine's success: an error body (or Envoy's own 503 for an engine it
        // could not reach, in picker mode) says nothing about how fast engines answer.
        let answered = (200..300).contains(&line.status) && !line.engine.is_empty();
        if let (Some(ttft), true) = (line.ttft, answered) {
            let mut a = self.answers.lock();
            if a.len() >= MAX_ANSWERS {
                a.pop_front();
            }
            a.push_back(Answer {
                at: now,
                engine: line.engine.to_string(),
                ttft_ms: ttft.as_secs_f64() * 1000.0,
            });
        }
        if let Some(e) = refused {
            let at_unix_ms = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
            let mut r = self.refusals.lock();
            if r.len() >= MAX_REFUSALS {
                r.pop_front();
            }
            r.push_back(Refusal {
                at_unix_ms,
                status: e.status(),
                code: e.kind.code(),
                message: cut(&e.message),
                method: cut(line.method),
                path: cut(line.path),
                model: cut(line.model),
                client: line.client.to_string(),
                request_id: cut(line.request_id),
            });
        }
    }

    /// Requests finished per second over the last complete seconds (fewer just after start).
    pub fn per_sec(&self) -> f64 {
        let now = self.started.elapsed().as_secs();
        let window = RATE_WINDOW_SECS.min(now).max(1);
        let s = self.seconds.lock();
        let n: u64 = s
            .iter()
            .filter(|(sec, _)| *sec < now && *sec + window >= now)
            .map(|(_, n)| n)
            .sum();
        n as f64 / window as f64
    }

    /// TTFT percentiles of the last minute, over all engines and per engine; and each engine's
    /// count of answers in it.
    pub fn ttft(&self) -> (Percentiles, BTreeMap<String, (usize, Percentiles)>) {
        let now = Instant::now();
        let mut all = Vec::new();
        let mut by_engine: BTreeMap<String, Vec<f64>> = BTreeMap::new();
        for a in self
            .answers
            .lock()
            .iter()
            .filter(|a| now.duration_since(a.at) <= TTFT_WINDOW)
        {
            all.push(a.ttft_ms);
            by_engine
                .entry(a.engine.clone())
                .or_default()
                .push(a.ttft_ms);
        }
        let per = by_engine
            .into_iter()
            .map(|(e, v)| (e, (v.len(), Percentiles::of(v))))
            .collect();
        (Percentiles::of(all), per)
    }

    /// The last refusals, newest first.
    pub fn refusals(&self) -> Vec<Refusal> {
        self.refusals.lock().iter().rev().cloned().collect()
    }

    /// The status document (`full`: with clients' addresses and request ids), rendered by
    /// `render` unless one younger than a second is at hand.
    pub fn status_cached(&self, full: bool, render: impl FnOnce() -> bytes::Bytes) -> bytes::Bytes {
        let slot = usize::from(full);
        let mut cache = self.status.lock();
        if let Some((at, b)) = &cache[slot] {
            if at.elapsed() < STATUS_TTL {
                return b.clone();
            }
        }
        let b = render();
        cache[slot] = Some((Instant::now(), b.clone()));
        b
    }

    /// Seconds since start.
    pub fn uptime_secs(&self) -> u64 {
        self.started.elapsed().as_secs()
    }
}

/// `GET /dashboard/status`.
#[derive(Debug, Serialize)]
pub struct Status {
    /// This node.
    pub node: NodeStatus,
    /// Requests through it.
    pub requests: RequestStatus,
    /// Cached / prompt tokens since start (0 before any usage).
    pub hit_ratio: f64,
    /// Prompt tokens engines reported since start.
    pub prompt_tokens: u64,
    /// Of which cached.
    pub cached_tokens: u64,
    /// TTFT percentiles of the last minute.
    pub ttft_ms: Percentiles,
    /// The residency index.
    pub residency: ResidencyStatus,
    /// Gossip.
    pub gossip: GossipStatus,
    /// Every engine, configured ones first.
    pub engines: Vec<EngineStatus>,
    /// The last refusals, newest first.
    pub refusals: Vec<Refusal>,
    /// Reloads of the configuration file.
    pub config: ConfigStatus,
}

/// This node.
#[derive(Debug, Serialize)]
pub struct NodeStatus {
    /// Its gossip node id (with `[cluster]`), else empty.
    pub node_id: String,
    /// `gateway`, `sidecar` or `picker`.
    pub mode: String,
    /// The policy in force.
    pub policy: &'static str,
    /// The build.
    pub version: &'static str,
    /// Seconds since start.
    pub uptime_secs: u64,
}

/// Requests through the node.
#[derive(Debug, Serialize)]
pub struct RequestStatus {
    /// Finished per second, over the last 10 s.
    pub per_sec: f64,
    /// In flight now.
    pub inflight: u64,
    /// The cap (`max_inflight`).
    pub max_inflight: u64,
}

/// The residency index.
#[derive(Debug, Serialize)]
pub struct ResidencyStatus {
    /// Digests it holds.
    pub digests: usize,
    /// Entries (digest, engine) by source.
    pub entries: BTreeMap<&'static str, usize>,
}

/// Gossip.
#[derive(Debug, Serialize)]
pub struct GossipStatus {
    /// `[cluster]` is on.
    pub enabled: bool,
    /// Live peers.
    pub peers: i64,
    /// Bytes sent and received on the gossip socket since start.
    pub bytes_sent: u64,
    /// (see `bytes_sent`)
    pub bytes_received: u64,
}

/// One engine.
#[derive(Debug, Serialize)]
pub struct EngineStatus {
    /// Its name (a peer's node id for a peer's engine).
    pub name: String,
    /// Its URL.
    pub url: String,
    /// `local` (configured) or `peer` (learnt by gossip).
    pub kind: &'static str,
    /// Passing its health probe (or its peer says so).
    pub healthy: bool,
    /// Requests in flight on it.
    pub inflight: u64,
    /// Prompt bytes dispatched to it and not yet prefilled.
    pub pending_prefill_bytes: u64,
    /// Digests the index says it holds.
    pub residency_digests: usize,
    /// Models it serves, when known.
    pub models: Vec<String>,
    /// Its answers in the last minute.
    pub answers_last_minute: usize,
    /// Their TTFT percentiles.
    pub ttft_ms: Percentiles,
}

/// Reloads of the configuration file.
#[derive(Debug, Serialize)]
pub struct ConfigStatus {
    /// Reloads put in force.
    pub reloads_applied: u64,
    /// Reloads refused.
    pub reloads_refused: u64,
    /// The last one was not refused.
    pub last_reload_successful: bool,
    /// Changed keys waiting for a restart.
    pub restart_pending_keys: i64,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use kvmesh_filters::error::ErrorKind;

    fn line<'a>(engine: &'a str, ttft_ms: Option<u64>, model: &'a str) -> Line<'a> {
        Line {
            request_id: "id",
            method: "POST",
            path: "/v1/chat/completions",
            model,
            status: 200,
            engine,
            reason: "",
            overlap_blocks: 0,
            cached_tokens: None,
            completion_tokens: None,
            ttft: ttft_ms.map(Duration::from_millis),
            duration: Duration::from_millis(1),
            bytes_in: 0,
            bytes_out: 0,
            client: "127.0.0.1",
            key: "",
        }
    }

    /// Percentiles by nearest rank, overall and per engine.
    #[test]
    fn ttft_percentiles_by_nearest_rank() {
        let r = Recent::default();
        for ms in 1..=100 {
            r.finished(
                &line(if ms % 2 == 0 { "a" } else { "b" }, Some(ms), "m"),
                None,
            );
        }
        r.finished(&line("", None, "m"), None);
        let (all, per) = r.ttft();
        assert_eq!(all.samples, 100);
        assert_eq!(all.p50, Some(50.0));
        assert_eq!(all.p90, Some(90.0));
        assert_eq!(all.p99, Some(99.0));
        assert_eq!(per["a"].0, 50);
        assert_eq!(per["a"].1.p50, Some(50.0));
        assert_eq!(per["b"].1.p99, Some(99.0));
        assert_eq!(Percentiles::of(Vec::new()).p50, None);
    }

    /// Refusals are bounded, newest first, their texts cut at a character boundary.
    #[test]
    fn refusals_are_bounded_and_cut() {
        let r = Recent::default();
        let long = "é".repeat(200);
        for i in 0..(MAX_REFUSALS + 5) {
            let e = ApiError::new(ErrorKind::ModelNotFound, format!("no {i}"));
            r.finished(&line("", None, &long), Some(&e));
        }
        let got = r.refusals();
        assert_eq!(got.len(), MAX_REFUSALS);
        assert_eq!(got[0].message, format!("no {}", MAX_REFUSALS + 4));
        assert_eq!(got[0].status, 404);
        assert!(got[0].model.len() <= MAX_TEXT && got[0].model.starts_with('é'));
    }

    /// The answers kept are bounded.
    #[test]
    fn answers_are_bounded() {
        let r = Recent::default();
        for _ in 0..(MAX_ANSWERS + 10) {
            r.finished(&line("a", Some(1), "m"), None);
        }
        assert_eq!(r.ttft().0.samples, MAX_ANSWERS);
    }
}
