//! `kvmesh-sim-engine`: an OpenAI-compatible LLM engine simulator (a benchmark and test
//! instrument, not part of kvmesh).
//!
//! It has a real per-replica prefix cache and a step-based latency model, so that queueing and
//! cache hits behave like a real engine's, repeatably and without a GPU.
//!
//! **Tokenizer.** By default one token per 4 bytes of the rendered prompt (the bytes as a
//! little-endian u32; the last token zero-padded), chat messages rendered ChatML-style:
//! `<|im_start|>{role}\n{text}<|im_end|>\n` per message, then `<|im_start|>assistant\n`. With
//! `--tokenizer-gguf`, a real model's chat template and vocabulary instead (`kvmesh-tokenize`,
//! the code engine-shim and the proxy's token mode use), so that a token-mode proxy's digests
//! are the simulator's. Token-id prompts are used as given.
//!
//! **Prefix cache.** Token blocks of `block_tokens`, named by the kvmesh token-mode digest chain,
//! in an LRU of `cache_blocks` blocks. A request's leading resident blocks are its
//! `cached_tokens`; at least one token is always computed. Its blocks enter the cache when its
//! prefill completes.
//!
//! **Routing digests.** A request's `x-kvmesh-prefix-digests` header (the leading digests a
//! kvmesh proxy routed it by) is compared with the simulator's own chain of the prompt and
//! counted in `kvmesh_sim_routing_digests_total{result="match|mismatch|malformed"}`: a
//! token-mode proxy in front of engines that tokenize as it does matches every time.
//!
//! **Latency model.** One scheduler runs steps. In each step it admits prefill work from the
//! FIFO waiting queue up to `max_batch_tokens` prompt tokens (chunked prefill; a long prompt
//! spans several steps) while at most `max_running` requests decode, and every decoding request
//! emits one token. A step lasts
//! `prefill_tokens * prefill_us_per_token + (decoding > 0 ? decode_us_per_step + decoding * decode_us_per_seq : 0)`
//! microseconds (rounded up to the 1 ms timer when it sleeps). A request's first token comes at
//! the end of the step that finishes its prefill. With `--instant` (or every cost at zero) the
//! engine answers at once, without the scheduler (for proxy-overhead benchmarks).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use clap::Parser;
use http::{Method, Request, Response};
use http_body_util::BodyExt;
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use kvmesh_filters::chain::{
    check_digests, parse_digests, token_chain, Digest, DigestCheck, Namespace, DIGESTS_HEADER,
};
use kvmesh_tokenize::{ModelTokenizer, PrefixCache};
use lru::LruCache;
use parking_lot::Mutex;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, Notify};

use crate::http::{error, full, json as json_response, Body};

/// Command line and knobs of the simulator; every field has a documented default.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "kvmesh-sim-engine",
    about = "OpenAI-compatible LLM engine simulator (benchmark instrument)"
)]
pub struct SimConfig {
    /// Address to listen on; port 0 picks a free port (printed on stdout).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// Model id served (and listed by /v1/models).
    #[arg(long, default_value = "sim-model")]
    pub model: String,
    /// Name of this replica, returned in the `x-sim-engine` response header (beside
    /// `x-sim-body-blake3`, `x-sim-body-len`, `x-sim-body-framing` and
    /// `x-sim-saw-authorization`, and `x-sim-traceparent` / `x-sim-tracestate` when it was sent
    /// them: what it received).
    #[arg(long, default_value = "sim")]
    pub name: String,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_tokens: usize,
    /// Prefix-cache capacity in blocks.
    #[arg(long, default_value_t = 4096)]
    pub cache_blocks: usize,
    /// Microseconds of step time per prefilled prompt token.
    #[arg(long, default_value_t = 50.0)]
    pub prefill_us_per_token: f64,
    /// Microseconds of step time when any request decodes.
    #[arg(long, default_value_t = 8000.0)]
    pub decode_us_per_step: f64,
    /// Extra microseconds of step time per decoding request.
    #[arg(long, default_value_t = 100.0)]
    pub decode_us_per_seq: f64,
    /// Most prompt tokens prefilled in one step (the chunked-prefill budget).
    #[arg(long, default_value_t = 2048)]
    pub max_batch_tokens: u64,
    /// Most requests decoding at once; the rest wait.
    #[arg(long, default_value_t = 64)]
    pub max_running: usize,
    /// `max_tokens` when a request gives none.
    #[arg(long, default_value_t = 16)]
    pub default_max_tokens: u64,
    /// Largest accepted request body in bytes.
    #[arg(long, default_value_t = 64 << 20)]
    pub max_body_bytes: usize,
    /// Answer at once, whatever the per-token costs (for proxy-overhead benchmarks and tests).
    #[arg(long)]
    pub instant: bool,
    /// The engine's `kv_epoch`, reported in /server_info and /metrics (0: seconds since the epoch at start).
    #[arg(long, default_value_t = 0)]
    pub kv_epoch: u64,
    /// Tokenize as the model in this GGUF file does (its chat template and vocabulary) instead
    /// of 4 bytes a token. Default: none (4 bytes a token).
    #[arg(long)]
    pub tokenizer_gguf: Option<PathBuf>,
}

