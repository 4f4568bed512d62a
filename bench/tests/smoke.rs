//! End-to-end smoke run of the side-by-side runner: a small trace with shared prefixes, 2 fresh
//! simulated engines, kvmesh-proxy in front, through `kvmesh-bench compare` itself.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

/// Writes the smoke trace into a fresh directory named `name`: 20 requests over 1 s, 5
/// conversations of 4 turns, each turn extending the last by a block. (5 is odd, so round robin
/// sends consecutive turns of a conversation to different engines.)
fn smoke_trace(name: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("kvmesh-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut lines = Vec::new();
    for turn in 0..4u64 {
        for conv in 0..5u64 {
            let ids: Vec<String> = (0..=turn + 1)
                .map(|b| (conv * 100 + b).to_string())
                .collect();
            let ts = (turn * 5 + conv) * 50;
            let input = (turn as usize + 2) * 512 - 100;
            lines.push(format!(
                "{{\"timestamp\": {ts}, \"input_length\": {input}, \"output_length\": 4, \"hash_ids\": [{}]}}",
                ids.join(", ")
            ));
        }
    }
    let trace = dir.join("trace.jsonl");
    std::fs::write(&trace, lines.join("\n")).unwrap();
    (dir, trace)
}

#[test]
fn compare_replays_a_trace_through_kvmesh() {
    let (dir, trace) = smoke_trace("smoke");
    let out = dir.join("result.json");
    let status = Command::new(env!("CARGO_BIN_EXE_kvmesh-bench"))
        .args(["compare", "--workload", "trace", "--time-scale", "1", "--replicas", "2"])
        .args(["--cache-blocks", "4000", "--targets", "kvmesh-prefix,kvmesh-round_robin", "--decode-us-per-step", "1000"])
        .arg("--trace")
        .arg(&trace)
        .arg("--out")
        .arg(&out)
        .status()
        .expect("kvmesh-bench runs (cargo build --workspace --bins builds the engines and proxy it starts)");
    assert!(status.success());
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let oracle = v["oracle_hit_ratio"].as_f64().unwrap();
    assert!(
        oracle > 0.4,
        "turns 2-4 repeat earlier turns: oracle {oracle}"
    );
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 2);
    for r in results {
        let s = &r["summary"];
        assert_eq!(s["requests"], 20, "{r}");
        assert_eq!(s["errors"], 0, "{r}");
        assert!(
            s["prompt_tokens"].as_u64().unwrap() > 24 * 900,
            "usage came back: {s}"
        );
        assert!(s["mean_ttft_ms"].as_f64().unwrap() > 0.0);
        assert_eq!(r["ttft_ms"].as_array().unwrap().len(), 20);
        // Text-mode digests are not the engines' token chain: the control for the token-mode
        // test below.
        assert_eq!(
            r["engine_routing_digests"],
            serde_json::json!({"mismatch": 20.0}),
            "{r}"
        );
    }
    let prefix = results
        .iter()
        .find(|r| r["target"] == "kvmesh-prefix")
        .unwrap();
    let hit = prefix["summary"]["hit_ratio"].as_f64().unwrap();
    // Conversations stick to the engine holding their earlier turns.
    assert!(
        hit > 0.8 * oracle,
        "kvmesh-prefix hit ratio {hit} vs oracle {oracle}"
    );
    // The TTFT floor: the oracle's uncached tokens under the engines' step model, with no
    // wait. It is a lower bound on every target, and a decoding neighbour raises it.
    let floors = v["ttft_floor"].as_array().unwrap();
    let floor = |i: usize, k: &str| -> Vec<f64> {
        match &floors[i][k] {
            serde_json::Value::Array(a) => a.iter().map(|x| x.as_f64().unwrap()).collect(),
            x => vec![x.as_f64().unwrap()],
        }
    };
    assert_eq!(floors.len(), 2, "{floors:?}");
    assert_eq!(floors[0]["decoding"], 0);
    assert_eq!(floors[1]["decoding"], 1);
    assert!(floor(0, "mean_ms")[0] > 0.0, "{floors:?}");
    assert!(
        floor(1, "mean_ms")[0] > floor(0, "mean_ms")[0],
        "{floors:?}"
    );
    for r in results {
        let s = &r["summary"];
        let p99 = s["ttft_ms"][2].as_f64().unwrap();
        let mean = s["mean_ttft_ms"].as_f64().unwrap();
        assert!(floor(0, "ttft_ms")[2] <= p99, "{floors:?} vs {s}");
        assert!(floor(0, "mean_ms")[0] <= mean, "{floors:?} vs {s}");
    }
    let md = std::fs::read_to_string(dir.join("result.md")).unwrap();
    assert!(
        md.contains("| floor: oracle's cache, no wait, 1 decoding beside |"),
        "{md}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn replay_takes_a_v1_url_and_fails_loudly_when_requests_fail() {
    use std::io::BufRead;
    let mut sim = Command::new(env!("CARGO_BIN_EXE_kvmesh-sim-engine"))
        .args(["--listen", "127.0.0.1:0", "--instant"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(sim.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let base = line.trim().rsplit("http://").next().unwrap().to_string();
    let replay = |url: &str| {
        Command::new(env!("CARGO_BIN_EXE_kvmesh-bench"))
            .args([
                "replay",
                "--workload",
                "shared",
                "--requests",
                "10",
                "--rate",
                "200",
            ])
            .args(["--url", url])
            .output()
            .unwrap()
    };
    // With or without /v1, the same endpoint.
    for url in [format!("http://{base}"), format!("http://{base}/v1/")] {
        let out = replay(&url);
        assert!(
            out.status.success(),
            "{url}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let _ = sim.kill();
    let _ = sim.wait();
    // Nothing listens there any more: every request fails, and it says how.
    let out = replay(&format!("http://{base}"));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    let words: Vec<&str> = err
        .split("Error: ")
        .nth(1)
        .unwrap_or("")
        .split_whitespace()
        .collect();
    assert!(
        words.len() > 3 && words[1] == "of" && words[0] == words[2] && words[3] == "requests",
        "every request should be reported failed: {err}"
    );
    assert!(err.contains("no HTTP answer"), "{err}");
}

#[test]
fn compare_runs_a_token_mode_gateway_in_front_of_engines_that_tokenize_as_it_does() {
    let (dir, trace) = smoke_trace("smoke-tokens");
    let gguf = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let args = |out: &std::path::Path| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_kvmesh-bench"));
        c.args([
            "compare",
            "--workload",
            "trace",
            "--time-scale",
            "1",
            "--replicas",
            "2",
        ])
        .args([
            "--cache-blocks",
            "4000",
            "--targets",
            "kvmesh-prefix+tokens",
        ])
        .args(["--decode-us-per-step", "1000"])
        .arg("--trace")
        .arg(&trace)
        .arg("--out")
        .arg(out);
        c
    };
    // Refused before anything starts: an error naming the cause, and no results written.
    let refused_with = |mut c: Command, cause: &str| {
        let refused = c.output().unwrap();
        assert!(!refused.status.success());
        let err = String::from_utf8_lossy(&refused.stderr);
        assert!(err.contains(cause), "{err}");
        assert!(!dir.join("refused.json").exists());
    };
    // Without the engines' tokenizer the target is refused.
    refused_with(args(&dir.join("refused.json")), "--engine-tokenizer");
    // So is gateway TOML with a backslash-n where a newline was meant.
    let mut c = args(&dir.join("refused.json"));
    c.arg("--engine-tokenizer")
        .arg(&gguf)
        .args(["--gateway-config", "[routing]\\nmax_prefix_blocks = 8"]);
    refused_with(c, "real newline");
    // And more sidecar entry points than sidecars.
    let mut c = args(&dir.join("refused.json"));
    c.arg("--engine-tokenizer")
        .arg(&gguf)
        .args(["--sidecar-entries", "3"]);
    refused_with(c, "--sidecar-entries 3 exceeds --replicas 2");

    let out = dir.join("tokens.json");
    let status = args(&out)
        .arg("--engine-tokenizer")
        .arg(&gguf)
        .status()
        .expect("kvmesh-bench runs");
    assert!(status.success());
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let oracle = v["oracle_hit_ratio"].as_f64().unwrap();
    assert!(oracle > 0.4, "oracle {oracle}");
    let r = &v["results"][0];
    let s = &r["summary"];
    assert_eq!(s["requests"], 20, "{r}");
    assert_eq!(s["errors"], 0, "{r}");
    // The engines counted the model's tokens, not 4 bytes a token (about 34,000 of those for
    // this trace): its random lowercase words take about twice as many of the model's.
    assert!(
        s["prompt_tokens"].as_u64().unwrap() > 50_000,
        "usage came back: {s}"
    );
    // The proxy routed every request by the engines' own chain.
    assert_eq!(
        r["engine_routing_digests"],
        serde_json::json!({"match": 20.0}),
        "{r}"
    );
    let hit = s["hit_ratio"].as_f64().unwrap();
    assert!(
        hit > 0.8 * oracle,
        "token-mode kvmesh-prefix hit ratio {hit} vs oracle {oracle}"
    );
    let _ = std::fs::remove_dir_all(dir);
}
