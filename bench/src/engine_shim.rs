//! `kvmesh-bench engine-shim`: the native engine's prefill and decode speed, peak memory with and
//! without chunked prefill, and time to first token for a shared prefix that is cold, resident,
//! or paged in from kvagent. Every figure comes from real `engine-shim` (and `kvagent`)
//! processes over HTTP; optionally llama.cpp (llama-cpp-python) on the same model beside them.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use serde_json::json;

use crate::load::{self, HttpClient, Sample};
use crate::procs::{self, Proc};

/// What to run.
#[derive(Debug, Clone)]
pub struct ShimBench {
    /// The GGUF model.
    pub model: PathBuf,
    /// Prompt sizes, tokens (approximate; the table reports the exact count).
    pub prompts: Vec<usize>,
    /// Tokens generated per request.
    pub max_tokens: u64,
    /// Shared prefix size for the TTFT comparison, tokens.
    pub shared_prefix: usize,
    /// Python with llama-cpp-python installed, for the side-by-side (skipped when absent).
    pub llama_python: Option<PathBuf>,
    /// engine-shim's `weights` to measure (`f32`, `bf16`, `q8_0`): every table once for each.
    pub weights: Vec<String>,
}

const WORDS: &[&str] = &[
    "apple", "river", "stone", "cloud", "garden", "window", "silver", "forest", "engine", "letter",
    "market", "winter", "bridge", "candle", "harbor", "pencil", "mirror", "planet", "rocket",
    "signal", "thunder", "valley", "wagon", "yellow", "basket", "castle", "dragon", "feather",
    "island", "jacket", "kitten", "ladder", "meadow", "needle", "orange", "pepper", "rabbit",
    "saddle", "tunnel", "violin",
];

/// About `n` tokens of text (one common word is one token), distinct per `seed`.
pub fn words(n: usize, seed: u64) -> String {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut s = String::new();
    for _ in 0..n {
        s.push(' ');
        s.push_str(WORDS[rng.usize(..WORDS.len())]);
    }
    s
}

/// A streamed `/v1/completions` body (raw prompt, no chat template: the same text llama.cpp gets).
fn body(model: &str, prompt: &str, max_tokens: u64) -> Bytes {
    Bytes::from(
        serde_json::to_vec(&json!({
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": true,
            "stream_options": {"include_usage": true},
        }))
        .unwrap_or_default(),
    )
}

fn engine(b: &ShimBench, weights: &str, args: &[String]) -> anyhow::Result<Proc> {
    let mut a = vec![
        "--model".to_string(),
        b.model.display().to_string(),
        "--weights".into(),
        weights.to_string(),
        "--cache-blocks".into(),
        "1024".into(),
    ];
    a.extend_from_slice(args);
    procs::engine_shim(&a)
}

/// Peak resident memory of a process, MiB (VmHWM).
pub(crate) fn peak_rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map(|kib| kib / 1024.0)
        .unwrap_or(0.0)
}

async fn one(client: &HttpClient, url: &str, b: Bytes) -> anyhow::Result<Sample> {
    let s = load::send(client, url, b).await;
    anyhow::ensure!(s.status == 200, "engine answered {}", s.status);
    Ok(s)
}

/// Requests (engine-shim) or generations (llama.cpp) whose median decode rate a prompt-size row
/// reports.
const DECODE_RUNS: usize = 3;

/// A streamed answer's decode tokens/s: the tokens after the first, over the time after it.
fn decode_rate(s: &Sample) -> f64 {
    let decode_time = (s.latency - s.ttft).as_secs_f64();
    s.output_events.saturating_sub(1) as f64 / decode_time.max(1e-9)
}

/// Runs everything, every engine table once per `weights`, then llama.cpp; returns Markdown
/// tables.
pub async fn run(b: &ShimBench) -> anyhow::Result<String> {
    let mut out = String::new();
    for w in &b.weights {
        out += &tables(b, w).await?;
    }
    if let Some(py) = &b.llama_python {
        out += &llama_cpp(py, &b.model, &b.prompts, b.max_tokens)?;
    }
    Ok(out)
}

