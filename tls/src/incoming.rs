//! TLS connections for servers that take a stream of accepted connections (tonic's
//! `serve_with_incoming`): handshakes run beside the accept loop, bounded in number and time,
//! and only completed ones reach the server.

use std::sync::Arc;
use std::time::Duration;

/// Most TLS handshakes in progress at once; connections past it are closed at once.
pub const MAX_HANDSHAKES: usize = 256;
/// Most TLS handshakes in progress at once from one client ([`client_key`]: an IPv4 address,
/// or an IPv6 /64): one host opening idle connections cannot take every handshake slot.
pub const MAX_HANDSHAKES_PER_IP: usize = 16;
/// Longest TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Handshakes in progress by client IP (at most [`MAX_HANDSHAKES`] entries: one per handshake
/// at worst, removed at zero).
#[derive(Default)]
struct PerIp(std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>);

/// Whom a connection from `ip` counts against: IPv4 addresses (v4-mapped IPv6 ones too) one
/// by one, IPv6 ones by their /64, which one host is commonly given whole.
pub fn client_key(ip: std::net::IpAddr) -> std::net::IpAddr {
    match ip {
        std::net::IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => v4.into(),
            None => std::net::Ipv6Addr::from(u128::from(v6) & !u128::from(u64::MAX)).into(),
        },
        v4 => v4,
    }
}

impl PerIp {
    fn enter(self: &Arc<Self>, ip: std::net::IpAddr) -> Option<IpSlot> {
        let ip = client_key(ip);
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let n = m.entry(ip).or_insert(0);
        if *n >= MAX_HANDSHAKES_PER_IP {
            return None;
        }
        *n += 1;
        Some(IpSlot(self.clone(), ip))
    }
}

struct IpSlot(Arc<PerIp>, std::net::IpAddr);

impl Drop for IpSlot {
    fn drop(&mut self) {
        let mut m = (self.0).0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = m.get_mut(&self.1) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                m.remove(&self.1);
            }
        }
    }
}

/// TLS connections accepted on `listener`, handshakes bounded in number (overall and per client
/// IP) and time; a failed handshake is logged at debug and dropped: it never reaches the
/// server. The accept loop ends (and the listener closes) when the stream is dropped.
pub fn accept(
    listener: tokio::net::TcpListener,
    config: Arc<rustls::ServerConfig>,
) -> tokio_stream::wrappers::ReceiverStream<
    std::io::Result<tokio_rustls::server::TlsStream<tokio::net::TcpStream>>,
> {
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        let handshakes = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
        let per_ip = Arc::new(PerIp::default());
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = tx.closed() => return,
            };
            let (tcp, peer) = match accepted {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let Ok(permit) = handshakes.clone().try_acquire_owned() else {
                tracing::debug!(%peer, "too many TLS handshakes in progress; closing");
                continue;
            };
            let Some(ip_slot) = per_ip.enter(peer.ip()) else {
                tracing::debug!(%peer, "too many TLS handshakes in progress from this address; closing");
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let (acceptor, tx) = (acceptor.clone(), tx.clone());
            tokio::spawn(async move {
                let handshake = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await;
                drop((permit, ip_slot));
                match handshake {
                    Ok(Ok(stream)) => {
                        let _ = tx.send(Ok(stream)).await;
                    }
                    Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                    Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_is_an_ipv4_address_or_an_ipv6_slash_64() {
        let ip = |s: &str| {
            s.parse::<std::net::IpAddr>()
                .unwrap_or(std::net::Ipv4Addr::UNSPECIFIED.into())
        };
        let per_ip = Arc::new(PerIp::default());
        // 16 handshakes from one /64, each from another address: the 17th is refused, and
        // another /64 and an IPv4 client still get in.
        let held: Vec<IpSlot> = (0..MAX_HANDSHAKES_PER_IP)
            .filter_map(|i| per_ip.enter(ip(&format!("2001:db8:1:2::{:x}", i + 1))))
            .collect();
        assert_eq!(held.len(), MAX_HANDSHAKES_PER_IP);
        assert!(per_ip.enter(ip("2001:db8:1:2:ffff::1")).is_none());
        assert!(per_ip.enter(ip("2001:db8:1:3::1")).is_some());
        assert_eq!(client_key(ip("::ffff:10.0.0.7")), ip("10.0.0.7"));
        assert_eq!(client_key(ip("10.0.0.7")), ip("10.0.0.7"));
        drop(held);
        assert!(per_ip.enter(ip("2001:db8:1:2:ffff::1")).is_some());
    }
}
