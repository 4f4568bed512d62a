//! Chaos on loopback, real proxy and sim-engine processes: an engine that stalls past the read
//! timeout, slow and vanishing SSE readers. Each case checks what the client sees, what the
//! metrics say, and that nothing leaks: requests in flight, pending prefill, open descriptors.
//! (A sidecar killed mid-stream is in sidecar.rs, beside the cluster it needs.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;

const CHAT: &str = "/v1/chat/completions";

/// Nothing is left counted once the requests are over: in flight (proxy and per engine),
/// pending prefill; and the proxy holds no more descriptors than `baseline` plus its pooled
/// upstream connections (`slack`).
fn assert_no_leaks(p: &Proxy, baseline: usize, slack: usize) {
    let settled = eventually(Duration::from_secs(10), || {
        p.metric("kvmesh_inflight_requests") == 0.0
            && p.metric("kvmesh_engine_inflight") == 0.0
            && p.metric("kvmesh_engine_pending_prefill_bytes") == 0.0
            && fds(p.child.id()) <= baseline + slack
    });
    assert!(
        settled,
        "leak: in flight {}, engine in flight {}, pending prefill {}, fds {} (baseline {baseline})",
        p.metric("kvmesh_inflight_requests"),
        p.metric("kvmesh_engine_inflight"),
        p.metric("kvmesh_engine_pending_prefill_bytes"),
        fds(p.child.id())
    );
}

/// An engine that takes 3 s per decode step, behind `upstream.read_timeout_secs = 1`: each
/// client gets a 504 `upstream_timeout` naming the knob, the refusal is counted, and nothing
/// stays in flight.
#[test]
fn an_engine_stalling_past_the_read_timeout_is_a_504_and_leaks_nothing() {
    let stalled = Sim::start("stalled", &["--decode-us-per-step", "3000000"]);
    let p = Proxy::start(
        "[upstream]\nread_timeout_secs = 1\nmax_attempts = 1",
        &[&stalled],
        true,
    );
    let baseline = fds(p.child.id());
    let clients: Vec<_> = (0..4)
        .map(|i| {
            let addr = p.addr;
            std::thread::spawn(move || {
                post(
                    addr,
                    CHAT,
                    &chat_body("sim-model", &format!("stall {i}"), r#","max_tokens":2"#),
                )
            })
        })
        .collect();
    for c in clients {
        let r = c.join().unwrap();
        assert_eq!(r.status, 504, "{}", String::from_utf8_lossy(&r.body));
        let e = r.json();
        assert_eq!(e["error"]["code"], "upstream_timeout");
        assert!(
            e["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("`upstream.read_timeout_secs`")),
            "{e}"
        );
    }
    // (Counted once each request is logged, just after its answer is sent.) Timed-out
    // connections are closed, not pooled: a leak of one per request would show.
    assert_no_leaks(&p, baseline, 2);
    assert_eq!(
        p.metric("kvmesh_requests_total{route=\"chat\",status=\"504\"}"),
        4.0
    );
    // The proxy is whole: its status lists the four refusals.
    let s = get(p.addr, "/dashboard/status").unwrap().json();
    assert_eq!(s["refusals"].as_array().unwrap().len(), 4);
}

/// A streaming client that stops reading: the proxy holds back (the engine's stream waits on
/// TCP backpressure, the proxy's memory does not grow with the stream), other clients are
/// served meanwhile, and when the reader resumes its stream arrives whole. A reader that goes
/// away mid-stream frees everything it held.
#[test]
fn a_slow_sse_reader_holds_only_its_own_stream_and_a_vanished_one_frees_it() {
    let e = Sim::instant("e");
    let p = Proxy::start("", &[&e], true);
    let baseline = fds(p.child.id());
    let rss_before = rss_kib(p.child.id());
    // 200k events of ~165 bytes: about 33 MB, far more than the sockets buffer (a few MB),
    // so a proxy that buffered it would grow well past the bound below.
    let big = chat_body(
        "sim-model",
        "tell me everything",
        r#","stream":true,"max_tokens":200000"#,
    );
    let mut slow = start_request(p.addr, "POST", CHAT, &big, Framing::Length, &[]).unwrap();
    assert_eq!(slow.status, 200);
    // It reads nothing for two seconds; others are served all the while.
    for i in 0..20 {
        let r = post(
            p.addr,
            CHAT,
            &chat_body("sim-model", &format!("meanwhile {i}"), ""),
        );
        assert_eq!(r.status, 200);
    }
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(p.metric("kvmesh_inflight_requests"), 1.0);
    let grown = rss_kib(p.child.id()).saturating_sub(rss_before);
    assert!(
        grown < 16 * 1024,
        "the proxy buffered a stream nobody read: +{grown} KiB"
    );
    // It resumes: the whole stream, in order, to [DONE].
    let mut body = Vec::new();
    while let Some(piece) = slow.next_piece().unwrap() {
        body.extend_from_slice(&piece);
    }
    let text = String::from_utf8(body).unwrap();
    let events = text.matches("data: {").count();
    assert!(events >= 200_000, "{events} events");
    assert!(text.trim_end().ends_with("data: [DONE]"));

    // A reader that vanishes mid-stream (after its first bytes): the proxy lets go of it.
    let mut gone = start_request(p.addr, "POST", CHAT, &big, Framing::Length, &[]).unwrap();
    let first = gone.next_piece().unwrap().unwrap();
    assert!(!first.is_empty());
    drop(gone);
    assert_no_leaks(&p, baseline, 2);
    assert!(
        eventually(Duration::from_secs(5), || p
            .metric("kvmesh_engine_requests_total{class=\"aborted\"")
            == 1.0
            && p.metric("kvmesh_requests_total{route=\"chat\",status=\"499\"}")
                == 1.0),
        "the vanished reader is counted as aborted (499)"
    );
    // And the engine still serves through it.
    let r = post(p.addr, CHAT, &chat_body("sim-model", "after", ""));
    assert_eq!(r.status, 200);
}
