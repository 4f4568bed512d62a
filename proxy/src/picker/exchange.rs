//! One ext_proc stream: one HTTP request through Envoy, from its headers to the end of its
//! response, as a state machine over the messages Envoy sends (`FULL_DUPLEX_STREAMED` bodies).
//!
//! Request side: the headers are held; body chunks are buffered (bounded by `max_body_bytes`
//! and the body budget) until the end of the body; then the request is parsed and ranked
//! exactly as the gateway does, and the replies go out in the order Envoy requires: the
//! headers reply (destination, `clear_route_cache`, metadata), then the body in chunks of at
//! most 64 KiB. A request that is not an inference call (`/v1/models`, ...) is routed by load
//! at once and its body streamed through. Response side: each chunk goes straight back; on the
//! way `usage` is read, and at the end it settles the residency prediction.

use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request as Msg, HttpBody, HttpHeaders, ProcessingRequest,
    ProcessingResponse,
};
use kvmesh_filters::request::{self, Endpoint};
use kvmesh_filters::route::Candidate;
use kvmesh_filters::usage::{self, SseUsageScanner};
use kvmesh_filters::{ApiError, ErrorKind, Source};

use super::envoy::{self, Direction};
use crate::body::{body_too_large, Admitted, BodyPermit};
use crate::feedback::Prediction;
use crate::fleet::{Dispatch, Engine};
use crate::plan::RequestFacts;
use crate::service::{Gateway, MAX_SSE_LINE, MAX_USAGE_BODY};

/// What the stream does after a message.
#[derive(Debug)]
pub(crate) enum Step {
    /// Send these replies (possibly none) and read on.
    Continue(Vec<ProcessingResponse>),
    /// Send these replies and end the stream (an immediate response was sent).
    Close(Vec<ProcessingResponse>),
}

/// Where the request is.
enum Phase {
    /// Waiting for the request headers.
    Start,
    /// Collecting an inference request's body.
    Buffering {
        endpoint: Endpoint,
        body: Vec<u8>,
        permit: BodyPermit,
    },
    /// Routed before its body (not an inference call): body chunks pass straight through.
    Passthrough,
    /// Routed; the request body (if any) is with Envoy; waiting for or streaming the response.
    Routed,
    /// The response is complete.
    Done,
}

/// The chosen engine and what is needed to settle its prediction.
struct Routed {
    engine: Arc<Engine>,
    /// Counts the request as the engine's load until the response ends (or the stream drops).
    dispatch: Dispatch,
    facts: Option<RequestFacts>,
    overlap_blocks: usize,
    settled: bool,
}

/// Where the response's `usage` is looked for.
enum UsageScan {
    Sse(SseUsageScanner),
    Json(Vec<u8>),
}

/// The state of one stream.
pub(crate) struct Exchange {
    gw: Arc<Gateway>,
    fallbacks: usize,
    started: Instant,
    route: &'static str,
    phase: Phase,
    /// The `max_inflight` slot, held until the stream ends.
    admitted: Option<Admitted>,
    /// Envoy's subset hint, if it sent one.
    subset: Option<Vec<String>>,
    /// The session header's value.
    session: Option<String>,
    routed: Option<Routed>,
    scan: Option<UsageScan>,
    first_byte: bool,
    /// The status the client got (an immediate response's, or the engine's).
    status: u16,
}

impl Exchange {
    pub(crate) fn new(gw: Arc<Gateway>, fallbacks: usize) -> Self {
        Exchange {
            gw,
            fallbacks,
            started: Instant::now(),
            route: "other",
            phase: Phase::Start,
            admitted: None,
            subset: None,
            session: None,
            routed: None,
            scan: None,
            first_byte: false,
            status: 0,
        }
    }

    /// Whether the request body is still being collected (the body deadline applies).
    pub(crate) fn buffering(&self) -> bool {
        matches!(self.phase, Phase::Buffering { .. })
    }

    /// Whether the response is complete (or a local answer was sent).
    pub(crate) fn done(&self) -> bool {
        matches!(self.phase, Phase::Done)
    }

