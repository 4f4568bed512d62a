//! OpenTelemetry traces (`[otel]`) end to end: a real gateway exporting over OTLP/gRPC to a
//! real receiver (`kvmesh-otlp-sink`), in front of simulated engines that report the
//! `traceparent` they were sent. (The trace across a sidecar hop is in sidecar.rs, the picker's
//! in envoy.rs.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::otlp::{one, traceparent, OtlpSink};
use common::*;
use serde_json::{json, Value};

const CHAT: &str = "/v1/chat/completions";
/// A caller's context: trace `0af7…319c`, its span `b7ad…3331`, sampled.
const CALLER: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
const CALLER_TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
const CALLER_SPAN: &str = "b7ad6b7169203331";

/// `[otel]` towards `sink`, following callers' contexts.
fn otel_toml(sink: &OtlpSink) -> String {
    otel_toml_with(sink, "trust_client_context = true\n")
}

fn otel_toml_with(sink: &OtlpSink, more: &str) -> String {
    format!(
        "[otel]\nendpoint = \"{}\"\nservice_name = \"gw-under-test\"\nexport_interval_ms = 50\n{more}",
        sink.endpoint()
    )
}

fn chat_with(addr: std::net::SocketAddr, prompt: &str, headers: &[(&str, &str)]) -> Resp {
    let body = chat_body("sim-model", prompt, r#","max_tokens":4"#);
    request(addr, "POST", CHAT, &body, Framing::Length, headers).unwrap()
}

fn attr<'a>(span: &'a Value, key: &str) -> &'a Value {
    &span["attributes"][key]
}

