//! A real OTLP receiver for the tracing tests: `kvmesh-otlp-sink` (stubs generated from the
//! official `opentelemetry-proto` definitions), its spans read back as JSON.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::bin;

/// A running sink; killed on drop.
pub struct OtlpSink {
    child: Child,
    pub addr: SocketAddr,
    spans: Arc<Mutex<Vec<Value>>>,
}

impl OtlpSink {
    /// Starts a sink with `args` (e.g. `--refuse`) on a port it picks (so that no other
    /// process can hold it) and waits for it to listen.
    pub fn start(args: &[&str]) -> OtlpSink {
        let mut child = Command::new(bin("kvmesh-otlp-sink"))
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn kvmesh-otlp-sink");
        let mut err = BufReader::new(child.stderr.take().unwrap());
        let mut line = String::new();
        err.read_line(&mut line).unwrap();
        let addr: SocketAddr = line
            .trim()
            .rsplit("http://")
            .next()
            .unwrap()
            .parse()
            .unwrap_or_else(|_| panic!("kvmesh-otlp-sink did not start: {line:?}"));
        // The rest of its stderr, to the test's.
        std::thread::spawn(move || {
            for l in err.lines().map_while(Result::ok) {
                eprintln!("{l}");
            }
        });
        let out = child.stdout.take().unwrap();
        let spans = Arc::new(Mutex::new(Vec::new()));
        let into = spans.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                let v: Value = serde_json::from_str(&line).expect("sink line is JSON");
                into.lock().unwrap().push(v);
            }
        });
        OtlpSink { child, addr, spans }
    }

    /// The `otel.endpoint` that reaches it.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Value> {
        self.spans.lock().unwrap().clone()
    }

    /// The spans of `trace_id` once `requests` of its `kvmesh.request` spans have arrived
    /// (panics after 15 s). A proxy ends a request's span after all the others of that
    /// request, and spans leave in the order they end: then the proxy's spans are all here.
    pub fn trace(&self, trace_id: &str, requests: usize) -> Vec<Value> {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let got: Vec<Value> = self
                .spans()
                .into_iter()
                .filter(|s| s["trace_id"] == trace_id)
                .collect();
            let done = got.iter().filter(|s| s["name"] == "kvmesh.request").count();
            if done >= requests {
                return got;
            }
            assert!(
                Instant::now() < deadline,
                "trace {trace_id}: {done} of {requests} request spans arrived: {got:#?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for OtlpSink {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The one span of `spans` named `name` (and, if given, with `attribute` = `value`).
pub fn one<'a>(spans: &'a [Value], name: &str, attr: Option<(&str, Value)>) -> &'a Value {
    let found: Vec<&Value> = spans
        .iter()
        .filter(|s| s["name"] == name)
        .filter(|s| attr.as_ref().is_none_or(|(k, v)| &s["attributes"][k] == v))
        .collect();
    assert_eq!(found.len(), 1, "one {name} {attr:?} in {spans:#?}");
    found[0]
}

/// The one span of `spans` named `name` whose parent is `parent`.
pub fn child<'a>(spans: &'a [Value], name: &str, parent: &Value) -> &'a Value {
    let found: Vec<&Value> = spans
        .iter()
        .filter(|s| s["name"] == name && s["parent_span_id"] == parent["span_id"])
        .collect();
    assert_eq!(found.len(), 1, "one {name} under {parent:#} in {spans:#?}");
    found[0]
}

/// `(trace id, parent span id)` of a W3C `traceparent` (`00-<trace>-<span>-<flags>`).
pub fn traceparent(v: &str) -> (String, String) {
    let parts: Vec<&str> = v.split('-').collect();
    assert_eq!(parts.len(), 4, "traceparent {v:?}");
    assert_eq!(parts[0], "00", "traceparent {v:?}");
    (parts[1].to_string(), parts[2].to_string())
}
