//! Ranking candidate nodes for a request: the routing policies.
//!
//! Every policy returns a full preference order, so that the proxy can fail over to the next
//! node without deciding again. The `prefix` policy (the default) is a pure function of the
//! candidates' overlap and load; see [`rank_prefix`] for the formula.

use std::sync::atomic::{AtomicUsize, Ordering};

use serde::{Deserialize, Serialize};

use crate::residency::NodeId;

/// How the proxy chooses an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// Each engine in turn.
    RoundRobin,
    /// The engine with the fewest requests in flight.
    LeastInflight,
    /// Two engines at random, the less loaded of them.
    PowerOfTwo,
    /// Rendezvous hash of a session key (a header, or the body's `user`), so a session sticks.
    Session,
    /// Longest cached prefix balanced against load (see [`rank_prefix`]).
    #[default]
    Prefix,
}

impl Policy {
    /// The name used in config and metrics.
    pub fn label(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round_robin",
            Policy::LeastInflight => "least_inflight",
            Policy::PowerOfTwo => "power_of_two",
            Policy::Session => "session",
            Policy::Prefix => "prefix",
        }
    }
}

/// Why the first node of a [`Decision`] was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// `prefix`: the chosen node holds the longest cached prefix.
    PrefixHit,
    /// `prefix`: another node holds a longer prefix, but its load costs more than the saving.
    LoadOverPrefix,
    /// `prefix`: no node holds any of the prefix; the least costly node was chosen.
    Cold,
    /// `prefix`: the fleet is imbalanced; the least loaded node was chosen regardless of prefix.
    Imbalanced,
    /// `round_robin`.
    RoundRobin,
    /// `least_inflight`.
    LeastInflight,
    /// `power_of_two`.
    PowerOfTwo,
    /// `session`: by the session key's hash.
    SessionHash,
    /// `session`: the request had no session key; least in flight instead.
    SessionNoKey,
}

impl Reason {
    /// A short label for metrics.
    pub fn label(self) -> &'static str {
        match self {
            Reason::PrefixHit => "prefix_hit",
            Reason::LoadOverPrefix => "load_over_prefix",
            Reason::Cold => "cold",
            Reason::Imbalanced => "imbalanced",
            Reason::RoundRobin => "round_robin",
            Reason::LeastInflight => "least_inflight",
            Reason::PowerOfTwo => "power_of_two",
            Reason::SessionHash => "session_hash",
            Reason::SessionNoKey => "session_no_key",
        }
    }
}

/// One routable node, as the router sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// The node.
    pub node: NodeId,
    /// A stable 64-bit key for the node (e.g. a hash of its name), for session hashing.
    pub key: u64,
    /// Requests in flight on the node.
    pub inflight: u64,
    /// Prompt bytes dispatched to the node whose prefill has not finished yet (the proxy counts
    /// a request's uncached bytes from dispatch to its first response byte).
    pub pending_prefill_bytes: u64,
    /// Leading blocks of this request's chain the node holds, per the residency index.
    pub overlap_blocks: usize,
}

/// A request's prompt as the cost model counts it: bytes, and how many of them one block of
/// its digest chain stands for (the unit of `overlap_blocks`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PromptSize {
    /// The whole prompt, bytes.
    pub total_bytes: usize,
    /// Bytes of prompt per chain block: the block size in text mode; in token mode, the block's
    /// tokens at the bytes per token measured on this prompt.
    pub block_bytes: usize,
}

impl PromptSize {
    /// The bytes of prompt the first `overlap_blocks` blocks stand for (at most all of them).
    pub fn cached_bytes(&self, overlap_blocks: usize) -> u64 {
        (overlap_blocks as u64)
            .saturating_mul(self.block_bytes as u64)
            .min(self.total_bytes as u64)
    }

    /// The bytes left to prefill past the first `overlap_blocks` blocks.
    pub fn uncached_bytes(&self, overlap_blocks: usize) -> u64 {
        self.total_bytes as u64 - self.cached_bytes(overlap_blocks)
    }
}

