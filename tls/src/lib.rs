//! kvmesh's TLS pieces, shared by the proxy (its listener, mTLS between sidecars) and kvagent
//! (its gRPC port): PEM files read and checked, a server certificate and client-certificate
//! verifier reloaded from their files without dropping connections, and the identity in a
//! peer's certificate.
//!
//! A reload builds the new certificate and verifier completely before swapping them in: files
//! that do not load (or a certificate outside its validity period) are refused with the reason
//! and the old ones stay in force. Handshakes after the swap use the new files; connections
//! already open keep theirs. The crypto provider is ring's, the one provider of the build.

use std::sync::Arc;
use std::time::SystemTime;

use arc_swap::ArcSwap;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme};
use x509_parser::extensions::GeneralName;
use x509_parser::prelude::{FromDer, X509Certificate};

pub mod config;
pub mod incoming;
pub mod reload;
#[cfg(feature = "testing")]
pub mod testing;

pub use config::TlsConfig;

/// Why TLS files cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file cannot be read or holds no usable PEM item.
    #[error("{path}: {message}")]
    File {
        /// The file.
        path: String,
        /// What is wrong with it.
        message: String,
    },
    /// The files load but do not make a usable configuration.
    #[error("{0}")]
    Invalid(String),
}

/// A [`TlsError::File`] for `path`.
pub fn file_error(path: &str, message: impl std::fmt::Display) -> TlsError {
    TlsError::File {
        path: path.to_string(),
        message: message.to_string(),
    }
}

/// The certificates of a PEM file, leaf first.
pub fn read_certs(path: &str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read_pem(path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_error(path, e))?;
    if certs.is_empty() {
        return Err(file_error(path, "no PEM certificate in the file"));
    }
    Ok(certs)
}

/// The private key of a PEM file.
pub fn read_key(path: &str) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(&read_pem(path)?)
        .map_err(|e| file_error(path, format!("no usable private key: {e}")))
}

/// Largest PEM file read: a chain of a few certificates, or a CA bundle, is tens of KiB.
pub const MAX_PEM_BYTES: u64 = 1 << 20;

/// A PEM file's bytes: a regular file (a FIFO or a device would block the reading thread,
/// which a reload's timer and shutdown run beside) of at most [`MAX_PEM_BYTES`]. Opened
/// without blocking, then checked: what is checked is what is read.
fn read_pem(path: &str) -> Result<Vec<u8>, TlsError> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| file_error(path, e))?;
    let meta = file.metadata().map_err(|e| file_error(path, e))?;
    if !meta.is_file() {
        return Err(file_error(path, "not a regular file"));
    }
    let mut bytes = Vec::new();
    file.take(MAX_PEM_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| file_error(path, e))?;
    if bytes.len() as u64 > MAX_PEM_BYTES {
        return Err(file_error(
            path,
            format!("larger than {MAX_PEM_BYTES} bytes"),
        ));
    }
    Ok(bytes)
}

/// A root store of the CA certificates in a PEM file.
pub fn read_roots(path: &str) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for c in read_certs(path)? {
        roots
            .add(c)
            .map_err(|e| file_error(path, format!("not a usable CA certificate: {e}")))?;
    }
    Ok(roots)
}

/// Checks that a certificate is inside its validity period now.
pub fn check_validity(path: &str, der: &[u8]) -> Result<(), TlsError> {
    let (_, cert) = X509Certificate::from_der(der)
        .map_err(|e| file_error(path, format!("the certificate does not parse: {e}")))?;
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let v = cert.validity();
    if now < v.not_before.timestamp() {
        return Err(file_error(
            path,
            format!("the certificate is not valid before {}", v.not_before),
        ));
    }
    if now > v.not_after.timestamp() {
        return Err(file_error(
            path,
            format!("the certificate expired at {}", v.not_after),
        ));
    }
    Ok(())
}

/// The files of a server's TLS.
#[derive(Debug, Clone, Default)]
pub struct ServerFiles {
    /// PEM certificate chain, leaf first.
    pub cert: String,
    /// Its PEM private key.
    pub key: String,
    /// PEM CA bundle client certificates are verified against; empty: none asked for.
    pub client_ca: String,
    /// Refuse clients without a certificate (needs `client_ca`).
    pub require_client_cert: bool,
}

