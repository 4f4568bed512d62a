//! What a reload of the configuration file may change while the proxy runs, and what needs a
//! restart. A reload compares the configuration in force with the file's, key by key (as TOML),
//! takes the changed keys listed in [`RELOADABLE`] and keeps the old value of every other
//! changed key, naming it, so that the operator knows a restart is pending.

use super::{ConfigError, ProxyConfig};

/// The keys a reload applies: a dotted key, or a table or array every key under which is.
/// Everything else (listeners, mode, threads, caps sized at start, `[cluster]`, `[residency]`,
/// `[health]`, TLS file paths, `routing.block_bytes`, which every digest depends on, ...) takes
/// a restart. The contents of the TLS files and of `auth.key_file` are reloaded on their own,
/// whatever this list says (see [`crate::reload`]).
pub const RELOADABLE: &[&str] = &[
    "policy",
    "log",
    "max_body_bytes",
    "body_read_timeout_secs",
    "engines",
    "routing.decode_cost_bytes",
    "routing.uncached_weight",
    "routing.balance_abs_threshold",
    "routing.balance_rel_threshold",
    "routing.session_header",
    "routing.forward_digests",
    "routing.max_prefix_blocks",
    "upstream.connect_timeout_ms",
    "upstream.read_timeout_secs",
    "upstream.tcp_user_timeout_ms",
    "upstream.max_attempts",
    "sidecar.forward_min_saving",
    "sidecar.cold_placement",
    "sidecar.home_load_bound",
    "sidecar.home_choices",
    "auth.keys",
    "admission.deadline_header",
    "admin.on_api_listener",
];

/// The outcome of comparing the configuration in force with a newly read one.
#[derive(Debug)]
pub struct ReloadPlan {
    /// The configuration to put in force: the old one with the reloadable changes applied.
    pub cfg: ProxyConfig,
    /// Changed keys that are applied (dotted, in key order).
    pub applied: Vec<String>,
    /// Changed keys that keep their old value until a restart (dotted, in key order).
    pub needs_restart: Vec<String>,
}

impl ReloadPlan {
    /// Whether the new file changes nothing at all.
    pub fn is_unchanged(&self) -> bool {
        self.applied.is_empty() && self.needs_restart.is_empty()
    }
}

/// Whether a change of `key` is applied by a reload.
pub fn is_reloadable(key: &str) -> bool {
    RELOADABLE.iter().any(|r| {
        key == *r
            || key
                .strip_prefix(r)
                .is_some_and(|rest| rest.starts_with('.'))
    })
}

/// Compares `old` (in force) with `new` (validated, as read from the file): what to apply, what
/// waits for a restart. An error when the mix of the two is not a valid configuration (a new
/// value that is only valid together with a change that needs a restart).
pub fn plan(old: &ProxyConfig, new: &ProxyConfig) -> Result<ReloadPlan, ConfigError> {
    let as_toml = |c: &ProxyConfig| {
        toml::Value::try_from(c)
            .map_err(|e| ConfigError::Invalid(format!("cannot compare configurations: {e}")))
    };
    let (old_v, new_v) = (as_toml(old)?, as_toml(new)?);
    let mut changed = Vec::new();
    diff(Some(&old_v), Some(&new_v), &mut String::new(), &mut changed);
    let (mut applied, mut needs_restart): (Vec<String>, Vec<String>) =
        changed.into_iter().partition(|k| is_reloadable(k));
    let mut cfg = merge(&old_v, &new_v, &applied)?;
    // API keys are checked by an `Auth` made at start: only a proxy started with `[auth]` on
    // can change them, and only while it stays on, judged on what would be in force (keys
    // moved from the file to `auth.key_file`, which takes a restart, would leave none).
    if cfg.auth.enabled() != old.auth.enabled() {
        needs_restart.extend(applied.iter().filter(|k| k.starts_with("auth.")).cloned());
        applied.retain(|k| !k.starts_with("auth."));
        needs_restart.sort();
        cfg = merge(&old_v, &new_v, &applied)?;
    }
    let problems = cfg.problems();
    if !problems.is_empty() {
        return Err(ConfigError::Invalid(format!(
            "with the changes that need a restart ({}) left out: {}",
            needs_restart.join(", "),
            problems.join("; ")
        )));
    }
    Ok(ReloadPlan {
        cfg,
        applied,
        needs_restart,
    })
}

