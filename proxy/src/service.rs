//! The request path of the gateway, one Pingora hook per phase, top to bottom:
//!
//! 1. `request_filter`: local endpoints; the hop header's trust; the API key and its in-flight
//!    slot ([`crate::guard`]); admission (a hard cap on requests in flight, taken before the
//!    body is read); read and bound the body (its bytes reserved from a global body budget as
//!    they arrive, the whole read under one deadline); parse it in one streaming pass; the
//!    key's model allow-list and its tenant's cache salt (set in the body); hash the leading
//!    blocks of the canonical prompt into the digest chain; decide; the TTFT deadline and the
//!    model's admission slot (a bounded wait, then a fresh decision). Early
//!    refusals read and discard the rest of the body, bounded, before closing (a lingering
//!    close), so that the client sees the error, not a reset; refusals for overload or a slow
//!    client drain far less.
//! 2. `upstream_peer`: rank the engines once (policy over the residency index and live load;
//!    in sidecar mode, keep the local engine unless a peer saves enough), then take the next
//!    untried engine: the first call, and again after each failover (the model's slot follows
//!    the attempt: none for a peer, one for a local engine); `https://` engines get TLS. A peer's engine is reached
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
//!
//! The hooks call into one module per concern: [`crate::admin`] (local endpoints),
//! [`crate::trust`] (the hop header), [`crate::guard`] (keys, tenants, per-model admission,
//! deadlines), [`crate::body`] (reading, bounding and staging the body,
//! admission and the body budget, the lingering close), [`crate::plan`] (planning and the
//! decision), [`crate::placement`] (the sidecar rule, the cold home) and [`crate::feedback`]
//! (settling `usage` into the residency index).

use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use async_trait::async_trait;
use bytes::Bytes;
use http::header;
use kvmesh_filters::error::{ApiError, ErrorKind};
use kvmesh_filters::request::Endpoint;
use kvmesh_filters::residency::{ResidencyIndex, Source};
use kvmesh_filters::route::{Decision, Router};
use pingora::http::ResponseHeader;
use pingora::prelude::*;
use pingora::proxy::{FailToProxy, ProxyHttp, Session};
use pingora::upstreams::peer::HttpPeer;
use pingora::{Error, ErrorSource, ErrorType};

use crate::admission::{ModelGates, ModelSlot};
use crate::auth::{Auth, KeySlot, Principal};
use crate::body::{linger, Admitted, BodyPermit, Limits, Tail};
use crate::config::{ConfigError, HopTrust, ProxyConfig};
use crate::feedback::UsageScan;
use crate::fleet::{Dispatch, Engine, Fleet};
use crate::metrics::labels as metrics_labels;
use crate::metrics::Metrics;
use crate::otel::{attr, client_attr, millis, span_attributes, Failure, RequestTrace};
use crate::plan::Plan;
use crate::tls::{PeerIdentity, UpstreamTls};
use crate::trust::HOP_HEADER;
use kvmesh_filters::usage::Usage;
use opentelemetry::KeyValue;

/// What a reload replaces ([`crate::reload`]): the configuration in force and the policy made
/// from it, swapped whole. Each use reads the one in force then (a request that spans a reload
/// may see the old knobs in its early phases and the new ones later: each knob stands alone,
/// and those that do not, like `routing.block_bytes`, take a restart).
pub struct Live {
    /// Configuration in force.
    pub cfg: ProxyConfig,
    /// The policy.
    pub router: Arc<Router>,
}

impl Live {
    /// The policy of `cfg`, with `cfg`.
    pub fn new(cfg: ProxyConfig) -> Self {
        Live {
            router: Arc::new(Router::new(cfg.policy, cfg.routing.prefix_params())),
            cfg,
        }
    }

    /// What a reload to `cfg` puts in force: the same router (and its round-robin cursor)
    /// unless the policy or its knobs changed.
    pub fn reloaded(&self, cfg: ProxyConfig) -> Self {
        let same = self.cfg.policy == cfg.policy
            && self.cfg.routing.prefix_params() == cfg.routing.prefix_params();
        if same {
            Live {
                router: self.router.clone(),
                cfg,
            }
        } else {
            Live::new(cfg)
        }
    }
}

