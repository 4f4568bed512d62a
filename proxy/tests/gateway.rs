//! End-to-end tests of the gateway: a real `kvmesh-proxy` in front of real `kvmesh-sim-engine`
//! processes, over loopback sockets.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use common::*;

const CHAT: &str = "/v1/chat/completions";

#[test]
fn same_prefix_same_engine_and_distinct_prefixes_spread() {
    let sims: Vec<Sim> = (0..3).map(|i| Sim::instant(&format!("e{i}"))).collect();
    let proxy = Proxy::start(
        "policy = \"prefix\"",
        &sims.iter().collect::<Vec<_>>(),
        true,
    );
    let mut engine_of: HashMap<u64, String> = HashMap::new();
    for round in 0..3 {
        for prefix in 0..9u64 {
            // 4 KB shared prefix, then a per-request suffix.
            let content = format!(
                "{}{}",
                text(prefix, 4096),
                text(1000 + round * 100 + prefix, 300)
            );
            let r = post(proxy.addr, CHAT, &chat_body("sim-model", &content, ""));
            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
            let engine = r.header("x-sim-engine").unwrap().to_string();
            assert_eq!(r.header("x-kvmesh-engine"), Some(engine.as_str()));
            let first = engine_of.entry(prefix).or_insert_with(|| engine.clone());
            assert_eq!(
                *first, engine,
                "prefix {prefix} moved from {first} to {engine} in round {round}"
            );
        }
    }
    let used: HashSet<&String> = engine_of.values().collect();
    assert!(
        used.len() >= 2,
        "9 distinct cold prefixes all landed on {used:?}"
    );
    assert!(
        proxy.metric("kvmesh_routing_decisions_total{policy=\"prefix\",reason=\"prefix_hit\"}")
            >= 18.0
    );
    // The engines confirmed the hits: cached tokens were reported for the repeat requests.
    assert!(proxy.metric("kvmesh_cached_tokens_total") > 0.0);
}

#[test]
fn body_reaches_the_engine_byte_for_byte() {
    let sim = Sim::instant("e0");
    let proxy = Proxy::start("", &[&sim], true);
    for size in [100usize, 200 * 1024, 2 * 1024 * 1024] {
        let mut body = chat_body("sim-model", &text(size as u64, size.saturating_sub(70)), "");
        body.truncate(body.len()); // exact bytes as sent
        let want = blake3::hash(&body).to_hex().to_string();
        for framing in [
            Framing::Length,
            Framing::Chunked(16 * 1024),
            Framing::Chunked(7),
            Framing::LengthExpect,
        ] {
            if matches!(framing, Framing::Chunked(7)) && size > 1024 * 1024 {
                continue; // 300k tiny chunks only slow the test down
            }
            let r = request(proxy.addr, "POST", CHAT, &body, framing, &[]).expect("request");
            assert_eq!(
                r.status,
                200,
                "{size} {framing:?}: {}",
                String::from_utf8_lossy(&r.body)
            );
            assert_eq!(
                r.header("x-sim-body-len"),
                Some(body.len().to_string().as_str()),
                "{size} {framing:?}"
            );
            assert_eq!(
                r.header("x-sim-body-blake3"),
                Some(want.as_str()),
                "{size} {framing:?}"
            );
        }
    }
}

