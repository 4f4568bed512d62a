//! Workloads: what to send and when. Every generator is seeded and deterministic.
//!
//! - [`trace`]: the Mooncake trace, at its own timestamps divided by a time scale.
//! - [`shared_prompts`]: K system prompts x M users (`load::SharedPrefix`).
//! - [`multi_turn`]: chat sessions whose context grows turn by turn.
//! - [`rag`]: retrieval-augmented prompts over a document pool with Zipf popularity.
//! - [`agent`]: agent loops: a long stable prefix (tools + instructions) and a short varying,
//!   growing suffix.
//!
//! Synthetic workloads get Poisson arrivals at a given rate (open loop) or are sent closed loop.

use std::time::Duration;

use bytes::Bytes;
use serde_json::{json, Value};

use crate::load::text;
use crate::trace::{self, TraceRequest};

/// What one request carries; rendered to a body only when sent (trace prompts are large).
#[derive(Debug, Clone)]
pub enum Item {
    /// A trace line.
    Trace(TraceRequest),
    /// Chat messages and `max_tokens`.
    Chat(Vec<Value>, u64),
}

/// A request and its arrival offset from the start of the run.
#[derive(Debug, Clone)]
pub struct Planned {
    /// When to send it (open loop); ignored closed loop.
    pub at: Duration,
    /// What to send.
    pub item: Item,
}

impl Planned {
    /// The streamed chat-completions body for `model`.
    pub fn body(&self, model: &str) -> Bytes {
        let (messages, max_tokens) = match &self.item {
            Item::Trace(r) => (
                vec![json!({"role": "user", "content": trace::prompt(r)})],
                r.output_length.max(1),
            ),
            Item::Chat(m, t) => (m.clone(), *t),
        };
        let body = json!({
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        Bytes::from(serde_json::to_vec(&body).unwrap_or_default())
    }
}

/// The trace at `timestamp / time_scale`, at most `max_requests` requests (0: all).
pub fn trace(reqs: &[TraceRequest], time_scale: f64, max_requests: usize) -> Vec<Planned> {
    let n = if max_requests == 0 {
        reqs.len()
    } else {
        max_requests.min(reqs.len())
    };
    let scale = if time_scale > 0.0 { time_scale } else { 1.0 };
    reqs[..n]
        .iter()
        .map(|r| Planned {
            at: Duration::from_secs_f64(r.timestamp as f64 / 1000.0 / scale),
            item: Item::Trace(r.clone()),
        })
        .collect()
}

/// Poisson arrivals at `rate` per second (seeded); `rate <= 0` sends everything at once.
pub fn poisson(items: Vec<Item>, rate: f64, seed: u64) -> Vec<Planned> {
    let mut rng = fastrand::Rng::with_seed(seed ^ 0xA5A5);
    let mut t = 0.0f64;
    items
        .into_iter()
        .map(|item| {
            if rate > 0.0 {
                // Exponential gap: -ln(U) / rate, U in (0, 1].
                t += -(1.0 - rng.f64()).ln() / rate;
            }
            Planned {
                at: Duration::from_secs_f64(t),
                item,
            }
        })
        .collect()
}

fn user(content: String) -> Value {
    json!({"role": "user", "content": content})
}

fn system(content: String) -> Value {
    json!({"role": "system", "content": content})
}

/// K system prompts x M users x T turns, in seeded random order.
pub fn shared_prompts(w: &crate::load::SharedPrefix) -> Vec<Item> {
    w.requests()
        .into_iter()
        .map(|(_, messages)| Item::Chat(messages, w.max_tokens))
        .collect()
}

/// (sequence, step) pairs for `n` sequences of `steps` steps: sequences interleave at random
/// (seeded), the steps of one sequence stay in order.
fn interleave(n: usize, steps: usize, seed: u64) -> Vec<(usize, usize)> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut next = vec![0usize; n];
    let mut open: Vec<usize> = if steps == 0 {
        Vec::new()
    } else {
        (0..n).collect()
    };
    let mut order = Vec::with_capacity(n * steps);
    while !open.is_empty() {
        let i = rng.usize(..open.len());
        let s = open[i];
        order.push((s, next[s]));
        next[s] += 1;
        if next[s] == steps {
            open.swap_remove(i);
        }
    }
    order
}

/// `sessions` chat sessions of `turns` turns: turn t sends the system prompt, all earlier
/// questions and (synthetic) answers, and a new question. Sessions interleave at random; turns
/// of one session stay in order.
pub fn multi_turn(
    sessions: usize,
    turns: usize,
    system_bytes: usize,
    turn_bytes: usize,
    max_tokens: u64,
    seed: u64,
) -> Vec<Item> {
    let order = interleave(sessions, turns, seed);
    order
        .into_iter()
        .map(|(s, t)| {
            let mut msgs = vec![system(text(seed ^ ((s as u64 + 1) * 31), system_bytes))];
            for k in 0..=t {
                msgs.push(user(text(seed ^ (((s * 1000 + k) as u64 + 7) * 131), turn_bytes)));
                if k < t {
                    msgs.push(json!({"role": "assistant", "content": text(seed ^ (((s * 1000 + k) as u64 + 3) * 257), turn_bytes)}));
                }
            }
            Item::Chat(msgs, max_tokens)
        })
        .collect()
}

/// Zipf(s) over `n` ranks: P(rank k) proportional to 1 / k^s.
pub struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    /// The distribution over ranks `0..n`.
    pub fn new(n: usize, s: f64) -> Self {
        let mut acc = 0.0;
        let mut cdf: Vec<f64> = (1..=n.max(1))
            .map(|k| {
                acc += 1.0 / (k as f64).powf(s);
                acc
            })
            .collect();
        for c in &mut cdf {
            *c /= acc;
        }
        Zipf { cdf }
    }