/// The engine tables for one `weights` setting.
async fn tables(b: &ShimBench, weights: &str) -> anyhow::Result<String> {
    let client = load::client(1);
    let model_name = "SmolLM2-135M-Instruct";
    let mut out = format!("\n### engine-shim, weights = {weights}\n\n");
    out += &format!(
        "| prompt tokens | prefill | prefill tok/s | decode tok/s (median of {DECODE_RUNS}) | peak RSS MiB | RSS over idle MiB |\n|---:|---|---:|---:|---:|---:|\n",
    );
    for &n in &b.prompts {
        for (label, chunk) in [("chunked 256", 256usize), ("one step", 1 << 20)] {
            let e = engine(b, weights, &["--prefill-chunk".into(), chunk.to_string()])?;
            let url = format!("http://{}/v1/completions", e.addr);
            // Warm-up (allocator, libtorch kernels), on a different prompt.
            one(&client, &url, body(model_name, &words(64, 999), 4)).await?;
            let idle = peak_rss_mib(e.pid());
            let request = body(model_name, &words(n, n as u64), b.max_tokens);
            let s = one(&client, &url, request.clone()).await?;
            let prefill = s.prompt_tokens as f64 / s.ttft.as_secs_f64();
            // Decode from the median of DECODE_RUNS requests: the same prompt again (its prefix
            // now cached) decodes at the same context, and one request swings by ~10%.
            let mut decode = vec![decode_rate(&s)];
            for _ in 1..DECODE_RUNS {
                decode.push(decode_rate(&one(&client, &url, request.clone()).await?));
            }
            let decode = percentile(&mut decode, 0.5);
            let peak = peak_rss_mib(e.pid());
            out += &format!(
                "| {} | {label} | {prefill:.0} | {decode:.1} | {peak:.0} | {:.0} |\n",
                s.prompt_tokens,
                peak - idle
            );
            eprintln!("{weights}: prompt {n} {label}: done");
        }
    }

    // TTFT of a shared prefix: cold, resident, paged in from kvagent.
    let dir = std::env::temp_dir().join(format!("kvmesh-bench-shim-{}", std::process::id()));
    let agent = procs::kvagent(
        &dir,
        "[ram]\ncapacity_bytes = 2147483648\n[limits]\nmax_block_bytes = 1048576\n",
    )
    .await?;
    // Both engines sign and check their blocks with one key, so the fresh engine may page in
    // what the first wrote (with a random key per start it would refuse them).
    let key_file =
        std::env::temp_dir().join(format!("kvmesh-bench-shim-{}.key", std::process::id()));
    let key: String = (0..32)
        .map(|_| format!("{:02x}", fastrand::u8(..)))
        .collect();
    std::fs::write(&key_file, key)?;
    let kv = vec![
        "--kvagent".to_string(),
        format!("http://{}", agent.addr),
        "--kv-mac-key-file".to_string(),
        key_file.display().to_string(),
    ];
    let doc = words(b.shared_prefix, 7);
    let ask = |q: &str| body(model_name, &format!("{doc}\nQuestion: {q}"), 8);
    let a = engine(b, weights, &kv)?;
    let url_a = format!("http://{}/v1/completions", a.addr);
    one(&client, &url_a, body(model_name, &words(64, 999), 4)).await?;
    let cold = one(&client, &url_a, ask("which word comes first?")).await?;
    let resident = one(&client, &url_a, ask("which word comes last?")).await?;
    drop(a);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let fresh = engine(b, weights, &kv)?;
    let url_f = format!("http://{}/v1/completions", fresh.addr);
    one(&client, &url_f, body(model_name, &words(64, 998), 4)).await?;
    let paged = one(&client, &url_f, ask("how many words are there?")).await?;
    drop(fresh);
    drop(agent);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_file(&key_file);
    let ms = |s: &Sample| s.ttft.as_secs_f64() * 1e3;
    out += &format!(
        "\n| shared prefix ({} prompt tokens) | cached tokens | TTFT ms | vs cold |\n|---|---:|---:|---:|\n| cold (computed) | {} | {:.0} | 1.00 |\n| resident (prefix cache) | {} | {:.0} | {:.3} |\n| paged in from kvagent (fresh engine) | {} | {:.0} | {:.3} |\n",
        cold.prompt_tokens,
        cold.cached_tokens,
        ms(&cold),
        resident.cached_tokens,
        ms(&resident),
        ms(&resident) / ms(&cold),
        paged.cached_tokens,
        ms(&paged),
        ms(&paged) / ms(&cold),
    );

    out += &batching(b, weights, &client, model_name).await?;
    Ok(out)
}

