//! TLS in the proxy: the listener (Pingora settings over [`kvmesh_tls::ServerTls`], recording
//! each client certificate's identity for the hop header's mTLS trust), and the settings of
//! `https://` upstreams (the CA bundle, and the client certificate, reloaded).

use std::sync::Arc;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora::listeners::tls::TlsSettings;
use pingora::listeners::TlsAccept;
use pingora::protocols::tls::TlsRef;
use pingora::utils::tls::CertKey;
use rustls::sign::CertifiedKey;
use rustls::{RootCertStore, SignatureScheme};

use kvmesh_tls::{check_validity, file_error, read_certs, read_key, read_roots};
pub use kvmesh_tls::{fingerprint, PeerCert, PeerIdentity, ServerFiles, ServerTls, TlsError};

use crate::config::UpstreamConfig;

/// Pingora listener settings that take the certificate and verifier in force at each
/// handshake and record the client certificate's identity ([`PeerCert`]).
pub fn listener_settings(tls: &Arc<ServerTls>) -> pingora::Result<TlsSettings> {
    let mut s = TlsSettings::with_callbacks(Box::new(RecordPeerCert))?;
    s.set_cert_resolver(tls.cert_resolver());
    if let Some(v) = tls.client_verifier() {
        s.set_client_cert_verifier(v);
    }
    Ok(s)
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
