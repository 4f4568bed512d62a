//! The engine worker driven directly (the real model, no HTTP): a job that fails inside the
//! model is answered with `Failed`, what it touched leaves the prefix cache, and the worker goes
//! on serving; the load gauges are clear before `Done` is sent. Needs `scripts/setup.sh`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use engine_shim::engine::{Event, Job, SamplingParams, Stats, Worker};
use engine_shim::gguf::Gguf;
use engine_shim::model::{Llama, WeightType};
use engine_shim::tokenizer::ModelTokenizer;
use tokio::sync::mpsc;

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
    drop(g);
    let stats = Arc::new(Stats::default());
    let worker = Worker::new(
        model,
        tok.clone(),
        "SmolLM2-135M-Instruct",
        64,
        256,
        None,
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

    // A token id outside the vocabulary makes libtorch fail inside the forward pass (after the
    // cached blocks were read): the job fails, and the blocks it touched leave the pool.
    let mut poisoned = france.clone();
    poisoned.push(vocab + 7);
    let (ev, running) = run_job(&jobs, &stats, poisoned, greedy(4));
    assert!(matches!(ev.last(), Some(Event::Failed { .. })), "{ev:?}");
    assert_eq!(running, 0);
    assert_eq!(stats.requests_failed.load(Ordering::Relaxed), 2);
    assert_eq!(stats.cache_blocks.load(Ordering::Relaxed), 0);

    // Still serving, from a clean cache, with the same answer.
    let (ev, running) = run_job(&jobs, &stats, france, greedy(24));
    assert_eq!(cached(&ev), Some(0));
    assert_eq!(text(&ev), "The capital of France is Paris.");
    assert_eq!(running, 0);
    drop(jobs);
    thread.join().unwrap();
}
