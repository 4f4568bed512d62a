//! `kvmesh-proxy`: the KV-cache-aware gateway in front of OpenAI-compatible engines.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use async_trait::async_trait;
use clap::{Parser, Subcommand};
use kvmesh_filters::residency::ResidencyIndex;
use pingora::server::configuration::ServerConf;
use pingora::server::{Server, ShutdownWatch};
use pingora::services::background::{background_service, BackgroundService};

use kvmesh_proxy::cluster;
use kvmesh_proxy::config::{LogFormat, Mode, Overrides, ProxyConfig};
use kvmesh_proxy::feed::Feeds;
use kvmesh_proxy::fleet::{self, Fleet, HealthCheck, ModelsProbe};
use kvmesh_proxy::metrics::Metrics;
use kvmesh_proxy::otel::Otel;
use kvmesh_proxy::picker;
use kvmesh_proxy::reload::{ConfigReload, Reloader, SetLogFilter};
use kvmesh_proxy::service::Gateway;
use kvmesh_proxy::tls::{ServerTls, UpstreamTls};

// glibc malloc showed up at about a fifth of the proxy's instructions per request (Pingora
// allocates and frees many buffers per request); mimalloc is measured faster here
// (docs/benchmarks.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "kvmesh-proxy",
    version = kvmesh_proxy::VERSION,
    about = "KV-cache-aware L7 proxy for OpenAI-compatible LLM engines"
)]
struct Cli {
    /// TOML configuration file (see docs/configuration.md).
    #[arg(long, short = 'c', env = "KVMESH_CONFIG")]
    config: Option<PathBuf>,
    /// Overrides `listen` (and `KVMESH_LISTEN`), e.g. `0.0.0.0:8080`.
    #[arg(long, value_name = "ADDR")]
    listen: Option<String>,
    /// An engine's URL; repeat for more. Replaces the file's `[[engines]]` (named engine-0,
    /// engine-1, ... in that order).
    #[arg(long = "engine", value_name = "URL")]
    engines: Vec<String>,
    /// Overrides `policy`: prefix, round_robin, least_inflight, power_of_two, session.
    #[arg(long)]
    policy: Option<String>,
    /// Overrides `mode`: gateway, sidecar, picker.
    #[arg(long)]
    mode: Option<String>,
    /// Overrides `log_format` (and `KVMESH_LOG_FORMAT`): text, json.
    #[arg(long, value_name = "FORMAT")]
    log_format: Option<String>,
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
    /// Print a fresh random gossip key (base64 of 32 bytes) for `cluster.gossip_keys`.
    GossipKeygen,
    /// Read an API key from stdin (one line) and print its SHA-256 for `[[auth.keys]]` `sha256`.
    HashKey,
    /// GET a URL and exit 0 on a 2xx answer, 1 otherwise: the container healthcheck (images
    /// carry no curl), e.g. `kvmesh-proxy probe http://127.0.0.1:8080/ready`.
    Probe {
        /// `http://` or `https://` URL.
        url: String,
        /// Give up after this many milliseconds.
        #[arg(long, default_value_t = 2000)]
        timeout_ms: u64,
        /// CA bundle (PEM) that verifies an `https://` URL's certificate.
        #[arg(long, value_name = "FILE")]
        ca_file: Option<String>,
    },
}

/// `kvmesh-proxy probe`: one GET with the health probes' client; the status line is printed.
fn probe(url: &str, timeout: Duration, ca_file: Option<&str>) -> anyhow::Result<()> {
    let uri: http::Uri = url
        .parse()
        .with_context(|| format!("{url:?} is not a URL"))?;
    let upstream = UpstreamTls::from_config(&kvmesh_proxy::config::UpstreamConfig {
        ca_file: ca_file.unwrap_or_default().to_string(),
        ..Default::default()
    })
    .context("--ca-file")?;
    let client = fleet::probe_client(&upstream);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting a runtime")?;
    let status = rt
        .block_on(async { tokio::time::timeout(timeout, client.get(uri)).await })
        .map_err(|_| anyhow::anyhow!("{url}: no answer within {} ms", timeout.as_millis()))?
        .with_context(|| format!("{url}: request failed"))?
        .status();
    println!("{url}: {status}");
    anyhow::ensure!(status.is_success(), "{url} answered {status}");
    Ok(())
}

/// Periodic work beside the request path: engine health probes and residency TTL sweeps.
struct Housekeeping {
    upstream: Arc<UpstreamTls>,
    fleet: Arc<Fleet>,
    index: Arc<ResidencyIndex>,
    interval: Duration,
    timeout: Duration,
}

