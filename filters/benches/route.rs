//! One routing decision for a 32 KB prompt against a residency index holding 1M digests over
//! 16 nodes: overlap lookup + `prefix` ranking (criterion), then p50/p99 over 20,000 timed
//! decisions, printed as a table. Twice: a text-mode chain (256-byte blocks: 128 digests), and
//! a token-mode one (8,192 tokens, about 32 KB of English, in 16-token blocks: 512 digests;
//! tokenizing is measured apart, by `cargo bench -p kvmesh-tokenize`).
#![allow(missing_docs)] // criterion_group! generates undocumented public functions

use std::time::Instant;

use criterion::{criterion_group, Criterion};
use kvmesh_filters::chain::{text_chain, token_chain, Digest, Namespace};
use kvmesh_filters::residency::{NodeId, ResidencyConfig, ResidencyIndex, Source};
use kvmesh_filters::route::{rank_prefix, Candidate, PrefixParams, PromptSize};

const NODES: u32 = 16;
const CHAINS_PER_NODE: usize = 250;
const BLOCKS_PER_CHAIN: usize = 250; // 16 x 250 x 250 = 1M digests

fn prompt(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(seed);
    (0..len).map(|_| rng.u8(b'a'..=b'z')).collect()
}

/// The proxy's default text-mode block.
const BLOCK_BYTES: usize = 256;

/// One request: its chain and size.
struct Request {
    chain: Vec<Digest>,
    size: PromptSize,
}

struct Setup {
    index: ResidencyIndex,
    text: Request,
    tokens: Request,
    params: PrefixParams,
}

/// The token mode's block, tokens (engine-shim's and vLLM's default).
const BLOCK_TOKENS: usize = 16;

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
                BLOCKS_PER_CHAIN * BLOCK_BYTES,
            );
            index.record(
                NodeId(n),
                &text_chain(&ns, &text, BLOCK_BYTES),
                Source::Reported,
                now,
            );
        }
    }
    // The request: 32 KB whose first 100 blocks equal a chain held by nodes 3 and 7.
    let shared = prompt(3 * 1_000_000 + 5, 100 * BLOCK_BYTES);
    index.record(
        NodeId(7),
        &text_chain(&ns, &shared, BLOCK_BYTES),
        Source::Reported,
        now,
    );
    let mut req = shared;
    req.extend(prompt(42, 32 * 1024 - req.len()));
    // Token mode: 8,192 token ids whose first 100 blocks nodes 3 and 7 hold.
    let mut rng = fastrand::Rng::with_seed(9);
    let ids: Vec<u32> = (0..8192).map(|_| rng.u32(..49_152)).collect();
    let held = token_chain(&ns, &ids[..100 * BLOCK_TOKENS], BLOCK_TOKENS);
    for n in [3, 7] {
        index.record(NodeId(n), &held, Source::Reported, now);
    }
    Setup {
        text: Request {
            chain: text_chain(&ns, &req, BLOCK_BYTES),
            size: PromptSize {
                total_bytes: req.len(),
                block_bytes: BLOCK_BYTES,
            },
        },
        tokens: Request {
            chain: token_chain(&ns, &ids, BLOCK_TOKENS),
            size: PromptSize {
                total_bytes: 32 * 1024,
                block_bytes: 32 * 1024 * BLOCK_TOKENS / ids.len(),
            },
        },
        index,
        params,
    }
}

fn decide(s: &Setup, r: &Request, rng: &mut fastrand::Rng) -> usize {
    let mut cands: Vec<Candidate> = (0..NODES)
        .map(|n| Candidate {
            node: NodeId(n),
            key: u64::from(n),
            inflight: u64::from(n % 4),
            pending_prefill_bytes: u64::from(n) * 1000,
            overlap_blocks: 0,
        })
        .collect();
    for (node, blocks) in s.index.overlap(&r.chain, Instant::now()) {
        cands[node.0 as usize].overlap_blocks = blocks;
    }
    rank_prefix(&cands, &r.size, &s.params, rng).order[0]
}

fn bench(c: &mut Criterion, s: &Setup) {
    let mut rng = fastrand::Rng::with_seed(1);
    c.bench_function("route_decision_32KiB_1M_digests_16_nodes", |b| {
        b.iter(|| decide(s, &s.text, &mut rng))
    });
    c.bench_function(
        "route_decision_token_mode_8k_tokens_1M_digests_16_nodes",
        |b| b.iter(|| decide(s, &s.tokens, &mut rng)),
    );
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
    for r in [&s.text, &s.tokens] {
        let chosen = decide(&s, r, &mut rng);
        assert!(
            chosen == 3 || chosen == 7,
            "the decision must pick a node holding the prefix, got {chosen}"
        );
    }
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c, &s);
    c.final_summary();
    println!("\n| decision (1M-digest index, 16 nodes) | blocks | p50 us | p99 us | max us |");
    println!("|---|---:|---:|---:|---:|");
    for (label, r) in [
        ("text mode, 32 KiB prompt", &s.text),
        ("token mode, 8,192 tokens", &s.tokens),
    ] {
        let mut times: Vec<f64> = (0..20_000)
            .map(|_| {
                let t = Instant::now();
                std::hint::black_box(decide(&s, r, &mut rng));
                t.elapsed().as_secs_f64() * 1e6
            })
            .collect();
        times.sort_by(f64::total_cmp);
        let q = |p: f64| times[((p * times.len() as f64) as usize).min(times.len() - 1)];
        println!(
            "| {label}: overlap lookup + prefix ranking | {} | {:.2} | {:.2} | {:.2} |",
            r.chain.len(),
            q(0.5),
            q(0.99),
            times[times.len() - 1]
        );
    }
}

// `criterion_group!` wants a function even though `main` drives criterion itself.
criterion_group!(unused, criterion_unused);
fn criterion_unused(_: &mut Criterion) {}
