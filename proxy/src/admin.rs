//! Local answers: `/health`, `/ready`, `/metrics` and `/v1/models`, served by the proxy itself.

use bytes::Bytes;
use pingora::prelude::*;
use pingora::proxy::Session;

use crate::service::{respond, Ctx, Gateway};

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
        let mut ids: Vec<String> = Vec::new();
        for e in self.fleet.engines().iter().filter(|e| e.healthy()) {
            for m in e.models().iter().flat_map(|m| m.iter()) {
                if allowed(m) && !ids.contains(m) {
                    ids.push(m.clone());
                }
            }
        }
        let data: Vec<serde_json::Value> = ids
            .iter()
            .map(|id| serde_json::json!({"id": id, "object": "model", "created": 0, "owned_by": "kvmesh"}))
            .collect();
        Bytes::from(
            serde_json::to_vec(&serde_json::json!({"object": "list", "data": data}))
                .unwrap_or_default(),
        )
    }

    /// Local endpoints; `true` when answered.
    pub(crate) async fn local(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
        path: &str,
    ) -> Result<bool> {
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
            (true, "/metrics") => (200, "text/plain; version=0.0.4", self.metrics_text()),
            (true, "/v1/models") => match self.auth.as_ref() {
                None => (200, "application/json", self.models_json()),
                Some(auth) => {
                    let header = session
                        .req_header()
                        .headers
                        .get(http::header::AUTHORIZATION)
                        .map(|v| v.as_bytes());
                    match auth.authenticate(header) {
                        Ok(p) => (
                            200,
                            "application/json",
                            self.models_json_for(|m| p.allows(m)),
                        ),
                        Err(e) => {
                            ctx.route = "models";
                            return self.refuse_local(session, ctx, e).await;
                        }
                    }
                }
            },
            _ => return Ok(false),
        };
        ctx.route = match path {
            "/v1/models" => "models",
            _ => "admin",
        };
        ctx.status = answer.0;
        let id = [(crate::access::REQUEST_ID, ctx.request_id.as_str())];
        respond(session, answer.0, answer.1, answer.2, &id).await?;
        Ok(true)
    }
}
