//! `kvmesh-bench eval`: long-context quality under KV eviction (docs/eviction.md, "Evaluation").
//!
//! Tasks in the RULER style, generated from a seed: single-needle NIAH (a key-value needle in
//! RULER's noise haystack), multi-passage QA (passages about distinct towns from one template;
//! only the answer's passage names a mayor, the distractors give other facts), and a two-turn
//! variant (two passages name a mayor; the first question is answered, the second asks for the
//! other). The passages are the text parts of one user message, so the segment policy sees each
//! as a segment by default, and nothing tells it which one matters but BM25 of the question. Each item runs with full KV, then every policy at every budget (a fraction of that
//! item's prompt tokens), greedy, on one real `engine-shim`. Reported per task and length: match
//! (the gold value appears in the answer, RULER's string match) and token F1 in percent,
//! evictions per item, decode tokens/s; paired bootstrap of segment against each baseline (95%
//! CI of the difference in match points, two-sided p, Bonferroni-corrected over every
//! comparison made); then peak RSS and peak KV pool per configuration, from fresh engines
//! serving several items at once.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};

use crate::load::{self, HttpClient};
use crate::procs;

/// What to run (the `kvmesh-bench eval` arguments).
#[derive(Debug, Clone, clap::Args)]
pub struct EvalBench {
    /// The GGUF model.
    #[arg(long, default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    pub model: PathBuf,
    /// Tasks, comma-separated (niah, qa, multiturn).
    #[arg(long, value_delimiter = ',', default_value = "niah,qa,multiturn")]
    pub tasks: Vec<String>,
    /// Passages per item, comma-separated: one context length each.
    #[arg(long, value_delimiter = ',', default_value = "10,20")]
    pub passages: Vec<usize>,
    /// Items per task and length.
    #[arg(long, default_value_t = 60)]
    pub items: usize,
    /// KV budgets as fractions of each item's prompt, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "0.5,0.25")]
    pub budgets: Vec<f64>,
    /// Baselines segment is compared against, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "h2o,streaming")]
    pub policies: Vec<String>,
    /// Bootstrap resamples.
    #[arg(long, default_value_t = 2000)]
    pub resamples: usize,
    /// Seed of the items and the bootstrap.
    #[arg(long, default_value_t = 14)]
    pub seed: u64,
    /// Items served at once in the memory phase (0: skip it).
    #[arg(long, default_value_t = 6)]
    pub memory_concurrency: usize,
    /// Where the per-item answers go (JSON lines).
    #[arg(long, default_value = "bench-out/eval.jsonl")]
    pub out: PathBuf,
}

impl EvalBench {
    /// Refuses arguments the run cannot use.
    pub fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.budgets.iter().all(|f| *f > 0.0 && *f < 1.0),
            "--budgets are fractions in (0, 1)"
        );
        let mut distinct = self.budgets.clone();
        distinct.sort_by(f64::total_cmp);
        distinct.dedup();
        anyhow::ensure!(
            distinct.len() == self.budgets.len(),
            "--budgets: each fraction once"
        );
        anyhow::ensure!(
            self.items > 0 && self.resamples > 0,
            "--items and --resamples must be > 0"
        );
        anyhow::ensure!(
            self.passages.iter().all(|&n| n >= 2),
            "--passages: at least 2 per item (the two-turn task asks about two)"
        );
        Ok(())
    }
}

const MODEL_NAME: &str = "SmolLM2-135M-Instruct";
const MAX_TOKENS: u64 = 24;

/// RULER's noise haystack sentence group.
const NOISE: &str =
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";
const TOWNS: &[&str] = &[
    "Arlen", "Brisk", "Corvel", "Dunmore", "Elsby", "Fenwick", "Garrow", "Halden", "Ivel",
    "Jarrow", "Kestle", "Lorne", "Marden", "Norby", "Oakham", "Pellam", "Quarry", "Rosket",
    "Selby", "Tamsin", "Ulver", "Varne", "Wexley", "Yarrow", "Zennor", "Ashby", "Bexley", "Carew",
    "Dorring", "Eskdale",
];
const NAMES: &[&str] = &[
    "Alice Moreau",
    "Bruno Silva",
    "Clara Jensen",
    "Diego Ramos",
    "Elena Petrova",
    "Felix Braun",
    "Grace Okafor",
    "Hugo Lambert",
    "Irene Costa",
    "Jonas Weber",
    "Karin Holm",
    "Luis Ortega",
    "Maya Chen",
    "Nils Berg",
    "Olga Ivanova",
    "Paulo Rocha",
    "Rita Novak",
    "Samir Haddad",
    "Tara Quinn",
    "Victor Hale",
];
const GOODS: &[&str] = &[
    "cheese", "pottery", "wool", "glass", "cider", "lace", "honey", "salt", "timber", "copper",
];

