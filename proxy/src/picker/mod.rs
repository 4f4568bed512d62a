//! Picker mode: kvmesh as an Envoy ext_proc endpoint picker, following the Gateway API
//! Inference Extension's endpoint-picker protocol (GIE v1.0.0,
//! `docs/proposals/004-endpoint-picker-protocol`).
//!
//! Envoy carries the traffic and calls `envoy.service.ext_proc.v3.ExternalProcessor/Process`
//! once per request, with `FULL_DUPLEX_STREAMED` bodies. The picker buffers the request body,
//! ranks the engines with the gateway's own decision ([`Gateway::rank`]: the same digest chain,
//! residency index, policy and metrics), and answers the request headers with the chosen
//! `ip:port` in the `x-gateway-destination-endpoint` header (always overwritten) and in the
//! `envoy.lb` dynamic metadata (the choice, then fallbacks), then streams the body back. It
//! reads each response's `usage` on the way back to settle the residency prediction, and
//! counts each engine's requests in flight from the choice to the end of the response.
//!
//! Three listeners: ext_proc (gRPC, [`PickerConfig::listen`]), gRPC health
//! ([`PickerConfig::health_listen`]: `liveness`, `readiness` and the ext_proc service name) and
//! HTTP `/metrics`, `/health`, `/ready` ([`PickerConfig::metrics_listen`]).

pub mod envoy;
mod exchange;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tonic_health::ServingStatus;

use crate::config::PickerConfig;
use crate::service::Gateway;
use exchange::{Exchange, Step};

/// The gRPC service name Envoy's health check and the GIE protocol use for the picker.
pub const EXT_PROC_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";
/// Replies queued per stream before the stream waits for Envoy to take them (body chunks of
/// at most 64 KiB: what a stream whose peer stopped reading may leave held).
const REPLY_QUEUE: usize = 16;
/// Most gRPC streams open at once on one health-check connection.
const HEALTH_STREAMS: u32 = 64;
/// How often the `readiness` health status is brought up to date.
const READINESS_POLL: Duration = Duration::from_millis(50);

/// Errors starting the picker.
#[derive(Debug, thiserror::Error)]
pub enum PickerError {
    /// A listener address could not be bound.
    #[error("cannot listen on {addr} (`{key}`): {source}")]
    Bind {
        /// The config key.
        key: &'static str,
        /// The address.
        addr: String,
        /// Why.
        source: std::io::Error,
    },
    /// A gRPC server failed.
    #[error("gRPC server on {0} failed: {1}")]
    Serve(SocketAddr, tonic::transport::Error),
    /// The `[tls]` files do not make a server configuration.
    #[error("`[tls]`: {0}")]
    Tls(String),
}

/// The ext_proc service.
struct Picker {
    gw: Arc<Gateway>,
    fallbacks: usize,
    /// Streams open at once, over all connections ([`max_streams`]).
    streams: Arc<tokio::sync::Semaphore>,
}

/// Most ext_proc streams open at once, over all connections: twice `max_inflight` (streams
/// past admission are answered 429 by the picker itself, at a message each) and 256 more.
/// One connection's HTTP/2 limit does not bound how many connections a peer opens.
fn max_streams(max_inflight: usize) -> usize {
    max_inflight
        .saturating_mul(2)
        .saturating_add(256)
        .min(tokio::sync::Semaphore::MAX_PERMITS)
}

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = Replies;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let Ok(open) = self.streams.clone().try_acquire_owned() else {
            return Err(Status::resource_exhausted(
                "too many ext_proc streams open at once",
            ));
        };
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(REPLY_QUEUE);
        let exchange = Exchange::new(self.gw.clone(), self.fallbacks);
        let timeouts = Timeouts {
            body: Duration::from_secs(self.gw.live().cfg.body_read_timeout_secs),
            idle: Duration::from_secs(self.gw.live().cfg.upstream.read_timeout_secs),
        };
        let ending = Arc::new(Ending::default());
        let out = Out {
            tx,
            ending: ending.clone(),
        };
        tokio::spawn(run_stream(exchange, inbound, out, timeouts));
        Ok(Response::new(Replies {
            rx: ReceiverStream::new(rx),
            _open: open,
            ending,
            ended: false,
        }))
    }
}

