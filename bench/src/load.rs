//! Load generation: an OpenAI streaming client that measures TTFT and reads `usage`, the
//! shared-prefix workload, and summary statistics.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvmesh_filters::usage::{self, SseUsageScanner};

/// The HTTP client the load generator uses (keep-alive pool, HTTP/1.1; `https://` URLs too).
pub type HttpClient = Client<
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    Full<Bytes>,
>;

/// A client with Nagle off and a pool large enough for `concurrency` (`https://` trusts no
/// one: see [`client_with_tls`]).
pub fn client(concurrency: usize) -> HttpClient {
    client_with_tls(concurrency, crate::tls::no_roots())
}

/// [`client`], verifying `https://` servers with `tls`.
pub fn client_with_tls(concurrency: usize, tls: rustls::ClientConfig) -> HttpClient {
    let mut conn = hyper_util::client::legacy::connect::HttpConnector::new();
    conn.set_nodelay(true);
    conn.enforce_http(false);
    let conn = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .wrap_connector(conn);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(concurrency.max(1))
        .pool_idle_timeout(Duration::from_secs(30))
        .build(conn)
}

/// What one request measured.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Sample {
    /// HTTP status (0: transport error).
    pub status: u16,
    /// Time to the first body byte (non-streamed) or to the first SSE event carrying content.
    pub ttft: Duration,
    /// Gaps between consecutive content events of a stream, ms.
    pub itl_ms: Vec<f32>,
    /// Content events received (output tokens, for engines that stream one token an event).
    pub output_events: u64,
    /// Time to the end of the response.
    pub latency: Duration,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: u64,
    /// The `x-sim-engine` (or `x-kvmesh-engine`) header, when present.
    pub engine: Option<String>,
}

/// Splits an SSE stream into events and notes when each content-carrying event arrives.
#[derive(Default)]
struct ContentEvents {
    pending: Vec<u8>,
    first: Option<Duration>,
    last: Option<Duration>,
    gaps_ms: Vec<f32>,
    count: u64,
}

impl ContentEvents {
    fn feed(&mut self, data: &[u8], at: Duration) {
        self.pending.extend_from_slice(data);
        while let Some(end) = self.pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = self.pending.drain(..end + 2).collect();
            if has_content(&event) {
                self.count += 1;
                match self.last {
                    None => self.first = Some(at),
                    Some(prev) => self.gaps_ms.push((at - prev).as_secs_f32() * 1e3),
                }
                self.last = Some(at);
            }
        }
    }
}

/// Whether an SSE event carries generated text (a non-empty `content` or `text` field).
fn has_content(event: &[u8]) -> bool {
    [&b"\"content\":\""[..], &b"\"text\":\""[..]]
        .iter()
        .any(|key| {
            event
                .windows(key.len())
                .position(|w| w == *key)
                .is_some_and(|i| event.get(i + key.len()).is_some_and(|&c| c != b'"'))
        })
}

/// Sends one POST with a JSON body and measures it. Streams are read to the end.
pub async fn send(client: &HttpClient, url: &str, body: Bytes) -> Sample {
    let start = Instant::now();
    let req = match http::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(body))
    {
        Ok(r) => r,
        Err(_) => return Sample::default(),
    };
    let resp = match client.request(req).await {
        Ok(r) => r,
        Err(_) => {
            return Sample {
                latency: start.elapsed(),
                ..Sample::default()
            }
        }
    };
    let status = resp.status().as_u16();
    let engine = resp
        .headers()
        .get("x-sim-engine")
        .or_else(|| resp.headers().get("x-kvmesh-engine"))
        .and_then(|v| v.to_str().ok())
        .map(String::from);
    let sse = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let mut body = resp.into_body();
    let mut first_byte = None;
    let mut events = ContentEvents::default();
    let mut scanner = SseUsageScanner::new(1 << 20);
    let mut whole = Vec::new();
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else {
            return Sample {
                status: 0,
                latency: start.elapsed(),
                engine,
                ..Sample::default()
            };
        };
        if let Some(data) = frame.data_ref() {
            let at = start.elapsed();
            if first_byte.is_none() && !data.is_empty() {
                first_byte = Some(at);
            }
            if sse {
                scanner.feed(data);
                events.feed(data, at);
            } else {
                whole.extend_from_slice(data);
            }
        }
    }
    let u = if sse {
        scanner.usage()
    } else {
        usage::from_json(&whole)
    };
    Sample {
        status,
        ttft: events
            .first
            .or(first_byte)
            .unwrap_or_else(|| start.elapsed()),
        itl_ms: events.gaps_ms,
        output_events: events.count,
        latency: start.elapsed(),
        prompt_tokens: u.map_or(0, |u| u.prompt_tokens),
        cached_tokens: u.and_then(|u| u.cached_tokens).unwrap_or(0),
        engine,
    }
}

/// Deterministic text of `len` bytes: lowercase words drawn from `seed`.
pub fn text(seed: u64, len: usize) -> String {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut s = String::with_capacity(len + 8);
    while s.len() < len {
        let w = rng.usize(2..9);
        for _ in 0..w {
            s.push(rng.lowercase());
        }
        s.push(' ');
    }
    s.truncate(len);
    s
}

