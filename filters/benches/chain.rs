//! Digest-chain throughput (text mode, default 256-byte blocks) for 1 KB, 32 KB and 256 KB prompts.
#![allow(missing_docs)] // criterion_group! generates undocumented public functions

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvmesh_filters::chain::{text_chain, Namespace};

fn chain(c: &mut Criterion) {
    let ns = Namespace::new("bench-model", b"");
    // The proxy's default `routing.block_bytes`.
    let block = 256;
    let mut g = c.benchmark_group("text_chain");
    for size in [1024usize, 32 * 1024, 256 * 1024] {
        let prompt: Vec<u8> = (0..size).map(|i| (i * 31 % 251) as u8).collect();
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_with_input(
            BenchmarkId::from_parameter(format!("{}KiB", size / 1024)),
            &prompt,
            |b, p| b.iter(|| text_chain(&ns, std::hint::black_box(p), block)),
        );
    }
    g.finish();
}

criterion_group!(benches, chain);
criterion_main!(benches);
