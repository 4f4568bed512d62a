//! KV eviction: a per-sequence budget of KV slots, and the policies that choose what to drop
//! when a sequence holds more (docs/eviction.md).
//!
//! Eviction runs at one boundary: at the end of a step, for a sequence whose prompt is computed
//! (so first right after prefill, before the first decode step, then whenever decoding takes it
//! past the budget again). Nothing is evicted inside chunked prefill: every prompt token's KV is
//! computed against the whole prompt, the first generated token comes from those logits, and the
//! prompt's blocks go into the prefix cache before any eviction (so they are exact and stay
//! reusable; nothing computed after an eviction is ever cached or written to kvagent). Kept keys
//! keep the positions RoPE gave them: nothing is rotated again.
//!
//! - [`Policy::Segment`]: drops the least relevant segment's tokens first (a segment is a
//!   passage the client marked, or by default a message that is not the system prompt or the
//!   last user message; relevance from the client or BM25, `crate::segments`); reserved tokens
//!   (everything outside segments, and every generated token) are never dropped. The segment
//!   the budget cuts into loses its least relevant sentences first, each from its end.
//! - [`Policy::H2o`]: Heavy-Hitter Oracle (Zhang et al., NeurIPS 2023), from accumulated
//!   attention, not the L2-norm proxy: per layer and kv head, the most recent half of the budget
//!   plus the slots that received the most attention (summed over the head's queries and every
//!   step so far).
//! - [`Policy::Streaming`]: StreamingLLM (Xiao et al., ICLR 2024): the first [`SINK_TOKENS`]
//!   tokens (attention sinks) and the most recent window. Kept keys are not re-rotated to
//!   in-cache positions, unlike the paper: all policies keep original positions.

use tch::{Kind, Tensor};

use crate::model::{KvCache, LlamaConfig};

/// Attention-sink tokens StreamingLLM keeps (the paper's 4).
pub const SINK_TOKENS: usize = 4;

/// What a sequence evicts when it holds more KV than its budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// Never evicts.
    #[default]
    None,
    /// Least relevant segment first; reserved tokens never.
    Segment,
    /// Heavy hitters by accumulated attention, plus the recent window.
    H2o,
    /// Attention sinks plus the recent window.
    Streaming,
}

impl Policy {
    /// Every policy, in [`Policy::index`] order.
    pub const ALL: [Policy; 4] = [
        Policy::None,
        Policy::Segment,
        Policy::H2o,
        Policy::Streaming,
    ];

    /// The name used in configuration, requests and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::None => "none",
            Policy::Segment => "segment",
            Policy::H2o => "h2o",
            Policy::Streaming => "streaming",
        }
    }

    /// Index into per-policy counters.
    pub fn index(self) -> usize {
        self as usize
    }

    /// The smallest budget the policy can keep to (StreamingLLM needs room past its sinks, H2O
    /// one recent and one heavy slot).
    pub fn min_budget(self) -> usize {
        match self {
            Policy::None | Policy::Segment => 1,
            Policy::H2o => 2,
            Policy::Streaming => SINK_TOKENS + 1,
        }
    }
}

impl std::str::FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Policy::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| format!("{s:?}: use none, segment, h2o or streaming"))
    }
}

/// A span of prompt tokens the segment policy may drop, with its relevance.
#[derive(Debug, Clone, PartialEq)]
pub struct Segment {
    /// First token (a position in the prompt).
    pub start: usize,
    /// One past the last token.
    pub end: usize,
    /// Higher is kept longer.
    pub relevance: f64,
    /// The segment's sentences (disjoint, inside it), in the order a partial eviction drops
    /// them: least relevant first. Tokens of the segment in none of them go last. Empty: the
    /// segment goes from its end.
    pub sentences: Vec<(usize, usize)>,
}

/// A sequence's eviction settings.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Eviction {
    /// The policy.
    pub policy: Policy,
    /// Most KV slots the sequence keeps once its prompt is computed (0: no budget).
    pub budget_tokens: usize,
    /// For [`Policy::Segment`]: the droppable spans (disjoint).
    pub segments: Vec<Segment>,
}