/// What one load of the files gives.
struct Loaded {
    key: Arc<CertifiedKey>,
    verifier: Option<Arc<dyn ClientCertVerifier>>,
    /// The files' contents as loaded: a reload happens when they change.
    fingerprint: blake3::Hash,
}

impl ServerFiles {
    fn fingerprint(&self) -> blake3::Hash {
        fingerprint(&[&self.cert, &self.key, &self.client_ca])
    }

    /// Reads and checks every file: the chain parses and its leaf is valid now, the key
    /// matches the certificate, the client CA makes a verifier.
    fn load_all(&self) -> Result<Loaded, TlsError> {
        let fingerprint = self.fingerprint();
        let certs = read_certs(&self.cert)?;
        check_validity(&self.cert, &certs[0])?;
        let key = read_key(&self.key)?;
        let provider = rustls::crypto::ring::default_provider();
        let signing = provider
            .key_provider
            .load_private_key(key)
            .map_err(|e| file_error(&self.key, format!("unsupported private key: {e}")))?;
        let certified = CertifiedKey::new(certs, signing);
        certified.keys_match().map_err(|e| {
            TlsError::Invalid(format!(
                "{} does not match the certificate in {}: {e}",
                self.key, self.cert
            ))
        })?;
        let verifier = if self.client_ca.is_empty() {
            None
        } else {
            let roots = Arc::new(read_roots(&self.client_ca)?);
            let builder = WebPkiClientVerifier::builder_with_provider(roots, Arc::new(provider));
            let builder = if self.require_client_cert {
                builder
            } else {
                builder.allow_unauthenticated()
            };
            Some(builder.build().map_err(|e| {
                file_error(
                    &self.client_ca,
                    format!("cannot verify clients with it: {e}"),
                )
            })?)
        };
        Ok(Loaded {
            key: Arc::new(certified),
            verifier,
            fingerprint,
        })
    }

    /// Checks that the files load (for `check-config` and start-up).
    pub fn load(&self) -> Result<(), TlsError> {
        self.load_all().map(|_| ())
    }
}

/// A server's TLS state: the certificate and client verifier in force, swapped on reload.
pub struct ServerTls {
    files: ServerFiles,
    current: ArcSwap<Loaded>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("files", &self.files)
            .finish()
    }
}

impl ServerTls {
    /// Loads `files`.
    pub fn new(files: ServerFiles) -> Result<Arc<Self>, TlsError> {
        let loaded = files.load_all()?;
        Ok(Arc::new(ServerTls {
            files,
            current: ArcSwap::from_pointee(loaded),
        }))
    }

    /// Reloads the files when one changed (or always, with `force`): `Ok(true)` when new ones
    /// are in force, an error (and the old ones kept) when they do not load.
    pub fn reload(&self, force: bool) -> Result<bool, TlsError> {
        if !force && self.files.fingerprint() == self.current.load().fingerprint {
            return Ok(false);
        }
        let loaded = self.files.load_all()?;
        self.current.store(Arc::new(loaded));
        Ok(true)
    }

    /// What serves the certificate in force at each handshake.
    pub fn cert_resolver(self: &Arc<Self>) -> Arc<dyn ResolvesServerCert> {
        Arc::new(Resolver(self.clone()))
    }

    /// What verifies client certificates with the CA in force; `None` when no client CA is
    /// configured.
    pub fn client_verifier(self: &Arc<Self>) -> Option<Arc<dyn ClientCertVerifier>> {
        self.current.load().verifier.as_ref()?;
        Some(Arc::new(Verifier {
            tls: self.clone(),
            mandatory: self.files.require_client_cert,
        }))
    }