/// One evaluation item.
#[derive(Debug, Clone)]
struct Item {
    messages: Vec<Value>,
    gold: String,
}

fn system() -> Value {
    json!({"role": "system", "content": "You are a helpful assistant. Answer the question with the value only, using the passages."})
}

/// The passages as the text parts of one user message: every part is a segment by default,
/// and the chat template adds its per-message tokens (reserved) once, not once a passage.
fn passages(parts: Vec<String>) -> Value {
    let parts: Vec<Value> = parts
        .into_iter()
        .map(|p| json!({"type": "text", "text": p}))
        .collect();
    json!({"role": "user", "content": parts})
}

/// NIAH: `n` filler passages, the needle in a random one of them.
fn niah(rng: &mut fastrand::Rng, n: usize) -> Item {
    let key = format!("{}-{}", pick(rng, GOODS), pick(rng, TOWNS).to_lowercase());
    let value = rng.u32(1_000_000..10_000_000).to_string();
    let at = rng.usize(..n);
    let parts = (0..n)
        .map(|i| match i == at {
            true => format!("Passage {}: {NOISE} One of the special magic numbers for {key} is: {value}. {NOISE}\n", i + 1),
            false => format!("Passage {}: {NOISE} {NOISE}\n", i + 1),
        })
        .collect();
    let question = format!("What is the special magic number for {key} mentioned in the passages?");
    Item {
        messages: vec![
            system(),
            passages(parts),
            json!({"role": "user", "content": question}),
        ],
        gold: value,
    }
}

/// `n` passages about distinct towns, written from one template; only the towns in `mayors`
/// (indices) have a passage naming their mayor, the others give other facts. Returns the
/// passages, the towns and the mayors named.
fn towns(
    rng: &mut fastrand::Rng,
    n: usize,
    mayors: &[usize],
) -> (Vec<String>, Vec<String>, Vec<String>) {
    let mut ts: Vec<&str> = TOWNS.to_vec();
    rng.shuffle(&mut ts);
    let (mut ps, mut tn, mut ms) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..n {
        // More passages than towns: a numbered suffix keeps them distinct.
        let town = match i / ts.len() {
            0 => ts[i % ts.len()].to_string(),
            k => format!("{} {}", ts[i % ts.len()], k + 1),
        };
        let mayor = pick(rng, NAMES).to_string();
        let good = pick(rng, GOODS);
        ps.push(if mayors.contains(&i) {
            format!("Passage {}: {town} is a small town known for its {good}. The mayor of {town} is {mayor}.\n", i + 1)
        } else {
            format!(
                "Passage {}: {town} is a small town known for its {good}. It was founded in {} and has {} thousand inhabitants.\n",
                i + 1,
                rng.u32(1200..1900),
                rng.u32(2..90)
            )
        });
        tn.push(town);
        ms.push(mayor);
    }
    (ps, tn, ms)
}

/// Multi-passage QA: `n` town passages, one naming its town's mayor; the question asks for it.
fn qa(rng: &mut fastrand::Rng, n: usize) -> Item {
    let at = rng.usize(..n);
    let (ps, ts, ms) = towns(rng, n, &[at]);
    let question = format!("Who is the mayor of {}?", ts[at]);
    Item {
        messages: vec![
            system(),
            passages(ps),
            json!({"role": "user", "content": question}),
        ],
        gold: ms[at].clone(),
    }
}

/// Two turns of QA: two passages name a mayor; the first question is answered (with its gold
/// answer), then the second asks for the other.
fn multiturn(rng: &mut fastrand::Rng, n: usize) -> Item {
    let first = rng.usize(..n);
    let mut second = rng.usize(..n - 1);
    if second >= first {
        second += 1;
    }
    let (ps, ts, ms) = towns(rng, n, &[first, second]);
    Item {
        messages: vec![
            system(),
            passages(ps),
            json!({"role": "user", "content": format!("Who is the mayor of {}?", ts[first])}),
            json!({"role": "assistant", "content": format!("The mayor of {} is {}.", ts[first], ms[first])}),
            json!({"role": "user", "content": format!("And who is the mayor of {}?", ts[second])}),
        ],
        gold: ms[second].clone(),
    }
}

