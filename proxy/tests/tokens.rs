//! Precise residency against the real engine-shim, kvagent and model.
//!
//! Token mode: the digests the proxy routes by (and sends in `x-kvmesh-prefix-digests`) are the
//! engine's own token-block digests for the same request, which engine-shim checks and counts
//! (`engine_shim_routing_digests_total`), for several chat shapes, Unicode, a cache salt, a
//! prompt longer than the hashed prefix, and a completion. A text-mode proxy in front of the
//! same engine is the control: its digests never match.
//!
//! The engine feed: blocks engine-shim writes through to its kvagent become the engine's
//! `engine_feed` residency in a proxy that never saw the request, which then routes the prefix
//! to it; a kvagent restart (a new `kv_epoch`, an empty store) withdraws them.
//!
//! engine-shim's `kv_eviction` request extension reaches it through the proxy unchanged.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

const MODEL: &str = "SmolLM2-135M-Instruct";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The model's GGUF, which both the engine and a token-mode proxy read.
fn gguf() -> String {
    root()
        .join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
        .display()
        .to_string()
}

/// A running engine-shim on the real model; killed on drop.
struct Engine {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn engine() -> Engine {
    engine_with(&[])
}

/// engine-shim with `extra` arguments, on one libtorch thread unless `extra` chooses: tests run
/// one per core at a time, and engines with a thread per core each slow each other several
/// times over (libgomp's threads spin between ops).
fn engine_with(extra: &[&str]) -> Engine {
    let mut cmd = Command::new(bin("engine-shim"));
    if !extra
        .iter()
        .any(|a| *a == "--threads" || a.starts_with("--threads="))
    {
        cmd.args(["--threads", "1"]);
    }
    let mut child = cmd
        .current_dir(root())
        .args(["--listen", "127.0.0.1:0", "--cache-blocks", "512"])
        .args(extra)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn engine-shim");
    let addr = announced_addr(&mut child, "engine-shim");
    Engine { child, addr }
}

fn engine_metric(e: &Engine, prefix: &str) -> f64 {
    let body = String::from_utf8(get(e.addr, "/metrics").unwrap().body).unwrap();
    metric_sum(&body, prefix)
}

/// A gateway in front of `e`; in token mode with the model's GGUF when `token_mode`.
fn proxy(e: &Engine, token_mode: bool) -> Proxy {
    proxy_with(&[e], token_mode, &[])
}

/// A gateway in front of `engines` (named `shim0`, `shim1`, ...), engine `i` with `feeds[i]`
/// as its kvagent when given.
fn proxy_with(engines: &[&Engine], token_mode: bool, feeds: &[Option<SocketAddr>]) -> Proxy {
    let port = free_port();
    Proxy::start_with(&proxy_toml(port, engines, token_mode, feeds), port, true)
}

/// [`proxy_with`]'s configuration, listening on `port`.
fn proxy_toml(
    port: u16,
    engines: &[&Engine],
    token_mode: bool,
    feeds: &[Option<SocketAddr>],
) -> String {
    let tokenizer = if token_mode {
        format!(
            "[[tokenizers]]\nmodel = \"{MODEL}\"\ngguf = \"{}\"\n",
            gguf()
        )
    } else {
        String::new()
    };
    let mut engine_tables = String::new();
    for (i, e) in engines.iter().enumerate() {
        engine_tables.push_str(&format!(
            "[[engines]]\nname = \"shim{i}\"\nurl = \"http://{}\"\n",
            e.addr
        ));
        if let Some(Some(agent)) = feeds.get(i) {
            engine_tables.push_str(&format!("kvagent = \"http://{agent}\"\n"));
        }
    }
    // 8 blocks hashed: the long prompt is tokenized only up to them.
    format!(
        "listen = \"127.0.0.1:{port}\"\nthreads = 2\nlog = \"warn\"\n[routing]\nmax_prefix_blocks = 8\n[health]\ninterval_ms = 200\n{tokenizer}{engine_tables}"
    )
}

fn chat(messages: Value, extra: Value) -> Vec<u8> {
    let mut body = json!({"model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0});
    if let (Some(b), Some(x)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(x.clone());
    }
    serde_json::to_vec(&body).unwrap()
}

/// Requests of several shapes, each with at least one full 16-token block.
fn requests() -> Vec<(&'static str, Vec<u8>)> {
    // Over INLINE_TOKENIZE_BYTES: tokenized on a blocking thread.
    let long = "Retrieval passage: the harbour of the old town was rebuilt in 1872 after a storm. "
        .repeat(60);
    vec![
        (
            "/v1/chat/completions",
            chat(
                json!([{"role": "system", "content": "You are a careful assistant."},
                       {"role": "user", "content": "Name three rivers of Europe and one fact about each."}]),
                json!({}),
            ),
        ),
        (
            "/v1/chat/completions",
            chat(
                json!([{"role": "user", "content": "What is the capital of France?"},
                       {"role": "assistant", "content": "Paris."},
                       {"role": "user", "content": "And of Italy? Answer in one word, please."}]),
                json!({}),
            ),
        ),
        (
            "/v1/chat/completions",
            chat(
                json!([{"role": "user", "content": "日本語のテキスト、émojis 😀 et un café naïve — ça va? Ünïcödé ½ ∑ 🚀🚀"}]),
                json!({}),
            ),
        ),
        (
            "/v1/chat/completions",
            chat(
                json!([{"role": "user", "content": [
                    {"type": "text", "text": "Summarise the following in a sentence. "},
                    {"type": "text", "text": "Tides rise and fall twice a day because of the moon."}
                ]}]),
                json!({}),
            ),
        ),
        (
            "/v1/chat/completions",
            chat(json!([{"role": "user", "content": long}]), json!({})),
        ),
        (
            "/v1/chat/completions",
            chat(
                json!([{"role": "user", "content": "A tenant's prompt, salted apart from everyone else's."}]),
                json!({"cache_salt": "tenant-7"}),
            ),
        ),
        (
            "/v1/completions",
            serde_json::to_vec(&json!({"model": MODEL, "max_tokens": 1, "temperature": 0,
                "prompt": "Once upon a time, in a small village by the sea, there lived an old fisherman who"}))
            .unwrap(),
        ),
    ]
}

#[test]
fn token_mode_digests_are_the_engines_own() {
    let e = engine();
    let p = proxy(&e, true);
    let reqs = requests();
    for (path, body) in &reqs {
        let r = post(p.addr, path, body);
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    }
    let n = reqs.len() as f64;
    assert_eq!(
        engine_metric(&e, "engine_shim_routing_digests_total{result=\"match\"}"),
        n
    );
    assert_eq!(
        engine_metric(&e, "engine_shim_routing_digests_total{result=\"mismatch\"}"),
        0.0
    );
    assert_eq!(p.metric("kvmesh_token_mode_fallbacks_total"), 0.0);
    assert_eq!(p.metric("kvmesh_tokenize_seconds_count"), n);

    // Asked again, the long prompt's cached tokens confirm the index's prediction in blocks.
    let (path, body) = &reqs[4];
    let confirmed = p.metric("kvmesh_residency_verdicts_total{verdict=\"confirmed\"}");
    let r = post(p.addr, path, body);
    assert_eq!(r.status, 200);
    let cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= 8 * 16, "{cached}");
    assert_eq!(
        p.metric("kvmesh_residency_verdicts_total{verdict=\"confirmed\"}"),
        confirmed + 1.0
    );

    // A prompt token mode cannot read is routed without a chain, counted, and the engine's
    // own answer (it takes only string prompts) comes back.
    let bad = br#"{"model":"SmolLM2-135M-Instruct","prompt":["a","b"],"max_tokens":1}"#;
    let r = post(p.addr, "/v1/completions", bad);
    assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(
        p.metric("kvmesh_token_mode_fallbacks_total{reason=\"prompt\"}"),
        1.0
    );

    // The control: text-mode digests (of the long prompt: a shorter one has no 256-byte
    // block) are not the engine's.
    let text = proxy(&e, false);
    let (path, body) = &reqs[4];
    assert_eq!(post(text.addr, path, body).status, 200);
    assert_eq!(
        engine_metric(&e, "engine_shim_routing_digests_total{result=\"mismatch\"}"),
        1.0
    );
}

// Tokenizing a long prompt took the runtime worker that handled the request for milliseconds
// (8-45 ms for 32 KB, measured under load), and a sidecar runs one: every other request and
// stream it relays waited. A prompt over INLINE_TOKENIZE_BYTES is tokenized on a blocking
// thread, and gives the same chain. Seen from a one-thread runtime: a task spawned before
// the call runs while a long prompt is tokenized, and not while a short one is.
#[test]
fn a_long_prompt_is_tokenized_off_the_runtime_worker() {
    use kvmesh_filters::chain::Namespace;
    use kvmesh_filters::request::Endpoint;
    use kvmesh_proxy::tokens::{TokenModes, INLINE_TOKENIZE_BYTES};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    let modes = TokenModes::load(
        &[kvmesh_proxy::config::TokenizerConfig {
            model: MODEL.into(),
            gguf: gguf(),
            block_tokens: 16,
        }],
        1,
    )
    .unwrap();
    let ns = Namespace::new(MODEL, b"");
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let text = "The harbour of the old town was rebuilt in 1872 after a storm. ";
    for (repeat, off_worker) in [(2, false), (200, true)] {
        let body = chat(
            json!([{"role": "user", "content": text.repeat(repeat)}]),
            json!({}),
        );
        assert_eq!(body.len() > INLINE_TOKENIZE_BYTES, off_worker);
        let body = bytes::Bytes::from(body);
        let ran = Arc::new(AtomicBool::new(false));
        let (chain, ran_meanwhile) = rt.block_on(async {
            let flag = ran.clone();
            let other = tokio::spawn(async move { flag.store(true, Ordering::SeqCst) });
            let (chain, _) = modes
                .chain_off_worker(MODEL, Endpoint::ChatCompletions, &body, &ns, 64)
                .await;
            let ran_meanwhile = ran.load(Ordering::SeqCst);
            other.await.unwrap();
            (chain, ran_meanwhile)
        });
        assert_eq!(ran_meanwhile, off_worker, "{} bytes", body.len());
        let inline = modes
            .chain(MODEL, Endpoint::ChatCompletions, &body, &ns, 64)
            .unwrap();
        let chain = chain.unwrap();
        assert!(chain.chain.len() > 1);
        assert_eq!(chain.chain, inline.chain);
        assert_eq!(
            (chain.total_bytes, chain.block_bytes),
            (inline.total_bytes, inline.block_bytes)
        );
    }
}

#[test]
fn a_token_mode_proxy_refuses_to_start_without_its_tokenizer() {
    let (ok, out) = check_config(&format!(
        "[[tokenizers]]\nmodel = \"{MODEL}\"\ngguf = \"/nonexistent/model.gguf\"\n[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\n"
    ));
    assert!(!ok, "{out}");
    assert!(out.contains("/nonexistent/model.gguf"), "{out}");
    let (ok, out) = check_config(
        "[[tokenizers]]\nmodel = \"m\"\ngguf = \"x.gguf\"\nblock_tokens = 0\n[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\n",
    );
    assert!(!ok, "{out}");
    assert!(out.contains("block_tokens"), "{out}");
}

/// A kvagent on 127.0.0.1:`port` storing under `dir`; killed on drop.
fn kvagent(dir: &std::path::Path, port: u16) -> Killed {
    let child = Command::new(bin("kvagent"))
        .env("KVAGENT_LISTEN", format!("127.0.0.1:{port}"))
        .env("KVAGENT_METRICS_LISTEN", "")
        .env("KVAGENT_SSD_DIR", dir)
        .env("KVAGENT_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn kvagent");
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    assert!(
        eventually(Duration::from_secs(20), || std::net::TcpStream::connect(
            addr
        )
        .is_ok()),
        "kvagent did not start"
    );
    Killed(child)
}

#[test]
fn blocks_an_engine_wrote_to_kvagent_are_its_residency_until_kvagent_restarts() {
    let dir = std::env::temp_dir().join(format!("kvmesh-feed-{}", std::process::id()));
    let port = free_port();
    let agent_addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut agent = kvagent(&dir, port);
    // Engine 1 writes through to the agent; engine 0 has none.
    let e0 = engine();
    let e1 = engine_with(&["--kvagent", &format!("http://{agent_addr}")]);
    let p = proxy_with(&[&e0, &e1], true, &[None, Some(agent_addr)]);
    let feed = "kvmesh_residency_entries{source=\"engine_feed\"}";
    assert!(eventually(Duration::from_secs(10), || {
        p.metric("kvmesh_engine_feed_events_total{engine=\"shim1\",event=\"connected\"}") == 1.0
    }));
    assert_eq!(p.metric(feed), 0.0);

    // The engine computes a prompt the proxy never sees; its blocks reach the agent and, by
    // the feed, the proxy's index.
    let (path, body) = &requests()[4];
    let r = post(e1.addr, path, body);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let prompt_tokens = r.json()["usage"]["prompt_tokens"].as_u64().unwrap();
    let blocks = (prompt_tokens / 16) as f64;
    assert!(blocks >= 8.0, "{prompt_tokens} tokens");
    assert!(
        eventually(Duration::from_secs(20), || p.metric(feed) == blocks),
        "engine_feed entries {} of {blocks}",
        p.metric(feed)
    );
    // Routed on that residency: every time to the engine that holds it, a prefix hit.
    for _ in 0..3 {
        let r = post(p.addr, path, body);
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-kvmesh-engine"), Some("shim1"));
    }
    assert_eq!(
        p.metric("kvmesh_routing_decisions_total{policy=\"prefix\",reason=\"prefix_hit\"}"),
        3.0
    );

    // The agent restarts empty (a new kv_epoch): the feed is lost, then reconnects, and
    // nothing it claimed is left.
    agent.0.kill().unwrap();
    agent.0.wait().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        eventually(Duration::from_secs(10), || p.metric(feed) == 0.0),
        "engine_feed entries {} after the agent stopped",
        p.metric(feed)
    );
    let _agent = kvagent(&dir, port);
    assert!(eventually(Duration::from_secs(20), || {
        p.metric("kvmesh_engine_feed_events_total{engine=\"shim1\",event=\"connected\"}") == 2.0
    }));
    assert_eq!(p.metric(feed), 0.0);
    assert!(p.metric("kvmesh_engine_feed_events_total{engine=\"shim1\",event=\"lost\"}") >= 1.0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Feeds follow configuration reloads: a reload that gives an engine a `kvagent` starts its
/// feed (the blocks the engine wrote before become its residency), one that points it at
/// another agent restarts the feed (what the old one recorded is withdrawn), and one that
/// takes the key away stops it (withdrawn, not claimed again, its metric series dropped).
#[test]
fn a_reload_starts_restarts_and_stops_an_engines_feed() {
    let pid = std::process::id();
    let dirs = [0, 1].map(|i| std::env::temp_dir().join(format!("kvmesh-feed-reload-{pid}-{i}")));
    let ports = [free_port(), free_port()];
    let agents: Vec<SocketAddr> = ports
        .iter()
        .map(|p| format!("127.0.0.1:{p}").parse().unwrap())
        .collect();
    let _a = kvagent(&dirs[0], ports[0]);
    let _b = kvagent(&dirs[1], ports[1]);
    let e0 = engine();
    let e1 = engine_with(&["--kvagent", &format!("http://{}", agents[0])]);
    let port = free_port();
    let p = Proxy::start_with(&proxy_toml(port, &[&e0, &e1], true, &[]), port, true);
    let feed = "kvmesh_residency_entries{source=\"engine_feed\"}";
    let connected = "kvmesh_engine_feed_events_total{engine=\"shim1\",event=\"connected\"}";
    // Agent a holds blocks of a prompt that engine 1 computed, never seen by the proxy.
    let (path, body) = &requests()[4];
    let r = post(e1.addr, path, body);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let blocks = (r.json()["usage"]["prompt_tokens"].as_u64().unwrap() / 16) as f64;
    assert!(blocks >= 8.0);
    let reload = |feeds: &[Option<SocketAddr>], applied: f64| {
        // Replaced whole (the reload timer may read the file at any moment).
        let tmp = p.config.with_extension("next");
        std::fs::write(&tmp, proxy_toml(port, &[&e0, &e1], true, feeds)).unwrap();
        std::fs::rename(&tmp, &p.config).unwrap();
        p.sighup();
        assert!(
            eventually(Duration::from_secs(20), || {
                p.metric("kvmesh_config_reloads_total{outcome=\"applied\"}") == applied
            }),
            "reload {applied} not applied"
        );
    };
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(p.metric(feed), 0.0, "no feed configured yet");
    assert_eq!(p.metric(connected), 0.0);

    // Started by a reload.
    reload(&[None, Some(agents[0])], 1.0);
    assert!(
        eventually(Duration::from_secs(20), || p.metric(feed) == blocks),
        "engine_feed entries {} of {blocks} after the reload that added the feed",
        p.metric(feed)
    );
    assert_eq!(p.metric(connected), 1.0);

    // Restarted on another (empty) agent: a's blocks are withdrawn.
    reload(&[None, Some(agents[1])], 2.0);
    assert!(
        eventually(Duration::from_secs(20), || p.metric(connected) == 2.0),
        "the feed did not reconnect to the new agent"
    );
    assert!(
        eventually(Duration::from_secs(10), || p.metric(feed) == 0.0),
        "{} engine_feed entries left by the replaced feed",
        p.metric(feed)
    );

    // Back on a, then stopped: withdrawn, and nothing reconnects or claims them again.
    reload(&[None, Some(agents[0])], 3.0);
    assert!(
        eventually(Duration::from_secs(20), || p.metric(feed) == blocks),
        "engine_feed entries {} of {blocks} back on agent a",
        p.metric(feed)
    );
    reload(&[], 4.0);
    assert!(
        eventually(Duration::from_secs(10), || p.metric(feed) == 0.0),
        "{} engine_feed entries left by the stopped feed",
        p.metric(feed)
    );
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(p.metric(feed), 0.0);
    // The stopped feed's series are gone with it.
    assert_eq!(
        p.metric("kvmesh_engine_feed_events_total{engine=\"shim1\""),
        0.0
    );
    for d in &dirs {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// The `kv_eviction` extension (docs/eviction.md) reaches the engine unchanged through a
/// text-mode and a token-mode proxy: the segment budget is applied (evictions reported in
/// `usage.kv_eviction`), and a bad annotation's 400, naming the field, comes back as the engine
/// wrote it.
#[test]
fn kv_eviction_reaches_the_engine_through_the_proxy() {
    let e = engine();
    let mut messages = vec![json!({"role": "system", "content": "Answer from the passages."})];
    for i in 0..6 {
        messages.push(json!({"role": "user", "content": format!(
            "Passage {i}: the harbour of town {i} was rebuilt in 18{i}2 after a storm that lasted three days."
        )}));
    }
    messages.push(json!({"role": "user", "content": "When was the harbour of town 3 rebuilt?"}));
    let ev = json!({"policy": "segment", "budget_tokens": 120, "segments": [{"message": 4, "relevance": 5.0}]});
    for token_mode in [false, true] {
        let p = proxy(&e, token_mode);
        let body = chat(json!(messages), json!({"max_tokens": 4, "kv_eviction": ev}));
        let r = post(p.addr, "/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let v = r.json();
        let report = &v["usage"]["kv_eviction"];
        assert_eq!(
            (report["policy"].as_str(), report["budget_tokens"].as_u64()),
            (Some("segment"), Some(120)),
            "{v}"
        );
        assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 120, "{v}");
        assert!(report["evictions"].as_u64().unwrap() > 0, "{v}");
        let bad = json!({"policy": "segment", "budget_tokens": 120, "segments": [{"message": 40}]});
        let r = post(
            p.addr,
            "/v1/chat/completions",
            &chat(json!(messages), json!({"kv_eviction": bad})),
        );
        assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
        assert_eq!(
            r.json()["error"]["param"].as_str(),
            Some("kv_eviction.segments[0].message")
        );
    }
}
