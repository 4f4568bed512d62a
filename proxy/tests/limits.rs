//! End-to-end tests of the proxy's limits and refusals: a real `kvmesh-proxy` in front of real
//! `kvmesh-sim-engine` processes, over loopback sockets.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

const CHAT: &str = "/v1/chat/completions";

/// A listen address already in use: the proxy exits non-zero, naming it, instead of running on
/// without a listener.
#[test]
fn busy_listen_port_exits_nonzero_naming_the_address() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let (status, stderr) = run_until_exit(&format!(
        "listen = \"{addr}\"\nlog = \"info\"\n[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:9\"\n"
    ));
    assert!(!status.success(), "exit status {status}: {stderr}");
    assert!(stderr.contains(&addr.to_string()), "{stderr}");
    assert!(
        !stderr.contains("kvmesh-proxy listening"),
        "claimed to listen: {stderr}"
    );
    drop(taken);
}

#[test]
fn busy_gossip_port_exits_nonzero_naming_the_address() {
    let taken = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let gossip = taken.local_addr().unwrap();
    let (status, stderr) = run_until_exit(&format!(
        "listen = \"127.0.0.1:{}\"\nmode = \"sidecar\"\nlog = \"info\"\n\
         [cluster]\nenabled = true\ninsecure_plaintext = true\ngossip_listen = \"{gossip}\"\n\
         [[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:9\"\n",
        free_port()
    ));
    assert!(!status.success(), "exit status {status}: {stderr}");
    assert!(stderr.contains(&gossip.to_string()), "{stderr}");
    assert!(
        !stderr.contains("kvmesh-proxy listening"),
        "claimed to listen: {stderr}"
    );
    drop(taken);
}

/// Starts the proxy on `toml` and waits (bounded) for it to exit: status and stderr.
fn run_until_exit(toml: &str) -> (std::process::ExitStatus, String) {
    let config = std::env::temp_dir().join(format!(
        "kvmesh-busy-{}-{}.toml",
        std::process::id(),
        free_port()
    ));
    std::fs::write(&config, toml).unwrap();
    let mut child = Command::new(bin("kvmesh-proxy"))
        .arg("--config")
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let exited = eventually(Duration::from_secs(20), || {
        child.try_wait().unwrap().is_some()
    });
    if !exited {
        let _ = child.kill();
    }
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    let _ = std::fs::remove_file(&config);
    assert!(exited, "still running 20 s after failing to bind: {stderr}");
    (status, stderr)
}