fn pick<'a>(rng: &mut fastrand::Rng, from: &[&'a str]) -> &'a str {
    from[rng.usize(..from.len())]
}

fn items(task: &str, n: usize, count: usize, seed: u64) -> anyhow::Result<Vec<Item>> {
    let mut rng = fastrand::Rng::with_seed(seed);
    (0..count)
        .map(|_| match task {
            "niah" => Ok(niah(&mut rng, n)),
            "qa" => Ok(qa(&mut rng, n)),
            "multiturn" => Ok(multiturn(&mut rng, n)),
            other => anyhow::bail!("unknown task {other:?}: use niah, qa or multiturn"),
        })
        .collect()
}

/// Lower-cased alphanumeric words.
fn words(s: &str) -> Vec<String> {
    s.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .collect()
}

/// RULER's string match: the gold's words appear, in order and adjacent, in the answer.
fn matches(answer: &str, gold: &str) -> bool {
    let (a, g) = (words(answer), words(gold));
    !g.is_empty() && a.windows(g.len()).any(|w| w == g.as_slice())
}

/// SQuAD's token F1 between answer and gold words.
fn f1(answer: &str, gold: &str) -> f64 {
    let (a, g) = (words(answer), words(gold));
    let mut left = g.clone();
    let mut common = 0usize;
    for w in &a {
        if let Some(i) = left.iter().position(|x| x == w) {
            left.swap_remove(i);
            common += 1;
        }
    }
    if common == 0 {
        return 0.0;
    }
    let (p, r) = (
        common as f64 / a.len() as f64,
        common as f64 / g.len() as f64,
    );
    2.0 * p * r / (p + r)
}

/// One answer and what the engine reported with it.
#[derive(Debug, Clone, Default, serde::Serialize)]
struct Answer {
    text: String,
    prompt_tokens: u64,
    completion_tokens: u64,
    evictions: u64,
    evicted_tokens: u64,
    over_budget_tokens: u64,
    /// Seconds from the first to the last streamed token.
    decode_secs: f64,
    /// The engine's 400, when it refused the configuration for this item (for the segment
    /// policy, a budget below the prompt's reserved part): scored as a miss.
    refused: Option<String>,
}

/// One streamed chat request (greedy), its text and usage.
async fn ask(client: &HttpClient, url: &str, body: &Value) -> anyhow::Result<Answer> {
    let req = http::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec(body)?)))?;
    let resp = client.request(req).await?;
    let status = resp.status();
    if status == 400 {
        let bytes = resp.into_body().collect().await?.to_bytes();
        return Ok(Answer {
            refused: Some(String::from_utf8_lossy(&bytes).into_owned()),
            ..Answer::default()
        });
    }
    let mut body = resp.into_body();
    let mut raw = Vec::new();
    let (mut first, mut last) = (None, None);
    let t0 = Instant::now();
    let mut ans = Answer::default();
    while let Some(frame) = body.frame().await {
        let frame = frame?;
        let Some(data) = frame.data_ref() else {
            continue;
        };
        raw.extend_from_slice(data);
        while let Some(end) = raw.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = raw.drain(..end + 2).collect();
            let Some(payload) = event.strip_prefix(b"data: ") else {
                continue;
            };
            let Ok(v) = serde_json::from_slice::<Value>(payload) else {
                continue;
            };
            if let Some(t) = v["choices"][0]["delta"]["content"]
                .as_str()
                .filter(|t| !t.is_empty())
            {
                ans.text.push_str(t);
                first.get_or_insert(t0.elapsed());
                last = Some(t0.elapsed());
            }
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                let n = |x: &Value| x.as_u64().unwrap_or(0);
                ans.prompt_tokens = n(&u["prompt_tokens"]);
                ans.completion_tokens = n(&u["completion_tokens"]);
                ans.evictions = n(&u["kv_eviction"]["evictions"]);
                ans.evicted_tokens = n(&u["kv_eviction"]["evicted_tokens"]);
                ans.over_budget_tokens = n(&u["kv_eviction"]["over_budget_tokens"]);
            }
            if let Some(e) = v.get("error") {
                anyhow::bail!("engine error: {e}");
            }
        }
    }
    anyhow::ensure!(
        status == 200,
        "engine answered {status}: {}",
        String::from_utf8_lossy(&raw)
    );
    anyhow::ensure!(ans.prompt_tokens > 0, "no usage in the answer");
    if let (Some(f), Some(l)) = (first, last) {
        ans.decode_secs = (l - f).as_secs_f64();
    }
    Ok(ans)
}