    /// A rustls server configuration (TLS 1.2 and 1.3, ring) over [`Self::cert_resolver`] and
    /// [`Self::client_verifier`], for servers that run rustls themselves.
    pub fn server_config(self: &Arc<Self>) -> Result<rustls::ServerConfig, TlsError> {
        let builder = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Invalid(e.to_string()))?;
        let verifies = self.client_verifier();
        let builder = match verifies.clone() {
            Some(v) => builder.with_client_cert_verifier(v),
            None => builder.with_no_client_auth(),
        };
        let mut config = builder.with_cert_resolver(self.cert_resolver());
        if verifies.is_some() {
            // A resumed session keeps the client identity it was made with: with client
            // certificates, every connection is verified against the CA in force.
            config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
            config.send_tls13_tickets = 0;
        }
        Ok(config)
    }
}

/// Serves the certificate in force.
#[derive(Debug)]
struct Resolver(Arc<ServerTls>);

impl ResolvesServerCert for Resolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.current.load().key.clone())
    }
}

/// Verifies client certificates with the verifier in force.
#[derive(Debug)]
struct Verifier {
    tls: Arc<ServerTls>,
    mandatory: bool,
}

impl Verifier {
    fn with<T>(
        &self,
        f: impl FnOnce(&dyn ClientCertVerifier) -> Result<T, rustls::Error>,
    ) -> Result<T, rustls::Error> {
        match self.tls.current.load().verifier.as_deref() {
            Some(v) => f(v),
            None => Err(rustls::Error::General(
                "client certificates are not accepted".into(),
            )),
        }
    }
}

impl ClientCertVerifier for Verifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        self.mandatory
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        // The hints would borrow from the verifier in force, which a reload may replace; kvmesh
        // peers present their one cluster certificate without them.
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.with(|v| v.verify_client_cert(end_entity, intermediates, now))
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.with(|v| v.verify_tls12_signature(message, cert, dss))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.with(|v| v.verify_tls13_signature(message, cert, dss))
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        rustls::crypto::ring::default_provider()
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// The names in a verified client certificate (kept with the connection by the server that
/// verified it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerCert {
    /// URI SANs (e.g. `spiffe://kvmesh.local/node/a`).
    pub uris: Vec<String>,
    /// DNS SANs.
    pub dns: Vec<String>,
}

impl PeerCert {
    /// The SANs of a DER certificate (`None` when it does not parse).
    pub fn from_der(der: &[u8]) -> Option<Self> {
        let (_, cert) = X509Certificate::from_der(der).ok()?;
        let mut out = PeerCert::default();
        if let Ok(Some(san)) = cert.subject_alternative_name() {
            for name in &san.value.general_names {
                match name {
                    GeneralName::URI(u) => out.uris.push(u.to_string()),
                    GeneralName::DNSName(d) => out.dns.push(d.to_ascii_lowercase()),
                    _ => {}
                }
            }
        }
        Some(out)
    }
}

/// The identity a peer's certificate must carry (the proxy's `sidecar.peer_identity`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerIdentity {
    /// Any URI SAN starting with this prefix.
    UriPrefix(String),
    /// A DNS SAN in this domain, one label deep (`*.kvmesh.svc` -> `a.kvmesh.svc`).
    DnsWildcard(String),
    /// This exact DNS SAN.
    Dns(String),
}

impl PeerIdentity {
    /// Parses `spiffe://domain/...`-style prefixes and DNS names or `*.` patterns.
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s.is_empty() {
            return Err(
                "empty: name the cluster's identity, e.g. \"spiffe://kvmesh.local/\" or \"*.kvmesh.svc\""
                    .into(),
            );
        }
        if let Some((scheme, rest)) = s.split_once("://") {
            if scheme.is_empty() || rest.is_empty() {
                return Err(format!(
                    "{s:?} is not a URI prefix such as spiffe://kvmesh.local/"
                ));
            }
            if !s.ends_with('/') {
                // Without the separator, `spiffe://kvmesh.local` would also admit
                // `spiffe://kvmesh.local.evil/...` (and `.../node` would admit `.../node-evil/`).
                return Err(format!("{s:?}: end the prefix with `/`, e.g. {s}/"));
            }
            return Ok(PeerIdentity::UriPrefix(s.to_string()));
        }
        let lower = s.to_ascii_lowercase();
        let valid_dns = |d: &str| {
            !d.is_empty()
                && d.split('.').all(|l| {
                    !l.is_empty() && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                })
        };
        match lower.strip_prefix("*.") {
            Some(domain) if valid_dns(domain) => Ok(PeerIdentity::DnsWildcard(domain.to_string())),
            None if valid_dns(&lower) => Ok(PeerIdentity::Dns(lower)),
            _ => Err(format!(
                "{s:?} is neither a URI prefix (spiffe://...) nor a DNS name or *.domain pattern"
            )),
        }
    }

    /// Whether `cert` carries this identity.
    pub fn matches(&self, cert: &PeerCert) -> bool {
        match self {
            PeerIdentity::UriPrefix(p) => cert.uris.iter().any(|u| u.starts_with(p.as_str())),
            PeerIdentity::Dns(d) => cert.dns.iter().any(|n| n == d),
            PeerIdentity::DnsWildcard(domain) => cert.dns.iter().any(|n| {
                n.split_once('.').is_some_and(|(label, rest)| {
                    !label.is_empty() && label != "*" && rest == domain
                })
            }),
        }
    }
}

