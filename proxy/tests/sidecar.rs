//! Sidecar mode end to end: three real `kvmesh-proxy` sidecars gossiping over UDP on loopback,
//! each beside its own `kvmesh-sim-engine`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const CHAT: &str = "/v1/chat/completions";
/// The test cluster's gossip key (tests only; real clusters make theirs with gossip-keygen).
const GOSSIP_KEY: &str = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";

struct Node {
    name: String,
    proxy: Proxy,
    gossip: u16,
    seed: u16,
    cold: String,
    extra: String,
}

fn sidecar(name: &str, engine: SocketAddr, gossip: u16, seed: u16, cold: &str) -> Node {
    sidecar_with(name, engine, gossip, seed, cold, "")
}

/// [`sidecar`] with `extra` TOML tables (before `[[engines]]`).
fn sidecar_with(
    name: &str,
    engine: SocketAddr,
    gossip: u16,
    seed: u16,
    cold: &str,
    extra: &str,
) -> Node {
    let port = free_port();
    let toml = sidecar_toml(
        name,
        "127.0.0.1",
        port,
        gossip,
        &format!("127.0.0.1:{seed}"),
        engine,
        &format!("cold_placement = \"{cold}\"\n"),
        extra,
    );
    Node {
        name: name.into(),
        proxy: Proxy::start_with(&toml, port, true),
        gossip,
        seed,
        cold: cold.into(),
        extra: extra.into(),
    }
}

impl Node {
    fn restart(&mut self, engine: SocketAddr) {
        let _ = self.proxy.child.kill();
        let _ = self.proxy.child.wait();
        let n = sidecar_with(
            &self.name,
            engine,
            self.gossip,
            self.seed,
            &self.cold,
            &self.extra,
        );
        // Keep the same listen port? Peers learn the new URL by gossip either way.
        *self = n;
    }

    fn residency_of(&self, peer: &str) -> f64 {
        self.proxy.metric(&format!(
            "kvmesh_engine_residency_digests{{engine=\"{peer}\"}}"
        ))
    }
}