/// The knobs of the `prefix` policy.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrefixParams {
    /// The cost of one request in flight, in prompt bytes to prefill (decode pressure).
    pub decode_cost_bytes: u64,
    /// Weight of this request's own uncached bytes against work already queued. Above 1 it
    /// favours nodes holding the prefix: a miss costs more than its own prefill, since it also
    /// evicts other prefixes and duplicates this one in a second cache.
    pub uncached_weight: f64,
    /// The fleet is imbalanced when max - min in-flight exceeds this ...
    pub balance_abs_threshold: u64,
    /// ... and max in-flight exceeds this times min in-flight.
    pub balance_rel_threshold: f64,
}

impl Default for PrefixParams {
    fn default() -> Self {
        PrefixParams {
            decode_cost_bytes: 256,
            uncached_weight: 8.0,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
        }
    }
}

/// A ranking: indices into the candidate slice, best first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// Candidate indices, most preferred first; every candidate appears once.
    pub order: Vec<usize>,
    /// Why `order[0]` was chosen.
    pub reason: Reason,
}

/// The estimated cost of serving a request of `size` on `c`, in prompt bytes to prefill:
/// `pending_prefill_bytes + uncached_weight * (total_bytes - overlap_blocks * block_bytes) + decode_cost_bytes * inflight`.
pub fn prefix_cost(c: &Candidate, size: &PromptSize, p: &PrefixParams) -> u64 {
    let uncached = size.uncached_bytes(c.overlap_blocks);
    let weighted = (uncached as f64 * p.uncached_weight.max(0.0)) as u64;
    c.pending_prefill_bytes
        .saturating_add(weighted)
        .saturating_add(p.decode_cost_bytes.saturating_mul(c.inflight))
}

/// Whether the fleet is imbalanced enough that the `prefix` policy ignores prefixes:
/// `max - min > balance_abs_threshold` and `max > balance_rel_threshold * min` (in-flight counts).
pub fn imbalanced(cands: &[Candidate], p: &PrefixParams) -> bool {
    let (Some(max), Some(min)) = (
        cands.iter().map(|c| c.inflight).max(),
        cands.iter().map(|c| c.inflight).min(),
    ) else {
        return false;
    };
    max - min > p.balance_abs_threshold && max as f64 > p.balance_rel_threshold * min as f64
}

/// Sorts `order` by `key`, shuffling runs of equal keys so that ties spread over nodes.
fn sort_with_random_ties<K: Ord>(
    order: &mut [usize],
    rng: &mut fastrand::Rng,
    key: impl Fn(usize) -> K,
) {
    rng.shuffle(order);
    // A stable sort keeps the shuffled order within equal keys.
    order.sort_by_key(|&i| key(i));
}

/// The `prefix` policy.
///
/// 1. If the fleet is [`imbalanced`], rank by in-flight count (then by longer overlap), ties at
///    random: affinity never wins over a badly skewed fleet.
/// 2. Otherwise rank by [`prefix_cost`], the estimated prefill work queued ahead of and including
///    this request on each node: a long cached prefix lowers the cost, queued prefill and requests
///    in flight raise it. Equal costs are broken at random.
pub fn rank_prefix(
    cands: &[Candidate],
    size: &PromptSize,
    p: &PrefixParams,
    rng: &mut fastrand::Rng,
) -> Decision {
    let mut order: Vec<usize> = (0..cands.len()).collect();
    if cands.is_empty() {
        return Decision {
            order,
            reason: Reason::Cold,
        };
    }
    if imbalanced(cands, p) {
        sort_with_random_ties(&mut order, rng, |i| {
            (
                cands[i].inflight,
                std::cmp::Reverse(cands[i].overlap_blocks),
            )
        });
        return Decision {
            order,
            reason: Reason::Imbalanced,
        };
    }
    sort_with_random_ties(&mut order, rng, |i| prefix_cost(&cands[i], size, p));
    let best_overlap = cands.iter().map(|c| c.overlap_blocks).max().unwrap_or(0);
    let chosen = cands[order[0]].overlap_blocks;
    let reason = if best_overlap == 0 {
        Reason::Cold
    } else if chosen == best_overlap {
        Reason::PrefixHit
    } else {
        Reason::LoadOverPrefix
    };
    Decision { order, reason }
}

