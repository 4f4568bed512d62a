//! Certificates made for the tests (rcgen), and a blocking rustls HTTP/1.1 client that reports
//! the certificate the server presented.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use super::Resp;

/// A certificate authority.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    /// Its certificate, PEM.
    pub pem: String,
}

/// A certificate and its key, PEM.
pub struct Leaf {
    pub cert_pem: String,
    pub key_pem: String,
}

/// When a leaf is valid.
#[derive(Clone, Copy)]
pub enum Validity {
    Now,
    Expired,
    NotYetValid,
}

impl Ca {
    pub fn new(name: &str) -> Ca {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key).unwrap();
        Ca {
            pem: cert.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    /// A leaf for `names` (DNS names or IPs) and `uris` (URI SANs), usable by servers and
    /// clients.
    pub fn leaf(&self, cn: &str, names: &[&str], uris: &[&str], validity: Validity) -> Leaf {
        let key = KeyPair::generate().unwrap();
        let mut params =
            CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .unwrap();
        for u in uris {
            params
                .subject_alt_names
                .push(SanType::URI((*u).try_into().unwrap()));
        }
        params.distinguished_name.push(DnType::CommonName, cn);
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let (from, to) = match validity {
            Validity::Now => ((2020, 1, 1), (2099, 1, 1)),
            Validity::Expired => ((2020, 1, 1), (2021, 1, 1)),
            Validity::NotYetValid => ((2098, 1, 1), (2099, 1, 1)),
        };
        params.not_before = rcgen::date_time_ymd(from.0, from.1, from.2);
        params.not_after = rcgen::date_time_ymd(to.0, to.1, to.2);
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }
}

impl Leaf {
    /// Writes `<name>.crt` and `<name>.key` under `dir`; returns their paths.
    pub fn write(&self, dir: &Path, name: &str) -> (PathBuf, PathBuf) {
        let cert = dir.join(format!("{name}.crt"));
        let key = dir.join(format!("{name}.key"));
        std::fs::write(&cert, &self.cert_pem).unwrap();
        std::fs::write(&key, &self.key_pem).unwrap();
        (cert, key)
    }

    pub fn der(&self) -> Vec<u8> {
        CertificateDer::from_pem_slice(self.cert_pem.as_bytes())
            .unwrap()
            .to_vec()
    }
}

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
