//! The security tables of the configuration: `[tls]` (the listener), `[auth]` (API keys) and
//! `[admission]` (per-model caps), and their checks. docs/security.md explains the threat model.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// The most API keys one configuration (file and key file together) may hold.
pub const MAX_API_KEYS: usize = 100_000;

pub use kvmesh_tls::TlsConfig;

/// The `[auth]` table: bearer API keys. Off while neither `keys` nor `key_file` is set.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// Keys given in this file (`[[auth.keys]]`).
    pub keys: Vec<ApiKeyConfig>,
    /// A TOML file of `[[keys]]` tables (same fields), re-read when it changes and on SIGHUP; a
    /// file that does not parse is refused and the keys in force stay.
    pub key_file: String,
    /// How often `key_file` is checked for changes, seconds.
    pub reload_interval_secs: u64,
}

impl Default for AuthConfig {
    fn default() -> Self {
        AuthConfig {
            keys: Vec::new(),
            key_file: String::new(),
            reload_interval_secs: 10,
        }
    }
}

impl AuthConfig {
    /// Whether requests need an API key.
    pub fn enabled(&self) -> bool {
        !self.keys.is_empty() || !self.key_file.is_empty()
    }
}

/// One API key. The key itself is never stored: only its SHA-256 (`printf %s "$KEY" |
/// sha256sum`, or `kvmesh-proxy hash-key`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKeyConfig {
    /// The key's name: in logs and metrics, never the key.
    pub name: String,
    /// SHA-256 of the key, 64 hexadecimal characters.
    pub sha256: String,
    /// The tenant the key belongs to: its requests share prefix residency and engine KV only
    /// with keys of the same tenant. Default: the key's name.
    #[serde(default)]
    pub tenant: String,
    /// Models the key may use; empty: all.
    #[serde(default)]
    pub models: Vec<String>,
    /// Most requests in flight with this key at once (on this proxy); 0: no limit beyond the
    /// proxy's. Past it: 429 with `Retry-After`.
    #[serde(default)]
    pub max_inflight: u64,
}

/// A key file: `[[keys]]` tables.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyFile {
    /// The keys.
    #[serde(default)]
    pub keys: Vec<ApiKeyConfig>,
}

/// Whether `s` may name a key or a tenant: 1 to 64 of `A-Z a-z 0-9 . _ -` (tenants go into the
/// cache salt sent to engines, `tenant/<name>/...`, so no `/`).
pub fn valid_name(s: &str) -> bool {
    (1..=64).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Checks a set of keys: names, hashes, no duplicates. The error names the key.
pub fn check_keys(keys: &[ApiKeyConfig]) -> Result<(), String> {
    if keys.len() > MAX_API_KEYS {
        return Err(format!(
            "{} API keys: at most {MAX_API_KEYS} are accepted",
            keys.len()
        ));
    }
    let mut names = std::collections::HashSet::new();
    let mut hashes = std::collections::HashSet::new();
    for k in keys {
        if !valid_name(&k.name) {
            return Err(format!(
                "API key name {:?}: use 1 to 64 of A-Z a-z 0-9 . _ -",
                k.name
            ));
        }
        if !k.tenant.is_empty() && !valid_name(&k.tenant) {
            return Err(format!(
                "API key {:?}: tenant {:?}: use 1 to 64 of A-Z a-z 0-9 . _ -",
                k.name, k.tenant
            ));
        }
        if k.sha256.len() != 64 || !k.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!(
                "API key {:?}: `sha256` must be 64 hexadecimal characters (the SHA-256 of the key, \
                 not the key)",
                k.name
            ));
        }
        if !names.insert(k.name.as_str()) {
            return Err(format!("API key name {:?} appears twice", k.name));
        }
        if k.tenant.is_empty() && keys.iter().any(|o| o.tenant == k.name) {
            return Err(format!(
                "API key {:?} has no tenant, so its tenant is its name, which another key names as \
                 its tenant: set `tenant` on {:?} to share that cache deliberately, or rename it",
                k.name, k.name
            ));
        }
        if !hashes.insert(k.sha256.to_ascii_lowercase()) {
            return Err(format!(
                "API key {:?}: the same key (hash) is listed twice",
                k.name
            ));
        }
    }
    Ok(())
}