impl Eviction {
    /// Whether this sequence can ever evict.
    pub fn active(&self) -> bool {
        self.policy != Policy::None && self.budget_tokens > 0
    }
}

/// What eviction did to one sequence (reported with its answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EvictionReport {
    /// Times tokens were dropped.
    pub evictions: usize,
    /// Tokens dropped in all.
    pub evicted_tokens: usize,
    /// Most slots held over the budget after an eviction: reserved tokens the segment policy
    /// could not drop (0: the budget held).
    pub over_budget_tokens: usize,
}

/// Evicts from `kv` down to `ev.budget_tokens` slots where the policy can (new buffers sized
/// with `headroom` spare slots); returns the slots dropped (0 when within the budget).
pub fn evict(cfg: &LlamaConfig, kv: &mut KvCache, ev: &Eviction, headroom: usize) -> usize {
    let (len, budget) = (kv.len, ev.budget_tokens);
    if !ev.active() || len <= budget {
        return 0;
    }
    match ev.policy {
        Policy::None => 0,
        Policy::Segment | Policy::Streaming => {
            let keep = match (ev.policy, kv.positions()) {
                (Policy::Streaming, _) => streaming_keep(len, budget),
                (_, Some(pos)) => segment_keep(pos, &ev.segments, budget),
                // Unreachable: only H2O makes positions differ per head.
                (_, None) => return 0,
            };
            if keep.len() == len {
                return 0;
            }
            kv.retain(cfg, &keep, headroom);
            len - keep.len()
        }
        Policy::H2o => {
            let keep: Option<Vec<Tensor>> = (0..cfg.n_layer)
                .map(|layer| kv.attention(layer).map(|a| h2o_keep(&a, budget)))
                .collect();
            match keep {
                Some(keep) => {
                    kv.retain_per_head(cfg, &keep, headroom);
                    len - budget
                }
                None => 0,
            }
        }
    }
}

/// StreamingLLM: the first [`SINK_TOKENS`] slots and the last `budget - SINK_TOKENS`.
fn streaming_keep(len: usize, budget: usize) -> Vec<usize> {
    let sinks = SINK_TOKENS.min(budget);
    let recent = budget - sinks;
    (0..sinks).chain(len - recent..len).collect()
}

/// Segment relevance: the slots to keep once the least relevant segments' tokens are dropped
/// (ties: the earlier segment first), until `budget` slots are left or no segment token is;
/// the last segment it takes from loses its least relevant sentences first (each from its end),
/// so that exactly the budget is kept whenever segments hold enough.
fn segment_keep(positions: &[u32], segments: &[Segment], budget: usize) -> Vec<usize> {
    let mut order: Vec<&Segment> = segments.iter().collect();
    order.sort_by(|a, b| {
        a.relevance
            .total_cmp(&b.relevance)
            .then(a.start.cmp(&b.start))
    });
    let mut excess = positions.len().saturating_sub(budget);
    let mut dropped = vec![false; positions.len()];
    for s in order {
        if excess == 0 {
            break;
        }
        for &(start, end) in s.sentences.iter().chain([(s.start, s.end)].iter()) {
            if excess == 0 {
                break;
            }
            // Slots are in position order: a span's held slots are one run (a sentence is
            // clamped to its segment: only segment tokens may go).
            let from = positions.partition_point(|&p| (p as usize) < start.max(s.start));
            let to = positions.partition_point(|&p| (p as usize) < end.min(s.end));
            for d in dropped[from..to.max(from)].iter_mut().rev() {
                if excess == 0 {
                    break;
                }
                if !*d {
                    *d = true;
                    excess -= 1;
                }
            }
        }
    }
    (0..positions.len()).filter(|&i| !dropped[i]).collect()
}