#[async_trait]
impl BackgroundService for Housekeeping {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let health: Arc<dyn HealthCheck> = Arc::new(ModelsProbe {
            client: fleet::probe_client(&self.upstream),
            timeout: self.timeout,
        });
        let mut tick = tokio::time::interval(self.interval);
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    self.fleet.probe_all(&health).await;
                    self.index.sweep(Instant::now(), 10_000);
                }
                _ = shutdown.changed() => return,
            }
        }
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Some(Command::HashKey) = cli.command {
        let mut line = String::new();
        std::io::stdin()
            .read_line(&mut line)
            .context("reading the key from stdin")?;
        // Surrounding whitespace is never part of a presented key either.
        let key = line.trim();
        anyhow::ensure!(!key.is_empty(), "no key on stdin");
        println!("{}", kvmesh_proxy::auth::hash_key(key));
        return Ok(());
    }
    if let Some(Command::Probe {
        url,
        timeout_ms,
        ca_file,
    }) = &cli.command
    {
        return probe(url, Duration::from_millis(*timeout_ms), ca_file.as_deref());
    }
    if let Some(Command::GossipKeygen) = cli.command {
        println!("{}", kvmesh_cluster::Keyring::generate_base64());
        return Ok(());
    }
    if let Some(Command::CheckConfig { file }) = cli.command {
        let cfg = ProxyConfig::load(Some(&file)).with_context(|| {
            format!(
                "{} is not a valid kvmesh-proxy configuration",
                file.display()
            )
        })?;
        // The proxy starts with such an engine down (retried at each probe): a warning, since
        // the check may run where the engines' names do not resolve (outside their network).
        for e in cfg.engine_addrs()? {
            if let Some(why) = e.unresolved {
                eprintln!(
                    "warning: engine {:?}: {why} (here; it stays down until it resolves)",
                    e.name
                );
            }
        }
        // The tokenizers are read as the proxy would read them at start.
        kvmesh_proxy::tokens::TokenModes::load(&cfg.tokenizers, cfg.worker_threads())
            .map_err(anyhow::Error::msg)
            .with_context(|| format!("{}: `[[tokenizers]]`", file.display()))?;
        let listen = if cfg.mode == Mode::Picker {
            format!("ext_proc {}", cfg.picker.listen)
        } else {
            cfg.listen.clone()
        };
        println!(
            "{}: ok (listen {}, mode {:?}, policy {}, {} engines, cluster {})",
            file.display(),
            listen,
            cfg.mode,
            cfg.policy.label(),
            cfg.engines.len(),
            if cfg.cluster.enabled { "on" } else { "off" }
        );
        return Ok(());
    }
    let overrides = Overrides {
        listen: cli.listen.clone(),
        engines: cli.engines.clone(),
        policy: cli.policy.clone(),
        mode: cli.mode.clone(),
        log_format: cli.log_format.clone(),
    };
    let cfg = ProxyConfig::load_with(cli.config.as_deref(), &overrides)
        .context("invalid configuration")?;
    let set_log_filter = init_logging(&cfg)?;
    let fleet = Fleet::new(
        cfg.engine_addrs()?,
        Duration::from_secs(cfg.sidecar.peer_down_secs),
    );
    if cfg.cluster.enabled {
        // Fail now, with a clear message, rather than from inside a background service.
        let gossip = cfg.cluster_config()?;
        std::net::UdpSocket::bind(gossip.listen)
            .with_context(|| format!("cannot bind the gossip address {}", gossip.listen))?;
    }
    let index = Arc::new(ResidencyIndex::new(cfg.residency_config()));
    let metrics = Arc::new(Metrics::new().context("metrics registry")?);
    let upstream_tls =
        Arc::new(UpstreamTls::from_config(&cfg.upstream).context("`[upstream]` TLS")?);
    if cfg.mode == Mode::Picker {
        warn_if_open(&cfg);
        let source = ConfigSource {
            path: cli.config.clone(),
            overrides,
            set_log_filter,
        };
        return run_picker(cfg, source, fleet, index, metrics, upstream_tls);
    }
    // Pingora binds inside its worker threads, retries a busy address for half a minute and
    // then panics there, leaving a process that serves nothing. Bind first and fail clearly.
    probe_listen(&cfg.listen)?;

    let conf = ServerConf {
        threads: cfg.worker_threads(),
        grace_period_seconds: Some(cfg.shutdown.grace_period_secs),
        graceful_shutdown_timeout_seconds: Some(cfg.shutdown.drain_timeout_secs),
        // The CA bundle of Pingora's TLS connector (`https://` engines and peers).
        ca_file: (!cfg.upstream.ca_file.is_empty()).then(|| cfg.upstream.ca_file.clone()),
        ..ServerConf::default()
    };
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();

    let housekeeping = Housekeeping {
        upstream: upstream_tls.clone(),
        fleet: fleet.clone(),
        index: index.clone(),
        interval: Duration::from_millis(cfg.health.interval_ms),
        timeout: Duration::from_millis(cfg.health.timeout_ms),
    };
    let feeds = Feeds::new(&cfg, fleet.clone(), index.clone(), metrics.clone())
        .map_err(anyhow::Error::msg)
        .context("`[[engines]]` residency feed")?;
    let listen = cfg.listen.clone();
    let listener_tls_on = cfg.tls.enabled();
    let gossip_stats = Arc::new(kvmesh_cluster::GossipStats::default());
    let gossip = cfg.cluster.enabled.then(|| cluster::ClusterService {
        cfg: cfg.clone(),
        fleet: fleet.clone(),
        index: index.clone(),
        metrics: metrics.clone(),
        upstream_tls: upstream_tls.clone(),
        stats: gossip_stats.clone(),
    });
    warn_if_open(&cfg);
    let listener_tls = if cfg.tls.enabled() {
        Some(ServerTls::new(cfg.tls.files()).context("`[tls]`")?)
    } else {
        None
    };
    let mut gateway = Gateway::new(cfg, fleet, index, metrics, upstream_tls.clone())?;
    if gateway.live().cfg.cluster.enabled {
        gateway.gossip = Some(gossip_stats);
    }
    gateway.otel = start_otel(&gateway)?;
    let otel = gateway.otel.clone();
    let source = ConfigSource {
        path: cli.config.clone(),
        overrides,
        set_log_filter,
    };
    // With a configuration file, a reload can start, stop or restart feeds.
    let feeds = if source.path.is_some() {
        feeds.follow_reloads(gateway.live_handle())
    } else {
        feeds
    };
    let reloader = Reloader::new(
        &gateway.live().cfg,
        listener_tls.clone(),
        gateway.auth.clone(),
        upstream_tls,
        source.reload_of(&gateway),
    );
    let admin = match gateway.live().cfg.admin.listen.as_str() {
        "" => None,
        addr => {
            let a = kvmesh_proxy::admin::AdminListener::bind(addr, gateway.observed())
                .with_context(|| format!("`admin.listen` = {addr:?}: cannot listen"))?;
            tracing::info!(admin_listen = %addr, "admin listener (/metrics, /health, /ready)");
            Some(a)
        }
    };
    let mut proxy = pingora::proxy::http_proxy_service(&server.configuration, gateway);
    match listener_tls {
        Some(tls) => {
            proxy.add_tls_with_settings(&listen, None, kvmesh_proxy::tls::listener_settings(&tls)?)
        }
        None => proxy.add_tcp(&listen),
    }
    server.add_service(proxy);
    server.add_service(background_service("housekeeping", housekeeping));
    if !feeds.is_empty() {
        server.add_service(background_service("residency feeds", feeds));
    }
    server.add_service(background_service("reload", reloader));
    if let Some(a) = admin {
        server.add_service(background_service("admin", a));
    }
    if let Some(g) = gossip {
        server.add_service(background_service("gossip", g));
    }
    // The address was bindable a moment ago (probe_listen); Pingora binds it as it starts.
    tracing::info!(%listen, tls = listener_tls_on, "kvmesh-proxy listening");
    // Returns once every service and runtime has stopped (requests drained).
    server.run(pingora::server::RunArgs::default());
    // What the drained requests traced leaves now.
    if let Some(o) = otel {
        o.shutdown();
    }
    std::process::exit(0)
}