/// A stream's replies, holding its place among [`max_streams`] until the server drops them:
/// a stream whose peer stopped reading keeps its queued replies (HTTP/2 polls them only as
/// its window opens) until the connection goes, so it counts until then.
/// Once the stream gave up on a reply Envoy left untaken, what is still queued is dropped and
/// the stream ends with `DEADLINE_EXCEEDED` as soon as Envoy reads again: not with OK, which
/// would pass a truncated body on as complete. A stream that ended with an error its full
/// queue could not take ends with that error once the queue is drained.
pub struct Replies {
    rx: ReceiverStream<Result<ProcessingResponse, Status>>,
    _open: tokio::sync::OwnedSemaphorePermit,
    ending: Arc<Ending>,
    ended: bool,
}

/// How a stream ends, as its driver ([`run_stream`]) tells its [`Replies`].
#[derive(Default)]
struct Ending {
    /// Envoy left a reply untaken past its timeout: end at once, with `DEADLINE_EXCEEDED`.
    abandoned: AtomicBool,
    /// The error to end with once the queued replies are taken (the queue was full for it).
    last: parking_lot::Mutex<Option<Status>>,
}

impl tokio_stream::Stream for Replies {
    type Item = Result<ProcessingResponse, Status>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        if self.ended {
            return std::task::Poll::Ready(None);
        }
        if self.ending.abandoned.load(Ordering::Relaxed) {
            self.ended = true;
            self.rx.close();
            return std::task::Poll::Ready(Some(Err(Status::deadline_exceeded(
                "Envoy left an ext_proc reply untaken past its timeout",
            ))));
        }
        match std::task::ready!(std::pin::Pin::new(&mut self.rx).poll_next(cx)) {
            Some(reply) => std::task::Poll::Ready(Some(reply)),
            None => {
                self.ended = true;
                std::task::Poll::Ready(self.ending.last.lock().take().map(Err))
            }
        }
    }
}

/// Where a stream's replies go, and how it tells its [`Replies`] the way it ends.
struct Out {
    tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
    ending: Arc<Ending>,
}

/// How long a stream may wait for Envoy.
#[derive(Clone, Copy)]
struct Timeouts {
    /// The whole request body, from its start (`body_read_timeout_secs`).
    body: Duration,
    /// Any other wait for Envoy's next message (`upstream.read_timeout_secs`: an engine's
    /// longest silence): a stream nobody finishes does not hold its slot for ever.
    idle: Duration,
}

impl Timeouts {
    /// How long Envoy may leave a reply untaken (its HTTP/2 window shut: it stopped reading)
    /// before the stream ends: `body` until the response begins (the request's body goes back
    /// to Envoy as fast as it reads it), then `idle`, since the replies then carry the
    /// response as fast as the client reads it.
    fn reply(&self, ex: &Exchange) -> Duration {
        if ex.responding() {
            self.idle
        } else {
            self.body
        }
    }
}

/// The status of a request whose routing failed on its blocking thread (a panic, or the
/// runtime shutting down).
fn routing_failed() -> Status {
    Status::internal("the picker failed routing this request")
}

/// Drives one stream: each message from Envoy through the exchange, its replies back in order.
async fn run_stream(
    mut ex: Exchange,
    mut inbound: Streaming<ProcessingRequest>,
    out: Out,
    timeouts: Timeouts,
) {
    let mut body_deadline: Option<tokio::time::Instant> = None;
    let mut first = true;
    loop {
        let now = tokio::time::Instant::now();
        let buffering = ex.buffering();
        let at = if buffering {
            *body_deadline.get_or_insert_with(|| deadline(now, timeouts.body))
        } else if first {
            // The request headers come first, at once: a stream opened and left silent ends
            // after `body_read_timeout_secs`.
            deadline(now, timeouts.body)
        } else {
            deadline(now, timeouts.idle)
        };
        first = false;
        let next = match tokio::time::timeout_at(at, inbound.message()).await {
            Ok(m) => m,
            Err(_) if buffering => {
                if let Step::Close(replies) = ex.body_timed_out() {
                    send_all(&out, replies, timeouts.reply(&ex)).await;
                }
                break;
            }
            Err(_) => {
                if !ex.done() {
                    tracing::debug!("ext_proc stream idle past its timeout");
                    let status = Status::deadline_exceeded(
                        "no ext_proc message in time (the first within body_read_timeout_secs, \
                         later ones within upstream.read_timeout_secs)",
                    );
                    end_with(&out, status);
                }
                break;
            }
        };
        let msg = match next {
            Ok(Some(m)) => m,
            Ok(None) => break,
            Err(status) => {
                // Envoy resets each stream once the response is through; only an earlier
                // reset is worth a line.
                if !ex.done() {
                    tracing::debug!(%status, "ext_proc stream reset before the response ended");
                }
                // A message refused on its way in (over `picker.max_message_bytes` or
                // `picker.message_budget_bytes`, or unreadable): Envoy learns why and applies
                // its failure mode. (A reset reaches here as the end of the stream.)
                end_with(&out, status);
                break;
            }
        };
        let step = if ex.routes_a_long_body(&msg) {
            // Parsing and tokenizing a long prompt takes milliseconds: on a blocking thread,
            // so that this runtime worker keeps driving the other streams meanwhile.
            let tokens = ex.gateway().tokens.clone();
            let routed = tokens
                .run_off_worker(move || {
                    // A panic fails this request, not the stream's bookkeeping: the exchange
                    // comes back and is finished (logged, counted, its span ended) as any.
                    let step = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        ex.on_message(msg)
                    }))
                    .unwrap_or_else(|_| Err(routing_failed()));
                    (ex, step)
                })
                .await;
            match routed {
                Some((back, step)) => {
                    ex = back;
                    step
                }
                None => {
                    // The blocking task was cancelled (the runtime is shutting down): the
                    // exchange went with it, and its slot and load with it.
                    end_with(&out, routing_failed());
                    return;
                }
            }
        } else {
            ex.on_message(msg)
        };
        match step {
            Ok(Step::Continue(replies)) => {
                if !send_all(&out, replies, timeouts.reply(&ex)).await {
                    break;
                }
            }
            Ok(Step::Close(replies)) => {
                send_all(&out, replies, timeouts.reply(&ex)).await;
                break;
            }
            Err(status) => {
                tracing::warn!(%status, "ext_proc protocol error; ending the stream");
                end_with(&out, status);
                break;
            }
        }
    }
    ex.finish();
}