/// The shared-prefix workload: `prefixes` system prompts, each shared by `users` users, each
/// user asking `turns` different questions. Requests come in a seeded random order.
#[derive(Debug, Clone)]
pub struct SharedPrefix {
    /// Distinct system prompts.
    pub prefixes: usize,
    /// Users per system prompt.
    pub users: usize,
    /// Questions per user.
    pub turns: usize,
    /// Bytes of each system prompt.
    pub prefix_bytes: usize,
    /// Bytes of each question.
    pub suffix_bytes: usize,
    /// `max_tokens` of each request.
    pub max_tokens: u64,
    /// Model name.
    pub model: String,
    /// Seed of the order and the text.
    pub seed: u64,
}

impl SharedPrefix {
    /// The requests in send order: the user id (`user-{prompt}-{user}`) and the messages.
    pub fn requests(&self) -> Vec<(String, Vec<serde_json::Value>)> {
        let mut keys: Vec<(usize, usize, usize)> = Vec::new();
        for p in 0..self.prefixes {
            for u in 0..self.users {
                for t in 0..self.turns {
                    keys.push((p, u, t));
                }
            }
        }
        fastrand::Rng::with_seed(self.seed).shuffle(&mut keys);
        keys.into_iter()
            .map(|(p, u, t)| {
                let system = text(
                    self.seed ^ ((p as u64 + 1) * 0x1000_0001),
                    self.prefix_bytes,
                );
                let question = text(
                    self.seed ^ (((p * 1000 + u * 10 + t) as u64 + 7) * 0x2000_0003),
                    self.suffix_bytes,
                );
                let messages = vec![
                    serde_json::json!({"role": "system", "content": system}),
                    serde_json::json!({"role": "user", "content": question}),
                ];
                (format!("user-{p}-{u}"), messages)
            })
            .collect()
    }

    /// The streamed request bodies, in send order.
    pub fn bodies(&self) -> Vec<Bytes> {
        self.requests()
            .into_iter()
            .map(|(user, messages)| {
                let body = serde_json::json!({
                    "model": self.model,
                    "messages": messages,
                    "max_tokens": self.max_tokens,
                    "stream": true,
                    "stream_options": {"include_usage": true},
                    "user": user,
                });
                Bytes::from(serde_json::to_vec(&body).unwrap_or_default())
            })
            .collect()
    }
}

/// Sends `n` requests with `concurrency` workers (closed loop: each sends its next request when
/// the last one ends); request `i` goes to `urls[i % urls.len()]` (several entry points, e.g.
/// one sidecar per client) with body `body(i)`, rendered when sent. Samples come back in request
/// order; no URL, no requests.
pub async fn closed_loop<F>(
    client: &HttpClient,
    urls: &[String],
    n: usize,
    concurrency: usize,
    body: F,
) -> Vec<Sample>
where
    F: Fn(usize) -> Bytes + Send + Sync + 'static,
{
    if urls.is_empty() {
        return Vec::new();
    }
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let body = Arc::new(body);
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..concurrency.max(1) {
        let (next, body, client, urls) =
            (next.clone(), body.clone(), client.clone(), urls.to_vec());
        workers.spawn(async move {
            let mut out = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= n {
                    break;
                }
                out.push((i, send(&client, &urls[i % urls.len()], body(i)).await));
            }
            out
        });
    }
    let mut all = Vec::with_capacity(n);
    while let Some(r) = workers.join_next().await {
        all.extend(r.unwrap_or_default());
    }
    in_request_order(all)
}

/// Samples tagged with their request index, back in request order.
fn in_request_order(mut tagged: Vec<(usize, Sample)>) -> Vec<Sample> {
    tagged.sort_by_key(|(i, _)| *i);
    tagged.into_iter().map(|(_, s)| s).collect()
}

/// Sends `plan` open loop: each request at its planned offset from now, whatever is still in
/// flight (at most `max_inflight` at once; later ones wait for a slot and their lateness counts
/// in their latency). Request `i` goes to `urls[i % urls.len()]`. Prints progress to stderr
/// every 5 s when `progress`.
pub async fn open_loop(
    client: &HttpClient,
    urls: &[String],
    model: &str,
    plan: &[crate::workload::Planned],
    max_inflight: usize,
    progress: bool,
) -> Vec<Sample> {
    if urls.is_empty() {
        return Vec::new();
    }
    let start = tokio::time::Instant::now();
    let slots = Arc::new(tokio::sync::Semaphore::new(max_inflight.max(1)));
    let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let failed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let total = plan.len();
    let reporter = progress.then(|| {
        let (done, failed) = (done.clone(), failed.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            tick.tick().await;
            loop {
                tick.tick().await;
                eprintln!(
                    "  [{:>5.0}s] {}/{} done, {} failed",
                    start.elapsed().as_secs_f64(),
                    done.load(std::sync::atomic::Ordering::Relaxed),
                    total,
                    failed.load(std::sync::atomic::Ordering::Relaxed)
                );
            }
        })
    });
    let mut tasks = tokio::task::JoinSet::new();
    for (i, p) in plan.iter().enumerate() {
        tokio::time::sleep_until(start + p.at).await;
        let Ok(permit) = slots.clone().acquire_owned().await else {
            break;
        };
        let (client, url, body) = (client.clone(), urls[i % urls.len()].clone(), p.body(model));
        let (done, failed) = (done.clone(), failed.clone());
        tasks.spawn(async move {
            let s = send(&client, &url, body).await;
            drop(permit);
            if !(200..300).contains(&s.status) {
                failed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            (i, s)
        });
    }
    let mut out: Vec<(usize, Sample)> = Vec::with_capacity(plan.len());
    while let Some(r) = tasks.join_next().await {
        if let Ok(x) = r {
            out.push(x);
        }
    }
    if let Some(r) = reporter {
        r.abort();
    }
    in_request_order(out)
}