/// H2O for one layer, from its accumulated attention `[n_kv_head, len]`: per kv head, the last
/// `budget / 2` slots (the recent window) and the `budget - budget / 2` earlier slots that
/// received the most attention; `[n_kv_head, budget]` slot indices, ascending per row.
fn h2o_keep(attention: &Tensor, budget: usize) -> Tensor {
    let (heads, len) = attention.size2().unwrap_or((0, 0));
    let recent = (budget / 2) as i64;
    let heavy = budget as i64 - recent;
    let (_, top) = attention
        .narrow(1, 0, len - recent)
        .topk(heavy, 1, true, false);
    let window = Tensor::arange_start(len - recent, len, (Kind::Int64, tch::Device::Cpu))
        .unsqueeze(0)
        .expand([heads, recent], false);
    let (sorted, _) = top.sort(1, false);
    Tensor::cat(&[sorted, window], 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> LlamaConfig {
        crate::model::tests::tiny_config()
    }

    /// A cache of `n` tokens whose key at slot i, in every layer, head and lane, is its
    /// position (so what is kept can be read back).
    fn filled(n: usize) -> KvCache {
        let c = cfg();
        let mut kv = KvCache::new(&c, n);
        for t in kv.k.iter_mut().chain(kv.v.iter_mut()) {
            let pos = Tensor::arange(n as i64, (Kind::Float, tch::Device::Cpu))
                .view([1, n as i64, 1])
                .expand([c.n_kv_head as i64, n as i64, c.head_dim as i64], false);
            t.narrow(1, 0, n as i64).copy_(&pos);
        }
        kv.advance(n);
        kv
    }

    /// Positions held by layer `layer`, kv head `head`, read from the keys.
    fn held(kv: &KvCache, layer: usize, head: i64) -> Vec<usize> {
        let col = kv.k[layer]
            .get(head)
            .narrow(0, 0, kv.len as i64)
            .select(1, 0);
        Vec::<f32>::try_from(col)
            .unwrap_or_default()
            .into_iter()
            .map(|x| x as usize)
            .collect()
    }

    fn ev(policy: Policy, budget: usize, segments: Vec<Segment>) -> Eviction {
        Eviction {
            policy,
            budget_tokens: budget,
            segments,
        }
    }

    fn seg(start: usize, end: usize, relevance: f64) -> Segment {
        Segment {
            start,
            end,
            relevance,
            sentences: Vec::new(),
        }
    }

    #[test]
    fn segment_eviction_drops_the_least_relevant_first_exactly_to_the_budget() {
        let c = cfg();
        let mut kv = filled(20);
        // Reserved 0..4 and 16..20; segments 4..8 (0.9), 8..12 (0.1), 12..16 (0.5).
        let segs = vec![seg(4, 8, 0.9), seg(8, 12, 0.1), seg(12, 16, 0.5)];
        let e = ev(Policy::Segment, 14, segs.clone());
        assert_eq!(evict(&c, &mut kv, &e, 8), 6);
        assert_eq!(kv.len, 14);
        // 8..12 went whole, then 12..16 lost its two latest tokens.
        let want: Vec<usize> = (0..8).chain(12..14).chain(16..20).collect();
        assert_eq!(held(&kv, 0, 0), want);
        assert_eq!(held(&kv, 1, 1), want);
        assert_eq!(kv.positions().map(<[u32]>::len), Some(14));
        assert_eq!(kv.pos, 20, "positions go on from where the sequence was");
        assert_eq!(kv.capacity, 22);
        // Again within budget: nothing.
        assert_eq!(evict(&c, &mut kv, &e, 8), 0);
        // Two decode tokens later (reserved), 2 more go: the rest of 12..16.
        kv.advance(2);
        assert_eq!(evict(&c, &mut kv, &e, 8), 2);
        let want: Vec<usize> = (0..8).chain(16..22).collect();
        assert_eq!(
            kv.positions(),
            Some(&want.iter().map(|&p| p as u32).collect::<Vec<_>>()[..])
        );
    }

    #[test]
    fn a_partly_evicted_segment_loses_its_least_relevant_sentences_first() {
        let c = cfg();
        let mut kv = filled(16);
        // Reserved 0..2 and 14..16; one segment 2..14 of three sentences, the middle one least
        // relevant, then the last; token 13 is in no sentence (it straddled one's end).
        let mut s = seg(2, 14, 0.5);
        s.sentences = vec![(6, 9), (9, 13), (2, 6)];
        let e = ev(Policy::Segment, 9, vec![s]);
        assert_eq!(evict(&c, &mut kv, &e, 2), 7);
        let want: Vec<usize> = (0..6).chain(13..16).collect();
        assert_eq!(held(&kv, 0, 0), want);
        // Then the first sentence, from its end; token 13 goes last.
        kv.advance(2);
        assert_eq!(evict(&c, &mut kv, &e, 0), 2);
        let want: Vec<u32> = (0..4).chain(13..18).collect();
        assert_eq!(kv.positions(), Some(&want[..]));
    }

    #[test]
    fn segment_eviction_never_drops_reserved_tokens() {
        let c = cfg();
        let mut kv = filled(12);
        let e = ev(Policy::Segment, 4, vec![seg(2, 6, 0.0)]);
        assert_eq!(evict(&c, &mut kv, &e, 0), 4);
        assert_eq!(kv.len, 8, "over the budget: only segment tokens may go");
        let want: Vec<usize> = (0..2).chain(6..12).collect();
        assert_eq!(held(&kv, 0, 1), want);
    }

    #[test]
    fn streaming_keeps_the_sinks_and_the_recent_window() {
        let c = cfg();
        let mut kv = filled(30);
        assert_eq!(
            evict(&c, &mut kv, &ev(Policy::Streaming, 10, vec![]), 1),
            20
        );
        let want: Vec<usize> = (0..4).chain(24..30).collect();
        assert_eq!(held(&kv, 1, 0), want);
        kv.advance(1);
        assert_eq!(evict(&c, &mut kv, &ev(Policy::Streaming, 10, vec![]), 1), 1);
        let want: Vec<usize> = (0..4).chain(25..31).collect();
        assert_eq!(
            kv.positions().map(<[u32]>::to_vec),
            Some(want.iter().map(|&p| p as u32).collect())
        );
    }

    #[test]
    fn h2o_keeps_each_heads_heavy_hitters_and_the_recent_half() {
        let c = cfg();
        let mut kv = KvCache::new(&c, 12);
        kv.track_attention(&c);
        // Write the keys after tracking starts, as the model does.
        let mut fill = filled(12);
        std::mem::swap(&mut kv.k, &mut fill.k);
        std::mem::swap(&mut kv.v, &mut fill.v);
        kv.advance(12);
        // Head 0 attends most to slots 1, 3 and 5; head 1 to 2, 7 and 8, in every layer.
        for layer in 0..c.n_layer {
            let mut a = kv.attention(layer).expect("tracked");
            let mut w = vec![0f32; 24];
            for s in [1, 3, 5] {
                w[s] = 1.0 + s as f32;
            }
            for s in [2, 7, 8] {
                w[12 + s] = 1.0 + s as f32;
            }
            a.copy_(&Tensor::from_slice(&w).view([2, 12]));
        }
        assert_eq!(evict(&c, &mut kv, &ev(Policy::H2o, 6, vec![]), 2), 6);
        assert_eq!(kv.len, 6);
        for layer in 0..c.n_layer {
            assert_eq!(held(&kv, layer, 0), vec![1, 3, 5, 9, 10, 11]);
            assert_eq!(held(&kv, layer, 1), vec![2, 7, 8, 9, 10, 11]);
            // The accumulated attention moved with its slots.
            let a = Vec::<f32>::try_from(kv.attention(layer).expect("tracked").get(0))
                .unwrap_or_default();
            assert_eq!(a, vec![2.0, 4.0, 6.0, 0.0, 0.0, 0.0]);
        }
        assert_eq!(kv.positions(), None, "heads hold different positions now");
        assert_eq!(kv.capacity, 8);
    }

    #[test]
    fn no_policy_or_no_budget_never_evicts() {
        let c = cfg();
        let mut kv = filled(10);
        assert_eq!(evict(&c, &mut kv, &ev(Policy::None, 2, vec![]), 0), 0);
        assert_eq!(evict(&c, &mut kv, &ev(Policy::Streaming, 0, vec![]), 0), 0);
        assert_eq!(evict(&c, &mut kv, &ev(Policy::Streaming, 10, vec![]), 0), 0);
        assert_eq!(kv.len, 10);
        assert_eq!("h2o".parse::<Policy>(), Ok(Policy::H2o));
        assert!("lru".parse::<Policy>().is_err());
    }
}