impl SimConfig {
    /// The step-time model these settings give.
    pub fn costs(&self) -> StepCosts {
        StepCosts {
            prefill_us_per_token: self.prefill_us_per_token,
            decode_us_per_step: self.decode_us_per_step,
            decode_us_per_seq: self.decode_us_per_seq,
            max_batch_tokens: self.max_batch_tokens,
        }
    }
}

/// The simulator's step-time model (module docs), one definition for the scheduler and for
/// the TTFT floor a benchmark reports beside its results.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepCosts {
    /// Microseconds of step time per prefilled prompt token.
    pub prefill_us_per_token: f64,
    /// Microseconds of step time when any request decodes.
    pub decode_us_per_step: f64,
    /// Extra microseconds of step time per decoding request.
    pub decode_us_per_seq: f64,
    /// Most prompt tokens prefilled in one step.
    pub max_batch_tokens: u64,
}

impl StepCosts {
    /// How long a step that prefills `prefill` tokens while `decoding` requests decode lasts,
    /// in microseconds (before the scheduler's 1 ms timer rounds it up).
    pub fn step_us(&self, prefill: u64, decoding: usize) -> f64 {
        let mut us = prefill as f64 * self.prefill_us_per_token;
        if decoding > 0 {
            us += self.decode_us_per_step + decoding as f64 * self.decode_us_per_seq;
        }
        us
    }

    /// The least TTFT a request that computes `uncached` prompt tokens can get, in
    /// microseconds: it waits for nothing, its chunks fill whole steps, and `decoding` other
    /// requests decode throughout. A lower bound on what the scheduler gives it (which also
    /// rounds each step up to its timer).
    pub fn ttft_floor_us(&self, uncached: u64, decoding: usize) -> f64 {
        let per_step = self.max_batch_tokens.max(1);
        let uncached = uncached.max(1);
        let full = uncached / per_step;
        let rest = uncached % per_step;
        let mut us = full as f64 * self.step_us(per_step, decoding);
        if rest > 0 {
            us += self.step_us(rest, decoding);
        }
        us
    }
}

enum Event {
    Token(u64),
    Done,
}

struct Job {
    prefill_left: u64,
    output_left: u64,
    emitted: u64,
    chain: Vec<Digest>,
    tx: mpsc::UnboundedSender<Event>,
}

#[derive(Default)]
struct Sched {
    waiting: VecDeque<Job>,
    running: Vec<Job>,
}

/// The simulator's shared state.
pub struct Engine {
    cfg: SimConfig,
    tokenizer: Arc<SimTokenizer>,
    ns: Namespace,
    cache: Mutex<LruCache<Digest, ()>>,
    sched: Mutex<Sched>,
    wake: Notify,
    kv_epoch: u64,
    requests: AtomicU64,
    connections: AtomicU64,
    prompt_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    next_id: AtomicU64,
    /// Requests whose routing digests matched, did not, or could not be read.
    routing_digests: [AtomicU64; 3],
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Cached tokens of a prompt of `prompt_len` tokens whose first `hit_blocks` blocks are
/// resident: at least one token is always computed, as in vLLM.
fn cached_tokens(hit_blocks: usize, block_tokens: usize, prompt_len: usize) -> u64 {
    ((hit_blocks * block_tokens) as u64).min((prompt_len as u64).saturating_sub(1))
}

/// The simulator's default tokenizer: one token per 4 bytes, little-endian, last one
/// zero-padded.
pub fn tokenize(text: &[u8]) -> Vec<u32> {
    text.chunks(4)
        .map(|c| {
            let mut b = [0u8; 4];
            b[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(b)
        })
        .collect()
}

fn text_of(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter(|p| p.get("type").and_then(Value::as_str) == Some("text"))
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    }
}

/// Bytes of text per cached chunk of a model tokenizer's ids (as the proxy's token mode).
const CHUNK_BYTES: usize = 1024;
/// Most token ids a model tokenizer's chunk cache holds (64 MiB of ids).
const MAX_CACHED_IDS: usize = 16 << 20;

/// How the simulator turns a request into token ids.
pub enum SimTokenizer {
    /// One token per 4 bytes of ChatML-rendered text (see the module docs).
    Bytes,
    /// A model's chat template and vocabulary, with a cache of the ids of text chunks seen
    /// before (prompts sharing a prefix are not tokenized again).
    Model {
        /// The model's tokenizer (boxed: it is large, and `Bytes` holds nothing).
        tokenizer: Box<ModelTokenizer>,
        /// Ids of chunks already tokenized.
        cache: PrefixCache,
    },
}

impl SimTokenizer {
    /// The tokenizer `--tokenizer-gguf` names: the model's in `gguf`, or 4 bytes a token.
    pub fn new(gguf: Option<&Path>) -> anyhow::Result<Self> {
        let Some(path) = gguf else {
            return Ok(SimTokenizer::Bytes);
        };
        let g = kvmesh_tokenize::gguf::Gguf::open(path)
            .map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
        let tokenizer = ModelTokenizer::from_gguf(&g)
            .map_err(|e| anyhow::anyhow!("the tokenizer of {}: {e}", path.display()))?;
        Ok(SimTokenizer::Model {
            tokenizer: Box::new(tokenizer),
            cache: PrefixCache::new(CHUNK_BYTES, MAX_CACHED_IDS),
        })
    }

