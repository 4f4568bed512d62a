//! The engine worker driven directly (the real model, no HTTP): a job that fails inside the
//! model is answered with `Failed`, the blocks it added leave the prefix cache (the shared
//! prefix it only read stays), and the worker goes on serving; the load gauges are clear before `Done` is sent. Needs `scripts/setup.sh`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use engine_shim::cache::KvBlock;
use engine_shim::engine::{BlockStore, Event, Job, SamplingParams, Schedule, Stats, Worker};
use engine_shim::gguf::Gguf;
use engine_shim::model::{Llama, WeightType};
use engine_shim::tokenizer::ModelTokenizer;
use kvmesh_filters::chain::Digest;
use tokio::sync::mpsc;

/// A block store that pages in whatever payloads the test queued (and stores nothing).
struct QueuedStore(Arc<Mutex<Vec<Vec<u8>>>>);

impl BlockStore for QueuedStore {
    fn put(&mut self, _blocks: Vec<(Digest, Vec<u8>)>) {}
    fn get_leading(&mut self, digests: &[Digest]) -> Vec<Vec<u8>> {
        let mut q = self.0.lock().unwrap();
        let n = digests.len().min(q.len());
        q.drain(..n).collect()
    }
}

fn model_path() -> PathBuf {
    let p =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: run scripts/setup.sh",
        p.display()
    );
    p
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens,
        temperature: 0.0,
        top_p: 1.0,
        top_k: 0,
        min_p: 0.0,
        seed: None,
        stop: Vec::new(),
    }
}

/// Runs one job to its last event; returns every event, and `running` as read right after the
/// last one arrived.
fn run_job(
    jobs: &std::sync::mpsc::SyncSender<Job>,
    stats: &Stats,
    prompt: Vec<u32>,
    params: SamplingParams,
) -> (Vec<Event>, u64) {
    let (tx, mut rx) = mpsc::unbounded_channel();
    stats.waiting.fetch_add(1, Ordering::Relaxed);
    jobs.send(Job {
        prompt,
        params,
        events: tx,
        stream: false,
        cache_salt: String::new(),
        eviction: Default::default(),
    })
    .unwrap();
    let mut events = Vec::new();
    while let Some(ev) = rx.blocking_recv() {
        let last = matches!(ev, Event::Done { .. } | Event::Failed { .. });
        events.push(ev);
        if last {
            return (events, stats.running.load(Ordering::Relaxed));
        }
    }
    panic!("the worker stopped before the last event: {events:?}");
}

fn text(events: &[Event]) -> String {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Text(t) => Some(t.as_str()),
            _ => None,
        })
        .collect()
}

fn cached(events: &[Event]) -> Option<usize> {
    events.iter().find_map(|e| match e {
        Event::Started { cached_tokens, .. } => Some(*cached_tokens),
        _ => None,
    })
}

#[test]
fn a_failing_job_is_answered_and_the_worker_keeps_serving() {
    let g = Gguf::open(&model_path()).unwrap();
    let tok = Arc::new(ModelTokenizer::from_gguf(&g).unwrap());
    let model = Llama::load(&g, WeightType::F32).unwrap();
    let vocab = model.cfg.vocab as u32;
    let block_bytes = KvBlock::bytes(&model.cfg);
    drop(g);
    let stats = Arc::new(Stats::default());
    let queued = Arc::new(Mutex::new(Vec::new()));
    let worker = Worker::new(
        model,
        tok.clone(),
        "SmolLM2-135M-Instruct",
        Schedule {
            cache_blocks: 64,
            prefill_chunk: 256,
            max_num_seqs: 8,
            max_num_batched_tokens: 512,
            kv_pool_tokens: 8192,
        },
        Some(Box::new(QueuedStore(queued.clone()))),
        stats.clone(),
    );
    let (jobs, queue) = std::sync::mpsc::sync_channel(8);
    let thread = std::thread::spawn(move || worker.run(queue));
    let france = tok
        .encode(
            &tok.render_chat(&[("user".into(), "What is the capital of France?".into())])
                .unwrap(),
        )
        .unwrap();

    // A normal job fills the prefix cache with the prompt's two full blocks.
    let (ev, running) = run_job(&jobs, &stats, france.clone(), greedy(24));
    assert_eq!(text(&ev), "The capital of France is Paris.");
    assert_eq!(running, 0, "running was still set when Done arrived");
    assert_eq!(stats.cache_blocks.load(Ordering::Relaxed), 2);

    // A completion bound that overflows `prompt + max_tokens`: refused, not a panic.
    let (ev, running) = run_job(&jobs, &stats, france.clone(), greedy(usize::MAX));
    assert!(
        matches!(ev.last(), Some(Event::Failed { message }) if message.contains("context")),
        "{ev:?}"
    );
    assert_eq!(running, 0);

    // The France prompt's two blocks, then two more blocks paged in from the store, then a token
    // id outside the vocabulary: libtorch fails inside the forward pass after the cached blocks
    // were read and the paged-in ones added. The job fails; the two blocks it added leave the
    // pool, the shared prefix it only read stays.
    let mut poisoned = france.clone();
    let filler = tok.encode(" and then").unwrap();
    while poisoned.len() < 4 * 16 + 1 {
        poisoned.extend_from_slice(&filler[usize::from(tok.add_bos)..]);
    }
    poisoned.truncate(4 * 16 + 1);
    poisoned.push(vocab + 7);
    queued
        .lock()
        .unwrap()
        .extend([vec![0u8; block_bytes], vec![0u8; block_bytes]]);
    let (ev, running) = run_job(&jobs, &stats, poisoned, greedy(4));
    assert!(matches!(ev.last(), Some(Event::Failed { .. })), "{ev:?}");
    assert!(
        queued.lock().unwrap().is_empty(),
        "the blocks were not paged in"
    );
    assert_eq!(running, 0);
    assert_eq!(stats.requests_failed.load(Ordering::Relaxed), 2);
    assert_eq!(stats.cache_blocks.load(Ordering::Relaxed), 2);

    // Still serving, from the shared prefix, with the same answer.
    let (ev, running) = run_job(&jobs, &stats, france, greedy(24));
    assert_eq!(cached(&ev), Some(32));
    assert_eq!(text(&ev), "The capital of France is Paris.");
    assert_eq!(running, 0);
    drop(jobs);
    thread.join().unwrap();
}