/// A digest of the files' contents (files that cannot be read as PEM files, missing ones
/// included, count as empty): any edit changes it, whatever their size and modification
/// time say.
pub fn fingerprint(paths: &[&str]) -> blake3::Hash {
    let mut h = blake3::Hasher::new();
    for p in paths {
        let bytes = if p.is_empty() {
            Vec::new()
        } else {
            read_pem(p).unwrap_or_default()
        };
        h.update(&(bytes.len() as u64).to_le_bytes());
        h.update(&bytes);
    }
    h.finalize()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::unwrap_used)]
    fn pem_files_must_be_regular_and_small() {
        let dir = std::env::temp_dir().join(format!("kvmesh-tls-pem-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("fifo.pem");
        let _ = std::fs::remove_file(&fifo);
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        assert!(made.unwrap().success(), "mkfifo");
        let big = dir.join("big.pem");
        std::fs::write(&big, vec![b'a'; MAX_PEM_BYTES as usize + 1]).unwrap();
        // Read on this thread: a FIFO opened for reading would block it for ever.
        for (path, needle) in [
            (fifo, "not a regular file"),
            ("/dev/zero".into(), "not a regular file"),
            (big, "larger than"),
        ] {
            let e = read_key(path.to_str().unwrap()).unwrap_err().to_string();
            assert!(e.contains(needle), "{}: {e}", path.display());
        }
        assert_eq!(fingerprint(&["/dev/zero"]), fingerprint(&[""]));
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn cert(uris: &[&str], dns: &[&str]) -> PeerCert {
        PeerCert {
            uris: uris.iter().map(|s| s.to_string()).collect(),
            dns: dns.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn peer_identity_patterns() {
        let spiffe = PeerIdentity::parse("spiffe://kvmesh.local/").unwrap();
        assert!(spiffe.matches(&cert(&["spiffe://kvmesh.local/node/a"], &[])));
        assert!(!spiffe.matches(&cert(&["spiffe://other.local/node/a"], &[])));
        assert!(!spiffe.matches(&cert(&[], &["kvmesh.local"])));
        let wild = PeerIdentity::parse("*.kvmesh.svc").unwrap();
        assert!(wild.matches(&cert(&[], &["a.kvmesh.svc"])));
        assert!(!wild.matches(&cert(&[], &["a.b.kvmesh.svc"])));
        assert!(!wild.matches(&cert(&[], &["kvmesh.svc"])));
        assert!(!wild.matches(&cert(&[], &["*.kvmesh.svc"])));
        let exact = PeerIdentity::parse("Node-A.kvmesh.svc").unwrap();
        assert!(exact.matches(&cert(&[], &["node-a.kvmesh.svc"])));
        assert!(!exact.matches(&cert(&[], &["node-b.kvmesh.svc"])));
        assert!(
            PeerIdentity::parse("spiffe://kvmesh.local").is_err(),
            "no boundary"
        );
        for bad in ["", "://x", "spiffe://", "a..b", "*.", "a b"] {
            assert!(PeerIdentity::parse(bad).is_err(), "{bad:?}");
        }
    }
}
