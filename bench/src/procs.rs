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
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts a `kvmesh-sim-engine` on a free loopback port with `args`.
pub fn sim(name: &str, args: &[String]) -> anyhow::Result<Proc> {
    let mut child = Command::new(sibling("kvmesh-sim-engine")?)
        .args(["--listen", "127.0.0.1:0", "--name", name])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting kvmesh-sim-engine")?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().context("no stdout")?).read_line(&mut line)?;
    let addr = line
        .trim()
        .rsplit("http://")
        .next()
        .unwrap_or_default()
        .parse()
        .context("sim engine address")?;
    Ok(Proc { child, addr })
}

/// A free loopback port.
pub fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Starts `kvmesh-proxy` with `toml` (which must listen on `port`) and waits for `/ready`.
pub async fn proxy(toml: &str, port: u16) -> anyhow::Result<Proc> {
    let dir = std::env::temp_dir();
    let path = dir.join(format!("kvmesh-bench-{}-{port}.toml", std::process::id()));
    std::fs::write(&path, toml)?;
    let child = Command::new(sibling("kvmesh-proxy")?)
        .arg("--config")
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting kvmesh-proxy")?;
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
    let p = Proc { child, addr };
    let client = crate::load::client(1);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let ready = client
            .get(format!("http://{addr}/ready").parse()?)
            .await
            .map(|r| r.status().is_success())
            .unwrap_or(false);
        if ready {
            break;
        }
        if Instant::now() > deadline {
            bail!("kvmesh-proxy did not become ready on {addr}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = std::fs::remove_file(path);
    Ok(p)
}