/// Ends the stream with `status`, without waiting on Envoy (its slot, body and load go back
/// at once): queued after the replies, or, when the queue is full, kept for [`Replies`] to end
/// with once Envoy has taken them.
fn end_with(out: &Out, status: Status) {
    tracing::debug!(%status, "ending the ext_proc stream");
    if let Err(mpsc::error::TrySendError::Full(Err(status))) = out.tx.try_send(Err(status)) {
        *out.ending.last.lock() = Some(status);
    }
}

/// `now + d`, or far ahead when that does not fit.
fn deadline(now: tokio::time::Instant, d: Duration) -> tokio::time::Instant {
    now.checked_add(d)
        .unwrap_or_else(|| now + Duration::from_secs(86_400 * 365))
}

/// Sends `replies` in order; `false` when Envoy has gone, or has left one untaken for `within`
/// (a peer that stops reading must not hold the stream's slot and body for ever: its writes
/// wait on the HTTP/2 window, which only its reads reopen).
async fn send_all(out: &Out, replies: Vec<ProcessingResponse>, within: Duration) -> bool {
    for r in replies {
        if let Err(e) = out.tx.send_timeout(Ok(r), within).await {
            if matches!(e, mpsc::error::SendTimeoutError::Timeout(_)) {
                out.ending.abandoned.store(true, Ordering::Relaxed);
                tracing::debug!("Envoy left an ext_proc reply untaken; ending the stream");
            }
            return false;
        }
    }
    true
}

/// The three bound listeners, bound before anything starts so that a busy address fails
/// clearly.
pub struct Listeners {
    ext_proc: tokio::net::TcpListener,
    health: tokio::net::TcpListener,
    metrics: tokio::net::TcpListener,
}

impl Listeners {
    /// Binds the `[picker]` addresses.
    pub async fn bind(cfg: &PickerConfig) -> Result<Self, PickerError> {
        async fn one(
            key: &'static str,
            addr: &str,
        ) -> Result<tokio::net::TcpListener, PickerError> {
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| PickerError::Bind {
                    key,
                    addr: addr.to_string(),
                    source,
                })
        }
        Ok(Listeners {
            ext_proc: one("picker.listen", &cfg.listen).await?,
            health: one("picker.health_listen", &cfg.health_listen).await?,
            metrics: one("picker.metrics_listen", &cfg.metrics_listen).await?,
        })
    }

    /// The bound ext_proc, health and metrics addresses.
    pub fn addrs(&self) -> [Option<SocketAddr>; 3] {
        [
            self.ext_proc.local_addr().ok(),
            self.health.local_addr().ok(),
            self.metrics.local_addr().ok(),
        ]
    }
}

