//! Sidecar placement: keep the local engine unless a peer saves enough, and the rendezvous
//! home of a cold prefix (`sidecar.cold_placement = "home"`).

use kvmesh_filters::chain::Digest;
use kvmesh_filters::route::Decision;

use crate::config::ColdPlacement;
use crate::plan::RequestFacts;
use crate::service::Gateway;

/// Why a request went where it went: the `reason` of `kvmesh_forwards_total`.
pub(crate) mod reason {
    /// The policy's ranking decided (not sidecar mode, or a non-`prefix` policy).
    pub(crate) const RANK: &str = "rank";
    /// A cold prefix sent to its rendezvous home on a peer.
    pub(crate) const HOME: &str = "home";
    /// A cold prefix sent to a peer after its home and any before it in rendezvous order
    /// (`sidecar.home_load_bound`).
    pub(crate) const HOME_BOUNDED: &str = "home_bounded";
    /// Kept on the local engine.
    pub(crate) const LOCAL: &str = "local";
    /// The local engine is down: the best peer takes it.
    pub(crate) const LOCAL_DOWN: &str = "local_down";
    /// A peer saves at least `sidecar.forward_min_saving`.
    pub(crate) const PREFIX_SAVING: &str = "prefix_saving";
    /// A retry to another engine after the first attempt failed.
    pub(crate) const FAILOVER: &str = "failover";
    /// Every reason, to remove a departed peer's series.
    pub(crate) const ALL: [&str; 7] = [
        RANK,
        HOME,
        HOME_BOUNDED,
        LOCAL,
        LOCAL_DOWN,
        PREFIX_SAVING,
        FAILOVER,
    ];
}

impl Gateway {
    /// Sidecar rule: serve on the local engine unless the best peer saves at least
    /// `sidecar.forward_min_saving` of the `prefix` cost against it (other policies: the rank
    /// decides). Reorders `decision` so the local engine comes first when it keeps the request;
    /// returns why a peer comes first otherwise.
    pub(crate) fn prefer_local(
        &self,
        cands: &[kvmesh_filters::route::Candidate],
        decision: &mut Decision,
        facts: &RequestFacts,
    ) -> &'static str {
        let is_local = |i: usize| {
            self.fleet
                .get(cands[i].node)
                .is_some_and(|e| e.peer.is_none())
        };
        let cold = cands.iter().all(|c| c.overlap_blocks == 0);
        if let (true, ColdPlacement::Home, Some(first)) = (
            cold,
            self.live().cfg.sidecar.cold_placement,
            facts.chain.first(),
        ) {
            if let Some((home, passed_over)) = self.cold_home(cands, first) {
                if let Some(pos) = decision.order.iter().position(|&i| i == home) {
                    decision.order[..=pos].rotate_right(1);
                }
                return match (is_local(home), passed_over) {
                    (true, _) => reason::LOCAL,
                    (false, false) => reason::HOME,
                    (false, true) => reason::HOME_BOUNDED,
                };
            }
        }
        let Some(&first) = decision.order.first() else {
            return reason::RANK;
        };
        if is_local(first) {
            return reason::LOCAL;
        }
        let Some(pos) = decision.order.iter().position(|&i| is_local(i)) else {
            return reason::LOCAL_DOWN;
        };
        let live = self.live();
        if live.router.policy() != kvmesh_filters::route::Policy::Prefix {
            return reason::RANK;
        }
        let p = live.router.params();
        let local_cost =
            kvmesh_filters::route::prefix_cost(&cands[decision.order[pos]], &facts.size, p);
        let peer_cost = kvmesh_filters::route::prefix_cost(&cands[first], &facts.size, p);
        if local_cost.saturating_sub(peer_cost) >= live.cfg.sidecar.forward_min_saving {
            return reason::PREFIX_SAVING;
        }
        decision.order[..=pos].rotate_right(1);
        reason::LOCAL
    }

    /// The rendezvous-hash home of a prefix among `cands`: the candidate maximising
    /// BLAKE3(first digest, node id). Node ids are cluster-wide, so every sidecar agrees. With
    /// `sidecar.home_load_bound` set, candidates are taken in that order and the first whose
    /// queued prefill is within the bound times the mean wins (bounded loads: sidecars whose
    /// views of the load are alike still agree, and a busy home is passed over). Returns the
    /// candidate, and whether the home was passed over for it.
    fn cold_home(
        &self,
        cands: &[kvmesh_filters::route::Candidate],
        first: &Digest,
    ) -> Option<(usize, bool)> {
        let own = self.live().cfg.node_id();
        let weight = |c: &kvmesh_filters::route::Candidate| {
            let engine = self.fleet.get(c.node)?;
            let id = engine
                .peer
                .as_ref()
                .map_or(own.as_str(), |p| p.node_id.as_str());
            let mut h = blake3::Hasher::new();
            h.update(&first.0);
            h.update(id.as_bytes());
            let mut b = [0u8; 8];
            b.copy_from_slice(&h.finalize().as_bytes()[..8]);
            Some(u64::from_le_bytes(b))
        };
        let mut ranked: Vec<(usize, u64)> = cands
            .iter()
            .enumerate()
            .filter_map(|(i, c)| Some((i, weight(c)?)))
            .collect();
        ranked.sort_unstable_by_key(|&(_, w)| std::cmp::Reverse(w));
        let loads: Vec<u64> = ranked
            .iter()
            .map(|&(i, _)| cands[i].pending_prefill_bytes)
            .collect();
        bounded_first(&loads, self.live().cfg.sidecar.home_load_bound).map(|k| (ranked[k].0, k > 0))
    }
}

/// Of `loads` in preference order, the first within `bound` times their mean (`bound` 0: the
/// first). The least loaded is always within, so a non-empty list always has one.
fn bounded_first(loads: &[u64], bound: f64) -> Option<usize> {
    if loads.is_empty() {
        return None;
    }
    if bound <= 0.0 {
        return Some(0);
    }
    let mean = loads.iter().map(|&l| l as f64).sum::<f64>() / loads.len() as f64;
    loads
        .iter()
        .position(|&l| l as f64 <= bound * mean)
        .or(Some(0))
}

#[cfg(test)]
mod tests {
    use super::bounded_first;

    #[test]
    fn bounded_first_passes_over_a_home_loaded_past_the_bound() {
        assert_eq!(bounded_first(&[], 1.25), None);
        // Idle: the home.
        assert_eq!(bounded_first(&[0, 0, 0, 0], 1.25), Some(0));
        // Mean 100: the home at 300 is over 1.25x, the next at 0 is within.
        assert_eq!(bounded_first(&[300, 0, 50, 50], 1.25), Some(1));
        // The second over the bound too: the third.
        assert_eq!(bounded_first(&[200, 160, 20, 20], 1.25), Some(2));
        // Within the bound: the home keeps it.
        assert_eq!(bounded_first(&[120, 80, 100, 100], 1.25), Some(0));
        // Off: the home whatever its load.
        assert_eq!(bounded_first(&[1000, 0, 0, 0], 0.0), Some(0));
    }
}