/// The gateway: shared state of the proxy.
pub struct Gateway {
    /// Configuration and policy in force (see [`Live`]).
    live: Arc<ArcSwap<Live>>,
    /// The engines.
    pub fleet: Arc<Fleet>,
    /// Prefix residency.
    pub index: Arc<ResidencyIndex>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Hard caps on requests in flight and body bytes held.
    pub limits: Arc<Limits>,
    /// API keys in force (`[auth]`), if any.
    pub auth: Option<Arc<Auth>>,
    /// Per-model caps (`[admission]`).
    pub model_gates: ModelGates,
    /// TLS towards `https://` engines and peers.
    pub upstream_tls: Arc<UpstreamTls>,
    /// The identity peers' certificates must carry (`accept_hop_from = "cluster_cert"`).
    pub peer_identity: Option<PeerIdentity>,
    /// Who gossips with us (with `[cluster]`): `accept_hop_from = "members"` also trusts a
    /// host that sent authenticated gossip lately, before its URL is admitted.
    pub gossip: Option<Arc<kvmesh_cluster::GossipStats>>,
    /// OpenTelemetry traces (`[otel]`), when on.
    pub otel: Option<Arc<crate::otel::Otel>>,
    /// The token-mode models (`[[tokenizers]]`), read at start.
    pub tokens: crate::tokens::TokenModes,
}

impl Gateway {
    /// A gateway over `fleet` and `index` with `cfg`'s policy, limits and keys (read now: an
    /// error names the file or key that cannot be used), reaching `https://` engines and peers
    /// with `upstream_tls`.
    pub fn new(
        cfg: ProxyConfig,
        fleet: Arc<Fleet>,
        index: Arc<ResidencyIndex>,
        metrics: Arc<Metrics>,
        upstream_tls: Arc<UpstreamTls>,
    ) -> std::result::Result<Self, ConfigError> {
        let invalid =
            |what: &str, e: &dyn std::fmt::Display| ConfigError::Invalid(format!("{what}: {e}"));
        let auth = Auth::new(&cfg.auth).map_err(|e| invalid("`[auth]`", &e))?;
        let peer_identity = match cfg.sidecar.accept_hop_from {
            HopTrust::ClusterCert => Some(
                PeerIdentity::parse(&cfg.sidecar.peer_identity)
                    .map_err(|e| invalid("`sidecar.peer_identity`", &e))?,
            ),
            _ => None,
        };
        let tokens = crate::tokens::TokenModes::load(&cfg.tokenizers, cfg.worker_threads())
            .map_err(|e| invalid("`[[tokenizers]]`", &e))?;
        for m in &metrics_labels::REFUSALS {
            metrics.admission_rejections.with_label_values(&[m]);
        }
        for f in crate::tokens::Fallback::ALL {
            metrics.token_mode_fallbacks.with_label_values(&[f.label()]);
        }
        metrics
            .max_inflight
            .set(i64::try_from(cfg.max_inflight).unwrap_or(i64::MAX));
        Ok(Gateway {
            limits: Limits::new(
                cfg.max_inflight,
                cfg.body_budget_bytes,
                cfg.picker.message_budget_bytes,
            ),
            model_gates: ModelGates::new(cfg.admission.clone()),
            auth,
            upstream_tls,
            peer_identity,
            gossip: None,
            otel: None,
            tokens,
            live: Arc::new(ArcSwap::from_pointee(Live::new(cfg))),
            fleet,
            index,
            metrics,
        })
    }
}

impl Gateway {
    /// The configuration and policy in force now.
    pub fn live(&self) -> arc_swap::Guard<Arc<Live>> {
        self.live.load()
    }

    /// Where a reload puts a new [`Live`] (shared with [`crate::reload::Reloader`]).
    pub fn live_handle(&self) -> Arc<ArcSwap<Live>> {
        self.live.clone()
    }
}

