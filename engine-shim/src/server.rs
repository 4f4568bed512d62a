//! The OpenAI HTTP surface: `/v1/chat/completions` and `/v1/completions` (JSON or SSE),
//! `/v1/models`, `/health`, `/metrics` (with the vLLM gauge names kvmesh-proxy and kvagent read).

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{Bytes, BytesMut};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Body as _, Frame, Incoming};
use hyper::{Method, Request, Response};
use kvmesh_filters::error::{ApiError, ErrorKind};
use serde_json::{json, Value};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

use kvmesh_filters::chain::{
    check_digests, parse_digests, token_chain, Digest, DigestCheck, Namespace, DIGESTS_HEADER,
};

use crate::cache::BLOCK_TOKENS;
use crate::engine::{Event, Job, SamplingParams, Stats};
use crate::evict::{Eviction, EvictionReport, Policy};
use crate::kvstore::RejectReason;
use crate::segments;
use crate::tokenizer::ModelTokenizer;

/// Most bytes of one `stop` string.
pub const MAX_STOP_BYTES: usize = 1024;

/// Most `stop` strings.
pub const MAX_STOPS: usize = 4;
/// Longest `cache_salt`, bytes (kvmesh's tenant salts, `tenant/<name>/<client salt>`, stay
/// under 330).
pub const MAX_CACHE_SALT_BYTES: usize = 512;

/// Requests parsed, rendered and tokenised at once (each on a blocking thread, off the HTTP
/// runtime); more wait their turn.
pub const TOKENIZE_CONCURRENCY: usize = 2;

/// Response body type.
pub type Body = BoxBody<Bytes, Infallible>;

/// Compares `sent` (the header's digests, `None`: malformed) with the engine's chain of `ids`
/// in `ns`, hashed only as far as `sent` reaches; `None` when nothing was sent.
fn check_routing_digests(
    sent: Option<&[Digest]>,
    ns: &Namespace,
    ids: &[u32],
) -> Option<DigestCheck> {
    let span = sent
        .map_or(0, <[Digest]>::len)
        .saturating_mul(BLOCK_TOKENS)
        .min(ids.len());
    check_digests(sent, &token_chain(ns, &ids[..span], BLOCK_TOKENS))
}

/// What every request handler shares.
pub struct App {
    /// The served model name.
    pub model_name: String,
    /// Tokenizer and chat template.
    pub tokenizer: Arc<ModelTokenizer>,
    /// The engine's queue.
    pub jobs: std::sync::mpsc::SyncSender<Job>,
    /// Live counters.
    pub stats: Arc<Stats>,
    /// Longest prompt plus completion, tokens.
    pub max_model_len: usize,
    /// `max_tokens` when the request gives none.
    pub default_max_tokens: usize,
    /// Temperature, top_p, top_k and min_p when the request gives none.
    pub sampling: crate::engine::SamplingDefaults,
    /// Largest request body, bytes.
    pub max_body_bytes: usize,
    /// Longest wait for a request's whole body; then 408.
    pub body_read_timeout: Duration,
    /// Bytes of request bodies being read or held until tokenised, over all connections (one
    /// permit per byte); a body that does not fit gets 429.
    pub body_budget: Arc<Semaphore>,
    /// Permits to parse and tokenise ([`TOKENIZE_CONCURRENCY`]).
    pub tokenizing: Arc<Semaphore>,
    /// Most requests waiting.
    pub max_queue: u64,
    /// Prefix cache capacity, blocks (for the KV usage gauge).
    pub cache_capacity: usize,
    /// The KV pool of running sequences, tokens (`kv_pool_tokens`).
    pub kv_pool_tokens: usize,
    /// Changes on every start (reported as `kv_epoch`): the cache starts empty.
    pub kv_epoch: u64,
    /// KV eviction for requests that do not choose (`kv_eviction`, `kv_budget_tokens`; no
    /// segments).
    pub eviction: Eviction,
    /// Relevance kept per assistant turn since a segment's message (`segment_decay`).
    pub segment_decay: f64,
}

fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into()).boxed()
}

fn json_response(status: u16, v: &Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(full(serde_json::to_vec(v).unwrap_or_default()))
        .unwrap_or_else(|_| Response::new(full(Bytes::new())))
}

