//! Local answers: `/health`, `/ready`, `/metrics`, `/v1/models` and `/v1/models/{id}`, served by
//! the proxy itself on its API listener, and the operators' endpoints (`/metrics`, `/health`,
//! `/ready`) on a plain-HTTP listener of their own: `[admin] listen`, and the picker's
//! `picker.metrics_listen`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use http_body_util::Full;
use pingora::prelude::*;
use pingora::proxy::Session;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;

use kvmesh_filters::error::{ApiError, ErrorKind};
use kvmesh_filters::residency::ResidencyIndex;

use crate::body::Limits;
use crate::dashboard;
use crate::fleet::Fleet;
use crate::metrics::Metrics;
use crate::service::{respond, Ctx, Gateway, Live};
use arc_swap::ArcSwap;

/// Most concurrent connections to an operators' listener; past it, new ones are closed.
const MAX_ADMIN_CONNECTIONS: usize = 64;

/// What the operators' endpoints read: shared with the gateway, so either listener sees the
/// same numbers.
#[derive(Clone)]
pub struct Observed {
    fleet: Arc<Fleet>,
    index: Arc<ResidencyIndex>,
    metrics: Arc<Metrics>,
    limits: Arc<Limits>,
    live: Arc<ArcSwap<Live>>,
    gossip: Option<Arc<kvmesh_cluster::GossipStats>>,
}

/// One answer of an operators' endpoint.
pub struct OperatorAnswer {
    /// HTTP status.
    pub status: u16,
    /// Its `Content-Type`.
    pub content_type: &'static str,
    /// The body.
    pub body: Bytes,
    /// More headers.
    pub headers: &'static [(&'static str, &'static str)],
}

/// The operators' paths besides `/health`: `/ready`, `/metrics` and the dashboard's (served
/// on the admin listener, and on the API listener unless `admin.on_api_listener` is off).
fn is_operator_path(path: &str) -> bool {
    matches!(path, "/ready" | "/metrics") || dashboard::is_dashboard_path(path)
}

impl OperatorAnswer {
    /// A plain-text answer.
    fn plain(status: u16, body: &'static [u8]) -> Self {
        OperatorAnswer {
            status,
            content_type: "text/plain",
            body: Bytes::from_static(body),
            headers: &[],
        }
    }
}

/// Headers of the dashboard's page and assets.
const DASHBOARD_HEADERS: &[(&str, &str)] = &[
    ("content-security-policy", dashboard::CSP),
    ("x-content-type-options", "nosniff"),
    ("cache-control", "no-store"),
    ("referrer-policy", "no-referrer"),
];

impl Observed {
    /// The Prometheus text exposition of every metric, gauges refreshed.
    pub fn metrics_text(&self) -> Bytes {
        self.metrics
            .inflight_requests
            .set(self.limits.inflight() as i64);
        self.metrics.body_bytes.set(self.limits.body_bytes() as i64);
        self.metrics
            .ext_proc_message_bytes
            .set(i64::try_from(self.limits.messages.used()).unwrap_or(i64::MAX));
        Bytes::from(self.metrics.render(&self.fleet, &self.index))
    }

    /// Whether an engine is healthy (`/ready`).
    pub fn ready(&self) -> bool {
        self.fleet.ready()
    }

