//! Test harness: real `kvmesh-proxy` and `kvmesh-sim-engine` processes on ephemeral loopback
//! ports, and a small raw HTTP/1.1 client that controls framing exactly.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

pub mod extproc;
pub mod netns;
pub mod otlp;
pub mod pki;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Path of a workspace binary (`cargo build --workspace --bins` builds them all).
///
/// `KVMESH_TEST_PROXY_BIN` names another `kvmesh-proxy` to test (e.g. an older build, to check
/// that a regression test fails there).
pub fn bin(name: &str) -> PathBuf {
    let proxy = PathBuf::from(env!("CARGO_BIN_EXE_kvmesh-proxy"));
    if name == "kvmesh-proxy" {
        if let Some(p) = std::env::var_os("KVMESH_TEST_PROXY_BIN") {
            return PathBuf::from(p);
        }
    }
    let p = proxy.parent().unwrap().join(name);
    assert!(
        p.exists(),
        "{} is missing: run `cargo build --workspace --bins` first (scripts/test.sh does)",
        p.display()
    );
    p
}

/// The address a child announces on the first line of its stdout (`... http://ADDR`), as the
/// sim engine and engine-shim do once they listen.
pub fn announced_addr(child: &mut Child, what: &str) -> SocketAddr {
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    line.trim()
        .rsplit("http://")
        .next()
        .unwrap()
        .parse()
        .unwrap_or_else(|_| panic!("{what} did not start: {line:?}"))
}

/// A running simulated engine; killed on drop.
pub struct Sim {
    pub child: Child,
    pub addr: SocketAddr,
    pub name: String,
}

impl Sim {
    pub fn start(name: &str, args: &[&str]) -> Sim {
        Sim::start_in(Command::new(bin("kvmesh-sim-engine")), name, args)
    }

    /// [`Sim::start`] by `cmd` (the sim's binary, or a wrapper such as `ip netns exec` that
    /// runs it).
    pub fn start_in(mut cmd: Command, name: &str, args: &[&str]) -> Sim {
        let mut child = cmd
            .args(["--listen", "127.0.0.1:0", "--name", name])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn sim engine");
        let addr = announced_addr(&mut child, "sim engine");
        Sim {
            child,
            addr,
            name: name.into(),
        }
    }

