//! Security end to end, real processes on loopback: API keys and tenant-isolated caches,
//! per-model admission, TLS on the listener (rustls; the `openai` client with a custom CA,
//! refusals, certificate rotation) and mTLS between sidecars for the hop header.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::pki::{client_config, https, https_get, Ca, Scratch, Validity};
use common::*;

const CHAT: &str = "/v1/chat/completions";

fn bearer(key: &str) -> String {
    format!("Bearer {key}")
}

fn chat_as(addr: SocketAddr, key: Option<&str>, body: &[u8]) -> Resp {
    let auth = key.map(bearer);
    let headers: Vec<(&str, &str)> = auth
        .as_deref()
        .map(|a| vec![("authorization", a)])
        .unwrap_or_default();
    request(addr, "POST", CHAT, body, Framing::Length, &headers).unwrap()
}

fn cached_tokens(r: &Resp) -> u64 {
    r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

/// The JSON access lines of `log` for request ids starting with `prefix`.
fn access_lines(log: &std::path::Path, prefix: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["target"] == "kvmesh::access")
        .filter(|v| {
            v["fields"]["request_id"]
                .as_str()
                .is_some_and(|id| id.starts_with(prefix))
        })
        .collect()
}

#[test]
fn api_keys_gate_requests_and_tenants_never_share_a_cache() {
    let sims = [Sim::instant("e0"), Sim::instant("e1")];
    let dir = Scratch::new("auth");
    let keys = [
        ("sk-acme-one", "acme-1"),
        ("sk-acme-two", "acme-2"),
        ("sk-beta", "beta"),
        ("sk-limited", "limited"),
    ];
    let key_file = dir.file(
        "keys.toml",
        &format!(
            "[[keys]]\nname = \"filed\"\nsha256 = \"{}\"\n",
            hash_key("sk-filed")
        ),
    );
    let log = dir.0.join("proxy.log");
    let port = free_port();
    let toml = format!(
        r#"listen = "127.0.0.1:{port}"
threads = 2
log = "debug"
log_format = "json"
[health]
interval_ms = 200
[auth]
key_file = "{}"
reload_interval_secs = 1
[[auth.keys]]
name = "{}"
sha256 = "{}"
tenant = "acme"
[[auth.keys]]
name = "{}"
sha256 = "{}"
tenant = "acme"
[[auth.keys]]
name = "{}"
sha256 = "{}"
[[auth.keys]]
name = "{}"
sha256 = "{}"
models = ["another-model"]
{}"#,
        key_file.display(),
        keys[0].1,
        hash_key(keys[0].0),
        keys[1].1,
        hash_key(keys[1].0),
        keys[2].1,
        hash_key(keys[2].0),
        keys[3].1,
        hash_key(keys[3].0),
        engines_toml(&[&sims[0], &sims[1]])
    );
    let proxy = Proxy::start_logged(&toml, port, true, Some(&log));
    let body = chat_body("sim-model", "hello", "");

    // No key, a malformed header, a wrong key: 401, OpenAI-style, with WWW-Authenticate.
    for (case, auth) in [
        ("none", None),
        ("not bearer", Some("Basic c2stYmV0YQ==")),
        ("wrong", Some("Bearer sk-wrong")),
    ] {
        let headers: Vec<(&str, &str)> =
            auth.map(|a| vec![("authorization", a)]).unwrap_or_default();
        let r = request(proxy.addr, "POST", CHAT, &body, Framing::Length, &headers).unwrap();
        assert_eq!(r.status, 401, "{case}");
        assert_eq!(r.json()["error"]["code"], "invalid_api_key", "{case}");
        assert_eq!(r.header("www-authenticate"), Some("Bearer"), "{case}");
    }
    // A key limited to another model: 403 naming the parameter; its /v1/models is empty.
    // The key is kvmesh's: the engine never receives it.
    let r = chat_as(proxy.addr, Some("sk-beta"), &body);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-sim-saw-authorization"), Some("no"));
    let r = chat_as(proxy.addr, Some("sk-limited"), &body);
    assert_eq!(r.status, 403, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["error"]["param"], "model");
    let models_at = |path: &str, key: Option<&str>| {
        let auth = key.map(bearer);
        let headers: Vec<(&str, &str)> = auth
            .as_deref()
            .map(|a| vec![("authorization", a)])
            .unwrap_or_default();
        request(proxy.addr, "GET", path, b"", Framing::Length, &headers).unwrap()
    };
    let models = |key: Option<&str>| models_at("/v1/models", key);
    assert_eq!(models(None).status, 401);
    assert_eq!(
        models(Some("sk-limited")).json()["data"],
        serde_json::json!([])
    );
    assert_eq!(models(Some("sk-beta")).json()["data"][0]["id"], "sim-model");
    // One model: as the list, a model the key may not use is absent.
    assert_eq!(models_at("/v1/models/sim-model", None).status, 401);
    assert_eq!(
        models_at("/v1/models/sim-model", Some("sk-beta")).json()["id"],
        "sim-model"
    );
    assert_eq!(
        models_at("/v1/models/sim-model", Some("sk-limited")).status,
        404
    );
    // Probes stay open.
    assert_eq!(get(proxy.addr, "/ready").unwrap().status, 200);

    // Tenants: acme's prompt is resident for acme's other key, never for beta.
    let prefix = text(7, 6000);
    let ask = |key: &str, id: &str, q: &str| {
        let b = chat_body("sim-model", &format!("{prefix} {q}"), "");
        let auth = bearer(key);
        request(
            proxy.addr,
            "POST",
            CHAT,
            &b,
            Framing::Length,
            &[("authorization", &auth), ("x-request-id", id)],
        )
        .unwrap()
    };
    let first = ask("sk-acme-one", "t-acme-1", "q1");
    assert_eq!(first.status, 200);
    assert_eq!(cached_tokens(&first), 0);
    let beta = ask("sk-beta", "t-beta", "q2");
    assert_eq!(beta.status, 200);
    assert_eq!(cached_tokens(&beta), 0, "beta hit acme's cache");
    // A client salt naming acme's namespace stays inside beta's own, however it is spelt
    // (escapes, null). Duplicates, which engines read differently (first, last), are refused.
    // Each case uses a prompt acme has cached first, so a leak would show as a hit.
    for extra in [
        r#","cache_salt":"x","cache\u005fsalt":"tenant/acme""#,
        r#","cache\u005fsalt":"tenant/acme","cache_salt":"tenant/acme""#,
    ] {
        let r = chat_as(
            proxy.addr,
            Some("sk-beta"),
            &chat_body("sim-model", "dup", extra),
        );
        assert_eq!(r.status, 400, "{extra}");
        let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(msg.contains("duplicate field `cache_salt`"), "{msg}");
    }
    for (i, extra) in [
        r#","cache_salt":"tenant/acme""#,
        r#","cache\u005fsalt":"tenant/acme""#,
        r#","cache_salt":null"#,
        r#","cache\u005fsalt":null"#,
    ]
    .into_iter()
    .enumerate()
    {
        let own = format!("{} case {i}", text(100 + i as u64, 6000));
        let salted = |key: &str, extra: &str| {
            chat_as(proxy.addr, Some(key), &chat_body("sim-model", &own, extra))
        };
        let acme = salted("sk-acme-one", "");
        assert_eq!(acme.status, 200);
        let again = salted("sk-acme-two", "");
        assert!(
            cached_tokens(&again) > 1000,
            "case {i}: acme's own prefix missed"
        );
        let r = salted("sk-beta", extra);
        assert_eq!(
            r.status,
            200,
            "{extra}: {}",
            String::from_utf8_lossy(&r.body)
        );
        assert_eq!(cached_tokens(&r), 0, "{extra}: beta reached acme's cache");
    }
    let second = ask("sk-acme-two", "t-acme-2", "q4");
    assert_eq!(second.status, 200);
    assert!(
        cached_tokens(&second) > 1000,
        "acme's second key missed its tenant's cache"
    );
    assert_eq!(
        second.header("x-kvmesh-engine"),
        first.header("x-kvmesh-engine"),
        "the tenant's prefix did not keep its engine"
    );
    // The routing side: the index predicted nothing for beta, acme's prefix for acme.
    assert!(eventually(Duration::from_secs(5), || access_lines(
        &log, "t-"
    )
    .len()
        == 3));
    let lines = access_lines(&log, "t-");
    let overlap = |id: &str| {
        lines
            .iter()
            .find(|v| v["fields"]["request_id"] == id)
            .map(|v| v["fields"]["overlap_blocks"].as_u64().unwrap())
            .unwrap()
    };
    assert_eq!(overlap("t-beta"), 0);
    assert!(overlap("t-acme-2") > 0);
    assert_eq!(
        lines
            .iter()
            .find(|v| v["fields"]["request_id"] == "t-beta")
            .unwrap()["fields"]["key"],
        "beta"
    );

    // The key file: its key works, then is revoked by rewriting the file (seen by polling,
    // no signal).
    assert_eq!(chat_as(proxy.addr, Some("sk-filed"), &body).status, 200);
    std::fs::write(&key_file, "").unwrap();
    assert!(eventually(Duration::from_secs(5), || chat_as(
        proxy.addr,
        Some("sk-filed"),
        &body
    )
    .status
        == 401));
    // A key file that does not parse is refused; the keys in force stay.
    std::fs::write(&key_file, "[[keys]]\nname = 5\n").unwrap();
    proxy.sighup();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(chat_as(proxy.addr, Some("sk-beta"), &body).status, 200);
    assert_eq!(
        proxy.metric("kvmesh_admission_rejections_total{reason=\"model_forbidden\"}"),
        1.0
    );
    assert!(proxy.metric("kvmesh_admission_rejections_total{reason=\"unauthenticated\"}") >= 5.0);

    // No key ever reaches the log, at debug level either.
    let all = std::fs::read_to_string(&log).unwrap();
    for (secret, _) in keys {
        assert!(!all.contains(secret), "{secret} was logged");
    }
    assert!(!all.contains("sk-filed") && !all.contains("sk-wrong"));
}

