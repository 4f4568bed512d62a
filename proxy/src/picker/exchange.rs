//! One ext_proc stream: one HTTP request through Envoy, from its headers to the end of its
//! response, as a state machine over the messages Envoy sends (`FULL_DUPLEX_STREAMED` bodies).
//!
//! Request side: the headers are held; body chunks are buffered (bounded by `max_body_bytes`
//! and the body budget, charged with the buffer's capacity) until the end of the body; then the
//! request is parsed and ranked exactly as the gateway does, and the replies go out in the
//! order Envoy requires: the headers reply (destination, `clear_route_cache`, metadata), then
//! the body in chunks of at most 64 KiB. `GET /v1/models` is answered by the picker itself, as
//! the gateway does; any other path is a 404, so a client cannot reach an engine's own admin
//! endpoints through Envoy. Response side: each chunk goes straight back; on the way `usage` is
//! read, and at the end it settles the residency prediction.

use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request as Msg, HttpBody, HttpHeaders, ProcessingRequest,
    ProcessingResponse,
};
use kvmesh_filters::request::Endpoint;
use kvmesh_filters::route::Candidate;
use kvmesh_filters::{ApiError, ErrorKind, Source};

use super::envoy::{self, Direction};
use crate::body::{body_too_large, Admitted, BodyPermit};
use crate::feedback::{Prediction, UsageScan};
use crate::fleet::{Dispatch, Engine};
use crate::otel::{attr, client_attr, span_attributes, Failure, RequestTrace};
use crate::plan::{RequestFacts, DIGESTS_HEADER};
use crate::service::Gateway;
use kvmesh_filters::usage::Usage;

/// What the stream does after a message.
#[derive(Debug)]
pub(crate) enum Step {
    /// Send these replies (possibly none) and read on.
    Continue(Vec<ProcessingResponse>),
    /// Send these replies and end the stream (a local answer was sent).
    Close(Vec<ProcessingResponse>),
}

/// Where the request side is.
enum RequestPhase {
    /// Waiting for the request headers.
    Start,
    /// Collecting an inference request's body.
    Buffering {
        endpoint: Endpoint,
        body: Vec<u8>,
        /// The buffer never grows past this unless the body does (its declared length, or
        /// `max_body_bytes`).
        ceiling: usize,
    },
    /// Routed; the body (if any) has gone back to Envoy.
    Sent,
}

/// The chosen engine and what is needed to settle its prediction.
struct Routed {
    engine: Arc<Engine>,
    /// Counts the request as the engine's load until the response ends (or the stream drops).
    dispatch: Dispatch,
    facts: RequestFacts,
    overlap_blocks: usize,
    settled: bool,
}

/// The state of one stream.
pub(crate) struct Exchange {
    gw: Arc<Gateway>,
    fallbacks: usize,
    started: Instant,
    route: &'static str,
    request: RequestPhase,
    /// The response is complete, or a local answer was sent.
    finished: bool,
    /// The `max_inflight` slot, held until the response ends.
    admitted: Option<Admitted>,
    /// The body's reservation, held until the engine answers (as in the gateway).
    permit: Option<BodyPermit>,
    /// Envoy's subset hint, if it sent one.
    subset: Option<std::collections::HashSet<std::net::SocketAddr>>,
    /// The session header's value.
    session: Option<String>,
    routed: Option<Routed>,
    /// The endpoints the request was offered to (the choice, then its fallbacks): the only
    /// ones Envoy may say served it.
    offered: Vec<String>,
    /// The response's headers have come (once per stream).
    responded: bool,
    scan: Option<UsageScan>,
    /// The status the client got (a local answer's, or the engine's).
    status: u16,
    /// The request id (the client's `x-request-id` when usable, else fresh).
    request_id: String,
    /// For the access log.
    method: String,
    path: String,
    reason: &'static str,
    bytes_in: usize,
    bytes_out: u64,
    ttft: Option<std::time::Duration>,
    usage: Option<Usage>,
    engine_name: String,
    overlap_blocks: usize,
    model: Option<String>,
    /// The refusal sent, if the picker answered with an error itself.
    refused: Option<ApiError>,
    /// Its spans (`[otel]`), from the request headers of an inference call to the stream's end.
    trace: Option<RequestTrace>,
}

impl Exchange {
    pub(crate) fn new(gw: Arc<Gateway>, fallbacks: usize) -> Self {
        Exchange {
            gw,
            fallbacks,
            started: Instant::now(),
            route: "other",
            request: RequestPhase::Start,
            finished: false,
            admitted: None,
            permit: None,
            subset: None,
            session: None,
            routed: None,
            offered: Vec::new(),
            responded: false,
            scan: None,
            status: 0,
            request_id: String::new(),
            method: String::new(),
            path: String::new(),
            reason: "",
            bytes_in: 0,
            bytes_out: 0,
            ttft: None,
            usage: None,
            engine_name: String::new(),
            overlap_blocks: 0,
            model: None,
            refused: None,
            trace: None,
        }
    }

