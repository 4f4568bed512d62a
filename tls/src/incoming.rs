//! TLS connections for servers that take a stream of accepted connections (tonic's
//! `serve_with_incoming`): handshakes run beside the accept loop, bounded in number and time,
//! and only completed ones reach the server.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::Arc;
use std::time::Duration;

/// Most TLS handshakes in progress at once; connections past it are closed at once.
pub const MAX_HANDSHAKES: usize = 256;
/// Most TLS handshakes in progress at once from one IP address (v4-mapped IPv6 ones counted
/// as IPv4): one host opening idle connections cannot take every handshake slot.
pub const MAX_HANDSHAKES_PER_IP: usize = 16;
/// Most from one IPv6 /64, which one host may own whole (while, in a Kubernetes cluster, a
/// node's pods may share one).
pub const MAX_HANDSHAKES_PER_PREFIX: usize = 64;
/// Longest TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// What a connection from `ip` counts against: its address (an IPv4 one for a v4-mapped
/// IPv6 address) and, for IPv6, its /64.
fn client_keys(ip: IpAddr) -> (IpAddr, Option<IpAddr>) {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => (v4.into(), None),
            None => {
                let prefix = Ipv6Addr::from(u128::from(v6) & !u128::from(u64::MAX));
                (ip, Some(prefix.into()))
            }
        },
        v4 => (v4, None),
    }
}

/// Handshakes in progress by client address and IPv6 /64 (at most [`MAX_HANDSHAKES`] entries
/// each: one per handshake at worst, removed at zero).
#[derive(Default)]
struct PerIp(std::sync::Mutex<(HashMap<IpAddr, usize>, HashMap<IpAddr, usize>)>);

impl PerIp {
    fn enter(self: &Arc<Self>, ip: IpAddr) -> Option<IpSlot> {
        let (ip, prefix) = client_keys(ip);
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let (by_ip, by_prefix) = &mut *m;
        if by_ip.get(&ip).is_some_and(|&n| n >= MAX_HANDSHAKES_PER_IP)
            || prefix.is_some_and(|p| {
                by_prefix
                    .get(&p)
                    .is_some_and(|&n| n >= MAX_HANDSHAKES_PER_PREFIX)
            })
        {
            return None;
        }
        *by_ip.entry(ip).or_insert(0) += 1;
        if let Some(p) = prefix {
            *by_prefix.entry(p).or_insert(0) += 1;
        }
        Some(IpSlot(self.clone(), ip, prefix))
    }
}

struct IpSlot(Arc<PerIp>, IpAddr, Option<IpAddr>);

impl Drop for IpSlot {
    fn drop(&mut self) {
        let mut m = (self.0).0.lock().unwrap_or_else(|p| p.into_inner());
        let (by_ip, by_prefix) = &mut *m;
        let leave = |map: &mut HashMap<IpAddr, usize>, key: &IpAddr| {
            if let Some(n) = map.get_mut(key) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    map.remove(key);
                }
            }
        };
        leave(by_ip, &self.1);
        if let Some(p) = &self.2 {
            leave(by_prefix, p);
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
    fn handshakes_are_counted_per_address_and_per_ipv6_slash_64() {
        let ip = |s: &str| {
            s.parse::<IpAddr>()
                .unwrap_or(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED))
        };
        let per_ip = Arc::new(PerIp::default());
        // One address: 16.
        let one: Vec<IpSlot> = (0..MAX_HANDSHAKES_PER_IP + 1)
            .filter_map(|_| per_ip.enter(ip("2001:db8:1:2::1")))
            .collect();
        assert_eq!(one.len(), MAX_HANDSHAKES_PER_IP);
        // One /64, many addresses: 64 in all.
        let many: Vec<IpSlot> = (0..MAX_HANDSHAKES_PER_PREFIX)
            .filter_map(|i| per_ip.enter(ip(&format!("2001:db8:1:2::{:x}", i + 2))))
            .collect();
        assert_eq!(one.len() + many.len(), MAX_HANDSHAKES_PER_PREFIX);
        assert!(per_ip.enter(ip("2001:db8:1:2:ffff::1")).is_none());
        // Another /64, and IPv4 clients (v4-mapped ones the same), still get in.
        assert!(per_ip.enter(ip("2001:db8:1:3::1")).is_some());
        let v4: Vec<IpSlot> = (0..MAX_HANDSHAKES_PER_IP)
            .filter_map(|_| per_ip.enter(ip("10.0.0.7")))
            .collect();
        assert_eq!(v4.len(), MAX_HANDSHAKES_PER_IP);
        assert!(per_ip.enter(ip("::ffff:10.0.0.7")).is_none());
        drop((one, many, v4));
        assert!(per_ip.enter(ip("2001:db8:1:2:ffff::1")).is_some());
        let m = per_ip.0.lock().unwrap_or_else(|p| p.into_inner());
        assert!(m.0.is_empty() && m.1.is_empty(), "every count left at zero");
    }
}