/// Serves the picker on `listeners`. When `shutdown` turns true, the health services report
/// NOT_SERVING, streams are still accepted for `shutdown.grace_period_secs`, then the listeners
/// close (streams in flight run on; the caller bounds how long).
///
/// With `tls` (the `[tls]` table), the ext_proc and gRPC health ports speak TLS (HTTP/2 by
/// ALPN), verifying client certificates when `tls.client_ca_file` is set; the metrics port
/// stays plaintext HTTP.
pub async fn serve(
    gw: Arc<Gateway>,
    listeners: Listeners,
    shutdown: watch::Receiver<bool>,
    tls: Option<Arc<kvmesh_tls::ServerTls>>,
) -> Result<(), PickerError> {
    let tls = match tls {
        Some(t) => {
            let mut config = t
                .server_config()
                .map_err(|e| PickerError::Tls(e.to_string()))?;
            config.alpn_protocols = vec![b"h2".to_vec()];
            Some(Arc::new(config))
        }
        None => None,
    };
    let (reporter, health_service) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("liveness", ServingStatus::Serving)
        .await;
    let fleet = gw.fleet.clone();
    let mut draining = shutdown.clone();
    let grace = Duration::from_secs(gw.live().cfg.shutdown.grace_period_secs);
    let (stop_tx, stop) = watch::channel(false);
    tokio::spawn(async move {
        // Readiness (and the ext_proc service, which Envoy's health check asks for) follows
        // the engines: serving while at least one is healthy, so that Envoy prefers a picker
        // that can route. Checked often (two loads), published on change.
        let mut tick = tokio::time::interval(READINESS_POLL);
        let mut last = None;
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = draining.wait_for(|s| *s) => break,
            }
            let ready = fleet.ready();
            if last != Some(ready) {
                last = Some(ready);
                let status = if ready {
                    ServingStatus::Serving
                } else {
                    ServingStatus::NotServing
                };
                reporter.set_service_status("readiness", status).await;
                reporter.set_service_status(EXT_PROC_SERVICE, status).await;
            }
        }
        // Shutting down: tell Envoy first, keep serving through the grace period so it can
        // move new streams elsewhere, then stop accepting.
        reporter
            .set_service_status("readiness", ServingStatus::NotServing)
            .await;
        reporter
            .set_service_status(EXT_PROC_SERVICE, ServingStatus::NotServing)
            .await;
        tokio::time::sleep(grace).await;
        let _ = stop_tx.send(true);
    });

    let ext_addr = listeners.ext_proc.local_addr().ok();
    let health_addr = listeners.health.local_addr().ok();
    let max_message = gw.live().cfg.picker.max_message_bytes;
    let picker = kvmesh_grpc::Charged::new(
        ExternalProcessorServer::new(Picker {
            gw: gw.clone(),
            fallbacks: gw.live().cfg.picker.fallbacks,
            streams: Arc::new(tokio::sync::Semaphore::new(max_streams(
                usize::try_from(gw.live().cfg.max_inflight).unwrap_or(usize::MAX),
            ))),
        })
        .max_decoding_message_size(max_message),
        gw.limits.messages.clone(),
        max_message,
    );
    let max_streams =
        u32::try_from(gw.live().cfg.max_inflight.saturating_add(64)).unwrap_or(u32::MAX);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    type Served = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<(), tonic::transport::Error>> + Send>,
    >;
    let serve_on = |router: tonic::transport::server::Router,
                    listener: tokio::net::TcpListener,
                    stop: watch::Receiver<bool>|
     -> Served {
        match tls.as_ref() {
            Some(config) => Box::pin(router.serve_with_incoming_shutdown(
                kvmesh_tls::incoming::accept(listener, config.clone()),
                stopped(stop),
            )),
            None => Box::pin(router.serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
                stopped(stop),
            )),
        }
    };
    let ext_proc = serve_on(
        tonic::transport::Server::builder()
            .max_concurrent_streams(Some(max_streams))
            .http2_keepalive_interval(Some(Duration::from_secs(30)))
            .add_service(picker),
        listeners.ext_proc,
        stop.clone(),
    );
    let health = serve_on(
        // Health checks are one call each; Watch streams stay open, a few per Envoy.
        tonic::transport::Server::builder()
            .max_concurrent_streams(Some(HEALTH_STREAMS))
            .http2_keepalive_interval(Some(Duration::from_secs(30)))
            .add_service(kvmesh_grpc::health(health_service)),
        listeners.health,
        stop.clone(),
    );
    let metrics = crate::admin::serve_observed(gw.observed(), listeners.metrics, stop);
    let unspecified = || SocketAddr::from(([0, 0, 0, 0], 0));
    let (a, b, ()) = tokio::join!(ext_proc, health, metrics);
    a.map_err(|e| PickerError::Serve(ext_addr.unwrap_or_else(unspecified), e))?;
    b.map_err(|e| PickerError::Serve(health_addr.unwrap_or_else(unspecified), e))?;
    Ok(())
}
