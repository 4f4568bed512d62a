//! The request path of the gateway, one Pingora hook per phase, top to bottom:
//!
//! 1. `request_filter`: local endpoints; admission (a hard cap on requests in flight, taken
//!    before the body is read); read and bound the body (its bytes reserved from a global body
//!    budget as they arrive, the whole read under one deadline); parse it in one streaming
//!    pass; hash the leading blocks of the canonical prompt into the digest chain. Early
//!    refusals read and discard the rest of the body, bounded, before closing (a lingering
//!    close), so that the client sees the error, not a reset; refusals for overload or a slow
//!    client drain far less.
//! 2. `upstream_peer`: rank the engines once (policy over the residency index and live load;
//!    in sidecar mode, keep the local engine unless a peer saves enough), then take the next
//!    untried engine: the first call, and again after each failover. A peer's engine is reached
//!    through the peer proxy, with `x-kvmesh-hop: 1` so that it serves the request locally.
//! 3. `upstream_request_filter` / `request_body_filter`: send the original body bytes.
//! 4. `upstream_response_filter` / `response_body_filter`: stream the response through as it
//!    comes, note the first byte, read `usage` on the way.
//!    Once the engine has answered and the body has been sent, the body and its budget are
//!    released: failover can no longer happen.
//! 5. `logging`: record residency and metrics; the load guard and the admission slot are
//!    released.
//!
//! Failover happens only before the first response byte: connect failures
//! (`fail_to_connect`) and failures while sending the request (`error_while_proxy`).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use http::header;
use kvmesh_filters::chain::{text_chain_capped, Digest, Namespace};
use kvmesh_filters::error::{ApiError, ErrorKind};
use kvmesh_filters::request::{self, Endpoint, ParsedRequest};
use kvmesh_filters::residency::{ResidencyIndex, Source};
use kvmesh_filters::route::{Decision, Router};
use kvmesh_filters::usage::{self, SseUsageScanner};
use pingora::http::ResponseHeader;
use pingora::prelude::*;
use pingora::proxy::{FailToProxy, ProxyHttp, Session};
use pingora::upstreams::peer::HttpPeer;
use pingora::{Error, ErrorSource, ErrorType};

use crate::config::{ColdPlacement, HopTrust, Mode, ProxyConfig};
use crate::fleet::{Dispatch, Engine, Fleet, NoRoute};
use crate::metrics::Metrics;

/// Pingora's per-request body replay buffer (`BODY_BUF_LIMIT` in pingora-core): a body whose
/// last `REPLAY_TAIL` bytes are captured can be sent upstream after we pre-read it.
const REPLAY_TAIL: usize = 64 * 1024;
/// Most bytes of a non-streamed response kept to read its `usage`.
const MAX_USAGE_BODY: usize = 4 << 20;
/// Longest SSE line kept while looking for `usage`.
const MAX_SSE_LINE: usize = 1 << 20;
/// A request forwarded by a peer proxy carries this header and is served locally.
pub const HOP_HEADER: &str = "x-kvmesh-hop";
/// Lingering close after an early refusal: most body bytes read and discarded ...
const LINGER_MAX_BYTES: usize = 64 << 20;
/// ... and for at most this long, before the connection is closed.
const LINGER_TIME: Duration = Duration::from_secs(5);
/// The same after a refusal for overload (`max_inflight`, the body budget) or a body not sent
/// in time: enough for a small body to be taken whole, never the cost of a large one.
const SHORT_LINGER_MAX_BYTES: usize = 256 << 10;
/// ... for at most this long.
const SHORT_LINGER_TIME: Duration = Duration::from_secs(1);
/// A body's buffer is first allocated as large as the bytes received, and at least this large
/// (never past its `Content-Length`), then at most doubled as bytes arrive: the budget is charged
/// with at most twice what has arrived, plus this.
const FIRST_BODY_ALLOC: usize = 4 << 10;
/// Most bytes accepted after the JSON document of a chunked body; they must be whitespace.
const MAX_TRAILING_BYTES: usize = 16 << 10;

/// Proxy-wide hard limits: requests in flight and request-body bytes held.
pub struct Limits {
    inflight: AtomicU64,
    max_inflight: u64,
    body_bytes: AtomicUsize,
    body_budget: usize,
}

impl Limits {
    /// Limits of `max_inflight` requests and `body_budget` body bytes.
    pub fn new(max_inflight: u64, body_budget: usize) -> Arc<Self> {
        Arc::new(Limits {
            inflight: AtomicU64::new(0),
            max_inflight,
            body_bytes: AtomicUsize::new(0),
            body_budget,
        })
    }

    /// Requests admitted and not finished.
    pub fn inflight(&self) -> u64 {
        self.inflight.load(Ordering::Relaxed)
    }

    /// Body bytes reserved now.
    pub fn body_bytes(&self) -> usize {
        self.body_bytes.load(Ordering::Relaxed)
    }

    /// Takes an admission slot, or `None` at the cap.
    fn admit(self: &Arc<Self>) -> Option<Admitted> {
        self.inflight
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
                (n < self.max_inflight).then_some(n + 1)
            })
            .ok()
            .map(|_| Admitted(self.clone()))
    }
}

/// An admission slot; released on drop.
struct Admitted(Arc<Limits>);

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Body bytes reserved from the budget by one request; released on drop.
struct BodyPermit {
    limits: Arc<Limits>,
    bytes: usize,
}

impl BodyPermit {
    fn new(limits: &Arc<Limits>) -> Self {
        BodyPermit {
            limits: limits.clone(),
            bytes: 0,
        }
    }

    /// Reserves `n` more bytes; `false` (and nothing reserved) past the budget.
    fn grow(&mut self, n: usize) -> bool {
        let budget = self.limits.body_budget;
        let ok = self
            .limits
            .body_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |cur| {
                cur.checked_add(n).filter(|&t| t <= budget)
            })
            .is_ok();
        if ok {
            self.bytes += n;
        }
        ok
    }
}