    /// The dashboard's status document (`GET /dashboard/status`); without `full`, the
    /// refusals' client addresses and request ids are left out (the API listener: whoever
    /// reaches the clients' port).
    pub fn status(&self, full: bool) -> dashboard::Status {
        let live = self.live.load();
        let m = &self.metrics;
        let (ttft, per_engine) = m.recent.ttft();
        let (prompt, cached) = (m.prompt_tokens.get(), m.cached_tokens.get());
        let engines = self
            .fleet
            .engines()
            .iter()
            .map(|e| {
                let (answers, ttft_ms) = per_engine
                    .get(e.name.as_str())
                    .map(|(n, p)| (*n, p.clone()))
                    .unwrap_or_default();
                dashboard::EngineStatus {
                    name: e.name.clone(),
                    url: e.url.clone(),
                    kind: if e.peer.is_some() { "peer" } else { "local" },
                    healthy: e.healthy(),
                    inflight: e.inflight(),
                    pending_prefill_bytes: e.pending_prefill(),
                    residency_digests: self.index.node_usage(e.id).0,
                    models: e.models().map(|m| m.to_vec()).unwrap_or_default(),
                    answers_last_minute: answers,
                    ttft_ms,
                }
            })
            .collect();
        let reloads = |o: &str| m.config_reloads.with_label_values(&[o]).get();
        dashboard::Status {
            node: dashboard::NodeStatus {
                node_id: if live.cfg.cluster.enabled {
                    live.cfg.node_id()
                } else {
                    String::new()
                },
                mode: format!("{:?}", live.cfg.mode).to_lowercase(),
                policy: live.router.policy().label(),
                version: crate::VERSION,
                uptime_secs: m.recent.uptime_secs(),
            },
            requests: dashboard::RequestStatus {
                per_sec: m.recent.per_sec(),
                inflight: self.limits.inflight(),
                max_inflight: live.cfg.max_inflight,
            },
            hit_ratio: m.hit_ratio_now(),
            prompt_tokens: prompt,
            cached_tokens: cached,
            ttft_ms: ttft,
            residency: dashboard::ResidencyStatus {
                digests: self.index.len(),
                entries: self
                    .index
                    .count_by_source()
                    .into_iter()
                    .map(|(s, n)| (s.label(), n))
                    .collect(),
            },
            gossip: dashboard::GossipStatus {
                enabled: live.cfg.cluster.enabled,
                peers: m.gossip_peers.get(),
                bytes_sent: self.gossip.as_ref().map_or(0, |g| g.bytes_sent()),
                bytes_received: self.gossip.as_ref().map_or(0, |g| g.bytes_received()),
            },
            engines,
            refusals: m
                .recent
                .refusals()
                .into_iter()
                .map(|mut r| {
                    if !full {
                        r.client.clear();
                        r.request_id.clear();
                    }
                    r
                })
                .collect(),
            config: dashboard::ConfigStatus {
                reloads_applied: reloads("applied"),
                reloads_refused: reloads("refused"),
                last_reload_successful: m.config_last_reload_successful.get() == 1,
                restart_pending_keys: m.config_restart_pending.get(),
            },
        }
    }

    /// The answer to `GET path` when `path` is an operators' endpoint: `/health`, `/ready`,
    /// `/metrics` and the dashboard's. `admin_port`: asked on an operators' listener (the
    /// dashboard's status then names clients).
    pub fn operator_get(&self, path: &str, admin_port: bool) -> Option<OperatorAnswer> {
        let plain = OperatorAnswer::plain;
        let page = |content_type, body: &'static str| OperatorAnswer {
            status: 200,
            content_type,
            body: Bytes::from_static(body.as_bytes()),
            headers: DASHBOARD_HEADERS,
        };
        Some(match path {
            "/health" => plain(200, b"ok\n"),
            "/ready" if self.ready() => plain(200, b"ready\n"),
            "/ready" => plain(503, b"no healthy engine\n"),
            "/metrics" => OperatorAnswer {
                status: 200,
                content_type: "text/plain; version=0.0.4",
                body: self.metrics_text(),
                headers: &[],
            },
            "/dashboard" | "/dashboard/" => page("text/html; charset=utf-8", dashboard::PAGE),
            "/dashboard/app.js" => page("text/javascript; charset=utf-8", dashboard::SCRIPT),
            "/dashboard/app.css" => page("text/css; charset=utf-8", dashboard::STYLE),
            "/dashboard/status" => OperatorAnswer {
                status: 200,
                content_type: "application/json",
                body: self.metrics.recent.status_cached(admin_port, || {
                    Bytes::from(serde_json::to_vec(&self.status(admin_port)).unwrap_or_default())
                }),
                headers: DASHBOARD_HEADERS,
            },
            p if dashboard::is_dashboard_path(p) => plain(404, b"not found\n"),
            _ => return None,
        })
    }

    fn answer<B>(&self, req: &hyper::Request<B>) -> hyper::Response<Full<Bytes>> {
        // HEAD answers as GET does; hyper leaves the body out.
        let read = matches!(*req.method(), hyper::Method::GET | hyper::Method::HEAD);
        let path = req.uri().path();
        let a = if read {
            self.operator_get(path, true)
        } else {
            // Known paths only, without building their answers.
            (path == "/health" || is_operator_path(path)).then_some(OperatorAnswer {
                headers: &[("allow", ApiError::READ_ONLY)],
                ..OperatorAnswer::plain(405, b"method not allowed: GET or HEAD only\n")
            })
        }
        .unwrap_or(OperatorAnswer::plain(404, b"not found\n"));
        let mut resp = hyper::Response::new(Full::new(a.body));
        *resp.status_mut() = hyper::StatusCode::from_u16(a.status).unwrap_or_default();
        let headers = [("content-type", a.content_type)]
            .into_iter()
            .chain(a.headers.iter().copied());
        for (k, v) in headers {
            if let Ok(v) = hyper::header::HeaderValue::from_str(v) {
                resp.headers_mut().insert(k, v);
            }
        }
        resp
    }
}