    /// Zero-latency engine (answers at once).
    pub fn instant(name: &str) -> Sim {
        Sim::start(name, &["--instant"])
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Sum of the samples in a Prometheus text exposition whose line starts with `prefix`.
pub fn metric_sum(exposition: &str, prefix: &str) -> f64 {
    exposition
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Resident set of process `pid`, KiB.
pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap()
}

/// Ports handed out by this test process: the TCP and UDP pickers never return one twice,
/// so a proxy's HTTP port is never another's gossip port (gossip takes TCP on its port too,
/// for bulk transfers).
static HANDED_OUT: std::sync::Mutex<std::collections::BTreeSet<u16>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

fn unique(mut pick: impl FnMut() -> Option<u16>) -> u16 {
    loop {
        if let Some(p) = pick() {
            if HANDED_OUT.lock().unwrap().insert(p) {
                return p;
            }
        }
    }
}

/// A loopback port free for UDP and TCP alike (gossip, and its bulk transfers).
pub fn udp_port() -> u16 {
    unique(|| {
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").ok()?;
        let port = udp.local_addr().ok()?.port();
        TcpListener::bind(("127.0.0.1", port)).ok().map(|_| port)
    })
}

/// A free TCP port on loopback.
pub fn free_port() -> u16 {
    unique(|| {
        Some(
            TcpListener::bind("127.0.0.1:0")
                .ok()?
                .local_addr()
                .ok()?
                .port(),
        )
    })
}

/// Runs the reference `openai` client (`tests/support/openai_client.py`, from `.venv-peers`)
/// against `base` (`http(s)://host:port/v1`) in `mode` (`chat` or `stream`) with `env` set;
/// its JSON report (engine, text, chunks, usage). Fails the test if the client fails.
pub fn openai_client(
    base: &str,
    mode: &str,
    prompt: &str,
    env: &[(&str, &std::path::Path)],
) -> serde_json::Value {
    let out =
        Command::new(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv-peers/bin/python"))
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/tests/support/openai_client.py"
            ))
            .args([base, mode, prompt])
            .envs(env.iter().copied())
            .output()
            .expect("run the openai client");
    assert!(
        out.status.success(),
        "{mode}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `printf %s KEY | sha256sum`, via the proxy's own `hash-key` (what operators run).
pub fn hash_key(key: &str) -> String {
    let mut child = Command::new(bin("kvmesh-proxy"))
        .arg("hash-key")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(format!("{key}\n").as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// Open file descriptors of process `pid` (Linux `/proc`).
pub fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

/// `kvmesh-proxy check-config` on `toml` (written to a temporary file): whether it passed,
/// and what it printed on stderr.
pub fn check_config(toml: &str) -> (bool, String) {
    let file = std::env::temp_dir().join(format!(
        "kvmesh-check-{}-{}.toml",
        std::process::id(),
        free_port()
    ));
    std::fs::write(&file, toml).unwrap();
    let out = Command::new(bin("kvmesh-proxy"))
        .arg("check-config")
        .arg(&file)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&file);
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A child process killed (and reaped) on drop, also when an assertion fails.
pub struct Killed(pub Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A running proxy; killed on drop.
pub struct Proxy {
    pub child: Child,
    pub addr: SocketAddr,
    pub config: PathBuf,
}

pub fn engines_toml(sims: &[&Sim]) -> String {
    sims.iter()
        .map(|s| {
            format!(
                "[[engines]]\nname = \"{}\"\nurl = \"{}\"\n",
                s.name,
                s.url()
            )
        })
        .collect()
}

impl Proxy {
    /// Starts a proxy with `extra` TOML (top-level keys first) and the given engines; waits for
    /// `/ready` when `wait_ready`.
    pub fn start(extra: &str, sims: &[&Sim], wait_ready: bool) -> Proxy {
        let port = free_port();
        let toml = format!(
            "listen = \"127.0.0.1:{port}\"\nthreads = 2\nlog = \"warn\"\n{extra}\n[health]\ninterval_ms = 200\n\n{}",
            engines_toml(sims)
        );
        Proxy::start_with(&toml, port, wait_ready)
    }

    pub fn start_with(toml: &str, port: u16, wait_ready: bool) -> Proxy {
        Proxy::start_logged(toml, port, wait_ready, None)
    }

    /// [`Proxy::start_with`], its log (stderr) written to `log` when given. With `wait_ready`
    /// false it waits for the port only (a TLS listener's `/ready` needs a TLS client).
    pub fn start_logged(
        toml: &str,
        port: u16,
        wait_ready: bool,
        log: Option<&std::path::Path>,
    ) -> Proxy {
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        Proxy::start_in(
            Command::new(bin("kvmesh-proxy")),
            toml,
            addr,
            wait_ready,
            log,
        )
    }

    /// [`Proxy::start_logged`] by `cmd` (the proxy's binary, or a wrapper that runs it), its
    /// configuration listening on `addr`.
    pub fn start_in(
        mut cmd: Command,
        toml: &str,
        addr: SocketAddr,
        wait_ready: bool,
        log: Option<&std::path::Path>,
    ) -> Proxy {
        let config = std::env::temp_dir().join(format!(
            "kvmesh-test-{}-{}-{}.toml",
            std::process::id(),
            addr.ip(),
            addr.port()
        ));
        std::fs::write(&config, toml).unwrap();
        let stderr = match log {
            Some(p) => Stdio::from(std::fs::File::create(p).unwrap()),
            None => Stdio::inherit(),
        };
        let child = cmd
            .arg("--config")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("spawn proxy");
        let p = Proxy {
            child,
            addr,
            config,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let ok = TcpStream::connect(addr).is_ok()
                && (!wait_ready
                    || get(addr, "/ready")
                        .map(|r| r.status == 200)
                        .unwrap_or(false));
            if ok {
                break;
            }
            assert!(Instant::now() < deadline, "proxy did not become ready");
            std::thread::sleep(Duration::from_millis(50));
        }
        p
    }

    /// Sends SIGHUP (reload).
    pub fn sighup(&self) {
        let ok = Command::new("kill")
            .args(["-HUP", &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok);
    }

    /// Sum of a metric's samples whose line starts with `prefix`.
    pub fn metric(&self, prefix: &str) -> f64 {
        let body = String::from_utf8(get(self.addr, "/metrics").unwrap().body).unwrap();
        metric_sum(&body, prefix)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.config);
    }
}

/// How a request body is framed on the wire.
#[derive(Clone, Copy, Debug)]
pub enum Framing {
    /// `Content-Length`.
    Length,
    /// `Transfer-Encoding: chunked` in chunks of this many bytes.
    Chunked(usize),
    /// `Content-Length` with `Expect: 100-continue` (waits for the 100 before sending).
    LengthExpect,
}

#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
}

fn write_request(
    s: &mut TcpStream,
    method: &str,
    path: &str,
    body: &[u8],
    framing: Framing,
    extra: &[(&str, &str)],
) -> std::io::Result<()> {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: kvmesh.test\r\nConnection: close\r\nContent-Type: application/json\r\n");
    for (k, v) in extra {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    match framing {
        Framing::Length => head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len())),
        Framing::LengthExpect => head.push_str(&format!(
            "Content-Length: {}\r\nExpect: 100-continue\r\n\r\n",
            body.len()
        )),
        Framing::Chunked(_) => head.push_str("Transfer-Encoding: chunked\r\n\r\n"),
    }
    s.write_all(head.as_bytes())?;
    match framing {
        Framing::Length => s.write_all(body)?,
        Framing::LengthExpect => {
            // Wait for "HTTP/1.1 100 Continue\r\n\r\n" before sending.
            let mut buf = [0u8; 25];
            s.read_exact(&mut buf)?;
            assert!(
                buf.starts_with(b"HTTP/1.1 100"),
                "expected 100 Continue, got {:?}",
                String::from_utf8_lossy(&buf)
            );
            s.write_all(body)?;
        }
        Framing::Chunked(n) => {
            for c in body.chunks(n.max(1)) {
                s.write_all(format!("{:x}\r\n", c.len()).as_bytes())?;
                s.write_all(c)?;
                s.write_all(b"\r\n")?;
            }
            s.write_all(b"0\r\n\r\n")?;
        }
    }
    s.flush()
}

/// A response being read incrementally.
pub struct Streaming {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    reader: BufReader<TcpStream>,
    chunked: bool,
    remaining: Option<usize>,
    done: bool,
}

impl Streaming {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The next piece of body as it arrives (a chunk, or up to 64 KiB); `None` at the end.
    pub fn next_piece(&mut self) -> std::io::Result<Option<Vec<u8>>> {
        if self.done {
            return Ok(None);
        }
        if self.chunked {
            let mut line = String::new();
            self.reader.read_line(&mut line)?;
            let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or("0"), 16)
                .unwrap_or(0);
            if size == 0 {
                self.done = true;
                return Ok(None);
            }
            let mut buf = vec![0u8; size + 2];
            self.reader.read_exact(&mut buf)?;
            buf.truncate(size);
            return Ok(Some(buf));
        }
        let want = self.remaining.unwrap_or(64 * 1024).min(64 * 1024);
        if want == 0 {
            self.done = true;
            return Ok(None);
        }
        let mut buf = vec![0u8; want];
        let n = self.reader.read(&mut buf)?;
        if n == 0 {
            self.done = true;
            return Ok(None);
        }
        buf.truncate(n);
        if let Some(r) = self.remaining.as_mut() {
            *r -= n;
        }
        Ok(Some(buf))
    }

    pub fn into_resp(mut self) -> std::io::Result<Resp> {
        let mut body = Vec::new();
        while let Some(p) = self.next_piece()? {
            body.extend_from_slice(&p);
        }
        Ok(Resp {
            status: self.status,
            headers: self.headers,
            body,
        })
    }
}

/// Sends a request and returns once the response head has arrived.
pub fn start_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &[u8],
    framing: Framing,
    extra: &[(&str, &str)],
) -> std::io::Result<Streaming> {
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    write_request(&mut s, method, path, body, framing, extra)?;
    let mut reader = BufReader::new(s);
    loop {
        let mut status_line = String::new();
        reader.read_line(&mut status_line)?;
        let status: u16 = status_line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let mut headers = Vec::new();
        loop {
            let mut l = String::new();
            reader.read_line(&mut l)?;
            let l = l.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':') {
                headers.push((k.trim().to_string(), v.trim().to_string()));
            }
        }
        if status == 100 {
            continue;
        }
        let chunked = headers
            .iter()
            .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
        let remaining = headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
            .and_then(|(_, v)| v.parse().ok());
        return Ok(Streaming {
            status,
            headers,
            reader,
            chunked,
            remaining,
            done: false,
        });
    }
}

pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &[u8],
    framing: Framing,
    extra: &[(&str, &str)],
) -> std::io::Result<Resp> {
    start_request(addr, method, path, body, framing, extra)?.into_resp()
}