fn error_response(e: &ApiError) -> Response<Body> {
    let mut resp = Response::builder()
        .status(e.status())
        .header("content-type", "application/json");
    if let Some(allow) = e.allow {
        resp = resp.header("allow", allow);
    }
    resp.body(full(e.to_json()))
        .unwrap_or_else(|_| Response::new(full(Bytes::new())))
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::new(ErrorKind::InvalidRequest, msg)
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The served model as an OpenAI model object.
fn model_object(app: &App) -> Value {
    json!({"id": app.model_name, "object": "model", "created": 0, "owned_by": "engine-shim",
           "max_model_len": app.max_model_len})
}

/// Handles one HTTP request.
pub async fn handle(app: Arc<App>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path().to_string();
    // HEAD answers as GET does; hyper leaves the body out.
    let method = match req.method() {
        &Method::HEAD => Method::GET,
        m => m.clone(),
    };
    let resp = match (method, path.as_str()) {
        (Method::GET, "/health") => Response::new(full("ok\n")),
        (Method::GET, "/v1/models") => json_response(
            200,
            &json!({"object": "list", "data": [model_object(&app)]}),
        ),
        (Method::GET, p) if p.strip_prefix("/v1/models/").is_some() => {
            // Clients percent-encode ids (`org%2Fmodel`).
            let raw = p.strip_prefix("/v1/models/").unwrap_or_default();
            let id = percent_encoding::percent_decode_str(raw)
                .decode_utf8()
                .unwrap_or_default();
            if id == app.model_name {
                json_response(200, &model_object(&app))
            } else {
                error_response(
                    &ApiError::new(
                        ErrorKind::ModelNotFound,
                        format!(
                            "the model `{id}` does not exist; this engine serves `{}`",
                            app.model_name
                        ),
                    )
                    .with_param("model"),
                )
            }
        }
        (Method::GET, "/server_info") => json_response(
            200,
            &json!({"engine": "engine-shim", "served_model_name": app.model_name, "kv_epoch": app.kv_epoch}),
        ),
        (Method::GET, "/metrics") => Response::builder()
            .header("content-type", "text/plain; version=0.0.4")
            .body(full(metrics(&app)))
            .unwrap_or_else(|_| Response::new(full(Bytes::new()))),
        (Method::POST, "/v1/chat/completions") => complete(app, req, true).await,
        (Method::POST, "/v1/completions") => complete(app, req, false).await,
        (_, "/v1/chat/completions" | "/v1/completions") => {
            error_response(&ApiError::method_not_allowed(&path, "POST"))
        }
        (_, "/health" | "/v1/models" | "/server_info" | "/metrics") => {
            error_response(&ApiError::method_not_allowed(&path, ApiError::READ_ONLY))
        }
        (_, p) if p.starts_with("/v1/models/") => error_response(&ApiError::method_not_allowed(
            "/v1/models/{id}",
            ApiError::READ_ONLY,
        )),
        (m, _) => error_response(&ApiError::new(
            ErrorKind::NotFound,
            format!("no route for {m} {path}"),
        )),
    };
    Ok(resp)
}

fn metrics(app: &App) -> String {
    let s = &app.stats;
    let m = &app.model_name;
    let usage = s.cache_blocks.load(Ordering::Relaxed) as f64 / app.cache_capacity.max(1) as f64;
    let mut out = format!(
        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{model_name=\"{m}\"}} {}\n\
         # TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{model_name=\"{m}\"}} {}\n\
         # TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{model_name=\"{m}\"}} {usage}\n\
         # TYPE engine_shim_prompt_tokens_total counter\nengine_shim_prompt_tokens_total {}\n\
         # TYPE engine_shim_cached_tokens_total counter\nengine_shim_cached_tokens_total {}\n\
         # TYPE engine_shim_paged_in_tokens_total counter\nengine_shim_paged_in_tokens_total {}\n\
         # TYPE engine_shim_generated_tokens_total counter\nengine_shim_generated_tokens_total {}\n\
         # TYPE engine_shim_requests_failed_total counter\nengine_shim_requests_failed_total {}\n\
         # TYPE engine_shim_kv_pagein_timeouts_total counter\nengine_shim_kv_pagein_timeouts_total {}\n\
         # TYPE engine_shim_kv_pagein_errors_total counter\nengine_shim_kv_pagein_errors_total {}\n\
         # TYPE engine_shim_kv_pagein_skipped_total counter\nengine_shim_kv_pagein_skipped_total {}\n\
         # TYPE engine_shim_kv_writethrough_dropped_blocks_total counter\nengine_shim_kv_writethrough_dropped_blocks_total {}\n\
         # TYPE engine_shim_kv_writethrough_failed_total counter\nengine_shim_kv_writethrough_failed_total {}\n\
         # TYPE engine_shim_kv_writethrough_resyncs_total counter\nengine_shim_kv_writethrough_resyncs_total {}\n\
         # TYPE vllm:num_preemptions_total counter\nvllm:num_preemptions_total{{model_name=\"{m}\"}} {}\n\
         # TYPE vllm:prefix_cache_queries_total counter\nvllm:prefix_cache_queries_total{{model_name=\"{m}\"}} {}\n\
         # TYPE vllm:prefix_cache_hits_total counter\nvllm:prefix_cache_hits_total{{model_name=\"{m}\"}} {}\n\
         # TYPE engine_shim_kv_pool_used_tokens gauge\nengine_shim_kv_pool_used_tokens {}\n\
         # TYPE engine_shim_kv_pool_peak_tokens gauge\nengine_shim_kv_pool_peak_tokens {}\n\
         # TYPE engine_shim_kv_pool_capacity_tokens gauge\nengine_shim_kv_pool_capacity_tokens {}\n\
         # TYPE engine_shim_routing_digests_total counter\n",
        s.running.load(Ordering::Relaxed),
        s.waiting.load(Ordering::Relaxed),
        s.prompt_tokens.load(Ordering::Relaxed),
        s.cached_tokens.load(Ordering::Relaxed),
        s.paged_in_tokens.load(Ordering::Relaxed),
        s.generated_tokens.load(Ordering::Relaxed),
        s.requests_failed.load(Ordering::Relaxed),
        s.pagein_timeouts.load(Ordering::Relaxed),
        s.pagein_errors.load(Ordering::Relaxed),
        s.pagein_skipped.load(Ordering::Relaxed),
        s.writethrough_dropped_blocks.load(Ordering::Relaxed),
        s.writethrough_failed.load(Ordering::Relaxed),
        s.writethrough_resyncs.load(Ordering::Relaxed),
        s.preemptions.load(Ordering::Relaxed),
        s.prompt_tokens.load(Ordering::Relaxed),
        s.cached_tokens.load(Ordering::Relaxed),
        s.kv_pool_used_tokens.load(Ordering::Relaxed),
        s.kv_pool_peak_tokens.load(Ordering::Relaxed),
        app.kv_pool_tokens,
    );
    for c in DigestCheck::ALL {
        let n = s.routing_digests[c.index()].load(Ordering::Relaxed);
        out.push_str(&format!(
            "engine_shim_routing_digests_total{{result=\"{}\"}} {n}\n",
            c.as_str()
        ));
    }
    for (name, counters) in [
        ("engine_shim_kv_evictions_total", &s.kv_evictions),
        ("engine_shim_kv_evicted_tokens_total", &s.kv_evicted_tokens),
        (
            "engine_shim_kv_over_budget_sequences_total",
            &s.kv_over_budget_sequences,
        ),
    ] {
        out.push_str(&format!("# TYPE {name} counter\n"));
        for p in &Policy::ALL[1..] {
            let n = counters[p.index()].load(Ordering::Relaxed);
            out.push_str(&format!("{name}{{policy=\"{}\"}} {n}\n", p.as_str()));
        }
    }
    out.push_str("# TYPE engine_shim_kv_pagein_rejected_total counter\n");
    for r in RejectReason::ALL {
        let n = s
            .pagein_rejected
            .get(r.index())
            .map_or(0, |c| c.load(Ordering::Relaxed));
        out.push_str(&format!(
            "engine_shim_kv_pagein_rejected_total{{reason=\"{}\"}} {n}\n",
            r.as_str()
        ));
    }
    let mut families = Vec::new();
    for h in [&s.steps.batch_size, &s.steps.tokens, &s.steps.seconds] {
        families.extend(prometheus::core::Collector::collect(h));
    }
    if let Err(e) = prometheus::TextEncoder::new().encode_utf8(&families, &mut out) {
        tracing::warn!(error = %e, "encoding the step histograms");
    }
    out
}

/// Rejects, before anything is tokenised, a prompt of `bytes` bytes that cannot fit the context
/// with `max_tokens`: it has at least [`ModelTokenizer::min_tokens`] tokens.
fn check_prompt_bytes(
    app: &App,
    bytes: usize,
    max_tokens: usize,
    param: &str,
) -> Result<(), ApiError> {
    let at_least = app.tokenizer.min_tokens(bytes);
    if at_least.saturating_add(max_tokens) > app.max_model_len {
        return Err(bad(format!(
            "This model's maximum context length is {} tokens. However, the prompt is {bytes} bytes, so at least {at_least} tokens, and you requested {max_tokens} tokens for the completion. Please reduce the prompt or max_tokens.",
            app.max_model_len
        ))
        .with_param(param));
    }
    Ok(())
}

/// A validated request.
struct Parsed {
    prompt: String,
    cache_salt: String,
    stream: bool,
    include_usage: bool,
    params: SamplingParams,
    eviction: EvictionPlan,
}

/// A request's eviction settings before its prompt is tokenised.
struct EvictionPlan {
    request: segments::Request,
    policy: Policy,
    budget_tokens: usize,
    /// For the segment policy on a chat request.
    chat: Option<ChatSegments>,
}

/// A chat request's messages as the segment policy sees them.
struct ChatSegments {
    messages: Vec<Value>,
    units: Vec<segments::Unit>,
    /// Where each content starts in the rendered prompt (`None`: the template does not copy
    /// contents verbatim, so no segment can be placed).
    starts: Option<Vec<usize>>,
}

fn parse(app: &App, body: &[u8], chat: bool) -> Result<Parsed, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| bad(format!("request body is not valid JSON: {e}")))?;
    let obj = v
        .as_object()
        .ok_or_else(|| bad("request body must be a JSON object"))?;
    let model = obj
        .get("model")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("`model` (a string) is required").with_param("model"))?;
    if model != app.model_name {
        return Err(ApiError::new(
            ErrorKind::ModelNotFound,
            format!(
                "the model `{model}` does not exist; this engine serves `{}`",
                app.model_name
            ),
        )
        .with_param("model"));
    }
    let num = |k: &str| obj.get(k).filter(|v| !v.is_null());
    let (max_key, max_value) = match (num("max_tokens"), num("max_completion_tokens")) {
        (Some(v), _) => ("max_tokens", Some(v)),
        (None, Some(v)) => ("max_completion_tokens", Some(v)),
        (None, None) => ("max_tokens", None),
    };
    let max_tokens = match max_value {
        None => app.default_max_tokens,
        Some(v) => v
            .as_u64()
            .filter(|&n| n >= 1)
            .ok_or_else(|| {
                bad(format!("`{max_key}` must be a positive integer")).with_param(max_key)
            })
            // Above usize::MAX on a 32-bit target: far over any context, and reported as such.
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX))?,
    };
    for k in ["n", "best_of"] {
        if let Some(v) = num(k) {
            if v.as_u64() != Some(1) {
                return Err(bad(format!("only `{k}` = 1 is supported")).with_param(k));
            }
        }
    }
    refuse_unsupported(obj)?;
    let request = segments::Request::parse(obj.get("kv_eviction"), chat)?;
    let mut eviction = EvictionPlan {
        policy: request.policy.unwrap_or(app.eviction.policy),
        budget_tokens: request.budget_tokens.unwrap_or(app.eviction.budget_tokens),
        request,
        chat: None,
    };
    if eviction.policy != Policy::None && eviction.budget_tokens == 0 {
        return Err(bad(format!(
            "`kv_eviction.budget_tokens` is required with policy {:?}: this engine has no default budget (kv_budget_tokens)",
            eviction.policy.as_str()
        ))
        .with_param("kv_eviction.budget_tokens"));
    }
    if eviction.policy != Policy::Segment && !eviction.request.annotations.is_empty() {
        return Err(bad(format!(
            "`kv_eviction.segments` is for the segment policy; this request's policy is {:?}",
            eviction.policy.as_str()
        ))
        .with_param("kv_eviction.segments"));
    }
    let prompt_param = if chat { "messages" } else { "prompt" };
    let prompt = if chat {
        let pairs = kvmesh_tokenize::chat::turns(obj.get("messages"))
            .map_err(|e| bad(e.to_string()).with_param(e.param()))?;
        let content_bytes = pairs
            .iter()
            .fold(0usize, |n, (_, c)| n.saturating_add(c.len()));
        // The rendered prompt holds every content: too long already, it is not rendered.
        check_prompt_bytes(app, content_bytes, max_tokens, prompt_param)?;
        let rendered = app
            .tokenizer
            .render_chat(&pairs)
            .map_err(|e| bad(e.to_string()).with_param("messages"))?;
        if eviction.policy == Policy::Segment {
            let messages = obj
                .get("messages")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            let units = segments::units(&messages, &eviction.request.annotations)?;
            let starts =
                segments::content_starts(&pairs, &rendered, |p| app.tokenizer.render_chat(p));
            if starts.is_none() && !eviction.request.annotations.is_empty() {
                return Err(bad(
                    "`kv_eviction.segments` cannot be placed: this model's chat template changes message text, so their tokens cannot be found in the prompt",
                )
                .with_param("kv_eviction.segments"));
            }
            eviction.chat = Some(ChatSegments {
                messages,
                units,
                starts,
            });
        }
        rendered
    } else {
        match obj.get("prompt") {
            Some(Value::String(s)) if !s.is_empty() => s.clone(),
            Some(Value::String(_)) => {
                return Err(bad("`prompt` must not be empty").with_param("prompt"))
            }
            _ => return Err(bad("`prompt` (a string) is required").with_param("prompt")),
        }
    };
    check_prompt_bytes(app, prompt.len(), max_tokens, prompt_param)?;
    let defaults = app.sampling;
    let temperature = match num("temperature") {
        None => defaults.temperature,
        Some(v) => v
            .as_f64()
            .filter(|t| (0.0..=2.0).contains(t))
            .ok_or_else(|| {
                bad("`temperature` must be a number in [0, 2]").with_param("temperature")
            })?,
    };
    let top_p = match num("top_p") {
        None => defaults.top_p,
        Some(v) => v
            .as_f64()
            .filter(|t| *t > 0.0 && *t <= 1.0)
            .ok_or_else(|| bad("`top_p` must be a number in (0, 1]").with_param("top_p"))?,
    };
    // 0 and -1 (vLLM's spelling) turn it off; integral floats (40.0) are integers.
    let top_k = match num("top_k") {
        None => defaults.top_k,
        Some(v) => match v.as_f64().filter(|k| k.fract() == 0.0 && *k >= -1.0) {
            Some(k) if k <= 0.0 => 0,
            Some(k) => usize::try_from(k as u64).unwrap_or(usize::MAX),
            None => {
                return Err(
                    bad("`top_k` must be an integer >= -1 (0 or -1: off)").with_param("top_k")
                )
            }
        },
    };
    let min_p = match num("min_p") {
        None => defaults.min_p,
        Some(v) => v
            .as_f64()
            .filter(|t| (0.0..=1.0).contains(t))
            .ok_or_else(|| bad("`min_p` must be a number in [0, 1]").with_param("min_p"))?,
    };
    let seed = match num("seed") {
        None => None,
        Some(v) => Some(
            v.as_u64()
                .ok_or_else(|| bad("`seed` must be a non-negative integer").with_param("seed"))?,
        ),
    };
    let bad_stop = || {
        bad(format!(
            "`stop` must be a string or up to {MAX_STOPS} strings of at most {MAX_STOP_BYTES} bytes each"
        ))
        .with_param("stop")
    };
    let stop = match num("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if a.len() <= MAX_STOPS => a
            .iter()
            .map(|s| s.as_str().map(String::from))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(bad_stop)?,
        Some(_) => return Err(bad_stop()),
    };
    if stop.iter().any(|s| s.len() > MAX_STOP_BYTES) {
        return Err(bad_stop());
    }
    let stream = match num("stream") {
        None => false,
        Some(v) => v
            .as_bool()
            .ok_or_else(|| bad("`stream` must be a boolean").with_param("stream"))?,
    };
    let cache_salt = match num("cache_salt") {
        None => String::new(),
        Some(Value::String(s)) if s.len() <= MAX_CACHE_SALT_BYTES => s.clone(),
        Some(_) => {
            return Err(bad(format!(
                "`cache_salt` must be a string of at most {MAX_CACHE_SALT_BYTES} bytes"
            ))
            .with_param("cache_salt"))
        }
    };
    let include_usage = obj
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok(Parsed {
        prompt,
        cache_salt,
        stream,
        include_usage,
        params: SamplingParams {
            max_tokens,
            temperature,
            top_p,
            top_k,
            min_p,
            seed,
            stop: stop.into_iter().filter(|s| !s.is_empty()).collect(),
        },
        eviction,
    })
}

