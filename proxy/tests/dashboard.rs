//! The fleet dashboard in a real browser: headless Chromium (Debian's `chromium`, installed by
//! scripts/setup.sh) loads `/dashboard` from a real proxy in front of two sim engines after
//! traffic, runs its script, and the rendered page must show the live numbers; markup sent by a
//! client must arrive as text. `KVMESH_DASHBOARD_SCREENSHOT=path` also saves a screenshot there
//! (docs/img/dashboard.png comes from this test).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;

const CHAT: &str = "/v1/chat/completions";

/// The Chromium to drive: `KVMESH_CHROMIUM`, else `chromium` on PATH.
fn chromium() -> PathBuf {
    if let Some(p) = std::env::var_os("KVMESH_CHROMIUM") {
        return PathBuf::from(p);
    }
    let found = std::env::var_os("PATH")
        .map(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join("chromium"))
                .find(|p| p.exists())
        })
        .unwrap_or_default();
    found.expect("no `chromium` on PATH: scripts/setup.sh installs Debian's chromium")
}

/// Runs headless Chromium on `url` with `args`, letting the page's script run for a few
/// seconds of virtual time; its stdout.
fn headless(url: &str, args: &[&str], profile: &Path) -> String {
    let out = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-dev-shm-usage",
            "--virtual-time-budget=6000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(url)
        .output()
        .expect("run chromium");
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The text of the element with `id` in a serialized DOM (its `data-value` when it has one).
fn value_of(dom: &str, id: &str) -> String {
    let at = dom
        .find(&format!("id=\"{id}\""))
        .unwrap_or_else(|| panic!("no #{id} in {dom}"));
    let tag = &dom[at..at + dom[at..].find('>').unwrap()];
    let v = tag.split("data-value=\"").nth(1).unwrap();
    v[..v.find('"').unwrap()].to_string()
}

/// After traffic with shared prefixes and two refused requests (one naming a model made of
/// markup), the page shows both engines with their answers and residency, a request rate, a
/// hit ratio, TTFT percentiles and the refusals, the markup as text.
#[test]
fn the_dashboard_shows_live_numbers_in_a_real_browser() {
    let a = Sim::start("a", &[]);
    let b = Sim::start("b", &[]);
    let p = Proxy::start("policy = \"prefix\"", &[&a, &b], true);
    // Three conversations, each sent several times: long shared prefixes.
    let mut sent = 0;
    for round in 0..6 {
        for conv in 0..3u64 {
            let body = chat_body(
                "sim-model",
                &format!("{} turn {round}", text(conv, 3000)),
                r#","max_tokens":2"#,
            );
            assert_eq!(post(p.addr, CHAT, &body).status, 200);
            sent += 1;
        }
    }
    let evil = "<img src=x onerror=alert(1)>";
    let r = post(p.addr, CHAT, &chat_body(evil, "hello", ""));
    assert_eq!(r.status, 404);
    let r = post(p.addr, CHAT, b"{not json");
    assert_eq!(r.status, 400);

    // The status document itself.
    let s = get(p.addr, "/dashboard/status").unwrap();
    assert_eq!(s.status, 200);
    let s = s.json();
    let answers: u64 = s["engines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["answers_last_minute"].as_u64().unwrap())
        .sum();
    assert_eq!(answers, sent);
    assert_eq!(s["ttft_ms"]["samples"].as_u64(), Some(sent));
    assert_eq!(s["refusals"][0]["code"], "invalid_request");
    assert_eq!(s["refusals"][1]["code"], "model_not_found");
    assert_eq!(s["refusals"][1]["model"], evil);
    // On the clients' port, no client's address or request id.
    assert_eq!(s["refusals"][1]["client"], "");
    assert_eq!(s["refusals"][1]["request_id"], "");
    let page = get(p.addr, "/dashboard").unwrap();
    assert_eq!(page.status, 200);
    assert!(page
        .header("content-security-policy")
        .is_some_and(|c| c.contains("script-src 'self'")));

    // Traffic goes on while the browser loads (a slow machine could otherwise take longer
    // than the rate's 10 s window to start it).
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let more = {
        let (stop, addr) = (stop.clone(), p.addr);
        std::thread::spawn(move || {
            let body = chat_body("sim-model", &text(9, 3000), r#","max_tokens":2"#);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                assert_eq!(post(addr, CHAT, &body).status, 200);
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    // The rate counts complete seconds only, and a status document is served again for a
    // second: on a fast machine everything above fits in the proxy's first second, and a
    // browser polling at once would read a rate of 0 from that document. Wait for the first
    // complete second to be counted.
    assert!(
        eventually(Duration::from_secs(15), || {
            get(p.addr, "/dashboard/status").is_ok_and(|r| {
                r.status == 200
                    && r.json()["requests"]["per_sec"]
                        .as_f64()
                        .is_some_and(|v| v > 0.0)
            })
        }),
        "the status never showed a request rate"
    );
    let profile = std::env::temp_dir().join(format!("kvmesh-chromium-{}", std::process::id()));
    let url = format!("http://{}/dashboard", p.addr);
    let dom = headless(&url, &["--dump-dom"], &profile);
    let polls: u64 = dom
        .split("data-polls=\"")
        .nth(1)
        .and_then(|v| v.split('"').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert!(polls >= 1, "the page never read its status: {dom}");
    for engine in ["a", "b"] {
        assert!(
            dom.contains(&format!("<tr data-engine=\"{engine}\">")),
            "engine {engine} missing: {dom}"
        );
    }
    assert!(value_of(&dom, "req-rate").parse::<f64>().unwrap() > 0.0);
    assert!(value_of(&dom, "residency").parse::<u64>().unwrap() > 0);
    assert!(value_of(&dom, "hit-ratio").parse::<f64>().unwrap() > 0.0);
    assert!(value_of(&dom, "ttft").parse::<f64>().unwrap() > 0.0);
    let shown: u64 = dom
        .split("data-field=\"answers\">")
        .skip(1)
        .map(|c| c[..c.find('<').unwrap()].parse::<u64>().unwrap())
        .sum();
    assert!(
        shown >= sent,
        "answers per engine on the page: {shown} < {sent}"
    );
    assert!(dom.contains("model_not_found") && dom.contains("invalid_request"));
    // The client's markup is text in a cell, not an element.
    assert!(dom.contains("&lt;img src=x onerror=alert(1)&gt;"), "{dom}");
    assert!(!dom.contains("<img"), "client markup became an element");

    let shot = std::env::var_os("KVMESH_DASHBOARD_SCREENSHOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| profile.with_extension("png"));
    headless(
        &url,
        &[
            &format!("--screenshot={}", shot.display()),
            "--window-size=1360,900",
            "--hide-scrollbars",
        ],
        &profile,
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    more.join().unwrap();
    let png = std::fs::read(&shot).unwrap();
    assert!(png.starts_with(b"\x89PNG") && png.len() > 10_000);
    let _ = std::fs::remove_dir_all(&profile);
    if std::env::var_os("KVMESH_DASHBOARD_SCREENSHOT").is_none() {
        let _ = std::fs::remove_file(&shot);
    }
    // The page kept the proxy whole: it still serves.
    assert!(eventually(Duration::from_secs(2), || get(p.addr, "/ready")
        .is_ok_and(|r| r.status == 200)));
}