fn body(item: &Item, eviction: Option<(&str, u64)>) -> Value {
    let mut b = json!({"model": MODEL_NAME, "messages": item.messages, "temperature": 0,
                       "max_tokens": MAX_TOKENS, "stream": true,
                       "stream_options": {"include_usage": true}});
    if let Some((policy, budget)) = eviction {
        b["kv_eviction"] = json!({"policy": policy, "budget_tokens": budget});
    }
    b
}

/// A configuration: `full`, or a policy at a budget fraction.
#[derive(Debug, Clone, PartialEq)]
struct Config {
    policy: String,
    budget: f64,
}

impl Config {
    fn label(&self) -> String {
        if self.policy == "full" {
            "full KV".into()
        } else {
            format!("{} @ {:.0}%", self.policy, self.budget * 100.0)
        }
    }
}

/// Paired bootstrap of mean(a - b): (mean, 95% CI low, high, two-sided p).
fn paired_bootstrap(
    a: &[f64],
    b: &[f64],
    resamples: usize,
    rng: &mut fastrand::Rng,
) -> (f64, f64, f64, f64) {
    let d: Vec<f64> = a.iter().zip(b).map(|(x, y)| x - y).collect();
    let n = d.len();
    if n == 0 {
        return (0.0, 0.0, 0.0, 1.0);
    }
    let mean = d.iter().sum::<f64>() / n as f64;
    let mut means: Vec<f64> = (0..resamples)
        .map(|_| (0..n).map(|_| d[rng.usize(..n)]).sum::<f64>() / n as f64)
        .collect();
    means.sort_by(f64::total_cmp);
    let q = |p: f64| means[((means.len() - 1) as f64 * p).round() as usize];
    // Shifted to the null (mean 0): how often a resample is at least as far from it.
    let extreme = means
        .iter()
        .filter(|m| (*m - mean).abs() >= mean.abs())
        .count();
    let p = (extreme as f64 + 1.0) / (resamples as f64 + 1.0);
    (mean, q(0.025), q(0.975), p)
}

