//! What a joining node reads back from the peer it pulls the cluster's state from (after each
//! frame is opened): chunks reassembled by `Reply`, then the snapshot JSON. Input: a bound
//! selector byte, then length-prefixed chunks (u16 little-endian); chunks whose first byte is
//! even get the expected challenge prefixed, so the checks behind it are reached.
//!
//! Checked: no panic; the body never exceeds its bound; nothing is accepted after the last
//! chunk; a snapshot that parses has at most `MAX_NODES` nodes, each shard index in range and
//! once, and re-encodes to itself.
#![no_main]

use kvmesh_cluster::bulk::{parse_snapshot, Reply, CHALLENGE_LEN, MAX_NODES};
use kvmesh_cluster::shards::SLOTS;
use libfuzzer_sys::fuzz_target;
// The capped allocator (src/lib.rs).
use kvmesh_fuzz as _;

const CHALLENGE: [u8; CHALLENGE_LEN] = [0x5a; CHALLENGE_LEN];

fuzz_target!(|data: &[u8]| {
    let Some((&bound, mut rest)) = data.split_first() else {
        return;
    };
    let max = 64 + usize::from(bound) * 256;
    let mut reply = Reply::new(CHALLENGE, max);
    let mut done = false;
    while rest.len() >= 2 {
        let len = usize::from(u16::from_le_bytes([rest[0], rest[1]])).min(rest.len() - 2);
        let piece = &rest[2..2 + len];
        rest = &rest[2 + len..];
        let mut chunk = Vec::new();
        if piece.first().is_some_and(|b| b % 2 == 0) {
            chunk.extend_from_slice(&CHALLENGE);
            chunk.extend_from_slice(&piece[1..]);
        } else {
            chunk.extend_from_slice(piece);
        }
        let result = reply.accept(&chunk);
        assert!(reply.body.len() <= max, "body over its bound");
        if done {
            assert!(result.is_err(), "a chunk accepted after the last");
        }
        match result {
            Ok(true) => done = true,
            Ok(false) => {}
            Err(_) => break,
        }
    }
    if let Ok(snapshot) = parse_snapshot(&reply.body) {
        assert!(snapshot.nodes.len() <= MAX_NODES);
        for n in &snapshot.nodes {
            let mut seen = vec![false; SLOTS];
            for s in &n.shards {
                assert!(s.index < SLOTS && !seen[s.index]);
                seen[s.index] = true;
            }
        }
        let text = serde_json::to_vec(&snapshot).expect("a snapshot serialises");
        assert_eq!(
            parse_snapshot(&text).expect("its JSON reads back"),
            snapshot
        );
    }
});