    /// Token ids of a text.
    fn text(&self, text: &str) -> Result<Vec<u32>, String> {
        match self {
            SimTokenizer::Bytes => Ok(tokenize(text.as_bytes())),
            SimTokenizer::Model { tokenizer, cache } => {
                match tokenizer.encode_prefix(text, usize::MAX, cache, b"") {
                    Ok((ids, covered)) if covered == text.len() => Ok(ids),
                    // A text with no place to cut it into chunks, or a tokenizer that cannot
                    // cut: tokenized whole, as an engine would.
                    _ => tokenizer.encode(text).map_err(|e| e.to_string()),
                }
            }
        }
    }

    /// Renders a request body to the token ids the simulator would process.
    pub fn prompt_tokens(&self, body: &Value, chat: bool) -> Result<Vec<u32>, String> {
        if chat {
            return match self {
                SimTokenizer::Bytes => self.text(&chat_ml(body)?),
                SimTokenizer::Model { tokenizer, .. } => {
                    let turns = kvmesh_tokenize::chat::turns(body.get("messages"))
                        .map_err(|e| e.to_string())?;
                    let text = tokenizer.render_chat(&turns).map_err(|e| e.to_string())?;
                    self.text(&text)
                }
            };
        }
        match body.get("prompt").or_else(|| body.get("input")) {
            Some(Value::String(s)) => self.text(s),
            Some(Value::Array(items)) => {
                let mut out = Vec::new();
                for it in items {
                    match it {
                        Value::String(s) => out.extend(self.text(s)?),
                        Value::Number(n) => out.push(n.as_u64().unwrap_or(0) as u32),
                        Value::Array(inner) => {
                            out.extend(inner.iter().map(|t| t.as_u64().unwrap_or(0) as u32))
                        }
                        _ => return Err("unsupported prompt element".into()),
                    }
                }
                Ok(out)
            }
            _ => Err("`prompt` must be a string or an array".into()),
        }
    }
}

/// A chat body's messages rendered ChatML-style (the default tokenizer's template).
fn chat_ml(body: &Value) -> Result<String, String> {
    let msgs = body
        .get("messages")
        .and_then(Value::as_array)
        .ok_or("`messages` must be an array")?;
    let mut s = String::new();
    for m in msgs {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or("each message needs a string `role`")?;
        s.push_str("<|im_start|>");
        s.push_str(role);
        s.push('\n');
        s.push_str(&m.get("content").map(text_of).unwrap_or_default());
        s.push_str("<|im_end|>\n");
    }
    s.push_str("<|im_start|>assistant\n");
    Ok(s)
}

impl Engine {
    /// A fresh engine with an empty cache; fails when `--tokenizer-gguf` cannot be read.
    pub fn new(cfg: SimConfig) -> anyhow::Result<Arc<Self>> {
        let tokenizer = Arc::new(SimTokenizer::new(cfg.tokenizer_gguf.as_deref())?);
        let kv_epoch = if cfg.kv_epoch == 0 {
            now_secs()
        } else {
            cfg.kv_epoch
        };
        let cap = std::num::NonZeroUsize::new(cfg.cache_blocks.max(1))
            .unwrap_or(std::num::NonZeroUsize::MIN);
        Ok(Arc::new(Engine {
            tokenizer,
            ns: Namespace::new(&cfg.model, b""),
            cache: Mutex::new(LruCache::new(cap)),
            sched: Mutex::new(Sched::default()),
            wake: Notify::new(),
            kv_epoch,
            requests: AtomicU64::new(0),
            connections: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            cached_tokens: AtomicU64::new(0),
            next_id: AtomicU64::new(1),
            routing_digests: Default::default(),
            cfg,
        }))
    }

