//! TLS connections for servers that take a stream of accepted connections (tonic's
//! `serve_with_incoming`): handshakes run beside the accept loop, bounded in number and time,
//! and only completed ones reach the server.

use std::sync::Arc;
use std::time::Duration;

/// Most TLS handshakes in progress at once; connections past it are closed at once.
pub const MAX_HANDSHAKES: usize = 256;
/// Most TLS handshakes in progress at once from one IP address: one host opening idle
/// connections cannot take every handshake slot.
pub const MAX_HANDSHAKES_PER_IP: usize = 16;
/// Longest TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Handshakes in progress by client IP (at most [`MAX_HANDSHAKES`] entries: one per handshake
/// at worst, removed at zero).
#[derive(Default)]
struct PerIp(std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>);

impl PerIp {
    fn enter(self: &Arc<Self>, ip: std::net::IpAddr) -> Option<IpSlot> {
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
