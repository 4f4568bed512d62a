//! Local answers: `/health`, `/ready`, `/metrics`, `/v1/models` and `/v1/models/{id}`, served by
//! the proxy itself.

use bytes::Bytes;
use pingora::prelude::*;
use pingora::proxy::Session;

use kvmesh_filters::error::{ApiError, ErrorKind};

use crate::service::{respond, Ctx, Gateway};

/// An OpenAI model object.
fn model_object(id: &str) -> serde_json::Value {
    serde_json::json!({"id": id, "object": "model", "created": 0, "owned_by": "kvmesh"})
}

impl Gateway {
    /// The Prometheus text exposition of every metric, gauges refreshed.
    pub fn metrics_text(&self) -> Bytes {
        self.metrics
            .inflight_requests
            .set(self.limits.inflight() as i64);
        self.metrics.body_bytes.set(self.limits.body_bytes() as i64);
        Bytes::from(self.metrics.render(&self.fleet, &self.index))
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
