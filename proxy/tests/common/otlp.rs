//! A real OTLP receiver for the tracing tests: `kvmesh-otlp-sink` (stubs generated from the
//! official `opentelemetry-proto` definitions), its spans read back as JSON.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{bin, free_port};

/// A running sink; killed on drop.
pub struct OtlpSink {
    child: Child,
    pub addr: SocketAddr,
    spans: Arc<Mutex<Vec<Value>>>,
}

impl OtlpSink {
    /// Starts a sink with `args` (e.g. `--refuse`) and waits for its port.
    pub fn start(args: &[&str]) -> OtlpSink {
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let mut child = Command::new(bin("kvmesh-otlp-sink"))
            .args(["--listen", &addr.to_string()])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn kvmesh-otlp-sink");
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
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(addr).is_err() {
            assert!(Instant::now() < deadline, "kvmesh-otlp-sink did not listen");
            std::thread::sleep(Duration::from_millis(20));
        }
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

    /// The spans of `trace_id` once there are at least `n` (panics after 15 s).
    pub fn trace(&self, trace_id: &str, n: usize) -> Vec<Value> {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let got: Vec<Value> = self
                .spans()
                .into_iter()
                .filter(|s| s["trace_id"] == trace_id)
                .collect();
            if got.len() >= n {
                return got;
            }
            assert!(
                Instant::now() < deadline,
                "trace {trace_id}: {} of {n} spans arrived: {got:#?}",
                got.len()
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