    /// Handles one message from Envoy. An error is a protocol violation: the stream ends with
    /// that gRPC status and Envoy applies its failure mode.
    pub(crate) fn on_message(&mut self, req: ProcessingRequest) -> Result<Step, tonic::Status> {
        if req.observability_mode {
            return Err(tonic::Status::failed_precondition(
                "observability_mode is not supported: the picker must answer to route",
            ));
        }
        if let Some(p) = req.protocol_config.as_ref() {
            let full = BodySendMode::FullDuplexStreamed as i32;
            if p.request_body_mode != full {
                return Err(tonic::Status::failed_precondition(
                    "the picker needs request_body_mode FULL_DUPLEX_STREAMED (and \
                     request_trailer_mode SEND): it routes on the body",
                ));
            }
            if p.response_body_mode != full && p.response_body_mode != BodySendMode::None as i32 {
                return Err(tonic::Status::failed_precondition(
                    "the picker supports response_body_mode FULL_DUPLEX_STREAMED or NONE",
                ));
            }
        }
        match req.request {
            Some(Msg::RequestHeaders(ref h)) => self.on_request_headers(&req, h),
            Some(Msg::RequestBody(b)) => self.on_request_body(b),
            Some(Msg::RequestTrailers(_)) => self.on_request_trailers(),
            Some(Msg::ResponseHeaders(h)) => Ok(self.on_response_headers(&h)),
            Some(Msg::ResponseBody(b)) => Ok(self.on_response_body(b)),
            Some(Msg::ResponseTrailers(_)) => {
                self.response_done();
                Ok(Step::Continue(vec![envoy::trailers(Direction::Response)]))
            }
            None => Err(tonic::Status::invalid_argument(
                "a ProcessingRequest without a request",
            )),
        }
    }

    /// The body did not arrive within `body_read_timeout_secs`: the 408.
    pub(crate) fn body_timed_out(&mut self) -> Step {
        let e = self.gw.body_timed_out();
        self.refuse(e)
    }

    /// A local answer instead of routing; the stream ends after it.
    fn refuse(&mut self, e: ApiError) -> Step {
        tracing::debug!(status = e.status(), error = %e.message, "picker refused a request");
        self.status = e.status();
        self.phase = Phase::Done;
        Step::Close(vec![envoy::immediate(&e)])
    }