#[test]
fn sse_chunks_arrive_incrementally() {
    // 40 ms per decode step: 8 tokens take about 320 ms at the engine.
    let sim = Sim::start(
        "e0",
        &[
            "--decode-us-per-step",
            "40000",
            "--prefill-us-per-token",
            "0",
        ],
    );
    let proxy = Proxy::start("", &[&sim], true);
    let body = chat_body(
        "sim-model",
        "hello",
        r#","stream":true,"max_tokens":8,"stream_options":{"include_usage":true}"#,
    );
    let mut s = start_request(proxy.addr, "POST", CHAT, &body, Framing::Length, &[]).unwrap();
    assert_eq!(s.status, 200);
    assert!(s
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    let mut arrivals = Vec::new();
    let mut text_seen = String::new();
    while let Some(piece) = s.next_piece().unwrap() {
        let p = String::from_utf8(piece).unwrap();
        for _ in p.matches("data: ") {
            arrivals.push(Instant::now());
        }
        text_seen.push_str(&p);
    }
    assert!(text_seen.ends_with("data: [DONE]\n\n"), "{text_seen}");
    assert!(
        text_seen.contains("\"cached_tokens\""),
        "usage chunk passed through"
    );
    // 8 token events + the final + usage + [DONE]; they arrive spread over the decode steps,
    // not in one burst at the end.
    assert!(arrivals.len() >= 10, "{} events", arrivals.len());
    let spread = *arrivals.last().unwrap() - arrivals[0];
    assert!(
        spread >= Duration::from_millis(150),
        "all events arrived within {spread:?}: buffered, not streamed"
    );
    let distinct_reads = arrivals
        .windows(2)
        .filter(|w| w[1] - w[0] >= Duration::from_millis(10))
        .count();
    assert!(
        distinct_reads >= 5,
        "events came in {distinct_reads} separate bursts"
    );
}

#[test]
fn inflight_returns_to_zero_after_client_aborts_mid_stream() {
    let sim = Sim::start(
        "e0",
        &[
            "--decode-us-per-step",
            "50000",
            "--prefill-us-per-token",
            "0",
        ],
    );
    let proxy = Proxy::start("", &[&sim], true);
    for _ in 0..3 {
        // The previous stream's abort reaches the proxy only at its next write to the client:
        // wait for its release rather than race it.
        assert!(
            eventually(Duration::from_secs(10), || proxy
                .metric("kvmesh_engine_inflight")
                == 0.0),
            "the aborted stream was not released: inflight {}",
            proxy.metric("kvmesh_engine_inflight")
        );
        let body = chat_body(
            "sim-model",
            "tell me a long story",
            r#","stream":true,"max_tokens":200"#,
        );
        let mut s = start_request(proxy.addr, "POST", CHAT, &body, Framing::Length, &[]).unwrap();
        assert_eq!(s.status, 200);
        assert!(s.next_piece().unwrap().is_some());
        // 200 tokens at 50 ms each: the stream runs for seconds, and it alone is counted.
        assert_eq!(
            proxy.metric("kvmesh_engine_inflight"),
            1.0,
            "the stream is counted while it runs"
        );
        drop(s); // the client goes away mid-stream
    }
    assert!(
        eventually(Duration::from_secs(10), || proxy
            .metric("kvmesh_engine_inflight")
            == 0.0),
        "inflight stuck at {}",
        proxy.metric("kvmesh_engine_inflight")
    );
    assert_eq!(proxy.metric("kvmesh_engine_pending_prefill_bytes"), 0.0);
}

#[test]
fn bad_input_gets_openai_style_errors() {
    let sim = Sim::instant("e0");
    let proxy = Proxy::start("max_body_bytes = 65536", &[&sim], true);
    let big = chat_body("sim-model", &text(1, 70_000), "");
    let mut non_utf8 = br#"{"model":"sim-model","messages":[{"role":"user","content":"ab"#.to_vec();
    non_utf8.extend_from_slice(&[0xC3, 0x28]);
    non_utf8.extend_from_slice(br#""}]}"#);
    // (case, path, body, framing, expected status, expected words in the message)
    type Case<'a> = (&'a str, &'a str, Vec<u8>, Framing, u16, &'a str);
    let cases: Vec<Case> = vec![
        (
            "invalid JSON",
            CHAT,
            b"{\"model\":".to_vec(),
            Framing::Length,
            400,
            "invalid JSON",
        ),
        (
            "wrong type",
            CHAT,
            br#"{"model":"sim-model","messages":"hi"}"#.to_vec(),
            Framing::Length,
            400,
            "messages",
        ),
        (
            "missing messages",
            CHAT,
            br#"{"model":"sim-model"}"#.to_vec(),
            Framing::Length,
            400,
            "missing field `messages`",
        ),
        (
            "missing prompt",
            "/v1/completions",
            br#"{"model":"sim-model"}"#.to_vec(),
            Framing::Length,
            400,
            "missing field `prompt`",
        ),
        (
            "missing input",
            "/v1/embeddings",
            br#"{"model":"sim-model"}"#.to_vec(),
            Framing::Length,
            400,
            "missing field `input`",
        ),
        ("non-UTF-8", CHAT, non_utf8, Framing::Length, 400, "invalid"),
        (
            "tools nested too deep",
            CHAT,
            chat_body(
                "sim-model",
                "hi",
                &format!(r#","tools":{}{}"#, "[".repeat(40), "]".repeat(40)),
            ),
            Framing::Length,
            400,
            "`tools` nests arrays and objects deeper than 32",
        ),
        (
            "empty body",
            CHAT,
            Vec::new(),
            Framing::Length,
            400,
            "empty",
        ),
        (
            "too large (length)",
            CHAT,
            big.clone(),
            Framing::Length,
            413,
            "limit",
        ),
        (
            "too large (chunked)",
            CHAT,
            big,
            Framing::Chunked(8192),
            413,
            "limit",
        ),
        (
            "unknown model",
            CHAT,
            chat_body("no-such-model", "hi", ""),
            Framing::Length,
            404,
            "no-such-model",
        ),
        (
            "unknown path",
            "/v1/nothing",
            b"{}".to_vec(),
            Framing::Length,
            404,
            "no route",
        ),
    ];
    for (name, path, body, framing, status, needle) in cases {
        let r = request(proxy.addr, "POST", path, &body, framing, &[])
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(
            r.status,
            status,
            "{name}: {}",
            String::from_utf8_lossy(&r.body)
        );
        let v = r.json();
        let msg = v["error"]["message"]
            .as_str()
            .unwrap_or_else(|| panic!("{name}: no error.message in {v}"));
        assert!(msg.contains(needle), "{name}: {msg}");
        assert!(
            v["error"]["type"].is_string() && v["error"]["code"].is_string(),
            "{name}: {v}"
        );
    }
    let r = request(proxy.addr, "GET", CHAT, b"", Framing::Length, &[]).unwrap();
    assert_eq!((r.status, r.header("allow")), (405, Some("POST")));
    let r = request(proxy.addr, "POST", "/v1/models", b"", Framing::Length, &[]).unwrap();
    assert_eq!((r.status, r.header("allow")), (405, Some("GET, HEAD")));
    // HEAD answers as GET, without the body.
    for path in ["/v1/models", "/v1/models/sim-model", "/health"] {
        let full = get(proxy.addr, path).unwrap();
        assert_eq!(full.status, 200, "GET {path}");
        assert_eq!(
            head(proxy.addr, path),
            (200, Some(full.body.len()), 0),
            "HEAD {path}: GET's status and length, no body"
        );
    }
    // Engine errors pass through unchanged: the simulator rejects an empty prompt itself.
    let r = post(
        proxy.addr,
        "/v1/completions",
        br#"{"model":"sim-model","prompt":""}"#,
    );
    assert_eq!(r.status, 400);
    assert_eq!(
        r.header("x-sim-engine"),
        Some("e0"),
        "answered by the engine"
    );
    assert_eq!(r.json()["error"]["message"], "empty prompt");
    // The proxy still serves after all that.
    assert_eq!(
        post(proxy.addr, CHAT, &chat_body("sim-model", "hi", "")).status,
        200
    );
}

#[test]
fn no_reachable_engine_is_503() {
    let port = free_port();
    let toml = format!(
        "listen = \"127.0.0.1:{}\"\nlog = \"error\"\n[health]\ninterval_ms = 200\n[[engines]]\nname = \"gone\"\nurl = \"http://127.0.0.1:{port}\"\n",
        free_port()
    );
    let listen_port: u16 = toml
        .lines()
        .next()
        .unwrap()
        .rsplit(':')
        .next()
        .unwrap()
        .trim_end_matches('"')
        .parse()
        .unwrap();
    let proxy = Proxy::start_with(&toml, listen_port, false);
    assert_eq!(get(proxy.addr, "/ready").unwrap().status, 503);
    assert_eq!(get(proxy.addr, "/health").unwrap().status, 200);
    let r = post(proxy.addr, CHAT, &chat_body("sim-model", "hi", ""));
    assert_eq!(r.status, 503, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["error"]["code"], "no_engine_available");
    assert_eq!(r.header("retry-after"), Some("1"));
}

#[test]
fn killed_engine_fails_over_before_the_first_byte() {
    let mut sims: Vec<Sim> = (0..3).map(|i| Sim::instant(&format!("e{i}"))).collect();
    // Slow health probes: failover must come from the failed connection itself.
    let extra = "[upstream]\nmax_attempts = 3\nconnect_timeout_ms = 500\n";
    let port = free_port();
    let toml = format!(
        "listen = \"127.0.0.1:{port}\"\nlog = \"error\"\n{extra}[health]\ninterval_ms = 60000\n{}",
        engines_toml(&sims.iter().collect::<Vec<_>>())
    );
    let proxy = Proxy::start_with(&toml, port, true);
    let prompt = text(42, 5000);
    let r = post(proxy.addr, CHAT, &chat_body("sim-model", &prompt, ""));
    assert_eq!(r.status, 200);
    let victim = r.header("x-sim-engine").unwrap().to_string();
    sims.iter_mut().find(|s| s.name == victim).unwrap().kill();
    for i in 0..12 {
        // The same prefix (which the index places on the dead engine) and fresh ones.
        let content = if i % 2 == 0 {
            prompt.clone()
        } else {
            text(100 + i, 5000)
        };
        let r = post(proxy.addr, CHAT, &chat_body("sim-model", &content, ""));
        assert_eq!(
            r.status,
            200,
            "request {i}: {}",
            String::from_utf8_lossy(&r.body)
        );
        assert_ne!(r.header("x-sim-engine"), Some(victim.as_str()));
    }
    assert!(proxy.metric("kvmesh_upstream_retries_total") >= 1.0);
    assert_eq!(
        proxy.metric("kvmesh_engine_healthy"),
        2.0,
        "the dead engine is marked down"
    );
}

#[test]
fn models_are_aggregated_and_health_answers() {
    let a = Sim::start("a", &["--model", "alpha"]);
    let b = Sim::start("b", &["--model", "beta"]);
    let proxy = Proxy::start("", &[&a, &b], true);
    assert!(eventually(Duration::from_secs(5), || proxy
        .metric("kvmesh_engine_healthy")
        == 2.0));
    let ids: HashSet<String> = get(proxy.addr, "/v1/models").unwrap().json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        ids,
        HashSet::from(["alpha".to_string(), "beta".to_string()])
    );
    let one = get(proxy.addr, "/v1/models/beta").unwrap();
    assert_eq!((one.status, one.json()["id"].as_str()), (200, Some("beta")));
    let encoded = get(proxy.addr, "/v1/models/%62eta").unwrap();
    assert_eq!(
        encoded.json()["id"].as_str(),
        Some("beta"),
        "percent-decoded"
    );
    let none = get(proxy.addr, "/v1/models/gamma").unwrap();
    assert_eq!(
        (none.status, none.json()["error"]["code"].as_str()),
        (404, Some("model_not_found"))
    );
    // Requests go to the engine that serves the model.
    for _ in 0..4 {
        assert_eq!(
            post(proxy.addr, CHAT, &chat_body("beta", "x", "")).header("x-sim-engine"),
            Some("b")
        );
    }
    // Per engine and model: the four above, the other engine's series at zero (known models).
    let served = |engine: &str, model: &str, class: &str| {
        proxy.metric(&format!(
            "kvmesh_engine_requests_total{{class=\"{class}\",engine=\"{engine}\",model=\"{model}\"}}"
        ))
    };
    assert_eq!(served("b", "beta", "2xx"), 4.0);
    assert_eq!(served("b", "beta", "5xx"), 0.0);
    assert_eq!(served("a", "alpha", "2xx"), 0.0);
    assert_eq!(
        proxy.metric("kvmesh_engine_ttft_seconds_count{engine=\"b\",model=\"beta\"}"),
        4.0
    );
    assert!(proxy.metric("kvmesh_engine_tokens_total{engine=\"b\",kind=\"prompt\"}") > 0.0);
    // Completion tokens: per engine and in all, as the engine's `usage` reported them.
    let completion = proxy.metric("kvmesh_engine_tokens_total{engine=\"b\",kind=\"completion\"}");
    assert!(completion >= 4.0, "{completion} completion tokens");
    assert_eq!(proxy.metric("kvmesh_completion_tokens_total"), completion);
    assert_eq!(
        proxy.metric("kvmesh_engine_tokens_total{engine=\"a\",kind=\"completion\"}"),
        0.0
    );
    // Process metrics of the proxy itself (from /proc).
    assert!(proxy.metric("process_resident_memory_bytes") > 1e6);
    assert!(proxy.metric("process_open_fds") >= 3.0);
    assert!(proxy.metric("process_max_fds") > 0.0);
    assert_eq!(proxy.metric("kvmesh_max_inflight"), 4096.0);
    // Inter-chunk gaps: none for the four JSON answers; a streamed answer's 16 tokens arrive
    // as chunks with gaps between them.
    let itl = "kvmesh_engine_itl_seconds_count{engine=\"b\",model=\"beta\"}";
    assert_eq!(proxy.metric(itl), 0.0);
    let r = post(
        proxy.addr,
        CHAT,
        &chat_body("beta", "y", r#","stream":true"#),
    );
    assert_eq!(r.status, 200);
    let gaps = proxy.metric(itl);
    assert!(gaps >= 5.0, "{gaps} inter-chunk gaps");
    assert_eq!(get(proxy.addr, "/health").unwrap().status, 200);
    assert_eq!(get(proxy.addr, "/ready").unwrap().status, 200);
    let metrics = get(proxy.addr, "/metrics").unwrap();
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(
        text.contains(&format!(
            "kvmesh_build_info{{commit=\"{}\",version=\"{}\"}} 1",
            env!("KVMESH_GIT_HASH"),
            env!("CARGO_PKG_VERSION")
        )),
        "{text}"
    );
    // Created at zero for a known model, not absent: alerts see 0.
    assert!(
        text.contains("kvmesh_engine_requests_total{class=\"2xx\",engine=\"a\",model=\"alpha\"} 0"),
        "{text}"
    );
}

#[test]
fn round_robin_and_session_policies() {
    let sims: Vec<Sim> = (0..3).map(|i| Sim::instant(&format!("e{i}"))).collect();
    let refs: Vec<&Sim> = sims.iter().collect();
    let rr = Proxy::start("policy = \"round_robin\"", &refs, true);
    assert!(eventually(Duration::from_secs(5), || rr
        .metric("kvmesh_engine_healthy")
        == 3.0));
    let seen: Vec<String> = (0..6)
        .map(|_| {
            post(rr.addr, CHAT, &chat_body("sim-model", "same", ""))
                .header("x-sim-engine")
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(seen.iter().collect::<HashSet<_>>().len(), 3, "{seen:?}");
    let session = Proxy::start("policy = \"session\"", &refs, true);
    assert!(eventually(Duration::from_secs(5), || session
        .metric("kvmesh_engine_healthy")
        == 3.0));
    for user in ["alice", "bob", "carol"] {
        let engines: HashSet<String> = (0..4)
            .map(|i| {
                let body = chat_body("sim-model", &text(i, 50), &format!(r#","user":"{user}""#));
                post(session.addr, CHAT, &body)
                    .header("x-sim-engine")
                    .unwrap()
                    .to_string()
            })
            .collect();
        assert_eq!(engines.len(), 1, "{user} moved: {engines:?}");
    }
}

#[test]
fn check_config_validates_without_starting() {
    let dir = std::env::temp_dir();
    let good = dir.join(format!("kvmesh-good-{}.toml", std::process::id()));
    let bad = dir.join(format!("kvmesh-bad-{}.toml", std::process::id()));
    std::fs::write(
        &good,
        "[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:9\"\n",
    )
    .unwrap();
    std::fs::write(
        &bad,
        "policy = \"fastest\"\n[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:9\"\n",
    )
    .unwrap();
    let check = |file: &std::path::Path| {
        std::process::Command::new(bin("kvmesh-proxy"))
            .arg("check-config")
            .arg(file)
            .output()
            .unwrap()
    };
    let out = check(&good);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = check(&bad);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("fastest") && err.contains("policy"), "{err}");
    // Every problem is reported, not only the first: unknown keys (with a suggestion) and
    // mistyped values in one pass, then every out-of-range value.
    for (text, expected) in [
        (
            "lisen = \"0.0.0.0:1\"\nmax_inflight = \"many\"\n[routing]\nblok_bytes = 4\n",
            &[
                "3 unknown or mistyped keys",
                "unknown key `lisen`",
                "did you mean `listen`?",
                "`max_inflight` takes integer, not string",
                "did you mean `routing.block_bytes`?",
                "the TOML reader's first error",
                "line 1",
            ][..],
        ),
        (
            "max_inflight = 0\nlog = \"[\"\n[routing]\nblock_bytes = 0\n\
             [[engines]]\nname = \"a\"\nurl = \"ftp://x:1\"\n",
            &[
                "4 problems",
                "`max_inflight` must be > 0",
                "`routing.block_bytes` must be > 0",
                "engine \"a\"",
                "`log`",
            ][..],
        ),
    ] {
        std::fs::write(&bad, text).unwrap();
        let out = check(&bad);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        for needle in expected {
            assert!(err.contains(needle), "{needle:?} missing from: {err}");
        }
    }
    let _ = std::fs::remove_file(good);
    let _ = std::fs::remove_file(bad);
}

#[test]
fn sigterm_shuts_down_within_seconds() {
    let sim = Sim::instant("e0");
    let mut proxy = Proxy::start("", &[&sim], true);
    let pid = proxy.child.id().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let exited = eventually(Duration::from_secs(10), || {
        proxy.child.try_wait().unwrap().is_some()
    });
    assert!(exited, "still running 10 s after SIGTERM");
}

#[test]
fn every_request_gets_an_access_line_and_a_request_id() {
    let sim = Sim::instant("e0");
    let port = free_port();
    let log = std::env::temp_dir().join(format!("kvmesh-access-{}-{port}.log", std::process::id()));
    let proxy = Proxy::start_logged(
        &format!(
            "listen = \"127.0.0.1:{port}\"\nthreads = 2\nlog = \"warn,kvmesh::access=info\"\nlog_format = \"json\"\n[health]\ninterval_ms = 200\n{}",
            engines_toml(&[&sim])
        ),
        port,
        true,
        Some(&log),
    );
    let addr = proxy.addr;
    let body = chat_body("sim-model", "hello access log", "");
    let given = request(
        addr,
        "POST",
        CHAT,
        &body,
        Framing::Length,
        &[("x-request-id", "req-42")],
    )
    .unwrap();
    assert_eq!(given.status, 200);
    assert_eq!(given.header("x-request-id"), Some("req-42"));
    let fresh = post(addr, CHAT, &body);
    let fresh_id = fresh.header("x-request-id").unwrap().to_string();
    assert_eq!(fresh_id.len(), 32);
    // A refusal before routing is logged and carries an id too.
    let refused = post(addr, "/v1/nope", b"{}");
    assert_eq!(refused.status, 404);
    assert_eq!(refused.header("x-request-id").map(str::len), Some(32));
    let lines = || -> Vec<serde_json::Value> {
        std::fs::read_to_string(&log)
            .unwrap()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["target"] == "kvmesh::access")
            .collect()
    };
    let refused_id = refused.header("x-request-id").unwrap().to_string();
    // Each line is written once its request is done, a moment after the client has it.
    let wanted = ["req-42", fresh_id.as_str(), refused_id.as_str()];
    assert!(eventually(Duration::from_secs(5), || {
        let all = lines();
        wanted
            .iter()
            .all(|id| all.iter().any(|v| v["fields"]["request_id"] == *id))
    }));
    let all = lines();
    let by_id = |id: &str| {
        all.iter()
            .find(|v| v["fields"]["request_id"] == id)
            .unwrap_or_else(|| panic!("no access line for {id}: {all:?}"))
    };
    let l = &by_id("req-42")["fields"];
    assert_eq!(l["method"], "POST");
    assert_eq!(l["path"], CHAT);
    assert_eq!(l["model"], "sim-model");
    assert_eq!(l["status"], 200);
    assert_eq!(l["engine"], "e0");
    assert_eq!(l["client"], "127.0.0.1");
    assert_eq!(l["bytes_in"], body.len());
    assert!(l["ttft_ms"].as_f64().unwrap() >= 0.0);
    assert!(l["duration_ms"].as_f64().unwrap() >= l["ttft_ms"].as_f64().unwrap());
    assert!(l["cached_tokens"].is_u64());
    assert!(!l["reason"].as_str().unwrap().is_empty());
    assert_eq!(by_id(&fresh_id)["fields"]["status"], 200);
    let r = &by_id(&refused_id)["fields"];
    assert_eq!(
        (r["status"].as_u64(), r["engine"].as_str()),
        (Some(404), Some(""))
    );
    let _ = std::fs::remove_file(&log);
}

/// The common keys as flags, no configuration file: `--listen`, `--engine` (repeated),
/// `--policy`, `--log-format`; a bad value is refused naming the flag and the choices;
/// `--version` names the commit.
#[test]
fn flags_alone_run_a_gateway_and_bad_values_are_named() {
    let sims = [Sim::instant("e0"), Sim::instant("e1")];
    let port = free_port();
    let _proxy = Killed(
        std::process::Command::new(bin("kvmesh-proxy"))
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--engine", &sims[0].url(), "--engine", &sims[1].url()])
            .args(["--policy", "round_robin", "--log-format", "json"])
            .env_remove("KVMESH_CONFIG")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    assert!(eventually(Duration::from_secs(20), || get(addr, "/ready")
        .is_ok_and(|r| r.status == 200)));
    let mut served = std::collections::HashSet::new();
    for i in 0..4 {
        let r = post(
            addr,
            "/v1/chat/completions",
            &chat_body("sim-model", &format!("q{i}"), ""),
        );
        assert_eq!(r.status, 200);
        served.insert(r.header("x-kvmesh-engine").unwrap().to_string());
    }
    // Round robin over engine-0 and engine-1, the names the flags give.
    assert_eq!(
        served,
        ["engine-0", "engine-1"]
            .map(String::from)
            .into_iter()
            .collect()
    );
    let metrics = String::from_utf8(get(addr, "/metrics").unwrap().body).unwrap();
    assert!(metrics.contains("policy=\"round_robin\""), "{metrics}");

    for (flag, value, words) in [
        ("--policy", "fastest", "round_robin"),
        ("--mode", "mesh", "sidecar"),
        ("--log-format", "xml", "json"),
        ("--engine", "ftp://x", "http://"),
    ] {
        let out = std::process::Command::new(bin("kvmesh-proxy"))
            .args([flag, value])
            .args(["--engine", "http://127.0.0.1:9", "--listen", "127.0.0.1:0"])
            .env_remove("KVMESH_CONFIG")
            .env("RUST_BACKTRACE", "0")
            .output()
            .unwrap();
        assert!(!out.status.success(), "{flag} {value} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(words), "{flag} {value}: {err}");
    }
    let out = std::process::Command::new(bin("kvmesh-proxy"))
        .arg("--version")
        .output()
        .unwrap();
    let v = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        v.starts_with(&format!("kvmesh-proxy {} (", env!("CARGO_PKG_VERSION")))
            && v.trim_end().ends_with(')'),
        "{v}"
    );
}

#[test]
fn an_admin_listener_serves_the_operators_endpoints_and_can_take_them_off_the_api() {
    let sim = Sim::instant("e0");
    let admin_port = free_port();
    let admin: std::net::SocketAddr = format!("127.0.0.1:{admin_port}").parse().unwrap();
    let proxy = Proxy::start(
        &format!("[admin]\nlisten = \"{admin}\"\non_api_listener = false\n"),
        &[&sim],
        false,
    );
    assert!(
        eventually(Duration::from_secs(10), || get(admin, "/ready")
            .map(|r| r.status == 200)
            .unwrap_or(false)),
        "/ready on the admin listener"
    );
    assert_eq!(get(admin, "/health").unwrap().status, 200);
    let m = get(admin, "/metrics").unwrap();
    assert_eq!(m.status, 200);
    let text = String::from_utf8_lossy(&m.body);
    assert!(
        text.contains("kvmesh_engine_healthy{engine=\"e0\"} 1"),
        "{text}"
    );
    assert_eq!(
        get(admin, "/v1/models").unwrap().status,
        404,
        "admin port: operators only"
    );
    for path in ["/dashboard", "/dashboard/app.js", "/dashboard/status"] {
        assert_eq!(
            get(admin, path).unwrap().status,
            200,
            "{path} on the admin port"
        );
    }
    assert_eq!(get(admin, "/dashboard/nothing").unwrap().status, 404);
    // HEAD answers as GET without the body; other methods on a known path get a 405 naming
    // the two, and on an unknown one a 404.
    let (status, length, after) = head(admin, "/metrics");
    assert_eq!((status, after), (200, 0), "HEAD /metrics on the admin port");
    assert!(length.is_some_and(|n| n > 0), "{length:?}");
    let r = request(admin, "POST", "/metrics", b"", Framing::Length, &[]).unwrap();
    assert_eq!((r.status, r.header("allow")), (405, Some("GET, HEAD")));
    let r = request(admin, "DELETE", "/nothing", b"", Framing::Length, &[]).unwrap();
    assert_eq!(r.status, 404);
    // A refusal: the operators' port names its client (the API listener would not).
    assert_eq!(
        post(proxy.addr, CHAT, &chat_body("no-such-model", "x", "")).status,
        404
    );
    // (A status document is served again for a second.)
    let refusal = || get(admin, "/dashboard/status").unwrap().json()["refusals"][0].clone();
    assert!(
        eventually(Duration::from_secs(3), || {
            let r = refusal();
            r["code"] == "model_not_found" && r["client"] == "127.0.0.1"
        }),
        "{}",
        refusal()
    );
    // The API listener: metrics and readiness are gone (an OpenAI 404), the API is not, nor
    // /health, which peers probe to admit a node.
    assert_eq!(get(proxy.addr, "/health").unwrap().status, 200);
    for path in ["/metrics", "/ready", "/dashboard", "/dashboard/status"] {
        let r = get(proxy.addr, path).unwrap();
        assert_eq!(
            (r.status, r.json()["error"]["code"].as_str()),
            (404, Some("not_found")),
            "{path}"
        );
    }
    assert_eq!(get(proxy.addr, "/v1/models").unwrap().status, 200);
    let r = post(proxy.addr, CHAT, &chat_body("sim-model", "x", ""));
    assert_eq!(r.status, 200);
    // The same registry on both: the request above is counted on the admin port.
    let served = || {
        let m = get(admin, "/metrics").unwrap();
        String::from_utf8_lossy(&m.body)
            .lines()
            .filter(|l| l.starts_with("kvmesh_engine_requests_total{class=\"2xx\",engine=\"e0\""))
            .map(String::from)
            .collect::<Vec<_>>()
    };
    assert!(
        eventually(Duration::from_secs(5), || served()
            .iter()
            .any(|l| l.ends_with(" 1"))),
        "{:?}",
        served()
    );
}

#[test]
fn admin_settings_that_cannot_work_are_refused() {
    for (toml, needle) in [
        ("[admin]\non_api_listener = false\n", "needs `admin.listen`"),
        (
            "[admin]\nlisten = \"nowhere\"\n",
            "is not an IP:port address",
        ),
        ("[admin]\nlisten = \"127.0.0.1:0\"\n", "port 0"),
        // The same port as the API's, spelled another way (0.0.0.0 covers 127.0.0.1).
        (
            "listen = \"0.0.0.0:18555\"\n[admin]\nlisten = \"127.0.0.1:18555\"\n",
            "takes the port of `listen`",
        ),
        (
            "mode = \"picker\"\n[admin]\nlisten = \"127.0.0.1:18556\"\n",
            "picker.metrics_listen",
        ),
    ] {
        let (ok, err) = check_config(&format!(
            "{toml}[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:9\"\n"
        ));
        assert!(!ok && err.contains(needle), "{toml}: {err}");
    }
}