/// 400 for the OpenAI parameters this engine cannot honour, naming the first: it never
/// answers as if it had applied them. Their neutral values (no tools, `"text"` format, no
/// penalties, no logprobs) are accepted, as clients send them by default.
fn refuse_unsupported(obj: &serde_json::Map<String, Value>) -> Result<(), ApiError> {
    let empty = |v: &Value| {
        v.is_null()
            || v.as_array().is_some_and(|a| a.is_empty())
            || v.as_object().is_some_and(|m| m.is_empty())
    };
    let off = |v: &Value| v.is_null() || v.as_bool() == Some(false);
    let neutral = |k: &str, v: &Value| match k {
        // OpenAI's, then vLLM's extensions (structured output, stopping, beams).
        "tools" | "functions" | "logit_bias" | "stop_token_ids" | "allowed_token_ids"
        | "bad_words" => empty(v),
        // With no tools (refused above otherwise) "auto" and "none" mean the same.
        "tool_choice" | "function_call" => {
            v.is_null() || matches!(v.as_str(), Some("none" | "auto"))
        }
        "response_format" => v.is_null() || v.get("type").and_then(Value::as_str) == Some("text"),
        // On completions `logprobs: 0` asks for the sampled token's: only off is neutral.
        "logprobs" | "echo" | "ignore_eos" | "use_beam_search" => off(v),
        "top_logprobs" => v.is_null() || v.as_u64() == Some(0),
        "prompt_logprobs" | "guided_json" | "guided_regex" | "guided_choice" | "guided_grammar"
        | "structured_outputs" => v.is_null(),
        "presence_penalty" | "frequency_penalty" => v.is_null() || v.as_f64() == Some(0.0),
        "repetition_penalty" => v.is_null() || v.as_f64() == Some(1.0),
        "min_tokens" => v.is_null() || v.as_u64() == Some(0),
        "suffix" => v.is_null() || v.as_str() == Some(""),
        _ => true,
    };
    for (k, v) in obj {
        if !neutral(k, v) {
            return Err(bad(format!(
                "`{k}` is not supported by engine-shim (it would be ignored); remove it"
            ))
            .with_param(k));
        }
    }
    Ok(())
}