/// Sends `bodies` at once (or at `gaps` apart when given); returns every sample and the wall
/// time from the first send to the last answer.
async fn concurrent(
    client: &HttpClient,
    url: &str,
    bodies: Vec<Bytes>,
    gaps: Option<Vec<Duration>>,
) -> anyhow::Result<(Vec<Sample>, Duration)> {
    let t0 = std::time::Instant::now();
    let mut tasks = Vec::new();
    let mut at = Duration::ZERO;
    for (i, body) in bodies.into_iter().enumerate() {
        if let Some(g) = gaps.as_ref().and_then(|g| g.get(i)) {
            at += *g;
        }
        let (client, url, start) = (client.clone(), url.to_string(), at);
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(tokio::time::Instant::from_std(t0 + start)).await;
            one(&client, &url, body).await
        }));
    }
    let mut samples = Vec::new();
    for t in tasks {
        samples.push(t.await??);
    }
    Ok((samples, t0.elapsed()))
}

/// The decode steps of a concurrent run: the gaps between a stream's tokens that lie wholly
/// after the last stream's first token (every prompt computed) and before the first end of a
/// stream that ran to `max_tokens`. Each such gap is one step in which every stream still
/// running decodes one token.
#[derive(Clone, Copy, Debug, PartialEq)]
struct DecodeSteps {
    /// Gaps counted, over all streams: the tokens decoded in the window.
    gaps: usize,
    /// The time those steps took, s: each gap divided by the streams running during it.
    busy_secs: f64,
    /// The window's length, s.
    secs: f64,
}

impl DecodeSteps {
    /// Tokens a second, over the streams running.
    fn rate(&self) -> f64 {
        self.gaps as f64 / self.busy_secs.max(1e-9)
    }
}

/// The [`DecodeSteps`] of `samples` (sent together, each asking for `max_tokens`), `None` when
/// no gap lies in the window (for example, a stream ended before another began). Prompt steps
/// stall every decoding stream, so the mean gap over a whole run counts the other streams'
/// prefill too; these gaps are decode steps only, which is what an aggregate decode rate
/// measures. Gaps, not tokens, so that a step straddling the window's start is not counted. A
/// stream that stopped early (end of text) counts as running only until its last token, so
/// the steps after it count one stream fewer.
fn decode_steps(samples: &[Sample], max_tokens: u64) -> Option<DecodeSteps> {
    let times: Vec<Vec<f64>> = samples.iter().map(event_times).collect();
    let last: Vec<f64> = times.iter().filter_map(|t| t.last().copied()).collect();
    let from = samples.iter().map(|s| s.ttft).max()?.as_secs_f64();
    let full = samples
        .iter()
        .zip(&last)
        .filter(|(s, _)| s.output_events >= max_tokens)
        .map(|(_, &t)| t);
    let to = full
        .min_by(f64::total_cmp)
        .or_else(|| last.iter().copied().min_by(f64::total_cmp))?;
    let (mut gaps, mut busy_secs) = (0usize, 0.0);
    for t in &times {
        for w in t.windows(2) {
            if w[0] >= from && w[1] <= to {
                // The streams that got a token after this step began (this one included).
                let running = last.iter().filter(|&&l| l > w[0]).count().max(1);
                gaps += 1;
                busy_secs += (w[1] - w[0]) / running as f64;
            }
        }
    }
    (gaps > 0).then_some(DecodeSteps {
        gaps,
        busy_secs,
        secs: to - from,
    })
}