/// Runs the evaluation; returns Markdown tables.
pub async fn run(b: &EvalBench) -> anyhow::Result<String> {
    let args = vec![
        "--model".to_string(),
        b.model.display().to_string(),
        "--cache-blocks".into(),
        "2048".into(),
    ];
    let engine = procs::engine_shim(&args)?;
    let url = format!("http://{}/v1/chat/completions", engine.addr);
    let client = load::client(b.memory_concurrency.max(1));
    if let Some(dir) = b.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut jsonl = String::new();
    let mut configs = vec![Config {
        policy: "full".into(),
        budget: 1.0,
    }];
    for &f in &b.budgets {
        for p in std::iter::once("segment").chain(b.policies.iter().map(String::as_str)) {
            configs.push(Config {
                policy: p.to_string(),
                budget: f,
            });
        }
    }
    let mut out = format!(
        "\n### KV eviction: quality ({} items per row, greedy, {MAX_TOKENS} tokens max, seed {})\n\n| task | passages | prompt tokens (mean) | configuration | match % | F1 % | refused | evictions per item (min / mean) | evicted tokens per item | decode tok/s |\n|---|---:|---:|---|---:|---:|---:|---:|---:|---:|\n",
        b.items, b.seed
    );
    // (task, passages, budget, baseline, diff, lo, hi, p)
    let mut comparisons = Vec::new();
    let mut boot_rng = fastrand::Rng::with_seed(b.seed ^ 0xB007);
    for task in &b.tasks {
        for (li, &n) in b.passages.iter().enumerate() {
            let set = items(task, n, b.items, b.seed + 1000 * li as u64)?;
            // scores[config][item]
            let mut results: Vec<Vec<Answer>> = vec![Vec::new(); configs.len()];
            for (k, item) in set.iter().enumerate() {
                let full = ask(&client, &url, &body(item, None)).await?;
                let pt = full.prompt_tokens;
                results[0].push(full);
                for (ci, c) in configs.iter().enumerate().skip(1) {
                    let budget = ((pt as f64 * c.budget).floor() as u64).max(8);
                    let a = ask(&client, &url, &body(item, Some((&c.policy, budget)))).await?;
                    results[ci].push(a);
                }
                for (ci, c) in configs.iter().enumerate() {
                    let a = &results[ci][k];
                    jsonl += &format!(
                        "{}\n",
                        json!({"task": task, "passages": n, "item": k, "config": c.label(), "gold": item.gold, "answer": a})
                    );
                }
                eprintln!(
                    "eval: {task} / {n} passages: item {} of {} done",
                    k + 1,
                    set.len()
                );
            }
            let score = |ci: usize, f: &dyn Fn(&Answer, &str) -> f64| -> Vec<f64> {
                results[ci]
                    .iter()
                    .zip(&set)
                    .map(|(a, it)| f(a, &it.gold))
                    .collect()
            };
            let em = |a: &Answer, g: &str| if matches(&a.text, g) { 100.0 } else { 0.0 };
            let tf1 = |a: &Answer, g: &str| 100.0 * f1(&a.text, g);
            let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
            let prompt_mean = mean(
                &results[0]
                    .iter()
                    .map(|a| a.prompt_tokens as f64)
                    .collect::<Vec<_>>(),
            );
            for (ci, c) in configs.iter().enumerate() {
                let r = &results[ci];
                let ev: Vec<f64> = r.iter().map(|a| a.evictions as f64).collect();
                let min_ev = ev.iter().copied().fold(f64::INFINITY, f64::min);
                let toks = mean(
                    &r.iter()
                        .map(|a| a.evicted_tokens as f64)
                        .collect::<Vec<_>>(),
                );
                let (dt, ds) = r.iter().fold((0u64, 0f64), |(t, s), a| {
                    (t + a.completion_tokens.saturating_sub(1), s + a.decode_secs)
                });
                let refused = r.iter().filter(|a| a.refused.is_some()).count();
                out += &format!(
                    "| {task} | {n} | {prompt_mean:.0} | {} | {:.1} | {:.1} | {refused} | {} | {toks:.0} | {:.1} |\n",
                    c.label(),
                    mean(&score(ci, &em)),
                    mean(&score(ci, &tf1)),
                    if c.policy == "full" { "-".to_string() } else { format!("{min_ev:.0} / {:.1}", mean(&ev)) },
                    dt as f64 / ds.max(1e-9),
                );
            }
            for &f in &b.budgets {
                let seg = configs
                    .iter()
                    .position(|c| c.policy == "segment" && c.budget == f);
                for base in std::iter::once("full").chain(b.policies.iter().map(String::as_str)) {
                    let other = configs
                        .iter()
                        .position(|c| c.policy == base && (base == "full" || c.budget == f));
                    if let (Some(s), Some(o)) = (seg, other) {
                        let (d, lo, hi, p) = paired_bootstrap(
                            &score(s, &em),
                            &score(o, &em),
                            b.resamples,
                            &mut boot_rng,
                        );
                        comparisons.push((task.clone(), n, f, base.to_string(), d, lo, hi, p));
                    }
                }
            }
        }
    }
    std::fs::write(&b.out, jsonl)?;
    let m = comparisons.len().max(1) as f64;
    out += &format!(
        "\n### Segment against each baseline: paired bootstrap of the match difference ({} resamples; p two-sided, Bonferroni over {} comparisons; the CIs are not corrected)\n\n| task | passages | budget | segment minus | points | 95% CI | p (corrected) |\n|---|---:|---:|---|---:|---|---:|\n",
        b.resamples, comparisons.len()
    );
    for (task, n, f, base, d, lo, hi, p) in &comparisons {
        out += &format!(
            "| {task} | {n} | {:.0}% | {} | {d:+.1} | [{lo:+.1}, {hi:+.1}] | {:.4} |\n",
            f * 100.0,
            if base == "full" { "full KV" } else { base },
            (p * m).min(1.0)
        );
    }
    drop(engine);
    if b.memory_concurrency > 0 {
        out += &memory(b, &configs).await?;
    }
    Ok(out)
}