/// `old` with the `applied` keys taken from `new`, as a configuration.
fn merge(
    old: &toml::Value,
    new: &toml::Value,
    applied: &[String],
) -> Result<ProxyConfig, ConfigError> {
    let mut merged = old.clone();
    for key in applied {
        set(&mut merged, key, lookup(new, key));
    }
    merged
        .try_into()
        .map_err(|e| ConfigError::Invalid(format!("the reloaded configuration: {e}")))
}

/// Appends to `out` the dotted keys whose values differ: leaves of tables, arrays whole.
fn diff(
    old: Option<&toml::Value>,
    new: Option<&toml::Value>,
    path: &mut String,
    out: &mut Vec<String>,
) {
    match (old, new) {
        (Some(toml::Value::Table(a)), Some(toml::Value::Table(b))) => {
            let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
            keys.sort();
            keys.dedup();
            for k in keys {
                let len = path.len();
                if !path.is_empty() {
                    path.push('.');
                }
                path.push_str(k);
                diff(a.get(k), b.get(k), path, out);
                path.truncate(len);
            }
        }
        (a, b) if a != b => out.push(path.clone()),
        _ => {}
    }
}

fn lookup<'a>(v: &'a toml::Value, key: &str) -> Option<&'a toml::Value> {
    key.split('.').try_fold(v, |v, k| v.as_table()?.get(k))
}