/// Reads a request body within `max_body_bytes`, `body_read_timeout` and the global body budget;
/// the permit returned holds the body's bytes in the budget until it is dropped.
async fn read_body(
    app: &App,
    mut body: Incoming,
) -> Result<(Bytes, Option<OwnedSemaphorePermit>), ApiError> {
    let too_large = || {
        ApiError::new(
            ErrorKind::BodyTooLarge,
            format!("request body exceeds {} bytes", app.max_body_bytes),
        )
    };
    // A declared length over the limit is refused before a byte is read.
    if body.size_hint().lower() > app.max_body_bytes as u64 {
        return Err(too_large());
    }
    let read = async {
        let mut buf = BytesMut::new();
        let mut held: Option<OwnedSemaphorePermit> = None;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| bad(format!("could not read the request body: {e}")))?;
            let Ok(data) = frame.into_data() else {
                continue; // trailers
            };
            if buf.len().saturating_add(data.len()) > app.max_body_bytes {
                return Err(too_large());
            }
            let n = u32::try_from(data.len()).map_err(|_| too_large())?;
            let permit = app
                .body_budget
                .clone()
                .try_acquire_many_owned(n)
                .map_err(|_| {
                    ApiError::new(
                        ErrorKind::Overloaded,
                        "too many request bodies are being read at once (max_body_buffer_bytes); retry shortly",
                    )
                })?;
            match held.as_mut() {
                Some(h) => h.merge(permit),
                None => held = Some(permit),
            }
            buf.extend_from_slice(&data);
        }
        Ok((buf.freeze(), held))
    };
    match tokio::time::timeout(app.body_read_timeout, read).await {
        Ok(r) => r,
        Err(_) => Err(ApiError::new(
            ErrorKind::RequestTimeout,
            format!(
                "the request body did not arrive within {} ms (body_read_timeout_ms)",
                app.body_read_timeout.as_millis()
            ),
        )),
    }
}