fn wait_for(what: &str, secs: u64, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting: {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn sim_requests(sim: SocketAddr) -> f64 {
    let body = String::from_utf8(get(sim, "/metrics").unwrap().body).unwrap();
    body.lines()
        .filter(|l| l.starts_with("kvmesh_sim_requests_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Three sidecars a, b, c on sims; a seeds the cluster. Waits until everyone sees two peers.
fn cluster(sim_args: &[&[&str]; 3], cold: &str) -> (Vec<Sim>, Vec<Node>) {
    cluster_with(sim_args, cold, "")
}

/// [`cluster`], each sidecar with `extra` TOML tables.
fn cluster_with(sim_args: &[&[&str]; 3], cold: &str, extra: &str) -> (Vec<Sim>, Vec<Node>) {
    let names = ["a", "b", "c"];
    let sims: Vec<Sim> = names
        .iter()
        .zip(sim_args)
        .map(|(n, args)| Sim::start(&format!("engine-{n}"), args))
        .collect();
    let seed = udp_port();
    let nodes: Vec<Node> = names
        .iter()
        .zip(&sims)
        .enumerate()
        .map(|(i, (n, s))| {
            let gossip = if i == 0 { seed } else { udp_port() };
            sidecar_with(n, s.addr, gossip, seed, cold, extra)
        })
        .collect();
    // Live in gossip, then admitted (URL checked and probed) and healthy in every fleet.
    wait_for("every sidecar sees and admits 2 peers", 20, || {
        nodes.iter().all(|n| {
            n.proxy.metric("kvmesh_gossip_peers") == 2.0
                && n.proxy.metric("kvmesh_engine_healthy") == 3.0
        })
    });
    (sims, nodes)
}

#[test]
fn residency_spreads_and_a_request_goes_once_to_the_engine_holding_its_prefix() {
    let (sims, nodes) = cluster(&[&["--instant"], &["--instant"], &["--instant"]], "local");
    let (a, b, c) = (&nodes[0], &nodes[1], &nodes[2]);
    let prefix = text(1, 8000);

    // c serves a long prompt on its own engine (nothing is resident anywhere yet).
    let r = post(
        c.proxy.addr,
        CHAT,
        &chat_body("sim-model", &format!("{prefix} q1"), ""),
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-kvmesh-engine"), Some("engine-c"));
    assert_eq!(r.header("x-kvmesh-peer"), None);

    // Its residency reaches a and b by gossip.
    wait_for("a and b learn c's residency", 20, || {
        a.residency_of("c") > 0.0 && b.residency_of("c") > 0.0
    });

    // Forged gossip aimed at a: c's node record replaced by one pointing at an attacker's
    // listener, sent plaintext (as chitchat itself would accept it) and sealed with a wrong
    // key. Both are dropped before chitchat, counted, and change no routing.
    let attacker = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    attacker.set_nonblocking(true).unwrap();
    let evil = format!("http://{}", attacker.local_addr().unwrap());
    let record = format!(
        r#"{{"node_id":"c","proxy_url":"{evil}","engine_url":"{evil}","models":["sim-model"],"role":"both","kv_epoch":1,"ready":true}}"#
    );
    let c_gossip: SocketAddr = format!("127.0.0.1:{}", c.gossip).parse().unwrap();
    let forged =
        kvmesh_cluster::testing::crafted_ack_for("c", 0, c_gossip, "node", &record, 1_000_000);
    let wrong_key =
        kvmesh_cluster::Keyring::from_base64(&[kvmesh_cluster::Keyring::generate_base64()])
            .unwrap();
    let a_gossip: SocketAddr = format!("127.0.0.1:{}", a.gossip).parse().unwrap();
    let sealed_wrong =
        kvmesh_cluster::seal::Sealer::new(wrong_key, "test", c_gossip).seal(&forged, a_gossip);
    // Sealed with the cluster key, but for c (as a sniffer would capture it): refused by a.
    let right_key = kvmesh_cluster::Keyring::from_base64(&[GOSSIP_KEY]).unwrap();
    let captured_for_c =
        kvmesh_cluster::seal::Sealer::new(right_key, "test", a_gossip).seal(&forged, c_gossip);
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    udp.send_to(&forged, ("127.0.0.1", a.gossip)).unwrap();
    for f in sealed_wrong.iter().chain(&captured_for_c) {
        udp.send_to(f, ("127.0.0.1", a.gossip)).unwrap();
    }
    wait_for("a counts the forged datagrams", 10, || {
        a.proxy
            .metric("kvmesh_gossip_dropped_total{reason=\"plaintext\"}")
            >= 1.0
            && a.proxy
                .metric("kvmesh_gossip_dropped_total{reason=\"forged\"}")
                >= 1.0
            && a.proxy
                .metric("kvmesh_gossip_dropped_total{reason=\"misdirected\"}")
                >= 1.0
    });

    // The same prefix sent to a is served by c's engine, once, through c's proxy.
    let before: Vec<f64> = sims.iter().map(|s| sim_requests(s.addr)).collect();
    let r = post(
        a.proxy.addr,
        CHAT,
        &chat_body("sim-model", &format!("{prefix} q2"), ""),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.header("x-kvmesh-peer"), Some("c"));
    assert_eq!(r.header("x-kvmesh-engine"), Some("engine-c"));
    let cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    assert!(
        cached > 1000,
        "c's engine should have had the prefix cached: {cached}"
    );
    let after: Vec<f64> = sims.iter().map(|s| sim_requests(s.addr)).collect();
    assert_eq!(
        (
            after[0] - before[0],
            after[1] - before[1],
            after[2] - before[2]
        ),
        (0.0, 0.0, 1.0),
        "exactly one engine request, on c"
    );
    assert_eq!(
        a.proxy
            .metric("kvmesh_forwards_total{peer=\"c\",reason=\"prefix_saving\"}"),
        1.0
    );
    assert!(
        attacker.accept().is_err(),
        "forged gossip sent traffic to the attacker"
    );

    // Streaming through the hop: events arrive, usage included, from c's engine.
    let r = post(
        b.proxy.addr,
        CHAT,
        &chat_body("sim-model", &format!("{prefix} q3"), r#","stream":true"#),
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-kvmesh-peer"), Some("c"));
    let body = String::from_utf8(r.body).unwrap();
    assert!(
        body.contains("data: ") && body.trim_end().ends_with("data: [DONE]"),
        "{body}"
    );

    // A request carrying the hop header is served where it lands, never forwarded.
    let r = request(
        a.proxy.addr,
        "POST",
        CHAT,
        &chat_body("sim-model", &format!("{prefix} q4"), ""),
        Framing::Length,
        &[("x-kvmesh-hop", "1")],
    )
    .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-kvmesh-engine"), Some("engine-a"));
    assert_eq!(r.header("x-kvmesh-peer"), None);

    // A short unrelated prompt stays local (no peer saves enough).
    let r = post(b.proxy.addr, CHAT, &chat_body("sim-model", "hello", ""));
    assert_eq!(r.header("x-kvmesh-engine"), Some("engine-b"));

    // Bad input through a sidecar gets the gateway's errors.
    let r = post(a.proxy.addr, CHAT, b"{not json");
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["code"], "invalid_request");
}

#[test]
fn a_dead_peer_and_an_engine_restart_drop_their_residency() {
    let (mut sims, mut nodes) = cluster(
        &[
            &["--instant"],
            &["--instant"],
            &["--instant", "--kv-epoch", "1"],
        ],
        "local",
    );
    let prefix = text(2, 8000);
    let body = |q: usize| chat_body("sim-model", &format!("{prefix} q{q}"), "");
    assert_eq!(post(nodes[2].proxy.addr, CHAT, &body(0)).status, 200);
    wait_for("a learns c's residency", 20, || {
        nodes[0].residency_of("c") > 0.0
    });

    // c's proxy dies. Requests for c's prefix keep succeeding through a (failover before the
    // first byte, then c is skipped), and c's entries disappear within a bounded time.
    let _ = nodes[2].proxy.child.kill();
    let _ = nodes[2].proxy.child.wait();
    let started = Instant::now();
    for q in 1..=12 {
        let r = post(nodes[0].proxy.addr, CHAT, &body(q));
        assert_eq!(
            r.status,
            200,
            "request {q}: {}",
            String::from_utf8_lossy(&r.body)
        );
        assert_ne!(r.header("x-kvmesh-peer"), Some("c"));
    }
    let series = || String::from_utf8(get(nodes[0].proxy.addr, "/metrics").unwrap().body).unwrap();
    assert!(
        series().contains("kvmesh_forwards_total{peer=\"c\""),
        "the attempts to reach c should have been counted under c"
    );
    wait_for("a forgets c", 20, || {
        nodes[0].proxy.metric("kvmesh_gossip_peers") == 1.0 && nodes[0].residency_of("c") == 0.0
    });
    eprintln!("dead peer dropped after {:?}", started.elapsed());
    // c's per-peer series go with it (they would pile up for every peer ever seen).
    wait_for("a removes c's forward series", 10, || {
        !series().contains("peer=\"c\"")
    });

    // c comes back and serves a new prefix (a holds the old one now); a learns it.
    let c_engine = sims[2].addr;
    nodes[2].restart(c_engine);
    wait_for("c rejoins", 20, || {
        nodes[0].proxy.metric("kvmesh_gossip_peers") == 2.0
    });
    // Restarted, c pulled the cluster's state from its seed (a) in one bulk transfer rather
    // than waiting for gossip to deliver it.
    let pulled = "kvmesh_gossip_bulk_transfers_total{result=\"pulled\"}";
    wait_for("c pulls the cluster's state from a", 20, || {
        nodes[2].proxy.metric(pulled) == 1.0
    });
    assert!(
        nodes[0]
            .proxy
            .metric("kvmesh_gossip_bulk_transfers_total{result=\"served\"}")
            >= 1.0
    );
    // ... and indexes what a and b hold (the 12 requests above went to one of their engines).
    wait_for("c indexes a's and b's residency", 20, || {
        let own_a = nodes[0].residency_of("engine-a");
        let own_b = nodes[1].residency_of("engine-b");
        own_a + own_b > 0.0
            && nodes[2].residency_of("a") == own_a
            && nodes[2].residency_of("b") == own_b
    });
    let fresh = chat_body("sim-model", &text(3, 8000), "");
    let r = post(nodes[2].proxy.addr, CHAT, &fresh);
    assert_eq!(r.header("x-kvmesh-engine"), Some("engine-c"));
    wait_for("a re-learns c's residency", 20, || {
        nodes[0].residency_of("c") > 0.0
    });

    // c's engine restarts with a new kv_epoch (its cache is empty): c's proxy notices, and a
    // drops everything it learnt about c, while c stays a live peer.
    sims[2].kill();
    let mut restarted = Command::new(bin("kvmesh-sim-engine"))
        .args([
            "--listen",
            &c_engine.to_string(),
            "--name",
            "engine-c",
            "--instant",
            "--kv-epoch",
            "2",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    wait_for("a drops c's stale entries", 20, || {
        nodes[0].residency_of("c") == 0.0
    });
    assert_eq!(nodes[0].proxy.metric("kvmesh_gossip_peers"), 2.0);
    let _ = restarted.kill();
    let _ = restarted.wait();
}

#[test]
fn with_home_placement_a_new_prefix_meets_on_one_engine_before_gossip() {
    // Unbounded homes: with a load bound, a sidecar that still sees the last request's load on
    // a home (by its beacon, a few milliseconds old) rightly passes it over while the others,
    // a moment later, do not; the bound has its own tests (placement).
    let (_sims, nodes) = cluster_with(
        &[&["--instant"], &["--instant"], &["--instant"]],
        "home",
        "home_load_bound = 0\n",
    );
    // Several new prefixes, each sent at once to all three sidecars: no gossip can have spread
    // it, yet all three copies must land on the same engine (the prefix's home).
    let mut homes = std::collections::HashSet::new();
    for p in 0..6 {
        let prefix = text(100 + p, 4000);
        let engines: Vec<String> = nodes
            .iter()
            .map(|n| {
                let r = post(n.proxy.addr, CHAT, &chat_body("sim-model", &prefix, ""));
                assert_eq!(r.status, 200);
                r.header("x-kvmesh-engine").unwrap().to_string()
            })
            .collect();
        assert!(
            engines.iter().all(|e| *e == engines[0]),
            "prefix {p}: {engines:?}"
        );
        homes.insert(engines[0].clone());
    }
    assert!(
        homes.len() > 1,
        "homes should spread over engines: {homes:?}"
    );
}

// Load beacons: with gossip rounds 2 s apart, a learns that b's engine has a long prefill
// queued, and that it drained, within 1 s each, which the gossiped record alone does only by
// chance (b's publication tick, a round and a's sync tick falling within that second, about 2%
// of the time): the beacon carries it.
#[test]
fn a_peer_sees_a_sidecars_prefill_queue_by_its_load_beacons_between_gossip_rounds() {
    let sim_a = Sim::start("engine-a", &["--instant"]);
    let sim_b = Sim::start("engine-b", &["--prefill-us-per-token", "1000"]);
    let seed = udp_port();
    let start = |name: &str, gossip: u16, engine: SocketAddr| {
        let port = free_port();
        let toml = sidecar_toml(
            name,
            "127.0.0.1",
            port,
            gossip,
            &format!("127.0.0.1:{seed}"),
            engine,
            "",
            "",
        )
        .replace("gossip_interval_ms = 100", "gossip_interval_ms = 2000");
        Proxy::start_with(&toml, port, true)
    };
    let a = start("a", seed, sim_a.addr);
    let b = start("b", udp_port(), sim_b.addr);
    wait_for("a and b admit each other", 60, || {
        [&a, &b].iter().all(|p| {
            p.metric("kvmesh_gossip_peers") == 1.0 && p.metric("kvmesh_engine_healthy") == 2.0
        })
    });
    let pending_of_b = || pending_prefill(&a, "b");
    let within_a_second = |what: &str, ok: &dyn Fn() -> bool| {
        let deadline = Instant::now() + Duration::from_secs(1);
        while !ok() {
            assert!(Instant::now() < deadline, "not within 1 s: {what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    assert_eq!(pending_of_b(), 0.0);
    let b_addr = b.addr;
    // About 5,000 tokens: 5 s of prefill on b's engine.
    let slow = std::thread::spawn(move || {
        post(
            b_addr,
            CHAT,
            &chat_body("sim-model", &text(900, 20_000), ""),
        )
        .status
    });
    wait_for("b dispatches the prompt", 5, || {
        pending_prefill(&b, "engine-b") > 10_000.0
    });
    within_a_second("a sees b's queued prefill", &|| pending_of_b() > 10_000.0);
    wait_for("b's engine answers", 10, || {
        pending_prefill(&b, "engine-b") == 0.0
    });
    within_a_second("a sees b's prefill drained", &|| pending_of_b() == 0.0);
    assert_eq!(slow.join().unwrap(), 200);
    // The counters are exported once per gossip round.
    wait_for("the beacon counters", 5, || {
        a.metric("kvmesh_gossip_load_beacons_total{result=\"received\"}") > 0.0
            && b.metric("kvmesh_gossip_load_beacons_total{result=\"sent\"}") > 0.0
    });
    assert_eq!(
        a.metric("kvmesh_gossip_load_beacons_total{result=\"refused\"}"),
        0.0
    );
}

/// The pending prefill bytes `p` counts for `engine`.
fn pending_prefill(p: &Proxy, engine: &str) -> f64 {
    p.metric(&format!(
        "kvmesh_engine_pending_prefill_bytes{{engine=\"{engine}\"}}"
    ))
}

#[test]
fn sidecar_mode_without_gossip_is_refused() {
    // Sidecar mode without gossip is refused at start with a message naming the key.
    let dir = std::env::temp_dir().join(format!("kvmesh-sidecar-{}.toml", std::process::id()));
    std::fs::write(
        &dir,
        "mode = \"sidecar\"\n[[engines]]\nname = \"e\"\nurl = \"http://127.0.0.1:1\"\n",
    )
    .unwrap();
    let out = Command::new(bin("kvmesh-proxy"))
        .arg("check-config")
        .arg(&dir)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&dir);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("[cluster]"));
}

#[test]
fn a_gateway_joining_the_cluster_learns_engines_and_routes_to_them_directly() {
    let (sims, nodes) = cluster(&[&["--instant"], &["--instant"], &["--instant"]], "local");
    // A gateway with no engines of its own: not ready until gossip brings some.
    let port = free_port();
    let gossip = udp_port();
    let toml = format!(
        r#"listen = "127.0.0.1:{port}"
threads = 2
log = "warn"
[cluster]
enabled = true
cluster_id = "test"
node_id = "gw"
gossip_listen = "127.0.0.1:{gossip}"
seeds = ["127.0.0.1:{}"]
gossip_interval_ms = 100
gossip_keys = ["{GOSSIP_KEY}"]
"#,
        nodes[0].gossip
    );
    let gw = Proxy::start_with(&toml, port, false);
    wait_for("the gateway learns 3 engines", 20, || {
        gw.metric("kvmesh_engine_healthy") == 3.0
    });
    assert_eq!(get(gw.addr, "/ready").unwrap().status, 200);
    let models = get(gw.addr, "/v1/models").unwrap().json();
    assert_eq!(models["data"][0]["id"], "sim-model");

    // A prefix served through sidecar b becomes known to the gateway, which then sends the same
    // prefix straight to b's engine (no proxy hop: b's sidecar sees nothing).
    let prefix = text(7, 8000);
    let r = post(
        nodes[1].proxy.addr,
        CHAT,
        &chat_body("sim-model", &format!("{prefix} x"), ""),
    );
    assert_eq!(r.header("x-kvmesh-engine"), Some("engine-b"));
    wait_for("the gateway learns b's residency", 20, || {
        gw.metric("kvmesh_engine_residency_digests{engine=\"b\"}") > 0.0
    });
    let b_proxied_before = nodes[1]
        .proxy
        .metric("kvmesh_requests_total{route=\"chat\"");
    let before = sim_requests(sims[1].addr);
    let r = post(
        gw.addr,
        CHAT,
        &chat_body("sim-model", &format!("{prefix} y"), ""),
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-kvmesh-engine"), Some("b"));
    assert_eq!(sim_requests(sims[1].addr) - before, 1.0);
    assert_eq!(
        nodes[1]
            .proxy
            .metric("kvmesh_requests_total{route=\"chat\""),
        b_proxied_before,
        "the gateway went to b's engine directly"
    );
    // The gateway is not a routing target for the sidecars (it fronts no engine).
    for n in &nodes {
        assert_eq!(n.proxy.metric("kvmesh_engine_healthy{engine=\"gw\"}"), 0.0);
    }
}

#[test]
fn a_picker_joining_the_cluster_names_the_engine_holding_the_prefix() {
    let (sims, nodes) = cluster(&[&["--instant"], &["--instant"], &["--instant"]], "local");
    // An Envoy picker with no engines of its own learns them, and their residency, by gossip.
    let gossip = udp_port();
    let picker = Picker::start_unready(&format!(
        r#"[cluster]
enabled = true
cluster_id = "test"
node_id = "picker"
gossip_listen = "127.0.0.1:{gossip}"
seeds = ["127.0.0.1:{}"]
gossip_interval_ms = 100
gossip_keys = ["{GOSSIP_KEY}"]
"#,
        nodes[0].gossip
    ));
    wait_for("the picker learns 3 engines", 20, || {
        picker.metric("kvmesh_engine_healthy") == 3.0
    });
    let prefix = text(11, 8000);
    let r = post(
        nodes[2].proxy.addr,
        CHAT,
        &chat_body("sim-model", &format!("{prefix} x"), ""),
    );
    assert_eq!(r.header("x-kvmesh-engine"), Some("engine-c"));
    wait_for("the picker learns c's residency", 20, || {
        picker.metric("kvmesh_engine_residency_digests{engine=\"c\"}") > 0.0
    });
    // It names c's engine itself (Envoy goes there directly, not through c's sidecar).
    let doc = chat_body("sim-model", &format!("{prefix} y"), "");
    assert_eq!(
        common::extproc::pick_chat(picker.ext_proc, &doc),
        sims[2].addr.to_string()
    );
}

/// A gossip node run by the test itself (a key holder: an insider, or a buggy peer) that
/// publishes whatever node record it is given.
fn insider(
    rt: &tokio::runtime::Runtime,
    name: &str,
    seed: u16,
    record: kvmesh_cluster::NodeRecord,
) -> kvmesh_cluster::Cluster {
    let port = udp_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    rt.block_on(async {
        let cluster = kvmesh_cluster::Cluster::join(kvmesh_cluster::ClusterConfig {
            cluster_id: "test".into(),
            node_id: name.into(),
            listen: addr,
            advertise: addr,
            seeds: vec![format!("127.0.0.1:{seed}")],
            gossip_interval: Duration::from_millis(100),
            phi_threshold: 8.0,
            dead_node_grace: Duration::from_secs(60),
            security: kvmesh_cluster::GossipSecurity::sealed(
                kvmesh_cluster::Keyring::from_base64(&[GOSSIP_KEY]).unwrap(),
            ),
            max_peers: 16,
            bulk_sync: true,
            bulk_max_bytes: kvmesh_cluster::bulk::DEFAULT_MAX_BYTES,
            residency_full: kvmesh_cluster::FullPublication::default(),
        })
        .await
        .unwrap();
        cluster.publish_record(&record).await;
        cluster
    })
}

// Defect: a peer's node record became an upstream without any check. Even a key holder's
// record is used only once its URL resolves into the allowed networks (default: the address
// its gossip comes from) and answers a probe. Here one insider names a foreign host and one a
// dead port on its own address: both are refused (counted by reason), never routed to.
#[test]
fn a_peer_url_outside_its_own_address_or_not_answering_is_never_used() {
    let sim = Sim::start("engine-a", &["--instant"]);
    let seed = udp_port();
    let a = sidecar("a", sim.addr, seed, seed, "local");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let dead_port = free_port();
    let record = |name: &str, url: String| kvmesh_cluster::NodeRecord {
        node_id: name.into(),
        proxy_url: url.clone(),
        engine_url: url,
        models: vec!["sim-model".into()],
        role: "both".into(),
        kv_epoch: 1,
        ready: true,
        ..Default::default()
    };
    // 192.0.2.0/24 is TEST-NET-1: refused by the network rule before any connection.
    let foreign = insider(
        &rt,
        "foreign",
        seed,
        record("foreign", "http://192.0.2.1:8080".into()),
    );
    let dead = insider(
        &rt,
        "dead",
        seed,
        record("dead", format!("http://127.0.0.1:{dead_port}")),
    );
    wait_for("a sees both insiders and refuses their URLs", 20, || {
        a.proxy.metric("kvmesh_gossip_peers") == 2.0
            && a.proxy
                .metric("kvmesh_peer_urls_refused_total{reason=\"network\"}")
                >= 1.0
            && a.proxy
                .metric("kvmesh_peer_urls_refused_total{reason=\"probe\"}")
                >= 1.0
    });
    // Only the local engine is in the fleet; every request is served there.
    assert_eq!(a.proxy.metric("kvmesh_engine_healthy"), 1.0);
    for i in 0..4 {
        let r = post(
            a.proxy.addr,
            CHAT,
            &chat_body("sim-model", &format!("{} q{i}", text(7, 3000)), ""),
        );
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-kvmesh-engine"), Some("engine-a"));
        assert_eq!(r.header("x-kvmesh-peer"), None);
    }
    rt.block_on(async {
        foreign.shutdown().await;
        dead.shutdown().await;
    });
}

/// Chaos: the peer serving a forwarded stream is killed (SIGKILL) mid-stream. The client of
/// the forwarding sidecar sees its stream end early (status 200 sent, no `[DONE]`); that sidecar
/// counts the answer as aborted, holds nothing for it afterwards (in flight, pending prefill,
/// descriptors), and serves the same prefix again at once from a live engine.
#[test]
fn a_peer_killed_mid_stream_cuts_that_stream_only_and_leaks_nothing() {
    // c streams slowly (8 ms a token): the kill lands mid-answer.
    let (_sims, mut nodes) = cluster(&[&["--instant"], &["--instant"], &[]], "local");
    let prefix = text(4, 8000);
    let body = |q: usize, extra: &str| chat_body("sim-model", &format!("{prefix} q{q}"), extra);
    let r = post(nodes[2].proxy.addr, CHAT, &body(0, r#","max_tokens":2"#));
    assert_eq!(r.header("x-kvmesh-engine"), Some("engine-c"));
    wait_for("a learns c's residency", 20, || {
        nodes[0].residency_of("c") > 0.0
    });
    let (left, right) = nodes.split_at_mut(2);
    let (a, c) = (&left[0].proxy, &mut right[0].proxy);
    let fds = |p: &Proxy| fds(p.child.id());
    let baseline = fds(a);

    let mut s = start_request(
        a.addr,
        "POST",
        CHAT,
        &body(1, r#","stream":true,"max_tokens":400"#),
        Framing::Length,
        &[],
    )
    .unwrap();
    assert_eq!(s.status, 200);
    assert_eq!(s.header("x-kvmesh-peer"), Some("c"));
    let mut got = s.next_piece().unwrap().unwrap_or_default();
    let _ = c.child.kill();
    let _ = c.child.wait();
    // The rest of what arrives, until the proxy closes the stream (or an error ends reading).
    while let Ok(Some(piece)) = s.next_piece() {
        got.extend_from_slice(&piece);
    }
    let text = String::from_utf8_lossy(&got);
    assert!(text.contains("data: {"), "no event before the kill: {text}");
    assert!(!text.contains("[DONE]"), "the stream should have been cut");
    // Counted as aborted under c, at once (logged before the stream is closed); only if a has
    // already forgotten c are c's series gone.
    let aborted = || a.metric("kvmesh_engine_requests_total{class=\"aborted\",engine=\"c\"");
    assert!(
        eventually(Duration::from_secs(5), || aborted() == 1.0
            || a.metric("kvmesh_gossip_peers") == 1.0),
        "aborted under c: {}",
        aborted()
    );

    let settled = eventually(Duration::from_secs(10), || {
        a.metric("kvmesh_inflight_requests") == 0.0
            && a.metric("kvmesh_engine_inflight") == 0.0
            && a.metric("kvmesh_engine_pending_prefill_bytes") == 0.0
            && fds(a) <= baseline + 2
    });
    assert!(settled, "a leaked: fds {} (baseline {baseline})", fds(a));
    // The same prefix again through a: answered, not by c.
    let r = post(a.addr, CHAT, &body(2, r#","max_tokens":2"#));
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_ne!(r.header("x-kvmesh-peer"), Some("c"));
}

#[test]
fn one_trace_follows_a_request_across_the_hop_to_a_peer_sidecar() {
    use common::otlp::{child, one, traceparent, OtlpSink};
    use serde_json::json;
    const CALLER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    const CALLER_SPAN: &str = "00f067aa0ba902b7";
    let sink = OtlpSink::start(&[]);
    let otel = format!(
        "[otel]\nendpoint = \"{}\"\nexport_interval_ms = 50\ntrust_client_context = true\n",
        sink.endpoint()
    );
    let (_sims, nodes) = cluster_with(
        &[&["--instant"], &["--instant"], &["--instant"]],
        "local",
        &otel,
    );
    let (a, c) = (&nodes[0], &nodes[2]);
    let prefix = text(9, 8000);
    let r = post(
        c.proxy.addr,
        CHAT,
        &chat_body("sim-model", &format!("{prefix} q1"), ""),
    );
    assert_eq!(r.header("x-kvmesh-engine"), Some("engine-c"));
    wait_for("a learns c's residency", 20, || a.residency_of("c") > 0.0);

    let r = request(
        a.proxy.addr,
        "POST",
        CHAT,
        &chat_body("sim-model", &format!("{prefix} q2"), ""),
        Framing::Length,
        &[(
            "traceparent",
            &format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01"),
        )],
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.header("x-kvmesh-peer"), Some("c"));
    let (trace, engine_parent) = traceparent(r.header("x-sim-traceparent").unwrap());
    assert_eq!(trace, CALLER_TRACE);

    // a: request, route, attempt to c's proxy; c: request, route, attempt to its engine.
    let spans = sink.trace(CALLER_TRACE, 2);
    assert_eq!(spans.len(), 6, "{spans:#?}");
    // For the docs' sample trace (docs/observability.md).
    if let Some(path) = std::env::var_os("KVMESH_TRACE_DUMP") {
        std::fs::write(path, serde_json::to_string_pretty(&spans).unwrap()).unwrap();
    }
    let a_req = one(&spans, "kvmesh.request", Some(("kvmesh.hop", json!(false))));
    let c_req = one(&spans, "kvmesh.request", Some(("kvmesh.hop", json!(true))));
    assert_eq!(a_req["parent_span_id"], CALLER_SPAN);
    assert_eq!(
        a_req["attributes"]["kvmesh.request_id"], c_req["attributes"]["kvmesh.request_id"],
        "one request id across the hop"
    );
    let a_up = one(&spans, "kvmesh.upstream", Some(("kvmesh.peer", json!("c"))));
    assert_eq!(a_up["parent_span_id"], a_req["span_id"]);
    assert_eq!(a_up["kind"], "client");
    // The hop: c's server span is a child of a's client span.
    assert_eq!(c_req["parent_span_id"], a_up["span_id"]);
    let c_up = child(&spans, "kvmesh.upstream", c_req);
    assert_eq!(c_up["attributes"]["kvmesh.engine"], "engine-c");
    assert_eq!(
        c_up["span_id"],
        engine_parent.as_str(),
        "the engine's parent"
    );
    let a_route = child(&spans, "kvmesh.route", a_req);
    assert_eq!(
        a_route["attributes"]["kvmesh.forward_reason"],
        "prefix_saving"
    );
    assert!(
        a_route["attributes"]["kvmesh.overlap_blocks"]
            .as_i64()
            .unwrap()
            > 0
    );
    let c_route = child(&spans, "kvmesh.route", c_req);
    assert_eq!(c_route["attributes"]["kvmesh.engine"], "engine-c");
}

/// A sidecar's configuration: listening on `ip` (`port`, gossip on `gossip`), seeded by `seed`,
/// in front of `engine`, with `sidecar_keys` in its `[sidecar]` table and `extra` TOML tables.
#[allow(clippy::too_many_arguments)]
fn sidecar_toml(
    name: &str,
    ip: &str,
    port: u16,
    gossip: u16,
    seed: &str,
    engine: SocketAddr,
    sidecar_keys: &str,
    extra: &str,
) -> String {
    format!(
        r#"listen = "{ip}:{port}"
mode = "sidecar"
threads = 2
log = "warn"
[health]
interval_ms = 200
[cluster]
enabled = true
cluster_id = "test"
node_id = "{name}"
gossip_listen = "{ip}:{gossip}"
seeds = ["{seed}"]
gossip_interval_ms = 100
gossip_keys = ["{GOSSIP_KEY}"]
[sidecar]
peer_down_secs = 2
{sidecar_keys}{extra}
[[engines]]
name = "engine-{name}"
url = "http://{engine}"
"#
    )
}

/// `GET url` (or a JSON POST of `body`) from inside `ns`, by python3's urllib: the status line
/// and body, or the error.
fn from_inside(ns: &common::netns::Netns, url: &str, body: Option<&[u8]>) -> String {
    let data = match body {
        Some(b) => format!("{:?}.encode()", String::from_utf8_lossy(b)),
        None => "None".into(),
    };
    let script = format!(
        "import urllib.request\nreq = urllib.request.Request({url:?}, data={data}, headers={{'content-type': 'application/json'}})\ntry:\n r = urllib.request.urlopen(req, timeout=5)\n print(r.status, r.headers.get('x-kvmesh-engine'))\n print(r.read().decode())\nexcept Exception as e:\n print('error', e)"
    );
    let out = ns
        .command(std::path::Path::new("python3"))
        .args(["-c", &script])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// Chaos: sidecar c, in a network namespace of its own, is partitioned from a and b (the link
/// cut: gossip and HTTP alike), then the partition heals. Clients of a never see an error:
/// requests a would have forwarded to c fail over to another engine (a broken pooled
/// connection ends after `upstream.tcp_user_timeout_ms`), then go elsewhere once gossip
/// declares c dead; c keeps serving its own clients alone. Healed, c is a peer again and a
/// forwards there the prefix c's engine took while cut off. Nothing leaks in a.
#[test]
fn a_partitioned_sidecar_is_routed_around_and_taken_back_when_the_partition_heals() {
    let ns = common::netns::Netns::new();
    let host = ns.host_ip.to_string();
    let inside = ns.inside_ip.to_string();
    let sim_a = Sim::instant("engine-a");
    let sim_b = Sim::instant("engine-b");
    let sim_c = Sim::start_in(
        ns.command(&bin("kvmesh-sim-engine")),
        "engine-c",
        &["--instant"],
    );
    let (ga, gb) = (udp_port(), udp_port());
    let seed = format!("{host}:{ga}");
    let start = |name: &str, ip: &str, port: u16, gossip: u16, engine: SocketAddr, cmd| {
        // Hops from peers beyond loopback; a broken connection found within 3 s.
        let toml = sidecar_toml(
            name,
            ip,
            port,
            gossip,
            &seed,
            engine,
            "accept_hop_from = \"members\"\n",
            "[upstream]\nconnect_timeout_ms = 300\ntcp_user_timeout_ms = 3000\n",
        );
        let addr: SocketAddr = format!("{ip}:{port}").parse().unwrap();
        Proxy::start_in(cmd, &toml, addr, true, None)
    };
    let proxy_bin = bin("kvmesh-proxy");
    let a = start(
        "a",
        &host,
        free_port(),
        ga,
        sim_a.addr,
        Command::new(&proxy_bin),
    );
    let b = start(
        "b",
        &host,
        free_port(),
        gb,
        sim_b.addr,
        Command::new(&proxy_bin),
    );
    // A fresh namespace: any port is free in it.
    let c = start("c", &inside, 8080, 7946, sim_c.addr, ns.command(&proxy_bin));
    let peers = |p: &Proxy| p.metric("kvmesh_gossip_peers");
    let residency_of_c = |p: &Proxy| p.metric("kvmesh_engine_residency_digests{engine=\"c\"}");
    wait_for("every sidecar admits 2 peers", 30, || {
        [&a, &b, &c]
            .iter()
            .all(|p| peers(p) == 2.0 && p.metric("kvmesh_engine_healthy") == 3.0)
    });
    let prefix = text(11, 8000);
    let body = |q: usize| chat_body("sim-model", &format!("{prefix} q{q}"), r#","max_tokens":2"#);
    let r = post(c.addr, CHAT, &body(0));
    assert_eq!(r.header("x-kvmesh-engine"), Some("engine-c"));
    wait_for("a learns c's residency", 20, || residency_of_c(&a) > 0.0);
    let r = post(a.addr, CHAT, &body(1));
    assert_eq!(r.header("x-kvmesh-peer"), Some("c"));
    let baseline = fds(a.child.id());
    let broken_before = a.metric("kvmesh_upstream_retries_total{cause=\"proxy\"}");

    ns.set_link(false);
    // Until gossip says c is gone: every request answered, by a's own engine.
    let mut during = 0;
    let mut slowest = Duration::ZERO;
    let cut_at = Instant::now();
    let deadline = cut_at + Duration::from_secs(30);
    while peers(&a) != 1.0 || peers(&b) != 1.0 || residency_of_c(&a) != 0.0 {
        assert!(
            Instant::now() < deadline,
            "c not declared gone: peers a {} b {}, c's residency in a {}",
            peers(&a),
            peers(&b),
            residency_of_c(&a)
        );
        let sent = Instant::now();
        let r = post(a.addr, CHAT, &body(2 + during));
        slowest = slowest.max(sent.elapsed());
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        assert_ne!(r.header("x-kvmesh-engine"), Some("engine-c"));
        during += 1;
        std::thread::sleep(Duration::from_millis(100));
    }
    let gone_after = cut_at.elapsed();
    assert!(during >= 1);
    // The first went on the connection pooled since q1, and failed over once its bytes stayed
    // unacknowledged for `tcp_user_timeout_ms`; later ones found c down or gone.
    assert_eq!(
        a.metric("kvmesh_upstream_retries_total{cause=\"proxy\"}") - broken_before,
        1.0
    );
    // c, alone, sees no peer and still serves its own clients.
    wait_for("c sees no peer", 30, || {
        let m = from_inside(&ns, &format!("http://{inside}:8080/metrics"), None);
        m.starts_with("200") && metric_sum(&m, "kvmesh_gossip_peers ") == 0.0
    });
    // A prefix only c's engine will hold: taken while c was cut off.
    let alone = text(12, 8000);
    let alone_body =
        |q: usize| chat_body("sim-model", &format!("{alone} q{q}"), r#","max_tokens":2"#);
    let answer = from_inside(
        &ns,
        &format!("http://{inside}:8080{CHAT}"),
        Some(&alone_body(0)),
    );
    assert!(answer.starts_with("200 engine-c"), "{answer}");

    ns.set_link(true);
    wait_for(
        "c is a peer again, with its residency, and healthy",
        60,
        || {
            peers(&a) == 2.0
                && peers(&b) == 2.0
                && peers(&c) == 2.0
                && residency_of_c(&a) > 0.0
                && a.metric("kvmesh_engine_healthy") == 3.0
        },
    );
    let r = post(a.addr, CHAT, &alone_body(1));
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-kvmesh-peer"), Some("c"), "forwarded to c again");
    let settled = eventually(Duration::from_secs(10), || {
        a.metric("kvmesh_inflight_requests") == 0.0
            && a.metric("kvmesh_engine_inflight") == 0.0
            && a.metric("kvmesh_engine_pending_prefill_bytes") == 0.0
            && fds(a.child.id()) <= baseline + 4
    });
    assert!(
        settled,
        "a leaked: fds {} (baseline {baseline})",
        fds(a.child.id())
    );
    eprintln!(
        "partition: {during} requests through a in the {:.1} s until c was declared gone, all 200, \
         slowest {} ms; retries {:?}",
        gone_after.as_secs_f64(),
        slowest.as_millis(),
        (
            a.metric("kvmesh_upstream_retries_total{cause=\"connect\"}"),
            a.metric("kvmesh_upstream_retries_total{cause=\"proxy\"}")
        )
    );
}