/// Per-request state.
pub struct Ctx {
    pub(crate) started: Instant,
    pub(crate) route: &'static str,
    /// For an SSE answer: its engine's inter-chunk histogram, and when the last chunk came.
    itl: Option<(prometheus::Histogram, Instant)>,
    /// The admission slot, held from admission to `logging`.
    admitted: Option<Admitted>,
    /// The caller's key (`[auth]`), and its in-flight slot.
    pub(crate) principal: Option<Arc<Principal>>,
    pub(crate) key_slot: Option<KeySlot>,
    /// The model's admission slot (`[admission]`), held to `logging`.
    pub(crate) model_slot: Option<ModelSlot>,
    body: Option<Bytes>,
    /// The body's reservation, released with the body.
    pub(crate) body_permit: Option<BodyPermit>,
    /// The client asked `Expect: 100-continue` and has not been told to send the body.
    pub(crate) awaiting_continue: bool,
    /// A chunked body whose last chunks Pingora reads (after the JSON document): checked in
    /// `request_body_filter`.
    pub(crate) tail: Option<Tail>,
    body_sent: bool,
    /// The engine chosen while the client's body is still arriving (a chunked body read on by
    /// Pingora): its load is counted only once the body is complete (`request_body_filter`).
    pending_dispatch: Option<(Arc<Engine>, u64)>,
    pub(crate) plan: Option<Plan>,
    pub(crate) decision: Option<(Vec<kvmesh_filters::route::Candidate>, Decision)>,
    attempts: u32,
    /// Ranked engines passed over because they left the fleet (not attempts).
    skipped: u32,
    /// The engine's answer broke off after its first byte.
    cut: bool,
    pub(crate) dispatch: Option<Dispatch>,
    /// Forwarded by a peer: only local engines may serve it.
    pub(crate) local_only: bool,
    /// Why the first choice is a peer (sidecar mode), for the forward metrics.
    pub(crate) forward_reason: &'static str,
    pub(crate) predicted_overlap: usize,
    pub(crate) prediction_settled: bool,
    response_started: bool,
    pub(crate) status: u16,
    /// When the current attempt was sent to its engine (its time to first byte is measured
    /// from here, not from the client's request).
    dispatched_at: Option<Instant>,
    /// Where the response's `usage` is looked for (successful responses).
    pub(crate) usage: Option<UsageScan>,
    error: Option<ApiError>,
    /// The request's id: the client's `x-request-id` when usable, else a fresh one; sent to the
    /// engine and echoed to the client.
    pub(crate) request_id: String,
    /// What the access log says of the request.
    access: Access,
    /// Its spans (`[otel]`), from the first hook past the operators' endpoints to `logging`.
    pub(crate) trace: Option<RequestTrace>,
}

/// The access log's facts about one request, gathered along the way.
#[derive(Default)]
struct Access {
    method: String,
    path: String,
    client: String,
    bytes_in: usize,
    bytes_out: u64,
    ttft: Option<Duration>,
    usage: Option<Usage>,
    engine: Option<String>,
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
            itl: None,
            admitted: None,
            principal: None,
            key_slot: None,
            model_slot: None,
            body: None,
            body_permit: None,
            awaiting_continue: false,
            tail: None,
            body_sent: false,
            pending_dispatch: None,
            plan: None,
            decision: None,
            attempts: 0,
            skipped: 0,
            cut: false,
            dispatch: None,
            local_only: false,
            forward_reason: crate::placement::reason::RANK,
            predicted_overlap: 0,
            prediction_settled: false,
            response_started: false,
            status: 0,
            dispatched_at: None,
            usage: None,
            error: None,
            request_id: String::new(),
            access: Access::default(),
            trace: None,
        }
    }
}

fn pingora_error(kind: ErrorKind, message: &str) -> Box<Error> {
    Error::explain(ErrorType::HTTPStatus(kind.status()), message.to_string())
}

