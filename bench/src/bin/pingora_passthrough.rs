//! `kvmesh-pingora-passthrough`: the baseline for proxy-overhead benchmarks. A bare Pingora
//! HTTP proxy that forwards every request to one upstream with no hooks of its own, configured
//! like kvmesh-proxy (same Pingora version, threads, pooling), so a benchmark can tell the cost of
//! the framework from the cost of kvmesh's routing. An instrument, not part of the product.
//!
//! Usage: `kvmesh-pingora-passthrough LISTEN_ADDR UPSTREAM_ADDR [THREADS]`

use async_trait::async_trait;
use pingora::prelude::*;
use pingora::server::configuration::ServerConf;
use pingora::upstreams::peer::HttpPeer;

// The same allocator as kvmesh-proxy, so that only the hooks differ.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

struct Passthrough {
    upstream: std::net::SocketAddr,
}

#[async_trait]
impl ProxyHttp for Passthrough {
    type CTX = ();

    fn new_ctx(&self) {}

    async fn upstream_peer(&self, _session: &mut Session, _ctx: &mut ()) -> Result<Box<HttpPeer>> {
        let mut peer = HttpPeer::new(self.upstream, false, String::new());
        peer.options.idle_timeout = Some(std::time::Duration::from_secs(60));
        Ok(Box::new(peer))
    }
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (Some(listen), Some(upstream)) = (args.get(1), args.get(2)) else {
        anyhow::bail!("usage: kvmesh-pingora-passthrough LISTEN_ADDR UPSTREAM_ADDR [THREADS]");
    };
    let threads = args.get(3).map(|t| t.parse()).transpose()?.unwrap_or(1);
    let conf = ServerConf {
        threads,
        grace_period_seconds: Some(0),
        graceful_shutdown_timeout_seconds: Some(1),
        ..ServerConf::default()
    };
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();
    let mut proxy = pingora::proxy::http_proxy_service(
        &server.configuration,
        Passthrough {
            upstream: upstream.parse()?,
        },
    );
    proxy.add_tcp(listen);
    server.add_service(proxy);
    server.run_forever()
}
