//! Hop trust: a request carrying the hop header (forwarded by a peer proxy, to be served
//! locally) is accepted only from loopback or, with `sidecar.accept_hop_from = "members"`, from
//! live peers, or with `"cluster_cert"` only over TLS from a client whose certificate (verified
//! against `tls.client_ca_file`) carries `sidecar.peer_identity`.

use pingora::proxy::Session;

use crate::config::HopTrust;
use crate::service::Gateway;
use crate::tls::PeerCert;

/// A request forwarded by a peer proxy carries this header and is served locally.
pub const HOP_HEADER: &str = "x-kvmesh-hop";

impl Gateway {
    /// Whether a request carrying the hop header comes from a trusted peer.
    pub(crate) fn hop_trusted(&self, session: &Session) -> bool {
        if self.live().cfg.sidecar.accept_hop_from == HopTrust::ClusterCert {
            let cert = session
                .digest()
                .and_then(|d| d.ssl_digest.as_ref())
                .and_then(|s| s.extension.get::<PeerCert>());
            return match (cert, self.peer_identity.as_ref()) {
                (Some(cert), Some(id)) => id.matches(cert),
                _ => false,
            };
        }
        // An IPv4 client of a dual-stack (`[::]`) listener arrives as `::ffff:a.b.c.d`; peers'
        // and gossip's addresses are plain IPv4.
        let Some(ip) = session
            .client_addr()
            .and_then(|a| a.as_inet())
            .map(|a| a.ip().to_canonical())
        else {
            return false;
        };
        hop_allowed(ip, self.live().cfg.sidecar.accept_hop_from, || {
            // A peer that rejoins (a healed partition, a restart) is admitted again only once
            // its URL has been checked, while it may already forward to us: its authenticated
            // gossip from that IP is the same proof of membership, and arrives first.
            let gossiping = self
                .gossip
                .as_ref()
                .is_some_and(|g| g.heard_within(ip, GOSSIP_TRUST_WINDOW));
            gossiping
                || self
                    .fleet
                    .engines()
                    .iter()
                    .any(|e| e.peer.is_some() && e.addr().ip() == ip)
        })
    }
}

/// How recent a host's authenticated gossip must be for its hop requests to be trusted.
const GOSSIP_TRUST_WINDOW: std::time::Duration = std::time::Duration::from_secs(10);

/// Whether a request with the hop header from `ip` is trusted under `trust`; `member` says
/// whether `ip` is a live peer's (asked only when needed).
fn hop_allowed(ip: std::net::IpAddr, trust: HopTrust, member: impl FnOnce() -> bool) -> bool {
    ip.to_canonical().is_loopback() || (trust == HopTrust::Members && member())
}

#[cfg(test)]
mod tests {
    use super::{hop_allowed, HopTrust};

    #[test]
    fn hop_header_trust() {
        let peer: std::net::IpAddr = "10.0.0.7".parse().unwrap();
        let stranger: std::net::IpAddr = "10.0.0.9".parse().unwrap();
        let members = |ip| move || ip == peer;
        let lo: std::net::IpAddr = "127.0.0.1".parse().unwrap();
        let lo6: std::net::IpAddr = "::1".parse().unwrap();
        assert!(hop_allowed(lo, HopTrust::Loopback, members(lo)));
        assert!(hop_allowed(lo6, HopTrust::Loopback, members(lo6)));
        assert!(!hop_allowed(peer, HopTrust::Loopback, members(peer)));
        assert!(hop_allowed(peer, HopTrust::Members, members(peer)));
        assert!(!hop_allowed(stranger, HopTrust::Members, members(stranger)));
        // IPv4 loopback through a dual-stack listener.
        let mapped: std::net::IpAddr = "::ffff:127.0.0.1".parse().unwrap();
        assert!(hop_allowed(mapped, HopTrust::Loopback, members(mapped)));
    }
}
