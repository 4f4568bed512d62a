//! Environment overrides of any configuration key.
//!
//! `KVMESH_<KEY>` sets a top-level key and `KVMESH_<TABLE>__<KEY>` a key of a table (names
//! upper-cased, path segments joined by a double underscore): `KVMESH_LISTEN`,
//! `KVMESH_CLUSTER__NODE_ID`, `KVMESH_ROUTING__BLOCK_BYTES`. A string key takes the value as
//! it is; any other key takes a TOML value (`true`, `4096`, `["a:7946", "b:7946"]`,
//! `[{ name = "e1", url = "http://e1:8000" }]`). Containers and pods set per-node keys this
//! way over one shared file.

use super::ConfigError;

/// Every override variable starts with this.
pub const PREFIX: &str = "KVMESH_";

/// `KVMESH_*` variables that are not configuration keys: the file path, and the gossip keys'
/// comma-separated list (applied by [`super::ProxyConfig::load_with`]).
const NOT_KEYS: &[&str] = &["KVMESH_CONFIG", "KVMESH_GOSSIP_KEYS"];

/// Applies the overrides among `vars` to `table` (the parsed file), checking each name against
/// `schema` (the default configuration as TOML, which has every key) and each value against
/// the type of the key's default. Returns the names applied.
///
/// A variable whose name is an edit or two from a key (see [`nearest`]), or that names a
/// table but no key in it, is an error (a typo must not silently fall back to the file); other `KVMESH_*` names
/// (other programs' variables) are left alone.
pub fn apply(
    table: &mut toml::Table,
    schema: &toml::Table,
    vars: impl IntoIterator<Item = (String, String)>,
) -> Result<Vec<String>, ConfigError> {
    let mut applied = Vec::new();
    let mut vars: Vec<(String, String)> = vars
        .into_iter()
        .filter(|(name, _)| name.starts_with(PREFIX) && !NOT_KEYS.contains(&name.as_str()))
        .collect();
    // Deterministic order: a table override then its keys' (`KVMESH_CLUSTER` before
    // `KVMESH_CLUSTER__NODE_ID`), whatever the environment's order.
    vars.sort();
    for (name, raw) in vars {
        let path: Vec<String> = name[PREFIX.len()..]
            .split("__")
            .map(str::to_ascii_lowercase)
            .collect();
        let Some(leaf) = lookup(schema, &name, &path)? else {
            continue;
        };
        let value = typed_value(&name, &raw, leaf)?;
        set(table, &name, &path, value)?;
        applied.push(name);
    }
    Ok(applied)
}

/// The schema's value at `path`; `None` for a name that is no key and not close to one.
fn lookup<'a>(
    schema: &'a toml::Table,
    name: &str,
    path: &[String],
) -> Result<Option<&'a toml::Value>, ConfigError> {
    let mut table = schema;
    for (depth, segment) in path.iter().enumerate() {
        match table.get(segment) {
            Some(toml::Value::Table(t)) if depth + 1 < path.len() => table = t,
            Some(v) if depth + 1 == path.len() => return Ok(Some(v)),
            Some(_) => {
                return Err(ConfigError::Invalid(format!(
                    "{name}: `{}` is not a table (keys of arrays of tables cannot be set one \
                     by one; set the whole array)",
                    path[..=depth].join(".")
                )))
            }
            None => {
                let near = nearest(table, segment, 6);
                if depth == 0 && near.is_none() {
                    return Ok(None);
                }
                let scope = if depth == 0 {
                    "the configuration".to_string()
                } else {
                    format!("`[{}]`", path[..depth].join("."))
                };
                let hint = near
                    .map(|k| {
                        let mut p = path[..depth].to_vec();
                        p.push(k.to_string());
                        format!("; did you mean {}?", var_name(&p))
                    })
                    .unwrap_or_default();
                return Err(ConfigError::Invalid(format!(
                    "{name}: {scope} has no key `{segment}`{hint}"
                )));
            }
        }
    }
    Ok(None)
}

/// The variable that sets `path`.
fn var_name(path: &[String]) -> String {
    format!("{PREFIX}{}", path.join("__").to_ascii_uppercase())
}

/// The key of `table` close to `segment`, if one is: one edit (a swap of neighbours is one)
/// for keys of `min_len` to 9 letters, two from 10. Shorter keys get no suggestion: for
/// variables `min_len` is 6, so other programs' `KVMESH_HOME` or `KVMESH_MODEL` are not taken
/// for typos of `mode`.
pub(super) fn nearest<'a>(
    table: &'a toml::Table,
    segment: &str,
    min_len: usize,
) -> Option<&'a str> {
    table
        .keys()
        .filter(|k| k.len() >= min_len)
        .map(|k| (strsim::osa_distance(k, segment), k))
        .filter(|(d, k)| *d <= if k.len() >= 10 { 2 } else { 1 })
        .min()
        .map(|(_, k)| k.as_str())
}

