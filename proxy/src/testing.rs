//! Builders the unit tests of several modules share (test builds only).

use std::sync::Arc;

use crate::config::{EngineAddr, ProxyConfig};
use crate::fleet::{Fleet, PeerEngine};
use crate::metrics::Metrics;
use crate::service::Gateway;

/// An engine `name` at `url` (`addr`, an IP:port) serving `models`.
pub(crate) fn engine_addr(name: &str, url: &str, addr: &str, models: &[&str]) -> EngineAddr {
    EngineAddr {
        name: name.into(),
        url: url.into(),
        addr: addr.parse().unwrap(),
        models: models.iter().map(|m| m.to_string()).collect(),
        unresolved: None,
    }
}

/// Peer `node_id`, through its proxy at 127.0.0.1:`port`, ready and serving `m`, with the
/// load given.
pub(crate) fn peer_engine(
    node_id: &str,
    port: u16,
    inflight: u64,
    pending_prefill_bytes: u64,
) -> PeerEngine {
    PeerEngine {
        node_id: node_id.into(),
        addr: format!("127.0.0.1:{port}").parse().unwrap(),
        url: format!("http://127.0.0.1:{port}"),
        via_peer: true,
        models: vec!["m".into()],
        ready: true,
        inflight,
        pending_prefill_bytes,
    }
}

/// A gateway with `cfg` over `fleet`, an empty residency index and fresh metrics.
pub(crate) fn gateway_over(cfg: ProxyConfig, fleet: Arc<Fleet>) -> Gateway {
    let index = Arc::new(kvmesh_filters::residency::ResidencyIndex::new(
        cfg.residency_config(),
    ));
    Gateway::new(
        cfg,
        fleet,
        index,
        Arc::new(Metrics::new().unwrap()),
        Arc::new(crate::tls::UpstreamTls::from_config(&Default::default()).unwrap()),
    )
    .unwrap()
}
