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
    let config = std::env::temp_dir().join(format!(
        "kvmesh-busy-{}-{}.toml",
        std::process::id(),
        addr.port()
    ));
    std::fs::write(
        &config,
        format!(
            "listen = \"{addr}\"\nlog = \"info\"\n[[engines]]\nname = \"a\"\nurl = \"http://127.0.0.1:9\"\n"
        ),
    )
    .unwrap();
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
    assert!(!status.success(), "exit status {status}: {stderr}");
    assert!(stderr.contains(&addr.to_string()), "{stderr}");
    assert!(
        !stderr.contains("kvmesh-proxy listening"),
        "claimed to listen: {stderr}"
    );
    drop(taken);
}

/// Body bytes are reserved from the request head on: while uploads hold the whole budget, new
/// bodies are refused with 429 JSON and `Retry-After` (concurrently too), the proxy stays up,
/// and once the uploads finish the budget is free again.
#[test]
fn body_budget_refuses_bodies_past_it_and_recovers() {
    let sim = Sim::instant("e0");
    let proxy = Proxy::start(
        "max_body_bytes = 1048576\nbody_budget_bytes = 2000000",
        &[&sim],
        true,
    );
    let body = chat_body("sim-model", &text(7, 999_900), "");
    assert!(
        body.len() <= 1_000_000,
        "two fill the 2 MB budget, and no more fits"
    );
    let uploads: Vec<TcpStream> = (0..2)
        .map(|_| start_upload(proxy.addr, CHAT, &body, 1000))
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
        let r = finish_upload(u, &body, 1000);
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
    let mut chunked = Vec::new();
    for c in body.chunks(64 * 1024) {
        chunked.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
        chunked.extend_from_slice(c);
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    let head = format!(
        "POST {CHAT} HTTP/1.1\r\nHost: kvmesh.test\r\nConnection: close\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    );
    let r = raw_upload(proxy.addr, &head, &chunked).expect("the client saw a reset");
    assert_eq!(r.status, 413, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["error"]["code"], "request_too_large");
    // Refused before reading (unknown path): the body is drained as well.
    let head = format!(
        "POST /v1/nothing HTTP/1.1\r\nHost: kvmesh.test\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let r = raw_upload(proxy.addr, &head, &body).expect("the client saw a reset");
    assert_eq!(r.status, 404, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(
        post(proxy.addr, CHAT, &chat_body("sim-model", "hi", "")).status,
        200
    );
}