/// Sets `key` in `v` to `value` (removes it for `None`), creating tables on the way.
fn set(v: &mut toml::Value, key: &str, value: Option<&toml::Value>) {
    let mut parts: Vec<&str> = key.split('.').collect();
    let Some(last) = parts.pop() else { return };
    let mut at = v;
    for p in parts {
        let Some(t) = at.as_table_mut() else { return };
        at = t
            .entry(p)
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    }
    let Some(t) = at.as_table_mut() else { return };
    match value {
        Some(x) => {
            t.insert(last.to_string(), x.clone());
        }
        None => {
            t.remove(last);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(toml: &str) -> ProxyConfig {
        let c = ProxyConfig::from_toml(toml).unwrap();
        assert!(c.problems().is_empty(), "{:?}", c.problems());
        c
    }

    const BASE: &str = r#"
        listen = "127.0.0.1:8080"
        policy = "prefix"
        [[engines]]
        name = "a"
        url = "http://127.0.0.1:9001"
        [routing]
        uncached_weight = 2.0
    "#;

    /// Reloadable changes are applied; the rest keep their old values and are named.
    #[test]
    fn reloadable_keys_apply_and_the_rest_wait_for_a_restart() {
        let old = cfg(BASE);
        let new = cfg(r#"
            listen = "127.0.0.1:9090"
            policy = "least_inflight"
            [[engines]]
            name = "a"
            url = "http://127.0.0.1:9001"
            [[engines]]
            name = "b"
            url = "http://127.0.0.1:9002"
            [routing]
            uncached_weight = 3.0
            block_bytes = 128
        "#);
        let p = plan(&old, &new).unwrap();
        assert_eq!(p.applied, ["engines", "policy", "routing.uncached_weight"]);
        assert_eq!(p.needs_restart, ["listen", "routing.block_bytes"]);
        assert_eq!(p.cfg.listen, "127.0.0.1:8080");
        assert_eq!(p.cfg.routing.block_bytes, old.routing.block_bytes);
        assert_eq!(p.cfg.routing.uncached_weight, 3.0);
        assert_eq!(p.cfg.policy.label(), "least_inflight");
        assert_eq!(p.cfg.engines.len(), 2);
        assert!(!p.is_unchanged());
        assert!(plan(&old, &old).unwrap().is_unchanged());
    }

    /// A key that goes back to its default (absent from the new file) is a change too.
    #[test]
    fn a_removed_key_reverts_to_its_default() {
        let old = cfg(BASE);
        let new = cfg(r#"
            listen = "127.0.0.1:8080"
            policy = "prefix"
            [[engines]]
            name = "a"
            url = "http://127.0.0.1:9001"
        "#);
        let p = plan(&old, &new).unwrap();
        assert_eq!(p.applied, ["routing.uncached_weight"]);
        assert_eq!(
            p.cfg.routing.uncached_weight,
            ProxyConfig::default().routing.uncached_weight
        );
    }

    /// Turning API keys on or off takes a restart; changing them while on does not.
    #[test]
    fn api_keys_change_only_while_auth_stays_on() {
        let key = |name: &str| {
            format!(
                "[[auth.keys]]\nname = \"{name}\"\nsha256 = \"{}\"\n",
                "ab".repeat(32)
            )
        };
        let off = cfg(BASE);
        let on = cfg(&format!("{BASE}\n{}", key("k1")));
        let on2 = cfg(&format!("{BASE}\n{}", key("k2")));
        let p = plan(&off, &on).unwrap();
        assert!(p.applied.is_empty());
        assert_eq!(p.needs_restart, ["auth.keys"]);
        assert!(!p.cfg.auth.enabled());
        let p = plan(&on, &on2).unwrap();
        assert_eq!(p.applied, ["auth.keys"]);
        assert_eq!(p.cfg.auth.keys[0].name, "k2");
    }

    /// Keys moved from the file into `auth.key_file` (a path, which takes a restart) would
    /// leave no key in force: the keys stay as they are, and both changes wait for a restart.
    #[test]
    fn moving_keys_to_a_key_file_does_not_empty_the_keyring() {
        let dir = std::env::temp_dir().join(format!("kvmesh-reload-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("keys.toml");
        std::fs::write(
            &file,
            format!("[[keys]]\nname = \"k\"\nsha256 = \"{}\"\n", "cd".repeat(32)),
        )
        .unwrap();
        let old = cfg(&format!(
            "{BASE}\n[[auth.keys]]\nname = \"k\"\nsha256 = \"{}\"\n",
            "ab".repeat(32)
        ));
        let new = cfg(&format!(
            "{BASE}\n[auth]\nkey_file = {:?}\n",
            file.display().to_string()
        ));
        let p = plan(&old, &new).unwrap();
        assert!(p.applied.is_empty(), "{:?}", p.applied);
        assert_eq!(p.needs_restart, ["auth.key_file", "auth.keys"]);
        assert_eq!(p.cfg.auth.keys.len(), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The TOML round trip is lossless (floats, maps with dotted names, nested tables): a
    /// configuration compared with itself changes nothing, and a map entry is one key.
    #[test]
    fn a_configuration_compared_with_itself_changes_nothing() {
        let text = r#"
            listen = "127.0.0.1:8080"
            [[engines]]
            name = "a"
            url = "http://127.0.0.1:9001"
            models = ["llama-3.1"]
            [routing]
            balance_rel_threshold = 1.3333333333333333
            uncached_weight = 0.1
            [admission.model_max_inflight]
            "llama-3.1" = 2
        "#;
        let a = cfg(text);
        assert!(plan(&a, &a).unwrap().is_unchanged());
        let b = cfg(&text.replace("\"llama-3.1\" = 2", "\"llama-3.1\" = 3"));
        let p = plan(&a, &b).unwrap();
        assert_eq!(p.needs_restart, ["admission.model_max_inflight.llama-3.1"]);
        assert_eq!(p.cfg.admission.model_max_inflight["llama-3.1"], 2);
    }

    #[test]
    fn reloadable_is_by_whole_key_segments() {
        assert!(is_reloadable("engines"));
        assert!(is_reloadable("routing.uncached_weight"));
        assert!(!is_reloadable("routing.block_bytes"));
        assert!(!is_reloadable("policy_extra"));
        assert!(!is_reloadable("listen"));
    }
}
