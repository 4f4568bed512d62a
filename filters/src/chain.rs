//! The prefix digest chain (DESIGN section 2): one implementation for every part of kvmesh.
//!
//! A prompt is cut into fixed-size blocks; only full blocks get a digest. Digest `i` is keyed by a
//! per-(model, salt) namespace and covers digest `i-1` and block `i`, so equal `d[i]` means equal
//! first `i + 1` blocks: a digest names a whole prefix, not a block.
//!
//! ```
//! use kvmesh_filters::chain::{text_chain, Namespace};
//! let ns = Namespace::new("smollm2", b"");
//! let a = text_chain(&ns, b"aaaabbbbcccc", 4);
//! let b = text_chain(&ns, b"aaaabbbbdddd", 4);
//! assert_eq!(a.len(), 3);
//! assert_eq!(a[..2], b[..2]);
//! assert_ne!(a[2], b[2]);
//! ```

use std::fmt;

/// The `blake3::derive_key` context string of the namespace key.
pub const NAMESPACE_CONTEXT: &str = "kvmesh prefix chain v1";

/// A 32-byte BLAKE3 digest naming a whole prefix of blocks.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(pub [u8; 32]);

impl Digest {
    /// The digest as 64 lowercase hex characters.
    pub fn to_hex(&self) -> String {
        blake3::Hash::from_bytes(self.0).to_hex().to_string()
    }

    /// The first 8 bytes as a little-endian integer: the compact form used in gossip and metrics.
    pub fn short(&self) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.0[..8]);
        u64::from_le_bytes(b)
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Digest({})", &self.to_hex()[..16])
    }
}

/// The key that separates chains of different models and tenants (cache salts).
#[derive(Clone)]
pub struct Namespace {
    key: [u8; 32],
}

impl Namespace {
    /// `blake3::derive_key("kvmesh prefix chain v1", model ++ 0x00 ++ salt)`.
    pub fn new(model: &str, salt: &[u8]) -> Self {
        let mut material = Vec::with_capacity(model.len() + 1 + salt.len());
        material.extend_from_slice(model.as_bytes());
        material.push(0);
        material.extend_from_slice(salt);
        Namespace {
            key: blake3::derive_key(NAMESPACE_CONTEXT, &material),
        }
    }

    /// The raw 32-byte key.
    pub fn key(&self) -> &[u8; 32] {
        &self.key
    }
}

/// Hashes a sequence of blocks into the chain. Every block is hashed as given: callers pass only
/// full blocks.
pub fn chain_blocks<'a>(ns: &Namespace, blocks: impl IntoIterator<Item = &'a [u8]>) -> Vec<Digest> {
    let iter = blocks.into_iter();
    let mut out = Vec::with_capacity(iter.size_hint().0);
    let mut prev = [0u8; 32];
    for block in iter {
        let mut h = blake3::Hasher::new_keyed(&ns.key);
        h.update(&prev);
        h.update(block);
        prev = *h.finalize().as_bytes();
        out.push(Digest(prev));
    }
    out
}

/// Text mode: the canonical prompt bytes cut every `block_bytes`; a trailing partial block is
/// not hashed. `block_bytes == 0` yields an empty chain.
pub fn text_chain(ns: &Namespace, canonical: &[u8], block_bytes: usize) -> Vec<Digest> {
    if block_bytes == 0 {
        return Vec::new();
    }
    chain_blocks(ns, canonical.chunks_exact(block_bytes))
}

/// Text mode, at most `max_blocks` digests: the chain of the first `max_blocks` full blocks
/// (equal to the first `max_blocks` digests of [`text_chain`]). Routing compares leading
/// blocks, so a cap bounds what one request hashes and records in the residency index whatever
/// the prompt's size.
pub fn text_chain_capped(
    ns: &Namespace,
    canonical: &[u8],
    block_bytes: usize,
    max_blocks: usize,
) -> Vec<Digest> {
    if block_bytes == 0 {
        return Vec::new();
    }
    chain_blocks(ns, canonical.chunks_exact(block_bytes).take(max_blocks))
}

/// Token mode: token ids as u32 little-endian, cut every `block_tokens` (the engine's KV block
/// size); a trailing partial block is not hashed. `block_tokens == 0` yields an empty chain.
pub fn token_chain(ns: &Namespace, tokens: &[u32], block_tokens: usize) -> Vec<Digest> {
    token_chain_from(ns, None, tokens, block_tokens)
}

/// [`token_chain`] continued after `parent`, the digest of the block before `tokens` (`None`:
/// `tokens` start the prompt). An engine that reports blocks as they are stored names each
/// batch's parent; the digests are those of the whole prompt's chain.
pub fn token_chain_from(
    ns: &Namespace,
    parent: Option<&Digest>,
    tokens: &[u32],
    block_tokens: usize,
) -> Vec<Digest> {
    if block_tokens == 0 {
        return Vec::new();
    }
    let mut buf = Vec::with_capacity(block_tokens * 4);
    let mut out = Vec::with_capacity(tokens.len() / block_tokens);
    let mut prev = parent.map_or([0u8; 32], |p| p.0);
    for block in tokens.chunks_exact(block_tokens) {
        buf.clear();
        buf.extend(block.iter().flat_map(|t| t.to_le_bytes()));
        let mut h = blake3::Hasher::new_keyed(&ns.key);
        h.update(&prev);
        h.update(&buf);
        prev = *h.finalize().as_bytes();
        out.push(Digest(prev));
    }
    out
}

