//! What engines answer outside a request's body: the `/v1/models` list the proxy's health
//! probe reads and the Prometheus text kvagent's telemetry scrapes. First byte selects.
//!
//! Checked: no panic; no blank model id is kept; the load read is finite, non-negative and the
//! KV usage a fraction.
#![no_main]

use libfuzzer_sys::fuzz_target;
// The capped allocator (src/lib.rs).
use kvmesh_fuzz as _;

fuzz_target!(|data: &[u8]| {
    let Some((&sel, body)) = data.split_first() else {
        return;
    };
    if sel % 2 == 0 {
        for id in kvmesh_proxy::fleet::parse_model_list(body) {
            assert!(!id.trim().is_empty(), "a blank model id was kept: {id:?}");
        }
    } else if let Ok(text) = std::str::from_utf8(body) {
        if let Some(load) = kvagent::telemetry::parse_load(text) {
            for v in [load.running, load.waiting] {
                assert!(
                    v.is_finite() && v >= 0.0,
                    "a load of {v} from the engine's text"
                );
            }
            assert!(
                (0.0..=1.0).contains(&load.kv_usage),
                "kv usage {}",
                load.kv_usage
            );
        }
    }
});