impl Drop for BodyPermit {
    fn drop(&mut self) {
        self.limits
            .body_bytes
            .fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// The gateway: shared, immutable-after-start state of the proxy.
pub struct Gateway {
    /// Configuration in force.
    pub cfg: ProxyConfig,
    /// The engines.
    pub fleet: Arc<Fleet>,
    /// Prefix residency.
    pub index: Arc<ResidencyIndex>,
    /// The policy.
    pub router: Router,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Hard caps on requests in flight and body bytes held.
    pub limits: Arc<Limits>,
}

/// What the router knows of a parsed request.
pub struct Plan {
    endpoint: Endpoint,
    model: String,
    chain: Vec<Digest>,
    total_bytes: usize,
    session_key: Option<String>,
}

/// Per-request state.
pub struct Ctx {
    started: Instant,
    route: &'static str,
    /// The admission slot, held from admission to `logging`.
    admitted: Option<Admitted>,
    body: Option<Bytes>,
    /// The body's reservation, released with the body.
    body_permit: Option<BodyPermit>,
    /// The client asked `Expect: 100-continue` and has not been told to send the body.
    awaiting_continue: bool,
    /// A chunked body whose last chunks Pingora reads (after the JSON document): checked in
    /// `request_body_filter`.
    tail: Option<Tail>,
    body_sent: bool,
    /// The engine chosen while the client's body is still arriving (a chunked body read on by
    /// Pingora): its load is counted only once the body is complete (`request_body_filter`).
    pending_dispatch: Option<(Arc<Engine>, u64)>,
    plan: Option<Plan>,
    decision: Option<(Vec<kvmesh_filters::route::Candidate>, Decision)>,
    attempts: u32,
    dispatch: Option<Dispatch>,
    /// Forwarded by a peer: only local engines may serve it.
    local_only: bool,
    /// Why the first choice is a peer (sidecar mode), for the forward metrics.
    forward_reason: &'static str,
    predicted_overlap: usize,
    prediction_settled: bool,
    response_started: bool,
    first_byte: bool,
    status: u16,
    sse: Option<SseUsageScanner>,
    json: Option<Vec<u8>>,
    error: Option<ApiError>,
}

impl Ctx {
    /// The engine this attempt goes to, counted or not yet.
    fn engine(&self) -> Option<&Arc<Engine>> {
        self.dispatch
            .as_ref()
            .map(Dispatch::engine)
            .or(self.pending_dispatch.as_ref().map(|(e, _)| e))
    }

    fn new() -> Self {
        Ctx {
            started: Instant::now(),
            route: "other",
            admitted: None,
            body: None,
            body_permit: None,
            awaiting_continue: false,
            tail: None,
            body_sent: false,
            pending_dispatch: None,
            plan: None,
            decision: None,
            attempts: 0,
            dispatch: None,
            local_only: false,
            forward_reason: "rank",
            predicted_overlap: 0,
            prediction_settled: false,
            response_started: false,
            first_byte: false,
            status: 0,
            sse: None,
            json: None,
            error: None,
        }
    }
}

fn pingora_error(kind: ErrorKind, message: &str) -> Box<Error> {
    Error::explain(ErrorType::HTTPStatus(kind.status()), message.to_string())
}

/// Writes a complete local response.
async fn respond(
    session: &mut Session,
    status: u16,
    content_type: &str,
    body: Bytes,
    extra: &[(&str, &str)],
) -> Result<()> {
    let mut h = ResponseHeader::build(status, Some(4))?;
    h.insert_header(header::CONTENT_TYPE, content_type)?;
    h.insert_header(header::CONTENT_LENGTH, body.len().to_string())?;
    for (k, v) in extra {
        h.insert_header(k.to_string(), *v)?;
    }
    session.write_response_header(Box::new(h), false).await?;
    session.write_response_body(Some(body), true).await
}

/// What follows the JSON document of a chunked body that Pingora's own body loop reads.
struct Tail {
    /// Length of the body read so far.
    body_len: usize,
    /// Bytes after it that the proxy read itself, before Pingora took over.
    read_before: usize,
    /// Bytes offered after it in this attempt (a failover replays them).
    seen: usize,
    /// The body read deadline.
    deadline: tokio::time::Instant,
    /// Pingora's per-read timeout before it was shortened to the deadline, restored at the end.
    read_timeout: Option<Duration>,
}

/// Lingering close: reads and discards what is left of the request body, at most
/// [`LINGER_MAX_BYTES`] for at most [`LINGER_TIME`] ([`SHORT_LINGER_MAX_BYTES`] and
/// [`SHORT_LINGER_TIME`] after `short` refusals: overload, slow clients), so that a client that
/// writes its whole body before reading gets the response rather than a connection reset. A
/// client still waiting for `100 Continue` sends no body: nothing to drain.
async fn linger(session: &mut Session, ctx: &Ctx, short: bool) {
    if ctx.awaiting_continue {
        return;
    }
    let (max_bytes, time) = if short {
        (SHORT_LINGER_MAX_BYTES, SHORT_LINGER_TIME)
    } else {
        (LINGER_MAX_BYTES, LINGER_TIME)
    };
    let deadline = tokio::time::Instant::now() + time;
    let mut drained = 0usize;
    while drained < max_bytes && !session.is_body_done() {
        match tokio::time::timeout_at(deadline, session.read_request_body()).await {
            Ok(Ok(Some(chunk))) => drained += chunk.len(),
            _ => break,
        }
    }
}

/// The client did not send its body within `timeout`.
fn body_timeout(timeout: Duration) -> ApiError {
    ApiError::new(
        ErrorKind::RequestTimeout,
        format!(
            "the request body was not received within {} s (`body_read_timeout_secs`)",
            timeout.as_secs()
        ),
    )
}

async fn respond_error(session: &mut Session, ctx: &mut Ctx, e: ApiError) -> Result<bool> {
    ctx.status = e.status();
    let retry_after: &[(&str, &str)] =
        if matches!(e.kind, ErrorKind::Overloaded | ErrorKind::NoEngine) {
            &[("retry-after", "1")]
        } else {
            &[]
        };
    // The body may be unread: do not reuse this connection.
    session.set_keepalive(None);
    respond(
        session,
        e.status(),
        "application/json",
        Bytes::from(e.to_json()),
        retry_after,
    )
    .await?;
    // Overload, slow clients, and refusals before admission (which hold no `max_inflight`
    // slot): a refused connection must not cost a long drain.
    let short = matches!(
        e.kind,
        ErrorKind::Overloaded
            | ErrorKind::RequestTimeout
            | ErrorKind::NotFound
            | ErrorKind::MethodNotAllowed
            | ErrorKind::Forbidden
    );
    ctx.error = Some(e);
    ctx.body = None;
    ctx.body_permit = None;
    ctx.tail = None;
    linger(session, ctx, short).await;
    Ok(true)
}

/// Tracks whether a JSON text's top-level object or array has closed, across chunks.
#[derive(Default)]
struct JsonEnd {
    depth: u32,
    in_string: bool,
    escaped: bool,
    complete: bool,
}

impl JsonEnd {
    fn feed(&mut self, bytes: &[u8]) {
        for &c in bytes {
            if self.complete {
                if !c.is_ascii_whitespace() {
                    self.complete = false;
                    // Trailing garbage: keep reading to the end; the parser will reject it.
                    self.depth = u32::MAX / 2;
                }
                continue;
            }
            if self.in_string {
                match (self.escaped, c) {
                    (true, _) => self.escaped = false,
                    (false, b'\\') => self.escaped = true,
                    (false, b'"') => self.in_string = false,
                    _ => {}
                }
                continue;
            }
            match c {
                b'"' => self.in_string = true,
                b'{' | b'[' => self.depth = self.depth.saturating_add(1),
                b'}' | b']' => {
                    self.depth = self.depth.saturating_sub(1);
                    if self.depth == 0 {
                        self.complete = true;
                    }
                }
                _ => {}
            }
        }
    }
}

impl Gateway {
    /// Reads the whole request body, bounded, arranging that Pingora can still send it upstream.
    ///
    /// Bounds: `max_body_bytes` (413); the body budget, charged with the buffer as it grows with
    /// the bytes received, never for bytes only declared (429); `body_read_timeout_secs` for the
    /// whole read, however the client paces it (408).
    ///
    /// Pingora sends a pre-read body upstream only from its 64 KiB replay buffer, which stops
    /// holding anything once more than 64 KiB have passed through it. So: with `Content-Length`,
    /// the replay buffer is armed once at most 64 KiB remain (it then holds the tail, and
    /// `request_body_filter` swaps in the whole body). With chunked framing it is armed before
    /// the first read; once the JSON document is complete, what follows it (whitespace, at most
    /// [`MAX_TRAILING_BYTES`]) and the terminating chunk are read here too, under the same
    /// deadline, while the replay buffer still holds everything read (bodies of up to 64 KiB):
    /// no engine is chosen, connected to or charged before the whole body is in hand. For a
    /// larger chunked body the replay buffer cannot hold it, and Pingora must read the terminating
    /// chunk itself (else it would send the engine nothing): reading stops at the end of the
    /// document, [`Tail`] makes `request_body_filter` check the rest, and the engine's load is
    /// counted only once the body is complete (`pending_dispatch`); the engine connection is
    /// opened before that, for at most the deadline.
    async fn read_body(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
    ) -> std::result::Result<Bytes, ApiError> {
        let limit = self.cfg.max_body_bytes;
        let timeout = Duration::from_secs(self.cfg.body_read_timeout_secs);
        let deadline = tokio::time::Instant::now() + timeout;
        // Pingora's per-read timeout, shortened to the deadline while the body is read.
        let read_timeout = session.get_read_timeout();
        let over_budget = || {
            self.metrics
                .admission_rejections
                .with_label_values(&["body_budget"])
                .inc();
            ApiError::new(
                ErrorKind::Overloaded,
                "request bodies held by the proxy are at its budget (`body_budget_bytes`); retry shortly",
            )
        };
        let timed_out = || {
            self.metrics
                .admission_rejections
                .with_label_values(&["body_timeout"])
                .inc();
            body_timeout(timeout)
        };
        let read_error = |e: Box<Error>| {
            if e.etype() == &ErrorType::ReadTimedout {
                return timed_out();
            }
            ApiError::new(
                ErrorKind::InvalidRequest,
                format!("failed to read the request body: {e}"),
            )
        };
        // Dropped (released) on any error; moved into the context with the body.
        let mut permit = BodyPermit::new(&self.limits);
        let too_large = || {
            ApiError::new(
                ErrorKind::BodyTooLarge,
                format!("request body exceeds the limit of {limit} bytes"),
            )
        };
        let chunked = session
            .req_header()
            .headers
            .get(header::TRANSFER_ENCODING)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
        let content_length = if chunked {
            None
        } else {
            match session.req_header().headers.get(header::CONTENT_LENGTH) {
                None => Some(0),
                Some(v) => Some(
                    v.to_str()
                        .ok()
                        .and_then(|s| s.trim().parse::<usize>().ok())
                        .ok_or_else(|| {
                            ApiError::new(
                                ErrorKind::InvalidRequest,
                                "invalid Content-Length header",
                            )
                        })?,
                ),
            }
        };
        if content_length.is_some_and(|cl| cl > limit) {
            return Err(too_large());
        }
        let expects_continue = session
            .req_header()
            .headers
            .get(header::EXPECT)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.eq_ignore_ascii_case("100-continue"));
        if expects_continue {
            ctx.awaiting_continue = false;
            session.write_continue_response().await.map_err(|e| {
                ApiError::new(
                    ErrorKind::InvalidRequest,
                    format!("client connection failed: {e}"),
                )
            })?;
        }
        if chunked {
            // Holds every byte read while the body stays within 64 KiB.
            session.as_mut().enable_retry_buffering();
        }
        // A declared length only bounds the buffer: it grows (and is charged to the budget)
        // with what arrives.
        let ceiling = content_length.unwrap_or(limit);
        let mut buf: Vec<u8> = Vec::new();
        let mut json_end = JsonEnd::default();
        loop {
            if let Some(cl) = content_length {
                if cl - buf.len().min(cl) <= REPLAY_TAIL {
                    session.as_mut().enable_retry_buffering();
                }
            }
            // Pingora's own timeout is per read: never let one outlast the deadline.
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            session.set_read_timeout(Some(left.max(Duration::from_millis(1))));
            let chunk = match tokio::time::timeout_at(deadline, session.read_request_body()).await {
                Err(_) => return Err(timed_out()),
                Ok(read) => read.map_err(read_error)?,
            };
            let Some(chunk) = chunk else { break };
            let need = buf.len() + chunk.len();
            if need > limit {
                return Err(too_large());
            }
            if need > buf.capacity() {
                // The first buffer holds what arrived (at least 4 KiB); later ones at most double
                // what is held; never past the declared length (or the limit).
                let grown = if buf.capacity() == 0 {
                    need.max(FIRST_BODY_ALLOC)
                } else {
                    need.max(buf.capacity().saturating_mul(2))
                };
                let target = grown.min(ceiling.max(need));
                let target = if permit.grow(target - permit.bytes) {
                    target
                } else if permit.grow(need.saturating_sub(permit.bytes)) {
                    need
                } else {
                    return Err(over_budget());
                };
                buf.reserve_exact(target - buf.len());
                // The allocation may round up: charge what is really held.
                if buf.capacity() > permit.bytes && !permit.grow(buf.capacity() - permit.bytes) {
                    return Err(over_budget());
                }
            }
            buf.extend_from_slice(&chunk);
            if chunked {
                json_end.feed(&chunk);
                if json_end.complete {
                    let tail = self
                        .read_tail(session, buf.len(), deadline, &read_error)
                        .await?;
                    if let Some(read_before) = tail {
                        ctx.tail = Some(Tail {
                            body_len: buf.len(),
                            read_before,
                            seen: 0,
                            deadline,
                            read_timeout,
                        });
                    }
                    break;
                }
            }
        }
        if ctx.tail.is_none() {
            session.set_read_timeout(read_timeout);
        }
        if ctx.tail.is_none() && !buf.is_empty() && session.as_ref().get_retry_buffer().is_none() {
            // Never hang an upstream waiting for bytes we cannot replay. (A chunked body that
            // ended without a complete JSON document is refused by the parser first.)
            if content_length.is_some() || json_end.complete {
                return Err(ApiError::new(
                    ErrorKind::Internal,
                    "request body could not be staged for forwarding",
                ));
            }
        }
        ctx.body_permit = Some(permit);
        Ok(Bytes::from(buf))
    }

    /// Reads what follows the JSON document of a chunked body (`body_len` bytes so far) while
    /// the replay buffer still holds every byte read: `None` once the terminating chunk has
    /// been read (the body is whole), or `Some(bytes read after the document)` when the replay
    /// buffer overflowed and Pingora must read the rest (checked by [`Self::check_tail`]).
    async fn read_tail(
        &self,
        session: &mut Session,
        body_len: usize,
        deadline: tokio::time::Instant,
        read_error: &impl Fn(Box<Error>) -> ApiError,
    ) -> std::result::Result<Option<usize>, ApiError> {
        let mut seen = 0usize;
        loop {
            if session.is_body_done() {
                return Ok(None);
            }
            if session.as_ref().get_retry_buffer().is_none() {
                return Ok(Some(seen));
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            session.set_read_timeout(Some(left.max(Duration::from_millis(1))));
            let piece = match tokio::time::timeout_at(deadline, session.read_request_body()).await {
                Err(_) => {
                    self.metrics
                        .admission_rejections
                        .with_label_values(&["body_timeout"])
                        .inc();
                    return Err(body_timeout(Duration::from_secs(
                        self.cfg.body_read_timeout_secs,
                    )));
                }
                Ok(read) => read.map_err(read_error)?,
            };
            let Some(piece) = piece else {
                return Ok(None);
            };
            seen = seen.saturating_add(piece.len());
            self.trailing_ok(body_len, seen, &piece)?;
        }
    }

    /// What follows a chunked body's JSON document: whitespace only (else 400), at most
    /// [`MAX_TRAILING_BYTES`] of it and within `max_body_bytes` (else 413). `seen` counts every
    /// byte after the document so far, `data` included.
    fn trailing_ok(
        &self,
        body_len: usize,
        seen: usize,
        data: &[u8],
    ) -> std::result::Result<(), ApiError> {
        if !data.iter().all(u8::is_ascii_whitespace) {
            return Err(ApiError::new(
                ErrorKind::InvalidRequest,
                "invalid JSON body: characters after the JSON document",
            ));
        }
        let limit = self.cfg.max_body_bytes;
        if seen > MAX_TRAILING_BYTES || body_len.saturating_add(seen) > limit {
            return Err(ApiError::new(
                ErrorKind::BodyTooLarge,
                format!(
                    "request body has more than {MAX_TRAILING_BYTES} bytes of whitespace after its \
                     JSON document, or exceeds the limit of {limit} bytes"
                ),
            ));
        }
        Ok(())
    }

    /// Checks what Pingora read after the JSON document of a chunked body: whitespace only, at
    /// most [`MAX_TRAILING_BYTES`] (and within `max_body_bytes`), before the deadline; then
    /// shortens Pingora's next read to what is left of the deadline.
    fn check_tail(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
        data: &[u8],
    ) -> std::result::Result<(), ApiError> {
        let Some(t) = ctx.tail.as_mut() else {
            return Ok(());
        };
        t.seen = t.seen.saturating_add(data.len());
        self.trailing_ok(t.body_len, t.read_before.saturating_add(t.seen), data)?;
        let now = tokio::time::Instant::now();
        if now > t.deadline {
            self.metrics
                .admission_rejections
                .with_label_values(&["body_timeout"])
                .inc();
            return Err(body_timeout(Duration::from_secs(
                self.cfg.body_read_timeout_secs,
            )));
        }
        let left = t.deadline.saturating_duration_since(now);
        session.set_read_timeout(Some(left.max(Duration::from_millis(1))));
        Ok(())
    }

    /// Local endpoints; `true` when answered.
    async fn local(&self, session: &mut Session, ctx: &mut Ctx, path: &str) -> Result<bool> {
        let get = session.req_header().method == http::Method::GET;
        let answer = match (get, path) {
            (true, "/health") => (200, "text/plain", Bytes::from_static(b"ok\n")),
            (true, "/ready") => {
                if self.fleet.ready() {
                    (200, "text/plain", Bytes::from_static(b"ready\n"))
                } else {
                    (
                        503,
                        "text/plain",
                        Bytes::from_static(b"no healthy engine\n"),
                    )
                }
            }
            (true, "/metrics") => (200, "text/plain; version=0.0.4", {
                self.metrics
                    .inflight_requests
                    .set(self.limits.inflight() as i64);
                self.metrics.body_bytes.set(self.limits.body_bytes() as i64);
                Bytes::from(self.metrics.render(&self.fleet, &self.index))
            }),
            (true, "/v1/models") => {
                let mut ids: Vec<String> = Vec::new();
                for e in self.fleet.engines().iter().filter(|e| e.healthy()) {
                    for m in e.models().iter().flat_map(|m| m.iter()) {
                        if !ids.contains(m) {
                            ids.push(m.clone());
                        }
                    }
                }
                let data: Vec<serde_json::Value> = ids
                    .iter()
                    .map(|id| serde_json::json!({"id": id, "object": "model", "created": 0, "owned_by": "kvmesh"}))
                    .collect();
                let body = serde_json::to_vec(&serde_json::json!({"object": "list", "data": data}))
                    .unwrap_or_default();
                (200, "application/json", Bytes::from(body))
            }
            _ => return Ok(false),
        };
        ctx.route = match path {
            "/v1/models" => "models",
            _ => "admin",
        };
        ctx.status = answer.0;
        respond(session, answer.0, answer.1, answer.2, &[]).await?;
        Ok(true)
    }

    fn plan(&self, session: &Session, parsed: ParsedRequest) -> Plan {
        let ns = Namespace::new(
            &parsed.model,
            parsed.cache_salt.as_deref().unwrap_or("").as_bytes(),
        );
        let chain = text_chain_capped(
            &ns,
            &parsed.canonical,
            self.cfg.routing.block_bytes,
            self.cfg.routing.max_prefix_blocks,
        );
        let session_key = session
            .req_header()
            .headers
            .get(self.cfg.routing.session_header.as_str())
            .and_then(|v| v.to_str().ok())
            .map(String::from)
            .or(parsed.user);
        Plan {
            endpoint: parsed.endpoint,
            model: parsed.model,
            chain,
            total_bytes: parsed.canonical_len,
            session_key,
        }
    }

    fn decide(&self, ctx: &mut Ctx) -> std::result::Result<(), ApiError> {
        let Some(plan) = ctx.plan.as_ref() else {
            return Err(ApiError::new(ErrorKind::Internal, "no request plan"));
        };
        let mut cands =
            self.fleet
                .candidates(&plan.model, ctx.local_only)
                .map_err(|e| match e {
                    NoRoute::UnknownModel => ApiError::new(
                        ErrorKind::ModelNotFound,
                        format!(
                            "the model `{}` does not exist or is not served by any engine",
                            plan.model
                        ),
                    )
                    .with_param("model"),
                    NoRoute::NoneHealthy => ApiError::new(
                        ErrorKind::NoEngine,
                        format!("no healthy engine serves `{}`", plan.model),
                    ),
                })?;
        for (node, blocks) in self.index.overlap(&plan.chain, Instant::now()) {
            if let Some(c) = cands.iter_mut().find(|c| c.node == node) {
                c.overlap_blocks = blocks;
            }
        }
        let mut decision = self.router.rank(
            &cands,
            plan.total_bytes,
            plan.session_key.as_deref(),
            &mut fastrand::Rng::new(),
        );
        if self.cfg.mode == Mode::Sidecar && !ctx.local_only {
            ctx.forward_reason = self.prefer_local(&cands, &mut decision, plan);
        }
        self.metrics
            .decisions
            .with_label_values(&[self.router.policy().label(), decision.reason.label()])
            .inc();
        ctx.decision = Some((cands, decision));
        Ok(())
    }

    /// Sidecar rule: serve on the local engine unless the best peer saves at least
    /// `sidecar.forward_min_saving` of the `prefix` cost against it (other policies: the rank
    /// decides). Reorders `decision` so the local engine comes first when it keeps the request;
    /// returns why a peer comes first otherwise.
    fn prefer_local(
        &self,
        cands: &[kvmesh_filters::route::Candidate],
        decision: &mut Decision,
        plan: &Plan,
    ) -> &'static str {
        let total_bytes = plan.total_bytes;
        let is_local = |i: usize| {
            self.fleet
                .get(cands[i].node)
                .is_some_and(|e| e.peer.is_none())
        };
        let cold = cands.iter().all(|c| c.overlap_blocks == 0);
        if let (true, ColdPlacement::Home, Some(first)) =
            (cold, self.cfg.sidecar.cold_placement, plan.chain.first())
        {
            if let Some(home) = self.cold_home(cands, first) {
                if let Some(pos) = decision.order.iter().position(|&i| i == home) {
                    decision.order[..=pos].rotate_right(1);
                }
                return if is_local(home) { "local" } else { "home" };
            }
        }
        let Some(&first) = decision.order.first() else {
            return "rank";
        };
        if is_local(first) {
            return "local";
        }
        let Some(pos) = decision.order.iter().position(|&i| is_local(i)) else {
            return "local_down";
        };
        if self.router.policy() != kvmesh_filters::route::Policy::Prefix {
            return "rank";
        }
        let p = self.router.params();
        let local_cost =
            kvmesh_filters::route::prefix_cost(&cands[decision.order[pos]], total_bytes, p);
        let peer_cost = kvmesh_filters::route::prefix_cost(&cands[first], total_bytes, p);
        if local_cost.saturating_sub(peer_cost) >= self.cfg.sidecar.forward_min_saving {
            return "prefix_saving";
        }
        decision.order[..=pos].rotate_right(1);
        "local"
    }

    /// The rendezvous-hash home of a prefix among `cands`: the candidate maximising
    /// BLAKE3(first digest, node id). Node ids are cluster-wide, so every sidecar agrees.
    fn cold_home(
        &self,
        cands: &[kvmesh_filters::route::Candidate],
        first: &Digest,
    ) -> Option<usize> {
        let own = self.cfg.node_id();
        let weight = |c: &kvmesh_filters::route::Candidate| {
            let engine = self.fleet.get(c.node)?;
            let id = engine
                .peer
                .as_ref()
                .map_or(own.as_str(), |p| p.node_id.as_str());
            let mut h = blake3::Hasher::new();
            h.update(&first.0);
            h.update(id.as_bytes());
            let mut b = [0u8; 8];
            b.copy_from_slice(&h.finalize().as_bytes()[..8]);
            Some(u64::from_le_bytes(b))
        };
        cands
            .iter()
            .enumerate()
            .filter_map(|(i, c)| Some((i, weight(c)?)))
            .max_by_key(|(_, w)| *w)
            .map(|(i, _)| i)
    }

    /// Whether a request carrying the hop header comes from a trusted peer.
    fn hop_trusted(&self, session: &Session) -> bool {
        let Some(ip) = session
            .client_addr()
            .and_then(|a| a.as_inet())
            .map(|a| a.ip())
        else {
            return false;
        };
        hop_allowed(ip, self.cfg.sidecar.accept_hop_from, || {
            self.fleet
                .engines()
                .iter()
                .filter(|e| e.peer.is_some())
                .map(|e| e.addr.ip())
                .collect()
        })
    }

    /// The response is complete: confirm or refute the residency prediction from `usage`.
    fn settle_usage(&self, ctx: &Ctx) {
        let u = match (&ctx.sse, &ctx.json) {
            (Some(s), _) => s.usage(),
            (None, Some(body)) => usage::from_json(body),
            _ => None,
        };
        let (Some(u), Some(plan), Some(d)) = (u, ctx.plan.as_ref(), ctx.dispatch.as_ref()) else {
            return;
        };
        self.metrics.prompt_tokens.inc_by(u.prompt_tokens);
        let Some(cached) = u.cached_tokens else {
            return;
        };
        self.metrics.cached_tokens.inc_by(cached);
        if u.prompt_tokens == 0 || plan.chain.is_empty() {
            return;
        }
        // Text-mode estimate: the cached share of the prompt, in blocks of canonical bytes.
        let cached_bytes =
            (plan.total_bytes as u128 * cached as u128 / u.prompt_tokens as u128) as usize;
        let cached_blocks = (cached_bytes / self.cfg.routing.block_bytes).min(plan.chain.len());
        let verdict = self.index.confirm(
            d.engine().id,
            &plan.chain,
            ctx.predicted_overlap,
            cached_blocks,
            ctx.prediction_settled,
            Instant::now(),
        );
        self.metrics
            .residency_verdicts
            .with_label_values(&[verdict.label()])
            .inc();
    }

    fn can_retry(&self, ctx: &Ctx) -> bool {
        let remaining = ctx.decision.as_ref().map_or(0, |(_, d)| {
            d.order.len().saturating_sub(ctx.attempts as usize)
        });
        !ctx.response_started && ctx.attempts < self.cfg.upstream.max_attempts && remaining > 0
    }
}

#[async_trait]
impl ProxyHttp for Gateway {
    type CTX = Ctx;

