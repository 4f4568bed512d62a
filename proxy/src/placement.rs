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
    /// A cold prefix sent to a peer after its home and any before it in the order
    /// `sidecar.home_choices` left (`sidecar.home_load_bound`).
    pub(crate) const HOME_BOUNDED: &str = "home_bounded";
    /// A cold prefix sent to a peer cheaper than its home among its `sidecar.home_choices`.
    pub(crate) const HOME_CHOICE: &str = "home_choice";
    /// Kept on the local engine.
    pub(crate) const LOCAL: &str = "local";
    /// The local engine is down: the best peer takes it.
    pub(crate) const LOCAL_DOWN: &str = "local_down";
    /// A peer saves at least `sidecar.forward_min_saving`.
    pub(crate) const PREFIX_SAVING: &str = "prefix_saving";
    /// A retry to another engine after the first attempt failed.
    pub(crate) const FAILOVER: &str = "failover";
    /// Every reason, to remove a departed peer's series.
    pub(crate) const ALL: [&str; 8] = [
        RANK,
        HOME,
        HOME_BOUNDED,
        HOME_CHOICE,
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
            if let Some((home, why)) = self.cold_home(cands, first, facts) {
                if let Some(pos) = decision.order.iter().position(|&i| i == home) {
                    decision.order[..=pos].rotate_right(1);
                }
                return if is_local(home) { reason::LOCAL } else { why };
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
    /// `sidecar.home_choices` d > 1, the cheapest of the first d in that order (the `prefix`
    /// cost: queued prefill and requests in flight) comes first: two-choice hashing, which
    /// spreads load better than one choice while each prefix keeps the same few candidates
    /// everywhere. With `sidecar.home_load_bound` set, candidates are then taken in
    /// that order and the first whose queued prefill is within the bound times the mean wins
    /// (bounded loads: a busy home is passed over). Sidecars whose views of the load are alike
    /// still agree. Returns the candidate, and why it was chosen ([`reason::HOME`],
    /// [`reason::HOME_CHOICE`] or [`reason::HOME_BOUNDED`]).
    fn cold_home(
        &self,
        cands: &[kvmesh_filters::route::Candidate],
        first: &Digest,
        facts: &RequestFacts,
    ) -> Option<(usize, &'static str)> {
        let live = self.live();
        let own = live.cfg.node_id();
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
        let choices = live.cfg.sidecar.home_choices;
        let costs: Vec<u64> = ranked
            .iter()
            .take(choices)
            .map(|&(i, _)| {
                kvmesh_filters::route::prefix_cost(&cands[i], &facts.size, live.router.params())
            })
            .collect();
        let choice = cheapest_of_first(&costs, choices);
        let home = ranked.first().map(|&(i, _)| i);
        // `ranked` is empty when every candidate left the fleet meanwhile.
        if let Some(head) = ranked.get_mut(..=choice) {
            head.rotate_right(1);
        }
        let loads: Vec<u64> = ranked
            .iter()
            .map(|&(i, _)| cands[i].pending_prefill_bytes)
            .collect();
        // The bound judges queued prefill alone, so it may pass over the cheaper choice (busy
        // with prefill, idle otherwise) and come back to the home.
        let k = bounded_first(&loads, live.cfg.sidecar.home_load_bound)?;
        let chosen = ranked[k].0;
        let why = match (Some(chosen) == home, k) {
            (true, _) => reason::HOME,
            (false, 0) => reason::HOME_CHOICE,
            (false, _) => reason::HOME_BOUNDED,
        };
        Some((chosen, why))
    }
}

/// The position of the cheapest of the first `d` of `costs` (the earlier on a tie, so that
/// every sidecar breaks it alike; 0 when `costs` is empty or `d` is 0 or 1).
fn cheapest_of_first(costs: &[u64], d: usize) -> usize {
    costs
        .iter()
        .take(d.max(1))
        .enumerate()
        .min_by_key(|&(k, &c)| (c, k))
        .map_or(0, |(k, _)| k)
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
    use std::sync::Arc;
    use std::time::Duration;

    use kvmesh_filters::chain::{text_chain_capped, Namespace};
    use kvmesh_filters::route::PromptSize;

    use super::{bounded_first, cheapest_of_first};
    use crate::config::{ColdPlacement, Mode, ProxyConfig};
    use crate::fleet::Fleet;
    use crate::plan::RequestFacts;
    use crate::service::Gateway;
    use crate::testing::{engine_addr, gateway_over, peer_engine};

    /// A sidecar over `fleet` placing cold prefixes at home with `choices` and `bound`.
    fn sidecar(fleet: &Arc<Fleet>, choices: usize, bound: f64) -> Gateway {
        let mut cfg = ProxyConfig {
            mode: Mode::Sidecar,
            ..ProxyConfig::default()
        };
        cfg.sidecar.cold_placement = ColdPlacement::Home;
        cfg.sidecar.home_load_bound = bound;
        cfg.sidecar.home_choices = choices;
        gateway_over(cfg, fleet.clone())
    }

    fn facts(prompt: &str) -> RequestFacts {
        RequestFacts {
            model: "m".into(),
            chain: text_chain_capped(&Namespace::new("m", b""), prompt.as_bytes(), 256, 64),
            size: PromptSize {
                total_bytes: prompt.len(),
                block_bytes: 256,
            },
            ..RequestFacts::default()
        }
    }

    /// Where `gw` sends a cold `prompt` first (the engine's name), and why.
    fn placed(gw: &Gateway, prompt: &str) -> (String, &'static str) {
        let ranking = gw.rank(&facts(prompt)).unwrap();
        let first = ranking.ordered().next().unwrap().node;
        (
            gw.fleet.get(first).unwrap().name.clone(),
            ranking.forward_reason,
        )
    }

    /// With two choices a cold prefix goes to the cheaper of its first two rendezvous nodes,
    /// never further: the home while it is the cheaper, its second choice when the home is
    /// busier, and the home again when the second is busier still, however idle the rest. The
    /// bound, which counts queued prefill alone, may send it back from a cheaper second choice
    /// to the home: that is the home's (`home`), not a pass over it.
    #[test]
    fn a_cold_prefix_goes_to_the_cheaper_of_its_two_first_rendezvous_nodes() {
        use super::reason::{HOME, HOME_CHOICE};
        let local = engine_addr("local", "http://127.0.0.1:1", "127.0.0.1:1", &["m"]);
        let fleet = Fleet::new(vec![local], Duration::from_secs(5));
        for e in fleet.engines().iter() {
            e.mark_up();
        }
        let names = ["p1", "p2", "p3", "p4", "p5"];
        let set_loads = |loads: &dyn Fn(&str) -> (u64, u64)| {
            for (i, n) in names.iter().enumerate() {
                let (inflight, pending) = loads(n);
                fleet.upsert_peer(&peer_engine(n, 10 + i as u16, inflight, pending));
            }
        };
        set_loads(&|_| (0, 0));
        let (one, two, bounded) = (
            sidecar(&fleet, 1, 0.0),
            sidecar(&fleet, 2, 0.0),
            sidecar(&fleet, 2, 1.25),
        );
        let mut checked = 0;
        for p in 0..20 {
            let prompt = format!("{p} ").repeat(400);
            let (home, why) = placed(&one, &prompt);
            if home == "local" {
                // The local engine's load is this proxy's own count: not set here.
                continue;
            }
            assert_eq!(why, HOME);
            assert_eq!(
                placed(&two, &prompt),
                (home.clone(), HOME),
                "idle: ties go to the home"
            );
            set_loads(&|n| if n == home { (0, 1 << 20) } else { (0, 0) });
            assert_eq!(
                placed(&one, &prompt),
                (home.clone(), HOME),
                "one choice: the home"
            );
            let (second, why) = placed(&two, &prompt);
            assert_ne!(second, home, "a busy home is passed over");
            if second == "local" {
                set_loads(&|_| (0, 0));
                continue;
            }
            assert_eq!(why, HOME_CHOICE);
            set_loads(&|n| match n {
                n if n == home => (0, 1 << 20),
                n if n == second => (0, 2 << 20),
                _ => (0, 0),
            });
            assert_eq!(
                placed(&two, &prompt),
                (home.clone(), HOME),
                "never past the first two"
            );
            // The home decodes (4 in flight, 1024 bytes of cost), the second has 600 bytes of
            // prefill queued: the second is cheaper, but over 1.25x the mean queued prefill.
            set_loads(&|n| match n {
                n if n == home => (4, 0),
                n if n == second => (0, 600),
                _ => (0, 0),
            });
            assert_eq!(placed(&two, &prompt), (second.clone(), HOME_CHOICE));
            assert_eq!(placed(&bounded, &prompt), (home.clone(), HOME));
            set_loads(&|_| (0, 0));
            checked += 1;
        }
        assert!(
            checked >= 5,
            "only {checked} prompts had peers as first choices"
        );
    }

    #[test]
    fn the_cheapest_of_the_first_choices_comes_first() {
        assert_eq!(cheapest_of_first(&[], 2), 0);
        // One choice: the home, whatever its cost.
        assert_eq!(cheapest_of_first(&[9, 1, 0], 1), 0);
        assert_eq!(cheapest_of_first(&[9, 1, 0], 0), 0);
        // Two: the cheaper of the first two, never the third.
        assert_eq!(cheapest_of_first(&[9, 1, 0], 2), 1);
        assert_eq!(cheapest_of_first(&[1, 9, 0], 2), 0);
        // A tie keeps the earlier (every sidecar breaks it alike).
        assert_eq!(cheapest_of_first(&[5, 5, 0], 2), 0);
        // More choices than candidates: all of them.
        assert_eq!(cheapest_of_first(&[9, 1, 0], 8), 2);
    }

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