/// Parses a hex digest (64 characters) as sent in [`DIGESTS_HEADER`].
pub fn parse_hex(s: &str) -> Option<Digest> {
    blake3::Hash::from_hex(s.trim())
        .ok()
        .map(|h| Digest(*h.as_bytes()))
}

/// The header in which a kvmesh proxy sends the engine it routes a request to the leading
/// digests it routed by: hex, comma-separated.
pub const DIGESTS_HEADER: &str = "x-kvmesh-prefix-digests";

/// Most digests [`parse_digests`] reads from a [`DIGESTS_HEADER`] value (a proxy sends 32 by
/// default); more is malformed.
pub const MAX_HEADER_DIGESTS: usize = 256;

/// How the digests a proxy routed a request by compare with the receiving engine's own chain
/// for it. They match only when the proxy is in token mode with the engine's tokenizer and
/// block size (text-mode digests never do), so a mismatch in token mode names a misconfigured
/// proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DigestCheck {
    /// Every digest sent equals the engine's digest of the same block.
    Match,
    /// Some digest differs, or more were sent than the prompt has full blocks.
    Mismatch,
    /// The header is not comma-separated hex digests, or holds more than
    /// [`MAX_HEADER_DIGESTS`].
    Malformed,
}

impl DigestCheck {
    /// Every outcome, in [`DigestCheck::index`] order.
    pub const ALL: [DigestCheck; 3] = [
        DigestCheck::Match,
        DigestCheck::Mismatch,
        DigestCheck::Malformed,
    ];

    /// Position in [`DigestCheck::ALL`] (for an array of counters).
    pub fn index(self) -> usize {
        self as usize
    }

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            DigestCheck::Match => "match",
            DigestCheck::Mismatch => "mismatch",
            DigestCheck::Malformed => "malformed",
        }
    }
}

/// The digests of a [`DIGESTS_HEADER`] value, or `None` when it is malformed.
pub fn parse_digests(value: &[u8]) -> Option<Vec<Digest>> {
    let text = std::str::from_utf8(value).ok()?;
    if text.trim().is_empty() {
        return Some(Vec::new());
    }
    let digests: Option<Vec<Digest>> = text
        .split(',')
        .take(MAX_HEADER_DIGESTS + 1)
        .map(parse_hex)
        .collect();
    digests.filter(|d| d.len() <= MAX_HEADER_DIGESTS)
}

