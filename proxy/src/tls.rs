//! TLS with rustls: the listener's certificate and client-certificate verifier (both reloaded
//! from their files without dropping connections), the identity in a peer's certificate (for
//! the hop header's mTLS trust), and the settings of `https://` upstreams.
//!
//! A reload builds the new certificate and verifier completely before swapping them in: files
//! that do not load (or a certificate outside its validity period) are refused with the reason
//! and the old ones stay in force. Handshakes after the swap use the new files; connections
//! already open keep theirs.

use std::sync::Arc;
use std::time::SystemTime;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora::listeners::tls::TlsSettings;
use pingora::listeners::TlsAccept;
use pingora::protocols::tls::TlsRef;
use pingora::utils::tls::CertKey;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme};
use x509_parser::extensions::GeneralName;
use x509_parser::prelude::{FromDer, X509Certificate};

use crate::config::{TlsConfig, UpstreamConfig};

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

fn file_error(path: &str, message: impl std::fmt::Display) -> TlsError {
    TlsError::File {
        path: path.to_string(),
        message: message.to_string(),
    }
}

/// The certificates of a PEM file, leaf first.
pub fn read_certs(path: &str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| file_error(path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_error(path, e))?;
    if certs.is_empty() {
        return Err(file_error(path, "no PEM certificate in the file"));
    }
    Ok(certs)
}

/// The private key of a PEM file.
pub fn read_key(path: &str) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path)
        .map_err(|e| file_error(path, format!("no usable private key: {e}")))
}

/// A root store of the CA certificates in a PEM file.
fn read_roots(path: &str) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for c in read_certs(path)? {
        roots
            .add(c)
            .map_err(|e| file_error(path, format!("not a usable CA certificate: {e}")))?;
    }
    Ok(roots)
}

/// Checks that a certificate is inside its validity period now.
fn check_validity(path: &str, der: &[u8]) -> Result<(), TlsError> {
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

/// The files of the listener's TLS (`[tls]`).
#[derive(Debug, Clone)]
pub struct ListenerFiles {
    cert: String,
    key: String,
    client_ca: String,
    require_client_cert: bool,
}

/// What one load of the listener's files gives.
struct Loaded {
    key: Arc<CertifiedKey>,
    verifier: Option<Arc<dyn ClientCertVerifier>>,
    /// The files' contents as loaded: a reload happens when they change.
    fingerprint: blake3::Hash,
}

impl ListenerFiles {
    /// The files named by `[tls]`.
    pub fn from_config(cfg: &TlsConfig) -> Self {
        ListenerFiles {
            cert: cfg.cert_file.clone(),
            key: cfg.key_file.clone(),
            client_ca: cfg.client_ca_file.clone(),
            require_client_cert: cfg.require_client_cert,
        }
    }

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

/// The listener's TLS state: the certificate and client verifier in force, swapped on reload.
pub struct ListenerTls {
    files: ListenerFiles,
    current: ArcSwap<Loaded>,
}

impl std::fmt::Debug for ListenerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ListenerTls")
            .field("files", &self.files)
            .finish()
    }
}

impl ListenerTls {
    /// Loads `[tls]`'s files.
    pub fn new(cfg: &TlsConfig) -> Result<Arc<Self>, TlsError> {
        let files = ListenerFiles::from_config(cfg);
        let loaded = files.load_all()?;
        Ok(Arc::new(ListenerTls {
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

    /// Pingora listener settings that take the certificate and verifier in force at each
    /// handshake and record the client certificate's identity ([`PeerCert`]).
    pub fn settings(self: &Arc<Self>) -> pingora::Result<TlsSettings> {
        let mut s = TlsSettings::with_callbacks(Box::new(RecordPeerCert))?;
        s.set_cert_resolver(Arc::new(Resolver(self.clone())));
        if self.current.load().verifier.is_some() {
            s.set_client_cert_verifier(Arc::new(Verifier {
                tls: self.clone(),
                mandatory: self.files.require_client_cert,
            }));
        }
        Ok(s)
    }
}

/// Serves the certificate in force.
#[derive(Debug)]
struct Resolver(Arc<ListenerTls>);

impl ResolvesServerCert for Resolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.current.load().key.clone())
    }
}

/// Verifies client certificates with the verifier in force.
#[derive(Debug)]
struct Verifier {
    tls: Arc<ListenerTls>,
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

/// The names in a verified client certificate, kept with the connection (Pingora's TLS digest
/// extension) for the hop header's trust.
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

/// Records the client certificate's names after the handshake (the verifier has checked its
/// chain and validity by then).
struct RecordPeerCert;

#[async_trait]
impl TlsAccept for RecordPeerCert {
    async fn handshake_complete_callback(
        &self,
        tls: &TlsRef,
    ) -> Option<Arc<dyn std::any::Any + Send + Sync>> {
        let der = tls.peer_certificate_der()?;
        PeerCert::from_der(der).map(|p| Arc::new(p) as Arc<dyn std::any::Any + Send + Sync>)
    }
}

/// The identity a peer's certificate must carry (`sidecar.peer_identity`).
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
            if !rest.contains('/') {
                // Without a path separator, `spiffe://kvmesh.local` would also admit
                // `spiffe://kvmesh.local.evil/...`.
                return Err(format!("{s:?}: end the trust domain with `/`, e.g. {s}/"));
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

/// The client certificate in force, for rustls clients (the health probes).
#[derive(Debug, Default)]
struct ClientCert(ArcSwap<Option<Arc<CertifiedKey>>>);

impl rustls::client::ResolvesClientCert for ClientCert {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        self.0.load().as_ref().clone()
    }

    fn has_certs(&self) -> bool {
        self.0.load().is_some()
    }
}

/// The upstream client certificate as both TLS stacks want it.
struct ClientPair {
    pingora: Arc<CertKey>,
    rustls: Arc<CertifiedKey>,
}

/// TLS towards `https://` engines and peers (`[upstream]`): the CA bundle (read at start: the
/// Pingora connector and the health probes use it) and the client certificate presented, which
/// a reload replaces (SIGHUP, or a change of its files).
pub struct UpstreamTls {
    ca_file: String,
    cert_file: String,
    key_file: String,
    client: ArcSwap<Option<Arc<CertKey>>>,
    resolver: Arc<ClientCert>,
    fingerprint: parking_lot::Mutex<Option<blake3::Hash>>,
}

impl std::fmt::Debug for UpstreamTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamTls")
            .field("ca_file", &self.ca_file)
            .field("client_cert_file", &self.cert_file)
            .finish()
    }
}