    /// Token ids of a request body; a model's tokenizer runs on the blocking pool, as it takes
    /// milliseconds on a long prompt and would otherwise hold up the async threads that run
    /// the scheduler's timer (it still shares the machine's CPUs with it, unbounded: one
    /// blocking thread per request being tokenized).
    async fn prompt_tokens(&self, body: Value, chat: bool) -> (Value, Result<Vec<u32>, String>) {
        if matches!(*self.tokenizer, SimTokenizer::Bytes) {
            let tokens = self.tokenizer.prompt_tokens(&body, chat);
            return (body, tokens);
        }
        let tokenizer = self.tokenizer.clone();
        tokio::task::spawn_blocking(move || {
            let tokens = tokenizer.prompt_tokens(&body, chat);
            (body, tokens)
        })
        .await
        .unwrap_or_else(|e| (Value::Null, Err(format!("tokenizing failed: {e}"))))
    }

    fn instant(&self) -> bool {
        self.cfg.instant
            || self.cfg.prefill_us_per_token <= 0.0
                && self.cfg.decode_us_per_step <= 0.0
                && self.cfg.decode_us_per_seq <= 0.0
    }

    /// Looks up the leading cached blocks of `tokens`; returns (cached tokens, chain).
    #[cfg(test)]
    fn lookup(&self, tokens: &[u32]) -> (u64, Vec<Digest>) {
        self.lookup_salted(tokens, "")
    }

    /// Looks up the leading cached blocks of `tokens` under a `cache_salt` (as vLLM: blocks of
    /// different salts never match); returns (cached tokens, chain).
    fn lookup_salted(&self, tokens: &[u32], salt: &str) -> (u64, Vec<Digest>) {
        let chain = if salt.is_empty() {
            token_chain(&self.ns, tokens, self.cfg.block_tokens.max(1))
        } else {
            let ns = Namespace::new(&self.cfg.model, salt.as_bytes());
            token_chain(&ns, tokens, self.cfg.block_tokens.max(1))
        };
        let mut cache = self.cache.lock();
        let hit = chain.iter().take_while(|d| cache.get(*d).is_some()).count();
        (
            cached_tokens(hit, self.cfg.block_tokens, tokens.len()),
            chain,
        )
    }

    fn insert(&self, chain: &[Digest]) {
        let mut cache = self.cache.lock();
        for d in chain.iter().rev() {
            cache.put(*d, ());
        }
    }

    /// The scheduler loop (see the module docs for the latency model).
    async fn run_scheduler(self: Arc<Self>) {
        loop {
            let notified = self.wake.notified();
            let planned = {
                let mut s = self.sched.lock();
                if s.waiting.is_empty() && s.running.is_empty() {
                    None
                } else {
                    let mut budget = self.cfg.max_batch_tokens.max(1);
                    let mut prefill = 0;
                    let slots = self.cfg.max_running.saturating_sub(s.running.len());
                    for job in s.waiting.iter_mut().take(slots) {
                        if budget == 0 {
                            break;
                        }
                        let take = job.prefill_left.min(budget);
                        job.prefill_left -= take;
                        budget -= take;
                        prefill += take;
                    }
                    Some((prefill, s.running.len()))
                }
            };
            let Some((prefill, decoding)) = planned else {
                notified.await;
                continue;
            };
            let us = self.cfg.costs().step_us(prefill, decoding);
            if us >= 1.0 {
                tokio::time::sleep(Duration::from_micros(us as u64)).await;
            } else {
                tokio::task::yield_now().await;
            }
            let mut done_prefill = Vec::new();
            {
                let mut s = self.sched.lock();
                s.running.retain_mut(|job| {
                    job.emitted += 1;
                    job.output_left -= 1;
                    if job.tx.send(Event::Token(job.emitted)).is_err() {
                        return false;
                    }
                    if job.output_left == 0 {
                        let _ = job.tx.send(Event::Done);
                        return false;
                    }
                    true
                });
                while s.waiting.front().is_some_and(|j| j.prefill_left == 0) {
                    let Some(mut job) = s.waiting.pop_front() else {
                        break;
                    };
                    done_prefill.push(std::mem::take(&mut job.chain));
                    job.emitted = 1;
                    job.output_left -= 1;
                    if job.tx.send(Event::Token(1)).is_err() {
                        continue;
                    }
                    if job.output_left == 0 {
                        let _ = job.tx.send(Event::Done);
                    } else {
                        s.running.push(job);
                    }
                }
            }
            for chain in done_prefill {
                self.insert(&chain);
            }
        }
    }

    fn submit(
        &self,
        uncached: u64,
        output: u64,
        chain: Vec<Digest>,
    ) -> mpsc::UnboundedReceiver<Event> {
        let (tx, rx) = mpsc::unbounded_channel();
        if self.instant() {
            self.insert(&chain);
            for i in 1..=output {
                let _ = tx.send(Event::Token(i));
            }
            let _ = tx.send(Event::Done);
            return rx;
        }
        self.sched.lock().waiting.push_back(Job {
            prefill_left: uncached.max(1),
            output_left: output.max(1),
            emitted: 0,
            chain,
            tx,
        });
        self.wake.notify_one();
        rx
    }

