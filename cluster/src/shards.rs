//! Residency in compact, sharded form for gossip.
//!
//! A node's resident digests are published by their 8-byte short form ([`Digest::short`]),
//! split into [`SHARDS`] shards by the short's top bits, each shard one gossip key
//! (`r.000` .. `r.127`) whose value is the sorted shorts, little-endian, base64. A change
//! re-sends one shard, not the set; a shard holds at most [`MAX_PER_SHARD`] shorts (about 43 KB
//! encoded), well under chitchat's one-datagram value limit, so a node publishes at most
//! 512,000 digests in its shards (and up to [`RECENT_SLOTS`] x 4,000 more in its recent keys,
//! gained since the last full publication).
//!
//! Between two full publications a node sets only the recent keys ([`RECENT_SLOTS`] of them,
//! `r.128` .. `r.143`): each publication in between writes what was gained since the one before
//! into the next unused recent key, whatever the shorts' shards. Each request adds digests to
//! nearly every shard, so re-sending the changed shards each round re-sent the whole set; and one
//! recent key holding every gain since the full publication was re-sent whole each round it grew.
//! A recent key is written once between two full publications (the last one, when all are used,
//! takes later gains too), so each gain crosses the network about once. Removals wait for the
//! next full publication ([`crate::FullPublication`]: when they make peers' views stale
//! enough, or at once when more than half of the last one went: a dropped or restarted
//! engine); a full publication empties the recent keys. A node's
//! published set is the union of its shards and its recent keys; a node that does not know the
//! recent keys (an older version) reads the shards alone and only learns later.
//!
//! [`Digest::short`]: kvmesh_filters::chain::Digest::short

use base64::engine::general_purpose::STANDARD_NO_PAD;
use base64::Engine as _;

/// Number of residency shards per node.
pub const SHARDS: usize = 128;
/// Most shorts in one shard (and in one recent key).
pub const MAX_PER_SHARD: usize = 4000;
/// The slot of the first recent key: shorts added since the last full publication, of any
/// shard. The recent keys are the slots from here to [`SLOTS`].
pub const RECENT: usize = SHARDS;
/// Number of recent keys: at the default 200 ms gossip round and 2 s between full
/// publications, a node writes about 10 of them between two full ones.
pub const RECENT_SLOTS: usize = 16;
/// Residency keys per node: the shards and the recent keys.
pub const SLOTS: usize = SHARDS + RECENT_SLOTS;

/// The slots of the recent keys.
pub fn recent_slots() -> std::ops::Range<usize> {
    RECENT..SLOTS
}

/// The gossip key of slot `i` (a shard, or a recent key).
pub fn key(i: usize) -> String {
    format!("r.{i:03}")
}

/// The slot of a gossip key, if it is one.
pub fn parse_key(k: &str) -> Option<usize> {
    let i: usize = k.strip_prefix("r.")?.parse().ok()?;
    (i < SLOTS).then_some(i)
}

/// Which shard a short belongs to.
pub fn shard_of(short: u64) -> usize {
    (short >> (64 - SHARDS.trailing_zeros())) as usize
}

/// Splits shorts (most important first) into sorted shards, keeping at most [`MAX_PER_SHARD`]
/// of each shard's most important.
pub fn split(shorts: &[u64]) -> Vec<Vec<u64>> {
    let mut shards = vec![Vec::new(); SHARDS];
    for &s in shorts {
        let shard = &mut shards[shard_of(s)];
        if shard.len() < MAX_PER_SHARD {
            shard.push(s);
        }
    }
    for s in &mut shards {
        s.sort_unstable();
        s.dedup();
    }
    shards
}

/// Encodes one sorted shard.
pub fn encode(shard: &[u64]) -> String {
    let bytes: Vec<u8> = shard.iter().flat_map(|s| s.to_le_bytes()).collect();
    STANDARD_NO_PAD.encode(bytes)
}

/// Decodes one shard value; `None` when malformed (not base64, not whole shorts, or too many).
pub fn decode(value: &str) -> Option<Vec<u64>> {
    let bytes = STANDARD_NO_PAD.decode(value).ok()?;
    if bytes.len() % 8 != 0 || bytes.len() / 8 > MAX_PER_SHARD {
        return None;
    }
    let mut out: Vec<u64> = bytes
        .chunks_exact(8)
        .map(|c| {
            let mut b = [0u8; 8];
            b.copy_from_slice(c);
            u64::from_le_bytes(b)
        })
        .collect();
    out.sort_unstable();
    out.dedup();
    Some(out)
}

/// What changed between two sorted sets: (added, removed).
pub fn diff(old: &[u64], new: &[u64]) -> (Vec<u64>, Vec<u64>) {
    let (mut added, mut removed) = (Vec::new(), Vec::new());
    let (mut i, mut j) = (0, 0);
    while i < old.len() || j < new.len() {
        match (old.get(i), new.get(j)) {
            (Some(a), Some(b)) if a == b => {
                i += 1;
                j += 1;
            }
            (Some(a), Some(b)) if a < b => {
                removed.push(*a);
                i += 1;
            }
            (Some(_), Some(b)) => {
                added.push(*b);
                j += 1;
            }
            (Some(a), None) => {
                removed.push(*a);
                i += 1;
            }
            (None, Some(b)) => {
                added.push(*b);
                j += 1;
            }
            (None, None) => break,
        }
    }
    (added, removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_encode_decode_round_trip_and_bounds() {
        let shorts: Vec<u64> = (0..20_000u64)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .collect();
        let shards = split(&shorts);
        assert_eq!(shards.len(), SHARDS);
        let total: usize = shards.iter().map(Vec::len).sum();
        assert_eq!(total, 20_000);
        for (i, s) in shards.iter().enumerate() {
            assert!(s.iter().all(|x| shard_of(*x) == i));
            let v = encode(s);
            assert!(v.len() < 60_000);
            assert_eq!(decode(&v).as_deref(), Some(&s[..]));
        }
        // Over the per-shard bound, the first (most important) are kept.
        let same_shard: Vec<u64> = (0..5000u64).collect();
        let s = split(&same_shard);
        assert_eq!(s[0].len(), MAX_PER_SHARD);
        assert_eq!(s[0][0], 0);
        assert!(decode("!!").is_none());
        assert!(decode(&STANDARD_NO_PAD.encode([1u8, 2, 3])).is_none());
        assert_eq!(parse_key(&key(7)), Some(7));
        assert_eq!(parse_key(&key(RECENT)), Some(RECENT));
        assert_eq!(key(SLOTS - 1), "r.143");
        assert_eq!(parse_key("r.143"), Some(SLOTS - 1));
        assert_eq!(parse_key("r.144"), None);
        assert!(recent_slots().contains(&RECENT) && recent_slots().contains(&(SLOTS - 1)));
        assert!(!recent_slots().contains(&(RECENT - 1)) && !recent_slots().contains(&SLOTS));
        assert_eq!(parse_key("r.999"), None);
        assert_eq!(parse_key("node"), None);
    }

    #[test]
    fn diff_of_sorted_sets() {
        assert_eq!(diff(&[1, 3, 5], &[1, 2, 5, 9]), (vec![2, 9], vec![3]));
        assert_eq!(diff(&[], &[4]), (vec![4], vec![]));
        assert_eq!(diff(&[4], &[]), (vec![], vec![4]));
    }
}