/// Parses, renders and tokenises a request body (CPU work: run off the HTTP runtime) and checks
/// the prompt against the context.
fn prepare(app: &App, body: &[u8], chat: bool) -> Result<(Parsed, Vec<u32>, Eviction), ApiError> {
    let parsed = parse(app, body, chat)?;
    let plan = &parsed.eviction;
    let (ids, segments) = match &plan.chat {
        Some(ChatSegments {
            messages,
            units,
            starts: Some(starts),
        }) => {
            let (ids, offsets) = app
                .tokenizer
                .encode_with_offsets(&parsed.prompt)
                .map_err(|e| bad(e.to_string()))?;
            // A prompt over the context is refused below, before any segment is placed.
            let fits = ids.len().saturating_add(parsed.params.max_tokens) <= app.max_model_len;
            let spans = if fits {
                segments::spans(messages, units, starts, &offsets, app.segment_decay)
            } else {
                Vec::new()
            };
            (ids, spans)
        }
        _ => (
            app.tokenizer
                .encode(&parsed.prompt)
                .map_err(|e| bad(e.to_string()))?,
            Vec::new(),
        ),
    };
    let eviction = Eviction {
        policy: plan.policy,
        budget_tokens: plan.budget_tokens,
        segments,
    };
    check_budget(plan, &eviction, ids.len())?;
    if ids.is_empty() {
        return Err(bad("the prompt has no tokens").with_param("prompt"));
    }
    let requested = ids.len().checked_add(parsed.params.max_tokens);
    if requested.is_none_or(|n| n > app.max_model_len) {
        // u128: the sum of two usizes never overflows it.
        let total = ids.len() as u128 + parsed.params.max_tokens as u128;
        return Err(bad(format!(
            "This model's maximum context length is {} tokens. However, you requested {total} tokens ({} in the prompt, {} for the completion). Please reduce the prompt or max_tokens.",
            app.max_model_len,
            ids.len(),
            parsed.params.max_tokens
        ))
        .with_param(if chat { "messages" } else { "prompt" }));
    }
    Ok((parsed, ids, eviction))
}

