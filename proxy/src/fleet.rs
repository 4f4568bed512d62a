//! The engines behind the proxy: their load, health and models, and the RAII guard that keeps
//! load counts honest whatever happens to a request.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvmesh_filters::route::Candidate;
use kvmesh_filters::NodeId;

use crate::config::EngineAddr;

/// One engine and its live state.
pub struct Engine {
    /// Index in the fleet; also its [`NodeId`] in the residency index.
    pub id: NodeId,
    /// Configured name.
    pub name: String,
    /// Configured URL.
    pub url: String,
    /// Resolved address.
    pub addr: SocketAddr,
    /// A stable key for session hashing (from the name).
    pub key: u64,
    inflight: AtomicU64,
    pending_prefill: AtomicU64,
    healthy: AtomicBool,
    static_models: bool,
    models: ArcSwap<Vec<String>>,
    models_known: AtomicBool,
}

impl Engine {
    /// Requests in flight on this engine.
    pub fn inflight(&self) -> u64 {
        self.inflight.load(Ordering::Relaxed)
    }

    /// Uncached prompt bytes dispatched here whose first response byte has not come back yet.
    pub fn pending_prefill(&self) -> u64 {
        self.pending_prefill.load(Ordering::Relaxed)
    }

    /// Whether the last health probe (or request) succeeded.
    pub fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Marks the engine down until the next successful probe (a connection to it failed).
    pub fn mark_down(&self) {
        self.healthy.store(false, Ordering::Relaxed);
    }

    /// The models it serves, if known.
    pub fn models(&self) -> Option<Arc<Vec<String>>> {
        self.models_known
            .load(Ordering::Relaxed)
            .then(|| self.models.load_full())
    }

    fn serves(&self, model: &str) -> bool {
        self.models().is_some_and(|m| m.iter().any(|x| x == model))
    }
}

/// All engines.
pub struct Fleet {
    engines: Vec<Arc<Engine>>,
    total_inflight: AtomicU64,
}

/// Why no engine can take a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoRoute {
    /// No engine is known to serve the model.
    UnknownModel,
    /// Engines serve it, but none is healthy.
    NoneHealthy,
}

impl Fleet {
    /// A fleet from validated engine addresses; every engine starts unhealthy until probed.
    pub fn new(addrs: Vec<EngineAddr>) -> Arc<Self> {
        let engines = addrs
            .into_iter()
            .enumerate()
            .map(|(i, a)| {
                let key = {
                    let h = blake3::hash(a.name.as_bytes());
                    let mut b = [0u8; 8];
                    b.copy_from_slice(&h.as_bytes()[..8]);
                    u64::from_le_bytes(b)
                };
                let static_models = !a.models.is_empty();
                Arc::new(Engine {
                    id: NodeId(i as u32),
                    name: a.name,
                    url: a.url,
                    addr: a.addr,
                    key,
                    inflight: AtomicU64::new(0),
                    pending_prefill: AtomicU64::new(0),
                    healthy: AtomicBool::new(false),
                    static_models,
                    models_known: AtomicBool::new(static_models),
                    models: ArcSwap::from_pointee(a.models),
                })
            })
            .collect();
        Arc::new(Fleet {
            engines,
            total_inflight: AtomicU64::new(0),
        })
    }

    /// Every engine, in configuration order.
    pub fn engines(&self) -> &[Arc<Engine>] {
        &self.engines
    }

    /// Requests in flight through the proxy.
    pub fn total_inflight(&self) -> u64 {
        self.total_inflight.load(Ordering::Relaxed)
    }

    /// Whether at least one engine is healthy.
    pub fn ready(&self) -> bool {
        self.engines.iter().any(|e| e.healthy())
    }

    /// Healthy engines serving `model`, as routing candidates (overlap left at 0).
    pub fn candidates(&self, model: &str) -> Result<Vec<Candidate>, NoRoute> {
        let serving: Vec<&Arc<Engine>> = self.engines.iter().filter(|e| e.serves(model)).collect();
        if serving.is_empty() {
            // An engine whose list is unknown yet might serve it: say "unhealthy", not "unknown".
            let unknown = self.engines.iter().any(|e| e.models().is_none());
            return Err(if unknown {
                NoRoute::NoneHealthy
            } else {
                NoRoute::UnknownModel
            });
        }
        let c: Vec<Candidate> = serving
            .into_iter()
            .filter(|e| e.healthy())
            .map(|e| Candidate {
                node: e.id,
                key: e.key,
                inflight: e.inflight(),
                pending_prefill_bytes: e.pending_prefill(),
                overlap_blocks: 0,
            })
            .collect();
        if c.is_empty() {
            Err(NoRoute::NoneHealthy)
        } else {
            Ok(c)
        }
    }

    /// The engine with id `node`.
    pub fn get(&self, node: NodeId) -> Option<&Arc<Engine>> {
        self.engines.get(node.0 as usize)
    }