    fn new_ctx(&self) -> Ctx {
        Ctx::new()
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        let path = session.req_header().uri.path().to_string();
        if self.local(session, ctx, &path).await? {
            return Ok(true);
        }
        ctx.awaiting_continue = session
            .req_header()
            .headers
            .get(header::EXPECT)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.eq_ignore_ascii_case("100-continue"));
        let Some(endpoint) = Endpoint::from_path(&path) else {
            let e = ApiError::new(
                ErrorKind::NotFound,
                format!("no route for {} {path}", session.req_header().method),
            );
            return respond_error(session, ctx, e).await;
        };
        ctx.route = endpoint.label();
        if session.req_header().method != http::Method::POST {
            let e = ApiError::new(
                ErrorKind::MethodNotAllowed,
                format!("{path} accepts POST only"),
            );
            return respond_error(session, ctx, e).await;
        }
        if session.req_header().headers.contains_key(HOP_HEADER) {
            if !self.hop_trusted(session) {
                self.metrics
                    .admission_rejections
                    .with_label_values(&["untrusted_hop"])
                    .inc();
                let e = ApiError::new(
                    ErrorKind::Forbidden,
                    format!("the {HOP_HEADER} header is accepted only from peer proxies"),
                );
                return respond_error(session, ctx, e).await;
            }
            ctx.local_only = true;
        }
        ctx.admitted = self.limits.admit();
        if ctx.admitted.is_none() {
            tracing::debug!(
                admitted = self.limits.inflight(),
                at_engines = self.fleet.total_inflight(),
                "max_inflight reached"
            );
            self.metrics
                .admission_rejections
                .with_label_values(&["max_inflight"])
                .inc();
            let e = ApiError::new(
                ErrorKind::Overloaded,
                "too many requests in flight; retry shortly",
            );
            return respond_error(session, ctx, e).await;
        }
        let body = match self.read_body(session, ctx).await {
            Ok(b) => b,
            Err(e) => return respond_error(session, ctx, e).await,
        };
        // Only the leading blocks are hashed: keep no more of the canonical prompt than that.
        let keep = self
            .cfg
            .routing
            .max_prefix_blocks
            .saturating_mul(self.cfg.routing.block_bytes);
        let parsed = match request::parse_limited(endpoint, &body, keep) {
            Ok(p) => p,
            Err(e) => return respond_error(session, ctx, e).await,
        };
        ctx.body = Some(body);
        ctx.plan = Some(self.plan(session, parsed));
        if let Err(e) = self.decide(ctx) {
            return respond_error(session, ctx, e).await;
        }
        Ok(false)
    }

