//! `kvmesh-bench`: load generation and benchmark runs for kvmesh (an instrument, not the product).
//!
//! - `demo`: 3 fresh sim engines + kvmesh-proxy, a shared-prefix workload once per policy.
//! - `overhead`: requests/s and latency through kvmesh-proxy vs direct, on a zero-latency engine.
//! - `run`: the shared-prefix workload against any OpenAI URL.

use std::time::Instant;

use clap::{Args, Parser, Subcommand};
use kvmesh_bench::load::{self, SharedPrefix, Summary};
use kvmesh_bench::procs;

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
    /// Proxy overhead: the same closed-loop load direct and through kvmesh-proxy.
    Overhead(OverheadArgs),
    /// The shared-prefix workload against a URL (e.g. http://127.0.0.1:8080).
    Run {
        /// Base URL of an OpenAI-compatible server.
        #[arg(long)]
        url: String,
        #[command(flatten)]
        workload: WorkloadArgs,
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

#[derive(Args)]
struct DemoArgs {
    /// Number of engines.
    #[arg(long, default_value_t = 3)]
    engines: usize,
    /// Policies to compare, in order.
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

async fn demo(a: DemoArgs) -> anyhow::Result<()> {
    let w = a.workload.workload();
    let bodies = w.bodies();
    let sim_args: Vec<String> = vec!["--cache-blocks".into(), a.cache_blocks.to_string()];
    println!(
        "workload: {} requests = {} system prompts x {} users x {} turns; prompt ~{} B; max_tokens {}; concurrency {}",
        bodies.len(), w.prefixes, w.users, w.turns, w.prefix_bytes + w.suffix_bytes, w.max_tokens, a.workload.concurrency
    );
    println!(
        "engines: {} x kvmesh-sim-engine, cache {} blocks of 16 tokens each, default latency model (50 us/prompt token, 8 ms/decode step), fresh per policy\n",
        a.engines, a.cache_blocks
    );
    header();
    let mut results = Vec::new();
    for policy in &a.policies {
        let sims = (0..a.engines)
            .map(|i| procs::sim(&format!("engine-{i}"), &sim_args))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let port = procs::free_port()?;
        let mut toml = format!("listen = \"127.0.0.1:{port}\"\npolicy = \"{policy}\"\nlog = \"warn\"\n[health]\ninterval_ms = 500\n");
        for (i, s) in sims.iter().enumerate() {
            toml.push_str(&format!(
                "[[engines]]\nname = \"engine-{i}\"\nurl = \"http://{}\"\n",
                s.addr
            ));
        }
        let proxy = procs::proxy(&toml, port).await?;
        let client = load::client(a.workload.concurrency);
        let url = format!("http://{}/v1/chat/completions", proxy.addr);
        let start = Instant::now();
        let samples =
            load::closed_loop(&client, &url, bodies.clone(), a.workload.concurrency).await;
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

async fn overhead(a: OverheadArgs) -> anyhow::Result<()> {
    let zero = [
        "--prefill-us-per-token",
        "0",
        "--decode-us-per-step",
        "0",
        "--decode-us-per-seq",
        "0",
        "--default-max-tokens",
        "1",
    ];
    let sim = procs::sim(
        "engine-0",
        &zero.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
    )?;
    // Every proxy gets one worker thread: the machine also runs the engine and the client.
    let mut targets: Vec<(String, std::net::SocketAddr, Option<procs::Proc>)> =
        vec![("direct".into(), sim.addr, None)];
    match procs::nginx(&[sim.addr]).await {
        Ok(p) => targets.push(("nginx".into(), p.addr, Some(p))),
        Err(e) => println!("nginx: skipped ({e:#})"),
    }
    let passthrough = procs::pingora_passthrough(sim.addr, 1).await?;
    targets.push((
        "pingora passthrough".into(),
        passthrough.addr,
        Some(passthrough),
    ));
    let port = procs::free_port()?;
    let toml = format!(
        "listen = \"127.0.0.1:{port}\"\nlog = \"warn\"\nthreads = 1\n[health]\ninterval_ms = 1000\n[[engines]]\nname = \"engine-0\"\nurl = \"http://{}\"\n",
        sim.addr
    );
    let proxy = procs::proxy(&toml, port).await?;
    targets.push(("kvmesh-proxy".into(), proxy.addr, Some(proxy)));
    let body = bytes::Bytes::from_static(
        br#"{"model":"sim-model","messages":[{"role":"user","content":"hello there, a short prompt"}],"max_tokens":1}"#,
    );
    println!(
        "zero-latency kvmesh-sim-engine, non-streamed chat, closed loop; per row the median of {} interleaved rounds of {} requests (after 200 warm-up); every proxy has 1 worker\n",
        a.rounds, a.requests
    );
    println!("| concurrency | target | req/s | p50 ms | p99 ms | added p50 us | added p99 us |");
    println!("|---:|---|---:|---:|---:|---:|---:|");
    for &c in &a.concurrency {
        // Rounds interleave the targets, so a noisy moment hits all of them; each row reports
        // the median round (by p50).
        let mut runs: Vec<Vec<Summary>> = vec![Vec::new(); targets.len()];
        for _ in 0..a.rounds {
            for (i, (_, addr, _)) in targets.iter().enumerate() {
                let client = load::client(c);
                let url = format!("http://{addr}/v1/chat/completions");
                load::closed_loop(&client, &url, vec![body.clone(); 200], c).await;
                let start = Instant::now();
                let samples =
                    load::closed_loop(&client, &url, vec![body.clone(); a.requests], c).await;
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

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().cmd {
        Cmd::Demo(a) => demo(a).await,
        Cmd::Overhead(a) => overhead(a).await,
        Cmd::Run { url, workload } => {
            let bodies = workload.workload().bodies();
            let client = load::client(workload.concurrency);
            let start = Instant::now();
            let url = format!("{}/v1/chat/completions", url.trim_end_matches('/'));
            let samples = load::closed_loop(&client, &url, bodies, workload.concurrency).await;
            header();
            row(&url, &load::summarize(&samples, start.elapsed()));
            Ok(())
        }
    }
}
