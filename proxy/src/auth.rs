//! API keys: who may call, as which tenant, for which models, with how many requests in
//! flight.
//!
//! Keys are presented as `Authorization: Bearer <key>` and looked up by their SHA-256: the
//! configuration holds only hashes, and no key is ever logged. A key's tenant becomes the cache
//! salt of its requests ([`Principal::cache_salt`]): the digest chain's namespace and the
//! `cache_salt` the engine is sent, so two tenants never share residency or engine KV.
//! `auth.key_file` is re-read when it changes; in-flight counts survive a reload (they are kept
//! by key name).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;
use kvmesh_filters::error::{ApiError, ErrorKind};
use sha2::{Digest as _, Sha256};

use crate::config::security::{check_keys, KeyFile};
use crate::config::{ApiKeyConfig, AuthConfig};

/// The prefix of every cache salt kvmesh sets for a tenant.
const TENANT_SALT_PREFIX: &str = "tenant/";

/// The longest `Authorization` value looked at (a bearer key longer than this is invalid).
const MAX_KEY_BYTES: usize = 1024;

/// The hex SHA-256 of a key, as `[auth]` stores it.
pub fn hash_key(key: &str) -> String {
    hex_lower(&Sha256::digest(key.as_bytes()))
}

fn hex_lower(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The keys of `[auth]`: inline ones and those of `key_file`, checked together.
pub fn load_keys(cfg: &AuthConfig) -> Result<Vec<ApiKeyConfig>, String> {
    let mut keys = cfg.keys.clone();
    if !cfg.key_file.is_empty() {
        let text = std::fs::read_to_string(&cfg.key_file)
            .map_err(|e| format!("`auth.key_file` = {:?}: {e}", cfg.key_file))?;
        let file: KeyFile = toml::from_str(&text)
            .map_err(|e| format!("`auth.key_file` = {:?}: {e}", cfg.key_file))?;
        keys.extend(file.keys);
    }
    check_keys(&keys)?;
    Ok(keys)
}

/// A caller identified by its key.
#[derive(Debug)]
pub struct Principal {
    /// The key's name.
    pub name: String,
    /// The key's tenant.
    pub tenant: String,
    models: Vec<String>,
    max_inflight: u64,
    inflight: Arc<AtomicU64>,
}

impl Principal {
    /// Whether the key may use `model`.
    pub fn allows(&self, model: &str) -> bool {
        self.models.is_empty() || self.models.iter().any(|m| m == model)
    }

    /// Takes one of the key's in-flight slots; `None` at its limit.
    pub fn enter(&self) -> Option<KeySlot> {
        let n = self.inflight.fetch_add(1, Ordering::AcqRel);
        let slot = KeySlot(self.inflight.clone());
        (self.max_inflight == 0 || n < self.max_inflight).then_some(slot)
    }

    /// The cache salt of a request by this key: `tenant/<tenant>`, or `tenant/<tenant>/<salt>`
    /// with the client's own `cache_salt`. A client salt already inside this tenant's space is
    /// kept as it is (a request forwarded by a peer proxy was salted there); anything else is
    /// placed inside it, so no salt can reach another tenant's namespace.
    pub fn cache_salt(&self, client: Option<&str>) -> String {
        let own = format!("{TENANT_SALT_PREFIX}{}", self.tenant);
        match client {
            None | Some("") => own,
            Some(s)
                if s == own
                    || s.strip_prefix(own.as_str())
                        .is_some_and(|r| r.starts_with('/')) =>
            {
                s.to_string()
            }
            Some(s) => format!("{own}/{s}"),
        }
    }
}

/// One request in flight with a key; released on drop.
#[derive(Debug)]
pub struct KeySlot(Arc<AtomicU64>);

impl Drop for KeySlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

type Keyring = HashMap<[u8; 32], Arc<Principal>>;

/// The keys in force.
pub struct Auth {
    /// `[auth]` in force: a configuration reload may replace its inline keys.
    cfg: parking_lot::Mutex<AuthConfig>,
    keys: ArcSwap<Keyring>,
    /// In-flight counters by key name: a reload keeps them.
    counters: parking_lot::Mutex<HashMap<String, Arc<AtomicU64>>>,
    /// The key file's contents as loaded: a reload happens when they change.
    key_file_seen: parking_lot::Mutex<Option<blake3::Hash>>,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth")
            .field("keys", &self.keys.load().len())
            .finish()
    }
}