    fn on_request_headers(
        &mut self,
        req: &ProcessingRequest,
        h: &HttpHeaders,
    ) -> Result<Step, tonic::Status> {
        if !matches!(self.phase, Phase::Start) {
            return Err(tonic::Status::failed_precondition(
                "request headers arrived twice",
            ));
        }
        let map = h.headers.as_ref();
        let path = envoy::header(map, ":path").unwrap_or("/");
        let path = path.split('?').next().unwrap_or(path);
        let method = envoy::header(map, ":method").unwrap_or("");
        let cfg = &self.gw.cfg;
        self.subset = envoy::subset_hint(req);
        self.session =
            envoy::header(map, &cfg.routing.session_header.to_ascii_lowercase()).map(String::from);
        match self.gw.admit() {
            Ok(a) => self.admitted = Some(a),
            Err(e) => return Ok(self.refuse(e)),
        }
        let Some(endpoint) = Endpoint::from_path(path) else {
            // Not an inference call: any engine can answer it; the least loaded one does.
            return Ok(match self.route_by_load() {
                Ok(reply) => {
                    self.phase = if h.end_of_stream {
                        Phase::Routed
                    } else {
                        Phase::Passthrough
                    };
                    Step::Continue(vec![reply])
                }
                Err(e) => self.refuse(e),
            });
        };
        self.route = endpoint.label();
        if method != "POST" {
            let e = ApiError::new(
                ErrorKind::MethodNotAllowed,
                format!("{path} accepts POST only"),
            );
            return Ok(self.refuse(e));
        }
        let limit = cfg.max_body_bytes;
        let declared = envoy::header(map, "content-length").and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit as u64) {
            return Ok(self.refuse(body_too_large(limit)));
        }
        if h.end_of_stream {
            // No body at all: parsing says what is missing (400).
            return Ok(self.decide(endpoint, Vec::new(), None));
        }
        self.phase = Phase::Buffering {
            endpoint,
            body: Vec::new(),
            permit: BodyPermit::new(&self.gw.limits),
        };
        Ok(Step::Continue(Vec::new()))
    }

    fn on_request_body(&mut self, b: HttpBody) -> Result<Step, tonic::Status> {
        match &mut self.phase {
            Phase::Buffering { body, permit, .. } => {
                let limit = self.gw.cfg.max_body_bytes;
                if body.len().saturating_add(b.body.len()) > limit {
                    return Ok(self.refuse(body_too_large(limit)));
                }
                if !permit.grow(b.body.len()) {
                    let e = self.gw.over_body_budget();
                    return Ok(self.refuse(e));
                }
                body.extend_from_slice(&b.body);
                if !b.end_of_stream {
                    return Ok(Step::Continue(Vec::new()));
                }
            }
            Phase::Passthrough => {
                if b.end_of_stream {
                    self.phase = Phase::Routed;
                }
                return Ok(Step::Continue(envoy::body_chunks(
                    Direction::Request,
                    &b.body,
                    b.end_of_stream,
                )));
            }
            _ => {
                return Err(tonic::Status::failed_precondition(
                    "a request body chunk arrived outside the request body",
                ))
            }
        }
        // The body is complete.
        match std::mem::replace(&mut self.phase, Phase::Routed) {
            Phase::Buffering { endpoint, body, .. } => Ok(self.decide(endpoint, body, Some(true))),
            _ => Err(tonic::Status::internal("picker state lost its body")),
        }
    }

    fn on_request_trailers(&mut self) -> Result<Step, tonic::Status> {
        let trailers = envoy::trailers(Direction::Request);
        match std::mem::replace(&mut self.phase, Phase::Routed) {
            // Trailers end the body: decide now; the body goes back without end of stream.
            Phase::Buffering { endpoint, body, .. } => {
                Ok(match self.decide(endpoint, body, Some(false)) {
                    Step::Continue(mut replies) => {
                        replies.push(trailers);
                        Step::Continue(replies)
                    }
                    close => close,
                })
            }
            Phase::Passthrough | Phase::Routed => Ok(Step::Continue(vec![trailers])),
            _ => Err(tonic::Status::failed_precondition(
                "request trailers arrived before the request headers or after the response",
            )),
        }
    }

    /// Ranks the engines for the buffered request and routes it; `body_end` is `None` when
    /// the request had no body phase, else whether the body chunks end the stream.
    fn decide(&mut self, endpoint: Endpoint, body: Vec<u8>, body_end: Option<bool>) -> Step {
        let gw = self.gw.clone();
        let keep = gw
            .cfg
            .routing
            .max_prefix_blocks
            .saturating_mul(gw.cfg.routing.block_bytes);
        let parsed = match request::parse_limited(endpoint, &body, keep) {
            Ok(p) => p,
            Err(e) => return self.refuse(e),
        };
        let facts = gw.facts(parsed, self.session.as_deref(), false);
        let ranking = match gw.rank(&facts) {
            Ok(r) => r,
            Err(e) => return self.refuse(e),
        };
        let ordered: Vec<Candidate> = ranking.ordered().copied().collect();
        let Some((first, engines)) = self.allowed(&ordered) else {
            return self.refuse(ApiError::new(
                ErrorKind::NoEngine,
                "no healthy engine serving the model is in the subset Envoy offered",
            ));
        };
        let block = gw.cfg.routing.block_bytes;
        let uncached = facts
            .total_bytes
            .saturating_sub(first.overlap_blocks.saturating_mul(block))
            as u64;
        let engine = engines[0].clone();
        let settled = engine.pending_prefill() == 0;
        let dispatch = gw.fleet.dispatch(&engine, uncached);
        gw.index
            .record(engine.id, &facts.chain, Source::Optimistic, Instant::now());
        let endpoints: Vec<String> = engines.iter().map(|e| e.addr.to_string()).collect();
        self.routed = Some(Routed {
            engine,
            dispatch,
            facts: Some(facts),
            overlap_blocks: first.overlap_blocks,
            settled,
        });
        self.phase = Phase::Routed;
        let mut replies = vec![envoy::routed_headers(
            &endpoints,
            body_end.map(|_| body.len()),
        )];
        if let Some(end) = body_end {
            replies.extend(envoy::body_chunks(Direction::Request, &body, end));
        }
        Step::Continue(replies)
    }

    /// The ranked candidates Envoy allows (its subset hint, if any), as engines: the first
    /// candidate, and the choice followed by up to `fallbacks` more.
    fn allowed(&self, ordered: &[Candidate]) -> Option<(Candidate, Vec<Arc<Engine>>)> {
        let mut first = None;
        let mut engines = Vec::new();
        for c in ordered {
            let Some(e) = self.gw.fleet.get(c.node) else {
                continue;
            };
            if !self.in_subset(&e) {
                continue;
            }
            first.get_or_insert(*c);
            engines.push(e);
            if engines.len() > self.fallbacks {
                break;
            }
        }
        first.map(|f| (f, engines))
    }

    /// Whether Envoy's subset hint (if it sent one) lists `e`.
    fn in_subset(&self, e: &Engine) -> bool {
        self.subset
            .as_ref()
            .is_none_or(|s| s.contains(&e.addr.to_string()))
    }

    /// Routes a request that is not an inference call to the least-loaded healthy engine
    /// (within the subset hint).
    fn route_by_load(&mut self) -> Result<ProcessingResponse, ApiError> {
        let engines = self.gw.fleet.engines();
        let mut healthy: Vec<&Arc<Engine>> = engines
            .iter()
            .filter(|e| e.healthy())
            .filter(|e| self.in_subset(e))
            .collect();
        healthy.sort_by_key(|e| e.inflight());
        let Some(engine) = healthy.first().map(|e| (*e).clone()) else {
            return Err(ApiError::new(
                ErrorKind::NoEngine,
                "no healthy engine (in the subset Envoy offered)",
            ));
        };
        let endpoints: Vec<String> = healthy
            .iter()
            .take(self.fallbacks + 1)
            .map(|e| e.addr.to_string())
            .collect();
        self.routed = Some(Routed {
            dispatch: self.gw.fleet.dispatch(&engine, 0),
            engine,
            facts: None,
            overlap_blocks: 0,
            settled: true,
        });
        Ok(envoy::routed_headers(&endpoints, None))
    }

    fn on_response_headers(&mut self, h: &HttpHeaders) -> Step {
        let map = h.headers.as_ref();
        self.status = envoy::header(map, ":status")
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        if (200..300).contains(&self.status) {
            let sse = envoy::header(map, "content-type")
                .is_some_and(|v| v.starts_with("text/event-stream"));
            self.scan = Some(if sse {
                UsageScan::Sse(SseUsageScanner::new(MAX_SSE_LINE))
            } else {
                UsageScan::Json(Vec::new())
            });
        }
        let name = self.routed.as_ref().map(|r| r.engine.name.clone());
        let extra: Vec<(&str, &str)> = name
            .as_deref()
            .map(|n| ("x-kvmesh-engine", n))
            .into_iter()
            .collect();
        let reply = envoy::response_headers(&extra);
        if h.end_of_stream {
            self.response_done();
        }
        Step::Continue(vec![reply])
    }

    fn on_response_body(&mut self, b: HttpBody) -> Step {
        if !b.body.is_empty() {
            if !self.first_byte {
                self.first_byte = true;
                self.gw
                    .metrics
                    .ttft
                    .with_label_values(&[self.route])
                    .observe(self.started.elapsed().as_secs_f64());
                if let Some(r) = self.routed.as_mut() {
                    r.dispatch.prefill_done();
                }
            }
            match self.scan.as_mut() {
                Some(UsageScan::Sse(s)) => s.feed(&b.body),
                Some(UsageScan::Json(j)) => {
                    if j.len() + b.body.len() <= MAX_USAGE_BODY {
                        j.extend_from_slice(&b.body);
                    } else {
                        self.scan = None;
                    }
                }
                None => {}
            }
        }
        let replies = envoy::body_chunks(Direction::Response, &b.body, b.end_of_stream);
        if b.end_of_stream {
            self.response_done();
        }
        Step::Continue(replies)
    }

    /// The response is complete: settle `usage` into the residency index and release the
    /// engine's load.
    fn response_done(&mut self) {
        if matches!(self.phase, Phase::Done) {
            return;
        }
        self.phase = Phase::Done;
        let u = match self.scan.take() {
            Some(UsageScan::Sse(s)) => s.usage(),
            Some(UsageScan::Json(j)) => usage::from_json(&j),
            None => None,
        };
        if let Some(r) = self.routed.take() {
            if let Some(facts) = r.facts.as_ref() {
                self.gw.settle(
                    u,
                    &Prediction {
                        facts,
                        engine: r.engine.id,
                        overlap_blocks: r.overlap_blocks,
                        settled: r.settled,
                    },
                );
            }
        }
        self.admitted = None;
    }

    /// The stream ended (whatever the reason): count the request; dropping the exchange
    /// releases its load, body budget and admission slot.
    pub(crate) fn finish(self) {
        let status = match self.status {
            // Envoy closed the stream before any response: the client went away, or Envoy
            // gave up (its timeouts).
            0 => "499".to_string(),
            s => s.to_string(),
        };
        let m = &self.gw.metrics;
        m.requests.with_label_values(&[self.route, &status]).inc();
        m.latency
            .with_label_values(&[self.route])
            .observe(self.started.elapsed().as_secs_f64());
    }
}