/// The budget must be at least the policy's minimum, wherever it came from; a budget the
/// request chose must also be one the segment policy can keep to (at least every prompt token
/// outside segments). The engine's default budget is not judged against the reserved part: it
/// is kept where the policy can.
fn check_budget(plan: &EvictionPlan, ev: &Eviction, prompt: usize) -> Result<(), ApiError> {
    if ev.policy == Policy::None {
        return Ok(());
    }
    let param = "kv_eviction.budget_tokens";
    // Wherever the budget came from: the engine checks its default against its own policy only.
    if ev.budget_tokens < ev.policy.min_budget() {
        return Err(bad(format!(
            "`{param}` ({}) is below the {} policy's minimum of {}",
            ev.budget_tokens,
            ev.policy.as_str(),
            ev.policy.min_budget()
        ))
        .with_param(param));
    }
    if plan.request.budget_tokens.is_none() {
        return Ok(());
    }
    if ev.policy == Policy::Segment {
        let droppable: usize = ev.segments.iter().map(|s| s.end - s.start).sum();
        let reserved = prompt.saturating_sub(droppable);
        if ev.budget_tokens < reserved {
            return Err(bad(format!(
                "`{param}` ({}) is smaller than the prompt's reserved part ({reserved} of its {prompt} tokens are outside segments and are never evicted)",
                ev.budget_tokens
            ))
            .with_param(param));
        }
    }
    Ok(())
}

