//! Hot reload of the configuration file: a real proxy in front of real sim engines, its file
//! rewritten under load (SIGHUP, and the file watch alone), engines added and removed, a bad
//! file refused while the old configuration keeps serving, keys that need a restart named.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;

const CHAT: &str = "/v1/chat/completions";

/// The proxy's configuration: `policy`, `engines`, `extra` top-level keys; reloads checked
/// every second.
fn conf(port: u16, policy: &str, log: &str, engines: &[&Sim], extra: &str) -> String {
    format!(
        "listen = \"127.0.0.1:{port}\"\nthreads = 2\nlog = \"{log}\"\npolicy = \"{policy}\"\n\
         config_reload_interval_secs = 1\n{extra}\n[health]\ninterval_ms = 200\n\n{}",
        engines_toml(engines)
    )
}

/// Replaces the file whole (a rename), as a config-management tool or a ConfigMap does: the
/// watcher never reads half a file.
fn rewrite(p: &Proxy, toml: &str) {
    replace_file(&p.config, toml);
}

fn replace_file(path: &std::path::Path, toml: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, toml).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// The engine that served one request (200 only).
fn served_by(p: &Proxy, n: u64) -> Option<String> {
    let body = chat_body("sim-model", &text(n, 64), r#","max_tokens":2"#);
    let r = request(p.addr, "POST", CHAT, &body, Framing::Length, &[]).ok()?;
    (r.status == 200).then(|| r.header("x-kvmesh-engine").map(String::from))?
}

/// Clients looping on chat requests until stopped: per-engine successes (with when each
/// request started) and failures.
struct Load {
    stop: Arc<AtomicBool>,
    failed: Arc<AtomicU64>,
    served: Arc<Mutex<HashMap<String, Vec<Instant>>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Load {
    fn start(addr: std::net::SocketAddr, clients: u64) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let failed = Arc::new(AtomicU64::new(0));
        let served: Arc<Mutex<HashMap<String, Vec<Instant>>>> = Arc::default();
        let threads = (0..clients)
            .map(|c| {
                let (stop, failed, served) = (stop.clone(), failed.clone(), served.clone());
                std::thread::spawn(move || {
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        i += 1;
                        let body =
                            chat_body("sim-model", &text(c << 32 | i, 64), r#","max_tokens":4"#);
                        let started = Instant::now();
                        match request(addr, "POST", CHAT, &body, Framing::Length, &[]) {
                            Ok(r) if r.status == 200 => {
                                let e = r.header("x-kvmesh-engine").unwrap_or("?").to_string();
                                served.lock().unwrap().entry(e).or_default().push(started);
                            }
                            Ok(r) => {
                                eprintln!(
                                    "failed during reload: {} {}",
                                    r.status,
                                    String::from_utf8_lossy(&r.body)
                                );
                                failed.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => {
                                eprintln!("failed during reload: {e}");
                                failed.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                })
            })
            .collect();
        Load {
            stop,
            failed,
            served,
            threads,
        }
    }

    fn served(&self, engine: &str) -> usize {
        self.served.lock().unwrap().get(engine).map_or(0, Vec::len)
    }

    /// Requests `engine` served that started after `t`.
    fn served_since(&self, engine: &str, t: Instant) -> usize {
        self.served
            .lock()
            .unwrap()
            .get(engine)
            .map_or(0, |v| v.iter().filter(|s| **s > t).count())
    }

    /// Stops the clients; (successes, failures).
    fn finish(self) -> (u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            t.join().unwrap();
        }
        let ok = self
            .served
            .lock()
            .unwrap()
            .values()
            .map(|v| v.len() as u64)
            .sum();
        (ok, self.failed.load(Ordering::Relaxed))
    }
}

/// Engines added, removed and replaced, the policy and the log filter changed, a bad file
/// refused and a restart-only key named, all while four clients keep sending: not one request
/// fails.
#[test]
fn reload_under_load_changes_engines_and_knobs_without_failing_a_request() {
    let a = Sim::start("a", &[]);
    let b = Sim::start("b", &[]);
    let port = free_port();
    let log = std::env::temp_dir().join(format!("kvmesh-reload-{}.log", std::process::id()));
    let p = Proxy::start_logged(
        &conf(port, "round_robin", "warn", &[&a], ""),
        port,
        true,
        Some(&log),
    );
    let reloads = |outcome: &str| {
        p.metric(&format!(
            "kvmesh_config_reloads_total{{outcome=\"{outcome}\"}}"
        ))
    };
    assert_eq!(reloads("applied"), 0.0);
    let load = Load::start(p.addr, 4);
    assert!(eventually(Duration::from_secs(5), || load.served("a") >= 10));

    // 1. Engine b added, by SIGHUP: it takes traffic once its first probe passes.
    rewrite(&p, &conf(port, "round_robin", "warn", &[&a, &b], ""));
    p.sighup();
    assert!(eventually(Duration::from_secs(10), || load.served("b") >= 10));
    assert_eq!(reloads("applied"), 1.0);

    // 2. Engine a removed, by the file watch alone (no signal): requests on it finish there,
    // new ones all go to b; the log filter is raised to info at the same time.
    rewrite(
        &p,
        &conf(port, "round_robin", "info,pingora_core=warn", &[&b], ""),
    );
    assert!(eventually(Duration::from_secs(10), || reloads("applied") == 2.0));
    // The reload is in force before it is counted: a request that starts after the count is
    // routed by the new engines.
    let removed_at = Instant::now();
    for n in 0..20 {
        assert_eq!(served_by(&p, 1 << 40 | n).as_deref(), Some("b"));
    }
    assert!(eventually(Duration::from_secs(5), || load
        .served_since("b", removed_at)
        >= 20));
    assert_eq!(
        load.served_since("a", removed_at),
        0,
        "a removed engine got new requests"
    );
    let exposition = String::from_utf8(get(p.addr, "/metrics").unwrap().body).unwrap();
    assert!(
        !exposition.contains("kvmesh_engine_healthy{engine=\"a\"}"),
        "a removed engine is still listed"
    );

    // 3. A bad file is refused with check-config's reason; b keeps serving.
    rewrite(
        &p,
        &format!(
            "{}\n[routing]\nuncached_weight = -1.0\n",
            conf(port, "round_robin", "info,pingora_core=warn", &[&b], "")
        ),
    );
    p.sighup();
    // (The file watch may refuse it before the signal does: counted once or twice.)
    assert!(eventually(Duration::from_secs(10), || reloads("refused") >= 1.0));
    assert_eq!(p.metric("kvmesh_config_last_reload_successful"), 0.0);
    assert_eq!(served_by(&p, 1 << 41).as_deref(), Some("b"));

    // 3b. Engines that all fail their probe (a mistyped URL) do not replace serving ones.
    let refused = reloads("refused");
    let mut gone = Sim::start("gone", &[]);
    gone.kill();
    rewrite(
        &p,
        &conf(port, "round_robin", "info,pingora_core=warn", &[&gone], ""),
    );
    p.sighup();
    assert!(eventually(Duration::from_secs(20), || reloads("refused") > refused));
    assert_eq!(served_by(&p, 1 << 44).as_deref(), Some("b"));

    // 4. A restart-only key (listen) is named and kept; the policy beside it is applied.
    let other = free_port();
    rewrite(
        &p,
        &conf(other, "least_inflight", "info,pingora_core=warn", &[&b], ""),
    );
    p.sighup();
    assert!(eventually(Duration::from_secs(10), || reloads("applied") == 3.0));
    assert_eq!(p.metric("kvmesh_config_last_reload_successful"), 1.0);
    assert_eq!(p.metric("kvmesh_config_restart_pending_keys"), 1.0);
    assert_eq!(served_by(&p, 1 << 42).as_deref(), Some("b"));
    assert!(p.metric("kvmesh_routing_decisions_total{policy=\"least_inflight\"") >= 1.0);
    assert!(std::net::TcpStream::connect(("127.0.0.1", other)).is_err());

    // 5. b replaced by c in one step: c is probed before it is put in force, so the switch
    // leaves no moment without a healthy engine.
    let c = Sim::start("c", &[]);
    rewrite(
        &p,
        &conf(port, "least_inflight", "info,pingora_core=warn", &[&c], ""),
    );
    p.sighup();
    assert!(eventually(Duration::from_secs(10), || reloads("applied") == 4.0));
    assert_eq!(served_by(&p, 1 << 43).as_deref(), Some("c"));

    let (ok, failed) = load.finish();
    eprintln!("reload under load: {ok} requests served, {failed} failed");
    assert_eq!(failed, 0, "requests failed during reloads");
    assert!(ok >= 50, "only {ok} requests");

    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(
        logged.contains("configuration reload refused")
            && logged.contains("uncached_weight")
            && logged.contains("no engine of the new `[[engines]]` passes its health probe"),
        "{logged}"
    );
    assert!(
        logged.contains("take effect only after a restart") && logged.contains("listen"),
        "{logged}"
    );
    // The raised log filter took effect: access-log lines at info appear after reload 2.
    assert!(
        logged.contains("kvmesh::access"),
        "no access log after the filter was raised"
    );
    let _ = std::fs::remove_file(&log);
}

/// Inline API keys change by reload while `[auth]` stays on: a removed key is refused at once,
/// a new one works; turning `[auth]` off is named as needing a restart and keys stay required.
#[test]
fn inline_api_keys_reload_and_turning_auth_off_waits_for_a_restart() {
    let a = Sim::instant("a");
    let port = free_port();
    let key = |name: &str, secret: &str| {
        format!(
            "[[auth.keys]]\nname = \"{name}\"\nsha256 = \"{}\"\n",
            hash_key(secret)
        )
    };
    let status = |p: &Proxy, secret: &str| {
        let auth = format!("Bearer {secret}");
        let body = chat_body("sim-model", "hello", "");
        request(
            p.addr,
            "POST",
            CHAT,
            &body,
            Framing::Length,
            &[("authorization", &auth)],
        )
        .unwrap()
        .status
    };
    let p = Proxy::start_with(
        &conf(port, "prefix", "warn", &[&a], &key("one", "sk-one")),
        port,
        true,
    );
    assert_eq!(status(&p, "sk-one"), 200);
    assert_eq!(status(&p, "sk-two"), 401);

    rewrite(
        &p,
        &conf(port, "prefix", "warn", &[&a], &key("two", "sk-two")),
    );
    p.sighup();
    assert!(eventually(Duration::from_secs(10), || status(&p, "sk-two") == 200));
    assert_eq!(status(&p, "sk-one"), 401, "a removed key still works");

    rewrite(&p, &conf(port, "prefix", "warn", &[&a], ""));
    p.sighup();
    assert!(eventually(Duration::from_secs(10), || p
        .metric("kvmesh_config_restart_pending_keys")
        == 1.0));
    assert_eq!(status(&p, "sk-two"), 200);
    assert_eq!(
        status(&p, "sk-nobody"),
        401,
        "auth was turned off by a reload"
    );
}

/// The Envoy picker reloads its engines too: after the file names b instead of a, the picker
/// picks b.
#[test]
fn the_picker_reloads_its_engines() {
    let a = Sim::instant("a");
    let b = Sim::instant("b");
    let p = Picker::start(&[&a], "config_reload_interval_secs = 1");
    let doc = chat_body("sim-model", "pick me", "");
    assert_eq!(extproc::pick_chat(p.ext_proc, &doc), a.addr.to_string());
    let toml = std::fs::read_to_string(&p.config)
        .unwrap()
        .replace(&engines_toml(&[&a]), &engines_toml(&[&b]));
    replace_file(&p.config, &toml);
    assert!(eventually(Duration::from_secs(10), || extproc::pick_chat(
        p.ext_proc, &doc
    ) == b
        .addr
        .to_string()));
    assert_eq!(
        p.metric("kvmesh_config_reloads_total{outcome=\"applied\"}"),
        1.0
    );
}
