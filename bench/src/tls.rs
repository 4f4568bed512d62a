//! Test certificates for the TLS rows of the benchmarks: a throw-away CA and a server
//! certificate for 127.0.0.1, written to a temp directory, and a client that trusts the CA.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;

/// A CA and a `127.0.0.1` server certificate on disk (removed on drop).
pub struct BenchPki {
    dir: PathBuf,
    /// The server certificate (PEM).
    pub cert_file: PathBuf,
    /// Its key (PEM).
    pub key_file: PathBuf,
    ca_pem: String,
}

impl BenchPki {
    /// Makes the CA and the certificate under a fresh temp directory.
    pub fn new() -> anyhow::Result<Self> {
        use kvmesh_tls::testing::{Ca, Validity};
        let dir = std::env::temp_dir().join(format!("kvmesh-bench-pki-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let ca = Ca::new("kvmesh bench CA");
        let (cert_file, key_file) = ca
            .leaf("127.0.0.1", &["127.0.0.1"], &[], Validity::Now)
            .write(&dir, "server");
        Ok(BenchPki {
            dir,
            cert_file,
            key_file,
            ca_pem: ca.pem.clone(),
        })
    }

    /// A client configuration trusting the CA.
    pub fn client_config(&self) -> anyhow::Result<rustls::ClientConfig> {
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(self.ca_pem.as_bytes()) {
            roots.add(c.context("the bench CA")?)?;
        }
        Ok(builder()?
            .with_root_certificates(roots)
            .with_no_client_auth())
    }
}

impl Drop for BenchPki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn builder() -> anyhow::Result<rustls::ConfigBuilder<rustls::ClientConfig, rustls::WantsVerifier>> {
    Ok(rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?)
}

/// A client configuration trusting no certificate (for clients that only speak `http://`).
pub fn no_roots() -> rustls::ClientConfig {
    builder()
        .expect("ring supports rustls' default protocol versions")
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth()
}