impl UpstreamTls {
    /// Reads `[upstream]`'s TLS files.
    pub fn from_config(cfg: &UpstreamConfig) -> Result<Self, TlsError> {
        if !cfg.ca_file.is_empty() {
            read_roots(&cfg.ca_file)?;
        }
        let out = UpstreamTls {
            ca_file: cfg.ca_file.clone(),
            cert_file: cfg.client_cert_file.clone(),
            key_file: cfg.client_key_file.clone(),
            client: ArcSwap::from_pointee(None),
            resolver: Arc::new(ClientCert::default()),
            fingerprint: parking_lot::Mutex::new(None),
        };
        out.reload(true)?;
        Ok(out)
    }

    /// Whether a client certificate is configured.
    pub fn has_client_cert(&self) -> bool {
        !self.cert_file.is_empty()
    }

    /// The client certificate for Pingora's upstream connections, if any.
    pub fn client_cert(&self) -> Option<Arc<CertKey>> {
        self.client.load().as_ref().clone()
    }

    fn load_client(&self) -> Result<ClientPair, TlsError> {
        let certs = read_certs(&self.cert_file)?;
        check_validity(&self.cert_file, &certs[0])?;
        let key = read_key(&self.key_file)?;
        let signing = rustls::crypto::ring::default_provider()
            .key_provider
            .load_private_key(key.clone_key())
            .map_err(|e| file_error(&self.key_file, format!("unsupported private key: {e}")))?;
        let certified = CertifiedKey::new(certs.clone(), signing);
        certified.keys_match().map_err(|e| {
            TlsError::Invalid(format!(
                "{} does not match the certificate in {}: {e}",
                self.key_file, self.cert_file
            ))
        })?;
        Ok(ClientPair {
            pingora: Arc::new(CertKey::new(
                certs.iter().map(|c| c.to_vec()).collect(),
                key.secret_der().to_vec(),
            )),
            rustls: Arc::new(certified),
        })
    }

    /// Reloads the client certificate when its files changed (or always, with `force`):
    /// `Ok(true)` when a new one is in force; an error (the old one kept) when they do not load.
    pub fn reload(&self, force: bool) -> Result<bool, TlsError> {
        if !self.has_client_cert() {
            return Ok(false);
        }
        let now = fingerprint(&[&self.cert_file, &self.key_file]);
        if !force && *self.fingerprint.lock() == Some(now) {
            return Ok(false);
        }
        let pair = self.load_client()?;
        self.client.store(Arc::new(Some(pair.pingora)));
        self.resolver.0.store(Arc::new(Some(pair.rustls)));
        *self.fingerprint.lock() = Some(now);
        Ok(true)
    }

    /// A rustls client configuration with these roots, presenting the client certificate in
    /// force at each handshake (the health probes' HTTPS).
    pub fn client_config(&self) -> Result<rustls::ClientConfig, TlsError> {
        let mut roots = RootCertStore::empty();
        if self.ca_file.is_empty() {
            pingora::tls::load_platform_certs_incl_env_into_store(&mut roots)
                .map_err(|e| TlsError::Invalid(format!("loading the system's CA roots: {e}")))?;
        } else {
            roots = read_roots(&self.ca_file)?;
        }
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Invalid(e.to_string()))?
        .with_root_certificates(roots);
        Ok(if self.has_client_cert() {
            builder.with_client_cert_resolver(self.resolver.clone())
        } else {
            builder.with_no_client_auth()
        })
    }
}

/// A digest of the files' contents (missing files count as empty): any edit changes it,
/// whatever their size and modification time say.
pub(crate) fn fingerprint(paths: &[&str]) -> blake3::Hash {
    let mut h = blake3::Hasher::new();
    for p in paths {
        let bytes = if p.is_empty() {
            Vec::new()
        } else {
            std::fs::read(p).unwrap_or_default()
        };
        h.update(&(bytes.len() as u64).to_le_bytes());
        h.update(&bytes);
    }
    h.finalize()
}

#[cfg(test)]
mod tests {
    use super::*;

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