/// Writes a complete local response.
pub(crate) async fn respond(
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

impl Gateway {
    /// Answers a local endpoint's refusal (counted under `unauthenticated` when it is a 401).
    pub(crate) async fn refuse_local(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
        e: ApiError,
    ) -> Result<bool> {
        if e.kind == ErrorKind::Unauthorized {
            self.metrics
                .admission_rejections
                .with_label_values(&["unauthenticated"])
                .inc();
        }
        respond_error(session, ctx, e).await
    }
}

async fn respond_error(session: &mut Session, ctx: &mut Ctx, e: ApiError) -> Result<bool> {
    ctx.status = e.status();
    let request_id = ctx.request_id.clone();
    let mut extra: Vec<(&str, &str)> = vec![(crate::access::REQUEST_ID, &request_id)];
    if matches!(e.kind, ErrorKind::Overloaded | ErrorKind::NoEngine) {
        extra.push(("retry-after", "1"));
    }
    if e.kind == ErrorKind::Unauthorized {
        extra.push(("www-authenticate", "Bearer"));
    }
    if let Some(allow) = e.allow {
        extra.push(("allow", allow));
    }
    // The body may be unread: do not reuse this connection.
    session.set_keepalive(None);
    respond(
        session,
        e.status(),
        "application/json",
        Bytes::from(e.to_json()),
        &extra,
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
            | ErrorKind::Unauthorized
    );
    ctx.error = Some(e);
    ctx.body = None;
    ctx.body_permit = None;
    ctx.tail = None;
    linger(session, ctx, short).await;
    Ok(true)
}

impl Gateway {
    fn can_retry(&self, ctx: &Ctx) -> bool {
        let remaining = ctx.decision.as_ref().map_or(0, |(_, d)| {
            d.order
                .len()
                .saturating_sub((ctx.attempts + ctx.skipped) as usize)
        });
        !ctx.response_started
            && ctx.attempts < self.live().cfg.upstream.max_attempts
            && remaining > 0
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
        ctx.request_id = crate::access::request_id(
            session
                .req_header()
                .headers
                .get(crate::access::REQUEST_ID)
                .and_then(|v| v.to_str().ok()),
        );
        ctx.access.method = session.req_header().method.to_string();
        ctx.access.path.clone_from(&path);
        ctx.access.client = session
            .client_addr()
            .and_then(|a| a.as_inet())
            .map_or_else(String::new, |a| a.ip().to_canonical().to_string());
        if self.local(session, ctx, &path).await? {
            return Ok(true);
        }
        let endpoint = Endpoint::from_path(&path);
        if let (Some(otel), Some(_)) = (self.otel.as_ref(), endpoint) {
            let h = &session.req_header().headers;
            let header = |name: &str| h.get(name).and_then(|v| v.to_str().ok());
            let peer = h.contains_key(HOP_HEADER) && self.hop_trusted(session);
            ctx.trace = Some(otel.request(
                header(crate::otel::TRACEPARENT),
                header(crate::otel::TRACESTATE),
                peer,
                vec![
                    attr("http.request.method", ctx.access.method.clone()),
                    client_attr("url.path", &path),
                    attr("kvmesh.request_id", ctx.request_id.clone()),
                    attr("client.address", ctx.access.client.clone()),
                ],
            ));
        }
        ctx.awaiting_continue = session
            .req_header()
            .headers
            .get(header::EXPECT)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.eq_ignore_ascii_case("100-continue"));
        let Some(endpoint) = endpoint else {
            let e = ApiError::new(
                ErrorKind::NotFound,
                format!("no route for {} {path}", session.req_header().method),
            );
            return respond_error(session, ctx, e).await;
        };
        ctx.route = endpoint.label();
        if session.req_header().method != http::Method::POST {
            return respond_error(session, ctx, ApiError::method_not_allowed(&path, "POST")).await;
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
        if let Err(e) = self.authenticate(session, ctx) {
            return respond_error(session, ctx, e).await;
        }
        match self.admit() {
            Ok(a) => ctx.admitted = Some(a),
            Err(e) => return respond_error(session, ctx, e).await,
        }
        let body = match self.read_body(session, ctx).await {
            Ok(b) => b,
            Err(e) => return respond_error(session, ctx, e).await,
        };
        let mut parsed = match self.parse(endpoint, &body) {
            Ok(p) => p,
            Err(e) => return respond_error(session, ctx, e).await,
        };
        ctx.access.bytes_in = body.len();
        let body = match self.apply_tenant(ctx, &mut parsed, body) {
            Ok(b) => b,
            Err(e) => return respond_error(session, ctx, e).await,
        };
        ctx.plan = Some(
            self.plan(session, endpoint, parsed, &body, ctx.local_only)
                .await,
        );
        ctx.body = Some(body);
        if let Err(e) = self.decide(ctx) {
            return respond_error(session, ctx, e).await;
        }
        if let Err(e) = self.check_deadline(session, ctx) {
            return respond_error(session, ctx, e).await;
        }
        // The wait for the model's slot ends when the client goes: its request must not keep
        // a place in the bounded queue, nor take the slot once one frees. Watched only once
        // the body is read to its end: Pingora's probe reads the socket, and a chunked body
        // routed on its first 64 KiB may still have its last chunk there. A client that sends
        // more while it waits (a pipelined request) is cut off, as Pingora does once a request
        // is forwarded.
        let watch = session.is_body_done();
        let entered = {
            let entering = self.enter_model(ctx);
            tokio::pin!(entering);
            tokio::select! {
                biased;
                entered = &mut entering => entered,
                // Returning drops the wait, and with it the request's place in the queue.
                gone = session.read_body_or_idle(true), if watch => {
                    let e = match gone {
                        Err(e) => e,
                        Ok(_) => Error::explain(ErrorType::ConnectionClosed, "the client left"),
                    };
                    // `fail_to_proxy` logs it as 499 and closes the connection.
                    return Err(e.into_down());
                }
            }
        };
        if let Err(e) = entered {
            return respond_error(session, ctx, e).await;
        }
        // Again after a wait for the model's slot (the engine may have changed, time passed).
        if let Err(e) = self.check_deadline(session, ctx) {
            return respond_error(session, ctx, e).await;
        }
        Ok(false)
    }

    async fn upstream_peer(&self, _session: &mut Session, ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
        // An engine a reload or a peer's departure removed since the ranking is skipped, also
        // when it goes while this request waits for its model's slot.
        let (cand, engine) = loop {
            let Some((cands, decision)) = ctx.decision.as_ref() else {
                return Err(pingora_error(ErrorKind::Internal, "no routing decision"));
            };
            // Engines before `tried` in the order were attempted already. Take the next one
            // that is still healthy (or simply the next still known, if none is).
            let tried = (ctx.attempts + ctx.skipped) as usize;
            let rest = decision.order.get(tried..).unwrap_or(&[]);
            let next = |healthy: bool| {
                rest.iter().enumerate().find_map(|(pick, &i)| {
                    self.fleet
                        .get(cands[i].node)
                        .filter(|e| !healthy || e.healthy())
                        .map(|e| (pick, cands[i], e))
                })
            };
            let Some((pick, cand, engine)) = next(true).or_else(|| next(false)) else {
                ctx.error = Some(ApiError::new(
                    ErrorKind::NoEngine,
                    "no engine could be reached",
                ));
                return Err(pingora_error(
                    ErrorKind::NoEngine,
                    "all ranked engines tried",
                ));
            };
            // Move the chosen engine to position `tried`, keeping the skipped ones for a
            // failover.
            if let Some((_, d)) = ctx.decision.as_mut() {
                d.order[tried..=tried + pick].rotate_right(1);
            }
            ctx.attempts += 1;
            ctx.body_sent = false;
            if let Some(t) = ctx.tail.as_mut() {
                // A failover replays what was read of the tail.
                t.seen = 0;
            }
            // The model's slot follows the attempt: released when it goes to a peer (whose caps
            // apply), taken (waiting if need be) when it falls to a local engine.
            if engine.via_peer() {
                ctx.model_slot = None;
            } else if ctx.model_slot.is_none() {
                if let Err(e) = self.take_model_slot(ctx).await {
                    let err = pingora_error(e.kind, &e.message);
                    ctx.error = Some(e);
                    return Err(err);
                }
            }
            if self.fleet.get(engine.id).is_some() {
                break (cand, engine);
            }
            // It left while this request waited: not an attempt.
            ctx.attempts -= 1;
            ctx.skipped += 1;
        };
        if let Some(peer) = engine.peer.as_ref().filter(|p| p.via_peer) {
            let reason = if ctx.attempts > 1 {
                crate::placement::reason::FAILOVER
            } else {
                ctx.forward_reason
            };
            self.metrics
                .forwards
                .with_label_values(&[&peer.node_id, reason])
                .inc();
        }
        ctx.access.engine = Some(engine.name.clone());
        if let Some(t) = ctx.trace.as_mut() {
            let mut a = vec![
                attr("kvmesh.engine", engine.name.clone()),
                attr("server.address", engine.addr().to_string()),
                KeyValue::new("kvmesh.attempt", i64::from(ctx.attempts)),
                KeyValue::new("kvmesh.overlap_blocks", cand.overlap_blocks as i64),
            ];
            if let Some(peer) = engine.peer.as_ref().filter(|p| p.via_peer) {
                a.push(attr("kvmesh.peer", peer.node_id.clone()));
            }
            t.attempt(a);
        }
        ctx.dispatched_at = Some(Instant::now());
        ctx.predicted_overlap = cand.overlap_blocks;
        ctx.prediction_settled = engine.pending_prefill() == 0;
        let (chain, uncached) = ctx
            .plan
            .as_ref()
            .map(|p| {
                let f = &p.facts;
                (
                    f.chain.as_slice(),
                    f.size.uncached_bytes(cand.overlap_blocks),
                )
            })
            .unwrap_or((&[], 0));
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
        let mut peer = match engine.tls_host.as_ref() {
            Some(host) => {
                let mut p = HttpPeer::new(engine.addr(), true, host.clone());
                p.client_cert_key = self.upstream_tls.client_cert();
                p
            }
            None => HttpPeer::new(engine.addr(), false, String::new()),
        };
        peer.options.connection_timeout = Some(Duration::from_millis(
            self.live().cfg.upstream.connect_timeout_ms,
        ));
        peer.options.read_timeout = Some(Duration::from_secs(
            self.live().cfg.upstream.read_timeout_secs,
        ));
        peer.options.idle_timeout = Some(Duration::from_secs(60));
        // A host that fell off the network never answers a reused connection: the unacked
        // request bytes, or keepalive probes while it idles in the pool, end it instead.
        // Probes every fifth of it, so that no single lost probe reaches the timeout.
        let user_timeout = Duration::from_millis(self.live().cfg.upstream.tcp_user_timeout_ms);
        if !user_timeout.is_zero() {
            let probe = (user_timeout / 5).max(Duration::from_secs(1));
            peer.options.tcp_keepalive = Some(pingora::protocols::TcpKeepalive {
                idle: probe,
                interval: probe,
                count: 5,
                user_timeout,
            });
        }
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
        // With `[auth]` the client's key is kvmesh's: engines never see it (a peer proxy needs
        // it, to authenticate the request again).
        if self.auth.is_some() && !ctx.engine().is_some_and(|e| e.via_peer()) {
            req.remove_header(&header::AUTHORIZATION);
        }
        if ctx.engine().is_some_and(|e| e.via_peer()) {
            req.insert_header(HOP_HEADER, "1")?;
        }
        req.insert_header(crate::access::REQUEST_ID, ctx.request_id.as_str())?;
        // The attempt's context replaces the caller's (whose span is this one's ancestor).
        if let Some(t) = ctx.trace.as_ref() {
            for (name, value) in t.headers() {
                if value.is_empty() {
                    req.remove_header(name);
                } else {
                    req.insert_header(name, value)?;
                }
            }
        }
        if !ctx.access.client.is_empty() {
            let xff = crate::access::forwarded_for(
                req.headers
                    .get(crate::access::FORWARDED_FOR)
                    .and_then(|v| v.to_str().ok()),
                &ctx.access.client,
            );
            req.insert_header(crate::access::FORWARDED_FOR, xff)?;
        }
        // The digests engines get are the proxy's own, never a client's.
        req.remove_header(crate::plan::DIGESTS_HEADER);
        if let Some(plan) = ctx.plan.as_ref() {
            let digests = self.forwarded_digests(&plan.facts);
            if !digests.is_empty() {
                req.insert_header(crate::plan::DIGESTS_HEADER, digests)?;
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
        if let Some(t) = ctx.trace.as_ref() {
            t.event(
                "response_headers",
                vec![KeyValue::new(
                    "http.response.status_code",
                    i64::from(ctx.status),
                )],
            );
        }
        let sse = resp
            .headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|t| t.starts_with("text/event-stream"));
        if let (true, Some(engine), Some(plan)) =
            (sse, ctx.access.engine.as_deref(), ctx.plan.as_ref())
        {
            let h = self.metrics.per_engine.itl(engine, &plan.facts.model);
            ctx.itl = Some((h, Instant::now()));
        }
        if ctx.body_sent {
            // No failover after the first response byte: the body is not needed any more.
            ctx.body = None;
            ctx.body_permit = None;
        }
        if resp.status.is_success() {
            let content_type = resp
                .headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok());
            ctx.usage = Some(UsageScan::for_content_type(content_type));
        }
        resp.insert_header(crate::access::REQUEST_ID, ctx.request_id.as_str())?;
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
            ctx.access.bytes_out += b.len() as u64;
            if let Some((h, last)) = ctx.itl.as_mut() {
                // The first chunk's wait is the TTFT, not a gap between tokens.
                if ctx.access.ttft.is_some() {
                    h.observe(last.elapsed().as_secs_f64());
                }
                *last = Instant::now();
            }
            if ctx.access.ttft.is_none() {
                let ttft = ctx.started.elapsed();
                ctx.access.ttft = Some(ttft);
                self.metrics
                    .ttft
                    .with_label_values(&[ctx.route])
                    .observe(ttft.as_secs_f64());
                if let (Some(t), Some(at)) = (ctx.trace.as_ref(), ctx.dispatched_at) {
                    t.event(
                        "first_byte",
                        vec![KeyValue::new("kvmesh.ttfb_ms", millis(at.elapsed()))],
                    );
                }
                if let Some(d) = ctx.dispatch.as_mut() {
                    d.prefill_done();
                    // Only answers feed the estimate: an overloaded engine's fast errors must
                    // not make it look fast.
                    if (200..300).contains(&ctx.status) {
                        if let Some(at) = ctx.dispatched_at {
                            d.engine().observe_ttft(at.elapsed());
                        }
                    }
                }
            }
            if let Some(u) = ctx.usage.as_mut() {
                u.feed(b);
            }
        }
        if end_of_stream {
            ctx.access.usage = self.settle_usage(ctx);
            ctx.usage = None;
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
        if let Some(t) = ctx.trace.as_mut() {
            t.attempt_failed(&format!("cannot connect: {e}"));
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
        if let Some(t) = ctx.trace.as_mut() {
            t.attempt_failed(&e.to_string());
        }
        // Replayable: Pingora still holds the body's tail, or has not read its end yet.
        let replayable = session.as_ref().get_retry_buffer().is_some() || !session.is_body_done();
        // An engine that timed out reading may be computing the answer still: sending the
        // request elsewhere would compute it twice (the client gets the 504).
        let timed_out = e.etype() == &ErrorType::ReadTimedout;
        if e.esource() == &ErrorSource::Upstream && replayable && !timed_out && self.can_retry(ctx)
        {
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
                (ErrorSource::Upstream, ErrorType::ReadTimedout) => ApiError::new(
                    ErrorKind::UpstreamTimeout,
                    format!(
                        "the engine sent nothing for {} s (`upstream.read_timeout_secs`) {}",
                        self.live().cfg.upstream.read_timeout_secs,
                        e.context
                            .as_ref()
                            .map_or_else(String::new, |c| c.as_str().to_string())
                    ),
                ),
                (ErrorSource::Upstream, _) => {
                    ApiError::new(ErrorKind::UpstreamFailed, format!("engine failed: {e}"))
                }
                (ErrorSource::Downstream, ErrorType::ReadTimedout) => {
                    // Pingora's per-read timeout, shortened to the body deadline.
                    self.body_timed_out()
                }
                (ErrorSource::Downstream, _) => {
                    ApiError::new(ErrorKind::InvalidRequest, format!("client error: {e}"))
                }
                _ => ApiError::new(ErrorKind::Internal, format!("internal error: {e}")),
            });
        // Once the answer has started, any client-side failure means the client is gone.
        let downstream_gone = e.esource() == &ErrorSource::Downstream
            && (session.response_written().is_some()
                || matches!(
                    e.etype(),
                    ErrorType::WriteError | ErrorType::ReadError | ErrorType::ConnectionClosed
                ));
        let code = if downstream_gone || session.response_written().is_some() {
            0
        } else {
            let status = api.status();
            let _ = respond_error(session, ctx, api).await;
            status
        };
        if downstream_gone {
            // The client went away (mid-stream too): what it got is not the engine's status.
            ctx.status = 499;
        } else if code == 0 {
            if ctx.status == 0 {
                ctx.status = 499;
            }
            // The engine's answer was cut after its first byte: the client has its status
            // line, but not the answer.
            ctx.cut = true;
        }
        FailToProxy {
            error_code: code,
            can_reuse_downstream: false,
        }
    }

    async fn logging(&self, session: &mut Session, _e: Option<&Error>, ctx: &mut Ctx) {
        let code = if ctx.status != 0 {
            ctx.status
        } else {
            session.response_written().map_or(0, |r| r.status.as_u16())
        };
        let status = code.to_string();
        self.metrics
            .requests
            .with_label_values(&[ctx.route, &status])
            .inc();
        self.metrics
            .latency
            .with_label_values(&[ctx.route])
            .observe(ctx.started.elapsed().as_secs_f64());
        let a = &ctx.access;
        if let (Some(engine), Some(plan)) = (a.engine.as_deref(), ctx.plan.as_ref()) {
            self.metrics.per_engine.served(
                engine,
                &plan.facts.model,
                if ctx.cut { 0 } else { code },
                a.ttft,
            );
        }
        let line = crate::access::Line {
            request_id: &ctx.request_id,
            method: &a.method,
            path: &a.path,
            model: ctx.plan.as_ref().map_or("", |p| p.facts.model.as_str()),
            status: code,
            engine: a.engine.as_deref().unwrap_or(""),
            reason: ctx.decision.as_ref().map_or("", |(_, d)| d.reason.label()),
            overlap_blocks: ctx.predicted_overlap,
            cached_tokens: a.usage.and_then(|u| u.cached_tokens),
            completion_tokens: a.usage.and_then(|u| u.completion_tokens),
            ttft: a.ttft,
            duration: ctx.started.elapsed(),
            bytes_in: a.bytes_in,
            bytes_out: a.bytes_out,
            client: &a.client,
            key: ctx.principal.as_ref().map_or("", |p| p.name.as_str()),
        };
        crate::access::log(&line);
        if let Some(t) = ctx.trace.take() {
            let refusal = ctx.error.as_ref().map(|e| e.message.as_str());
            let failure = Failure::of(code, refusal, ctx.cut);
            t.finish(span_attributes(&line, ctx.local_only), failure);
        }
        // The operators' own requests (probes, scrapes, the dashboard's polls) are not traffic.
        if ctx.route != "admin" {
            self.metrics.recent.finished(&line, ctx.error.as_ref());
        }
        // Release the engine's load counts now rather than when Pingora drops the context.
        ctx.dispatch = None;
        ctx.pending_dispatch = None;
        ctx.body = None;
        ctx.body_permit = None;
        ctx.admitted = None;
        ctx.model_slot = None;
        ctx.key_slot = None;
    }
}