async fn complete(app: Arc<App>, req: Request<Incoming>, chat: bool) -> Response<Body> {
    let digests = req
        .headers()
        .get(DIGESTS_HEADER)
        .map(|v| parse_digests(v.as_bytes()));
    let (body, body_permit) = match read_body(&app, req.into_body()).await {
        Ok(b) => b,
        Err(e) => {
            let mut resp = error_response(&e);
            // The rest of the body is not read: the connection cannot be reused.
            resp.headers_mut().insert(
                hyper::header::CONNECTION,
                hyper::header::HeaderValue::from_static("close"),
            );
            return resp;
        }
    };
    let Ok(permit) = app.tokenizing.clone().acquire_owned().await else {
        return error_response(&ApiError::new(
            ErrorKind::Internal,
            "the engine is shutting down",
        ));
    };
    let job_app = app.clone();
    let prepared = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        let _body_permit = body_permit;
        let prepared = prepare(&job_app, &body, chat)?;
        if let Some(sent) = &digests {
            let (parsed, ids, _) = &prepared;
            let ns = Namespace::new(&job_app.model_name, parsed.cache_salt.as_bytes());
            if let Some(c) = check_routing_digests(sent.as_deref(), &ns, ids) {
                job_app.stats.routing_digests[c.index()].fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(prepared)
    })
    .await;
    let (parsed, ids, eviction) = match prepared {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => return error_response(&e),
        Err(e) => {
            tracing::error!(error = %e, "preparing a request failed");
            return error_response(&ApiError::new(
                ErrorKind::Internal,
                "the engine failed while tokenising this request",
            ));
        }
    };
    if app.stats.waiting.load(Ordering::Relaxed) >= app.max_queue {
        return error_response(&ApiError::new(
            ErrorKind::Overloaded,
            "the engine's queue is full; retry shortly",
        ));
    }
    let (tx, rx) = mpsc::unbounded_channel();
    app.stats.waiting.fetch_add(1, Ordering::Relaxed);
    let job = Job {
        prompt: ids,
        params: parsed.params,
        events: tx,
        stream: parsed.stream,
        cache_salt: parsed.cache_salt,
        eviction,
    };
    if app.jobs.try_send(job).is_err() {
        app.stats.waiting.fetch_sub(1, Ordering::Relaxed);
        return error_response(&ApiError::new(
            ErrorKind::Overloaded,
            "the engine's queue is full; retry shortly",
        ));
    }
    let id = format!("cmpl-{:016x}", fastrand::u64(..));
    let reply = Reply {
        id,
        chat,
        policy: parsed.eviction.policy,
        budget_tokens: parsed.eviction.budget_tokens,
    };
    if parsed.stream {
        stream(app, rx, reply, parsed.include_usage)
    } else {
        whole(app, rx, reply).await
    }
}

/// What an answer's envelope says besides the events.
struct Reply {
    id: String,
    chat: bool,
    policy: Policy,
    budget_tokens: usize,
}

impl Reply {
    /// The `usage` object; with a KV budget, a `kv_eviction` extension says what eviction did.
    fn usage(&self, prompt: usize, cached: usize, completion: usize, ev: &EvictionReport) -> Value {
        let mut u = json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                           "prompt_tokens_details": {"cached_tokens": cached}});
        if self.policy != Policy::None {
            u["kv_eviction"] = json!({"policy": self.policy.as_str(), "budget_tokens": self.budget_tokens,
                                      "evictions": ev.evictions, "evicted_tokens": ev.evicted_tokens,
                                      "over_budget_tokens": ev.over_budget_tokens});
        }
        u
    }
}

async fn whole(
    app: Arc<App>,
    mut rx: mpsc::UnboundedReceiver<Event>,
    reply: Reply,
) -> Response<Body> {
    let chat = reply.chat;
    let (mut text, mut prompt, mut cached) = (String::new(), 0, 0);
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Started {
                prompt_tokens,
                cached_tokens,
            } => {
                prompt = prompt_tokens;
                cached = cached_tokens;
            }
            Event::Text(t) => text.push_str(&t),
            Event::Done {
                finish_reason,
                completion_tokens,
                eviction,
            } => {
                let choice = if chat {
                    json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason})
                } else {
                    json!({"index": 0, "text": text, "finish_reason": finish_reason})
                };
                return json_response(
                    200,
                    &json!({"id": reply.id, "object": if chat { "chat.completion" } else { "text_completion" },
                            "created": now_secs(), "model": app.model_name, "choices": [choice],
                            "usage": reply.usage(prompt, cached, completion_tokens, &eviction)}),
                );
            }
            Event::Failed { message } => {
                return error_response(&ApiError::new(ErrorKind::Internal, message));
            }
        }
    }
    error_response(&ApiError::new(
        ErrorKind::Internal,
        "the engine stopped before answering",
    ))
}

