//! The `[tls]` table of kvmesh-proxy's and kvagent's configurations: one shape for both.

use serde::{Deserialize, Serialize};

use crate::ServerFiles;

/// The `[tls]` table: TLS (and optionally client certificates) on a server's port. Off while
/// `cert_file` is empty.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TlsConfig {
    /// PEM certificate chain, leaf first. Empty: plaintext.
    pub cert_file: String,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key_file: String,
    /// PEM CA bundle that client certificates are verified against (the cluster CA, for mTLS
    /// between kvmesh nodes). Empty: client certificates are not asked for.
    pub client_ca_file: String,
    /// Refuse clients without a valid certificate (signed by `client_ca_file`) at the handshake.
    /// Off: clients may connect without one; only a certificate they do present is checked.
    pub require_client_cert: bool,
    /// How often the certificate, key and CA files are checked for changes, seconds (they are
    /// also reloaded on SIGHUP). New handshakes use the new files; open connections continue.
    pub reload_interval_secs: u64,
}

impl Default for TlsConfig {
    fn default() -> Self {
        TlsConfig {
            cert_file: String::new(),
            key_file: String::new(),
            client_ca_file: String::new(),
            require_client_cert: false,
            reload_interval_secs: 10,
        }
    }
}

impl TlsConfig {
    /// Whether the port speaks TLS.
    pub fn enabled(&self) -> bool {
        !self.cert_file.is_empty()
    }

    /// The files, for [`crate::ServerTls`].
    pub fn files(&self) -> ServerFiles {
        ServerFiles {
            cert: self.cert_file.clone(),
            key: self.key_file.clone(),
            client_ca: self.client_ca_file.clone(),
            require_client_cert: self.require_client_cert,
        }
    }

    /// The checks both binaries make: the keys that go together, and the files load. The
    /// error names the key (`[tls]`-relative).
    pub fn check(&self) -> Result<(), String> {
        if self.enabled() == self.key_file.is_empty() {
            return Err(
                "`tls.cert_file` and `tls.key_file` go together: set both or neither".into(),
            );
        }
        if (!self.client_ca_file.is_empty() || self.require_client_cert) && !self.enabled() {
            return Err(
                "`tls.client_ca_file` and `tls.require_client_cert` need `tls.cert_file`".into(),
            );
        }
        if self.require_client_cert && self.client_ca_file.is_empty() {
            return Err("`tls.require_client_cert` needs `tls.client_ca_file`".into());
        }
        if self.reload_interval_secs == 0 {
            return Err("`tls.reload_interval_secs` must be > 0".into());
        }
        if self.enabled() {
            self.files().load().map_err(|e| format!("`[tls]`: {e}"))?;
        }
        Ok(())
    }
}
