//! The paged prefix cache: KV in fixed blocks of [`BLOCK_TOKENS`] tokens from a bounded pool,
//! each full block named by the token-mode digest chain of `kvmesh_filters::chain` (so a digest
//! names the whole prefix up to and including its block). Blocks no sequence is using are
//! evicted least recently used first.
//!
//! A sequence computes in its own unpaged [`KvCache`]; leading blocks found here are copied in
//! before its prefill (and skipped), and its new full prompt blocks are copied out after it.

use kvmesh_filters::chain::Digest;
use lru::LruCache;
use tch::Tensor;

use crate::model::{KvCache, LlamaConfig};

/// Tokens per KV block (the engine's block size; also the token-chain block size).
pub const BLOCK_TOKENS: usize = 16;

/// One block's keys and values for every layer: `[n_layer, n_kv_head, BLOCK_TOKENS, head_dim]`.
pub struct KvBlock {
    /// Keys.
    pub k: Tensor,
    /// Values.
    pub v: Tensor,
}

impl KvBlock {
    /// Bytes of one block's payload (keys and values, f32).
    pub fn bytes(cfg: &LlamaConfig) -> usize {
        2 * cfg.n_layer * cfg.n_kv_head * BLOCK_TOKENS * cfg.head_dim * 4
    }

    /// The block as opaque bytes (keys then values, f32 little-endian) for kvagent.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for t in [&self.k, &self.v] {
            let v: Vec<f32> = Vec::try_from(t.flatten(0, -1)).unwrap_or_default();
            out.extend(v.iter().flat_map(|x| x.to_le_bytes()));
        }
        out
    }

    /// A block from [`KvBlock::to_bytes`]; `None` when the size does not fit `cfg`.
    pub fn from_bytes(cfg: &LlamaConfig, bytes: &[u8]) -> Option<KvBlock> {
        if bytes.len() != Self::bytes(cfg) {
            return None;
        }
        let floats: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let half = floats.len() / 2;
        let shape = [
            cfg.n_layer as i64,
            cfg.n_kv_head as i64,
            BLOCK_TOKENS as i64,
            cfg.head_dim as i64,
        ];
        Some(KvBlock {
            k: Tensor::from_slice(&floats[..half]).reshape(shape),
            v: Tensor::from_slice(&floats[half..]).reshape(shape),
        })
    }

    /// Copies block `index` of a sequence's cache out (nothing evicted before it: slot `i` holds
    /// position `i`).
    pub fn from_sequence(cache: &KvCache, index: usize) -> KvBlock {
        let at = (index * BLOCK_TOKENS) as i64;
        let take = |layers: &[Tensor]| {
            Tensor::stack(
                &layers
                    .iter()
                    .map(|t| t.narrow(1, at, BLOCK_TOKENS as i64))
                    .collect::<Vec<_>>(),
                0,
            )
        };
        KvBlock {
            k: take(&cache.k),
            v: take(&cache.v),
        }
    }

    /// Copies this block into position `index` of a sequence's cache.
    pub fn copy_into(&self, cache: &mut KvCache, index: usize) {
        let at = (index * BLOCK_TOKENS) as i64;
        for (layer, (k, v)) in cache.k.iter_mut().zip(cache.v.iter_mut()).enumerate() {
            k.narrow(1, at, BLOCK_TOKENS as i64)
                .copy_(&self.k.get(layer as i64));
            v.narrow(1, at, BLOCK_TOKENS as i64)
                .copy_(&self.v.get(layer as i64));
        }
    }
}

/// The bounded pool of cached blocks.
pub struct PrefixCache {
    blocks: LruCache<Digest, KvBlock>,
    capacity: usize,
}

impl PrefixCache {
    /// A pool of at most `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        PrefixCache {
            blocks: LruCache::unbounded(),
            capacity: capacity.max(1),
        }
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether no block is held.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The pool's bound.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Whether `d` is held (without touching LRU order).
    pub fn contains(&self, d: &Digest) -> bool {
        self.blocks.contains(d)
    }

    /// How many leading blocks of `chain` are held.
    pub fn leading(&self, chain: &[Digest]) -> usize {
        chain.iter().take_while(|d| self.blocks.contains(d)).count()
    }

    /// Copies the first `n` blocks of `chain` into `cache`, which must be empty (and the blocks
    /// held); marks them used.
    pub fn load(&mut self, chain: &[Digest], n: usize, cache: &mut KvCache) {
        for (i, d) in chain.iter().take(n).enumerate() {
            if let Some(b) = self.blocks.get(d) {
                b.copy_into(cache, i);
            }
        }
        cache.advance((n * BLOCK_TOKENS).saturating_sub(cache.pos));
    }

    /// Inserts a block; returns the blocks evicted to stay within the bound.
    pub fn insert(&mut self, d: Digest, block: KvBlock) -> Vec<(Digest, KvBlock)> {
        self.blocks.put(d, block);
        let mut evicted = Vec::new();
        while self.blocks.len() > self.capacity {
            match self.blocks.pop_lru() {
                Some(e) => evicted.push(e),
                None => break,
            }
        }
        evicted
    }

    /// The `n` most recently used digests held, most recent first.
    pub fn most_recent(&self, n: usize) -> Vec<Digest> {
        self.blocks.iter().take(n).map(|(d, _)| *d).collect()
    }

    /// The block at `d`, if held (without touching LRU order).
    pub fn peek(&self, d: &Digest) -> Option<&KvBlock> {
        self.blocks.peek(d)
    }

    /// Drops one block (if held).
    pub fn remove(&mut self, d: &Digest) {
        self.blocks.pop(d);
    }

    /// Drops everything.
    pub fn clear(&mut self) {
        self.blocks.clear();
    }
}
