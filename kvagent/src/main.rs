//! `kvagent`: the kvmesh node agent (tiered KV block store over gRPC, residency feed, engine load).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use clap::{Parser, Subcommand};
use http_body_util::Full;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use kvagent::access::AccessControl;
use kvagent::config::AgentConfig;
use kvagent::metrics::Metrics;
use kvagent::pb::kv_agent_server::KvAgentServer;
use kvagent::service::KvAgentService;
use kvagent::store::{BlockStore, StoreConfig};
use kvagent::telemetry::{self, Scraper};

#[derive(Parser)]
#[command(
    name = "kvagent",
    version,
    about = "kvmesh node agent: tiered KV block store over gRPC"
)]
struct Cli {
    /// TOML configuration file (see docs/kvagent.md).
    #[arg(long, short = 'c', env = "KVAGENT_CONFIG")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Validate a configuration file and exit (0: valid).
    CheckConfig {
        /// The file to check.
        file: PathBuf,
    },
}

/// HTTP/2 flow-control windows: large enough that one multi-megabyte block streams without
/// waiting for window updates on loopback or a LAN.
const STREAM_WINDOW: u32 = 8 << 20;
const CONNECTION_WINDOW: u32 = 32 << 20;
/// Largest HTTP/2 frame the agent accepts (clients may set theirs for what they receive).
const MAX_FRAME: u32 = kvagent::config::MAX_FRAME_BYTES as u32;
/// How long a graceful stop waits for in-flight calls.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

#[tokio::main]
async fn main() -> std::process::ExitCode {
    match run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // One line naming what failed and why, e.g. `kvagent: cannot listen on
            // 127.0.0.1:50151 (listen): Address already in use (os error 98)`.
            eprintln!("kvagent: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Binds `addr` for the config key `key`, or says which address could not be bound.
async fn bind(addr: SocketAddr, key: &str) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr} ({key})"))
}

async fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Some(Command::CheckConfig { file }) = cli.command {
        AgentConfig::load(Some(&file))?;
        println!("{}: ok", file.display());
        return Ok(());
    }
    let cfg = AgentConfig::load(cli.config.as_deref())?;
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&cfg.log).context("invalid `log` filter")?,
        )
        // No colour codes in files and container logs.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .init();

    // Both ports first: a second agent started by mistake on a busy port must exit before it
    // touches the SSD directory (whose temp files belong to the running one) or logs anything.
    let listener = bind(cfg.listen, "listen").await?;
    let metrics_listener = match cfg.metrics_listen.as_str() {
        "" => None,
        a => Some(bind(a.parse().context("metrics_listen")?, "metrics_listen").await?),
    };

    let metrics = Arc::new(Metrics::new());
    let ssd = (cfg.ssd.capacity_bytes > 0).then_some((cfg.ssd.dir.as_path(), cfg.ssd.fsync));
    let store = BlockStore::open(StoreConfig::from_agent(&cfg), ssd, metrics.clone())
        .context("opening the SSD tier")?;
    tokio::spawn(
        store
            .clone()
            .run_maintenance(Duration::from_secs(cfg.ssd.sweep_interval_secs.max(1))),
    );

    let scraper = Scraper::new();
    let t = &cfg.telemetry;
    if !t.engine_metrics_url.is_empty() {
        let url = telemetry::parse_http_url(&t.engine_metrics_url).map_err(anyhow::Error::msg)?;
        tokio::spawn(scraper.clone().run(
            url,
            Duration::from_millis(t.scrape_interval_ms),
            Duration::from_millis(t.scrape_timeout_ms),
            metrics.clone(),
        ));
    }

    // Requests on their way in, charged before tonic buffers them (kvmesh_grpc::charge).
    let messages = kvmesh_grpc::Budget::new(
        cfg.limits.message_budget_bytes,
        "`limits.message_budget_bytes`",
    );
    if let Some(l) = metrics_listener {
        tokio::spawn(serve_metrics(l, metrics.clone(), messages.clone()));
    }

    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<KvAgentServer<KvAgentService>>().await;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let service = kvmesh_grpc::Charged::new(
        KvAgentServer::new(
            KvAgentService::new(store.clone(), scraper, cfg.limits.clone(), stop_rx.clone())
                .with_access(AccessControl::from_config(&cfg.auth)?),
        )
        .max_decoding_message_size(cfg.limits.max_message_bytes)
        .max_encoding_message_size(cfg.limits.max_message_bytes),
        messages.clone(),
        cfg.limits.max_message_bytes,
    )
    // Every KvAgent method takes one request message.
    .one_message();
    tracing::info!(listen = %cfg.listen, metrics = %cfg.metrics_listen, epoch = store.epoch(), "kvagent serving");
    let mut stopped = stop_rx;
    let stop = async move {
        let _ = stopped.wait_for(|s| *s).await;
    };
    let router = tonic::transport::Server::builder()
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(MAX_FRAME)
        .max_concurrent_streams(cfg.limits.max_concurrent_streams)
        .add_service(kvmesh_grpc::health(health_service))
        .add_service(service);
    let tls = if cfg.tls.enabled() {
        Some(kvmesh_tls::ServerTls::new(cfg.tls.files()).context("[tls]")?)
    } else {
        None
    };
    tokio::spawn(reload_on_hup(
        tls.clone(),
        Duration::from_secs(cfg.tls.reload_interval_secs.max(1)),
    ));
    let server = match tls {
        Some(tls) => {
            let mut config = tls.server_config().context("[tls]")?;
            config.alpn_protocols = vec![b"h2".to_vec()];
            let incoming = kvmesh_tls::incoming::accept(listener, Arc::new(config));
            tokio::spawn(router.serve_with_incoming_shutdown(incoming, stop))
        }
        None => tokio::spawn(router.serve_with_incoming_shutdown(
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            stop,
        )),
    };
    shutdown_signal().await;
    let _ = stop_tx.send(true);
    // In-flight calls get a bounded time to finish; clients that keep connections open do not
    // hold the stop up.
    match tokio::time::timeout(SHUTDOWN_GRACE, server).await {
        Ok(Ok(Err(e))) => tracing::error!(error = %e, "gRPC server failed"),
        Err(_) => tracing::warn!("in-flight calls still open after {SHUTDOWN_GRACE:?}; stopping"),
        _ => {}
    }
    // A graceful stop keeps what RAM held: it goes to the SSD tier and is served after restart.
    tracing::info!("shutting down: flushing the RAM tier to SSD");
    store.flush().await;
    let (ram_blocks, _, ssd_blocks, _) = store.occupancy();
    tracing::info!(ram_blocks, ssd_blocks, "stopped");
    Ok(())
}

/// Reloads the TLS files when they change and on SIGHUP (which would otherwise end the
/// process); files that do not load are refused and the old ones stay.
async fn reload_on_hup(tls: Option<Arc<kvmesh_tls::ServerTls>>, every: Duration) {
    use kvmesh_tls::reload::{every_and_on_hup, log_outcome};
    every_and_on_hup(every, std::future::pending(), |force| {
        match tls.as_ref() {
            Some(t) => log_outcome("TLS certificate and client CA", t.reload(force)),
            None if force => tracing::info!("SIGHUP: nothing to reload (only [tls] files are)"),
            None => {}
        }
        std::future::ready(())
    })
    .await;
}

async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = term => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

/// `/metrics` (Prometheus text) and `/health` over plain HTTP/1.1.
async fn serve_metrics(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    messages: kvmesh_grpc::Budget,
) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors, typically: back off instead of spinning.
                tracing::warn!(error = %e, "accepting a /metrics connection failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let metrics = metrics.clone();
        let messages = messages.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let metrics = metrics.clone();
                let used = i64::try_from(messages.used()).unwrap_or(i64::MAX);
                async move {
                    let (status, body) = match req.uri().path() {
                        "/metrics" => {
                            metrics.message_bytes.set(used);
                            (StatusCode::OK, metrics.encode())
                        }
                        "/health" => (StatusCode::OK, "ok\n".to_string()),
                        _ => (StatusCode::NOT_FOUND, "not found\n".to_string()),
                    };
                    let mut resp = Response::new(Full::new(Bytes::from(body)));
                    *resp.status_mut() = status;
                    Ok::<_, std::convert::Infallible>(resp)
                }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}
