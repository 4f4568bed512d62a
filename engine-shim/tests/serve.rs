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
    start(Command::new(env!("CARGO_BIN_EXE_engine-shim")), extra)
}

/// Starts `cmd` (engine-shim, or a shell that execs it) with the test's arguments and `extra`.
///
/// One libtorch thread unless `extra` says otherwise (the flag overrides a config file's
/// `threads`), as the demo and the gateway compose stack run their engines: tests run one per
/// core at a time, and two engines with a thread per core each, on a 2-core machine, took 3-7x
/// as long for the same requests (libgomp's threads spin between ops).
fn start(mut cmd: Command, extra: &[&str]) -> Proc {
    if !sets_threads(extra) {
        cmd.args(["--threads", "1"]);
    }
    let mut child = cmd
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

/// Whether `args` choose engine-shim's thread count.
fn sets_threads(args: &[&str]) -> bool {
    args.iter()
        .any(|a| *a == "--threads" || a.starts_with("--threads="))
}

fn kvagent(dir: &std::path::Path) -> Proc {
    kvagent_with(dir, None)
}

/// [`kvagent`] with a configuration file (its listen address still the env's).
fn kvagent_with(dir: &std::path::Path, config: Option<&std::path::Path>) -> Proc {
    kvagent_at(dir, free_port(), config)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// [`kvagent_with`] on 127.0.0.1:`port` (a restart keeps its address).
fn kvagent_at(dir: &std::path::Path, port: u16, config: Option<&std::path::Path>) -> Proc {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_engine-shim"))
        .parent()
        .unwrap()
        .join("kvagent");
    assert!(bin.exists(), "run `cargo build --workspace --bins` first");
    let mut cmd = Command::new(bin);
    if let Some(c) = config {
        cmd.arg("--config").arg(c);
    }
    let child = cmd
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

/// Sends a JSON POST (`Connection: close`); the response is left to read.
fn send(addr: SocketAddr, path: &str, body: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .unwrap();
    s.write_all(body).unwrap();
    s
}

/// POST and read the whole response: (status, body).
fn post(addr: SocketAddr, path: &str, body: &[u8]) -> (u16, Vec<u8>) {
    let mut s = send(addr, path, body);
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
    chat_messages(addr, &[json!({"role": "user", "content": content})], extra)
}

/// A greedy chat of `messages` (24 tokens at most; `extra` sets or overrides fields): 200 and
/// its JSON.
fn chat_messages(addr: SocketAddr, messages: &[Value], extra: Value) -> Value {
    let mut body =
        json!({"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 24});
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
    bodiless(addr, "GET", path)
}

/// A request without a body on a connection the engine closes after it: the whole answer.
fn bodiless(addr: SocketAddr, method: &str, path: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// `cache_salt` is part of the block digests: a prompt cached under one salt is a miss under
/// another (or none), a hit under the same one, and the answers agree.
#[test]
fn a_cache_salt_separates_cached_prefixes() {
    let doc = document();
    let q1 = format!("{doc}How many crates are in district 3?");
    let q2 = format!("{doc}How many crates are in district 12?");
    let e = engine(&[]);
    let a = chat(e.addr, &q1, json!({"cache_salt": "tenant/a"}));
    assert_eq!(cached(&a), 0);
    let other = chat(e.addr, &q2, json!({"cache_salt": "tenant/b"}));
    assert_eq!(cached(&other), 0, "tenant b hit tenant a's blocks");
    let unsalted = chat(e.addr, &q2, json!({}));
    assert_eq!(
        cached(&unsalted),
        0,
        "an unsalted request hit a salted prefix"
    );
    let same = chat(e.addr, &q2, json!({"cache_salt": "tenant/a"}));
    assert!(cached(&same) > 0, "the same salt must reuse its prefix");
    assert_eq!(answer(&same), answer(&other));
    for bad in [json!(5), json!("x".repeat(513))] {
        let body = serde_json::to_vec(&json!({"model": MODEL, "prompt": "hi", "cache_salt": bad}))
            .unwrap();
        let (status, b) = post(e.addr, "/v1/completions", &body);
        assert_eq!(status, 400);
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["error"]["param"], "cache_salt");
    }
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
        cached(&warm) >= prompt - 32 && cached(&warm).is_multiple_of(16),
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
    // Engine A computes the document and writes its blocks through to kvagent, sealed with the
    // key engines that share blocks are configured with.
    let key_file = temp_file("paged.key", MAC_KEY_HEX);
    let keyed = [
        "--kvagent",
        &url,
        "--kv-mac-key-file",
        key_file.to_str().unwrap(),
    ];
    {
        let a = engine(&keyed);
        chat(a.addr, &q1, json!({}));
        // Write-through runs in the background: wait (bounded) until kvagent holds every full
        // block of q1's prompt.
        let g =
            engine_shim::gguf::Gguf::open(&root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf"))
                .unwrap();
        let tok = engine_shim::tokenizer::ModelTokenizer::from_gguf(&g).unwrap();
        let rendered = tok.render_chat(&[("user".into(), q1.clone())]).unwrap();
        let blocks = (tok.encode(&rendered).unwrap().len() / 16) as u64;
        assert!(blocks >= 40, "{blocks} blocks");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let stored = kvagent_stored_blocks(agent.addr);
            if stored >= blocks {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "kvagent holds {stored} of {blocks} blocks"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    // Engine B starts empty, with the same key, and pages the document in.
    let b = engine(&keyed);
    let v = chat(b.addr, &q2, json!({}));
    assert!(
        cached(&v) >= 600,
        "paged-in tokens reported as cached: {}",
        cached(&v)
    );
    assert_eq!(answer(&v), recomputed);
    // The same key with other weights (bf16): its KV is not what wrote these blocks, so the
    // blocks fail its MAC and it computes the document itself.
    {
        let mut bf16 = keyed.to_vec();
        bf16.extend(["--weights", "bf16"]);
        let d = engine(&bf16);
        let v = chat(d.addr, &q2, json!({}));
        assert_eq!(
            cached(&v),
            0,
            "an engine with other weights took the blocks"
        );
        assert!(
            metric(
                d.addr,
                "engine_shim_kv_pagein_rejected_total{reason=\"mac\"}"
            ) >= 1.0
        );
    }
    // An engine with its own (random, per start) key does not trust blocks sealed with the shared key.
    {
        let c = engine(&["--kvagent", &url]);
        let v = chat(c.addr, &q2, json!({}));
        assert_eq!(cached(&v), 0);
        assert_eq!(answer(&v), recomputed);
        assert!(
            metric(
                c.addr,
                "engine_shim_kv_pagein_rejected_total{reason=\"mac\"}"
            ) >= 1.0
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Blocks kvagent holds (RAM and SSD), from its Stats RPC.
fn kvagent_stored_blocks(agent: SocketAddr) -> u64 {
    kvagent_stored_blocks_with(&format!("http://{agent}"), None, None)
}

/// [`kvagent_stored_blocks`] at `url`, with a token and TLS.
fn kvagent_stored_blocks_with(
    url: &str,
    token: Option<&str>,
    tls: Option<&kvagent::ClientTls>,
) -> u64 {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = kvagent::connect_with(url.to_string(), 64 << 20, token, tls)
            .await
            .unwrap();
        let s = c
            .stats(kvagent::pb::StatsRequest {})
            .await
            .unwrap()
            .into_inner();
        s.ram_blocks + s.ssd_blocks
    })
}

/// Paging through a kvagent that speaks TLS and wants a token: the engine (configured with the
/// CA and the token) writes through and pages in as over plaintext; an engine with a wrong token
/// refuses to start, naming the setting.
#[test]
fn blocks_page_in_through_a_tls_kvagent_with_a_token() {
    use kvmesh_tls::testing::{Ca, Validity};
    let dir = std::env::temp_dir().join(format!("engine-shim-kvagent-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca = Ca::new("kvagent CA");
    let (cert, key) = ca
        .leaf("kvagent", &["127.0.0.1"], &[], Validity::Now)
        .write(&dir, "kvagent");
    let ca_file = temp_file("kvagent-ca.pem", &ca.pem);
    let token = "engine-token-for-the-tls-test";
    let token_file = temp_file("kvagent.token", token);
    let agent_cfg = temp_file(
        "kvagent-tls.toml",
        &format!(
            "[tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\n[auth]\ntoken_file = \"{}\"\n",
            cert.display(),
            key.display(),
            token_file.display()
        ),
    );
    let agent = kvagent_with(&dir.join("ssd"), Some(&agent_cfg));
    let url = format!("https://127.0.0.1:{}", agent.addr.port());
    let key_file = temp_file("tls-paged.key", MAC_KEY_HEX);
    let engine_cfg = |token_file: &std::path::Path| {
        temp_file(
            &format!("engine-tls-{}.toml", token_file.file_name().unwrap().to_string_lossy()),
            &format!(
                "kvagent_url = \"{url}\"\nkvagent_ca_file = \"{}\"\nkvagent_token_file = \"{}\"\nkv_mac_key_file = \"{}\"\n",
                ca_file.display(),
                token_file.display(),
                key_file.display()
            ),
        )
    };
    let good = engine_cfg(&token_file);
    let doc = document();
    let q1 = format!("{doc}Which district has 10 crates?");
    let q2 = format!("{doc}How many crates are in district 20?");
    let tls = kvagent::ClientTls {
        ca_file: ca_file.display().to_string(),
        ..Default::default()
    };
    {
        let a = engine(&["-c", good.to_str().unwrap()]);
        chat(a.addr, &q1, json!({}));
        let deadline = Instant::now() + Duration::from_secs(60);
        while kvagent_stored_blocks_with(&url, Some(token), Some(&tls)) < 40 {
            assert!(Instant::now() < deadline, "no write-through over TLS");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let b = engine(&["-c", good.to_str().unwrap()]);
    let v = chat(b.addr, &q2, json!({}));
    assert!(cached(&v) >= 600, "paged in over TLS: {}", cached(&v));

    // An engine that trusts another CA does not talk to this kvagent at all.
    let other_ca = temp_file("other-ca.pem", &Ca::new("other CA").pem);
    let distrusting = temp_file(
        "engine-other-ca.toml",
        &format!(
            "kvagent_url = \"{url}\"\nkvagent_ca_file = \"{}\"\nkvagent_token_file = \"{}\"\n",
            other_ca.display(),
            token_file.display()
        ),
    );
    let err = refused_start(&distrusting, "an engine trusting another CA started");
    assert!(err.contains("kvagent"), "{err}");

    let wrong = engine_cfg(&temp_file("wrong.token", "not-the-engine-token-at-all"));
    let err = refused_start(&wrong, "an engine with a wrong token started");
    assert!(err.contains("kvagent_token_file"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

/// Starts engine-shim with the configuration file `config`, which must make it exit with an
/// error (else `started` is the failure); its stderr.
fn refused_start(config: &std::path::Path, started: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_engine-shim"))
        .current_dir(root())
        .args(["--listen", "127.0.0.1:0", "-c", config.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success(), "{started}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn bad_requests_get_openai_errors() {
    let e = engine(&[]);
    let cases: [(&str, &[u8], u16, &str); 9] = [
        ("/v1/chat/completions", b"{not json", 400, "invalid_request"),
        ("/v1/chat/completions", br#"{"model":"gpt-4","messages":[{"role":"user","content":"hi"}]}"#, 404, "model_not_found"),
        ("/v1/chat/completions", br#"{"model":"SmolLM2-135M-Instruct","messages":[]}"#, 400, "invalid_request"),
        ("/v1/chat/completions", br#"{"model":"SmolLM2-135M-Instruct","messages":[{"role":"user","content":"hi"}],"temperature":"hot"}"#, 400, "invalid_request"),
        ("/v1/completions", br#"{"model":"SmolLM2-135M-Instruct","prompt":"hi","max_tokens":9000}"#, 400, "invalid_request"),
        ("/v1/embeddings", b"{}", 404, "not_found"),
        // Known paths, wrong method.
        ("/v1/models", b"{}", 405, "method_not_allowed"),
        ("/v1/models/SmolLM2-135M-Instruct", b"{}", 405, "method_not_allowed"),
        ("/health", b"{}", 405, "method_not_allowed"),
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
    // A 405 names the methods the path takes.
    let mut raw = String::new();
    send(e.addr, "/v1/models", b"{}")
        .read_to_string(&mut raw)
        .unwrap();
    assert!(
        raw.to_ascii_lowercase()
            .contains("\r\nallow: get, head\r\n"),
        "{raw}"
    );
    // HEAD answers as GET, with GET's length and no body.
    for path in [
        "/health",
        "/v1/models",
        "/v1/models/SmolLM2-135M-Instruct",
        "/metrics",
    ] {
        let full = get(e.addr, path);
        let head = bodiless(e.addr, "HEAD", path);
        let (h, rest) = head.split_once("\r\n\r\n").unwrap_or((&head, "?"));
        assert!(h.starts_with("HTTP/1.1 200"), "HEAD {path}: {head}");
        assert_eq!(rest, "", "HEAD {path} sent a body");
        let length = |a: &str| {
            a.lines().find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("content-length:")
                    .map(|v| v.trim().to_string())
            })
        };
        let body = full.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        if path != "/metrics" {
            // (Metrics move between the two requests.)
            assert_eq!(
                length(h),
                Some(body.len().to_string()),
                "HEAD {path}: {head}"
            );
        }
    }
    // Still serving after all that.
    assert_eq!(
        answer(&chat(e.addr, "What is the capital of France?", json!({}))),
        "The capital of France is Paris."
    );
}

/// top_k and min_p are applied (1 of either is greedy, whatever the temperature); what the
/// engine cannot honour is refused naming the parameter, its neutral values accepted; the
/// model is served at `/v1/models/{id}`.
#[test]
fn sampling_knobs_apply_and_unsupported_parameters_are_refused() {
    let e = engine(&[]);
    let q = "What is the capital of France?";
    let greedy = answer(&chat(e.addr, q, json!({})));
    for knob in [json!({"top_k": 1}), json!({"min_p": 1.0})] {
        let mut extra = knob.clone();
        extra["temperature"] = json!(1.5);
        extra["seed"] = json!(7);
        assert_eq!(answer(&chat(e.addr, q, extra)), greedy, "{knob}");
    }
    // Neutral values, as clients send by default.
    let neutral = json!({"tools": [], "tool_choice": "auto", "response_format": {"type": "text"},
                         "presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": false,
                         "logit_bias": {}, "top_k": -1, "min_p": 0, "n": 1, "user": "u",
                         "stream_options": null, "parallel_tool_calls": true});
    assert_eq!(answer(&chat(e.addr, q, neutral)), greedy);
    // A temperature too small to divide by is greedy, not an overflowed distribution.
    let tiny = json!({"temperature": 1e-30, "top_k": 40.0});
    assert_eq!(answer(&chat(e.addr, q, tiny)), greedy);
    let refused = [
        (
            json!({"tools": [{"type": "function", "function": {"name": "f"}}]}),
            "tools",
        ),
        (
            json!({"response_format": {"type": "json_object"}}),
            "response_format",
        ),
        (json!({"logprobs": true}), "logprobs"),
        (json!({"logprobs": 0}), "logprobs"),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (json!({"guided_json": {"type": "object"}}), "guided_json"),
        (json!({"ignore_eos": true}), "ignore_eos"),
        (json!({"min_tokens": 5}), "min_tokens"),
        (json!({"presence_penalty": 0.5}), "presence_penalty"),
        (json!({"logit_bias": {"42": 10}}), "logit_bias"),
        (json!({"top_k": "a"}), "top_k"),
        (json!({"top_k": -2}), "top_k"),
        (json!({"min_p": 2}), "min_p"),
    ];
    for (extra, param) in refused {
        let mut body = json!({"model": MODEL, "messages": [{"role": "user", "content": q}]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (status, b) = post(
            e.addr,
            "/v1/chat/completions",
            &serde_json::to_vec(&body).unwrap(),
        );
        let v: Value = serde_json::from_slice(&b).unwrap_or(Value::Null);
        assert_eq!(
            (status, v["error"]["param"].as_str()),
            (400, Some(param)),
            "{extra}: {v}"
        );
    }
    let found = get(e.addr, &format!("/v1/models/{MODEL}"));
    assert!(found.starts_with("HTTP/1.1 200"), "{found}");
    assert!(found.contains(&format!("\"id\":\"{MODEL}\"")), "{found}");
    // Percent-encoded, as clients send ids.
    let encoded = get(e.addr, "/v1/models/SmolLM2%2D135M%2DInstruct");
    assert!(encoded.starts_with("HTTP/1.1 200"), "{encoded}");
    let missing = get(e.addr, "/v1/models/gpt-4");
    assert!(
        missing.starts_with("HTTP/1.1 404") && missing.contains("model_not_found"),
        "{missing}"
    );
}

/// Reads one metric (the first line starting with `name`, labels included in `name`).
fn metric(addr: SocketAddr, name: &str) -> f64 {
    metric_in(&get(addr, "/metrics"), name)
}

/// The value of `name` in one scrape `m` (values that must agree are read from one scrape:
/// a running stream moves them between two).
fn metric_in(m: &str, name: &str) -> f64 {
    m.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("{name} missing: {m}"))
}

/// A file in a fresh temporary directory for this test process.
fn temp_file(name: &str, contents: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("engine-shim-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, contents).unwrap();
    p
}

const MAC_KEY_HEX: &str = "5ec2e7000000000000000000000000000000000000000000000000000000c0de";

#[test]
fn absurd_request_values_get_400_and_the_engine_keeps_serving() {
    let e = engine(&[]);
    let chat_with = |extra: &str| {
        format!(r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}]{extra}}}"#)
    };
    let cases: Vec<(&str, String, &str)> = vec![
        // Used to overflow `prompt + max_tokens`, pass the context check and kill the engine.
        (
            "/v1/chat/completions",
            chat_with(r#","max_tokens":18446744073709551615"#),
            "messages",
        ),
        (
            "/v1/completions",
            format!(r#"{{"model":"{MODEL}","prompt":"hi","max_tokens":18446744073709551615}}"#),
            "prompt",
        ),
        (
            "/v1/chat/completions",
            chat_with(r#","max_completion_tokens":18446744073709551615"#),
            "messages",
        ),
        (
            "/v1/chat/completions",
            chat_with(r#","max_tokens":18446744073709551616"#),
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            chat_with(r#","max_tokens":-1"#),
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            chat_with(r#","max_tokens":0"#),
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            chat_with(r#","max_tokens":1e300"#),
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            chat_with(r#","max_completion_tokens":-5"#),
            "max_completion_tokens",
        ),
        (
            "/v1/chat/completions",
            chat_with(r#","n":18446744073709551615"#),
            "n",
        ),
        ("/v1/chat/completions", chat_with(r#","n":-1"#), "n"),
        (
            "/v1/completions",
            format!(r#"{{"model":"{MODEL}","prompt":"hi","best_of":1000000}}"#),
            "best_of",
        ),
        (
            "/v1/chat/completions",
            chat_with(r#","stop":["a","b","c","d","e"]"#),
            "stop",
        ),
        (
            "/v1/chat/completions",
            chat_with(&format!(r#","stop":"{}""#, "x".repeat(5000))),
            "stop",
        ),
        ("/v1/chat/completions", chat_with(r#","seed":-3"#), "seed"),
        (
            "/v1/chat/completions",
            chat_with(r#","temperature":-1"#),
            "temperature",
        ),
        (
            "/v1/chat/completions",
            chat_with(r#","top_p":1e308"#),
            "top_p",
        ),
    ];
    for (path, body, param) in &cases {
        let (s, b) = post(e.addr, path, body.as_bytes());
        let v: Value = serde_json::from_slice(&b).unwrap_or(Value::Null);
        assert_eq!(s, 400, "{body:.200}: {}", String::from_utf8_lossy(&b));
        assert_eq!(v["error"]["type"], "invalid_request_error", "{body:.200}");
        assert_eq!(v["error"]["code"], "invalid_request", "{body:.200}");
        assert_eq!(v["error"]["param"], *param, "{body:.200}");
        assert!(v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()));
    }
    // The same process still answers, and nothing failed inside it.
    assert_eq!(
        answer(&chat(e.addr, "What is the capital of France?", json!({}))),
        "The capital of France is Paris."
    );
    assert_eq!(metric(e.addr, "engine_shim_requests_failed_total"), 0.0);
}

#[test]
fn a_huge_prompt_is_rejected_before_it_is_tokenised() {
    let e = engine(&[]);
    // 3 MiB: under max_body_bytes, far over what 8192 tokens can hold.
    let huge = "lorem ipsum ".repeat((3 << 20) / 12);
    for (path, body) in [
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": huge, "max_tokens": 4}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"role": "user", "content": huge}], "max_tokens": 4}),
        ),
    ] {
        let (s, b) = post(e.addr, path, &serde_json::to_vec(&body).unwrap());
        let v: Value = serde_json::from_slice(&b).unwrap_or(Value::Null);
        assert_eq!(
            s,
            400,
            "{path}: {}",
            String::from_utf8_lossy(&b[..b.len().min(300)])
        );
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains("maximum context length is 8192"), "{msg}");
        // Refused on its byte length (a bound known before tokenising), not on a token count.
        assert!(msg.contains(&format!("{} bytes", huge.len())), "{msg}");
    }
    assert_eq!(
        answer(&chat(e.addr, "What is the capital of France?", json!({}))),
        "The capital of France is Paris."
    );
}

/// Starts engine-shim on `listen` and waits (bounded) for it to exit: (success, stdout, stderr).
fn run_to_exit(args: &[&str]) -> (bool, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_engine-shim"))
        .current_dir(root())
        .args(args)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn engine-shim");
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("engine-shim {args:?} did not exit");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let (mut out, mut err) = (String::new(), String::new());
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    (status.success(), out, err)
}

#[test]
fn a_busy_listen_port_fails_naming_the_address() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = busy.local_addr().unwrap().to_string();
    let (ok, out, err) = run_to_exit(&["--listen", &addr]);
    assert!(!ok, "exited successfully with {addr} busy");
    assert!(err.contains(&addr), "stderr does not name {addr}: {err}");
    // One line, as docs/engine-shim.md quotes it: the context and the OS's reason.
    assert!(
        err.lines().any(
            |l| l.starts_with(&format!("Error: cannot listen on {addr}: "))
                && l.contains("Address already in use")
        ),
        "{err}"
    );
    assert!(!out.contains("listening"), "announced listening: {out}");
    // The socket is bound first: the address is reported even before a model is looked at.
    let (ok, out, err) = run_to_exit(&["--listen", &addr, "--model", "models/absent.gguf"]);
    assert!(!ok);
    assert!(err.contains(&addr), "bound after loading the model: {err}");
    assert!(!out.contains("listening"));
    drop(busy);
}

#[test]
fn running_is_clear_when_the_answer_arrives() {
    let e = engine(&[]);
    for i in 0..12 {
        let stream = i % 2 == 1;
        let body = json!({"model": MODEL, "prompt": format!("{i}, {}, {},", i + 1, i + 2),
                          "temperature": 0, "max_tokens": 2, "stream": stream});
        let (s, _) = post(
            e.addr,
            "/v1/completions",
            &serde_json::to_vec(&body).unwrap(),
        );
        assert_eq!(s, 200);
        assert_eq!(
            metric(e.addr, "vllm:num_requests_running"),
            0.0,
            "after request {i}"
        );
    }
}

/// Test instrument: a "kvagent" that speaks HTTP/2 but never answers a request (holds them).
/// It answers the client's keep-alive pings, as a stalled agent's HTTP/2 stack would: a bare
/// TCP holder let the client's ping timeout (15 s) close the connection, failing the held
/// writes and freeing their permits, so on a slow machine nothing was dropped.
struct HungKvagent {
    addr: SocketAddr,
}

impl HungKvagent {
    fn start() -> Self {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        l.set_nonblocking(true).unwrap();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let l = tokio::net::TcpListener::from_std(l).unwrap();
                while let Ok((s, _)) = l.accept().await {
                    let never = hyper::service::service_fn(|_req| {
                        std::future::pending::<
                            Result<
                                hyper::Response<http_body_util::Empty<bytes::Bytes>>,
                                std::io::Error,
                            >,
                        >()
                    });
                    tokio::spawn(
                        hyper::server::conn::http2::Builder::new(
                            hyper_util::rt::TokioExecutor::new(),
                        )
                        .serve_connection(hyper_util::rt::TokioIo::new(s), never),
                    );
                }
            });
        });
        HungKvagent { addr }
    }
}

#[test]
fn a_hung_kvagent_neither_hangs_the_engine_nor_piles_up_writes() {
    let hung = HungKvagent::start();
    let config = temp_file(
        "hung.toml",
        "kvagent_fetch_timeout_ms = 300\nkvagent_put_timeout_ms = 600000\nkvagent_put_max_blocks = 2\n",
    );
    let e = engine(&[
        "--config",
        config.to_str().unwrap(),
        "--kvagent",
        &format!("http://{}", hung.addr),
    ]);
    // Two full blocks: a page-in is tried (and times out), both blocks go to write-through,
    // which the hung agent holds: they fill `kvagent_put_max_blocks`.
    let v = chat(e.addr, "What is the capital of France?", json!({}));
    assert_eq!(answer(&v), "The capital of France is Paris.");
    assert!(metric(e.addr, "engine_shim_kv_pagein_timeouts_total") >= 1.0);
    assert_eq!(
        metric(e.addr, "engine_shim_kv_writethrough_dropped_blocks_total"),
        0.0
    );
    // Another prompt: its new block does not fit, it is dropped (not queued, not waited for).
    let v = chat(
        e.addr,
        "Name three colours of the rainbow, please, and explain why the sky looks blue.",
        json!({"max_tokens": 8}),
    );
    assert_eq!(v["usage"]["completion_tokens"], 8);
    assert!(metric(e.addr, "engine_shim_kv_writethrough_dropped_blocks_total") >= 1.0);
    // Its page-in is not tried: the last one timed out within the pause (10 s), so a hung
    // agent costs the engine loop one timeout per pause, not one per admission.
    assert_eq!(metric(e.addr, "engine_shim_kv_pagein_timeouts_total"), 1.0);
    assert!(metric(e.addr, "engine_shim_kv_pagein_skipped_total") >= 1.0);
}

/// Open descriptors of process `pid`.
fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Chaos: kvagent killed (-9) while the engine writes through to it, then restarted on the same
/// address. The engine answers every request meanwhile, counts the writes it lost, reconnects
/// by itself, and the blocks it writes after the restart page in to another engine.
#[test]
fn a_kvagent_killed_and_restarted_under_write_through_costs_no_request_and_paging_resumes() {
    let dir = std::env::temp_dir().join(format!("engine-shim-restart-{}", std::process::id()));
    let port = free_port();
    let mut agent = kvagent_at(&dir, port, None);
    let url = format!("http://127.0.0.1:{port}");
    let key_file = temp_file("restart.key", MAC_KEY_HEX);
    let keyed = [
        "--kvagent",
        &url,
        "--kv-mac-key-file",
        key_file.to_str().unwrap(),
    ];
    let e = engine(&keyed);
    let doc = document();
    chat(
        e.addr,
        &format!("{doc}Which district has 10 crates?"),
        json!({}),
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while kvagent_stored_blocks(agent.addr) < 40 {
        assert!(Instant::now() < deadline, "write-through before the kill");
        std::thread::sleep(Duration::from_millis(50));
    }
    let baseline = fds(e.child.id());
    let failed_before = metric(e.addr, "engine_shim_kv_writethrough_failed_total");

    let _ = agent.child.kill();
    let _ = agent.child.wait();
    // New prompts (new blocks to write, a page-in tried for each): every one answered.
    for i in 0..3 {
        let v = chat(
            e.addr,
            &format!("Question {i}: describe the number {i} in one short sentence, with care."),
            json!({"max_tokens": 8}),
        );
        assert_eq!(v["usage"]["completion_tokens"], 8);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while metric(e.addr, "engine_shim_kv_writethrough_failed_total") <= failed_before {
        assert!(Instant::now() < deadline, "the lost writes are not counted");
        std::thread::sleep(Duration::from_millis(100));
    }

    // Back on the same address, empty (its RAM tier died with it): the engine's client
    // reconnects and writes a new prompt's blocks; kvagent answers with a new epoch, so at the
    // next request the engine writes everything it caches again, the blocks every prompt
    // shares (the chat template's) included.
    let agent = kvagent_at(&dir, port, None);
    let mut doc2 = String::from("Read the catalogue below, then answer.\n");
    for i in 0..40 {
        doc2.push_str(&format!(
            "Entry {i}: the library in town {i} lends {} books a week.\n",
            i * 11 + 5
        ));
    }
    assert_eq!(
        kvagent_stored_blocks(agent.addr),
        0,
        "nothing survived the kill"
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut asked = 0;
    while metric(e.addr, "engine_shim_kv_writethrough_resyncs_total") < 1.0 {
        assert!(Instant::now() < deadline, "no resync after the restart");
        // A new question each time (the first may still meet the old, broken connection):
        // a write's answer brings the new epoch, the request after it resyncs.
        chat(
            e.addr,
            &format!("{doc2}Which town lends {} books?", asked * 11 + 5),
            json!({"max_tokens": 4}),
        );
        asked += 1;
    }
    let cached_here = (metric(e.addr, "vllm:kv_cache_usage_perc") * 256.0).round() as u64;
    let deadline = Instant::now() + Duration::from_secs(60);
    while kvagent_stored_blocks(agent.addr) < cached_here {
        assert!(
            Instant::now() < deadline,
            "kvagent holds {} of the {cached_here} blocks cached in the engine",
            kvagent_stored_blocks(agent.addr)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let b = engine(&keyed);
    let v = chat(
        b.addr,
        &format!("{doc2}How many books does town 3 lend?"),
        json!({}),
    );
    assert!(
        cached(&v) >= 600,
        "paged in after the restart: {}",
        cached(&v)
    );
    // The first document too: its blocks were cached in the engine, not in the new kvagent.
    let v = chat(
        b.addr,
        &format!("{doc}How many crates are in district 20?"),
        json!({}),
    );
    assert!(
        cached(&v) >= 600,
        "the first document, written again: {}",
        cached(&v)
    );
    // Nothing leaked by the broken connection.
    let deadline = Instant::now() + Duration::from_secs(10);
    while fds(e.child.id()) > baseline + 2 {
        assert!(
            Instant::now() < deadline,
            "engine fds {} (baseline {baseline})",
            fds(e.child.id())
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = std::fs::remove_dir_all(dir);
}

mod forged {
    //! Blocks put into kvagent by someone else, at digests the engine will look up.
    use super::*;
    use engine_shim::gguf::Gguf;
    use engine_shim::kvstore::{seal, weights_fingerprint, MacKey};
    use engine_shim::tokenizer::ModelTokenizer;
    use kvmesh_filters::chain::{token_chain, Digest, Namespace};

    fn put(agent: SocketAddr, block: kvagent::pb::Block) {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let mut c = kvagent::connect(format!("http://{agent}"), 64 << 20)
                .await
                .unwrap();
            let r = c
                .put_blocks(kvagent::pb::PutBlocksRequest {
                    blocks: vec![block],
                })
                .await
                .unwrap();
            assert_eq!(r.into_inner().stored, 1);
        });
    }

    fn block(d: &Digest, model: &str, token_count: u32, payload: Vec<u8>) -> kvagent::pb::Block {
        kvagent::pb::Block {
            digest: bytes::Bytes::copy_from_slice(&d.0),
            model: model.into(),
            token_count,
            payload: payload.into(),
        }
    }

    fn completion(addr: SocketAddr, prompt: &str) -> (String, u64) {
        let body = json!({"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 8});
        let (s, b) = post(addr, "/v1/completions", &serde_json::to_vec(&body).unwrap());
        assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
        let v: Value = serde_json::from_slice(&b).unwrap();
        (
            v["choices"][0]["text"].as_str().unwrap().to_string(),
            cached(&v),
        )
    }

    #[test]
    fn forged_kvagent_blocks_are_not_used() {
        let g = Gguf::open(&root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf")).unwrap();
        let tok = ModelTokenizer::from_gguf(&g).unwrap();
        let u = |k: &str| g.get_u64(&format!("llama.{k}")).unwrap() as usize;
        let head_dim = u("embedding_length") / u("attention.head_count");
        let kv_bytes = 2 * u("block_count") * u("attention.head_count_kv") * 16 * head_dim * 4;
        assert_eq!(kv_bytes, 737_280);
        let ns = Namespace::new(MODEL, b"");
        // The engine's key: the configured secret bound to its weights (the model, in f32).
        let key = MacKey::from_hex(MAC_KEY_HEX)
            .unwrap()
            .for_weights(&weights_fingerprint(g.bytes(), "f32"));
        let key_file = temp_file("forged.key", MAC_KEY_HEX);
        let dir = std::env::temp_dir().join(format!("engine-shim-forged-{}", std::process::id()));
        let agent = kvagent(&dir);
        let victim = engine(&[
            "--kvagent",
            &format!("http://{}", agent.addr),
            "--kv-mac-key-file",
            key_file.to_str().unwrap(),
        ]);
        let cold = engine(&[]);
        let junk = |n: usize| (0..n).map(|i| (i % 251) as u8).collect::<Vec<u8>>();
        let elsewhere = Digest([9; 32]);
        // (case, what the forger stores at the prompt's first digest, rejection reason)
        type Forge = Box<dyn Fn(&Digest) -> kvagent::pb::Block>;
        let cases: Vec<(&str, Forge, Option<&str>)> = vec![
            // Exactly the bare KV size: what the old size check accepted.
            (
                "bare",
                Box::new(move |d| block(d, MODEL, 16, junk(kv_bytes))),
                Some("size"),
            ),
            (
                "junk mac",
                Box::new(move |d| block(d, MODEL, 16, junk(kv_bytes + 32))),
                Some("mac"),
            ),
            (
                "sealed for another digest",
                Box::new({
                    let key = key.clone();
                    move |d| {
                        block(
                            d,
                            MODEL,
                            16,
                            seal(&key, &elsewhere, MODEL, 16, &junk(kv_bytes)),
                        )
                    }
                }),
                Some("mac"),
            ),
            (
                "another model",
                Box::new({
                    let key = key.clone();
                    move |d| {
                        block(
                            d,
                            "other-model",
                            16,
                            seal(&key, d, "other-model", 16, &junk(kv_bytes)),
                        )
                    }
                }),
                Some("model"),
            ),
            (
                "another token count",
                Box::new({
                    let key = key.clone();
                    move |d| block(d, MODEL, 8, seal(&key, d, MODEL, 8, &junk(kv_bytes)))
                }),
                Some("token_count"),
            ),
            // Control: sealed with the engine's key, it is paged in (so the cases above were
            // looked up, and refused by the checks).
            (
                "sealed with the key",
                Box::new({
                    let key = key.clone();
                    move |d| block(d, MODEL, 16, seal(&key, d, MODEL, 16, &junk(kv_bytes)))
                }),
                None,
            ),
        ];
        for (i, (case, forge, reason)) in cases.iter().enumerate() {
            // A distinct first block per case: the victim holds none of it yet.
            let prompt = format!(
                "Case {i}. The quick brown fox jumps over the lazy dog; the lazy dog sleeps on. \
                 The fox runs into the woods, and the dog dreams of bones. In the morning the fox"
            );
            let ids = tok.encode(&prompt).unwrap();
            assert!(ids.len() > 33, "{case}: {} tokens", ids.len());
            let chain = token_chain(&ns, &ids, 16);
            put(agent.addr, forge(&chain[0]));
            let rejected = |r: &str| {
                metric(
                    victim.addr,
                    &format!("engine_shim_kv_pagein_rejected_total{{reason=\"{r}\"}}"),
                )
            };
            let before = reason.map(rejected);
            let (text, cached_tokens) = completion(victim.addr, &prompt);
            match reason {
                Some(r) => {
                    assert_eq!(cached_tokens, 0, "{case}: a forged block was used");
                    assert_eq!(rejected(r), before.unwrap() + 1.0, "{case}");
                    assert_eq!(text, completion(cold.addr, &prompt).0, "{case}");
                }
                None => assert_eq!(cached_tokens, 16, "{case}: the control was not paged in"),
            }
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// The longest vocabulary entry in bytes of text: a byte-level entry stands for one byte per
/// character (SmolLM2's control tokens are ASCII, one byte per character too).
fn longest_entry_bytes() -> (usize, engine_shim::tokenizer::ModelTokenizer) {
    let g = engine_shim::gguf::Gguf::open(&root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf"))
        .unwrap();
    let longest = g
        .get_strings("tokenizer.ggml.tokens")
        .unwrap()
        .iter()
        .map(|t| t.chars().count())
        .max()
        .unwrap();
    let tok = engine_shim::tokenizer::ModelTokenizer::from_gguf(&g).unwrap();
    (longest, tok)
}

#[test]
fn a_prompt_just_over_the_decoded_byte_bound_is_rejected_before_it_is_tokenised() {
    let (longest, tok) = longest_entry_bytes();
    assert_eq!(
        tok.max_token_bytes(),
        longest,
        "the bound is the decoded length"
    );
    let bos = usize::from(tok.add_bos);
    // One byte more than (context - max_tokens) tokens of the longest entry can hold.
    let bytes = (8192 - 4 - bos) * longest + 1;
    let prompt = "a".repeat(bytes);
    let e = engine(&[]);
    for (path, body) in [
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": prompt, "max_tokens": 4}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4}),
        ),
    ] {
        let (s, b) = post(e.addr, path, &serde_json::to_vec(&body).unwrap());
        let v: Value = serde_json::from_slice(&b).unwrap_or(Value::Null);
        assert_eq!(s, 400, "{path}");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains("maximum context length is 8192"), "{msg}");
        assert!(
            msg.contains(&format!("the prompt is {bytes} bytes")),
            "{msg}"
        );
    }
}

#[test]
fn health_answers_while_large_prompts_are_tokenised() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let (longest, tok) = longest_entry_bytes();
    // Exactly at the byte bound: allowed through to the tokeniser (which finds far too many
    // tokens: "a" merges into short entries).
    let bytes = (8192 - 4 - usize::from(tok.add_bos)) * longest;
    let body =
        serde_json::to_vec(&json!({"model": MODEL, "prompt": "a".repeat(bytes), "max_tokens": 4}))
            .unwrap();
    let e = engine(&[]);
    let big = 4;
    let (sent, done) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let clients: Vec<_> = (0..big)
        .map(|_| {
            let (addr, body, sent, done) = (e.addr, body.clone(), sent.clone(), done.clone());
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(addr).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
                write!(
                    s,
                    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                )
                .unwrap();
                s.write_all(&body).unwrap();
                sent.fetch_add(1, Ordering::SeqCst);
                let mut raw = Vec::new();
                s.read_to_end(&mut raw).unwrap();
                done.fetch_add(1, Ordering::SeqCst);
                String::from_utf8_lossy(&raw).to_string()
            })
        })
        .collect();
    while sent.load(Ordering::SeqCst) < big {
        std::thread::sleep(Duration::from_millis(5));
    }
    // Every prompt is with the engine: /health is asked (and must be answered) while none of
    // them has been answered yet.
    let mut answered_while_busy = 0;
    while done.load(Ordering::SeqCst) == 0 {
        let h = get(e.addr, "/health");
        if h.starts_with("HTTP/1.1 200") && done.load(Ordering::SeqCst) == 0 {
            answered_while_busy += 1;
        }
    }
    for c in clients {
        let raw = c.join().unwrap();
        assert!(raw.starts_with("HTTP/1.1 400"), "{:.300}", raw);
        // Refused on its token count: it was tokenised.
        assert!(raw.contains("you requested"), "{:.500}", raw);
    }
    assert!(
        answered_while_busy >= 1,
        "/health was not answered while the prompts were being tokenised"
    );
}

#[test]
fn idle_and_slow_connections_are_capped_and_closed() {
    let config = temp_file(
        "conns.toml",
        "max_connections = 16\nheader_read_timeout_ms = 1000\nbody_read_timeout_ms = 1000\n",
    );
    // A descriptor limit the connections below would exhaust without the cap (engine-shim holds
    // about a dozen descriptors when idle).
    let mut sh = Command::new("sh");
    sh.args([
        "-c",
        "ulimit -n 64 && exec \"$0\" \"$@\"",
        env!("CARGO_BIN_EXE_engine-shim"),
    ]);
    let e = start(sh, &["--config", config.to_str().unwrap()]);
    assert_eq!(
        get(e.addr, "/health").lines().next(),
        Some("HTTP/1.1 200 OK")
    );
    let open = |first: &[u8]| {
        let mut s = TcpStream::connect(e.addr).unwrap();
        s.write_all(first).unwrap();
        s
    };
    // First slow bodies: a head announcing 4 MB, then one byte, then nothing.
    let slow_head: &[u8] =
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4000000\r\n\r\n{";
    let mut slow: Vec<TcpStream> = (0..40).map(|_| open(slow_head)).collect();
    // Then connections that send nothing, and some that send half a head.
    let mut idle: Vec<TcpStream> = (0..20).map(|_| open(b"")).collect();
    idle.extend((0..20).map(|_| open(b"GET /health HTTP/1.1\r\nHo")));
    // /health is answered (the cap holds descriptors back, timeouts free the slots).
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let answered = TcpStream::connect(e.addr).ok().and_then(|mut s| {
            s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
            s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .ok()?;
            let mut out = String::new();
            s.read_to_string(&mut out).ok()?;
            Some(out)
        });
        if answered
            .as_deref()
            .is_some_and(|a| a.starts_with("HTTP/1.1 200") && a.ends_with("ok\n"))
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "/health never answered: {answered:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Every held connection is closed by the engine (EOF or reset), none left hanging; the slow
    // bodies inside the cap get a 408 first.
    let mut timed_out_bodies = 0;
    for (i, s) in slow.iter_mut().chain(idle.iter_mut()).enumerate() {
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut got = Vec::new();
        match s.read_to_end(&mut got) {
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                panic!("connection {i} was left open: {e}")
            }
            Err(_) => {} // reset: closed
        }
        let text = String::from_utf8_lossy(&got);
        if text.starts_with("HTTP/1.1 408") {
            assert!(text.contains("body_read_timeout_ms"), "{text}");
            assert!(
                text.contains("\"code\":\"request_timeout\"") || text.contains("\"error\""),
                "{text}"
            );
            timed_out_bodies += 1;
        }
    }
    assert!(timed_out_bodies >= 1, "no slow body was answered 408");
    // And the engine still does its job.
    assert_eq!(
        answer(&chat(e.addr, "What is the capital of France?", json!({}))),
        "The capital of France is Paris."
    );
}

/// Continuous batching over the real HTTP surface: concurrent answers equal the lone ones, a long
/// prefill does not stall running decodes, an aborted stream frees its KV, a full KV pool
/// preempts without changing any answer, a full queue answers 429, and the prefix cache and
/// kvagent paging serve concurrent requests.
mod batching {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// Sends a streamed request and calls `piece` with each text delta as it arrives; returns
    /// the whole text.
    fn stream(addr: SocketAddr, path: &str, body: &Value, mut piece: impl FnMut(&str)) -> String {
        let s = send(addr, path, &serde_json::to_vec(body).unwrap());
        let mut text = String::new();
        for line in BufReader::new(s).lines() {
            let line = line.unwrap();
            let Some(data) = line.strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                break;
            }
            let v: Value = serde_json::from_str(data).unwrap();
            assert!(v.get("error").is_none(), "{v}");
            let c = &v["choices"][0];
            let t = c["delta"]["content"]
                .as_str()
                .or_else(|| c["text"].as_str())
                .unwrap_or("");
            if !t.is_empty() {
                piece(t);
                text.push_str(t);
            }
        }
        text
    }

    fn chat_body(content: &str, max_tokens: u64) -> Value {
        json!({"model": MODEL, "messages": [{"role": "user", "content": content}],
               "temperature": 0, "max_tokens": max_tokens, "stream": true})
    }

    /// Eight questions of different lengths, and different answer lengths.
    fn questions() -> Vec<(String, u64)> {
        let topics = [
            "What is the capital of France?",
            "Name three colours of the rainbow.",
            "Write one sentence about the sea, the wind and the sailors who cross it at night.",
            "What is 12 plus 30?",
            "Explain in two sentences why the sky is blue, as you would to a curious child who keeps asking why.",
            "Say hello.",
            "List the days of the week.",
            "Describe a cat.",
        ];
        topics
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), 12 + 4 * i as u64))
            .collect()
    }

    /// A histogram's count of observations above `le`.
    fn above(addr: SocketAddr, name: &str, le: &str) -> f64 {
        above_in(&get(addr, "/metrics"), name, le)
    }

    /// Observations of histogram `name` above `le`, in one scrape `m`.
    fn above_in(m: &str, name: &str, le: &str) -> f64 {
        metric_in(m, &format!("{name}_count"))
            - metric_in(m, &format!("{name}_bucket{{le=\"{le}\"}}"))
    }

    #[test]
    fn concurrent_streams_get_the_greedy_answers_they_get_alone() {
        concurrent_streams_match_alone(&[], Prefix::Shared);
    }

    /// With Q8_0 decode kernels too: a decode row takes the Q8_0 path whatever shares its step,
    /// and its numbers are exactly those it gets alone. The questions share no prefix block here:
    /// prompt rows go through libtorch's f32 GEMM, whose rows differ in the last bits with the
    /// number of rows it is given, which a prefix-cache hit changes (whether the batched run
    /// hits depends on timing); with the AVX2 kernels that flipped a near tie ("a beautiful and
    /// magical sight" alone, "a beautiful sight" batched).
    /// The engine restarted itself with OpenMP's passive wait policy (same pid).
    #[test]
    fn q8_0_concurrent_streams_get_the_greedy_answers_they_get_alone() {
        // Whatever policy the caller's environment sets, this engine must choose its own.
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_engine-shim"));
        cmd.env_remove("OMP_WAIT_POLICY");
        // Two threads: decode steps drop libtorch to one and give the second back after, and
        // candle's pool has a worker to share the decode attention out to.
        let args = ["--weights", "q8_0", "--threads", "2"];
        let e = start(cmd, &args);
        let environ = std::fs::read(format!("/proc/{}/environ", e.child.id())).unwrap();
        assert!(
            environ
                .split(|&b| b == 0)
                .any(|kv| kv == b"OMP_WAIT_POLICY=passive"),
            "engine-shim did not restart with OMP_WAIT_POLICY=passive"
        );
        let v = chat(e.addr, "What is the capital of France?", json!({}));
        assert_eq!(answer(&v), "The capital of France is Paris.");
        drop(e);
        concurrent_streams_match_alone(&args, Prefix::Own);
    }

    /// Whether the questions of [`concurrent_streams_match_alone`] share their leading blocks.
    #[derive(Clone, Copy)]
    enum Prefix {
        /// The chat template's default system prompt: every question starts with the same blocks.
        Shared,
        /// A system message that starts with the question: no two share a block.
        Own,
    }

    fn concurrent_streams_match_alone(args: &[&str], prefix: Prefix) {
        let body = |q: &str, n: u64| {
            let mut b = chat_body(q, n);
            if let Prefix::Own = prefix {
                b["messages"].as_array_mut().unwrap().insert(
                    0,
                    json!({"role": "system", "content": format!("{q} Answer briefly.")}),
                );
            }
            b
        };
        let qs = questions();
        let alone_engine = engine(args);
        let alone: Vec<String> = qs
            .iter()
            .map(|(q, n)| {
                stream(
                    alone_engine.addr,
                    "/v1/chat/completions",
                    &body(q, *n),
                    |_| {},
                )
            })
            .collect();
        drop(alone_engine);
        let e = engine(args);
        let together: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> = qs
                .iter()
                .map(|(q, n)| {
                    let addr = e.addr;
                    let body = body(q, *n);
                    s.spawn(move || stream(addr, "/v1/chat/completions", &body, |_| {}))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (i, (a, b)) in alone.iter().zip(&together).enumerate() {
            assert!(!a.is_empty());
            assert_eq!(a, b, "question {i}: alone vs batched ({args:?})");
        }
        assert!(
            above(e.addr, "engine_shim_batch_size", "4") > 0.0,
            "no step ran more than 4 sequences at once"
        );
        assert_eq!(metric(e.addr, "vllm:num_requests_running"), 0.0);
        assert_eq!(metric(e.addr, "engine_shim_kv_pool_used_tokens"), 0.0);
    }

    #[test]
    fn a_long_prefill_does_not_stall_running_decodes() {
        // Steps of at most 72 tokens: the long prompt takes many steps, and the running stream
        // must get a token in each of them.
        let e = engine(&["--prefill-chunk", "64", "--max-num-batched-tokens", "72"]);
        let counting = json!({"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "temperature": 0,
                              "max_tokens": 400, "stream": true});
        let got = Arc::new(AtomicUsize::new(0));
        let addr = e.addr;
        let runner = {
            let got = got.clone();
            std::thread::spawn(move || {
                stream(addr, "/v1/completions", &counting, |_| {
                    got.fetch_add(1, Ordering::SeqCst);
                })
            })
        };
        let deadline = Instant::now() + Duration::from_secs(120);
        while got.load(Ordering::SeqCst) < 3 {
            assert!(Instant::now() < deadline, "the stream never started");
            std::thread::sleep(Duration::from_millis(10));
        }
        let before = got.load(Ordering::SeqCst);
        let long = json!({"model": MODEL, "prompt": document(), "temperature": 0, "max_tokens": 1});
        let (status, body) = post(
            e.addr,
            "/v1/completions",
            &serde_json::to_vec(&long).unwrap(),
        );
        let during = got.load(Ordering::SeqCst) - before;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        let v: Value = serde_json::from_slice(&body).unwrap();
        let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
        let steps = prompt.div_ceil(64);
        assert!(prompt > 600, "{prompt}");
        // One decode token per prefill step (a few are lost to SSE pieces that hold back an
        // incomplete character or arrive after the long answer).
        assert!(
            during + 3 >= steps,
            "the stream got {during} tokens while a {prompt}-token prompt took {steps} steps"
        );
        // One scrape: the counting stream still runs, and a step between two scrapes would
        // count in the second's total but not the first's bucket.
        let m = get(e.addr, "/metrics");
        assert!(
            above_in(&m, "vllm:iteration_tokens_total", "64") > 0.0
                && above_in(&m, "vllm:iteration_tokens_total", "128") == 0.0,
            "steps went over the 72-token budget"
        );
        drop(e);
        let _ = runner.join();
    }

    /// A streamed greedy completion of `prompt` sent on a raw connection (the test reads it,
    /// or drops it to leave).
    fn open_stream(addr: SocketAddr, prompt: &str, max_tokens: u32) -> TcpStream {
        let body = serde_json::to_vec(&json!({"model": MODEL, "prompt": prompt,
            "temperature": 0, "max_tokens": max_tokens, "stream": true}))
        .unwrap();
        let mut s = TcpStream::connect(addr).unwrap();
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )
        .unwrap();
        s.write_all(&body).unwrap();
        s
    }

    #[test]
    fn an_aborted_stream_frees_its_kv() {
        let e = engine(&[]);
        assert_eq!(metric(e.addr, "engine_shim_kv_pool_used_tokens"), 0.0);
        let mut r = BufReader::new(open_stream(e.addr, "1, 2, 3, 4,", 1000));
        let mut data = 0;
        let mut line = String::new();
        while data < 4 {
            line.clear();
            assert!(r.read_line(&mut line).unwrap() > 0);
            data += usize::from(line.starts_with("data: "));
        }
        assert_eq!(metric(e.addr, "vllm:num_requests_running"), 1.0);
        assert!(metric(e.addr, "engine_shim_kv_pool_used_tokens") > 0.0);
        drop(r);
        let deadline = Instant::now() + Duration::from_secs(60);
        while metric(e.addr, "engine_shim_kv_pool_used_tokens") > 0.0
            || metric(e.addr, "vllm:num_requests_running") > 0.0
        {
            assert!(
                Instant::now() < deadline,
                "the aborted sequence kept its KV"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let generated = metric(e.addr, "engine_shim_generated_tokens_total");
        assert!(generated < 1000.0, "it ran to the end: {generated}");
    }

    #[test]
    fn a_full_kv_pool_preempts_and_no_answer_changes() {
        // Counting never ends early, so every sequence grows past its admission room.
        let body = |i: usize| {
            let prompt: String = (0..8).map(|k| format!("{}, ", 100 * i + k)).collect();
            json!({"model": MODEL, "prompt": prompt.trim_end(), "temperature": 0,
                   "max_tokens": 120, "stream": true})
        };
        let alone_engine = engine(&[]);
        let alone: Vec<String> = (0..6)
            .map(|i| stream(alone_engine.addr, "/v1/completions", &body(i), |_| {}))
            .collect();
        drop(alone_engine);
        // A pool of 640 tokens: six sequences of ~150 tokens each cannot all grow.
        let cfg = temp_file(
            "small-pool.toml",
            "max_model_len = 512\nkv_pool_tokens = 640\n",
        );
        let e = engine(&["--config", cfg.to_str().unwrap()]);
        let together: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..6)
                .map(|i| {
                    let (addr, b) = (e.addr, body(i));
                    s.spawn(move || stream(addr, "/v1/completions", &b, |_| {}))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(alone, together);
        assert!(metric(e.addr, "vllm:num_preemptions_total") > 0.0);
        assert_eq!(metric(e.addr, "engine_shim_kv_pool_used_tokens"), 0.0);
        assert_eq!(metric(e.addr, "vllm:num_requests_waiting"), 0.0);
        // A pool smaller than one sequence is refused at start, naming the key.
        let bad = temp_file(
            "tiny-pool.toml",
            "max_model_len = 512\nkv_pool_tokens = 100\n",
        );
        let out = refused_start(&bad, "engine-shim listening");
        assert!(out.contains("kv_pool_tokens"), "{out}");
    }

    /// A streaming client that leaves while its request waits in the queue gives up its place
    /// at once: the engine drops the request before prefilling it, not after its first token.
    #[test]
    fn a_stream_abandoned_in_the_queue_leaves_it() {
        let e = engine(&["--max-num-seqs", "1"]);
        let wait = |what: &str, done: &dyn Fn() -> bool| {
            let deadline = Instant::now() + Duration::from_secs(60);
            while !done() {
                assert!(Instant::now() < deadline, "timed out: {what}");
                std::thread::sleep(Duration::from_millis(20));
            }
        };
        // A long stream holds the only running place (counting never ends early).
        let mut long = BufReader::new(open_stream(e.addr, "1, 2, 3, 4,", 1000));
        let mut line = String::new();
        while !line.starts_with("data: ") {
            line.clear();
            assert!(long.read_line(&mut line).unwrap() > 0);
        }
        let queued = open_stream(e.addr, "5, 6, 7,", 8);
        wait("the second request queues", &|| {
            metric(e.addr, "vllm:num_requests_waiting") == 1.0
        });
        drop(queued);
        wait("the abandoned request leaves the queue", &|| {
            metric(e.addr, "vllm:num_requests_waiting") == 0.0
        });
        let generated = metric(e.addr, "engine_shim_generated_tokens_total");
        assert!(
            generated < 1000.0,
            "it left only once the long stream ended ({generated} tokens)"
        );
        assert_eq!(metric(e.addr, "vllm:num_requests_running"), 1.0);
        drop(long);
    }

    #[test]
    fn a_full_queue_is_answered_429() {
        let cfg_queue = temp_file("queue1.toml", "max_queue = 1\n");
        let e = engine(&[
            "--config",
            cfg_queue.to_str().unwrap(),
            "--max-num-seqs",
            "1",
            "--max-num-batched-tokens",
            "64",
        ]);
        let statuses: Vec<(u16, String)> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..6)
                .map(|i| {
                    let addr = e.addr;
                    s.spawn(move || {
                        let b = json!({"model": MODEL, "prompt": format!("{i}, {},", i + 1),
                                       "temperature": 0, "max_tokens": 48});
                        let (st, body) =
                            post(addr, "/v1/completions", &serde_json::to_vec(&b).unwrap());
                        (st, String::from_utf8_lossy(&body).to_string())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(statuses.iter().any(|(s, _)| *s == 200), "{statuses:?}");
        let refused: Vec<_> = statuses.iter().filter(|(s, _)| *s == 429).collect();
        assert!(!refused.is_empty(), "{statuses:?}");
        assert!(
            refused.iter().all(|(_, b)| b.contains("queue is full")),
            "{refused:?}"
        );
    }

    #[test]
    fn concurrent_requests_reuse_and_page_in_a_shared_prefix() {
        let dir = tempdir("batching-paging");
        let agent = kvagent(&dir);
        let url = format!("http://{}", agent.addr);
        let engine_args = ["--kvagent", url.as_str(), "--kv-mac-key-file"];
        let key = temp_file("batching.key", MAC_KEY_HEX);
        let mut args: Vec<&str> = engine_args.to_vec();
        args.push(key.to_str().unwrap());
        let ask = |q: &str| {
            json!({"model": MODEL, "temperature": 0, "max_tokens": 12, "stream": false,
                   "messages": [{"role": "system", "content": document()}, {"role": "user", "content": q}]})
        };
        let qs = [
            "How many crates are in district 3?",
            "How many crates are in district 9?",
            "Which district has titled notes?",
            "Summarise note 1.",
        ];
        // Engine A answers one at a time: the document is computed once, then reused.
        let a = engine(&args);
        let alone: Vec<Value> = qs.iter().map(|q| chat_json(a.addr, &ask(q))).collect();
        assert!(cached(&alone[1]) > 600, "{}", alone[1]);
        drop(a);
        // A fresh engine B gets all four at once: each pages the document in from kvagent or
        // reuses what the others brought, and answers as A did.
        let b = engine(&args);
        let together: Vec<Value> = std::thread::scope(|s| {
            let handles: Vec<_> = qs
                .iter()
                .map(|q| {
                    let (addr, body) = (b.addr, ask(q));
                    s.spawn(move || chat_json(addr, &body))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (x, y) in alone.iter().zip(&together) {
            assert_eq!(answer(x), answer(y));
            assert!(cached(y) > 600, "{y}");
        }
        assert!(metric(b.addr, "engine_shim_paged_in_tokens_total") > 600.0);
    }

    fn chat_json(addr: SocketAddr, body: &Value) -> Value {
        let (status, b) = post(
            addr,
            "/v1/chat/completions",
            &serde_json::to_vec(body).unwrap(),
        );
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&b));
        serde_json::from_slice(&b).unwrap()
    }

    fn tempdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("engine-shim-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}

/// KV budgets and eviction (docs/eviction.md) on the real model: what eviction keeps, that the
/// prefix cache stays exact, and bad annotations.
mod eviction {
    use super::*;

    const NEEDLE: &str = "The special magic number for Lisbon is 4821937.";
    const QUESTION: &str = "What is the special magic number for Lisbon?";

    /// A NIAH chat: a system prompt, eight filler passages (one message each) and the question;
    /// the needle in its own passage (`in_segment`) or in the question's message.
    fn niah(in_segment: bool) -> Vec<Value> {
        let filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ".repeat(3);
        let mut m = vec![
            json!({"role": "system", "content": "You are a helpful assistant. Answer with the number only."}),
        ];
        for i in 0..8 {
            m.push(json!({"role": "user", "content": format!("Passage {i}: {filler}")}));
        }
        if in_segment {
            m.insert(
                4,
                json!({"role": "user", "content": format!("Passage X: {NEEDLE}")}),
            );
            m.push(json!({"role": "user", "content": QUESTION}));
        } else {
            m.push(json!({"role": "user", "content": format!("{NEEDLE} {QUESTION}")}));
        }
        m
    }

    use super::chat_messages as ask;

    fn report(v: &Value) -> (u64, u64, u64) {
        let r = &v["usage"]["kv_eviction"];
        let n = |k: &str| {
            r[k].as_u64()
                .unwrap_or_else(|| panic!("no usage.kv_eviction.{k}: {v}"))
        };
        (n("evictions"), n("evicted_tokens"), n("over_budget_tokens"))
    }

    fn prompt_tokens(v: &Value) -> u64 {
        v["usage"]["prompt_tokens"].as_u64().unwrap()
    }

    /// The segment policy at half the prompt answers a NIAH item exactly as full KV does when
    /// the needle is in a reserved part or in the most relevant segment (by BM25 against the
    /// question), while evicting; H2O and StreamingLLM evict to the same budget; the counters in
    /// /metrics add up to what the answers report.
    #[test]
    fn segment_eviction_answers_as_full_kv_when_the_needle_is_kept() {
        let e = engine(&[]);
        let mut evicted = std::collections::HashMap::<&str, u64>::new();
        for in_segment in [true, false] {
            let m = niah(in_segment);
            let full = ask(e.addr, &m, json!({}));
            assert!(
                full["usage"].get("kv_eviction").is_none(),
                "no budget, no report"
            );
            let budget = prompt_tokens(&full) / 2;
            for policy in ["segment", "h2o", "streaming"] {
                let v = ask(
                    e.addr,
                    &m,
                    json!({"kv_eviction": {"policy": policy, "budget_tokens": budget}}),
                );
                let (evictions, tokens, over) = report(&v);
                assert!(evictions > 0, "{policy}: {v}");
                assert!(
                    tokens >= prompt_tokens(&v) - budget,
                    "{policy} evicted down to the budget: {v}"
                );
                assert_eq!(over, 0, "{policy} kept to the budget: {v}");
                *evicted.entry(policy).or_default() += tokens;
                if policy == "segment" {
                    assert_eq!(
                        answer(&v),
                        answer(&full),
                        "needle in a segment: {in_segment}"
                    );
                }
            }
        }
        for (policy, tokens) in evicted {
            assert_eq!(
                metric(
                    e.addr,
                    &format!("engine_shim_kv_evicted_tokens_total{{policy=\"{policy}\"}}")
                ),
                tokens as f64
            );
        }
    }

    /// The prompt's blocks go into the prefix cache before its KV is evicted, so they are exact:
    /// the same prompt afterwards reuses them and answers as it does cold. Nothing computed after
    /// the eviction is cached: a follow-up turn holding the evicted answer reuses no more than
    /// the first prompt's blocks, and answers as it does cold.
    #[test]
    fn blocks_cached_before_eviction_are_exact_and_nothing_after_it_is_reused() {
        let e = engine(&[]);
        let m = niah(true);
        let cold = |m: &[Value], salt: &str| ask(e.addr, m, json!({"cache_salt": salt}));
        let reference = cold(&m, "cold-1");
        let pt = prompt_tokens(&reference);
        let evicting = ask(
            e.addr,
            &m,
            json!({"kv_eviction": {"policy": "segment", "budget_tokens": pt / 2}}),
        );
        assert!(report(&evicting).0 > 0);
        let again = ask(e.addr, &m, json!({}));
        assert_eq!(
            cached(&again),
            (pt - 1) / 16 * 16,
            "the prompt's blocks are reused"
        );
        assert_eq!(answer(&again), answer(&reference));
        let mut follow = m.clone();
        follow.push(json!({"role": "assistant", "content": answer(&evicting)}));
        follow.push(json!({"role": "user", "content": "Say it again."}));
        let warm = ask(e.addr, &follow, json!({}));
        assert!(
            cached(&warm) <= pt / 16 * 16,
            "only the first prompt's blocks: {}",
            warm["usage"]
        );
        assert_eq!(answer(&warm), answer(&cold(&follow, "cold-2")));
    }

    /// A sequence at a KV budget takes its prompt's room in the pool only while it prefills:
    /// two running at once (some step computed both) peak below their two prompts together,
    /// as each holds its budget once its prompt is computed; neither is preempted, and both
    /// answer as they do alone.
    #[test]
    fn sequences_at_a_budget_hold_their_budget_not_their_prompt() {
        let e = engine(&[]);
        let chats = [niah(true), niah(false)];
        let ev = |pt: u64, salt: String| json!({"cache_salt": salt, "kv_eviction": {"policy": "streaming", "budget_tokens": pt / 4}});
        let prompts: Vec<u64> = chats
            .iter()
            .map(|m| prompt_tokens(&ask(e.addr, m, json!({"max_tokens": 1}))))
            .collect();
        let alone: Vec<String> = chats
            .iter()
            .zip(&prompts)
            .enumerate()
            .map(|(i, (m, &pt))| answer(&ask(e.addr, m, ev(pt, format!("alone-{i}")))))
            .collect();
        let steps = |e: &Proc| {
            (
                metric(e.addr, "engine_shim_batch_size_count"),
                metric(e.addr, "engine_shim_batch_size_bucket{le=\"1\"}"),
            )
        };
        let (steps_before, single_before) = steps(&e);
        let together: Vec<Value> = std::thread::scope(|scope| {
            let handles: Vec<_> = chats
                .iter()
                .zip(&prompts)
                .enumerate()
                .map(|(i, (m, &pt))| {
                    let body = ev(pt, format!("together-{i}"));
                    scope.spawn(move || ask(e.addr, m, body))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let (steps_after, single_after) = steps(&e);
        assert!(
            steps_after - steps_before > single_after - single_before,
            "some step computed both sequences"
        );
        for (v, a) in together.iter().zip(&alone) {
            assert!(report(v).0 > 0, "evicted: {v}");
            assert_eq!(&answer(v), a, "answers as alone");
        }
        assert_eq!(metric(e.addr, "vllm:num_preemptions_total"), 0.0);
        let peak = metric(e.addr, "engine_shim_kv_pool_peak_tokens") as u64;
        let (a, b) = (prompts[0], prompts[1]);
        assert!(
            peak < a + b,
            "peak KV pool {peak} tokens, prompts {a} and {b}"
        );
    }

    /// A chat of `messages` with `kv_eviction` set to `ev`: its status and JSON body.
    fn refusal(addr: SocketAddr, messages: &[Value], ev: Value) -> (u16, Value) {
        let body =
            json!({"model": MODEL, "messages": messages, "max_tokens": 4, "kv_eviction": ev});
        let (status, b) = post(
            addr,
            "/v1/chat/completions",
            &serde_json::to_vec(&body).unwrap(),
        );
        (status, serde_json::from_slice(&b).unwrap_or(Value::Null))
    }

    /// Bad `kv_eviction` values get 400 naming the field, and the engine goes on serving.
    #[test]
    fn bad_segment_annotations_get_400_naming_the_field() {
        let e = engine(&[]);
        let m = niah(true);
        let cases = [
            (
                json!({"policy": "segment", "budget_tokens": 400, "segments": [{"message": 40}]}),
                "kv_eviction.segments[0].message",
            ),
            (
                json!({"policy": "segment", "budget_tokens": 400, "segments": [{"message": 1, "part": 3}]}),
                "kv_eviction.segments[0].part",
            ),
            (
                json!({"policy": "segment", "budget_tokens": 400, "segments": [{"message": 1, "relevance": "high"}]}),
                "kv_eviction.segments[0].relevance",
            ),
            (
                json!({"policy": "segment", "budget_tokens": 20}),
                "kv_eviction.budget_tokens",
            ),
            (
                json!({"policy": "streaming", "budget_tokens": 3}),
                "kv_eviction.budget_tokens",
            ),
            (json!({"policy": "h2o"}), "kv_eviction.budget_tokens"),
            (
                json!({"policy": "lru", "budget_tokens": 100}),
                "kv_eviction.policy",
            ),
            (
                json!({"policy": "h2o", "budget_tokens": 100, "segments": [{"message": 1}]}),
                "kv_eviction.segments",
            ),
            (json!("segment"), "kv_eviction"),
        ];
        for (ev, param) in cases {
            let (status, v) = refusal(e.addr, &m, ev.clone());
            assert_eq!(
                (
                    status,
                    v["error"]["param"].as_str(),
                    v["error"]["code"].as_str()
                ),
                (400, Some(param), Some("invalid_request")),
                "{ev}: {v}"
            );
        }
        let body = json!({"model": MODEL, "prompt": "hi", "kv_eviction": {"segments": []}});
        let (status, b) = post(
            e.addr,
            "/v1/completions",
            &serde_json::to_vec(&body).unwrap(),
        );
        assert_eq!(status, 400, "{}", String::from_utf8_lossy(&b));
        // A budget the segment policy can keep to, with the needle's passage made reserved.
        let v = ask(
            e.addr,
            &m,
            json!({"kv_eviction": {"policy": "segment", "budget_tokens": 200,
                                                       "segments": [{"message": 4, "reserved": true}]}}),
        );
        assert!(report(&v).0 > 0);
        assert!(answer(&v).contains("4821937"), "{v}");
        drop(e);
        // The engine's default budget is checked against the policy a request chooses.
        let cfg = temp_file(
            "evict.toml",
            "kv_eviction = \"segment\"\nkv_budget_tokens = 3\n",
        );
        let e = engine(&["--config", cfg.to_str().unwrap()]);
        let (status, v) = refusal(e.addr, &m, json!({"policy": "streaming"}));
        assert_eq!(
            (status, v["error"]["param"].as_str()),
            (400, Some("kv_eviction.budget_tokens")),
            "{v}"
        );
        // The segment default itself keeps the reserved part, over its budget, and says so.
        let v = ask(e.addr, &m, json!({}));
        let (evictions, _, over) = report(&v);
        assert!(evictions > 0 && over > 0, "{v}");
    }
}