    async fn upstream_peer(&self, _session: &mut Session, ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
        let Some((cands, decision)) = ctx.decision.as_ref() else {
            return Err(pingora_error(ErrorKind::Internal, "no routing decision"));
        };
        // Engines before `tried` in the order were attempted already. Take the next one that
        // is still healthy (or simply the next, if none is).
        let tried = ctx.attempts as usize;
        let rest = decision.order.get(tried..).unwrap_or(&[]);
        let pick = rest
            .iter()
            .position(|&i| self.fleet.get(cands[i].node).is_some_and(|e| e.healthy()))
            .unwrap_or(0);
        let Some(&ci) = rest.get(pick) else {
            ctx.error = Some(ApiError::new(
                ErrorKind::NoEngine,
                "no engine could be reached",
            ));
            return Err(pingora_error(
                ErrorKind::NoEngine,
                "all ranked engines tried",
            ));
        };
        let cand = cands[ci];
        let Some(engine) = self.fleet.get(cand.node) else {
            return Err(pingora_error(ErrorKind::Internal, "ranked engine vanished"));
        };
        // Move the chosen engine to position `tried`, keeping the skipped ones for a failover.
        if let Some((_, d)) = ctx.decision.as_mut() {
            d.order[tried..=tried + pick].rotate_right(1);
        }
        ctx.attempts += 1;
        ctx.body_sent = false;
        if let Some(t) = ctx.tail.as_mut() {
            // A failover replays what was read of the tail.
            t.seen = 0;
        }
        if let Some(peer) = engine.peer.as_ref().filter(|p| p.via_peer) {
            let reason = if ctx.attempts > 1 {
                "failover"
            } else {
                ctx.forward_reason
            };
            self.metrics
                .forwards
                .with_label_values(&[&peer.node_id, reason])
                .inc();
        }
        ctx.predicted_overlap = cand.overlap_blocks;
        ctx.prediction_settled = engine.pending_prefill() == 0;
        let (chain, total) = ctx
            .plan
            .as_ref()
            .map(|p| (p.chain.as_slice(), p.total_bytes))
            .unwrap_or((&[], 0));
        let uncached =
            total.saturating_sub(cand.overlap_blocks * self.cfg.routing.block_bytes) as u64;
        // Replacing the guard releases a failed attempt's counts. A body still arriving (read
        // on by Pingora) is not counted as the engine's load until it is complete.
        if ctx.tail.is_some() {
            ctx.dispatch = None;
            ctx.pending_dispatch = Some((engine.clone(), uncached));
        } else {
            ctx.dispatch = Some(self.fleet.dispatch(&engine, uncached));
        }
        self.index
            .record(engine.id, chain, Source::Optimistic, Instant::now());
        let mut peer = HttpPeer::new(engine.addr, false, String::new());
        peer.options.connection_timeout =
            Some(Duration::from_millis(self.cfg.upstream.connect_timeout_ms));
        peer.options.read_timeout = Some(Duration::from_secs(self.cfg.upstream.read_timeout_secs));
        peer.options.idle_timeout = Some(Duration::from_secs(60));
        Ok(Box::new(peer))
    }