    fn metrics(&self) -> String {
        let (running, waiting) = {
            let s = self.sched.lock();
            (s.running.len(), s.waiting.len())
        };
        let usage = {
            let c = self.cache.lock();
            c.len() as f64 / c.cap().get() as f64
        };
        let m = &self.cfg.model;
        format!(
            "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{model_name=\"{m}\"}} {running}\n\
             # TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{model_name=\"{m}\"}} {waiting}\n\
             # TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{model_name=\"{m}\"}} {usage}\n\
             # TYPE vllm:prompt_tokens_total counter\nvllm:prompt_tokens_total{{model_name=\"{m}\"}} {}\n\
             # TYPE vllm:prefix_cache_hits_total counter\nvllm:prefix_cache_hits_total{{model_name=\"{m}\"}} {}\n\
             # TYPE kvmesh_sim_requests_total counter\nkvmesh_sim_requests_total{{engine=\"{}\"}} {}\n\
             # TYPE kvmesh_sim_connections_total counter\nkvmesh_sim_connections_total {}\n\
             # TYPE kvmesh_sim_kv_epoch gauge\nkvmesh_sim_kv_epoch {}\n\
             # TYPE kvmesh_sim_routing_digests_total counter\n{}",
            self.prompt_tokens.load(Ordering::Relaxed),
            self.cached_tokens.load(Ordering::Relaxed),
            self.cfg.name,
            self.requests.load(Ordering::Relaxed),
            self.connections.load(Ordering::Relaxed),
            self.kv_epoch,
            DigestCheck::ALL
                .iter()
                .zip(&self.routing_digests)
                .map(|(c, n)| format!(
                    "kvmesh_sim_routing_digests_total{{result=\"{}\"}} {}\n",
                    c.as_str(),
                    n.load(Ordering::Relaxed)
                ))
                .collect::<String>(),
        )
    }
}

fn with_headers(
    mut resp: Response<Body>,
    engine: &Engine,
    body_hash: &str,
    body_len: usize,
) -> Response<Body> {
    let h = resp.headers_mut();
    if let Ok(v) = engine.cfg.name.parse() {
        h.insert("x-sim-engine", v);
    }
    if let Ok(v) = body_hash.parse() {
        h.insert("x-sim-body-blake3", v);
    }
    h.insert("x-sim-body-len", body_len.into());
    resp
}

async fn handle(
    engine: Arc<Engine>,
    req: Request<Incoming>,
) -> Result<Response<Body>, std::convert::Infallible> {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    let resp = match (method, path.as_str()) {
        (Method::GET, "/health") => Response::new(full("ok")),
        (Method::GET, "/v1/models") => json_response(
            200,
            &json!({"object": "list", "data": [{"id": engine.cfg.model, "object": "model", "created": 0, "owned_by": "kvmesh-sim-engine"}]}),
        ),
        (Method::GET, "/server_info") => json_response(
            200,
            &json!({"engine": "kvmesh-sim-engine", "name": engine.cfg.name, "served_model_name": engine.cfg.model, "kv_epoch": engine.kv_epoch}),
        ),
        (Method::GET, "/metrics") => Response::new(full(engine.metrics())),
        (Method::POST, p) => {
            // How the body was framed on the wire, for tests of what proxies forward.
            let framing = if req.headers().contains_key(hyper::header::CONTENT_LENGTH) {
                "length"
            } else {
                "chunked"
            };
            // The W3C trace context the engine was sent, for the tracing tests.
            let traceparent = req.headers().get("traceparent").cloned();
            let tracestate = req.headers().get("tracestate").cloned();
            let digests = req.headers().get(DIGESTS_HEADER).cloned();
            // Whether credentials reached the engine (never their value).
            let saw_auth = if req.headers().contains_key(hyper::header::AUTHORIZATION) {
                "yes"
            } else {
                "no"
            };
            let body =
                match http_body_util::Limited::new(req.into_body(), engine.cfg.max_body_bytes)
                    .collect()
                    .await
                {
                    Ok(b) => b.to_bytes(),
                    Err(e) => return Ok(error(413, &format!("body rejected: {e}"))),
                };
            let hash = blake3::hash(&body).to_hex().to_string();
            let len = body.len();
            let resp = post(&engine, p, body, digests.as_ref().map(|v| v.as_bytes())).await;
            let mut resp = with_headers(resp, &engine, &hash, len);
            resp.headers_mut().insert(
                "x-sim-body-framing",
                hyper::header::HeaderValue::from_static(framing),
            );
            resp.headers_mut().insert(
                "x-sim-saw-authorization",
                hyper::header::HeaderValue::from_static(saw_auth),
            );
            if let Some(v) = traceparent {
                resp.headers_mut().insert("x-sim-traceparent", v);
            }
            if let Some(v) = tracestate {
                resp.headers_mut().insert("x-sim-tracestate", v);
            }
            resp
        }
        _ => error(404, &format!("no route for {path}")),
    };
    Ok(resp)
}

async fn post(
    engine: &Arc<Engine>,
    path: &str,
    body: Bytes,
    digests: Option<&[u8]>,
) -> Response<Body> {
    let v: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return error(400, &format!("invalid JSON body: {e}")),
    };
    let chat = path.starts_with("/v1/chat/completions");
    match path {
        "/v1/chat/completions" | "/v1/completions" | "/v1/embeddings" => {}
        "/v1/chat/completions/render" | "/v1/completions/render" => {
            return match engine.prompt_tokens(v, chat).await.1 {
                Ok(t) => json_response(200, &json!({"token_ids": t})),
                Err(e) => error(400, &e),
            }
        }
        "/tokenize" => {
            let chat = v.get("messages").is_some();
            return match engine.prompt_tokens(v, chat).await.1 {
                Ok(t) => json_response(
                    200,
                    &json!({"count": t.len(), "tokens": t, "max_model_len": 1 << 20}),
                ),
                Err(e) => error(400, &e),
            };
        }
        _ => return error(404, &format!("no route for {path}")),
    }
    let (v, tokens) = engine.prompt_tokens(v, chat).await;
    let tokens = match tokens {
        Ok(t) if !t.is_empty() => t,
        Ok(_) => return error(400, "empty prompt"),
        Err(e) => return error(400, &e),
    };
    let embeddings = path == "/v1/embeddings";
    let salt = v.get("cache_salt").and_then(Value::as_str).unwrap_or("");
    let (cached, chain) = engine.lookup_salted(&tokens, salt);
    if let Some(check) = digests.and_then(|h| check_digests(parse_digests(h).as_deref(), &chain)) {
        engine.routing_digests[check.index()].fetch_add(1, Ordering::Relaxed);
    }
    let prompt = tokens.len() as u64;
    engine.requests.fetch_add(1, Ordering::Relaxed);
    engine.prompt_tokens.fetch_add(prompt, Ordering::Relaxed);
    engine.cached_tokens.fetch_add(cached, Ordering::Relaxed);
    let max_tokens = if embeddings {
        1
    } else {
        v.get("max_tokens")
            .or_else(|| v.get("max_completion_tokens"))
            .and_then(Value::as_u64)
            .unwrap_or(engine.cfg.default_max_tokens)
            .max(1)
    };
    let stream = v.get("stream").and_then(Value::as_bool).unwrap_or(false) && !embeddings;
    let include_usage = v
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let id = engine.next_id.fetch_add(1, Ordering::Relaxed);
    let created = now_secs();
    let model = engine.cfg.model.clone();
    let mut rx = engine.submit(prompt - cached, max_tokens, chain);
    let usage = move |completion: u64| {
        json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
               "prompt_tokens_details": {"cached_tokens": cached}})
    };
    if embeddings {
        while let Some(ev) = rx.recv().await {
            if matches!(ev, Event::Done) {
                break;
            }
        }
        let h = blake3::hash(&body);
        let emb: Vec<f32> = h.as_bytes()[..8]
            .iter()
            .map(|b| *b as f32 / 255.0)
            .collect();
        return json_response(
            200,
            &json!({"object": "list", "model": model, "data": [{"object": "embedding", "index": 0, "embedding": emb}],
                    "usage": {"prompt_tokens": prompt, "total_tokens": prompt}}),
        );
    }
    let (object, chunk_object) = if chat {
        ("chat.completion", "chat.completion.chunk")
    } else {
        ("text_completion", "text_completion")
    };
    let id = if chat {
        format!("chatcmpl-{id}")
    } else {
        format!("cmpl-{id}")
    };
    if !stream {
        let mut text = String::new();
        let mut n = 0;
        while let Some(ev) = rx.recv().await {
            match ev {
                Event::Token(i) => {
                    text.push_str(&format!("tok{i} "));
                    n = i;
                }
                Event::Done => break,
            }
        }
        let choice = if chat {
            json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"})
        } else {
            json!({"index": 0, "text": text, "finish_reason": "length"})
        };
        return json_response(
            200,
            &json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice], "usage": usage(n)}),
        );
    }
    let (mut tx, body) =
        http_body_util::channel::Channel::<Bytes, std::convert::Infallible>::new(16);
    tokio::spawn(async move {
        let mut n = 0;
        while let Some(ev) = rx.recv().await {
            let (delta, finish) = match ev {
                Event::Token(i) => {
                    n = i;
                    (format!("tok{i} "), Value::Null)
                }
                Event::Done => (String::new(), json!("length")),
            };
            let choice = if chat {
                json!({"index": 0, "delta": {"content": delta}, "finish_reason": finish})
            } else {
                json!({"index": 0, "text": delta, "finish_reason": finish})
            };
            let chunk = json!({"id": id, "object": chunk_object, "created": created, "model": model, "choices": [choice]});
            if tx
                .send(Frame::data(Bytes::from(format!("data: {chunk}\n\n"))))
                .await
                .is_err()
            {
                return;
            }
            if !finish.is_null() {
                break;
            }
        }
        if include_usage {
            let chunk = json!({"id": id, "object": chunk_object, "created": created, "model": model, "choices": [], "usage": usage(n)});
            let _ = tx
                .send(Frame::data(Bytes::from(format!("data: {chunk}\n\n"))))
                .await;
        }
        let _ = tx
            .send(Frame::data(Bytes::from_static(b"data: [DONE]\n\n")))
            .await;
    });
    Response::builder()
        .status(200)
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
        .body(body.boxed())
        .unwrap_or_else(|_| error(500, "response build failed"))
}