/// A HEAD request on a connection the server is asked to close: its status, its
/// `Content-Length`, and how many bytes came after the header section (none from a server that
/// leaves the body out, as it must).
pub fn head(addr: SocketAddr, path: &str) -> (u16, Option<usize>, usize) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "HEAD {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut all = Vec::new();
    s.read_to_end(&mut all).expect("read to close");
    let end = all
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a header section")
        + 4;
    let head = String::from_utf8_lossy(&all[..end]).to_string();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let length = head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim()
            .eq_ignore_ascii_case("content-length")
            .then(|| v.trim().parse().ok())?
    });
    (status, length, all.len() - end)
}

pub fn get(addr: SocketAddr, path: &str) -> std::io::Result<Resp> {
    request(addr, "GET", path, b"", Framing::Length, &[])
}

pub fn post(addr: SocketAddr, path: &str, body: &[u8]) -> Resp {
    request(addr, "POST", path, body, Framing::Length, &[]).expect("request")
}

/// A chat body with one user message.
pub fn chat_body(model: &str, content: &str, extra: &str) -> Vec<u8> {
    let content = serde_json::to_string(content).unwrap();
    format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":{content}}}]{extra}}}"#)
        .into_bytes()
}

/// Deterministic pseudo-random text of `len` bytes from `seed` (distinct seeds, distinct text).
pub fn text(seed: u64, len: usize) -> String {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (b'a' + (x % 26) as u8) as char
        })
        .collect()
}