/// A streamed response's body, fed by the task that turns engine events into SSE frames. Its
/// sender learns when hyper drops it (the client closed the connection) through
/// [`mpsc::Sender::closed`], even while no frame is due: the body channel of `http-body-util`
/// tells only at the next send.
struct SseBody {
    frames: mpsc::Receiver<Bytes>,
}

impl hyper::body::Body for SseBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.frames
            .poll_recv(cx)
            .map(|b| b.map(|b| Ok(Frame::data(b))))
    }
}

fn stream(
    app: Arc<App>,
    mut rx: mpsc::UnboundedReceiver<Event>,
    reply: Reply,
    include_usage: bool,
) -> Response<Body> {
    let (chat, id) = (reply.chat, reply.id.clone());
    let (tx, frames) = mpsc::channel::<Bytes>(8);
    let body = SseBody { frames };
    tokio::spawn(async move {
        let created = now_secs();
        let object = if chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        let chunk = |choice: Value| {
            let v = json!({"id": id, "object": object, "created": created, "model": app.model_name, "choices": [choice]});
            Bytes::from(format!("data: {v}\n\n"))
        };
        let (mut prompt, mut cached) = (0, 0);
        if chat {
            let first = chunk(
                json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}),
            );
            if tx.send(first).await.is_err() {
                return;
            }
        }
        loop {
            // A client that leaves before its first token (queued, or prefilling) is noticed
            // here: hyper drops the body when the connection closes, and dropping `rx` tells
            // the engine, which drops the request before its next step.
            let ev = tokio::select! {
                ev = rx.recv() => ev,
                () = tx.closed() => return,
            };
            let Some(ev) = ev else {
                return;
            };
            let frame = match ev {
                Event::Started {
                    prompt_tokens,
                    cached_tokens,
                } => {
                    prompt = prompt_tokens;
                    cached = cached_tokens;
                    continue;
                }
                Event::Text(t) => chunk(if chat {
                    json!({"index": 0, "delta": {"content": t}, "finish_reason": null})
                } else {
                    json!({"index": 0, "text": t, "finish_reason": null})
                }),
                Event::Done {
                    finish_reason,
                    completion_tokens,
                    eviction,
                } => {
                    let last = chunk(if chat {
                        json!({"index": 0, "delta": {}, "finish_reason": finish_reason})
                    } else {
                        json!({"index": 0, "text": "", "finish_reason": finish_reason})
                    });
                    if tx.send(last).await.is_err() {
                        return;
                    }
                    if include_usage {
                        let v = json!({"id": id, "object": object, "created": created, "model": app.model_name,
                                       "choices": [], "usage": reply.usage(prompt, cached, completion_tokens, &eviction)});
                        let _ = tx.send(Bytes::from(format!("data: {v}\n\n"))).await;
                    }
                    let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
                    return;
                }
                Event::Failed { message } => {
                    // The status line is sent already: the error goes in the stream.
                    let e = ApiError::new(ErrorKind::Internal, message);
                    let mut b = b"data: ".to_vec();
                    b.extend_from_slice(&e.to_json());
                    b.extend_from_slice(b"\n\ndata: [DONE]\n\n");
                    let _ = tx.send(Bytes::from(b)).await;
                    return;
                }
            };
            // A closed body means the client left: dropping `rx` stops the generation.
            if tx.send(frame).await.is_err() {
                return;
            }
        }
    });
    Response::builder()
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
        .body(body.boxed())
        .unwrap_or_else(|_| Response::new(full(Bytes::new())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(d: &[Digest]) -> String {
        d.iter().map(Digest::to_hex).collect::<Vec<_>>().join(",")
    }

    #[test]
    fn sent_digests_are_checked_against_the_engines_chain_in_its_namespace() {
        // The header's parsing and comparison are kvmesh_filters::chain's (tested there); this
        // is the engine's side: its own chain of the prompt, hashed as far as the sent reach.
        let ns = Namespace::new("m", b"");
        let ids: Vec<u32> = (0..100).collect();
        let own = token_chain(&ns, &ids, BLOCK_TOKENS);
        assert_eq!(own.len(), 6);
        let check =
            |v: &str| check_routing_digests(parse_digests(v.as_bytes()).as_deref(), &ns, &ids);
        assert_eq!(check(&hex(&own[..2])), Some(DigestCheck::Match));
        assert_eq!(check(&hex(&own)), Some(DigestCheck::Match));
        assert_eq!(check(""), None);
        // Another namespace (a salt), a block past the prompt's end.
        let salted = token_chain(&Namespace::new("m", b"t"), &ids, BLOCK_TOKENS);
        assert_eq!(check(&hex(&salted[..1])), Some(DigestCheck::Mismatch));
        let longer = [&own[..], &own[..1]].concat();
        assert_eq!(check(&hex(&longer)), Some(DigestCheck::Mismatch));
        assert_eq!(check("zz"), Some(DigestCheck::Malformed));
    }
}