    /// Whether the request body is still being collected (the body deadline applies).
    pub(crate) fn buffering(&self) -> bool {
        matches!(self.request, RequestPhase::Buffering { .. })
    }

    /// Whether the response is complete (or a local answer was sent).
    pub(crate) fn done(&self) -> bool {
        self.finished
    }

    /// Whether the request was routed.
    pub(crate) fn routed(&self) -> bool {
        !self.offered.is_empty()
    }

    /// Whether the response has begun: from then on the replies carry it, as fast as the
    /// client reads it.
    pub(crate) fn responding(&self) -> bool {
        self.responded
    }

    /// The gateway it routes with.
    pub(crate) fn gateway(&self) -> &Arc<Gateway> {
        &self.gw
    }

    /// Whether `req` ends a request body over [`crate::tokens::INLINE_TOKENIZE_BYTES`]: the
    /// message that routes it parses the body and may tokenize it, which takes milliseconds.
    pub(crate) fn routes_a_long_body(&self, req: &ProcessingRequest) -> bool {
        let RequestPhase::Buffering { body, .. } = &self.request else {
            return false;
        };
        let long =
            |extra: usize| body.len().saturating_add(extra) > crate::tokens::INLINE_TOKENIZE_BYTES;
        match &req.request {
            Some(Msg::RequestBody(b)) => b.end_of_stream && long(b.body.len()),
            Some(Msg::RequestTrailers(_)) => long(0),
            _ => false,
        }
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
        let response = matches!(
            req.request,
            Some(Msg::ResponseHeaders(_) | Msg::ResponseBody(_) | Msg::ResponseTrailers(_))
        );
        if response && matches!(self.request, RequestPhase::Start) {
            return Err(tonic::Status::failed_precondition(
                "a response message before the request headers",
            ));
        }
        if !response && req.request.is_some() && (self.responded || self.finished) {
            return Err(tonic::Status::failed_precondition(
                "a request message after the response began",
            ));
        }
        if response && !self.routed() && !self.finished {
            // Envoy answered itself (a 408, say) before the picker routed: the request side
            // is over, and what it held goes back.
            self.request = RequestPhase::Sent;
            self.permit = None;
            self.admitted = None;
        }
        match req.request {
            Some(Msg::RequestHeaders(ref h)) => self.on_request_headers(&req, h),
            Some(Msg::RequestBody(b)) => self.on_request_body(b),
            Some(Msg::RequestTrailers(_)) => self.on_request_trailers(),
            Some(Msg::ResponseHeaders(ref h)) => {
                // Once, and nothing after the response's end: each would move load or mark an
                // engine down on Envoy's word again. (Before routing it can be Envoy's own
                // answer, a 408 say: it moves nothing then.)
                if self.responded || self.finished {
                    return Err(tonic::Status::failed_precondition(
                        "response headers a second time, or after the response ended",
                    ));
                }
                self.responded = true;
                Ok(self.on_response_headers(&req, h))
            }
            Some(Msg::ResponseBody(_) | Msg::ResponseTrailers(_)) if self.finished => {
                Err(tonic::Status::failed_precondition(
                    "a response body or trailers after the response ended",
                ))
            }
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
        self.answer_locally();
        let reply = envoy::immediate(&e, &self.request_id);
        self.refused = Some(e);
        Step::Close(vec![reply])
    }

    fn answer_locally(&mut self) {
        self.finished = true;
        self.request = RequestPhase::Sent;
        self.permit = None;
        self.admitted = None;
    }

    fn on_request_headers(
        &mut self,
        req: &ProcessingRequest,
        h: &HttpHeaders,
    ) -> Result<Step, tonic::Status> {
        if !matches!(self.request, RequestPhase::Start) {
            return Err(tonic::Status::failed_precondition(
                "request headers arrived twice",
            ));
        }
        let map = h.headers.as_ref();
        let raw_path = envoy::header(map, ":path").unwrap_or("/");
        let path = raw_path.split('?').next().unwrap_or(raw_path);
        let method = envoy::header(map, ":method").unwrap_or("");
        self.request_id = crate::access::request_id(envoy::header(map, crate::access::REQUEST_ID));
        self.method = method.to_string();
        self.path = path.to_string();
        if !normalized(path) {
            return Ok(self.refuse(ApiError::new(
                ErrorKind::InvalidRequest,
                "the request path must be normalized: no percent-encoding, `//`, `.` or `..` \
                 segments",
            )));
        }
        let Some(endpoint) = Endpoint::from_path(path) else {
            return Ok(self.local_path(method, path));
        };
        self.route = endpoint.label();
        if let Some(otel) = self.gw.otel.as_ref() {
            // Envoy passes the client's context on: a client's, not a peer's.
            self.trace = Some(otel.request(
                envoy::header(map, crate::otel::TRACEPARENT),
                envoy::header(map, crate::otel::TRACESTATE),
                false,
                vec![
                    attr("http.request.method", method.to_string()),
                    client_attr("url.path", path),
                    attr("kvmesh.request_id", self.request_id.clone()),
                ],
            ));
        }
        if method != "POST" {
            return Ok(self.refuse(ApiError::method_not_allowed(path, "POST")));
        }
        let cfg = &self.gw.live().cfg;
        // The fleet's addresses, gathered only for a request that carries a hint.
        let known = std::cell::OnceCell::<std::collections::HashSet<std::net::SocketAddr>>::new();
        let fleet = || self.gw.fleet.engines().iter().map(|e| e.addr()).collect();
        self.subset = match envoy::subset_hint(req, |a| known.get_or_init(fleet).contains(a)) {
            Ok(s) => s,
            // The data plane's hint, not the client's request: not a 400.
            Err(e) => return Ok(self.refuse(ApiError::new(ErrorKind::NoEngine, e))),
        };
        self.session =
            envoy::header(map, &cfg.routing.session_header.to_ascii_lowercase()).map(String::from);
        let limit = cfg.max_body_bytes;
        let declared = envoy::header(map, "content-length").and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit as u64) {
            return Ok(self.refuse(body_too_large(limit)));
        }
        match self.gw.admit() {
            Ok(a) => self.admitted = Some(a),
            Err(e) => return Ok(self.refuse(e)),
        }
        if h.end_of_stream {
            // No body at all: parsing says what is missing (400).
            self.request = RequestPhase::Sent;
            return Ok(self.decide(endpoint, Vec::new(), None));
        }
        self.permit = Some(BodyPermit::new(&self.gw.limits));
        self.request = RequestPhase::Buffering {
            endpoint,
            body: Vec::new(),
            ceiling: declared.map_or(limit, |n| n as usize),
        };
        Ok(Step::Continue(Vec::new()))
    }