/// Polls `f` until it returns true or `timeout` passes.
pub fn eventually(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    f()
}

/// Sends a request head and the first `sent` bytes of a `Content-Length: total` body, and
/// stops: a client still uploading. Finish it with [`finish_upload`].
pub fn start_upload(addr: SocketAddr, path: &str, body: &[u8], sent: usize) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: kvmesh.test\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(&body[..sent]).unwrap();
    s.flush().unwrap();
    s
}

/// Sends the rest of an upload begun with [`start_upload`] and reads the whole response.
pub fn finish_upload(mut s: TcpStream, body: &[u8], sent: usize) -> Resp {
    s.write_all(&body[sent..]).unwrap();
    s.flush().unwrap();
    read_response(s).unwrap()
}

/// Reads one response by its framing (`Content-Length`), not waiting for the connection to
/// close: for clients still sending when the proxy answers.
pub fn read_framed_response(s: &mut TcpStream) -> std::io::Result<Resp> {
    let mut raw = Vec::new();
    let mut byte = [0u8; 1];
    while !raw.ends_with(b"\r\n\r\n") {
        if s.read(&mut byte)? == 0 {
            return Err(std::io::Error::other(format!(
                "connection closed after {} bytes of response head",
                raw.len()
            )));
        }
        raw.push(byte[0]);
    }
    let (status, headers) = parse_head(&raw);
    let len = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; len];
    s.read_exact(&mut body)?;
    Ok(Resp {
        status,
        headers,
        body,
    })
}

