//! chitchat's UDP transport, counting the bytes it sends and receives (for the gossip metrics
//! and the bandwidth benchmark).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use chitchat::transport::{RecvOutcome, SendOutcome, Socket, Transport, UdpTransport};
use chitchat::ChitchatEnvelope;

/// Gossip traffic of one node since it joined.
#[derive(Debug, Default)]
pub struct GossipStats {
    sent: AtomicU64,
    received: AtomicU64,
}

impl GossipStats {
    /// Bytes sent on the gossip socket.
    pub fn bytes_sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// Bytes received on the gossip socket.
    pub fn bytes_received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }
}

/// UDP, counted.
pub struct CountingUdp {
    /// Where the counts go.
    pub stats: Arc<GossipStats>,
}

#[async_trait]
impl Transport for CountingUdp {
    async fn open(&self, listen_addr: SocketAddr) -> anyhow::Result<Box<dyn Socket>> {
        Ok(Box::new(CountingSocket {
            inner: UdpTransport.open(listen_addr).await?,
            stats: self.stats.clone(),
        }))
    }
}

struct CountingSocket {
    inner: Box<dyn Socket>,
    stats: Arc<GossipStats>,
}

#[async_trait]
impl Socket for CountingSocket {
    fn local_addr(&self) -> anyhow::Result<SocketAddr> {
        self.inner.local_addr()
    }

    async fn send(
        &mut self,
        to: SocketAddr,
        envelope: ChitchatEnvelope,
    ) -> anyhow::Result<SendOutcome> {
        let out = self.inner.send(to, envelope).await?;
        self.stats
            .sent
            .fetch_add(out.num_bytes_sent as u64, Ordering::Relaxed);
        Ok(out)
    }

    async fn recv(&mut self) -> anyhow::Result<RecvOutcome> {
        let out = self.inner.recv().await?;
        self.stats
            .received
            .fetch_add(out.num_bytes_received as u64, Ordering::Relaxed);
        Ok(out)
    }
}