    /// A path that is not an inference call: `GET /v1/models` from the fleet (as the gateway
    /// answers it), anything else 404 or 405.
    fn local_path(&mut self, method: &str, path: &str) -> Step {
        if path.trim_end_matches('/') != "/v1/models" {
            return self.refuse(ApiError::new(
                ErrorKind::NotFound,
                format!("no route for {method} {path}"),
            ));
        }
        self.route = "models";
        // HEAD answers as GET; Envoy leaves the body out of its local reply.
        if method != "GET" && method != "HEAD" {
            return self.refuse(ApiError::method_not_allowed(
                "/v1/models",
                ApiError::READ_ONLY,
            ));
        }
        self.status = 200;
        self.answer_locally();
        Step::Close(vec![envoy::local_json(
            200,
            self.gw.models_json().to_vec(),
            &self.request_id,
        )])
    }

    fn on_request_body(&mut self, b: HttpBody) -> Result<Step, tonic::Status> {
        let RequestPhase::Buffering { body, ceiling, .. } = &mut self.request else {
            return Err(tonic::Status::failed_precondition(
                "a request body chunk arrived outside the request body",
            ));
        };
        let limit = self.gw.live().cfg.max_body_bytes;
        let need = body.len().saturating_add(b.body.len());
        if need > limit {
            return Ok(self.refuse(body_too_large(limit)));
        }
        // The body's buffer is charged to the budget as the gateway charges it.
        let granted = self
            .permit
            .as_mut()
            .is_some_and(|p| p.reserve(body, need, *ceiling));
        if !granted {
            let e = self.gw.over_body_budget();
            return Ok(self.refuse(e));
        }
        body.extend_from_slice(&b.body);
        if !b.end_of_stream {
            return Ok(Step::Continue(Vec::new()));
        }
        match std::mem::replace(&mut self.request, RequestPhase::Sent) {
            RequestPhase::Buffering { endpoint, body, .. } => {
                Ok(self.decide(endpoint, body, Some(true)))
            }
            _ => Err(tonic::Status::internal("picker state lost its body")),
        }
    }

