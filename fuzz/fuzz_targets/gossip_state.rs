//! What a peer publishes in its gossip state, once a message is authentic: the node record
//! (JSON under the key `node`) and residency shards (base64 under `r.NNN`), and the diff of a
//! shard against its previous value. First byte selects; for shards, the values are separated
//! by a newline.
//!
//! Checked: no panic; a decoded record re-encodes to itself; a decoded shard is sorted, free of
//! duplicates, within `MAX_PER_SHARD`, and round-trips; applying `diff(old, new)` to `old`
//! gives `new`.
#![no_main]

use std::collections::BTreeSet;

use kvmesh_cluster::record::NodeRecord;
use kvmesh_cluster::shards::{decode, diff, encode, MAX_PER_SHARD};
use libfuzzer_sys::fuzz_target;
// The capped allocator (src/lib.rs).
use kvmesh_fuzz as _;

fuzz_target!(|data: &[u8]| {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    if sel % 2 == 0 {
        if let Ok(record) = serde_json::from_slice::<NodeRecord>(rest) {
            let text = serde_json::to_string(&record).expect("a record serialises");
            let again: NodeRecord = serde_json::from_str(&text).expect("its JSON reads back");
            assert_eq!(again, record);
        }
        return;
    }
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let (a, b) = text.split_once('\n').unwrap_or((text, ""));
    let (Some(old), Some(new)) = (decode(a), decode(b)) else {
        return;
    };
    for shard in [&old, &new] {
        assert!(shard.len() <= MAX_PER_SHARD);
        assert!(
            shard.windows(2).all(|w| w[0] < w[1]),
            "not sorted and unique"
        );
        assert_eq!(decode(&encode(shard)).as_ref(), Some(shard));
    }
    let (added, removed) = diff(&old, &new);
    let mut set: BTreeSet<u64> = old.iter().copied().collect();
    for r in &removed {
        assert!(set.remove(r), "removed {r} that was not there");
    }
    for a in &added {
        assert!(set.insert(*a), "added {a} that was there");
    }
    assert!(set.into_iter().eq(new.iter().copied()));
});
