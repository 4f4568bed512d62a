//! Configuration files: the proxy's TOML with `KVMESH_*` environment overrides, and kvagent's
//! TOML, each parsed and validated as at start. First byte selects; for the proxy, the text
//! after a NUL byte is `NAME=value` lines, the environment.
//!
//! Checked: no panic; the proxy's list of problems has no repeats, and a configuration
//! written back to TOML and read again has the same problems (what `check-config` says does not
//! depend on how the file spells its values). Configurations that name files or host names are
//! only parsed: validating them reads the disk or asks DNS, which a fuzzer must not.
#![no_main]

use libfuzzer_sys::fuzz_target;
// The capped allocator (src/lib.rs).
use kvmesh_fuzz as _;
use kvmesh_proxy::config::ProxyConfig;

/// Whether validating `cfg` would read a file or resolve a name.
fn reaches_outside(cfg: &ProxyConfig) -> bool {
    fn names_a_file(t: &toml::Table) -> bool {
        t.iter().any(|(k, v)| match v {
            toml::Value::String(s) => k.ends_with("_file") && !s.is_empty(),
            toml::Value::Table(t) => names_a_file(t),
            toml::Value::Array(a) => a.iter().any(|v| v.as_table().is_some_and(names_a_file)),
            _ => false,
        })
    }
    let not_literal = |s: &str| !s.is_empty() && s.parse::<std::net::SocketAddr>().is_err();
    let c = &cfg.cluster;
    toml::Table::try_from(cfg).map_or(true, |t| names_a_file(&t))
        || not_literal(&c.advertise)
        || not_literal(&c.gossip_listen)
        || c.seeds.iter().any(|s| not_literal(s))
}

fuzz_target!(|data: &[u8]| {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    if sel % 2 == 0 {
        let (toml, env) = text.split_once('\0').unwrap_or((text, ""));
        let vars = env.lines().filter_map(|l| {
            let (k, v) = l.split_once('=')?;
            Some((k.to_string(), v.to_string()))
        });
        let Ok(cfg) = ProxyConfig::from_toml_with_env(toml, vars) else {
            return;
        };
        if reaches_outside(&cfg) {
            return;
        }
        let problems = cfg.problems();
        for (i, p) in problems.iter().enumerate() {
            assert!(!problems[..i].contains(p), "reported twice: {p}");
        }
        let written = toml::to_string(&cfg).expect("a configuration serialises");
        let again = ProxyConfig::from_toml(&written).expect("its TOML reads back");
        assert_eq!(again.problems(), problems, "written back as:\n{written}");
    } else if let Ok(cfg) = kvagent::config::AgentConfig::from_toml(text) {
        let _ = cfg.validate();
    }
});