#[test]
fn a_request_is_one_trace_from_the_callers_span_through_its_route_and_attempt_to_the_engine() {
    let sink = OtlpSink::start(&[]);
    let sim = Sim::instant("e0");
    let proxy = Proxy::start(&otel_toml(&sink), &[&sim], true);
    let prompt = text(7, 4000);

    let r = chat_with(
        proxy.addr,
        &prompt,
        &[("traceparent", CALLER), ("tracestate", "vendor=1")],
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    // The caller's vendor state travels with its trace.
    assert_eq!(r.header("x-sim-tracestate"), Some("vendor=1"));
    let request_id = r.header("x-request-id").unwrap().to_string();
    // The engine was sent this trace, with a span of kvmesh's as its parent.
    let (trace, engine_parent) = traceparent(r.header("x-sim-traceparent").unwrap());
    assert_eq!(trace, CALLER_TRACE);
    assert_ne!(engine_parent, CALLER_SPAN);

    let spans = sink.trace(CALLER_TRACE, 1);
    assert_eq!(spans.len(), 3, "{spans:#?}");
    let req = one(&spans, "kvmesh.request", None);
    assert_eq!(req["kind"], "server");
    assert_eq!(req["parent_span_id"], CALLER_SPAN);
    assert_eq!(req["service"], "gw-under-test");
    assert_eq!(req["status"]["code"], 0, "unset: {req:#}");
    assert_eq!(attr(req, "http.request.method"), "POST");
    assert_eq!(attr(req, "url.path"), CHAT);
    assert_eq!(attr(req, "kvmesh.request_id"), request_id.as_str());
    assert_eq!(attr(req, "http.response.status_code"), 200);
    assert_eq!(attr(req, "gen_ai.request.model"), "sim-model");
    assert_eq!(attr(req, "kvmesh.engine"), "e0");
    assert_eq!(attr(req, "kvmesh.hop"), false);
    assert!(
        attr(req, "kvmesh.ttft_ms").as_f64().unwrap() > 0.0,
        "{req:#}"
    );
    assert!(req["start_unix_nano"].as_u64() <= req["end_unix_nano"].as_u64());

    let route = one(&spans, "kvmesh.route", None);
    assert_eq!(route["parent_span_id"], req["span_id"]);
    assert_eq!(route["kind"], "internal");
    assert_eq!(attr(route, "kvmesh.engine"), "e0");
    assert_eq!(attr(route, "kvmesh.route.policy"), "prefix");
    assert_eq!(
        attr(route, "kvmesh.route.reason"),
        attr(req, "kvmesh.route.reason")
    );
    assert_eq!(attr(route, "kvmesh.route.candidates"), 1);
    assert_eq!(attr(route, "kvmesh.overlap_blocks"), 0, "a cold prefix");
    assert!(attr(route, "kvmesh.prompt_blocks").as_i64().unwrap() > 0);

    let up = one(&spans, "kvmesh.upstream", None);
    assert_eq!(up["kind"], "client");
    assert_eq!(up["parent_span_id"], req["span_id"]);
    assert_eq!(up["span_id"], engine_parent.as_str(), "the engine's parent");
    assert_eq!(attr(up, "kvmesh.engine"), "e0");
    assert_eq!(attr(up, "server.address"), sim.addr.to_string().as_str());
    assert_eq!(attr(up, "kvmesh.attempt"), 1);
    assert_eq!(attr(up, "http.response.status_code"), 200);
    assert!(attr(up, "kvmesh.ttfb_ms").as_f64().unwrap() > 0.0, "{up:#}");
    let events: Vec<&Value> = up["events"].as_array().unwrap().iter().collect();
    let names: Vec<&str> = events.iter().map(|e| e["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["response_headers", "first_byte"]);

    // The same prefix again, without a caller's context: a new root trace, and its route
    // span shows the overlap the first request left in the index.
    let r = chat_with(proxy.addr, &format!("{prompt} again"), &[]);
    assert_eq!(r.status, 200);
    let (trace, _) = traceparent(r.header("x-sim-traceparent").unwrap());
    assert_ne!(trace, CALLER_TRACE);
    let spans = sink.trace(&trace, 1);
    let req = one(&spans, "kvmesh.request", None);
    assert_eq!(req["parent_span_id"], "", "a root span");
    let route = one(&spans, "kvmesh.route", None);
    assert!(
        attr(route, "kvmesh.overlap_blocks").as_i64().unwrap() > 0,
        "{route:#}"
    );
    assert_eq!(
        proxy.metric("kvmesh_otel_spans_total{outcome=\"failed\"}"),
        0.0
    );
    assert!(eventually(Duration::from_secs(5), || {
        proxy.metric("kvmesh_otel_spans_total{outcome=\"exported\"}") >= 6.0
    }));
    // Operators' endpoints and unknown paths are not traced: after them, a traced request
    // (the barrier: spans leave in the order they end) is all that arrives.
    for _ in 0..3 {
        assert_eq!(get(proxy.addr, "/metrics").unwrap().status, 200);
    }
    let r = request(
        proxy.addr,
        "POST",
        "/v2/nothing",
        b"{}",
        Framing::Length,
        &[],
    )
    .unwrap();
    assert_eq!(r.status, 404);
    let r = chat_with(proxy.addr, "barrier", &[]);
    let (trace, _) = traceparent(r.header("x-sim-traceparent").unwrap());
    sink.trace(&trace, 1);
    let traced: Vec<Value> = sink
        .spans()
        .into_iter()
        .filter(|s| s["name"] == "kvmesh.request")
        .map(|s| s["attributes"]["url.path"].clone())
        .collect();
    assert_eq!(traced, vec![json!(CHAT); 3], "only the three chats");
}

#[test]
fn a_failed_attempt_is_its_own_failed_span_and_a_refusal_is_traced_with_its_status() {
    let sink = OtlpSink::start(&[]);
    let (mut dead, live) = (Sim::instant("dead"), Sim::instant("live"));
    // Probes far apart: the dead engine still looks healthy when the requests come.
    let port = free_port();
    let toml = format!(
        "listen = \"127.0.0.1:{port}\"\nthreads = 2\nlog = \"error\"\npolicy = \"round_robin\"\n\
         {}[health]\ninterval_ms = 60000\n\n{}",
        otel_toml(&sink),
        engines_toml(&[&dead, &live])
    );
    let proxy = Proxy::start_with(&toml, port, true);
    // Both probed healthy first: then "dead" is a candidate until a request finds it gone.
    assert!(eventually(Duration::from_secs(10), || {
        proxy.metric("kvmesh_engine_healthy") == 2.0
    }));
    dead.kill();
    let mut failover = None;
    for i in 0..2 {
        let r = chat_with(proxy.addr, &format!("q{i}"), &[]);
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let (trace, parent) = traceparent(r.header("x-sim-traceparent").unwrap());
        // Request, route and attempt spans; a failover adds one attempt.
        if sink.trace(&trace, 1).len() == 4 {
            failover = Some((trace, parent));
        }
    }
    let (trace, parent) = failover.expect("one of two round-robin requests met the dead engine");
    let spans = sink.trace(&trace, 1);
    let failed = one(
        &spans,
        "kvmesh.upstream",
        Some(("kvmesh.attempt", json!(1))),
    );
    assert_eq!(attr(failed, "kvmesh.engine"), "dead");
    assert_eq!(failed["status"]["code"], 2, "error: {failed:#}");
    let why = failed["status"]["message"].as_str().unwrap();
    assert!(why.contains("cannot connect"), "{why}");
    let served = one(
        &spans,
        "kvmesh.upstream",
        Some(("kvmesh.attempt", json!(2))),
    );
    assert_eq!(attr(served, "kvmesh.engine"), "live");
    assert_eq!(served["span_id"], parent.as_str());
    assert_eq!(served["status"]["code"], 0);
    let req = one(&spans, "kvmesh.request", None);
    assert_eq!(attr(req, "kvmesh.engine"), "live");
    assert_eq!(req["status"]["code"], 0);

    // A refusal after routing began: the route span says why, the request span has the 404.
    let body = chat_body("no-such-model", "hi", "");
    let r = request(
        proxy.addr,
        "POST",
        CHAT,
        &body,
        Framing::Length,
        &[("traceparent", CALLER)],
    )
    .unwrap();
    assert_eq!(r.status, 404);
    let spans = sink.trace(CALLER_TRACE, 1);
    let req = one(&spans, "kvmesh.request", None);
    assert_eq!(attr(req, "http.response.status_code"), 404);
    assert_eq!(
        req["status"]["code"], 0,
        "a client error is not the server's"
    );
    let route = one(&spans, "kvmesh.route", None);
    assert_eq!(route["status"]["code"], 2);
    assert!(route["status"]["message"]
        .as_str()
        .unwrap()
        .contains("no-such-model"));
    assert!(spans.iter().all(|s| s["name"] != "kvmesh.upstream"));
}

#[test]
fn off_by_default_the_callers_context_passes_untouched_and_a_failing_collector_costs_no_request() {
    // Off: nothing traced, the caller's traceparent reaches the engine as sent.
    let sim = Sim::instant("e0");
    let plain = Proxy::start("", &[&sim], true);
    let r = chat_with(plain.addr, "hello", &[("traceparent", CALLER)]);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-sim-traceparent"), Some(CALLER));
    assert_eq!(
        plain.metric("kvmesh_otel_spans_total{outcome=\"ended\"}"),
        0.0
    );

    // A collector that refuses every export: requests are served, the loss is counted.
    let sink = OtlpSink::start(&["--refuse"]);
    let proxy = Proxy::start(&otel_toml(&sink), &[&sim], true);
    for i in 0..5 {
        let r = chat_with(proxy.addr, &format!("q{i}"), &[]);
        assert_eq!(r.status, 200);
    }
    assert!(
        eventually(Duration::from_secs(10), || {
            proxy.metric("kvmesh_otel_spans_total{outcome=\"failed\"}") >= 15.0
        }),
        "failed: {}",
        proxy.metric("kvmesh_otel_spans_total{outcome=\"failed\"}")
    );
    assert_eq!(
        proxy.metric("kvmesh_otel_spans_total{outcome=\"ended\"}"),
        15.0
    );
    assert_eq!(
        proxy.metric("kvmesh_otel_spans_total{outcome=\"exported\"}"),
        0.0
    );
    assert!(sink.spans().is_empty());

    // No collector at all: the same.
    let nobody = format!("http://127.0.0.1:{}", free_port());
    let toml = format!(
        "[otel]\nendpoint = \"{nobody}\"\nexport_interval_ms = 50\nexport_timeout_ms = 500\n"
    );
    let proxy = Proxy::start(&toml, &[&sim], true);
    let r = chat_with(proxy.addr, "q", &[]);
    assert_eq!(r.status, 200);
    assert!(eventually(Duration::from_secs(10), || {
        proxy.metric("kvmesh_otel_spans_total{outcome=\"failed\"}") >= 3.0
    }));
}

#[test]
fn check_config_names_a_bad_otel_table() {
    let (ok, err) = check_config(
        "[otel]\nendpoint = \"https://collector:4317\"\nsample_ratio = 2.0\n\n[[engines]]\nname = \"e\"\nurl = \"http://127.0.0.1:1\"\n",
    );
    assert!(!ok);
    assert!(
        err.contains("`otel.endpoint`") && err.contains("not supported yet"),
        "{err}"
    );
    assert!(err.contains("`otel.sample_ratio`"), "{err}");
}

#[test]
fn by_default_a_clients_context_is_only_a_link_and_cannot_force_sampling() {
    let sink = OtlpSink::start(&[]);
    let sim = Sim::instant("e0");
    let proxy = Proxy::start(&otel_toml_with(&sink, ""), &[&sim], true);
    let r = chat_with(
        proxy.addr,
        "hi",
        &[("traceparent", CALLER), ("tracestate", "vendor=1")],
    );
    assert_eq!(r.status, 200);
    let (trace, _) = traceparent(r.header("x-sim-traceparent").unwrap());
    assert_ne!(trace, CALLER_TRACE, "a new trace");
    assert_eq!(
        r.header("x-sim-tracestate"),
        None,
        "not the new trace's state"
    );
    let spans = sink.trace(&trace, 1);
    let req = one(&spans, "kvmesh.request", None);
    assert_eq!(req["parent_span_id"], "");
    assert_eq!(
        req["links"],
        json!([{"trace_id": CALLER_TRACE, "span_id": CALLER_SPAN}])
    );

    // sample_ratio = 0: a client saying "sampled" records nothing, and the engine is told
    // "not sampled"; malformed or oversized contexts are ignored. Every request is served.
    let proxy = Proxy::start(
        &otel_toml_with(&sink, "sample_ratio = 0.0\n"),
        &[&sim],
        true,
    );
    let huge = format!("00-{}-{CALLER_SPAN}-01", "a".repeat(4000));
    for tp in [CALLER, "00-zz-yy-01", "garbage", huge.as_str()] {
        let r = chat_with(
            proxy.addr,
            "hi",
            &[("traceparent", tp), ("tracestate", "k=v")],
        );
        assert_eq!(r.status, 200);
        let sent = r.header("x-sim-traceparent").unwrap();
        assert!(sent.ends_with("-00"), "{tp} -> {sent}");
        assert_ne!(traceparent(sent).0, CALLER_TRACE);
    }
    let r = chat_with(proxy.addr, "hi", &[]);
    assert!(r.header("x-sim-traceparent").unwrap().ends_with("-00"));
    assert_eq!(
        proxy.metric("kvmesh_otel_spans_total{outcome=\"ended\"}"),
        0.0
    );
}

#[test]
fn a_stream_the_engine_cuts_is_a_failed_request_and_a_failed_attempt() {
    let sink = OtlpSink::start(&[]);
    // 8 ms a token: the kill lands mid-answer.
    let mut sim = Sim::start("slow", &[]);
    let proxy = Proxy::start(&otel_toml(&sink), &[&sim], true);
    let body = chat_body(
        "sim-model",
        "tell me a long story",
        r#","stream":true,"max_tokens":400"#,
    );
    let mut s = start_request(
        proxy.addr,
        "POST",
        CHAT,
        &body,
        Framing::Length,
        &[("traceparent", CALLER)],
    )
    .unwrap();
    assert_eq!(s.status, 200);
    s.next_piece().unwrap();
    sim.kill();
    while let Ok(Some(_)) = s.next_piece() {}
    let spans = sink.trace(CALLER_TRACE, 1);
    let req = one(&spans, "kvmesh.request", None);
    assert_eq!(req["status"]["code"], 2, "{req:#}");
    assert_eq!(req["status"]["message"], "the engine's answer broke off");
    let up = one(&spans, "kvmesh.upstream", None);
    assert_eq!(up["status"]["code"], 2, "{up:#}");
    assert!(
        up["events"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["name"] == "first_byte"),
        "{up:#}"
    );
}