/// The `[otel]` pipeline, when `otel.endpoint` is set.
fn start_otel(gateway: &Gateway) -> anyhow::Result<Option<Arc<Otel>>> {
    let cfg = &gateway.live().cfg.otel;
    let otel = Otel::start(cfg, &gateway.metrics.otel_spans).context("`[otel]`")?;
    if otel.is_some() {
        tracing::info!(endpoint = %cfg.endpoint, sample_ratio = cfg.sample_ratio, "exporting traces over OTLP");
    }
    Ok(otel.map(Arc::new))
}

/// Where the configuration came from, for reloading it.
struct ConfigSource {
    path: Option<PathBuf>,
    overrides: Overrides,
    set_log_filter: SetLogFilter,
}

impl ConfigSource {
    /// The reload of the configuration file into `gateway`; `None` without a file.
    fn reload_of(self, gateway: &Gateway) -> Option<ConfigReload> {
        let path = self.path?;
        Some(ConfigReload {
            path,
            overrides: self.overrides,
            live: gateway.live_handle(),
            fleet: gateway.fleet.clone(),
            index: gateway.index.clone(),
            auth: gateway.auth.clone(),
            upstream: gateway.upstream_tls.clone(),
            metrics: gateway.metrics.clone(),
            set_log_filter: Some(self.set_log_filter),
            // Read again at the first check: the file may have changed since start read it.
            seen: parking_lot::Mutex::new(None),
            interval_secs: 0,
            retry_engines: parking_lot::Mutex::new(None),
        })
    }
}

