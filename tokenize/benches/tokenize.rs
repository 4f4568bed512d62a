//! What token mode costs the proxy per request: rendering a 32 KiB chat prompt with the model's
//! template and tokenizing it whole, against tokenizing only the leading blocks routing hashes
//! (`encode_prefix`, at 64 and 1,024 blocks of 16 tokens), with nothing cached and with every
//! chunk cached (a prompt whose prefix was seen); and streaming an answer's text, decoding all
//! its ids after each one against decoding each once. Needs the model (scripts/setup.sh).
#![allow(missing_docs)] // criterion_group! generates undocumented public functions
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, Criterion};
use kvmesh_tokenize::gguf::Gguf;
use kvmesh_tokenize::{ModelTokenizer, PrefixCache, TextStream};

fn tokenizer() -> ModelTokenizer {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let g = Gguf::open(&path).expect("the model (scripts/setup.sh installs it)");
    ModelTokenizer::from_gguf(&g).unwrap()
}

/// About 32 KiB of English-like text, from a seed.
fn passage() -> String {
    const WORDS: &[&str] = &[
        "the",
        "harbour",
        "was",
        "rebuilt",
        "in",
        "1872",
        "after",
        "a",
        "storm,",
        "and",
        "its",
        "merchants",
        "traded",
        "salt",
        "fish",
        "timber",
        "with",
        "towns",
        "along",
        "coast.",
    ];
    let mut rng = fastrand::Rng::with_seed(7);
    let mut s = String::new();
    while s.len() < 32 * 1024 {
        s.push_str(WORDS[rng.usize(..WORDS.len())]);
        s.push(' ');
    }
    s
}

fn bench(c: &mut Criterion) {
    let tok = tokenizer();
    let turns = vec![
        (
            "system".to_string(),
            "You are a careful assistant.".to_string(),
        ),
        ("user".to_string(), passage()),
    ];
    let prompt = tok.render_chat(&turns).unwrap();
    eprintln!(
        "prompt: {} bytes, {} tokens",
        prompt.len(),
        tok.encode(&prompt).unwrap().len()
    );
    let mut g = c.benchmark_group("tokenize_32KiB_chat");
    g.bench_function("render", |b| b.iter(|| tok.render_chat(&turns).unwrap()));
    g.bench_function("encode_whole", |b| b.iter(|| tok.encode(&prompt).unwrap()));
    for blocks in [64usize, 1024] {
        // Nothing cached: every chunk tokenized.
        g.bench_function(format!("encode_prefix_{blocks}_blocks_uncached"), |b| {
            b.iter(|| {
                tok.encode_prefix(&prompt, blocks * 16, &PrefixCache::new(1024, 0), b"")
                    .unwrap()
            })
        });
        // The same prompt again (a shared prefix): every chunk from the cache.
        let cache = PrefixCache::new(1024, 1 << 21);
        g.bench_function(format!("encode_prefix_{blocks}_blocks_cached"), |b| {
            b.iter(|| {
                tok.encode_prefix(&prompt, blocks * 16, &cache, b"")
                    .unwrap()
            })
        });
    }
    g.finish();

    // What an engine pays to stream an answer's text: decoding all of its ids after each new
    // one (engine-shim before `decode_step`), against decoding each id once.
    let mut g = c.benchmark_group("detokenize_answer");
    let ids = tok.encode(&passage()).unwrap();
    for n in [256usize, 2048] {
        let ids = &ids[..n];
        g.bench_function(format!("whole_after_each_{n}_tokens"), |b| {
            b.iter(|| {
                (1..=ids.len())
                    .map(|k| tok.decode(&ids[..k]).unwrap().len())
                    .sum::<usize>()
            })
        });
        g.bench_function(format!("decode_step_{n}_tokens"), |b| {
            b.iter(|| {
                let mut stream = TextStream::default();
                ids.iter()
                    .map(|&id| {
                        tok.decode_step(&mut stream, id)
                            .unwrap()
                            .map_or(0, |p| p.len())
                    })
                    .sum::<usize>()
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