/// Compares `sent` ([`parse_digests`] of the header; `None`: malformed) with `own`, the
/// engine's chain of the same prompt from its first block (at least `sent.len()` digests
/// where the prompt has that many full blocks); `None` when nothing was sent.
pub fn check_digests(sent: Option<&[Digest]>, own: &[Digest]) -> Option<DigestCheck> {
    let Some(sent) = sent else {
        return Some(DigestCheck::Malformed);
    };
    if sent.is_empty() {
        return None;
    }
    Some(if own.get(..sent.len()) == Some(sent) {
        DigestCheck::Match
    } else {
        DigestCheck::Mismatch
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Fixed vectors: recomputed by hand from the definition in DESIGN section 2, so a change to
    /// the chain (which would strand every peer's residency) fails here.
    const PINNED_D1: &str = "fa6953a7bab8870f7a106cba4cf6674bc70dc77e6b16144adce45e9ba002bf4a";

    #[test]
    fn fixed_vectors() {
        let ns = Namespace::new("m", b"");
        let expected_key = blake3::derive_key("kvmesh prefix chain v1", b"m\0");
        assert_eq!(ns.key(), &expected_key);

        let chain = text_chain(&ns, b"abcdefgh", 4);
        let mut d0_in = [0u8; 36];
        d0_in[32..].copy_from_slice(b"abcd");
        let d0 = blake3::keyed_hash(&expected_key, &d0_in);
        let mut d1_in = Vec::from(*d0.as_bytes());
        d1_in.extend_from_slice(b"efgh");
        let d1 = blake3::keyed_hash(&expected_key, &d1_in);
        assert_eq!(chain, vec![Digest(*d0.as_bytes()), Digest(*d1.as_bytes())]);
        // Pinned hex, so that a blake3 or namespace change is caught too.
        assert_eq!(chain[1].to_hex(), PINNED_D1);
    }

    #[test]
    fn partial_block_is_not_hashed_and_salt_separates() {
        let ns = Namespace::new("m", b"");
        assert_eq!(text_chain(&ns, b"abcdefg", 4).len(), 1);
        assert!(text_chain(&ns, b"abc", 4).is_empty());
        assert!(text_chain(&ns, b"abcd", 0).is_empty());
        let salted = Namespace::new("m", b"tenant-a");
        assert_ne!(text_chain(&ns, b"abcd", 4), text_chain(&salted, b"abcd", 4));
        let other_model = Namespace::new("n", b"");
        assert_ne!(
            text_chain(&ns, b"abcd", 4),
            text_chain(&other_model, b"abcd", 4)
        );
    }

    #[test]
    fn capped_chain_is_the_uncapped_prefix() {
        let ns = Namespace::new("m", b"");
        let text = vec![7u8; 4 * 100 + 3];
        let full = text_chain(&ns, &text, 4);
        assert_eq!(full.len(), 100);
        let capped = text_chain_capped(&ns, &text, 4, 10);
        assert_eq!(capped.len(), 10);
        assert_eq!(capped[..], full[..10]);
        assert_eq!(text_chain_capped(&ns, &text, 4, 1000), full);
        assert!(text_chain_capped(&ns, &text, 4, 0).is_empty());
        assert!(text_chain_capped(&ns, &text, 0, 10).is_empty());
    }

    #[test]
    fn token_mode_hashes_le_u32() {
        let ns = Namespace::new("m", b"");
        let tokens = [1u32, 2, 3, 4, 5];
        let bytes: Vec<u8> = tokens[..4].iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(token_chain(&ns, &tokens, 2), text_chain(&ns, &bytes, 8));
    }

    #[test]
    fn a_chain_continued_from_its_parent_is_the_whole_chain() {
        let ns = Namespace::new("m", b"");
        let tokens: Vec<u32> = (0..40).collect();
        let whole = token_chain(&ns, &tokens, 4);
        for cut in [0usize, 1, 5, 9] {
            let parent = cut.checked_sub(1).map(|i| whole[i]);
            let rest = token_chain_from(&ns, parent.as_ref(), &tokens[cut * 4..], 4);
            assert_eq!(rest[..], whole[cut..], "cut after {cut} blocks");
        }
    }

    #[test]
    fn routing_digests_match_only_the_leading_digests_of_the_engines_chain() {
        let ns = Namespace::new("m", b"");
        let own = token_chain(&ns, &(0..100).collect::<Vec<u32>>(), 16);
        assert_eq!(own.len(), 6);
        let hex = |d: &[Digest]| d.iter().map(Digest::to_hex).collect::<Vec<_>>().join(",");
        let check = |v: &str| check_digests(parse_digests(v.as_bytes()).as_deref(), &own);
        assert_eq!(check(&hex(&own[..2])), Some(DigestCheck::Match));
        assert_eq!(check(&hex(&own)), Some(DigestCheck::Match));
        assert_eq!(check(" "), None);
        // Not from the first block, a block past the prompt's end, a wrong order.
        assert_eq!(check(&hex(&own[1..3])), Some(DigestCheck::Mismatch));
        let longer = [&own[..], &own[..1]].concat();
        assert_eq!(check(&hex(&longer)), Some(DigestCheck::Mismatch));
        assert_eq!(check(&hex(&[own[1], own[0]])), Some(DigestCheck::Mismatch));
        // Not hex digests, an empty item, too many, not UTF-8.
        assert_eq!(check("zz"), Some(DigestCheck::Malformed));
        assert_eq!(
            check(&format!("{},", hex(&own[..1]))),
            Some(DigestCheck::Malformed)
        );
        let at_most = vec![own[0]; MAX_HEADER_DIGESTS];
        assert_eq!(parse_digests(hex(&at_most).as_bytes()), Some(at_most));
        let many = vec![own[0]; MAX_HEADER_DIGESTS + 1];
        assert_eq!(check(&hex(&many)), Some(DigestCheck::Malformed));
        assert_eq!(parse_digests(&[0xff, 0xfe]), None);
    }

    #[test]
    fn hex_round_trip() {
        let ns = Namespace::new("m", b"");
        let d = text_chain(&ns, b"abcd", 4)[0];
        assert_eq!(parse_hex(&d.to_hex()), Some(d));
        assert_eq!(parse_hex("zz"), None);
    }

    proptest! {
        /// Two prompts sharing exactly k full blocks share exactly k digests.
        #[test]
        fn shared_blocks_equal_shared_digests(
            block in 1usize..16,
            k in 0usize..8,
            tail_a in 1usize..6,
            tail_b in 1usize..6,
            seed in any::<u64>(),
        ) {
            let mut rng = seed;
            let mut next = || { rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407); (rng >> 33) as u8 };
            let shared: Vec<u8> = (0..k * block).map(|_| next()).collect();
            let mut a = shared.clone();
            let mut b = shared;
            // Block k differs in its first byte, so the prompts share exactly k full blocks.
            let first_a = next();
            a.push(first_a);
            b.push(first_a.wrapping_add(1));
            for _ in 1..tail_a * block { a.push(next()); }
            for _ in 1..tail_b * block { b.push(next()); }
            let ns = Namespace::new("m", b"");
            let (ca, cb) = (text_chain(&ns, &a, block), text_chain(&ns, &b, block));
            let common = ca.iter().zip(&cb).take_while(|(x, y)| x == y).count();
            prop_assert_eq!(common, k);
            // No digest past the shared prefix coincides either.
            for d in &ca[k..] { prop_assert!(!cb.contains(d)); }
        }
    }
}
