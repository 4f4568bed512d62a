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
use crate::fleet::Fleet;
use crate::metrics::Metrics;
use crate::service::{respond, Ctx, Gateway};

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
}

impl Observed {
    /// The Prometheus text exposition of every metric, gauges refreshed.
    pub fn metrics_text(&self) -> Bytes {
        self.metrics
            .inflight_requests
            .set(self.limits.inflight() as i64);
        self.metrics.body_bytes.set(self.limits.body_bytes() as i64);
        Bytes::from(self.metrics.render(&self.fleet, &self.index))
    }

    /// Whether an engine is healthy (`/ready`).
    pub fn ready(&self) -> bool {
        self.fleet.ready()
    }

    fn answer<B>(&self, req: &hyper::Request<B>) -> hyper::Response<Full<Bytes>> {
        let (status, ctype, body) = match (req.method() == hyper::Method::GET, req.uri().path()) {
            (true, "/health") => (200, "text/plain", Bytes::from_static(b"ok\n")),
            (true, "/ready") if self.ready() => (200, "text/plain", Bytes::from_static(b"ready\n")),
            (true, "/ready") => (
                503,
                "text/plain",
                Bytes::from_static(b"no healthy engine\n"),
            ),
            (true, "/metrics") => (200, "text/plain; version=0.0.4", self.metrics_text()),
            _ => (404, "text/plain", Bytes::from_static(b"not found\n")),
        };
        let mut resp = hyper::Response::new(Full::new(body));
        *resp.status_mut() = hyper::StatusCode::from_u16(status).unwrap_or_default();
        if let Ok(v) = hyper::header::HeaderValue::from_str(ctype) {
            resp.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
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
        let get = session.req_header().method == http::Method::GET;
        let model_id = path.strip_prefix("/v1/models/");
        // `/health` stays: peers admit a node by `GET {proxy_url}/health` on this listener.
        let operators = matches!(path, "/ready" | "/metrics");
        if operators && !self.live().cfg.admin.on_api_listener {
            ctx.route = "admin";
            let e = ApiError::new(
                ErrorKind::NotFound,
                format!("{path} is served on the admin listener, not here"),
            );
            return self.refuse_local(session, ctx, e).await;
        }
        let answer = match (get, path) {
            (true, "/health") => {
                ctx.route = "admin";
                (200, "text/plain", Bytes::from_static(b"ok\n"))
            }
            (true, "/ready") => {
                ctx.route = "admin";
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
            (true, "/metrics") => {
                ctx.route = "admin";
                (200, "text/plain; version=0.0.4", self.metrics_text())
            }
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