/// Summary statistics of a run.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Summary {
    /// Requests sent.
    pub requests: usize,
    /// Non-2xx or failed requests.
    pub errors: usize,
    /// cached / prompt tokens over the run.
    pub hit_ratio: f64,
    /// Mean TTFT, ms.
    pub mean_ttft_ms: f64,
    /// p50 / p90 / p99 TTFT, ms.
    pub ttft_ms: [f64; 3],
    /// p50 / p90 / p99 latency, ms.
    pub latency_ms: [f64; 3],
    /// Requests per second over the wall time.
    pub rps: f64,
    /// p50 / p90 / p99 inter-token latency, ms (streams).
    pub itl_ms: [f64; 3],
    /// Content events (about output tokens) per second over the wall time.
    pub output_tps: f64,
    /// Prompt tokens the engines reported, in total.
    pub prompt_tokens: u64,
    /// Of those, cached.
    pub cached_tokens: u64,
}

/// The `q`-quantile (0..=1) of sorted values, nearest-rank.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// The mean of `values` (0 when there are none).
pub fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        0.0
    } else {
        values.iter().sum::<f64>() / values.len() as f64
    }
}

/// p50 / p90 / p99 of `values` (nearest rank).
pub fn percentiles(mut values: Vec<f64>) -> [f64; 3] {
    values.sort_by(f64::total_cmp);
    [
        quantile(&values, 0.5),
        quantile(&values, 0.9),
        quantile(&values, 0.99),
    ]
}

/// Summarises samples taken over `wall` time.
pub fn summarize(samples: &[Sample], wall: Duration) -> Summary {
    let ok: Vec<&Sample> = samples
        .iter()
        .filter(|s| (200..300).contains(&s.status))
        .collect();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let ttft: Vec<f64> = ok.iter().map(|s| ms(s.ttft)).collect();
    let prompt: u64 = ok.iter().map(|s| s.prompt_tokens).sum();
    let cached: u64 = ok.iter().map(|s| s.cached_tokens).sum();
    let events: u64 = ok.iter().map(|s| s.output_events).sum();
    let wall_s = wall.as_secs_f64().max(1e-9);
    Summary {
        requests: samples.len(),
        errors: samples.len() - ok.len(),
        hit_ratio: if prompt == 0 {
            0.0
        } else {
            cached as f64 / prompt as f64
        },
        mean_ttft_ms: mean(&ttft),
        ttft_ms: percentiles(ttft),
        latency_ms: percentiles(ok.iter().map(|s| ms(s.latency)).collect()),
        rps: samples.len() as f64 / wall_s,
        itl_ms: percentiles(
            ok.iter()
                .flat_map(|s| s.itl_ms.iter().map(|&g| f64::from(g)))
                .collect(),
        ),
        output_tps: events as f64 / wall_s,
        prompt_tokens: prompt,
        cached_tokens: cached,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_nearest_rank() {
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), 5.0);
        assert_eq!(quantile(&v, 0.9), 9.0);
        assert_eq!(quantile(&v, 0.99), 10.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
    }

    #[test]
    fn shared_prefix_workload_shares_exactly_the_system_prompt() {
        let w = SharedPrefix {
            prefixes: 2,
            users: 2,
            turns: 2,
            prefix_bytes: 100,
            suffix_bytes: 20,
            max_tokens: 1,
            model: "m".into(),
            seed: 3,
        };
        let bodies = w.bodies();
        assert_eq!(bodies.len(), 8);
        let systems: std::collections::HashSet<String> = bodies
            .iter()
            .map(|b| {
                serde_json::from_slice::<serde_json::Value>(b).unwrap()["messages"][0]["content"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect();
        assert_eq!(systems.len(), 2);
        let questions: std::collections::HashSet<String> = bodies
            .iter()
            .map(|b| {
                serde_json::from_slice::<serde_json::Value>(b).unwrap()["messages"][1]["content"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect();
        assert_eq!(questions.len(), 8);
        assert_eq!(w.bodies(), bodies, "deterministic");
    }
}