/// Ranks by in-flight count, ties at random.
pub fn rank_least_inflight(cands: &[Candidate], rng: &mut fastrand::Rng) -> Vec<usize> {
    let mut order: Vec<usize> = (0..cands.len()).collect();
    sort_with_random_ties(&mut order, rng, |i| cands[i].inflight);
    order
}

/// Rendezvous (highest random weight) hashing: the node whose `hash(key, node key)` is highest.
/// Adding or removing a node moves only the sessions that hashed to it.
pub fn rank_session(cands: &[Candidate], session_key: &str) -> Vec<usize> {
    let weight = |c: &Candidate| {
        let mut h = blake3::Hasher::new();
        h.update(session_key.as_bytes());
        h.update(&c.key.to_le_bytes());
        let mut b = [0u8; 8];
        b.copy_from_slice(&h.finalize().as_bytes()[..8]);
        u64::from_le_bytes(b)
    };
    let mut order: Vec<usize> = (0..cands.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(weight(&cands[i])));
    order
}

/// A policy plus the little state some policies keep (the round-robin cursor).
#[derive(Debug)]
pub struct Router {
    policy: Policy,
    params: PrefixParams,
    cursor: AtomicUsize,
}

impl Router {
    /// A router for `policy`.
    pub fn new(policy: Policy, params: PrefixParams) -> Self {
        Router {
            policy,
            params,
            cursor: AtomicUsize::new(0),
        }
    }

    /// The policy in force.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// The `prefix` policy's knobs.
    pub fn params(&self) -> &PrefixParams {
        &self.params
    }

