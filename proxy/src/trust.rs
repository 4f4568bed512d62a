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
        if self.cfg.sidecar.accept_hop_from == HopTrust::ClusterCert {
            let cert = session
                .digest()
                .and_then(|d| d.ssl_digest.as_ref())
                .and_then(|s| s.extension.get::<PeerCert>());
            return match (cert, self.peer_identity.as_ref()) {
                (Some(cert), Some(id)) => id.matches(cert),
                _ => false,
            };
        }
        let Some(ip) = session
            .client_addr()
            .and_then(|a| a.as_inet())
            .map(|a| a.ip())
        else {
            return false;
        };
        hop_allowed(ip, self.cfg.sidecar.accept_hop_from, || {
            self.fleet
                .engines()
                .iter()
                .filter(|e| e.peer.is_some())
                .map(|e| e.addr().ip())
                .collect()
        })
    }
}

/// Whether a request with the hop header from `ip` is trusted under `trust`; `members` lists
/// the IPs of live peers (computed only when needed).
fn hop_allowed(
    ip: std::net::IpAddr,
    trust: HopTrust,
    members: impl FnOnce() -> Vec<std::net::IpAddr>,
) -> bool {
    ip.is_loopback() || (trust == HopTrust::Members && members().contains(&ip))
}

#[cfg(test)]
mod tests {
    use super::{hop_allowed, HopTrust};

    #[test]
    fn hop_header_trust() {
        let peer: std::net::IpAddr = "10.0.0.7".parse().unwrap();
        let stranger: std::net::IpAddr = "10.0.0.9".parse().unwrap();
        let members = || vec![peer];
        assert!(hop_allowed(
            "127.0.0.1".parse().unwrap(),
            HopTrust::Loopback,
            members
        ));
        assert!(hop_allowed(
            "::1".parse().unwrap(),
            HopTrust::Loopback,
            members
        ));
        assert!(!hop_allowed(peer, HopTrust::Loopback, members));
        assert!(hop_allowed(peer, HopTrust::Members, members));
        assert!(!hop_allowed(stranger, HopTrust::Members, members));
    }
}