impl Auth {
    /// The keys of `cfg`; `None` when `[auth]` is off.
    pub fn new(cfg: &AuthConfig) -> Result<Option<Arc<Self>>, String> {
        if !cfg.enabled() {
            return Ok(None);
        }
        let auth = Auth {
            cfg: parking_lot::Mutex::new(cfg.clone()),
            keys: ArcSwap::from_pointee(HashMap::new()),
            counters: parking_lot::Mutex::new(HashMap::new()),
            key_file_seen: parking_lot::Mutex::new(None),
        };
        auth.reload(true)?;
        Ok(Some(Arc::new(auth)))
    }

    /// Number of keys in force.
    pub fn len(&self) -> usize {
        self.keys.load().len()
    }

    /// Whether no key is in force (every request is refused).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Re-reads the keys when `auth.key_file` changed (or always, with `force`): `Ok(true)`
    /// when new keys are in force; an error (old keys kept) when the file does not load.
    pub fn reload(&self, force: bool) -> Result<bool, String> {
        let cfg = self.cfg.lock().clone();
        self.load(&cfg, force)
    }

    /// Puts `keys` in force as the configuration file's inline keys (a configuration reload),
    /// with the key file's as they are now; an error (nothing changed) when they do not load.
    pub fn set_inline_keys(&self, keys: Vec<ApiKeyConfig>) -> Result<(), String> {
        let mut cfg = self.cfg.lock().clone();
        cfg.keys = keys;
        self.load(&cfg, true)?;
        *self.cfg.lock() = cfg;
        Ok(())
    }

    fn load(&self, cfg: &AuthConfig, force: bool) -> Result<bool, String> {
        let seen = (!cfg.key_file.is_empty()).then(|| crate::tls::fingerprint(&[&cfg.key_file]));
        if !force && *self.key_file_seen.lock() == seen {
            return Ok(false);
        }
        let keys = load_keys(cfg)?;
        let mut counters = self.counters.lock();
        let mut ring = Keyring::with_capacity(keys.len());
        for k in keys {
            let mut hash = [0u8; 32];
            // Checked by `check_keys`: 64 hex characters.
            if hex::decode_to_slice(&k.sha256, &mut hash).is_err() {
                return Err(format!("API key {:?}: `sha256` is not hexadecimal", k.name));
            }
            let inflight = counters.entry(k.name.clone()).or_default().clone();
            ring.insert(
                hash,
                Arc::new(Principal {
                    tenant: if k.tenant.is_empty() {
                        k.name.clone()
                    } else {
                        k.tenant
                    },
                    name: k.name,
                    models: k.models,
                    max_inflight: k.max_inflight,
                    inflight,
                }),
            );
        }
        // Counters of removed keys go once no request holds them.
        counters
            .retain(|name, c| ring.values().any(|p| &p.name == name) || Arc::strong_count(c) > 1);
        drop(counters);
        self.keys.store(Arc::new(ring));
        *self.key_file_seen.lock() = seen;
        Ok(true)
    }

