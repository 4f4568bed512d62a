//! Every unknown key and mistyped value of a configuration file, found in one pass over its
//! TOML against the schema (the default configuration, which has every key), so that an error
//! lists them all where serde stops at the first.

use super::env::nearest;

/// The problems of `file` against `schema`, in key order; empty when every key is
/// known and every value has its key's type. Arrays are compared as arrays (their elements are
/// left to serde), and a table whose default is empty is a map with free-form keys.
pub fn problems(file: &toml::Table, schema: &toml::Table) -> Vec<String> {
    let mut out = Vec::new();
    walk(file, schema, &mut Vec::new(), &mut out);
    out
}

fn walk<'a>(
    file: &'a toml::Table,
    schema: &toml::Table,
    path: &mut Vec<&'a str>,
    out: &mut Vec<String>,
) {
    for (key, value) in file {
        let dotted = dotted(path, key);
        match schema.get(key) {
            None => {
                let scope = if path.is_empty() {
                    "the configuration".to_string()
                } else {
                    format!("`[{}]`", path.join("."))
                };
                let hint = nearest(schema, key, 3)
                    .map(|k| format!("; did you mean `{}`?", self::dotted(path, k)))
                    .unwrap_or_default();
                out.push(format!(
                    "unknown key `{dotted}`: {scope} has no key `{key}`{hint}"
                ));
            }
            Some(toml::Value::Table(sub)) if !sub.is_empty() => match value {
                toml::Value::Table(t) => {
                    path.push(key);
                    walk(t, sub, path, out);
                    path.pop();
                }
                other => out.push(format!(
                    "`{dotted}` must be a table (`[{dotted}]`), not {}",
                    other.type_str()
                )),
            },
            Some(toml::Value::Table(_)) => {}
            Some(leaf) => {
                // serde's TOML reader takes an integer for a float, so this does too.
                let int_for_float = leaf.is_float() && value.is_integer();
                if std::mem::discriminant(leaf) != std::mem::discriminant(value) && !int_for_float {
                    out.push(format!(
                        "`{dotted}` takes {}, not {}",
                        leaf.type_str(),
                        value.type_str()
                    ));
                }
            }
        }
    }
}

fn dotted(path: &[&str], key: &str) -> String {
    let mut p = path.to_vec();
    p.push(key);
    p.join(".")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(text: &str) -> toml::Table {
        toml::from_str(text).expect("test TOML")
    }

    #[test]
    fn every_unknown_key_and_wrong_type_is_listed_with_a_hint() {
        let schema = table(
            r#"
            listen = "127.0.0.1:8080"
            max_inflight = 4096
            engines = []
            [routing]
            block_bytes = 256
            uncached_weight = 1.0
            [admission.model_max_inflight]
            "#,
        );
        let file = table(
            r#"
            lisen = "0.0.0.0:1"
            max_inflight = "many"
            engines = [{ name = "e", url = "http://e:1" }]
            routing = 3
            [admission.model_max_inflight]
            anything = 4
            "#,
        );
        assert_eq!(
            problems(&file, &schema),
            vec![
                "unknown key `lisen`: the configuration has no key `lisen`; did you mean `listen`?",
                "`max_inflight` takes integer, not string",
                "`routing` must be a table (`[routing]`), not integer",
            ]
        );
        let file = table(
            "[routing]\nblok_bytes = 1\nuncached_weight = 2\nzzz = 1\n[admission]\nqueue = true\n",
        );
        assert_eq!(
            problems(&file, &schema),
            vec![
                "unknown key `admission.queue`: `[admission]` has no key `queue`",
                "unknown key `routing.blok_bytes`: `[routing]` has no key `blok_bytes`; did you mean `routing.block_bytes`?",
                "unknown key `routing.zzz`: `[routing]` has no key `zzz`",
            ]
        );
        assert!(problems(&schema, &schema).is_empty());
    }
}