    /// A rank drawn from `rng`.
    pub fn sample(&self, rng: &mut fastrand::Rng) -> usize {
        let u = rng.f64();
        self.cdf.partition_point(|&c| c < u).min(self.cdf.len() - 1)
    }
}

/// `queries` RAG prompts: a fixed system prompt, then `docs_per_query` documents drawn from a
/// pool of `pool` by Zipf(`zipf_s`) popularity (most popular first), then a question.
#[allow(clippy::too_many_arguments)]
pub fn rag(
    queries: usize,
    pool: usize,
    docs_per_query: usize,
    zipf_s: f64,
    doc_bytes: usize,
    question_bytes: usize,
    max_tokens: u64,
    seed: u64,
) -> Vec<Item> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let zipf = Zipf::new(pool, zipf_s);
    let sys = text(seed ^ 0xDEAD, 1000);
    (0..queries)
        .map(|q| {
            let mut docs: Vec<usize> = Vec::new();
            while docs.len() < docs_per_query.min(pool) {
                let d = zipf.sample(&mut rng);
                if !docs.contains(&d) {
                    docs.push(d);
                }
            }
            docs.sort_unstable();
            let mut ctx = String::new();
            for d in docs {
                ctx.push_str(&format!("[doc {d}] "));
                ctx.push_str(&text(seed ^ ((d as u64 + 1) * 7919), doc_bytes));
                ctx.push('\n');
            }
            Item::Chat(
                vec![
                    system(sys.clone()),
                    user(format!(
                        "{ctx}\nQuestion: {}",
                        text(seed ^ (q as u64 * 104_729), question_bytes)
                    )),
                ],
                max_tokens,
            )
        })
        .collect()
}

/// `agents` agent loops of `steps` steps: a long stable prefix (tools and instructions,
/// `prefix_bytes`, shared by all agents of one of `kinds` kinds), then the loop's scratchpad,
/// growing by `step_bytes` per step. Loops interleave; steps stay in order.
pub fn agent(
    agents: usize,
    kinds: usize,
    steps: usize,
    prefix_bytes: usize,
    step_bytes: usize,
    max_tokens: u64,
    seed: u64,
) -> Vec<Item> {
    let kinds = kinds.max(1);
    interleave(agents, steps, seed)
        .into_iter()
        .map(|(a, step)| {
            let kind = a % kinds;
            let mut pad = String::new();
            for k in 0..step {
                pad.push_str(&format!("observation {k}: "));
                pad.push_str(&text(
                    seed ^ (((a * 10_000 + k) as u64 + 1) * 613),
                    step_bytes,
                ));
                pad.push('\n');
            }
            Item::Chat(
                vec![
                    system(text(seed ^ ((kind as u64 + 1) * 1_000_003), prefix_bytes)),
                    user(format!("{pad}next action?")),
                ],
                max_tokens,
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn contents(item: &Item) -> Vec<String> {
        match item {
            Item::Chat(m, _) => m
                .iter()
                .map(|v| v["content"].as_str().unwrap().to_string())
                .collect(),
            Item::Trace(_) => vec![],
        }
    }

    #[test]
    fn trace_timestamps_scale_and_cap() {
        let t = crate::trace::parse(
            "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n{\"timestamp\": 2000, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n",
        )
        .unwrap();
        let p = trace(&t, 4.0, 0);
        assert_eq!(p[1].at, Duration::from_millis(500));
        assert_eq!(trace(&t, 1.0, 1).len(), 1);
        let body: Value = serde_json::from_slice(&p[0].body("m")).unwrap();
        assert_eq!(body["max_tokens"], 1);
        assert_eq!(body["stream"], true);
        assert_eq!(body["messages"][0]["content"].as_str().unwrap().len(), 40);
    }

    #[test]
    fn multi_turn_contexts_grow_and_keep_order() {
        let items = multi_turn(3, 4, 100, 20, 8, 1);
        assert_eq!(items.len(), 12);
        let mut last_len = std::collections::HashMap::new();
        for it in &items {
            let c = contents(it);
            // system + (turn+1) questions + turn answers
            let turn = (c.len() - 2) / 2;
            let prev = last_len.insert(c[0].clone(), turn);
            assert_eq!(
                prev.map_or(0, |p| p + 1),
                turn,
                "turns of a session in order"
            );
        }
        // A later turn extends the earlier one: same prefix.
        let first: Vec<&Item> = items
            .iter()
            .filter(|i| contents(i)[0] == contents(&items[0])[0])
            .collect();
        let (a, b) = (contents(first[0]), contents(first[1]));
        assert_eq!(a[..], b[..a.len()]);
    }

    #[test]
    fn rag_prefers_popular_docs_and_agents_share_prefixes() {
        let z = Zipf::new(100, 1.1);
        let mut rng = fastrand::Rng::with_seed(3);
        let mut hits = [0usize; 100];
        for _ in 0..10_000 {
            hits[z.sample(&mut rng)] += 1;
        }
        assert!(hits[0] > hits[9] && hits[9] > hits[99], "{:?}", &hits[..10]);
        let r = rag(20, 50, 3, 1.1, 200, 30, 8, 2);
        assert_eq!(r.len(), 20);
        assert!(contents(&r[0])[1].contains("[doc "));
        let a = agent(6, 2, 3, 500, 50, 8, 4);
        assert_eq!(a.len(), 18);
        let prefixes: std::collections::HashSet<String> =
            a.iter().map(|i| contents(i)[0].clone()).collect();
        assert_eq!(prefixes.len(), 2, "one stable prefix per agent kind");
        assert_eq!(
            poisson(a, 10.0, 1)
                .windows(2)
                .filter(|w| w[1].at < w[0].at)
                .count(),
            0
        );
    }
}