    async fn upstream_request_filter(
        &self,
        _session: &mut Session,
        req: &mut RequestHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        // We hold the whole body: send it with a Content-Length whatever the client's framing.
        req.remove_header(&header::EXPECT);
        req.remove_header(&header::TRANSFER_ENCODING);
        let len = ctx.body.as_ref().map_or(0, |b| b.len());
        req.insert_header(header::CONTENT_LENGTH, len.to_string())?;
        // One hop at most: the peer serves it locally. A client's own hop header (trusted, or
        // the request was refused) never travels further.
        req.remove_header(HOP_HEADER);
        if ctx.engine().is_some_and(|e| e.via_peer()) {
            req.insert_header(HOP_HEADER, "1")?;
        }
        if let Some(plan) = ctx.plan.as_ref() {
            let n = self.cfg.routing.forward_digests.min(plan.chain.len());
            if n > 0 {
                let hex: Vec<String> = plan.chain[..n].iter().map(Digest::to_hex).collect();
                req.insert_header("x-kvmesh-prefix-digests", hex.join(","))?;
            }
        }
        Ok(())
    }

    async fn request_body_filter(
        &self,
        session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<()> {
        if ctx.tail.is_some() {
            // A chunked body's end: what follows the document is checked, and the engine gets
            // the body only once the client's is complete (so nothing is answered before).
            if let Err(e) = self.check_tail(session, ctx, body.as_deref().unwrap_or_default()) {
                let err = pingora_error(e.kind, &e.message);
                ctx.error = Some(e);
                return Err(err);
            }
            if !end_of_stream {
                *body = Some(Bytes::new());
                return Ok(());
            }
            if let Some(t) = ctx.tail.as_ref() {
                session.set_read_timeout(t.read_timeout);
            }
            // The body is complete: now it is the engine's load.
            if let Some((engine, uncached)) = ctx.pending_dispatch.take() {
                ctx.dispatch = Some(self.fleet.dispatch(&engine, uncached));
            }
        }
        // Whatever Pingora offers (the replay tail, the chunked terminator, insignificant
        // whitespace after the JSON document), the engine gets the whole body once per attempt.
        *body = if ctx.body_sent {
            None
        } else if ctx.response_started {
            // The engine answered already: no failover needs the body again.
            ctx.body_permit = None;
            ctx.body.take()
        } else {
            ctx.body.clone()
        };
        ctx.body_sent = true;
        Ok(())
    }

    async fn upstream_response_filter(
        &self,
        _session: &mut Session,
        resp: &mut ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        ctx.response_started = true;
        ctx.status = resp.status.as_u16();
        if ctx.body_sent {
            // No failover after the first response byte: the body is not needed any more.
            ctx.body = None;
            ctx.body_permit = None;
        }
        let is_sse = resp
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        if resp.status.is_success() {
            if is_sse {
                ctx.sse = Some(SseUsageScanner::new(MAX_SSE_LINE));
            } else {
                ctx.json = Some(Vec::new());
            }
        }
        if let Some(engine) = ctx.engine() {
            match engine.peer.as_ref().filter(|p| p.via_peer) {
                // The peer proxy named its engine already; say which peer served it.
                Some(p) => resp.insert_header("x-kvmesh-peer", p.node_id.as_str())?,
                None => resp.insert_header("x-kvmesh-engine", engine.name.as_str())?,
            }
        }
        Ok(())
    }

    fn response_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<Option<Duration>> {
        if let Some(b) = body.as_ref().filter(|b| !b.is_empty()) {
            if !ctx.first_byte {
                ctx.first_byte = true;
                self.metrics
                    .ttft
                    .with_label_values(&[ctx.route])
                    .observe(ctx.started.elapsed().as_secs_f64());
                if let Some(d) = ctx.dispatch.as_mut() {
                    d.prefill_done();
                }
            }
            if let Some(s) = ctx.sse.as_mut() {
                s.feed(b);
            } else if let Some(j) = ctx.json.as_mut() {
                if j.len() + b.len() <= MAX_USAGE_BODY {
                    j.extend_from_slice(b);
                } else {
                    ctx.json = None;
                }
            }
        }
        if end_of_stream {
            self.settle_usage(ctx);
            ctx.sse = None;
            ctx.json = None;
        }
        Ok(None)
    }

    fn fail_to_connect(
        &self,
        _session: &mut Session,
        _peer: &HttpPeer,
        ctx: &mut Ctx,
        mut e: Box<Error>,
    ) -> Box<Error> {
        let pending = ctx.pending_dispatch.take().map(|(engine, _)| engine);
        if let Some(engine) = ctx.dispatch.take().map(|d| d.engine().clone()).or(pending) {
            tracing::warn!(engine = %engine.name, error = %e, "cannot connect to engine");
            self.fleet.mark_down(&engine);
        }
        if self.can_retry(ctx) {
            self.metrics.retries.with_label_values(&["connect"]).inc();
            e.set_retry(true);
        }
        e
    }

    fn error_while_proxy(
        &self,
        peer: &HttpPeer,
        session: &mut Session,
        e: Box<Error>,
        ctx: &mut Ctx,
        _reused: bool,
    ) -> Box<Error> {
        let mut e = e.more_context(format!("engine {peer}"));
        // Replayable: Pingora still holds the body's tail, or has not read its end yet.
        let replayable = session.as_ref().get_retry_buffer().is_some() || !session.is_body_done();
        if e.esource() == &ErrorSource::Upstream && replayable && self.can_retry(ctx) {
            ctx.pending_dispatch = None;
            if let Some(d) = ctx.dispatch.take() {
                tracing::warn!(engine = %d.engine().name, error = %e, "engine failed before answering; failing over");
            }
            self.metrics.retries.with_label_values(&["proxy"]).inc();
            e.set_retry(true);
        } else {
            e.set_retry(false);
        }
        e
    }

    async fn fail_to_proxy(&self, session: &mut Session, e: &Error, ctx: &mut Ctx) -> FailToProxy {
        let api = ctx
            .error
            .clone()
            .unwrap_or_else(|| match (e.esource(), e.etype()) {
                (
                    ErrorSource::Upstream,
                    ErrorType::ConnectTimedout
                    | ErrorType::ConnectRefused
                    | ErrorType::ConnectNoRoute
                    | ErrorType::ConnectError,
                ) => ApiError::new(
                    ErrorKind::NoEngine,
                    format!("no engine reachable ({} tried): {e}", ctx.attempts),
                ),
                (ErrorSource::Upstream, _) => {
                    ApiError::new(ErrorKind::UpstreamFailed, format!("engine failed: {e}"))
                }
                (ErrorSource::Downstream, ErrorType::ReadTimedout) => {
                    // Pingora's per-read timeout, shortened to the body deadline.
                    self.metrics
                        .admission_rejections
                        .with_label_values(&["body_timeout"])
                        .inc();
                    body_timeout(Duration::from_secs(self.cfg.body_read_timeout_secs))
                }
                (ErrorSource::Downstream, _) => {
                    ApiError::new(ErrorKind::InvalidRequest, format!("client error: {e}"))
                }
                _ => ApiError::new(ErrorKind::Internal, format!("internal error: {e}")),
            });
        let downstream_gone = e.esource() == &ErrorSource::Downstream
            && matches!(
                e.etype(),
                ErrorType::WriteError | ErrorType::ReadError | ErrorType::ConnectionClosed
            );
        let code = if downstream_gone || session.response_written().is_some() {
            0
        } else {
            let status = api.status();
            let _ = respond_error(session, ctx, api).await;
            status
        };
        if code == 0 && ctx.status == 0 {
            ctx.status = 499;
        }
        FailToProxy {
            error_code: code,
            can_reuse_downstream: false,
        }
    }

    async fn logging(&self, session: &mut Session, _e: Option<&Error>, ctx: &mut Ctx) {
        let status = if ctx.status != 0 {
            ctx.status
        } else {
            session.response_written().map_or(0, |r| r.status.as_u16())
        };
        let status = status.to_string();
        self.metrics
            .requests
            .with_label_values(&[ctx.route, &status])
            .inc();
        self.metrics
            .latency
            .with_label_values(&[ctx.route])
            .observe(ctx.started.elapsed().as_secs_f64());
        if let (Some(plan), Some(d)) = (ctx.plan.as_ref(), ctx.dispatch.as_ref()) {
            tracing::debug!(engine = %d.engine().name, endpoint = plan.endpoint.label(), status, blocks = plan.chain.len(),
                predicted = ctx.predicted_overlap, "request done");
        }
        // Release the engine's load counts now rather than when Pingora drops the context.
        ctx.dispatch = None;
        ctx.pending_dispatch = None;
        ctx.body = None;
        ctx.body_permit = None;
        ctx.admitted = None;
    }
}

/// Whether a request with the hop header from `ip` is trusted under `trust`; `members` lists
/// the IPs of live peers (computed only when needed).
fn hop_allowed(
    ip: std::net::IpAddr,
    trust: HopTrust,
    members: impl FnOnce() -> Vec<std::net::IpAddr>,
) -> bool {
    ip.is_loopback() || (trust == HopTrust::Members && members().contains(&ip))
}

#[cfg(test)]
mod tests {
    use super::{hop_allowed, HopTrust, JsonEnd};

    #[test]
    fn hop_header_trust() {
        let peer: std::net::IpAddr = "10.0.0.7".parse().unwrap();
        let stranger: std::net::IpAddr = "10.0.0.9".parse().unwrap();
        let members = || vec![peer];
        assert!(hop_allowed(
            "127.0.0.1".parse().unwrap(),
            HopTrust::Loopback,
            members
        ));
        assert!(hop_allowed(
            "::1".parse().unwrap(),
            HopTrust::Loopback,
            members
        ));
        assert!(!hop_allowed(peer, HopTrust::Loopback, members));
        assert!(hop_allowed(peer, HopTrust::Members, members));
        assert!(!hop_allowed(stranger, HopTrust::Members, members));
    }

    #[test]
    fn json_end_tracks_nesting_and_strings() {
        let mut j = JsonEnd::default();
        j.feed(br#"{"a":"}\"{","b":[1,{"c":2}]"#);
        assert!(!j.complete);
        j.feed(b"}  \n");
        assert!(j.complete);
        j.feed(b"x");
        assert!(!j.complete);
    }
}