/// What the oracle saw: one simulated engine with an infinite cache, `bodies` sent one after
/// another (with the run's tokenizer, and the simulator's block size and at-least-one-token
/// rule). No router can beat its hit ratio, nor its prompts' uncached tokens.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Oracle {
    /// Cached over prompt tokens, all requests together.
    pub hit_ratio: f64,
    /// Each request's prompt tokens the oracle had to compute, in order (requests that could
    /// not be tokenized are left out).
    pub uncached_tokens: Vec<u64>,
}

/// Runs the oracle (see [`Oracle`]) over `bodies`.
pub fn oracle<'a>(
    model: &str,
    block_tokens: usize,
    tokenizer: &SimTokenizer,
    bodies: impl IntoIterator<Item = &'a Value>,
) -> Oracle {
    let ns = Namespace::new(model, b"");
    let mut seen = std::collections::HashSet::new();
    let (mut hit, mut total) = (0u64, 0u64);
    let mut uncached_tokens = Vec::new();
    for body in bodies {
        let chat = body.get("messages").is_some();
        let Ok(tokens) = tokenizer.prompt_tokens(body, chat) else {
            continue;
        };
        let chain = token_chain(&ns, &tokens, block_tokens.max(1));
        let blocks = chain.iter().take_while(|d| seen.contains(*d)).count();
        let cached = cached_tokens(blocks, block_tokens, tokens.len());
        hit += cached;
        total += tokens.len() as u64;
        uncached_tokens.push(tokens.len() as u64 - cached);
        seen.extend(chain);
    }
    Oracle {
        hit_ratio: if total == 0 {
            0.0
        } else {
            hit as f64 / total as f64
        },
        uncached_tokens,
    }
}

