//! OpenAI request bodies (chat, completions, embeddings) and the canonical prompt the digest
//! chain hashes. First byte: endpoint and canonical-prompt cap; the rest is the body.
//!
//! Checked: no panic; a refusal is a 4xx OpenAI error whose body is JSON; the capped parse
//! gives the same verdict, keeps a prefix of the full parse's canonical prompt and counts the
//! same length; the capped chain is the full chain's prefix, and so is the chain of the capped
//! parse's bytes (what the proxy hashes).
#![no_main]

use kvmesh_filters::chain::{text_chain, text_chain_capped, Namespace};
use kvmesh_filters::request::{parse, parse_limited, Endpoint};
use libfuzzer_sys::fuzz_target;
// The capped allocator (src/lib.rs).
use kvmesh_fuzz as _;

fuzz_target!(|data: &[u8]| {
    let Some((&sel, body)) = data.split_first() else {
        return;
    };
    let endpoint = match sel % 3 {
        0 => Endpoint::ChatCompletions,
        1 => Endpoint::Completions,
        _ => Endpoint::Embeddings,
    };
    let cap = usize::from(sel >> 2) * 8;
    let full = parse(endpoint, body);
    let limited = parse_limited(endpoint, body, cap);
    match (&full, &limited) {
        (Ok(f), Ok(l)) => {
            assert_eq!(f.canonical_len, f.canonical.len());
            assert_eq!(
                l.canonical_len, f.canonical_len,
                "the cap changed the length"
            );
            assert!(l.canonical.len() <= cap);
            assert!(
                f.canonical.starts_with(&l.canonical),
                "the cap kept other bytes"
            );
            assert_eq!((&l.model, l.stream), (&f.model, f.stream));
            let ns = Namespace::new(&f.model, f.cache_salt.as_deref().unwrap_or("").as_bytes());
            let chain = text_chain(&ns, &f.canonical, 16);
            let capped = text_chain_capped(&ns, &f.canonical, 16, 3);
            assert!(chain.starts_with(&capped));
            let from_limited = text_chain(&ns, &l.canonical, 16);
            assert!(chain.starts_with(&from_limited));
            assert_eq!(
                from_limited.len(),
                (l.canonical.len() / 16).min(chain.len())
            );
        }
        (Err(f), Err(l)) => {
            for e in [f, l] {
                let status = e.status();
                assert!(
                    (400..500).contains(&status),
                    "status {status} for bad input"
                );
                let json: serde_json::Value =
                    serde_json::from_slice(&e.to_json()).expect("the error body is JSON");
                assert!(json["error"]["message"].is_string());
            }
        }
        _ => panic!("the cap changed the verdict: {full:?} vs {limited:?}"),
    }
});