/// `raw` as a value of the key whose default is `leaf`.
fn typed_value(name: &str, raw: &str, leaf: &toml::Value) -> Result<toml::Value, ConfigError> {
    if leaf.is_str() {
        return Ok(toml::Value::String(raw.to_string()));
    }
    let parsed: toml::Table = toml::from_str(&format!("v = {raw}")).map_err(|_| {
        ConfigError::Invalid(format!(
            "{name} = {raw:?} is not a TOML value of type {}",
            leaf.type_str()
        ))
    })?;
    let value = parsed
        .get("v")
        .cloned()
        .unwrap_or(toml::Value::Boolean(false));
    match (leaf, value) {
        (toml::Value::Float(_), toml::Value::Integer(i)) => Ok(toml::Value::Float(i as f64)),
        (l, v) if std::mem::discriminant(l) == std::mem::discriminant(&v) => Ok(v),
        (l, v) => Err(ConfigError::Invalid(format!(
            "{name} = {raw:?}: the key takes type {}, not {}",
            l.type_str(),
            v.type_str()
        ))),
    }
}

/// Sets `path` in `table`, creating the tables on the way.
fn set(
    table: &mut toml::Table,
    name: &str,
    path: &[String],
    value: toml::Value,
) -> Result<(), ConfigError> {
    let (leaf, tables) = path
        .split_last()
        .expect("a variable names at least one key");
    let mut t = table;
    for segment in tables {
        let entry = t
            .entry(segment.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        t = entry.as_table_mut().ok_or_else(|| {
            ConfigError::Invalid(format!("{name}: the file's `{segment}` is not a table"))
        })?;
    }
    t.insert(leaf.clone(), value);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema() -> toml::Table {
        toml::from_str(
            r#"
            listen = "127.0.0.1:8080"
            mode = "gateway"
            max_inflight = 4096
            engines = []
            [cluster]
            enabled = false
            node_id = ""
            seeds = []
            phi_threshold = 8.0
            "#,
        )
        .unwrap()
    }

    fn vars(v: &[(&str, &str)]) -> Vec<(String, String)> {
        v.iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    #[test]
    fn sets_typed_values_at_any_depth() {
        let mut t = toml::Table::new();
        let applied = apply(
            &mut t,
            &schema(),
            vars(&[
                ("KVMESH_LISTEN", "0.0.0.0:8080"),
                ("KVMESH_MAX_INFLIGHT", "12"),
                ("KVMESH_CLUSTER__ENABLED", "true"),
                ("KVMESH_CLUSTER__NODE_ID", "123"),
                ("KVMESH_CLUSTER__SEEDS", r#"["a:7946", "b:7946"]"#),
                ("KVMESH_CLUSTER__PHI_THRESHOLD", "9"),
                (
                    "KVMESH_ENGINES",
                    r#"[{ name = "e", url = "http://e:8000" }]"#,
                ),
                ("KVMESH_CONFIG", "/etc/kvmesh.toml"),
                ("KVMESH_ENVOY", "/usr/bin/envoy"),
                ("KVMESH_HOME", "/opt/kvmesh"),
                ("KVMESH_MODEL", "m"),
                ("PATH", "/bin"),
            ]),
        )
        .unwrap();
        assert_eq!(applied.len(), 7);
        assert_eq!(t["listen"].as_str(), Some("0.0.0.0:8080"));
        assert_eq!(t["max_inflight"].as_integer(), Some(12));
        // A string key keeps digits as a string.
        assert_eq!(t["cluster"]["node_id"].as_str(), Some("123"));
        assert_eq!(t["cluster"]["enabled"].as_bool(), Some(true));
        assert_eq!(t["cluster"]["seeds"].as_array().unwrap().len(), 2);
        assert_eq!(t["cluster"]["phi_threshold"].as_float(), Some(9.0));
        assert_eq!(t["engines"][0]["url"].as_str(), Some("http://e:8000"));
        assert!(["config", "envoy", "home", "model"]
            .iter()
            .all(|k| t.get(*k).is_none()));
    }

    #[test]
    fn an_override_replaces_the_file_and_keeps_its_siblings() {
        let mut t: toml::Table =
            toml::from_str("[cluster]\nenabled = true\nnode_id = \"file\"\n").unwrap();
        apply(
            &mut t,
            &schema(),
            vars(&[("KVMESH_CLUSTER__NODE_ID", "env")]),
        )
        .unwrap();
        assert_eq!(t["cluster"]["node_id"].as_str(), Some("env"));
        assert_eq!(t["cluster"]["enabled"].as_bool(), Some(true));
    }

    #[test]
    fn typos_and_bad_values_are_errors_naming_the_variable() {
        let err = |v: &[(&str, &str)]| {
            apply(&mut toml::Table::new(), &schema(), vars(v))
                .unwrap_err()
                .to_string()
        };
        let e = err(&[("KVMESH_LISTNE", "x")]);
        assert!(
            e.contains("KVMESH_LISTNE") && e.contains("did you mean KVMESH_LISTEN?"),
            "{e}"
        );
        let e = err(&[("KVMESH_CLUSTER__NODEID", "x")]);
        assert!(e.contains("did you mean KVMESH_CLUSTER__NODE_ID?"), "{e}");
        let e = err(&[("KVMESH_CLUSTER__NOPE", "x")]);
        assert!(e.contains("`[cluster]` has no key `nope`"), "{e}");
        let e = err(&[("KVMESH_MAX_INFLIGHT", "many")]);
        assert!(
            e.contains("KVMESH_MAX_INFLIGHT") && e.contains("integer"),
            "{e}"
        );
        let e = err(&[("KVMESH_CLUSTER__ENABLED", "1")]);
        assert!(e.contains("the key takes type boolean, not integer"), "{e}");
        let e = err(&[("KVMESH_LISTEN__X", "1")]);
        assert!(e.contains("`listen` is not a table"), "{e}");
    }
}