/// Binds, prints `kvmesh-sim-engine listening on http://ADDR` on stdout, and serves forever.
pub async fn serve(cfg: SimConfig) -> anyhow::Result<()> {
    let listener = TcpListener::bind(cfg.listen).await?;
    let addr = listener.local_addr()?;
    let engine = Engine::new(cfg)?;
    tokio::spawn(engine.clone().run_scheduler());
    println!("kvmesh-sim-engine listening on http://{addr}");
    use std::io::Write;
    std::io::stdout().flush()?;
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        engine.connections.fetch_add(1, Ordering::Relaxed);
        let engine = engine.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| handle(engine.clone(), req));
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_is_deterministic_and_padded() {
        assert_eq!(
            tokenize(b"abcdef"),
            vec![
                u32::from_le_bytes(*b"abcd"),
                u32::from_le_bytes([b'e', b'f', 0, 0])
            ]
        );
    }

    /// The model that `scripts/setup.sh` installs (the engines' and the proxy's token mode's).
    fn model_tokenizer() -> SimTokenizer {
        let gguf =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
        SimTokenizer::new(Some(&gguf)).expect("the model is installed (scripts/setup.sh)")
    }

    #[test]
    fn a_model_tokenizer_gives_the_whole_rendered_chats_tokens_chunk_by_chunk() {
        let tok = model_tokenizer();
        let SimTokenizer::Model { tokenizer, cache } = &tok else {
            panic!("a model tokenizer");
        };
        // A trace-like prompt: many 1 KiB chunks, then a second turn that shares them.
        let doc = crate::trace::block_text(7) + &crate::trace::block_text(8);
        let first = json!({"messages": [{"role": "user", "content": doc}]});
        let second = json!({"messages": [
            {"role": "system", "content": "Be brief. Ünïcödé ✓"},
            {"role": "user", "content": doc},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "and then?"}]});
        for body in [&first, &second, &first] {
            let turns = kvmesh_tokenize::chat::turns(body.get("messages")).expect("turns");
            let text = tokenizer.render_chat(&turns).expect("renders");
            let whole = tokenizer.encode(&text).expect("encodes");
            assert_eq!(tok.prompt_tokens(body, true), Ok(whole));
        }
        assert!(cache.len() > 4, "prompts are tokenized in cached chunks");
        // Completions: a string, and strings in an array, each tokenized alone.
        let plain = json!({"prompt": ["hello world", "again"]});
        let mut want = tokenizer.encode("hello world").expect("encodes");
        want.extend(tokenizer.encode("again").expect("encodes"));
        assert_eq!(tok.prompt_tokens(&plain, false), Ok(want));
        // Nothing to cut at: tokenized whole, not cut short.
        let solid = "x".repeat(20_000);
        assert_eq!(
            tok.text(&solid),
            Ok(tokenizer.encode(&solid).expect("encodes"))
        );
    }

    #[test]
    fn the_ttft_floor_sums_whole_steps_of_the_step_model() {
        let c = StepCosts {
            prefill_us_per_token: 5.0,
            decode_us_per_step: 8000.0,
            decode_us_per_seq: 100.0,
            max_batch_tokens: 8192,
        };
        // Alone: only prefill, however many steps it spans.
        assert_eq!(c.ttft_floor_us(10_000, 0), 50_000.0);
        // Beside decoding requests every step of its prefill also pays the decode part:
        // 8,192 + 1,808 tokens are two steps.
        assert_eq!(c.ttft_floor_us(10_000, 1), 50_000.0 + 2.0 * 8100.0);
        assert_eq!(c.ttft_floor_us(8192, 3), 8192.0 * 5.0 + 8300.0);
        // At least one token is computed, as the scheduler does.
        assert_eq!(c.ttft_floor_us(0, 1), 5.0 + 8100.0);
        assert_eq!(c.step_us(100, 0), 500.0);
        let zero_budget = StepCosts {
            max_batch_tokens: 0,
            ..c
        };
        assert_eq!(zero_budget.ttft_floor_us(3, 1), 3.0 * (5.0 + 8100.0));
    }

    #[test]
    fn the_oracle_counts_each_requests_uncached_tokens() {
        let tok = SimTokenizer::new(None).expect("the built-in tokenizer");
        let doc = "a".repeat(4 * 64);
        let first = json!({"messages": [{"role": "user", "content": doc}]});
        let longer =
            json!({"messages": [{"role": "user", "content": doc.clone() + &"b".repeat(4 * 40)}]});
        let o = oracle("m", 16, &tok, [&first, &longer, &first]);
        let t1 = tok.prompt_tokens(&first, true).expect("tokenizes");
        let t2 = tok.prompt_tokens(&longer, true).expect("tokenizes");
        let (n1, n2) = (t1.len() as u64, t2.len() as u64);
        let shared = t1.iter().zip(&t2).take_while(|(a, b)| a == b).count() as u64;
        let shared_blocks = shared / 16 * 16;
        assert!(
            shared_blocks >= 48,
            "the two share their leading blocks: {shared}"
        );
        assert_eq!(o.uncached_tokens.len(), 3);
        // All of the first; the second's tokens past the whole blocks it shares with the
        // first; the repeat's tail past its own whole blocks, at least one token (as the
        // engine computes).
        let repeat_cached = (n1 / 16 * 16).min(n1 - 1);
        assert_eq!(
            o.uncached_tokens,
            vec![n1, n2 - shared_blocks, n1 - repeat_cached]
        );
        let cached = shared_blocks + repeat_cached;
        assert!((o.hit_ratio - cached as f64 / (2 * n1 + n2) as f64).abs() < 1e-12);
    }

    #[test]
    fn a_missing_tokenizer_file_is_an_error_naming_it() {
        let err = SimTokenizer::new(Some(Path::new("/nonexistent/m.gguf")))
            .err()
            .expect("fails");
        assert!(err.to_string().contains("/nonexistent/m.gguf"), "{err}");
    }

    #[test]
    fn cache_reports_leading_blocks() {
        let cfg = SimConfig::parse_from(["x", "--block-tokens", "2", "--cache-blocks", "8"]);
        let e = Engine::new(cfg).expect("no tokenizer file to read");
        let t: Vec<u32> = (0..10).collect();
        let (c0, chain) = e.lookup(&t);
        assert_eq!(c0, 0);
        e.insert(&chain);
        let (c1, _) = e.lookup(&t);
        assert_eq!(c1, 9, "fully cached prompts still compute one token");
        assert_eq!(
            e.lookup_salted(&t, "tenant/b").0,
            0,
            "another salt never matches"
        );
        let mut u = t.clone();
        u[5] = 99;
        assert_eq!(e.lookup(&u).0, 4);
    }
}