/// When each content event of `s` arrived, s since its request was sent (the requests of a
/// concurrent run go out together).
fn event_times(s: &Sample) -> Vec<f64> {
    let mut at = s.ttft.as_secs_f64();
    let mut times = vec![at];
    for gap in &s.itl_ms {
        at += f64::from(*gap) / 1e3;
        times.push(at);
    }
    times
}

/// Rounds of each concurrent-streams row: one round's decode window is a second or two, and
/// the rate of one swung by ~15% between otherwise equal runs.
const BATCH_ROUNDS: usize = 3;

/// One round of a concurrent-streams row.
struct BatchRound {
    /// Content events over all streams.
    tokens: u64,
    /// Mean gap between a stream's tokens over the whole round (prefill stalls included), ms.
    mean_itl_ms: f64,
    /// Its decode steps, if any gap lay in the window.
    steps: Option<DecodeSteps>,
}

impl BatchRound {
    /// The round whose streams (sent together, each asking for `max_tokens`) gave `samples`.
    fn of(samples: &[Sample], max_tokens: u64) -> BatchRound {
        let itl: Vec<f64> = samples
            .iter()
            .flat_map(|s| s.itl_ms.iter().map(|&x| f64::from(x)))
            .collect();
        BatchRound {
            tokens: samples.iter().map(|s| s.output_events).sum(),
            mean_itl_ms: itl.iter().sum::<f64>() / itl.len().max(1) as f64,
            steps: decode_steps(samples, max_tokens),
        }
    }

    /// Aggregate decode tokens/s of its steps (0 without any).
    fn rate(&self) -> f64 {
        self.steps.map_or(0.0, |s| s.rate())
    }
}

/// The round with the median aggregate decode rate (the lower middle of an even count).
fn median_round<'a>(rounds: &[&'a BatchRound]) -> Option<&'a BatchRound> {
    let mut sorted = rounds.to_vec();
    sorted.sort_by(|a, b| a.rate().total_cmp(&b.rate()));
    sorted.get(sorted.len().saturating_sub(1) / 2).copied()
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Continuous batching: aggregate decode tokens/s at 1/4/8/16 concurrent streams, the median of
/// [`BATCH_ROUNDS`] rounds each (one fresh engine, distinct prompts so nothing is cached), then
/// TTFT and ITL under a Poisson load.
async fn batching(
    b: &ShimBench,
    weights: &str,
    client: &HttpClient,
    model_name: &str,
) -> anyhow::Result<String> {
    let e = engine(b, weights, &[])?;
    let url = format!("http://{}/v1/completions", e.addr);
    one(client, &url, body(model_name, &words(64, 999), 4)).await?;
    let mut out = String::from(
        "\n| concurrent streams (128-token prompts) | rounds | generated tokens | decode window s | steps timed (gaps) | aggregate decode tok/s (median) | rounds' range | vs 1 stream | mean ITL ms (stalls included) | streams / mean ITL | peak RSS MiB |\n|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|\n",
    );
    let mut single = None;
    for (row, n) in [1usize, 4, 8, 16].into_iter().enumerate() {
        // Each round sends its own prompts: nothing is cached from an earlier one.
        let mut rounds = Vec::with_capacity(BATCH_ROUNDS);
        for round in 0..BATCH_ROUNDS {
            let bodies = (0..n)
                .map(|i| {
                    let seed = 10_000 + 1_000 * row as u64 + 100 * round as u64 + i as u64;
                    body(model_name, &words(128, seed), b.max_tokens)
                })
                .collect();
            let (samples, _) = concurrent(client, &url, bodies, None).await?;
            rounds.push(BatchRound::of(&samples, b.max_tokens));
        }
        let timed: Vec<&BatchRound> = rounds.iter().filter(|r| r.steps.is_some()).collect();
        let median = median_round(&timed);
        if n == 1 {
            single = median.map(BatchRound::rate);
        }
        let cells = match median.and_then(|m| Some((m, m.steps?))) {
            Some((m, steps)) => {
                let rates: Vec<f64> = timed.iter().map(|r| r.rate()).collect();
                let lo = rates.iter().copied().fold(f64::INFINITY, f64::min);
                let hi = rates.iter().copied().fold(0.0, f64::max);
                let vs = single.map_or("-".into(), |s| format!("{:.2}", m.rate() / s.max(1e-9)));
                format!(
                    "{} | {} | {:.2} | {} | {:.1} | {lo:.1}-{hi:.1} | {vs} | {:.1} | {:.1}",
                    timed.len(),
                    m.tokens,
                    steps.secs,
                    steps.gaps,
                    m.rate(),
                    m.mean_itl_ms,
                    n as f64 * 1e3 / m.mean_itl_ms.max(1e-9),
                )
            }
            None => "0 | - | - | - | - | - | - | - | -".into(),
        };
        out += &format!("| {n} | {cells} | {:.0} |\n", peak_rss_mib(e.pid()));
        eprintln!("{weights}: batching: {n} streams done");
    }
    // Poisson arrivals at `rate` requests/s for a fixed count.
    let (count, rate) = (48usize, 1.5f64);
    let mut rng = fastrand::Rng::with_seed(42);
    let gaps: Vec<Duration> = (0..count)
        .map(|_| Duration::from_secs_f64(-(1.0 - rng.f64()).ln() / rate))
        .collect();
    let bodies = (0..count)
        .map(|i| body(model_name, &words(64 + 16 * (i % 8), 20_000 + i as u64), 32))
        .collect();
    let (samples, wall) = concurrent(client, &url, bodies, Some(gaps)).await?;
    let mut ttft: Vec<f64> = samples.iter().map(|s| s.ttft.as_secs_f64() * 1e3).collect();
    let mut itl: Vec<f64> = samples
        .iter()
        .flat_map(|s| s.itl_ms.iter().map(|&x| x as f64))
        .collect();
    out += &format!(
        "\n| Poisson load | requests | wall s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | peak RSS MiB |\n|---|---:|---:|---:|---:|---:|---:|---:|\n| {rate} req/s, 64-176-token prompts, 32 tokens | {count} | {:.1} | {:.0} | {:.0} | {:.1} | {:.1} | {:.0} |\n",
        wall.as_secs_f64(),
        percentile(&mut ttft, 0.5),
        percentile(&mut ttft, 0.99),
        percentile(&mut itl, 0.5),
        percentile(&mut itl, 0.99),
        peak_rss_mib(e.pid()),
    );
    Ok(out)
}

