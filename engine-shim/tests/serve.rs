//! The engine over its real HTTP surface: real `engine-shim` processes with the real model, a
//! real `kvagent` for paging. Needs `scripts/setup.sh` (model) and the workspace binaries built.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

const MODEL: &str = "SmolLM2-135M-Instruct";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

struct Proc {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn engine(extra: &[&str]) -> Proc {
    let mut child = Command::new(env!("CARGO_BIN_EXE_engine-shim"))
        .current_dir(root())
        .args(["--listen", "127.0.0.1:0", "--cache-blocks", "256"])
        .args(extra)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn engine-shim");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .rsplit("http://")
        .next()
        .unwrap()
        .parse()
        .unwrap_or_else(|_| panic!("engine did not start: {line:?}"));
    Proc { child, addr }
}

fn kvagent(dir: &std::path::Path) -> Proc {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_engine-shim"))
        .parent()
        .unwrap()
        .join("kvagent");
    assert!(bin.exists(), "run `cargo build --workspace --bins` first");
    let child = Command::new(bin)
        .env("KVAGENT_LISTEN", format!("127.0.0.1:{port}"))
        .env("KVAGENT_METRICS_LISTEN", "")
        .env("KVAGENT_SSD_DIR", dir)
        .env("KVAGENT_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(addr).is_err() {
        assert!(Instant::now() < deadline, "kvagent did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    Proc { child, addr }
}

/// POST and read the whole response: (status, body).
fn post(addr: SocketAddr, path: &str, body: &[u8]) -> (u16, Vec<u8>) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .unwrap();
    s.write_all(body).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let mut body = raw[split + 4..].to_vec();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body = dechunk(&body);
    }
    (status, body)
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(nl) = b.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let n = usize::from_str_radix(std::str::from_utf8(&b[..nl]).unwrap().trim(), 16).unwrap();
        if n == 0 {
            return out;
        }
        out.extend_from_slice(&b[nl + 2..nl + 2 + n]);
        b = &b[nl + 2 + n + 2..];
    }
}

fn chat(addr: SocketAddr, content: &str, extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "messages": [{"role": "user", "content": content}],
                          "temperature": 0, "max_tokens": 24});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let (status, b) = post(
        addr,
        "/v1/chat/completions",
        &serde_json::to_vec(&body).unwrap(),
    );
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&b));
    serde_json::from_slice(&b).unwrap()
}

fn answer(v: &Value) -> String {
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string()
}

fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

/// A long shared document (about 700 tokens) and two questions about it.
fn document() -> String {
    let mut s = String::from("Read the notes below, then answer.\n");
    for i in 0..40 {
        s.push_str(&format!(
            "Note {i}: the warehouse in district {i} stores {} crates of apples.\n",
            i * 7 + 3
        ));
    }
    s
}

#[test]
fn serves_json_and_sse_with_usage() {
    let e = engine(&[]);
    let v = chat(e.addr, "What is the capital of France?", json!({}));
    assert_eq!(answer(&v), "The capital of France is Paris.");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["usage"]["prompt_tokens"], 37);
    assert_eq!(v["object"], "chat.completion");

    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                      "temperature": 0, "max_tokens": 3, "stream": true, "stream_options": {"include_usage": true}});
    let (status, b) = post(
        e.addr,
        "/v1/chat/completions",
        &serde_json::to_vec(&body).unwrap(),
    );
    assert_eq!(status, 200);
    let text = String::from_utf8(b).unwrap();
    let events: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let content: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, "The capital of");
    assert_eq!(
        events.iter().rev().nth(1).unwrap()["choices"][0]["finish_reason"],
        "length"
    );
    assert_eq!(events.last().unwrap()["usage"]["completion_tokens"], 3);
    assert!(text.trim_end().ends_with("data: [DONE]"));

    // /v1/completions with a stop string, and the metrics the proxy and kvagent read.
    let (status, b) = post(
        e.addr,
        "/v1/completions",
        &serde_json::to_vec(&json!({"model": MODEL, "prompt": "1, 2, 3, 4,", "temperature": 0, "max_tokens": 12, "stop": [" 7"]})).unwrap(),
    );
    assert_eq!(status, 200);
    let v: Value = serde_json::from_slice(&b).unwrap();
    let t = v["choices"][0]["text"].as_str().unwrap();
    assert!(!t.contains(" 7"), "{t:?}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let m = get(e.addr, "/metrics");
    let metric = |name: &str| -> f64 {
        m.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing: {m}"))
    };
    assert_eq!(metric("vllm:num_requests_running"), 0.0);
    assert_eq!(metric("vllm:num_requests_waiting"), 0.0);
    assert!(metric("vllm:kv_cache_usage_perc") > 0.0);
    assert!(metric("engine_shim_generated_tokens_total") >= 10.0);
    assert!(get(e.addr, "/v1/models").contains(MODEL));

    // Sampling with a seed is reproducible.
    let sampled = |seed: u64| {
        answer(&chat(
            e.addr,
            "Tell me a story.",
            json!({"temperature": 0.9, "top_p": 0.95, "seed": seed, "max_tokens": 16}),
        ))
    };
    assert_eq!(sampled(42), sampled(42));

    // Several clients at once: all served (first come, first served).
    let handles: Vec<_> = (0..3)
        .map(|i| {
            let addr = e.addr;
            std::thread::spawn(move || {
                chat(
                    addr,
                    &format!("Count to {}.", i + 3),
                    json!({"max_tokens": 8}),
                )
            })
        })
        .collect();
    for h in handles {
        let v = h.join().unwrap();
        assert_eq!(
            v["usage"]["completion_tokens"].as_u64().map(|n| n > 0),
            Some(true)
        );
    }
}

