//! Configuration files: the proxy's TOML with `KVMESH_*` environment overrides, and kvagent's
//! TOML, each parsed and validated as at start. First byte selects; for the proxy, the text
//! after a NUL byte is `NAME=value` lines, the environment.
//!
//! Checked: no panic; a proxy configuration that validates with gossip on also yields its
//! cluster settings and peer networks without an error.
#![no_main]

use libfuzzer_sys::fuzz_target;

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
        let Ok(cfg) = kvmesh_proxy::config::ProxyConfig::from_toml_with_env(toml, vars) else {
            return;
        };
        if cfg.validate().is_ok() && cfg.cluster.enabled {
            cfg.cluster_config()
                .expect("a validated configuration has cluster settings");
            cfg.peer_networks()
                .expect("a validated configuration has peer networks");
        }
    } else if let Ok(cfg) = kvagent::config::AgentConfig::from_toml(text) {
        let _ = cfg.validate();
    }
});
