//! Reading `usage` out of a non-streamed answer as it passes through the proxy, in 16 KiB
//! chunks: the body scanner (what the proxy runs: it keeps only the `usage` value) against
//! the way it was read before (keep the whole body, then parse the object after its last
//! `"usage"`), on an embeddings answer (3.4 MB of floats) and a chat answer (1.1 MB of text
//! with escaped quotes). docs/benchmarks.md has the figures.
#![allow(missing_docs)] // criterion_group! generates undocumented public functions

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvmesh_filters::usage::{from_json, JsonUsageScanner};

const CHUNK: usize = 16 << 10;

fn embeddings() -> Vec<u8> {
    let vector = vec!["-0.012345678"; 256].join(",");
    let data: Vec<String> = (0..1000)
        .map(|i| format!(r#"{{"object":"embedding","index":{i},"embedding":[{vector}]}}"#))
        .collect();
    format!(
        r#"{{"object":"list","data":[{}],"model":"m","usage":{{"prompt_tokens":10,"total_tokens":10}}}}"#,
        data.join(",")
    )
    .into_bytes()
}

fn chat() -> Vec<u8> {
    let text = r#"The quick brown fox jumps over the lazy dog. \"quoted\" "#.repeat(20_000);
    format!(
        r#"{{"id":"c","object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":"{text}"}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":10,"completion_tokens":5}}}}"#
    )
    .into_bytes()
}

fn scan(body: &[u8]) -> bool {
    let mut s = JsonUsageScanner::new(64 << 10);
    for c in body.chunks(CHUNK) {
        s.feed(c);
    }
    s.usage().is_some()
}

fn buffered(body: &[u8]) -> bool {
    let mut kept = Vec::new();
    for c in body.chunks(CHUNK) {
        kept.extend_from_slice(c);
    }
    from_json(&kept).is_some()
}

fn bench(c: &mut Criterion) {
    for (name, body) in [("embeddings", embeddings()), ("chat", chat())] {
        assert!(scan(&body) && buffered(&body), "{name}: no usage found");
        let mut g = c.benchmark_group(format!("usage/{name} ({} bytes)", body.len()));
        g.throughput(Throughput::Bytes(body.len() as u64));
        g.bench_function("scanner", |b| b.iter(|| scan(&body)));
        g.bench_function("buffered (before)", |b| b.iter(|| buffered(&body)));
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