/// Picker mode: no Pingora server; the ext_proc, health and metrics listeners, the health
/// probes and (with `[cluster]`) gossip on one Tokio runtime, until SIGINT or SIGTERM.
fn run_picker(
    cfg: ProxyConfig,
    source: ConfigSource,
    fleet: Arc<Fleet>,
    index: Arc<ResidencyIndex>,
    metrics: Arc<Metrics>,
    upstream_tls: Arc<UpstreamTls>,
) -> anyhow::Result<()> {
    let threads = cfg.worker_threads();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    rt.block_on(async move {
        let listeners = picker::Listeners::bind(&cfg.picker).await?;
        let (stop, shutdown) = tokio::sync::watch::channel(false);
        let housekeeping = Housekeeping {
            upstream: upstream_tls.clone(),
            fleet: fleet.clone(),
            index: index.clone(),
            interval: Duration::from_millis(cfg.health.interval_ms),
            timeout: Duration::from_millis(cfg.health.timeout_ms),
        };
        let rx = shutdown.clone();
        tokio::spawn(async move { housekeeping.start(rx).await });
        let feeds = Feeds::new(&cfg, fleet.clone(), index.clone(), metrics.clone())
            .map_err(anyhow::Error::msg)
            .context("`[[engines]]` residency feed")?;
        let gossip_stats = Arc::new(kvmesh_cluster::GossipStats::default());
        if cfg.cluster.enabled {
            let gossip = cluster::ClusterService {
                cfg: cfg.clone(),
                fleet: fleet.clone(),
                index: index.clone(),
                metrics: metrics.clone(),
                upstream_tls: upstream_tls.clone(),
                stats: gossip_stats.clone(),
            };
            let rx = shutdown.clone();
            tokio::spawn(async move { gossip.start(rx).await });
        }
        let [ext_proc, health, metrics_addr] = listeners.addrs().map(|a| {
            a.map_or_else(|| "?".to_string(), |a| a.to_string())
        });
        let drain = Duration::from_secs(
            cfg.shutdown
                .grace_period_secs
                .saturating_add(cfg.shutdown.drain_timeout_secs),
        );
        let tls = if cfg.tls.enabled() {
            Some(ServerTls::new(cfg.tls.files()).context("`[tls]`")?)
        } else {
            None
        };
        let cluster_on = cfg.cluster.enabled;
        let mut gateway = Gateway::new(cfg, fleet, index, metrics, upstream_tls.clone())?;
        if cluster_on {
            gateway.gossip = Some(gossip_stats);
        }
        gateway.otel = start_otel(&gateway)?;
        let otel = gateway.otel.clone();
        let gateway = Arc::new(gateway);
        // With a configuration file, a reload can start, stop or restart feeds.
        let feeds = if source.path.is_some() {
            feeds.follow_reloads(gateway.live_handle())
        } else {
            feeds
        };
        let rx = shutdown.clone();
        tokio::spawn(async move { feeds.start(rx).await });
        // Reloads the configuration file and the TLS files (and keeps SIGHUP from ending the
        // picker).
        let reloader = Reloader::new(
            &gateway.live().cfg,
            tls.clone(),
            None,
            upstream_tls,
            source.reload_of(&gateway),
        );
        let rx = shutdown.clone();
        tokio::spawn(async move { reloader.start(rx).await });
        tokio::spawn(async move {
            wait_for_signal().await;
            tracing::info!("shutting down");
            let _ = stop.send(true);
        });
        tracing::info!(%ext_proc, %health, metrics = %metrics_addr, "kvmesh-proxy picker listening");
        let mut stopping = shutdown.clone();
        // Envoy keeps its HTTP/2 connection open: after the signal (and the grace period, in
        // which the picker reports NOT_SERVING but still serves), streams in flight get
        // `shutdown.drain_timeout_secs` to finish, then the process exits regardless.
        tokio::select! {
            r = picker::serve(gateway, listeners, shutdown, tls) => r?,
            _ = async {
                let _ = stopping.wait_for(|s| *s).await;
                tokio::time::sleep(drain).await;
            } => tracing::warn!("drain timeout reached; closing the streams still open"),
        }
        if let Some(o) = otel {
            tokio::task::spawn_blocking(move || o.shutdown()).await.ok();
        }
        Ok(())
    })
}