/// Status code and headers of a response head (0 when the status line is unreadable).
fn parse_head(raw: &[u8]) -> (u16, Vec<(String, String)>) {
    let head = String::from_utf8_lossy(raw);
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    (status, headers)
}

/// Reads one `Connection: close` response to EOF and parses it.
pub fn read_response(mut s: TcpStream) -> std::io::Result<Resp> {
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| std::io::Error::other(format!("no response head in {} bytes", raw.len())))?;
    let (status, headers) = parse_head(&raw[..end]);
    Ok(Resp {
        status,
        headers,
        body: raw[end + 4..].to_vec(),
    })
}

/// A running picker (`mode = "picker"`); killed on drop.
pub struct Picker {
    pub child: Child,
    /// ext_proc gRPC port.
    pub ext_proc: u16,
    /// gRPC health port.
    pub health: u16,
    /// `/metrics`, `/ready` address.
    pub metrics: SocketAddr,
    pub config: PathBuf,
}

impl Picker {
    /// Starts a picker in front of `sims` with `extra` top-level TOML (tables allowed after
    /// it) and waits for its `/ready`.
    pub fn start(sims: &[&Sim], extra: &str) -> Picker {
        Picker::start_inner(sims, extra, "", 200, true)
    }

    /// As [`Picker::start`], probing engines only every `health_ms`.
    pub fn start_probing_every(sims: &[&Sim], health_ms: u64) -> Picker {
        Picker::start_inner(sims, "", "", health_ms, true)
    }

    /// As [`Picker::start`], with more `[picker]` keys (inline-table syntax, e.g.
    /// `fallbacks = 2`).
    pub fn start_with(sims: &[&Sim], extra: &str, picker_keys: &str) -> Picker {
        Picker::start_inner(sims, extra, picker_keys, 200, true)
    }

    /// As [`Picker::start`], without waiting for `/ready` (only for its metrics listener).
    pub fn start_unready(extra: &str) -> Picker {
        Picker::start_inner(&[], extra, "", 200, false)
    }

    fn start_inner(
        sims: &[&Sim],
        extra: &str,
        picker_keys: &str,
        health_ms: u64,
        wait_ready: bool,
    ) -> Picker {
        let picker_keys = if picker_keys.is_empty() {
            String::new()
        } else {
            format!(", {picker_keys}")
        };
        let (ext_proc, health, metrics) = (free_port(), free_port(), free_port());
        let toml = format!(
            "mode = \"picker\"\nthreads = 2\nlog = \"warn\"\n\
             picker = {{ listen = \"127.0.0.1:{ext_proc}\", health_listen = \"127.0.0.1:{health}\", \
             metrics_listen = \"127.0.0.1:{metrics}\"{picker_keys} }}\nhealth = {{ interval_ms = {health_ms} }}\n{extra}\n\n{}",
            engines_toml(sims)
        );
        let config = std::env::temp_dir().join(format!(
            "kvmesh-picker-{}-{ext_proc}.toml",
            std::process::id()
        ));
        std::fs::write(&config, toml).unwrap();
        let child = Command::new(bin("kvmesh-proxy"))
            .arg("--config")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn picker");
        let p = Picker {
            child,
            ext_proc,
            health,
            metrics: format!("127.0.0.1:{metrics}").parse().unwrap(),
            config,
        };
        assert!(
            eventually(Duration::from_secs(20), || get(p.metrics, "/ready")
                .is_ok_and(|r| r.status == 200 || (!wait_ready && r.status == 503))),
            "picker did not become ready"
        );
        p
    }

    pub fn metric(&self, prefix: &str) -> f64 {
        let body = String::from_utf8(get(self.metrics, "/metrics").unwrap().body).unwrap();
        metric_sum(&body, prefix)
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Picker {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_file(&self.config);
    }
}