    /// Counts a request against `engine` until the guard drops; `prefill_bytes` count as pending
    /// prefill until [`Dispatch::prefill_done`].
    pub fn dispatch(self: &Arc<Self>, engine: &Arc<Engine>, prefill_bytes: u64) -> Dispatch {
        engine.inflight.fetch_add(1, Ordering::Relaxed);
        engine
            .pending_prefill
            .fetch_add(prefill_bytes, Ordering::Relaxed);
        self.total_inflight.fetch_add(1, Ordering::Relaxed);
        Dispatch {
            fleet: self.clone(),
            engine: engine.clone(),
            prefill_bytes,
        }
    }

    /// Probes every engine once, concurrently: `GET /v1/models`.
    pub async fn probe_all(&self, client: &ProbeClient, timeout: Duration) {
        let mut probes = tokio::task::JoinSet::new();
        for e in &self.engines {
            let (e, client) = (e.clone(), client.clone());
            probes.spawn(async move {
                let result = tokio::time::timeout(timeout, fetch_models(&client, &e.url)).await;
                match result {
                    Ok(Some(models)) => {
                        if !e.static_models {
                            e.models.store(Arc::new(models));
                            e.models_known.store(true, Ordering::Relaxed);
                        }
                        if !e.healthy.swap(true, Ordering::Relaxed) {
                            tracing::info!(engine = %e.name, "engine is up");
                        }
                    }
                    _ => {
                        if e.healthy.swap(false, Ordering::Relaxed) {
                            tracing::warn!(engine = %e.name, url = %e.url, "engine failed its health probe");
                        }
                    }
                }
            });
        }
        while probes.join_next().await.is_some() {}
    }
}

/// `GET {url}/v1/models`: the model ids, or `None` when the engine did not answer 2xx.
async fn fetch_models(client: &ProbeClient, url: &str) -> Option<Vec<String>> {
    let uri = format!("{}/v1/models", url.trim_end_matches('/'))
        .parse()
        .ok()?;
    let resp = client.get(uri).await.ok()?;
    if !resp.status().is_success() {
        return None;
    }
    let body = resp.into_body().collect().await.ok()?.to_bytes();
    Some(parse_model_list(&body))
}

/// The HTTP client used for probes and model lists.
pub type ProbeClient = Client<hyper_util::client::legacy::connect::HttpConnector, Empty<Bytes>>;

/// A client for probes.
pub fn probe_client() -> ProbeClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// `{"data":[{"id":..},..]}` -> ids; anything else -> empty.
pub fn parse_model_list(body: &[u8]) -> Vec<String> {
    let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    v.get("data")
        .and_then(|d| d.as_array())
        .map(|a| {
            a.iter()
                .filter_map(|m| m.get("id").and_then(|i| i.as_str()).map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

/// A request's claim on an engine's load counters; released when dropped, however the request
/// ends (success, error, client disconnect, cancelled stream, retry elsewhere).
pub struct Dispatch {
    fleet: Arc<Fleet>,
    engine: Arc<Engine>,
    prefill_bytes: u64,
}

impl Dispatch {
    /// The engine this request went to.
    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// The engine started answering: its prefill for this request is over.
    pub fn prefill_done(&mut self) {
        let b = std::mem::take(&mut self.prefill_bytes);
        self.engine.pending_prefill.fetch_sub(b, Ordering::Relaxed);
    }
}

impl Drop for Dispatch {
    fn drop(&mut self) {
        self.prefill_done();
        self.engine.inflight.fetch_sub(1, Ordering::Relaxed);
        self.fleet.total_inflight.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fleet() -> Arc<Fleet> {
        Fleet::new(vec![
            EngineAddr {
                name: "a".into(),
                url: "http://127.0.0.1:1".into(),
                addr: "127.0.0.1:1".parse().unwrap(),
                models: vec!["m".into()],
            },
            EngineAddr {
                name: "b".into(),
                url: "http://127.0.0.1:2".into(),
                addr: "127.0.0.1:2".parse().unwrap(),
                models: vec!["m".into()],
            },
        ])
    }

    #[test]
    fn guards_release_counts_on_drop() {
        let f = fleet();
        let e = f.engines()[0].clone();
        let mut g = f.dispatch(&e, 100);
        assert_eq!(
            (e.inflight(), e.pending_prefill(), f.total_inflight()),
            (1, 100, 1)
        );
        g.prefill_done();
        assert_eq!(e.pending_prefill(), 0);
        let g2 = f.dispatch(&e, 50);
        drop(g);
        drop(g2);
        assert_eq!(
            (e.inflight(), e.pending_prefill(), f.total_inflight()),
            (0, 0, 0)
        );
    }

    #[test]
    fn candidates_need_health_and_model() {
        let f = fleet();
        assert_eq!(f.candidates("m").unwrap_err(), NoRoute::NoneHealthy);
        assert_eq!(f.candidates("other").unwrap_err(), NoRoute::UnknownModel);
        f.engines()[1].healthy.store(true, Ordering::Relaxed);
        let c = f.candidates("m").unwrap();
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].node, NodeId(1));
    }
}
