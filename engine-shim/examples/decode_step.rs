//! Model-level decode speed, without HTTP: loads the GGUF, prefills `n` sequences of 256
//! tokens, then times batched decode steps over all of them, for each `weights` given.
//!
//! ```text
//! cargo run --release -p engine-shim --example decode_step -- models/SmolLM2-135M-Instruct.Q4_1.gguf f32,q8_0 1,8 50
//! ```
//!
//! For `q8_0`, run it with `OMP_WAIT_POLICY=passive`, as the engine then runs itself; f32 runs
//! as the engine does with the variable unset (docs/engine-shim.md).

use std::time::Instant;

use anyhow::Context;
use engine_shim::gguf::Gguf;
use engine_shim::model::{Chunk, KvCache, Llama, WeightType};

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let model = args
        .next()
        .context("usage: decode_step MODEL WEIGHTS SEQS STEPS")?;
    let weights = args.next().unwrap_or_else(|| "f32,q8_0".into());
    let seqs = args.next().unwrap_or_else(|| "1,8".into());
    let steps: usize = args.next().unwrap_or_else(|| "50".into()).parse()?;
    tch::set_num_threads(2);
    let _guard = tch::no_grad_guard();
    let g = Gguf::open(std::path::Path::new(&model))?;
    println!("| weights | sequences | prefill tok/s | decode step ms | aggregate tok/s |");
    println!("|---|---:|---:|---:|---:|");
    for w in weights.split(',') {
        let wt: WeightType = w.parse().map_err(anyhow::Error::msg)?;
        let m = Llama::load(&g, wt)?;
        for n in seqs.split(',') {
            let n: usize = n.parse()?;
            let prompt: Vec<u32> = (0..256u32).map(|i| 100 + i * 7 % 5000).collect();
            let mut caches: Vec<KvCache> = (0..n)
                .map(|_| KvCache::new(&m.cfg, 256 + steps + 8))
                .collect();
            let t = Instant::now();
            for c in caches.iter_mut() {
                let _ = m.forward(&prompt, c, true);
            }
            let prefill = (256 * n) as f64 / t.elapsed().as_secs_f64();
            let tokens = vec![[42u32]; n];
            let mut step = || {
                let mut chunks: Vec<Chunk> = caches
                    .iter_mut()
                    .zip(&tokens)
                    .map(|(kv, t)| Chunk {
                        tokens: t,
                        kv,
                        logits: true,
                        decode: true,
                    })
                    .collect();
                let _ = m.forward_batch(&mut chunks).argmax(-1, false);
            };
            for _ in 0..3 {
                step();
            }
            let t = Instant::now();
            for _ in 0..steps {
                step();
            }
            let ms = t.elapsed().as_secs_f64() * 1e3 / steps as f64;
            println!(
                "| {w} | {n} | {prefill:.0} | {ms:.1} | {:.1} |",
                n as f64 * 1e3 / ms
            );
        }
    }
    Ok(())
}