/// A listener reachable beyond this host without API keys or TLS is allowed (examples and
/// trusted networks use it) but said at start.
fn warn_if_open(cfg: &ProxyConfig) {
    let beyond_loopback = |addr: &str| {
        addr.parse::<std::net::SocketAddr>()
            .is_ok_and(|a| !a.ip().is_loopback())
    };
    if cfg.mode == Mode::Picker {
        if beyond_loopback(&cfg.picker.listen) && cfg.tls.client_ca_file.is_empty() {
            tracing::warn!(picker_listen = %cfg.picker.listen, "the ext_proc listener is reachable beyond loopback without client certificates: whoever reaches it can have requests routed, hold admission slots and report usage (see docs/envoy.md, TLS)");
        }
        if beyond_loopback(&cfg.picker.metrics_listen) {
            tracing::warn!(metrics_listen = %cfg.picker.metrics_listen, "the picker's metrics listener (no TLS, no keys) is reachable beyond loopback: keep it on a management network");
        }
        return;
    }
    let public = beyond_loopback(&cfg.listen);
    if public && !cfg.auth.enabled() {
        tracing::warn!(listen = %cfg.listen, "listening beyond loopback without API keys: anyone who reaches this address may use the engines (see docs/security.md, `[auth]`)");
    }
    if public && !cfg.tls.enabled() {
        tracing::warn!(listen = %cfg.listen, "listening beyond loopback without TLS: prompts and answers cross the network in clear (see docs/security.md, `[tls]`)");
    }
    if beyond_loopback(&cfg.admin.listen) {
        tracing::warn!(admin_listen = %cfg.admin.listen, "the admin listener (metrics, no TLS, no keys) is reachable beyond loopback: keep it on a management network (see docs/configuration.md, `[admin]`)");
    }
}

/// Resolves on SIGINT or SIGTERM.
async fn wait_for_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
}

/// Logs to stderr with `cfg.log` as the filter, as text (coloured only on a terminal) or JSON.
/// Pingora's own debug and trace events are never written, whatever the filter: they print
/// whole request headers, `Authorization` included.
fn init_logging(cfg: &ProxyConfig) -> anyhow::Result<SetLogFilter> {
    use std::io::IsTerminal;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    let filter =
        tracing_subscriber::EnvFilter::try_new(&cfg.log).context("invalid `log` filter")?;
    // `log` is reloadable: the filter sits behind a reload handle.
    let (filter, handle) = tracing_subscriber::reload::Layer::new(filter);
    let no_header_dumps = tracing_subscriber::filter::filter_fn(|m| {
        !(m.target().starts_with("pingora") && *m.level() > tracing::Level::INFO)
    });
    let layer = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let layer = match cfg.log_format {
        LogFormat::Text => layer.with_ansi(std::io::stderr().is_terminal()).boxed(),
        LogFormat::Json => layer.json().boxed(),
    };
    tracing_subscriber::registry()
        .with(layer.with_filter(filter).with_filter(no_header_dumps))
        .try_init()
        .context("starting the logger")?;
    Ok(Box::new(move |spec: &str| {
        let f = tracing_subscriber::EnvFilter::try_new(spec).map_err(|e| e.to_string())?;
        handle.reload(f).map_err(|e| e.to_string())
    }))
}

/// Binds `listen` once (with `SO_REUSEADDR`, as Pingora does) and releases it: an address in
/// use or not assignable is an error naming it, before anything starts.
fn probe_listen(listen: &str) -> anyhow::Result<()> {
    let addr: std::net::SocketAddr = listen
        .parse()
        .with_context(|| format!("`listen` = {listen:?} is not an IP:port address"))?;
    std::net::TcpListener::bind(addr)
        .with_context(|| format!("cannot listen on {addr} (`listen`)"))?;
    Ok(())
}