    /// Ranks `cands` for a request whose prompt is `size`.
    pub fn rank(
        &self,
        cands: &[Candidate],
        size: &PromptSize,
        session_key: Option<&str>,
        rng: &mut fastrand::Rng,
    ) -> Decision {
        let n = cands.len();
        match self.policy {
            Policy::Prefix => rank_prefix(cands, size, &self.params, rng),
            Policy::RoundRobin => {
                let start = if n == 0 {
                    0
                } else {
                    self.cursor.fetch_add(1, Ordering::Relaxed) % n
                };
                Decision {
                    order: (0..n).map(|i| (start + i) % n).collect(),
                    reason: Reason::RoundRobin,
                }
            }
            Policy::LeastInflight => Decision {
                order: rank_least_inflight(cands, rng),
                reason: Reason::LeastInflight,
            },
            Policy::PowerOfTwo => {
                let mut order = rank_least_inflight(cands, rng);
                if n >= 2 {
                    let a = rng.usize(..n);
                    let mut b = rng.usize(..n - 1);
                    if b >= a {
                        b += 1;
                    }
                    let pick = if cands[b].inflight < cands[a].inflight {
                        b
                    } else {
                        a
                    };
                    order.retain(|&i| i != pick);
                    order.insert(0, pick);
                }
                Decision {
                    order,
                    reason: Reason::PowerOfTwo,
                }
            }
            Policy::Session => match session_key {
                Some(k) => Decision {
                    order: rank_session(cands, k),
                    reason: Reason::SessionHash,
                },
                None => Decision {
                    order: rank_least_inflight(cands, rng),
                    reason: Reason::SessionNoKey,
                },
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(i: u32, inflight: u64, pending: u64, overlap: usize) -> Candidate {
        Candidate {
            node: NodeId(i),
            key: i as u64 * 7919,
            inflight,
            pending_prefill_bytes: pending,
            overlap_blocks: overlap,
        }
    }

    /// 1000 bytes in blocks of 100.
    const SIZE: PromptSize = PromptSize {
        total_bytes: 1000,
        block_bytes: 100,
    };

    fn p() -> PrefixParams {
        PrefixParams {
            decode_cost_bytes: 50,
            uncached_weight: 1.0,
            balance_abs_threshold: 4,
            balance_rel_threshold: 2.0,
        }
    }

    #[test]
    fn longest_overlap_wins_at_equal_load() {
        let c = [cand(0, 1, 0, 2), cand(1, 1, 0, 9), cand(2, 1, 0, 0)];
        let d = rank_prefix(&c, &SIZE, &p(), &mut fastrand::Rng::with_seed(1));
        assert_eq!(d.order[0], 1);
        assert_eq!(d.reason, Reason::PrefixHit);
        assert_eq!(d.order.len(), 3);
    }

    #[test]
    fn queued_prefill_outweighs_a_small_overlap() {
        // Node 1 saves 200 bytes of prefill but has 5000 queued.
        let c = [cand(0, 1, 0, 0), cand(1, 1, 5000, 2)];
        let d = rank_prefix(&c, &SIZE, &p(), &mut fastrand::Rng::with_seed(1));
        assert_eq!(d.order, vec![0, 1]);
        assert_eq!(d.reason, Reason::LoadOverPrefix);
    }

    #[test]
    fn imbalance_falls_back_to_least_loaded() {
        let c = [cand(0, 20, 0, 10), cand(1, 2, 0, 0), cand(2, 3, 0, 0)];
        let d = rank_prefix(&c, &SIZE, &p(), &mut fastrand::Rng::with_seed(1));
        assert_eq!(d.order, vec![1, 2, 0]);
        assert_eq!(d.reason, Reason::Imbalanced);
        assert!(
            !imbalanced(&[cand(0, 6, 0, 0), cand(1, 3, 0, 0)], &p()),
            "6-3 is within the absolute threshold"
        );
    }

    #[test]
    fn cold_ties_spread_over_all_nodes() {
        let c = [cand(0, 0, 0, 0), cand(1, 0, 0, 0), cand(2, 0, 0, 0)];
        let mut rng = fastrand::Rng::with_seed(7);
        let mut hits = [0usize; 3];
        for _ in 0..300 {
            let d = rank_prefix(&c, &SIZE, &p(), &mut rng);
            assert_eq!(d.reason, Reason::Cold);
            hits[d.order[0]] += 1;
        }
        assert!(hits.iter().all(|&h| h > 60), "{hits:?}");
    }

    #[test]
    fn round_robin_cycles_and_session_sticks() {
        let c = [cand(0, 0, 0, 0), cand(1, 0, 0, 0), cand(2, 0, 0, 0)];
        let r = Router::new(Policy::RoundRobin, p());
        let mut rng = fastrand::Rng::with_seed(1);
        let firsts: Vec<usize> = (0..6)
            .map(|_| r.rank(&c, &PromptSize::default(), None, &mut rng).order[0])
            .collect();
        assert_eq!(firsts, vec![0, 1, 2, 0, 1, 2]);
        let s = Router::new(Policy::Session, p());
        let a = s
            .rank(&c, &PromptSize::default(), Some("alice"), &mut rng)
            .order[0];
        for _ in 0..10 {
            assert_eq!(
                s.rank(&c, &PromptSize::default(), Some("alice"), &mut rng)
                    .order[0],
                a
            );
        }
        // Removing another node does not move alice.
        let without: Vec<Candidate> = c
            .iter()
            .copied()
            .filter(|x| x.node.0 as usize != (a + 1) % 3)
            .collect();
        let again = s
            .rank(&without, &PromptSize::default(), Some("alice"), &mut rng)
            .order[0];
        assert_eq!(without[again].node, c[a].node);
        assert_eq!(
            s.rank(&c, &PromptSize::default(), None, &mut rng).reason,
            Reason::SessionNoKey
        );
    }

    #[test]
    fn least_inflight_and_power_of_two_prefer_idle_nodes() {
        let c = [cand(0, 5, 0, 0), cand(1, 0, 0, 0)];
        let mut rng = fastrand::Rng::with_seed(3);
        assert_eq!(
            Router::new(Policy::LeastInflight, p())
                .rank(&c, &PromptSize::default(), None, &mut rng)
                .order,
            vec![1, 0]
        );
        for _ in 0..20 {
            assert_eq!(
                Router::new(Policy::PowerOfTwo, p())
                    .rank(&c, &PromptSize::default(), None, &mut rng)
                    .order[0],
                1
            );
        }
    }
}