/// Serves `/metrics`, `/health` and `/ready` over HTTP/1.1 on `listener` until `shutdown`
/// turns true; at most [`MAX_ADMIN_CONNECTIONS`] at once, each closed after 30 s.
pub async fn serve_observed(
    view: Observed,
    listener: tokio::net::TcpListener,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_ADMIN_CONNECTIONS));
    loop {
        let (stream, _) = tokio::select! {
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!(error = %e, "admin accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = shutdown.changed() => return,
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            // At the cap: close it rather than queue scrapers without bound.
            continue;
        };
        let view = view.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let view = view.clone();
                async move { Ok::<_, Infallible>(view.answer(&req)) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            // Scrapes are small: a connection that lingers is closed.
            let _ = tokio::time::timeout(Duration::from_secs(30), conn).await;
            drop(slot);
        });
    }
}

/// `[admin] listen` as a Pingora background service. The socket is bound before the server
/// starts, so a busy address fails at start, naming the key.
pub struct AdminListener {
    view: Observed,
    listener: parking_lot::Mutex<Option<std::net::TcpListener>>,
}

impl AdminListener {
    /// Binds `addr` (`admin.listen`) for `view`.
    pub fn bind(addr: &str, view: Observed) -> std::io::Result<Self> {
        let listener = std::net::TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        Ok(AdminListener {
            view,
            listener: parking_lot::Mutex::new(Some(listener)),
        })
    }
}

#[async_trait]
impl BackgroundService for AdminListener {
    async fn start(&self, shutdown: ShutdownWatch) {
        let Some(std) = self.listener.lock().take() else {
            return;
        };
        match tokio::net::TcpListener::from_std(std) {
            Ok(l) => serve_observed(self.view.clone(), l, shutdown).await,
            Err(e) => tracing::error!(error = %e, "admin listener cannot start"),
        }
    }
}

/// An OpenAI model object.
fn model_object(id: &str) -> serde_json::Value {
    serde_json::json!({"id": id, "object": "model", "created": 0, "owned_by": "kvmesh"})
}

impl Gateway {
    /// What the operators' endpoints read.
    pub fn observed(&self) -> Observed {
        Observed {
            fleet: self.fleet.clone(),
            index: self.index.clone(),
            metrics: self.metrics.clone(),
            limits: self.limits.clone(),
            live: self.live_handle(),
            gossip: self.gossip.clone(),
        }
    }

    /// The Prometheus text exposition of every metric, gauges refreshed.
    pub fn metrics_text(&self) -> Bytes {
        self.observed().metrics_text()
    }

    /// The OpenAI `/v1/models` list: every model a healthy engine serves, once.
    pub fn models_json(&self) -> Bytes {
        self.models_json_for(|_| true)
    }

    /// The `/v1/models` list restricted to the models `allowed` admits (an API key's).
    pub fn models_json_for(&self, allowed: impl Fn(&str) -> bool) -> Bytes {
        let data: Vec<serde_json::Value> = self
            .model_ids(allowed)
            .iter()
            .map(|id| model_object(id))
            .collect();
        Bytes::from(
            serde_json::to_vec(&serde_json::json!({"object": "list", "data": data}))
                .unwrap_or_default(),
        )
    }

