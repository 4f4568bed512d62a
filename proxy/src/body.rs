//! The request body: reading and bounding it (`max_body_bytes`, the body budget, one deadline
//! for the whole read), staging it so that Pingora can still send it upstream, the proxy-wide
//! limits (admission slots, body budget permits) and the lingering close after a refusal.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header;
use kvmesh_filters::error::{ApiError, ErrorKind};
use pingora::proxy::Session;
use pingora::{Error, ErrorType};

use crate::service::{Ctx, Gateway};

/// Pingora's per-request body replay buffer (`BODY_BUF_LIMIT` in pingora-core): a body whose
/// last `REPLAY_TAIL` bytes are captured can be sent upstream after we pre-read it.
const REPLAY_TAIL: usize = 64 * 1024;
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
    /// Request bodies held: `body_budget_bytes`.
    bodies: kvmesh_grpc::Budget,
    /// ext_proc messages on their way in (picker mode): `picker.message_budget_bytes`.
    pub(crate) messages: kvmesh_grpc::Budget,
}

impl Limits {
    /// Limits of `max_inflight` requests, `body_budget` body bytes and (picker mode)
    /// `message_budget` bytes of ext_proc messages on their way in.
    pub fn new(max_inflight: u64, body_budget: usize, message_budget: usize) -> Arc<Self> {
        Arc::new(Limits {
            inflight: AtomicU64::new(0),
            max_inflight,
            bodies: kvmesh_grpc::Budget::new(body_budget, "`body_budget_bytes`"),
            messages: kvmesh_grpc::Budget::new(message_budget, "`picker.message_budget_bytes`"),
        })
    }

    /// Requests admitted and not finished.
    pub fn inflight(&self) -> u64 {
        self.inflight.load(Ordering::Relaxed)
    }

    /// Body bytes reserved now.
    pub fn body_bytes(&self) -> usize {
        self.bodies.used()
    }

    /// Takes an admission slot, or `None` at the cap.
    pub(crate) fn admit(self: &Arc<Self>) -> Option<Admitted> {
        self.inflight
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
                (n < self.max_inflight).then_some(n + 1)
            })
            .ok()
            .map(|_| Admitted(self.clone()))
    }
}

/// An admission slot; released on drop.
pub(crate) struct Admitted(Arc<Limits>);

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Body bytes reserved from the budget by one request; released on drop.
pub(crate) struct BodyPermit(kvmesh_grpc::Share);

impl BodyPermit {
    pub(crate) fn new(limits: &Arc<Limits>) -> Self {
        BodyPermit(limits.bodies.share())
    }

    /// Makes the permit cover at least `len` bytes (a body rewritten larger); `false` (and
    /// nothing more reserved) past the budget.
    pub(crate) fn cover(&mut self, len: usize) -> bool {
        self.0.cover(len)
    }

    /// Makes room in `buf` (the one buffer this permit pays for) for `need` bytes, charging the
    /// budget before allocating: the first buffer holds what arrived (at least 4 KiB), later
    /// ones at most double what is held, never past `ceiling` (the declared length, or the
    /// limit) unless `need` is more; when the budget cannot take that, exactly `need`. `false`
    /// (over budget) when it cannot take even that.
    pub(crate) fn reserve(&mut self, buf: &mut Vec<u8>, need: usize, ceiling: usize) -> bool {
        if need <= buf.capacity() {
            return true;
        }
        let grown = if buf.capacity() == 0 {
            need.max(FIRST_BODY_ALLOC)
        } else {
            need.max(buf.capacity().saturating_mul(2))
        };
        let target = grown.min(ceiling.max(need));
        let target = if self.0.cover(target) {
            target
        } else if self.0.cover(need) {
            need
        } else {
            return false;
        };
        buf.reserve_exact(target - buf.len());
        // The allocation may round up: charge what is really held.
        self.0.cover(buf.capacity())
    }
}

/// What follows the JSON document of a chunked body that Pingora's own body loop reads.
pub(crate) struct Tail {
    /// Length of the body read so far.
    body_len: usize,
    /// Bytes after it that the proxy read itself, before Pingora took over.
    read_before: usize,
    /// Bytes offered after it in this attempt (a failover replays them).
    pub(crate) seen: usize,
    /// The body read deadline.
    deadline: tokio::time::Instant,
    /// Pingora's per-read timeout before it was shortened to the deadline, restored at the end.
    pub(crate) read_timeout: Option<Duration>,
}