/// Peak RSS and peak KV pool per configuration: a fresh engine each, serving
/// `memory_concurrency` QA items at once (sequences that finished prefill hold their evicted KV
/// while the next ones prefill).
async fn memory(b: &EvalBench, configs: &[Config]) -> anyhow::Result<String> {
    let n = *b.passages.iter().max().unwrap_or(&20);
    let set = items("qa", n, b.memory_concurrency, b.seed ^ 0x4D45)?;
    let mut out = format!(
        "\n### Memory: {} QA items ({n} passages) at once, a fresh engine per configuration\n\n| configuration | peak RSS MiB | peak KV pool tokens | vs full KV (pool) |\n|---|---:|---:|---:|\n",
        set.len()
    );
    let args = vec!["--model".to_string(), b.model.display().to_string()];
    let client = load::client(set.len());
    // Each item's prompt size, from an engine of its own: a full-KV request on the measured
    // engines would raise their peak before the measurement.
    let mut prompts = Vec::new();
    {
        let e = procs::engine_shim(&args)?;
        let url = format!("http://{}/v1/chat/completions", e.addr);
        for item in &set {
            let mut one = body(item, None);
            one["max_tokens"] = json!(1);
            prompts.push(ask(&client, &url, &one).await?.prompt_tokens);
        }
    }
    let mut full_pool = 0.0;
    for c in configs {
        let e = procs::engine_shim(&args)?;
        let url = format!("http://{}/v1/chat/completions", e.addr);
        let mut tasks = Vec::new();
        for (item, &pt) in set.iter().zip(&prompts) {
            let budget = ((pt as f64 * c.budget).floor() as u64).max(8);
            let ev = (c.policy != "full").then_some((c.policy.as_str(), budget));
            let (client, url, body) = (client.clone(), url.clone(), body(item, ev));
            tasks.push(tokio::spawn(async move { ask(&client, &url, &body).await }));
        }
        for t in tasks {
            t.await??;
        }
        let text = procs::metrics_text(&client, e.addr).await?;
        let peak_pool = text
            .lines()
            .find_map(|l| l.strip_prefix("engine_shim_kv_pool_peak_tokens "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .context("engine-shim /metrics has no engine_shim_kv_pool_peak_tokens")?;
        let rss = crate::engine_shim::peak_rss_mib(e.pid());
        if c.policy == "full" {
            full_pool = peak_pool;
        }
        out += &format!(
            "| {} | {rss:.0} | {peak_pool:.0} | {:.2} |\n",
            c.label(),
            peak_pool / full_pool.max(1.0)
        );
        eprintln!("eval: memory {}: done", c.label());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scoring_follows_ruler_and_squad() {
        assert!(matches("The mayor of Arlen is Maya Chen.", "Maya Chen"));
        assert!(!matches("The mayor is Maya.", "Maya Chen"));
        assert!(matches("It is: 4821937", "4821937"));
        assert!(!matches("48219370", "4821937"));
        assert!((f1("Maya Chen", "Maya Chen") - 1.0).abs() < 1e-9);
        assert!((f1("the mayor is Maya Chen", "Maya Chen") - 2.0 * 0.4 / 1.4).abs() < 1e-9);
        assert_eq!(f1("nobody", "Maya Chen"), 0.0);
    }

    #[test]
    fn items_are_seeded_and_hold_their_answer_once() {
        let a = items("qa", 12, 5, 7).expect("qa");
        let b = items("qa", 12, 5, 7).expect("qa");
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(x.messages, y.messages);
            let text = serde_json::to_string(&x.messages).unwrap_or_default();
            assert!(text.contains(&format!("is {}.", x.gold)));
            assert_eq!(
                text.matches("The mayor of").count(),
                1,
                "one passage names a mayor"
            );
        }
        let n = items("niah", 6, 3, 1).expect("niah");
        for it in &n {
            // System, the passages (6 parts), the question.
            assert_eq!(it.messages.len(), 3);
            assert_eq!(it.messages[1]["content"].as_array().map(Vec::len), Some(6));
            assert_eq!(
                serde_json::to_string(&it.messages)
                    .unwrap_or_default()
                    .matches(&it.gold)
                    .count(),
                1
            );
        }
        let m = items("multiturn", 4, 3, 2).expect("multiturn");
        assert!(m.iter().all(|it| it.messages.len() == 5));
        assert!(items("lsat", 4, 1, 0).is_err());
    }

    #[test]
    fn the_paired_bootstrap_separates_a_real_difference_from_none() {
        let mut rng = fastrand::Rng::with_seed(3);
        let a: Vec<f64> = (0..60)
            .map(|i| if i % 10 < 9 { 100.0 } else { 0.0 })
            .collect();
        let b: Vec<f64> = (0..60)
            .map(|i| if i % 10 < 3 { 100.0 } else { 0.0 })
            .collect();
        let (d, lo, hi, p) = paired_bootstrap(&a, &b, 2000, &mut rng);
        assert!(
            (d - 60.0).abs() < 1e-9 && lo > 40.0 && hi <= 80.0 && p < 0.001,
            "{d} {lo} {hi} {p}"
        );
        let (d, lo, hi, p) = paired_bootstrap(&a, &a, 2000, &mut rng);
        assert!(d == 0.0 && lo == 0.0 && hi == 0.0 && p > 0.5);
    }
}