/// The `[admission]` table: caps per model, with a bounded wait.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdmissionConfig {
    /// Most requests in flight per model, by model name (e.g. `{ "llama-3-8b" = 64 }`).
    pub model_max_inflight: HashMap<String, u64>,
    /// The cap of models not listed in `model_max_inflight`; 0: none.
    pub default_model_max_inflight: u64,
    /// Requests that may wait for a model's slot at once, per model; past it: 429.
    pub queue_depth: u64,
    /// Longest wait for a model's slot, milliseconds; then 429 with `Retry-After`.
    pub queue_timeout_ms: u64,
    /// The request header carrying a time-to-first-token deadline in milliseconds: a request
    /// whose chosen engine's recent TTFT (an EWMA) is over it gets 429 at once instead of
    /// waiting for an answer that would come too late. Empty: deadlines are not read.
    pub deadline_header: String,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            model_max_inflight: HashMap::new(),
            default_model_max_inflight: 0,
            queue_depth: 64,
            queue_timeout_ms: 2000,
            deadline_header: "x-kvmesh-ttft-deadline-ms".into(),
        }
    }
}

impl AdmissionConfig {
    /// The cap of `model`, if it has one.
    pub fn cap(&self, model: &str) -> Option<u64> {
        match self.model_max_inflight.get(model) {
            Some(&n) => Some(n),
            None => {
                (self.default_model_max_inflight > 0).then_some(self.default_model_max_inflight)
            }
        }
    }

    /// Checks the values; the error names the key.
    pub fn check(&self) -> Result<(), String> {
        if let Some((m, _)) = self.model_max_inflight.iter().find(|(_, &n)| n == 0) {
            return Err(format!(
                "`admission.model_max_inflight` of {m:?} must be > 0 (leave the model out for no cap)"
            ));
        }
        if self.queue_timeout_ms > 600_000 {
            return Err("`admission.queue_timeout_ms` must be at most 600000".into());
        }
        if !self.deadline_header.is_empty()
            && http::HeaderName::from_bytes(self.deadline_header.as_bytes()).is_err()
        {
            return Err(format!(
                "`admission.deadline_header` = {:?} is not a header name",
                self.deadline_header
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str, sha: &str) -> ApiKeyConfig {
        ApiKeyConfig {
            name: name.into(),
            sha256: sha.into(),
            tenant: String::new(),
            models: Vec::new(),
            max_inflight: 0,
        }
    }

    #[test]
    fn keys_are_checked() {
        let h = "a".repeat(64);
        assert!(check_keys(&[key("a", &h)]).is_ok());
        let e = check_keys(&[key("a", "sk-plaintext")]).unwrap_err();
        assert!(e.contains("64 hexadecimal"), "{e}");
        let e = check_keys(&[key("a", &h), key("a", &"b".repeat(64))]).unwrap_err();
        assert!(e.contains("twice"), "{e}");
        let e = check_keys(&[key("a", &h), key("b", &h.to_uppercase())]).unwrap_err();
        assert!(e.contains("same key"), "{e}");
        let e = check_keys(&[key("a/b", &h)]).unwrap_err();
        assert!(e.contains("name"), "{e}");
        let mut k = key("a", &h);
        k.tenant = "x/y".into();
        assert!(check_keys(&[k]).unwrap_err().contains("tenant"));
        // `b` (no tenant: tenant "b") would silently share with `c`'s explicit tenant "b".
        let mut c = key("c", &"c".repeat(64));
        c.tenant = "b".into();
        let e = check_keys(&[key("b", &"b".repeat(64)), c.clone()]).unwrap_err();
        assert!(e.contains("tenant"), "{e}");
        let mut b = key("b", &"b".repeat(64));
        b.tenant = "b".into();
        assert!(
            check_keys(&[b, c]).is_ok(),
            "an explicit shared tenant is fine"
        );
    }

    #[test]
    fn admission_caps() {
        let mut a = AdmissionConfig::default();
        assert_eq!(a.cap("m"), None);
        a.default_model_max_inflight = 3;
        a.model_max_inflight.insert("big".into(), 1);
        assert_eq!(a.cap("m"), Some(3));
        assert_eq!(a.cap("big"), Some(1));
        a.model_max_inflight.insert("zero".into(), 0);
        assert!(a.check().is_err());
    }
}
