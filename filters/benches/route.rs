//! One routing decision for a 32 KB prompt against a residency index holding 1M digests over
//! 16 nodes: overlap lookup + `prefix` ranking (criterion), then p50/p99 over 20,000 timed
//! decisions, printed as a table.
#![allow(missing_docs)] // criterion_group! generates undocumented public functions

use std::time::Instant;

use criterion::{criterion_group, Criterion};
use kvmesh_filters::chain::{text_chain, Digest, Namespace};
use kvmesh_filters::residency::{NodeId, ResidencyConfig, ResidencyIndex, Source};
use kvmesh_filters::route::{rank_prefix, Candidate, PrefixParams};

const NODES: u32 = 16;
const CHAINS_PER_NODE: usize = 250;
const BLOCKS_PER_CHAIN: usize = 250; // 16 x 250 x 250 = 1M digests

fn prompt(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(seed);
    (0..len).map(|_| rng.u8(b'a'..=b'z')).collect()
}

struct Setup {
    index: ResidencyIndex,
    request: Vec<Digest>,
    total_bytes: usize,
    params: PrefixParams,
}

fn setup() -> Setup {
    let params = PrefixParams::default();
    let ns = Namespace::new("bench-model", b"");
    let index = ResidencyIndex::new(ResidencyConfig {
        capacity_per_node: 100_000,
        ..Default::default()
    });
    let now = Instant::now();
    for n in 0..NODES {
        for c in 0..CHAINS_PER_NODE {
            let text = prompt(
                u64::from(n) * 1_000_000 + c as u64,
                BLOCKS_PER_CHAIN * params.block_bytes,
            );
            index.record(
                NodeId(n),
                &text_chain(&ns, &text, params.block_bytes),
                Source::Reported,
                now,
            );
        }
    }
    // The request: 32 KB whose first 100 blocks equal a chain held by nodes 3 and 7.
    let shared = prompt(3 * 1_000_000 + 5, 100 * params.block_bytes);
    index.record(
        NodeId(7),
        &text_chain(&ns, &shared, params.block_bytes),
        Source::Reported,
        now,
    );
    let mut req = shared;
    req.extend(prompt(42, 32 * 1024 - req.len()));
    Setup {
        request: text_chain(&ns, &req, params.block_bytes),
        total_bytes: req.len(),
        index,
        params,
    }
}

fn decide(s: &Setup, rng: &mut fastrand::Rng) -> usize {
    let mut cands: Vec<Candidate> = (0..NODES)
        .map(|n| Candidate {
            node: NodeId(n),
            key: u64::from(n),
            inflight: u64::from(n % 4),
            pending_prefill_bytes: u64::from(n) * 1000,
            overlap_blocks: 0,
        })
        .collect();
    for (node, blocks) in s.index.overlap(&s.request, Instant::now()) {
        cands[node.0 as usize].overlap_blocks = blocks;
    }
    rank_prefix(&cands, s.total_bytes, &s.params, rng).order[0]
}

fn bench(c: &mut Criterion, s: &Setup) {
    let mut rng = fastrand::Rng::with_seed(1);
    c.bench_function("route_decision_32KiB_1M_digests_16_nodes", |b| {
        b.iter(|| decide(s, &mut rng))
    });
}

/// Resident memory of this process in KiB (Linux), for the index's footprint.
fn rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn main() {
    let t = Instant::now();
    let before = rss_kib();
    let s = setup();
    let after = rss_kib();
    eprintln!(
        "index: {} digests over {NODES} nodes, built in {:.1?}",
        s.index.len(),
        t.elapsed()
    );
    if let (Some(b), Some(a)) = (before, after) {
        println!(
            "index memory: {:.0} MiB resident for {} digests ({:.0} bytes per digest)",
            (a - b) as f64 / 1024.0,
            s.index.len(),
            (a - b) as f64 * 1024.0 / s.index.len() as f64
        );
    }
    let mut rng = fastrand::Rng::with_seed(1);
    let chosen = decide(&s, &mut rng);
    assert!(
        chosen == 3 || chosen == 7,
        "the decision must pick a node holding the prefix, got {chosen}"
    );
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c, &s);
    c.final_summary();
    let mut times: Vec<f64> = (0..20_000)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(decide(&s, &mut rng));
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    times.sort_by(f64::total_cmp);
    let q = |p: f64| times[((p * times.len() as f64) as usize).min(times.len() - 1)];
    println!("\n| decision (32 KiB prompt, {} blocks, 1M-digest index, 16 nodes) | p50 us | p99 us | max us |", s.request.len());
    println!("|---|---:|---:|---:|");
    println!(
        "| overlap lookup + prefix ranking | {:.2} | {:.2} | {:.2} |",
        q(0.5),
        q(0.99),
        times[times.len() - 1]
    );
}

// `criterion_group!` wants a function even though `main` drives criterion itself.
criterion_group!(unused, criterion_unused);
fn criterion_unused(_: &mut Criterion) {}