    /// The caller of a request with this `Authorization` header value: 401 without a bearer
    /// key or with one not in force.
    pub fn authenticate(&self, authorization: Option<&[u8]>) -> Result<Arc<Principal>, ApiError> {
        let Some(value) = authorization else {
            return Err(ApiError::new(
                ErrorKind::Unauthorized,
                "an API key is required: send `Authorization: Bearer <key>`",
            ));
        };
        // The scheme is case-insensitive (RFC 9110).
        let key = value
            .get(..7)
            .filter(|s| s.eq_ignore_ascii_case(b"bearer "))
            .map(|_| value[7..].trim_ascii())
            .filter(|k| !k.is_empty() && k.len() <= MAX_KEY_BYTES)
            .ok_or_else(|| {
                ApiError::new(
                    ErrorKind::Unauthorized,
                    "the Authorization header must be `Bearer <key>`",
                )
            })?;
        let hash: [u8; 32] = Sha256::digest(key).into();
        self.keys.load().get(&hash).cloned().ok_or_else(|| {
            ApiError::new(
                ErrorKind::Unauthorized,
                "the API key is not valid (unknown or revoked)",
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(keys: Vec<ApiKeyConfig>) -> AuthConfig {
        AuthConfig {
            keys,
            ..Default::default()
        }
    }

    fn key(name: &str, secret: &str) -> ApiKeyConfig {
        ApiKeyConfig {
            name: name.into(),
            sha256: hash_key(secret),
            tenant: String::new(),
            models: Vec::new(),
            max_inflight: 0,
        }
    }

    #[test]
    fn sha256_of_a_key_matches_sha256sum() {
        // printf %s "" | sha256sum; printf %s abc | sha256sum
        assert_eq!(
            hash_key(""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(
            hash_key("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn bearer_keys_are_checked() {
        let mut k = key("a", "sk-a");
        k.models = vec!["m".into()];
        k.max_inflight = 1;
        let auth = Auth::new(&cfg(vec![k])).unwrap().unwrap();
        let p = auth.authenticate(Some(b"Bearer sk-a")).unwrap();
        assert_eq!(p.name, "a");
        assert!(auth.authenticate(Some(b"BEARER  sk-a ")).is_ok());
        assert!(p.allows("m") && !p.allows("other"));
        for bad in [
            None,
            Some(&b"sk-a"[..]),
            Some(b"Bearer "),
            Some(b"Bearer sk-b"),
            Some(b"Basic c2s6YQ=="),
        ] {
            let e = auth.authenticate(bad).unwrap_err();
            assert_eq!(e.status(), 401, "{bad:?}");
        }
        let slot = p.enter().unwrap();
        assert!(
            p.enter().is_none(),
            "the second request passes the key's limit"
        );
        drop(slot);
        assert!(p.enter().is_some());
    }

    #[test]
    fn tenant_salts_stay_inside_the_tenant() {
        let mut k = key("a", "sk-a");
        k.tenant = "acme".into();
        let auth = Auth::new(&cfg(vec![k])).unwrap().unwrap();
        let p = auth.authenticate(Some(b"Bearer sk-a")).unwrap();
        assert_eq!(p.cache_salt(None), "tenant/acme");
        assert_eq!(p.cache_salt(Some("s1")), "tenant/acme/s1");
        assert_eq!(p.cache_salt(Some("tenant/acme/s1")), "tenant/acme/s1");
        assert_eq!(p.cache_salt(Some("tenant/acme")), "tenant/acme");
        assert_eq!(
            p.cache_salt(Some("tenant/other")),
            "tenant/acme/tenant/other"
        );
        assert_eq!(
            p.cache_salt(Some("tenant/acmeX")),
            "tenant/acme/tenant/acmeX"
        );
    }

    #[test]
    fn key_file_reload_revokes_and_keeps_counts() {
        let dir = std::env::temp_dir().join(format!("kvmesh-auth-{}", fastrand::u64(..)));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("keys.toml");
        let write = |keys: &[(&str, &str)]| {
            let mut t = String::new();
            for (n, s) in keys {
                t.push_str(&format!(
                    "[[keys]]\nname = \"{n}\"\nsha256 = \"{}\"\n",
                    hash_key(s)
                ));
            }
            std::fs::write(&file, t).unwrap();
        };
        write(&[("a", "sk-a"), ("b", "sk-b")]);
        let c = AuthConfig {
            key_file: file.display().to_string(),
            ..Default::default()
        };
        let auth = Auth::new(&c).unwrap().unwrap();
        let a = auth.authenticate(Some(b"Bearer sk-a")).unwrap();
        let held = a.enter().unwrap();
        write(&[("a", "sk-a")]);
        assert!(auth.reload(true).unwrap());
        assert!(auth.authenticate(Some(b"Bearer sk-b")).is_err(), "revoked");
        let a2 = auth.authenticate(Some(b"Bearer sk-a")).unwrap();
        assert_eq!(a2.inflight.load(Ordering::Relaxed), 1, "count kept");
        drop(held);
        std::fs::write(&file, "[[keys]]\nname = 1\n").unwrap();
        assert!(auth.reload(true).is_err());
        assert!(
            auth.authenticate(Some(b"Bearer sk-a")).is_ok(),
            "old keys kept"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