/// Body bytes are reserved as they arrive (a buffer that at most doubles, never past the
/// declared length): while uploads that have sent most of their bodies hold the whole budget,
/// new bodies are refused with 429 JSON and `Retry-After` (concurrently too), the proxy stays
/// up, and once the uploads finish the budget is free again.
#[test]
fn body_budget_refuses_bodies_past_it_and_recovers() {
    let sim = Sim::instant("e0");
    let proxy = Proxy::start(
        "max_body_bytes = 1048576\nbody_budget_bytes = 2000000",
        &[&sim],
        true,
    );
    let body = chat_body("sim-model", &text(7, 999_000), "");
    assert!(
        (999_000..1_000_000).contains(&body.len()),
        "two fill the 2 MB budget but for a small body's bytes"
    );
    // All but the last 1000 bytes sent: each buffer has grown to its declared length.
    let sent = body.len() - 1000;
    let uploads: Vec<TcpStream> = (0..2)
        .map(|_| start_upload(proxy.addr, CHAT, &body, sent))
        .collect();
    let held = (2 * body.len()) as f64;
    assert!(
        eventually(Duration::from_secs(10), || proxy
            .metric("kvmesh_request_body_bytes")
            == held),
        "reserved {} of {held}",
        proxy.metric("kvmesh_request_body_bytes")
    );
    // The budget is full: 8 concurrent large bodies, each past it, are all refused.
    let refused: Vec<Resp> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..8)
            .map(|i| {
                let b = chat_body("sim-model", &text(100 + i, 300_000), "");
                let addr = proxy.addr;
                s.spawn(move || post(addr, CHAT, &b))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for r in &refused {
        assert_eq!(r.status, 429, "{}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.header("retry-after"), Some("1"));
        let v = r.json();
        assert_eq!(v["error"]["code"], "overloaded", "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("body_budget_bytes"),
            "{v}"
        );
    }
    assert_eq!(
        proxy.metric("kvmesh_admission_rejections_total{reason=\"body_budget\"}"),
        8.0
    );
    // A small body still fits: the budget counts bytes, not requests.
    let small = post(proxy.addr, CHAT, &chat_body("sim-model", "hi", ""));
    assert_eq!(
        small.status,
        200,
        "{}",
        String::from_utf8_lossy(&small.body)
    );
    for u in uploads {
        let r = finish_upload(u, &body, sent);
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    }
    assert!(
        eventually(Duration::from_secs(10), || proxy
            .metric("kvmesh_request_body_bytes")
            == 0.0),
        "budget not released: {}",
        proxy.metric("kvmesh_request_body_bytes")
    );
    let r = post(proxy.addr, CHAT, &body);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
}

/// `max_inflight` counts a request from admission, before its body is read: uploads in progress
/// hold their slots, so the cap is hard.
#[test]
fn max_inflight_is_a_hard_cap_counted_from_admission() {
    let sim = Sim::instant("e0");
    let proxy = Proxy::start("max_inflight = 2", &[&sim], true);
    let body = chat_body("sim-model", &text(3, 20_000), "");
    let uploads: Vec<TcpStream> = (0..2)
        .map(|_| start_upload(proxy.addr, CHAT, &body, 100))
        .collect();
    assert!(
        eventually(Duration::from_secs(10), || proxy
            .metric("kvmesh_inflight_requests")
            == 2.0),
        "admitted {}",
        proxy.metric("kvmesh_inflight_requests")
    );
    let r = post(proxy.addr, CHAT, &chat_body("sim-model", "hi", ""));
    assert_eq!(r.status, 429, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.json()["error"]["code"], "overloaded");
    for u in uploads {
        assert_eq!(finish_upload(u, &body, 100).status, 200);
    }
    assert!(eventually(Duration::from_secs(10), || proxy
        .metric("kvmesh_inflight_requests")
        == 0.0));
    assert_eq!(
        post(proxy.addr, CHAT, &chat_body("sim-model", "hi", "")).status,
        200
    );
}

/// One huge prompt records only its leading blocks (`routing.max_prefix_blocks`, default 1024),
/// so it cannot flush the engine's residency LRU: an earlier prefix still routes as a hit.
#[test]
fn a_huge_prompt_does_not_evict_earlier_prefixes() {
    let sim = Sim::instant("e0");
    let proxy = Proxy::start("[residency]\ncapacity_per_node = 2000", &[&sim], true);
    let hits =
        || proxy.metric("kvmesh_routing_decisions_total{policy=\"prefix\",reason=\"prefix_hit\"}");
    let prefix = text(11, 4096);
    let ask = |suffix: u64| {
        let content = format!("{prefix}{}", text(suffix, 200));
        let r = post(proxy.addr, CHAT, &chat_body("sim-model", &content, ""));
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    };
    ask(1);
    ask(2);
    assert_eq!(hits(), 1.0, "the prefix is indexed");
    // 1 MiB of fresh prompt: 4096 blocks of 256 bytes, twice the engine's index capacity.
    let huge = post(
        proxy.addr,
        CHAT,
        &chat_body("sim-model", &text(12, 1 << 20), ""),
    );
    assert_eq!(huge.status, 200, "{}", String::from_utf8_lossy(&huge.body));
    let held = proxy.metric("kvmesh_engine_residency_digests");
    assert!(
        held <= (1024 + 2 * 17) as f64,
        "the huge prompt recorded {held} digests"
    );
    ask(3);
    assert_eq!(hits(), 2.0, "the earlier prefix was evicted");
}

/// `body` in HTTP/1.1 chunked encoding, in chunks of `size` bytes, with the last chunk.
fn chunked_encoding(body: &[u8], size: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for c in body.chunks(size) {
        out.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
        out.extend_from_slice(c);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"0\r\n\r\n");
    out
}

fn raw_upload(addr: std::net::SocketAddr, head: &str, body: &[u8]) -> std::io::Result<Resp> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    s.write_all(head.as_bytes())?;
    s.write_all(body)?;
    s.flush()?;
    read_response(s)
}

/// A client that writes its whole over-limit body before reading gets the 413 JSON error, not a
/// connection reset: the proxy drains the rest of the body (bounded) before closing.
#[test]
fn over_limit_body_written_whole_gets_413_not_a_reset() {
    let sim = Sim::instant("e0");
    let proxy = Proxy::start("max_body_bytes = 65536", &[&sim], true);
    // 8 MiB: far more than loopback socket buffers hold, so the client is still writing when
    // the proxy refuses.
    let body = chat_body("sim-model", &text(5, 8 << 20), "");
    let head = format!(
        "POST {CHAT} HTTP/1.1\r\nHost: kvmesh.test\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let r = raw_upload(proxy.addr, &head, &body).expect("the client saw a reset");
    assert_eq!(r.status, 413, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["error"]["code"], "request_too_large");
    // Chunked: refused once past the limit, the rest drained.
    let chunked = chunked_encoding(&body, 64 * 1024);
    let head = format!(
        "POST {CHAT} HTTP/1.1\r\nHost: kvmesh.test\r\nConnection: close\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    );
    let r = raw_upload(proxy.addr, &head, &chunked).expect("the client saw a reset");
    assert_eq!(r.status, 413, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["error"]["code"], "request_too_large");
    // Refused before admission (unknown path, wrong method): a small body is drained, so the
    // client sees the error; a large one is cut off (the short drain: such refusals hold no
    // `max_inflight` slot, so they must cost little).
    let small = chat_body("sim-model", &text(6, 100_000), "");
    for (method, path, status) in [
        ("POST", "/v1/nothing", 404),
        ("GET", CHAT, 405),
        ("POST", "/v1/models", 405),
        ("DELETE", "/v1/models/sim-model", 405),
        ("POST", "/health", 405),
    ] {
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: kvmesh.test\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
            small.len()
        );
        let r = raw_upload(proxy.addr, &head, &small).expect("the client saw a reset");
        assert_eq!(r.status, status, "{}", String::from_utf8_lossy(&r.body));
    }
    let large = chat_body("sim-model", &text(7, 40 << 20), "");
    let mut s = TcpStream::connect(proxy.addr).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(30))).unwrap();
    let head = format!(
        "POST /v1/nothing HTTP/1.1\r\nHost: kvmesh.test\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
        large.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    assert!(
        s.write_all(&large).is_err(),
        "the proxy read a 40 MiB body it had refused with 404"
    );
    assert_eq!(
        post(proxy.addr, CHAT, &chat_body("sim-model", "hi", "")).status,
        200
    );
}

/// Slowloris: clients that declare large bodies and then stall or trickle hold no more of the
/// body budget than about what they have sent (a first buffer of 4 KiB), so many of them cannot
/// fill it and a normal request still gets through; each is answered 408 (OpenAI-style JSON)
/// once `body_read_timeout_secs` has passed, however it paces its bytes, and its connection is
/// closed.
/// Framed as Pingora frames it: the last transfer coding decides. `identity` then `chunked` is
/// a chunked body, served whole (reading only the first header line took it for a body of
/// Content-Length 0 and failed a 100 KB one with a 500); a last coding other than `chunked` is
/// refused (400).
#[test]
fn the_last_transfer_coding_frames_the_body() {
    let sim = Sim::instant("e0");
    let proxy = Proxy::start("", &[&sim], true);
    let ok = chat_body("sim-model", &text(8, 100_000), "");
    let ok_chunked = chunked_encoding(&ok, 16 * 1024);
    for (codings, status) in [
        (
            "Transfer-Encoding: identity\r\nTransfer-Encoding: chunked\r\n",
            200,
        ),
        (
            "Transfer-Encoding: chunked\r\nTransfer-Encoding: gzip\r\n",
            400,
        ),
    ] {
        let head = format!(
            "POST {CHAT} HTTP/1.1\r\nHost: kvmesh.test\r\nConnection: close\r\nContent-Type: application/json\r\n{codings}\r\n"
        );
        let r = raw_upload(proxy.addr, &head, &ok_chunked).expect("an answer");
        assert_eq!(
            r.status,
            status,
            "{codings}: {}",
            String::from_utf8_lossy(&r.body)
        );
        if status == 200 {
            assert_eq!(
                r.header("x-sim-body-len"),
                Some(ok.len().to_string().as_str())
            );
        }
    }
}

#[test]
fn slow_uploads_cannot_hold_the_body_budget() {
    let sim = Sim::instant("e0");
    let proxy = Proxy::start(
        "max_body_bytes = 1048576\nbody_budget_bytes = 2097152\nbody_read_timeout_secs = 8",
        &[&sim],
        true,
    );
    // Declared lengths: any two would fill the budget, were they reserved up front; and 40
    // uploads of one byte each would pass it, were each charged 64 KiB (40 x 64 KiB > 2 MiB).
    let declared = chat_body("sim-model", &text(21, 1_040_000), "");
    const STALLED: usize = 40;
    const TRICKLING: usize = 3;
    let stalled: Vec<TcpStream> = (0..STALLED)
        .map(|_| start_upload(proxy.addr, CHAT, &declared, 1))
        .collect();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let trickling: Vec<(TcpStream, std::thread::JoinHandle<()>)> = (0..TRICKLING)
        .map(|_| {
            let s = start_upload(proxy.addr, CHAT, &declared, 1);
            let mut w = s.try_clone().unwrap();
            let (stop, body) = (stop.clone(), declared.clone());
            let t = std::thread::spawn(move || {
                for b in &body[1..] {
                    std::thread::sleep(Duration::from_millis(100));
                    if stop.load(std::sync::atomic::Ordering::Relaxed)
                        || w.write_all(std::slice::from_ref(b)).is_err()
                    {
                        break;
                    }
                }
            });
            (s, t)
        })
        .collect();
    let n = STALLED + TRICKLING;
    // Every upload admitted and its first bytes charged: 4 KiB each (the trickling ones send
    // far fewer bytes than that before their deadline).
    let want = (n * 4096) as f64;
    assert!(
        eventually(Duration::from_secs(6), || proxy
            .metric("kvmesh_inflight_requests")
            == n as f64
            && proxy.metric("kvmesh_request_body_bytes") == want),
        "{} uploads admitted, holding {} bytes (want {n}, {want})",
        proxy.metric("kvmesh_inflight_requests"),
        proxy.metric("kvmesh_request_body_bytes")
    );
    assert_eq!(
        proxy.metric("kvmesh_admission_rejections_total{reason=\"body_budget\"}"),
        0.0
    );
    let normal = post(
        proxy.addr,
        CHAT,
        &chat_body("sim-model", &text(22, 300_000), ""),
    );
    assert_eq!(
        normal.status,
        200,
        "{}",
        String::from_utf8_lossy(&normal.body)
    );
    let small = post(proxy.addr, CHAT, &chat_body("sim-model", "hi", ""));
    assert_eq!(
        small.status,
        200,
        "{}",
        String::from_utf8_lossy(&small.body)
    );
    let check_408 = |r: &Resp| {
        assert_eq!(r.status, 408, "{}", String::from_utf8_lossy(&r.body));
        let v = r.json();
        assert_eq!(v["error"]["code"], "request_timeout", "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("body_read_timeout_secs"),
            "{v}"
        );
    };
    for s in stalled {
        // Read to EOF: the proxy closes the connection after the 408.
        check_408(&read_response(s).expect("a 408, then the connection closed"));
    }
    for (mut s, t) in trickling {
        check_408(&read_framed_response(&mut s).expect("a 408"));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        t.join().unwrap();
    }
    assert_eq!(
        proxy.metric("kvmesh_admission_rejections_total{reason=\"body_timeout\"}"),
        n as f64
    );
    assert!(
        eventually(Duration::from_secs(10), || proxy
            .metric("kvmesh_inflight_requests")
            == 0.0
            && proxy.metric("kvmesh_request_body_bytes") == 0.0),
        "slots or budget not released"
    );
    assert_eq!(
        post(proxy.addr, CHAT, &chat_body("sim-model", "hi", "")).status,
        200
    );
}

/// Sends `head`, then `chunks` each as one HTTP chunk, then (when `terminate`) the last chunk.
fn chunked_upload(
    addr: std::net::SocketAddr,
    chunks: &[&[u8]],
    terminate: bool,
) -> std::io::Result<TcpStream> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut wire = format!(
        "POST {CHAT} HTTP/1.1\r\nHost: kvmesh.test\r\nConnection: close\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    .into_bytes();
    for c in chunks {
        wire.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
        wire.extend_from_slice(c);
        wire.extend_from_slice(b"\r\n");
    }
    if terminate {
        wire.extend_from_slice(b"0\r\n\r\n");
    }
    s.write_all(&wire)?;
    s.flush()?;
    Ok(s)
}

/// What follows the JSON document of a chunked body is bounded and checked: a little
/// whitespace is fine (and not forwarded), more is 413, anything else 400, and a client that
/// never sends the last chunk gets 408 at the body deadline. The engine never sees those bodies.
#[test]
fn chunked_body_after_the_json_document_is_bounded() {
    let sim = Sim::instant("e0");
    let proxy = Proxy::start("body_read_timeout_secs = 2", &[&sim], true);
    let doc = chat_body("sim-model", &text(31, 5000), "");
    let served = || proxy.metric("kvmesh_requests_total{route=\"chat\",status=\"200\"}");
    // A little whitespace after the document: served, the document forwarded as it is.
    let r = read_response(chunked_upload(proxy.addr, &[&doc, b"\r\n  \n", b" "], true).unwrap())
        .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(
        r.header("x-sim-body-len"),
        Some(doc.len().to_string().as_str())
    );
    // 256 KiB of whitespace after it: 413, the rest drained so the client sees it.
    let spaces = vec![b' '; 4096];
    let mut chunks: Vec<&[u8]> = vec![&doc];
    chunks.extend(std::iter::repeat_n(&spaces[..], 64));
    let r = read_response(chunked_upload(proxy.addr, &chunks, true).unwrap())
        .expect("the client saw a reset");
    assert_eq!(r.status, 413, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["error"]["code"], "request_too_large");
    // Not whitespace: 400.
    let r =
        read_response(chunked_upload(proxy.addr, &[&doc, b"\n", b"{\"more\":1}"], true).unwrap())
            .unwrap();
    assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
    let v = r.json();
    assert_eq!(v["error"]["code"], "invalid_request", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("after the JSON document"),
        "{v}"
    );
    // The document, then nothing more (no last chunk): 408 at the deadline.
    let r = read_response(chunked_upload(proxy.addr, &[&doc], false).unwrap())
        .expect("a 408, then the connection closed");
    assert_eq!(r.status, 408, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["error"]["code"], "request_timeout");
    assert_eq!(served(), 1.0, "the engine answered a refused body");
    assert!(eventually(Duration::from_secs(10), || proxy
        .metric("kvmesh_inflight_requests")
        == 0.0));
}

/// A refusal for overload reads little of the body before closing: a small body written whole
/// still gets its 429, a large one is cut off (the client's write fails) instead of being read
/// and thrown away; the 413 of an over-limit body still drains (the test above).
#[test]
fn overload_refusals_drain_little_before_closing() {
    let sim = Sim::instant("e0");
    let proxy = Proxy::start("max_inflight = 1", &[&sim], true);
    let held_body = chat_body("sim-model", &text(41, 20_000), "");
    let held = start_upload(proxy.addr, CHAT, &held_body, 100);
    assert!(eventually(Duration::from_secs(10), || proxy
        .metric("kvmesh_inflight_requests")
        == 1.0));
    let head = |len: usize| {
        format!(
            "POST {CHAT} HTTP/1.1\r\nHost: kvmesh.test\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {len}\r\n\r\n"
        )
    };
    let small = chat_body("sim-model", &text(42, 100_000), "");
    let r = raw_upload(proxy.addr, &head(small.len()), &small).expect("the client saw a reset");
    assert_eq!(r.status, 429, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["error"]["code"], "overloaded");
    // 40 MiB: far more than the drain and the loopback socket buffers together.
    let large = chat_body("sim-model", &text(43, 40 << 20), "");
    let mut s = TcpStream::connect(proxy.addr).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(head(large.len()).as_bytes()).unwrap();
    let written = s.write_all(&large);
    assert!(
        written.is_err(),
        "the proxy read a 40 MiB body it had refused for overload"
    );
    assert_eq!(
        proxy.metric("kvmesh_admission_rejections_total{reason=\"max_inflight\"}"),
        2.0
    );
    assert_eq!(finish_upload(held, &held_body, 100).status, 200);
}

/// A chunked body whose JSON document is complete but whose last chunk never comes takes no
/// engine: small bodies are read to their end by the proxy before any engine is chosen; for
/// bodies too large for Pingora's replay buffer the engine's load is counted only once the body
/// is complete. Each gets 408 at the body deadline (counted as `body_timeout`), and no engine
/// answers any of them.
#[test]
fn chunked_json_without_its_last_chunk_takes_no_engine() {
    let sim = Sim::instant("e0");
    let proxy = Proxy::start("body_read_timeout_secs = 3", &[&sim], true);
    let small = chat_body("sim-model", &text(51, 5000), "");
    let large = chat_body("sim-model", &text(52, 200_000), "");
    let mut pending = Vec::new();
    for _ in 0..6 {
        pending.push(chunked_upload(proxy.addr, &[&small], false).unwrap());
    }
    for _ in 0..2 {
        let pieces: Vec<&[u8]> = large.chunks(16 << 10).collect();
        pending.push(chunked_upload(proxy.addr, &pieces, false).unwrap());
    }
    // All read by the proxy (their documents are complete) ...
    let read = (6 * small.len() + 2 * large.len()) as f64;
    assert!(
        eventually(Duration::from_secs(10), || proxy
            .metric("kvmesh_request_body_bytes")
            >= read),
        "the proxy holds {} of {read} body bytes",
        proxy.metric("kvmesh_request_body_bytes")
    );
    // ... and none of them is any engine's load while its body is incomplete.
    for _ in 0..10 {
        assert_eq!(
            proxy.metric("kvmesh_engine_inflight"),
            0.0,
            "an engine was charged with a request whose body has not ended"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    for s in pending {
        let r = read_response(s).expect("a 408, then the connection closed");
        assert_eq!(r.status, 408, "{}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.json()["error"]["code"], "request_timeout");
    }
    assert_eq!(
        proxy.metric("kvmesh_admission_rejections_total{reason=\"body_timeout\"}"),
        8.0
    );
    assert_eq!(
        proxy.metric("kvmesh_requests_total{route=\"chat\",status=\"200\"}"),
        0.0,
        "an engine answered a body that never ended"
    );
    assert!(eventually(Duration::from_secs(10), || proxy
        .metric("kvmesh_inflight_requests")
        == 0.0
        && proxy.metric("kvmesh_engine_inflight") == 0.0));
    // The same bodies, ended, are served whole.
    for doc in [&small, &large] {
        let pieces: Vec<&[u8]> = doc.chunks(16 << 10).collect();
        let r = read_response(chunked_upload(proxy.addr, &pieces, true).unwrap()).unwrap();
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        assert_eq!(
            r.header("x-sim-body-len"),
            Some(doc.len().to_string().as_str())
        );
    }
}