    fn on_request_trailers(&mut self) -> Result<Step, tonic::Status> {
        let trailers = envoy::trailers(Direction::Request);
        match std::mem::replace(&mut self.request, RequestPhase::Sent) {
            // Trailers end the body: decide now; the body goes back without end of stream.
            RequestPhase::Buffering { endpoint, body, .. } => {
                Ok(match self.decide(endpoint, body, Some(false)) {
                    Step::Continue(mut replies) => {
                        replies.push(trailers);
                        Step::Continue(replies)
                    }
                    close => close,
                })
            }
            RequestPhase::Sent => Ok(Step::Continue(vec![trailers])),
            RequestPhase::Start => Err(tonic::Status::failed_precondition(
                "request trailers arrived before the request headers",
            )),
        }
    }

    /// Ranks the engines for the buffered request and routes it; `body_end` is `None` when
    /// the request had no body phase, else whether the body chunks end the stream.
    fn decide(&mut self, endpoint: Endpoint, body: Vec<u8>, body_end: Option<bool>) -> Step {
        let gw = self.gw.clone();
        let parsed = match gw.parse(endpoint, &body) {
            Ok(p) => p,
            Err(e) => return self.refuse(e),
        };
        let facts = gw.facts(
            endpoint,
            parsed,
            &body,
            self.session.as_deref(),
            false,
            None,
        );
        self.model = Some(facts.model.clone());
        let ranking = match gw.rank_traced(&facts, self.trace.as_ref()) {
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
        let engine = engines[0].clone();
        self.reason = ranking.decision.reason.label();
        self.bytes_in = body.len();
        let endpoints: Vec<String> = engines.iter().map(|e| e.addr().to_string()).collect();
        self.offered.clone_from(&endpoints);
        let digests = gw.forwarded_digests(&facts);
        self.route_to(engine, facts, first.overlap_blocks);
        // The engine's spans are children of this request's (Envoy sends the request on).
        let trace_headers = self.trace.as_ref().map(RequestTrace::headers);
        let mut headers = vec![
            (DIGESTS_HEADER, digests.as_str()),
            (crate::access::REQUEST_ID, self.request_id.as_str()),
        ];
        for (name, value) in trace_headers.iter().flatten() {
            headers.push((*name, value.as_str()));
        }
        let mut replies = vec![envoy::routed_headers(
            &endpoints,
            body_end.map(|_| body.len()),
            &headers,
        )];
        if let Some(end) = body_end {
            replies.extend(envoy::body_chunks(Direction::Request, body, end));
        }
        Step::Continue(replies)
    }

    /// Counts the request as `engine`'s load and records the prediction in the index.
    fn route_to(&mut self, engine: Arc<Engine>, facts: RequestFacts, overlap_blocks: usize) {
        let uncached = facts.size.uncached_bytes(overlap_blocks);
        let settled = engine.pending_prefill() == 0;
        // Replacing an earlier choice drops its guard: its load is released first.
        self.routed = None;
        let dispatch = self.gw.fleet.dispatch(&engine, uncached);
        self.engine_name.clone_from(&engine.name);
        self.overlap_blocks = overlap_blocks;
        self.gw
            .index
            .record(engine.id, &facts.chain, Source::Optimistic, Instant::now());
        self.routed = Some(Routed {
            engine,
            dispatch,
            facts,
            overlap_blocks,
            settled,
        });
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
        self.subset.as_ref().is_none_or(|s| s.contains(&e.addr()))
    }

    /// Envoy names the endpoint that served (GIE v1.0.0): when it is not the choice (a data
    /// plane that used a fallback), the load and the prediction move to it; only to one of
    /// the fallbacks offered.
    fn follow_served(&mut self, req: &ProcessingRequest) {
        let Some(served) = envoy::served_endpoint(req) else {
            return;
        };
        if !self.offered.contains(&served) {
            tracing::debug!(%served, "Envoy says an endpoint it was not offered served the request");
            return;
        }
        let Some(r) = self.routed.as_ref() else {
            return;
        };
        if r.engine.addr().to_string() == served {
            return;
        }
        let engines = self.gw.fleet.engines();
        let Some(engine) = engines.iter().find(|e| e.addr().to_string() == served) else {
            tracing::debug!(%served, "Envoy served an endpoint the picker does not know");
            return;
        };
        let Some(r) = self.routed.take() else {
            return;
        };
        // The served engine holds none of what was predicted for the choice.
        self.route_to(engine.clone(), r.facts, 0);
    }

    fn on_response_headers(&mut self, req: &ProcessingRequest, h: &HttpHeaders) -> Step {
        self.follow_served(req);
        let connect_failed = envoy::attribute(req, "response.code_details")
            .is_some_and(envoy::upstream_connect_failed);
        if connect_failed {
            // Envoy could not reach the engine (this is its own 503): take the engine out
            // until a probe succeeds, as the gateway does on a refused connection, and keep
            // the answer out of the residency index.
            if let Some(r) = self.routed.take() {
                tracing::warn!(engine = %r.engine.name, "Envoy could not connect to the engine");
                self.gw.fleet.mark_down(&r.engine);
            }
        }
        let map = h.headers.as_ref();
        self.status = envoy::header(map, ":status")
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        // The engine has answered: the request body is no longer held.
        self.permit = None;
        if (200..300).contains(&self.status) && self.routed.is_some() {
            let content_type = envoy::header(map, "content-type");
            self.scan = Some(UsageScan::for_content_type(content_type));
        }
        let name = self.routed.as_ref().map(|r| r.engine.name.clone());
        let mut extra: Vec<(&str, &str)> = vec![(crate::access::REQUEST_ID, &self.request_id)];
        if let Some(n) = name.as_deref() {
            extra.push(("x-kvmesh-engine", n));
        }
        let reply = envoy::response_headers(&extra);
        if h.end_of_stream {
            self.response_done();
        }
        Step::Continue(vec![reply])
    }

    fn on_response_body(&mut self, b: HttpBody) -> Step {
        if !b.body.is_empty() {
            self.bytes_out += b.body.len() as u64;
            if self.ttft.is_none() {
                let ttft = self.started.elapsed();
                self.ttft = Some(ttft);
                self.gw
                    .metrics
                    .ttft
                    .with_label_values(&[self.route])
                    .observe(ttft.as_secs_f64());
                if let Some(r) = self.routed.as_mut() {
                    r.dispatch.prefill_done();
                }
            }
            if let Some(scan) = self.scan.as_mut() {
                scan.feed(&b.body);
            }
        }
        let end = b.end_of_stream;
        let replies = envoy::body_chunks(Direction::Response, b.body, end);
        if end {
            self.response_done();
        }
        Step::Continue(replies)
    }

    /// The response is complete: settle `usage` into the residency index and release the
    /// engine's load.
    fn response_done(&mut self) {
        if self.finished {
            return;
        }
        self.finished = true;
        let u = self.scan.take().and_then(|s| s.usage());
        self.usage = u;
        if let Some(r) = self.routed.take() {
            self.gw.settle(
                u,
                &Prediction {
                    facts: &r.facts,
                    engine: r.engine.id,
                    overlap_blocks: r.overlap_blocks,
                    settled: r.settled,
                },
            );
        }
        self.permit = None;
        self.admitted = None;
    }

    /// The stream ended (whatever the reason): count the request; dropping the exchange
    /// releases its load, body budget and admission slot.
    pub(crate) fn finish(mut self) {
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
        let line = crate::access::Line {
            request_id: &self.request_id,
            method: &self.method,
            path: &self.path,
            model: self.model.as_deref().unwrap_or(""),
            status: if self.status == 0 { 499 } else { self.status },
            engine: &self.engine_name,
            reason: self.reason,
            overlap_blocks: self.overlap_blocks,
            cached_tokens: self.usage.and_then(|u| u.cached_tokens),
            completion_tokens: self.usage.and_then(|u| u.completion_tokens),
            ttft: self.ttft,
            duration: self.started.elapsed(),
            bytes_in: self.bytes_in,
            bytes_out: self.bytes_out,
            client: "",
            key: "",
        };
        crate::access::log(&line);
        if let Some(t) = self.trace.take() {
            let refusal = self.refused.as_ref().map(|e| e.message.as_str());
            let failure = Failure::of(line.status, refusal, false);
            t.finish(span_attributes(&line, false), failure);
        }
        self.gw
            .metrics
            .recent
            .finished(&line, self.refused.as_ref());
    }
}

/// Whether `path` (without its query) is in normal form: the picker classifies paths as
/// written, so a path an engine would decode or collapse into an inference call must not pass
/// as something else.
fn normalized(path: &str) -> bool {
    path.starts_with('/')
        && !path.contains('%')
        && !path.contains("//")
        && !path.split('/').any(|seg| seg == "." || seg == "..")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::normalized;

    #[test]
    fn only_normal_paths_are_classified() {
        assert!(normalized("/v1/chat/completions"));
        assert!(normalized("/v1/models/"));
        for bad in [
            "v1/chat",
            "/v1/chat%2Fcompletions",
            "/v1/%63hat/completions",
            "//v1/chat/completions",
            "/v1/./chat/completions",
            "/v1/x/../chat/completions",
        ] {
            assert!(!normalized(bad), "{bad}");
        }
    }
}