    /// Every model a healthy engine serves that `allowed` admits, once, in fleet order.
    fn model_ids(&self, allowed: impl Fn(&str) -> bool) -> Vec<String> {
        let mut ids: Vec<String> = Vec::new();
        for e in self.fleet.engines().iter().filter(|e| e.healthy()) {
            for m in e.models().iter().flat_map(|m| m.iter()) {
                if allowed(m) && !ids.contains(m) {
                    ids.push(m.clone());
                }
            }
        }
        ids
    }

    /// The models the request's API key may use (all, without `[auth]`); `None` once a
    /// refusal has been sent.
    async fn local_key(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
    ) -> Result<Option<Box<dyn Fn(&str) -> bool + Send>>> {
        let Some(auth) = self.auth.as_ref() else {
            return Ok(Some(Box::new(|_| true)));
        };
        let header = session
            .req_header()
            .headers
            .get(http::header::AUTHORIZATION)
            .map(|v| v.as_bytes());
        match auth.authenticate(header) {
            Ok(p) => Ok(Some(Box::new(move |m| p.allows(m)))),
            Err(e) => {
                self.refuse_local(session, ctx, e).await?;
                Ok(None)
            }
        }
    }

    /// Local endpoints; `true` when answered.
    pub(crate) async fn local(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
        path: &str,
    ) -> Result<bool> {
        // HEAD answers as GET does; pingora leaves the body out.
        let get = matches!(
            session.req_header().method,
            http::Method::GET | http::Method::HEAD
        );
        let model_id = path.strip_prefix("/v1/models/");
        // `/health` stays: peers admit a node by `GET {proxy_url}/health` on this listener.
        let operators = is_operator_path(path);
        if operators && !self.live().cfg.admin.on_api_listener {
            ctx.route = "admin";
            let e = ApiError::new(
                ErrorKind::NotFound,
                format!("{path} is served on the admin listener, not here"),
            );
            return self.refuse_local(session, ctx, e).await;
        }
        if let Some(a) = get
            .then(|| self.observed().operator_get(path, false))
            .flatten()
        {
            ctx.route = "admin";
            ctx.status = a.status;
            let mut headers = vec![(crate::access::REQUEST_ID, ctx.request_id.as_str())];
            headers.extend_from_slice(a.headers);
            respond(session, a.status, a.content_type, a.body, &headers).await?;
            return Ok(true);
        }
        let models = path == "/v1/models" || model_id.is_some();
        if !get && (models || operators || path == "/health") {
            ctx.route = if models { "models" } else { "admin" };
            let e = ApiError::method_not_allowed(path, ApiError::READ_ONLY);
            return self.refuse_local(session, ctx, e).await;
        }
        let answer = match (get, path) {
            (true, "/v1/models") => {
                ctx.route = "models";
                let Some(allowed) = self.local_key(session, ctx).await? else {
                    return Ok(true);
                };
                (200, "application/json", self.models_json_for(allowed))
            }
            (true, _) if model_id.is_some() => {
                ctx.route = "models";
                let Some(allowed) = self.local_key(session, ctx).await? else {
                    return Ok(true);
                };
                // Clients percent-encode ids (`org%2Fmodel`); one that does not decode to
                // UTF-8 names no model.
                let raw = model_id.unwrap_or_default();
                let id = percent_encoding::percent_decode_str(raw)
                    .decode_utf8()
                    .unwrap_or_default();
                let id = id.as_ref();
                // A model the key may not use is as absent as one no engine serves.
                if !self.model_ids(allowed).iter().any(|m| m == id) {
                    let e = ApiError::new(
                        ErrorKind::ModelNotFound,
                        format!("the model `{id}` is not served here (GET /v1/models lists those that are)"),
                    )
                    .with_param("model");
                    return self.refuse_local(session, ctx, e).await;
                }
                let body = serde_json::to_vec(&model_object(id)).unwrap_or_default();
                (200, "application/json", Bytes::from(body))
            }
            _ => return Ok(false),
        };

        ctx.status = answer.0;
        let id = [(crate::access::REQUEST_ID, ctx.request_id.as_str())];
        respond(session, answer.0, answer.1, answer.2, &id).await?;
        Ok(true)
    }
}
