//! Certificates for the tests (kvmesh-tls's `testing`), a scratch directory, and a blocking
//! rustls HTTP/1.1 client that reports the certificate the server presented.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[allow(unused_imports)] // not every test file uses every re-export
pub use kvmesh_tls::testing::{Ca, Leaf, Validity};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use super::Resp;

/// A scratch directory, removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Scratch {
        let d = std::env::temp_dir().join(format!(
            "kvmesh-{tag}-{}-{}",
            std::process::id(),
            fastrand_u64()
        ));
        std::fs::create_dir_all(&d).unwrap();
        Scratch(d)
    }

    pub fn file(&self, name: &str, content: &str) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, content).unwrap();
        p
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn fastrand_u64() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

/// A client trusting `ca_pem`, presenting `client` if given.
pub fn client_config(ca_pem: &str, client: Option<&Leaf>) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots);
    let mut cfg = match client {
        Some(l) => builder
            .with_client_auth_cert(
                CertificateDer::pem_slice_iter(l.cert_pem.as_bytes())
                    .map(|c| c.unwrap())
                    .collect(),
                PrivateKeyDer::from_pem_slice(l.key_pem.as_bytes()).unwrap(),
            )
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    // Every connection a full handshake: a resumed session shows the certificate of the
    // session it resumes, not the one the server now holds.
    cfg.resumption = rustls::client::Resumption::disabled();
    Arc::new(cfg)
}

/// One HTTPS request on a fresh connection (`Connection: close`): the response and the
/// server's leaf certificate (DER). An `Err` is a failed connection or handshake.
pub fn https(
    addr: SocketAddr,
    cfg: &Arc<rustls::ClientConfig>,
    method: &str,
    path: &str,
    body: &[u8],
    headers: &[(&str, &str)],
) -> std::io::Result<(Resp, Vec<u8>)> {
    let name = ServerName::IpAddress(addr.ip().into());
    let conn = rustls::ClientConnection::new(cfg.clone(), name)
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    let tcp = TcpStream::connect(addr)?;
    tcp.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !body.is_empty() {
        head.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    tls.write_all(head.as_bytes())?;
    tls.write_all(body)?;
    tls.flush()?;
    let mut raw = Vec::new();
    match tls.read_to_end(&mut raw) {
        Ok(_) => {}
        // Servers that close without close_notify: what was read is the answer.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !raw.is_empty() => {}
        Err(e) => return Err(e),
    }
    let leaf = tls
        .conn
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.to_vec())
        .unwrap_or_default();
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| std::io::Error::other("no HTTP response head"))?;
    let (status, headers) = super::parse_head(&raw[..split + 4]);
    let mut body = raw[split + 4..].to_vec();
    if headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"))
    {
        body = dechunk(&body);
    }
    Ok((
        Resp {
            status,
            headers,
            body,
        },
        leaf,
    ))
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(nl) = b.windows(2).position(|w| w == b"\r\n") {
        let size = std::str::from_utf8(&b[..nl]).unwrap_or("0");
        let n =
            usize::from_str_radix(size.split(';').next().unwrap_or("0").trim(), 16).unwrap_or(0);
        if n == 0 || b.len() < nl + 2 + n {
            break;
        }
        out.extend_from_slice(&b[nl + 2..nl + 2 + n]);
        b = &b[(nl + 4 + n).min(b.len())..];
    }
    out
}

/// `GET path` over HTTPS; `None` on a failed connection.
pub fn https_get(addr: SocketAddr, cfg: &Arc<rustls::ClientConfig>, path: &str) -> Option<Resp> {
    https(addr, cfg, "GET", path, b"", &[]).ok().map(|r| r.0)
}

/// Whether a TLS server at `addr` keeps a connection made with `cfg` after the handshake: in
/// TLS 1.3 a client finishes first, so a server that refuses the client's certificate (or its
/// absence) says so with an alert right after; a server that accepts it waits for the client.
pub fn tls_accepted(addr: SocketAddr, cfg: &Arc<rustls::ClientConfig>) -> bool {
    let name = ServerName::IpAddress(addr.ip().into());
    let Ok(conn) = rustls::ClientConnection::new(cfg.clone(), name) else {
        return false;
    };
    let Ok(tcp) = TcpStream::connect(addr) else {
        return false;
    };
    let _ = tcp.set_read_timeout(Some(Duration::from_millis(1500)));
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    let mut buf = [0u8; 64];
    match tls.read(&mut buf) {
        Err(e) => matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
        // The server spoke first (an HTTP/2 server's SETTINGS): it kept the connection.
        Ok(n) => n > 0,
    }
}