#[test]
fn a_key_at_its_in_flight_limit_gets_429_and_the_admitted_request_completes() {
    // About 1.5 s per 160-token answer: the first request is still running when the second
    // arrives.
    let sim = Sim::start("e0", &[]);
    let toml_keys = format!(
        "[[auth.keys]]\nname = \"one\"\nsha256 = \"{}\"\nmax_inflight = 1\n",
        hash_key("sk-one")
    );
    let proxy = Proxy::start(&toml_keys, &[&sim], true);
    let addr = proxy.addr;
    let slow = std::thread::spawn(move || {
        chat_as(
            addr,
            Some("sk-one"),
            &chat_body("sim-model", "slow", r#","max_tokens":160"#),
        )
    });
    assert!(eventually(Duration::from_secs(5), || proxy
        .metric("kvmesh_inflight_requests")
        >= 1.0));
    let r = chat_as(addr, Some("sk-one"), &chat_body("sim-model", "second", ""));
    assert_eq!(r.status, 429);
    assert_eq!(r.header("retry-after"), Some("1"));
    let done = slow.join().unwrap();
    assert_eq!(done.status, 200);
    assert_eq!(done.json()["usage"]["completion_tokens"], 160);
    // The slot came back.
    assert_eq!(
        chat_as(addr, Some("sk-one"), &chat_body("sim-model", "third", "")).status,
        200
    );
    assert_eq!(
        proxy.metric("kvmesh_admission_rejections_total{reason=\"key_inflight\"}"),
        1.0
    );
}

#[test]
fn a_burst_past_a_models_cap_queues_then_gets_429_and_nothing_admitted_is_lost() {
    let sim = Sim::start("e0", &[]);
    let proxy = Proxy::start(
        "[admission]\nmodel_max_inflight = { \"sim-model\" = 2 }\nqueue_depth = 2\nqueue_timeout_ms = 400\n",
        &[&sim],
        true,
    );
    let addr = proxy.addr;
    let n = 12;
    // What the engine holds at once, sampled while the burst runs.
    let sampling = Arc::new(AtomicBool::new(true));
    let peak = Arc::new(AtomicU64::new(0));
    let sampler = {
        let (sampling, peak) = (sampling.clone(), peak.clone());
        std::thread::spawn(move || {
            while sampling.load(Ordering::Relaxed) {
                if let Ok(r) = get(addr, "/metrics") {
                    let now =
                        metric_sum(&String::from_utf8_lossy(&r.body), "kvmesh_engine_inflight{");
                    peak.fetch_max(now as u64, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };
    let handles: Vec<_> = (0..n)
        .map(|i| {
            std::thread::spawn(move || {
                let body = chat_body("sim-model", &format!("burst {i}"), r#","max_tokens":40"#);
                request(addr, "POST", CHAT, &body, Framing::Length, &[]).unwrap()
            })
        })
        .collect();
    let (mut ok, mut refused) = (0, 0);
    for h in handles {
        let r = h.join().unwrap();
        match r.status {
            200 => {
                ok += 1;
                // Admitted means answered in full.
                assert_eq!(r.json()["usage"]["completion_tokens"], 40);
            }
            429 => {
                refused += 1;
                assert_eq!(r.header("retry-after"), Some("1"));
                assert_eq!(r.json()["error"]["code"], "overloaded");
                let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
                assert!(msg.contains("sim-model"), "{msg}");
            }
            s => panic!(
                "unexpected status {s}: {}",
                String::from_utf8_lossy(&r.body)
            ),
        }
    }
    assert_eq!(ok + refused, n);
    assert!(ok >= 2 && refused >= 1, "ok {ok}, refused {refused}");
    let counted = proxy.metric("kvmesh_admission_rejections_total{reason=\"model_queue_full\"}")
        + proxy.metric("kvmesh_admission_rejections_total{reason=\"model_queue_timeout\"}");
    assert_eq!(counted, refused as f64);
    sampling.store(false, Ordering::Relaxed);
    sampler.join().unwrap();
    // The engine never held more than the cap at once (and did hold some).
    let peak = peak.load(Ordering::Relaxed);
    assert!((1..=2).contains(&peak), "engine in flight peaked at {peak}");
    assert_eq!(
        proxy.metric("kvmesh_requests_total{route=\"chat\",status=\"200\"}"),
        ok as f64
    );
}

/// An engine behind a proxy that lets one request of `sim-model` in at a time (30 s queue
/// wait), and a request holding that slot for `tokens` tokens (8 ms each), already on the
/// engine.
fn one_model_slot_held(tokens: u32) -> (Sim, Proxy, std::thread::JoinHandle<Resp>) {
    let sim = Sim::start("e0", &[]);
    let proxy = Proxy::start(
        "[admission]\nmodel_max_inflight = { \"sim-model\" = 1 }\nqueue_depth = 4\nqueue_timeout_ms = 30000\n",
        &[&sim],
        true,
    );
    let addr = proxy.addr;
    let slow = std::thread::spawn(move || {
        let extra = format!(r#","max_tokens":{tokens}"#);
        chat_as(addr, None, &chat_body("sim-model", "slow", &extra))
    });
    assert!(eventually(Duration::from_secs(5), || proxy
        .metric("kvmesh_engine_inflight{")
        >= 1.0));
    (sim, proxy, slow)
}

/// A client that leaves while its request waits in a model's queue takes its request out of
/// the queue then (logged as 499), not once a slot frees; it never reaches the engine. Before,
/// the request kept its place in the bounded queue until the slot freed, and only then was
/// found gone.
#[test]
fn a_request_whose_client_left_while_it_queued_never_reaches_the_engine() {
    use std::io::Write as _;
    // The model's one slot, held for ~5 s.
    let (sim, proxy, slow) = one_model_slot_held(600);
    let addr = proxy.addr;
    // A second request queues behind it; its client goes before the slot frees.
    let body = chat_body("sim-model", "left", "");
    let mut left = std::net::TcpStream::connect(addr).unwrap();
    write!(
        left,
        "POST {CHAT} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    left.write_all(&body).unwrap();
    // Long enough for the proxy to read it and queue it (a closed connection noticed while
    // its body was read would never reach the engine either, and prove nothing).
    std::thread::sleep(Duration::from_millis(500));
    drop(left);
    assert!(
        eventually(Duration::from_secs(5), || proxy
            .metric("kvmesh_requests_total{route=\"chat\",status=\"499\"}")
            == 1.0),
        "the abandoned request was not logged as 499"
    );
    assert!(
        !slow.is_finished(),
        "the abandoned request left the queue only when the slot it waited for was freed"
    );
    assert_eq!(slow.join().unwrap().status, 200);
    // The queue is first come, first served: a request queued then was forwarded before this
    // one, so once this one is answered, the engine has seen everything that got the slot.
    let after = chat_as(addr, None, &chat_body("sim-model", "after", ""));
    assert_eq!(after.status, 200);
    let body = String::from_utf8(get(sim.addr, "/metrics").unwrap().body).unwrap();
    assert_eq!(
        metric_sum(&body, "kvmesh_sim_requests_total"),
        2.0,
        "the engine served only the slow request and the one after"
    );
}

/// A chunked body is routed on its first 64 KiB, and may still have its terminating chunk on
/// the wire while the request waits in a model's queue: that wait does not watch the
/// connection for the client going (a probe there would eat the chunk's bytes and refuse the
/// request), and the request is served in full once the slot frees.
#[test]
fn a_queued_chunked_request_whose_last_chunk_comes_late_is_served() {
    use std::io::{BufRead as _, Write as _};
    let (_sim, proxy, slow) = one_model_slot_held(300);
    let addr = proxy.addr;
    // The whole document in one 80 KB chunk, past Pingora's 64 KiB replay buffer; the
    // terminating chunk only once the request has queued.
    let body = chat_body("sim-model", &"late ".repeat(16_000), "");
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "POST {CHAT} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n",
        body.len()
    )
    .unwrap();
    s.write_all(&body).unwrap();
    s.write_all(b"\r\n").unwrap();
    std::thread::sleep(Duration::from_millis(500));
    s.write_all(b"0\r\n\r\n").unwrap();
    assert_eq!(slow.join().unwrap().status, 200);
    let mut status = String::new();
    std::io::BufReader::new(s).read_line(&mut status).unwrap();
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
}

/// A TLS gateway over one instant engine, its files in `dir`.
fn tls_gateway(dir: &Scratch, sim: &Sim, ca: &Ca) -> (Proxy, PathBuf, PathBuf) {
    let (cert, key) = ca
        .leaf("proxy", &["127.0.0.1", "localhost"], &[], Validity::Now)
        .write(&dir.0, "server");
    let port = free_port();
    let toml = format!(
        "listen = \"127.0.0.1:{port}\"\nthreads = 2\nlog = \"warn\"\n[health]\ninterval_ms = 200\n[tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\nreload_interval_secs = 3600\n{}",
        cert.display(),
        key.display(),
        engines_toml(&[sim])
    );
    (Proxy::start_with(&toml, port, false), cert, key)
}

#[test]
fn tls_listener_serves_the_openai_client_refuses_bad_clients_and_rotates_without_failures() {
    let sim = Sim::instant("e0");
    let dir = Scratch::new("tls");
    let ca = Ca::new("kvmesh test CA");
    let other = Ca::new("someone else's CA");
    let (proxy, cert, key) = tls_gateway(&dir, &sim, &ca);
    let client = client_config(&ca.pem, None);
    assert!(eventually(Duration::from_secs(20), || https_get(
        proxy.addr, &client, "/ready"
    )
    .is_some_and(|r| r.status == 200)));

    // The reference client, trusting our CA.
    let ca_file = dir.file("ca.pem", &ca.pem);
    let v = openai_client(
        &format!("https://127.0.0.1:{}/v1", proxy.addr.port()),
        "stream",
        "hello over tls",
        &[("SSL_CERT_FILE", ca_file.as_path())],
    );
    assert_eq!(v["engine"], "e0", "{v}");
    assert_eq!(v["chunks"], 4, "{v}");

    // Plaintext to the TLS port gets no HTTP answer.
    assert!(
        get(proxy.addr, "/ready").map_or(true, |r| r.status == 0),
        "plaintext was served"
    );
    // A client that trusts another CA refuses the proxy.
    let e = https(
        proxy.addr,
        &client_config(&other.pem, None),
        "GET",
        "/ready",
        b"",
        &[],
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("UnknownIssuer") || e.to_string().contains("certificate"),
        "{e}"
    );

    // Rotation under load: a client loops on fresh connections while the files are replaced
    // and SIGHUP sent; no request fails and new handshakes get the new certificate.
    let before = https(proxy.addr, &client, "GET", "/ready", b"", &[])
        .unwrap()
        .1;
    let stop = Arc::new(AtomicBool::new(false));
    let (okc, failc) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let load = {
        let (stop, okc, failc, client) = (stop.clone(), okc.clone(), failc.clone(), client.clone());
        let addr = proxy.addr;
        std::thread::spawn(move || {
            let body = chat_body("sim-model", "during rotation", "");
            while !stop.load(Ordering::Relaxed) {
                match https(addr, &client, "POST", CHAT, &body, &[]) {
                    Ok((r, _)) if r.status == 200 => okc.fetch_add(1, Ordering::Relaxed),
                    _ => failc.fetch_add(1, Ordering::Relaxed),
                };
            }
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    let rotated = ca.leaf("proxy-rotated", &["127.0.0.1"], &[], Validity::Now);
    std::fs::write(&key, &rotated.key_pem).unwrap();
    std::fs::write(&cert, &rotated.cert_pem).unwrap();
    proxy.sighup();
    assert!(eventually(Duration::from_secs(5), || https(
        proxy.addr,
        &client,
        "GET",
        "/ready",
        b"",
        &[]
    )
    .is_ok_and(|(_, leaf)| leaf == rotated.der())));
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    load.join().unwrap();
    assert_ne!(before, rotated.der());
    assert_eq!(
        failc.load(Ordering::Relaxed),
        0,
        "requests failed during rotation"
    );
    assert!(okc.load(Ordering::Relaxed) >= 5);

    // An expired certificate is refused on reload: the rotated one stays in force.
    let expired = ca.leaf("proxy-expired", &["127.0.0.1"], &[], Validity::Expired);
    std::fs::write(&key, &expired.key_pem).unwrap();
    std::fs::write(&cert, &expired.cert_pem).unwrap();
    proxy.sighup();
    std::thread::sleep(Duration::from_millis(300));
    let (r, leaf) = https(proxy.addr, &client, "GET", "/ready", b"", &[]).unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(
        leaf,
        rotated.der(),
        "an expired certificate was put in force"
    );

    // check-config says why expired and not-yet-valid certificates cannot start a listener.
    for (validity, words) in [
        (Validity::Expired, "expired"),
        (Validity::NotYetValid, "not valid before"),
    ] {
        let (c, k) = ca
            .leaf("x", &["127.0.0.1"], &[], validity)
            .write(&dir.0, "bad");
        let cfg = dir.file(
            "bad.toml",
            &format!(
                "[tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\n[[engines]]\nname = \"e\"\nurl = \"http://127.0.0.1:9\"\n",
                c.display(),
                k.display()
            ),
        );
        let out = Command::new(bin("kvmesh-proxy"))
            .arg("check-config")
            .arg(&cfg)
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(words), "{words}: {err}");
    }
}

/// A TLS sidecar for the mTLS test: its node certificate, the cluster CA for clients and
/// upstreams, the hop header trusted only with a cluster certificate.
fn mtls_sidecar(
    dir: &Scratch,
    ca: &Ca,
    name: &str,
    engine: SocketAddr,
    gossip: u16,
    seed: u16,
) -> Proxy {
    let (cert, key) = ca
        .leaf(
            name,
            &["127.0.0.1"],
            &[&format!("spiffe://kvmesh.test/node/{name}")],
            Validity::Now,
        )
        .write(&dir.0, name);
    let ca_file = dir.file("cluster-ca.pem", &ca.pem);
    let port = free_port();
    let toml = format!(
        r#"listen = "127.0.0.1:{port}"
mode = "sidecar"
threads = 2
log = "warn"
[health]
interval_ms = 200
[tls]
cert_file = "{cert}"
key_file = "{key}"
client_ca_file = "{ca}"
[upstream]
ca_file = "{ca}"
client_cert_file = "{cert}"
client_key_file = "{key}"
[cluster]
enabled = true
cluster_id = "mtls"
node_id = "{name}"
gossip_listen = "127.0.0.1:{gossip}"
seeds = ["127.0.0.1:{seed}"]
gossip_interval_ms = 100
gossip_keys = ["AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8="]
[sidecar]
accept_hop_from = "cluster_cert"
peer_identity = "spiffe://kvmesh.test/"
[[engines]]
name = "engine-{name}"
url = "http://{engine}"
"#,
        cert = cert.display(),
        key = key.display(),
        ca = ca_file.display(),
    );
    Proxy::start_with(&toml, port, false)
}

fn tls_metric(addr: SocketAddr, cfg: &Arc<rustls::ClientConfig>, prefix: &str) -> f64 {
    https_get(addr, cfg, "/metrics")
        .map(|r| metric_sum(&String::from_utf8_lossy(&r.body), prefix))
        .unwrap_or(-1.0)
}

#[test]
fn sidecars_forward_over_mtls_and_only_a_cluster_certificate_may_send_the_hop_header() {
    let dir = Scratch::new("mtls");
    let ca = Ca::new("kvmesh cluster CA");
    let sims = [Sim::instant("engine-a"), Sim::instant("engine-b")];
    let seed = udp_port();
    let a = mtls_sidecar(&dir, &ca, "a", sims[0].addr, seed, seed);
    let b = mtls_sidecar(&dir, &ca, "b", sims[1].addr, udp_port(), seed);
    let client = client_config(&ca.pem, None);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !(tls_metric(a.addr, &client, "kvmesh_engine_healthy") == 2.0
        && tls_metric(b.addr, &client, "kvmesh_engine_healthy") == 2.0)
    {
        assert!(
            Instant::now() < deadline,
            "the sidecars did not admit each other over TLS"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // b serves a long prompt; its residency reaches a; a forwards the same prefix to b over
    // mTLS, and b trusts the hop (a's cluster certificate), serving it on its engine.
    let prefix = text(3, 8000);
    let (r, _) = https(a.addr, &client, "GET", "/ready", b"", &[]).unwrap();
    assert_eq!(r.status, 200);
    let (r, _) = https(
        b.addr,
        &client,
        "POST",
        CHAT,
        &chat_body("sim-model", &format!("{prefix} q1"), ""),
        &[],
    )
    .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-kvmesh-engine"), Some("engine-b"));
    let deadline = Instant::now() + Duration::from_secs(20);
    while tls_metric(
        a.addr,
        &client,
        "kvmesh_engine_residency_digests{engine=\"b\"}",
    ) <= 0.0
    {
        assert!(Instant::now() < deadline, "a did not learn b's residency");
        std::thread::sleep(Duration::from_millis(100));
    }
    let (r, _) = https(
        a.addr,
        &client,
        "POST",
        CHAT,
        &chat_body("sim-model", &format!("{prefix} q2"), ""),
        &[],
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.header("x-kvmesh-peer"), Some("b"), "not forwarded to b");
    assert_eq!(r.header("x-kvmesh-engine"), Some("engine-b"));

    // a's node certificate is rotated (files replaced, SIGHUP): its forwards present the new
    // one. Rotated to a certificate outside the cluster identity, b refuses a's hops; rotated
    // back to a member's, they pass again.
    let forward = |q: &str| {
        https(
            a.addr,
            &client,
            "POST",
            CHAT,
            &chat_body("sim-model", &format!("{prefix} {q}"), ""),
            &[],
        )
        .unwrap()
        .0
    };
    let rotate = |identity: &str| {
        let leaf = ca.leaf("a", &["127.0.0.1"], &[identity], Validity::Now);
        std::fs::write(dir.0.join("a.key"), &leaf.key_pem).unwrap();
        std::fs::write(dir.0.join("a.crt"), &leaf.cert_pem).unwrap();
        a.sighup();
    };
    rotate("spiffe://elsewhere.test/node/a");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = forward("rotated-out");
        if r.status == 403 {
            assert_eq!(r.header("x-kvmesh-peer"), Some("b"));
            break;
        }
        assert!(
            Instant::now() < deadline,
            "a still presents its old certificate: {}",
            r.status
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    rotate("spiffe://kvmesh.test/node/a2");
    let deadline = Instant::now() + Duration::from_secs(10);
    while forward("rotated-back").status != 200 {
        assert!(
            Instant::now() < deadline,
            "a's new member certificate was not presented"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // The hop header from anything but a cluster certificate with the cluster identity: 403
    // (no certificate, over loopback; a cluster-CA certificate of another trust domain), or
    // no connection at all (another CA's certificate, an expired cluster certificate).
    let hop = [("x-kvmesh-hop", "1")];
    let body = chat_body("sim-model", "hop", "");
    let (r, _) = https(b.addr, &client, "POST", CHAT, &body, &hop).unwrap();
    assert_eq!(r.status, 403, "no client certificate");
    let stranger = ca.leaf(
        "stranger",
        &["127.0.0.1"],
        &["spiffe://elsewhere.test/node/x"],
        Validity::Now,
    );
    let (r, _) = https(
        b.addr,
        &client_config(&ca.pem, Some(&stranger)),
        "POST",
        CHAT,
        &body,
        &hop,
    )
    .unwrap();
    assert_eq!(r.status, 403, "another trust domain");
    let other_ca = Ca::new("other CA");
    let impostor = other_ca.leaf(
        "a",
        &["127.0.0.1"],
        &["spiffe://kvmesh.test/node/a"],
        Validity::Now,
    );
    assert!(
        https(
            b.addr,
            &client_config(&ca.pem, Some(&impostor)),
            "POST",
            CHAT,
            &body,
            &hop
        )
        .is_err(),
        "a certificate of another CA was accepted"
    );
    let expired = ca.leaf(
        "a",
        &["127.0.0.1"],
        &["spiffe://kvmesh.test/node/a"],
        Validity::Expired,
    );
    assert!(
        https(
            b.addr,
            &client_config(&ca.pem, Some(&expired)),
            "POST",
            CHAT,
            &body,
            &hop
        )
        .is_err(),
        "an expired cluster certificate was accepted"
    );
    // A member's certificate is trusted (and the request served locally).
    let member = ca.leaf(
        "c",
        &["127.0.0.1"],
        &["spiffe://kvmesh.test/node/c"],
        Validity::Now,
    );
    let (r, _) = https(
        b.addr,
        &client_config(&ca.pem, Some(&member)),
        "POST",
        CHAT,
        &body,
        &hop,
    )
    .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-kvmesh-engine"), Some("engine-b"));
    // Two refusals above, and at least one for a's rotated-out certificate.
    assert!(
        tls_metric(
            b.addr,
            &client,
            "kvmesh_admission_rejections_total{reason=\"untrusted_hop\"}"
        ) >= 3.0
    );
}

#[test]
fn bad_security_configs_name_the_problem() {
    let dir = Scratch::new("badsec");
    let engines = "[[engines]]\nname = \"e\"\nurl = \"http://127.0.0.1:9\"\n";
    let cases = [
        ("[tls]\ncert_file = \"/nonexistent.crt\"\n", "tls.cert_file"),
        ("[tls]\ncert_file = \"/nonexistent.crt\"\nkey_file = \"/nonexistent.key\"\n", "/nonexistent.crt"),
        ("[[auth.keys]]\nname = \"a\"\nsha256 = \"sk-plaintext\"\n", "64 hexadecimal"),
        ("[auth]\nkey_file = \"/nonexistent-keys.toml\"\n", "auth.key_file"),
        ("[sidecar]\naccept_hop_from = \"cluster_cert\"\n", "tls.client_ca_file"),
        ("[admission]\nmodel_max_inflight = { m = 0 }\n", "model_max_inflight"),
        ("[upstream]\nclient_cert_file = \"/x.crt\"\n", "client_key_file"),
        (
            "mode = \"picker\"\n[[auth.keys]]\nname = \"a\"\nsha256 = \"0000000000000000000000000000000000000000000000000000000000000000\"\n",
            "picker",
        ),
    ];
    for (i, (toml, words)) in cases.iter().enumerate() {
        let cfg = dir.file(&format!("c{i}.toml"), &format!("{toml}{engines}"));
        let out = Command::new(bin("kvmesh-proxy"))
            .arg("check-config")
            .arg(&cfg)
            .output()
            .unwrap();
        assert!(!out.status.success(), "case {i} passed");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(words), "case {i}: want {words:?} in {err}");
    }
}

#[test]
fn a_deadline_the_engine_cannot_meet_is_refused_at_once() {
    // About 75 ms of prefill per long prompt: the engine's recent TTFT is well over 1 ms.
    let sim = Sim::start("e0", &[]);
    let proxy = Proxy::start("", &[&sim], true);
    let long = |i: u64| chat_body("sim-model", &text(500 + i, 6000), "");
    let with_deadline = |ms: &str, body: &[u8]| {
        request(
            proxy.addr,
            "POST",
            CHAT,
            body,
            Framing::Length,
            &[("x-kvmesh-ttft-deadline-ms", ms)],
        )
        .unwrap()
    };
    // Before any answer there is no estimate: the request is served.
    assert_eq!(with_deadline("1", &long(0)).status, 200);
    for i in 1..4 {
        assert_eq!(post(proxy.addr, CHAT, &long(i)).status, 200);
    }
    let r = with_deadline("1", &long(10));
    assert_eq!(r.status, 429, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.header("retry-after"), Some("1"));
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("deadline"));
    assert_eq!(with_deadline("600000", &long(11)).status, 200);
    let r = with_deadline("soon", &long(12));
    assert_eq!(r.status, 400);
    assert_eq!(
        proxy.metric("kvmesh_admission_rejections_total{reason=\"deadline\"}"),
        1.0
    );
    // Exported at zero from the start, like every refusal reason.
    assert!(String::from_utf8(get(proxy.addr, "/metrics").unwrap().body)
        .unwrap()
        .contains("kvmesh_admission_rejections_total{reason=\"model_queue_full\"} 0"));
}