fn get(addr: SocketAddr, path: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

#[test]
fn a_shared_prefix_is_reused_and_gives_the_cold_answer() {
    let doc = document();
    let q1 = format!("{doc}How many crates are in district 3?");
    let q2 = format!("{doc}How many crates are in district 12?");
    // Cold: a fresh engine answers q2.
    let cold_engine = engine(&[]);
    let cold = chat(cold_engine.addr, &q2, json!({}));
    assert_eq!(cached(&cold), 0);
    drop(cold_engine);
    // Warm: q1 first, then q2 reuses the document's blocks and answers the same.
    let e = engine(&[]);
    let first = chat(e.addr, &q1, json!({}));
    assert_eq!(cached(&first), 0);
    let warm = chat(e.addr, &q2, json!({}));
    let prompt = warm["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        cached(&warm) >= prompt - 32 && cached(&warm) % 16 == 0,
        "cached {} of {prompt}",
        cached(&warm)
    );
    assert_eq!(answer(&warm), answer(&cold));
    // Chunked prefill with a different chunk size computes the same.
    let small = engine(&["--prefill-chunk", "64"]);
    assert_eq!(answer(&chat(small.addr, &q2, json!({}))), answer(&cold));
}

#[test]
fn blocks_paged_in_from_kvagent_give_the_recomputed_answer() {
    let dir = std::env::temp_dir().join(format!("engine-shim-kvagent-{}", std::process::id()));
    let agent = kvagent(&dir);
    let url = format!("http://{}", agent.addr);
    let doc = document();
    let q1 = format!("{doc}Which district has 10 crates?");
    let q2 = format!("{doc}How many crates are in district 20?");
    let recomputed = {
        let e = engine(&[]);
        answer(&chat(e.addr, &q2, json!({})))
    };
    // Engine A computes the document and writes its blocks through to kvagent.
    {
        let a = engine(&["--kvagent", &url]);
        chat(a.addr, &q1, json!({}));
        std::thread::sleep(Duration::from_millis(500));
    }
    // Engine B starts empty and pages the document in instead of recomputing it.
    let b = engine(&["--kvagent", &url]);
    let v = chat(b.addr, &q2, json!({}));
    assert!(
        cached(&v) >= 600,
        "paged-in tokens reported as cached: {}",
        cached(&v)
    );
    assert_eq!(answer(&v), recomputed);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn bad_requests_get_openai_errors() {
    let e = engine(&[]);
    let cases: [(&str, &[u8], u16, &str); 6] = [
        ("/v1/chat/completions", b"{not json", 400, "invalid_request"),
        ("/v1/chat/completions", br#"{"model":"gpt-4","messages":[{"role":"user","content":"hi"}]}"#, 404, "model_not_found"),
        ("/v1/chat/completions", br#"{"model":"SmolLM2-135M-Instruct","messages":[]}"#, 400, "invalid_request"),
        ("/v1/chat/completions", br#"{"model":"SmolLM2-135M-Instruct","messages":[{"role":"user","content":"hi"}],"temperature":"hot"}"#, 400, "invalid_request"),
        ("/v1/completions", br#"{"model":"SmolLM2-135M-Instruct","prompt":"hi","max_tokens":9000}"#, 400, "invalid_request"),
        ("/v1/embeddings", b"{}", 404, "not_found"),
    ];
    for (path, body, status, code) in cases {
        let (s, b) = post(e.addr, path, body);
        let v: Value = serde_json::from_slice(&b).unwrap_or(Value::Null);
        assert_eq!(
            (s, v["error"]["code"].as_str()),
            (status, Some(code)),
            "{path} {}",
            String::from_utf8_lossy(body)
        );
    }
    let (_, b) = post(
        e.addr,
        "/v1/completions",
        br#"{"model":"SmolLM2-135M-Instruct","prompt":"hi","max_tokens":9000}"#,
    );
    assert!(String::from_utf8_lossy(&b).contains("maximum context length is 8192"));
    // Still serving after all that.
    assert_eq!(
        answer(&chat(e.addr, "What is the capital of France?", json!({}))),
        "The capital of France is Paris."
    );
}