/// Lingering close: reads and discards what is left of the request body, at most
/// [`LINGER_MAX_BYTES`] for at most [`LINGER_TIME`] ([`SHORT_LINGER_MAX_BYTES`] and
/// [`SHORT_LINGER_TIME`] after `short` refusals: overload, slow clients), so that a client that
/// writes its whole body before reading gets the response rather than a connection reset. A
/// client still waiting for `100 Continue` sends no body: nothing to drain.
pub(crate) async fn linger(session: &mut Session, ctx: &Ctx, short: bool) {
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
pub(crate) fn body_timeout(timeout: Duration) -> ApiError {
    ApiError::new(
        ErrorKind::RequestTimeout,
        format!(
            "the request body was not received within {} s (`body_read_timeout_secs`)",
            timeout.as_secs()
        ),
    )
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

/// The 413 for a body over `max_body_bytes`.
pub(crate) fn body_too_large(limit: usize) -> ApiError {
    ApiError::new(
        ErrorKind::BodyTooLarge,
        format!("request body exceeds the limit of {limit} bytes"),
    )
}

impl Gateway {
    /// Takes an admission slot (`max_inflight`), or the counted 429 to send.
    pub(crate) fn admit(&self) -> std::result::Result<Admitted, ApiError> {
        self.limits.admit().ok_or_else(|| {
            tracing::debug!(
                admitted = self.limits.inflight(),
                at_engines = self.fleet.total_inflight(),
                "max_inflight reached"
            );
            self.metrics
                .admission_rejections
                .with_label_values(&["max_inflight"])
                .inc();
            ApiError::new(
                ErrorKind::Overloaded,
                "too many requests in flight; retry shortly",
            )
        })
    }

    /// The body budget is spent: counted, and the 429 to send.
    pub(crate) fn over_body_budget(&self) -> ApiError {
        self.metrics
            .admission_rejections
            .with_label_values(&["body_budget"])
            .inc();
        ApiError::new(
            ErrorKind::Overloaded,
            "request bodies held by the proxy are at its budget (`body_budget_bytes`); retry shortly",
        )
    }

    /// The body did not arrive within `body_read_timeout_secs`: counted, and the 408 to send.
    pub(crate) fn body_timed_out(&self) -> ApiError {
        self.metrics
            .admission_rejections
            .with_label_values(&["body_timeout"])
            .inc();
        body_timeout(Duration::from_secs(self.live().cfg.body_read_timeout_secs))
    }

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
    pub(crate) async fn read_body(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
    ) -> std::result::Result<Bytes, ApiError> {
        let limit = self.live().cfg.max_body_bytes;
        let timeout = Duration::from_secs(self.live().cfg.body_read_timeout_secs);
        let deadline = tokio::time::Instant::now() + timeout;
        // Pingora's per-read timeout, shortened to the deadline while the body is read.
        let read_timeout = session.get_read_timeout();
        let over_budget = || self.over_body_budget();
        let timed_out = || self.body_timed_out();
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
        let too_large = || body_too_large(limit);
        // Framed as Pingora frames it: it refuses (400) a request whose last transfer coding
        // is not `chunked`, so any `Transfer-Encoding` left means a chunked body, whatever an
        // earlier header line says (reading only the first line, as before, took
        // `identity` + `chunked` for a Content-Length body and failed it with a 500).
        let chunked = session
            .req_header()
            .headers
            .contains_key(header::TRANSFER_ENCODING);
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
            if !permit.reserve(&mut buf, need, ceiling) {
                return Err(over_budget());
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
                Err(_) => return Err(self.body_timed_out()),
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
        let limit = self.live().cfg.max_body_bytes;
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
    pub(crate) fn check_tail(
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
            return Err(self.body_timed_out());
        }
        let left = t.deadline.saturating_duration_since(now);
        session.set_read_timeout(Some(left.max(Duration::from_millis(1))));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::JsonEnd;

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