/// llama.cpp through llama-cpp-python on the same GGUF and prompts (an external baseline).
fn llama_cpp(
    py: &Path,
    model: &Path,
    prompts: &[usize],
    max_tokens: u64,
) -> anyhow::Result<String> {
    let script = r#"
import sys, time, json
from llama_cpp import Llama
model, n_tokens, max_tokens = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])
llm = Llama(model_path=model, n_ctx=8192, n_threads=2, verbose=False)
words = sys.stdin.read().split("\n")
runs = int(sys.argv[4])
for n, text in zip(n_tokens, words):
    toks = llm.tokenize(text.encode(), add_bos=False)
    pre, dec = None, []
    for _ in range(runs):
        llm.reset()
        t = time.perf_counter(); llm.eval(toks); p = time.perf_counter() - t
        pre = pre or p
        out = 0; t = time.perf_counter()
        for tok in llm.generate([], temp=0, reset=False):
            out += 1
            if out >= max_tokens: break
        dec.append(out / (time.perf_counter() - t))
    print(json.dumps({"n": len(toks), "prefill": len(toks) / pre, "decode": sorted(dec)[len(dec) // 2]}))
"#;
    let mut child = Command::new(py)
        .args(["-c", script, &model.display().to_string()])
        .arg(
            prompts
                .iter()
                .map(|n| n.to_string())
                .collect::<Vec<_>>()
                .join(","),
        )
        .arg(max_tokens.to_string())
        .arg(DECODE_RUNS.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting llama-cpp-python")?;
    if let Some(mut stdin) = child.stdin.take() {
        use std::io::Write;
        let texts: Vec<String> = prompts.iter().map(|&n| words(n, n as u64)).collect();
        stdin.write_all(texts.join("\n").as_bytes())?;
    }
    let output = child.wait_with_output()?;
    let mut out = format!(
        "\n| llama.cpp (llama-cpp-python, 2 threads) prompt tokens | prefill tok/s | decode tok/s (median of {DECODE_RUNS}) |\n|---:|---:|---:|\n",
    );
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let v: serde_json::Value = serde_json::from_str(line)?;
        out += &format!(
            "| {} | {:.0} | {:.1} |\n",
            v["n"],
            v["prefill"].as_f64().unwrap_or(0.0),
            v["decode"].as_f64().unwrap_or(0.0)
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(ttft_ms: u64, gaps_ms: &[f32], end_ms: u64) -> Sample {
        Sample {
            status: 200,
            ttft: Duration::from_millis(ttft_ms),
            itl_ms: gaps_ms.to_vec(),
            output_events: gaps_ms.len() as u64 + 1,
            latency: Duration::from_millis(end_ms),
            ..Sample::default()
        }
    }

    #[test]
    fn decode_steps_are_the_gaps_inside_the_window_where_the_streams_decode() {
        // Steps end at 600, 620, 640, 660 and 680 ms; every running stream gets a token in each.
        // A: first token at 100 ms, the next at 600 (a 500 ms prefill stall), last at 660.
        let a = stream(100, &[500.0, 20.0, 20.0, 20.0], 700);
        // B: first token at 600 ms (every prompt computed: the window opens), last at 680.
        let b = stream(600, &[20.0, 20.0, 20.0, 20.0], 690);
        let w = decode_steps(&[a.clone(), b.clone()], 5).expect("both decode from 600 ms");
        // A's end (660 ms) closes the window: three steps of both, A's stall left out.
        assert_eq!(w.gaps, 6);
        assert!((w.busy_secs - 0.060).abs() < 1e-9, "{}", w.busy_secs);
        assert!((w.secs - 0.060).abs() < 1e-9, "{}", w.secs);
        assert!((w.rate() - 100.0).abs() < 1e-6);
        // One stream: every gap, the stall included.
        let alone = decode_steps(std::slice::from_ref(&a), 5).expect("a window");
        assert_eq!(alone.gaps, 4);
        assert!(
            (alone.rate() - 4.0 / 0.560).abs() < 1e-6,
            "{}",
            alone.rate()
        );
        // C stopped early, its last token at 620 ms (3 of 5). The window still runs to A's
        // end; the step to 620 ms had three streams, the two after it two: 7 tokens in 60 ms.
        let c = stream(580, &[20.0, 20.0], 625);
        let w = decode_steps(&[a, b, c], 5).expect("a window");
        assert_eq!(w.gaps, 7);
        assert!((w.busy_secs - 0.060).abs() < 1e-9, "{}", w.busy_secs);
        assert!((w.rate() - 7.0 / 0.060).abs() < 1e-6, "{}", w.rate());
    }

    #[test]
    fn no_window_when_a_stream_ends_before_another_begins() {
        let a = stream(100, &[10.0], 120);
        let b = stream(300, &[10.0], 320);
        assert_eq!(decode_steps(&[a, b], 2), None);
        assert_eq!(decode_steps(&[], 2), None);
        // One token only: no gap.
        assert_eq!(decode_steps(&[stream(100, &[], 110)], 2), None);
    }

    #[test]
    fn a_row_reports_the_round_with_the_median_decode_rate() {
        let round = |gaps: usize| BatchRound {
            tokens: gaps as u64,
            mean_itl_ms: 10.0,
            steps: Some(DecodeSteps {
                gaps,
                busy_secs: 1.0,
                secs: 1.0,
            }),
        };
        let (slow, mid, fast) = (round(100), round(250), round(300));
        let picked = median_round(&[&fast, &slow, &mid]).expect("three rounds");
        assert_eq!(picked.tokens, 250);
        // An even count takes the lower middle; none gives none.
        assert_eq!(median_round(&[&fast, &slow]).map(|r| r.tokens), Some(100));
        assert!(median_round(&[]).is_none());
    }
}
