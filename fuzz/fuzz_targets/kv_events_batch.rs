//! A vLLM / SGLang KV events batch, as the proxy's `kv_events` feed reads it from the
//! publisher (msgpack, either encoding).
//!
//! Checked: no panic; a decoded batch holds no more events, hashes or token ids than its
//! bytes could encode (one byte each at least).
#![no_main]

use kvmesh_fuzz as _;
use kvmesh_proxy::feed::kv_events::schema::{decode, Event};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(batch) = decode(data) else {
        return;
    };
    assert!(
        batch.events.len() <= data.len(),
        "{} events",
        batch.events.len()
    );
    let mut items = 0usize;
    for ev in &batch.events {
        let hashes = match ev {
            Event::BlockStored(s) => {
                items += s.token_ids.len();
                &s.block_hashes
            }
            Event::BlockRemoved(r) => &r.block_hashes,
            _ => continue,
        };
        items += hashes.len();
    }
    assert!(
        items <= data.len(),
        "{items} hashes and tokens from {} bytes",
        data.len()
    );
});
