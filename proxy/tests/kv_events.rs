//! Engine-fed residency from vLLM's KV events: a real proxy subscribed to a publisher that
//! follows vLLM's published event schema and sockets (`tests/support/vllm_kv_publisher.py`:
//! pyzmq, msgspec, vLLM's structs in both of its encodings, PUB plus the ROUTER replay socket).
//!
//! Stored blocks become the engine's `engine_feed` residency and route a prefix the proxy never
//! saw to that engine; removals and clears withdraw them; a lost message is replayed; a batch
//! lost for good, or one that is not msgpack, withdraws what the feed holds and is counted;
//! oversized and misshapen messages end the connection (counted, reconnected), and the proxy
//! keeps serving. The engines behind the proxy are simulated engines (benchmark instruments):
//! the part under test is the proxy's feed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

const MODEL: &str = "SmolLM2-135M-Instruct";
const BLOCK: usize = 16;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The vLLM-schema publisher, driven over its stdin; killed on drop.
struct Publisher {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    pub_port: u16,
    replay_port: u16,
}

impl Publisher {
    fn start() -> Publisher {
        let mut child = Command::new(root().join(".venv-peers/bin/python"))
            .arg(root().join("proxy/tests/support/vllm_kv_publisher.py"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the publisher (scripts/setup.sh installs .venv-peers)");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let ports: Vec<u16> = line
            .trim()
            .strip_prefix("ready ")
            .unwrap_or_else(|| panic!("publisher did not start: {line:?}"))
            .split(' ')
            .map(|p| p.parse().unwrap())
            .collect();
        Publisher {
            child,
            stdin,
            stdout,
            pub_port: ports[0],
            replay_port: ports[1],
        }
    }

    fn send(&mut self, cmd: Value) {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ok", "publisher answered {line:?} to {cmd}");
    }

    /// Replay requests the publisher has served.
    fn replays(&mut self) -> u64 {
        writeln!(self.stdin, "{}", json!({"op": "replays"})).unwrap();
        self.stdin.flush().unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        line.trim()
            .strip_prefix("ok ")
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("publisher answered {line:?}"))
    }

    /// `BlockStored` of the blocks `from..to` of `tokens` (hashes 1000 + block index).
    fn store(&mut self, tokens: &[u32], from: usize, to: usize, medium: &str) {
        let hashes: Vec<u64> = (from..to).map(|i| 1000 + i as u64).collect();
        let parent = from.checked_sub(1).map(|i| 1000 + i as u64);
        self.send(json!({"op": "stored", "hashes": hashes, "parent": parent,
                         "tokens": &tokens[from * BLOCK..to * BLOCK], "block_size": BLOCK,
                         "medium": medium}));
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A token-mode gateway in front of sim engines `vllm0` and `vllm1`; `vllm1` is fed by
/// `publisher` (with its replay socket when `replay`).
fn gateway(sims: &[&Sim], publisher: &Publisher, replay: bool) -> Proxy {
    let port = free_port();
    let gguf = root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let replay = if replay {
        format!(
            "kv_events_replay = \"tcp://127.0.0.1:{}\"\n",
            publisher.replay_port
        )
    } else {
        String::new()
    };
    let toml = format!(
        "listen = \"127.0.0.1:{port}\"\nthreads = 2\nlog = \"warn\"\n[routing]\nmax_prefix_blocks = 8\n[health]\ninterval_ms = 200\n\
         [[tokenizers]]\nmodel = \"{MODEL}\"\ngguf = \"{}\"\n\
         [[engines]]\nname = \"vllm0\"\nurl = \"{}\"\nmodels = [\"{MODEL}\"]\n\
         [[engines]]\nname = \"vllm1\"\nurl = \"{}\"\nmodels = [\"{MODEL}\"]\nkv_events = \"tcp://127.0.0.1:{}\"\n{replay}",
        gguf.display(),
        sims[0].url(),
        sims[1].url(),
        publisher.pub_port,
    );
    Proxy::start_with(&toml, port, true)
}

fn sims() -> (Sim, Sim) {
    let args = ["--instant", "--model", MODEL];
    (Sim::start("vllm0", &args), Sim::start("vllm1", &args))
}

/// A completion of `tokens` (token ids, which token mode hashes as given).
fn completion(tokens: &[u32]) -> Vec<u8> {
    serde_json::to_vec(&json!({"model": MODEL, "prompt": tokens, "max_tokens": 1})).unwrap()
}

/// `n` tokens no other test prompt shares, starting at `seed`.
fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| seed + i * 7 % 30_000).collect()
}

const FEED: &str = "kvmesh_residency_entries{source=\"engine_feed\"}";

fn feed_event(p: &Proxy, ev: &str) -> f64 {
    p.metric(&format!(
        "kvmesh_engine_feed_events_total{{engine=\"vllm1\",event=\"{ev}\"}}"
    ))
}

/// Waits until the feed has connected `n` times.
fn wait_connections(p: &Proxy, n: u32) {
    assert!(
        eventually(Duration::from_secs(10), || feed_event(p, "connected")
            == f64::from(n)),
        "the feed connected {} times (want {n})",
        feed_event(p, "connected")
    );
}

fn wait_entries(p: &Proxy, n: f64) {
    assert!(
        eventually(Duration::from_secs(10), || p.metric(FEED) == n),
        "engine_feed entries {} (want {n})",
        p.metric(FEED)
    );
}

/// Repeats `act` until `done` holds (10 s at most): a subscription reaches the publisher a
/// moment after the subscriber counts itself connected, and PUB drops what it publishes before.
fn until(mut act: impl FnMut(), mut done: impl FnMut() -> bool) -> bool {
    eventually(Duration::from_secs(10), || {
        act();
        eventually(Duration::from_secs(1), &mut done)
    })
}

#[test]
fn stored_removed_cleared_in_both_encodings_route_and_withdraw() {
    let (s0, s1) = sims();
    let mut publisher = Publisher::start();
    let tokens = prompt(100, 8 * BLOCK + 5);
    // Published before the proxy subscribes: it comes by replay at connect.
    publisher.store(&tokens, 0, 4, "GPU");
    let p = gateway(&[&s0, &s1], &publisher, true);
    wait_entries(&p, 4.0);
    assert!(feed_event(&p, "replayed") >= 1.0);
    // Live, continued from block 3 (the parent's digest, mapped from vLLM's hash).
    publisher.store(&tokens, 4, 8, "GPU");
    wait_entries(&p, 8.0);
    for _ in 0..3 {
        let r = post(p.addr, "/v1/completions", &completion(&tokens));
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.header("x-kvmesh-engine"), Some("vllm1"));
    }
    assert_eq!(
        p.metric("kvmesh_routing_decisions_total{policy=\"prefix\",reason=\"prefix_hit\"}"),
        3.0
    );

    // Offloaded to CPU (as vLLM's offloading connector reports it: hashes only), then
    // evicted from GPU: still held; evicted from CPU too: gone.
    publisher.send(
        json!({"op": "stored", "hashes": [1006, 1007], "parent": null, "tokens": [],
                          "block_size": 2 * BLOCK, "medium": "CPU"}),
    );
    let removed: Vec<u64> = (1006..1008).collect();
    publisher.send(json!({"op": "removed", "hashes": removed, "medium": "GPU"}));
    publisher.send(json!({"op": "removed", "hashes": [1005], "medium": "GPU"}));
    wait_entries(&p, 7.0);
    publisher.send(json!({"op": "removed", "hashes": removed, "medium": "CPU"}));
    wait_entries(&p, 5.0);
    publisher.send(json!({"op": "cleared"}));
    wait_entries(&p, 0.0);
    assert_eq!(feed_event(&p, "cleared"), 1.0);

    // vLLM v0.23's positional encoding, on the same stream.
    publisher.send(json!({"op": "encoding", "value": "array"}));
    publisher.store(&tokens, 0, 8, "GPU");
    wait_entries(&p, 8.0);
    publisher.send(json!({"op": "removed", "hashes": [1007]}));
    wait_entries(&p, 7.0);
    // A LoRA block and one with extra keys (a cache salt) are not named by tokens alone.
    publisher.send(json!({"op": "encoding", "value": "map"}));
    let other = prompt(5000, 2 * BLOCK);
    publisher.send(
        json!({"op": "stored", "hashes": [1], "parent": null, "tokens": &other[..BLOCK],
                          "lora_name": "adapter"}),
    );
    publisher.send(
        json!({"op": "stored", "hashes": [2], "parent": null, "tokens": &other[..BLOCK],
                          "extra_keys": [["salt"]]}),
    );
    // A child of the skipped block: its parent is unknown.
    publisher.send(json!({"op": "stored", "hashes": [3], "parent": 2, "tokens": &other[BLOCK..]}));
    assert!(eventually(Duration::from_secs(10), || feed_event(
        &p, "unmapped"
    ) == 1.0));
    assert_eq!(feed_event(&p, "unsupported"), 2.0);
    assert_eq!(p.metric(FEED), 7.0);
    assert_eq!(feed_event(&p, "lost"), 0.0);
}

#[test]
fn a_lost_message_is_replayed_and_one_lost_for_good_resyncs() {
    let (s0, s1) = sims();
    let mut publisher = Publisher::start();
    let tokens = prompt(200, 8 * BLOCK);
    publisher.store(&tokens, 0, 2, "GPU");
    let p = gateway(&[&s0, &s1], &publisher, true);
    wait_entries(&p, 2.0);
    // Batch 1 is buffered but never published: batch 2 shows the gap, replay fills it.
    publisher.send(json!({"op": "hold"}));
    publisher.store(&tokens, 2, 4, "GPU");
    publisher.store(&tokens, 4, 6, "GPU");
    wait_entries(&p, 6.0);
    assert_eq!(feed_event(&p, "gap"), 1.0);
    assert_eq!(feed_event(&p, "resync"), 0.0);
    // Lost for good (not in the buffer either): what the feed held is withdrawn, and the
    // batch after the gap applies (its parent's digest is still known).
    publisher.send(json!({"op": "forget"}));
    publisher.send(json!({"op": "removed", "hashes": [1000]}));
    publisher.store(&tokens, 6, 8, "GPU");
    wait_entries(&p, 2.0);
    assert_eq!(feed_event(&p, "gap"), 2.0);
    assert_eq!(feed_event(&p, "resync"), 1.0);
    // Not msgpack: dropped, counted, withdrawn; the next batch applies.
    publisher.send(json!({"op": "garbage"}));
    assert!(eventually(Duration::from_secs(10), || feed_event(
        &p,
        "malformed"
    ) == 1.0));
    wait_entries(&p, 0.0);
    publisher.store(&tokens, 0, 3, "GPU");
    wait_entries(&p, 3.0);
    assert_eq!(feed_event(&p, "lost"), 0.0);
}

#[test]
fn hostile_messages_end_the_connection_and_the_proxy_keeps_serving() {
    let (s0, s1) = sims();
    let mut publisher = Publisher::start();
    let tokens = prompt(300, 4 * BLOCK);
    publisher.store(&tokens, 0, 4, "GPU");
    // No replay socket: a gap or a reconnect cannot be filled.
    let p = gateway(&[&s0, &s1], &publisher, false);
    wait_connections(&p, 1);
    // Without replay, what was published before the subscription is not known.
    assert_eq!(p.metric(FEED), 0.0);
    assert!(until(
        || publisher.store(&tokens, 0, 4, "GPU"),
        || p.metric(FEED) == 4.0
    ));
    // Two frames, a seq of 3 bytes: skipped and counted, the stream stays.
    publisher.send(json!({"op": "raw", "frames": ["", "00"]}));
    publisher.send(json!({"op": "raw", "frames": ["", "000001", "90"]}));
    assert!(eventually(Duration::from_secs(10), || feed_event(
        &p,
        "malformed"
    ) == 2.0));
    assert_eq!(feed_event(&p, "lost"), 0.0);
    // Five frames, then a 9 MiB payload: the connection ends, its residency is withdrawn, and
    // the feed reconnects.
    publisher.send(json!({"op": "raw", "frames": ["", "00", "00", "00", "00"]}));
    assert!(eventually(Duration::from_secs(10), || feed_event(
        &p, "lost"
    ) == 1.0));
    wait_entries(&p, 0.0);
    wait_connections(&p, 2);
    assert!(until(
        || publisher.send(json!({"op": "huge", "bytes": 9 << 20})),
        || feed_event(&p, "lost") == 2.0
    ));
    wait_connections(&p, 3);
    // Alive, and the feed works again.
    let r = post(p.addr, "/v1/completions", &completion(&tokens));
    assert_eq!(r.status, 200);
    let more = prompt(400, 2 * BLOCK);
    assert!(until(
        || publisher
            .send(json!({"op": "stored", "hashes": [7, 8], "parent": null, "tokens": more})),
        || p.metric(FEED) == 2.0
    ));
}

#[test]
fn a_replay_numbered_past_the_live_stream_does_not_silence_it() {
    let (s0, s1) = sims();
    let mut publisher = Publisher::start();
    // Batch 0, published before the proxy subscribes, comes by replay at connect, numbered
    // 2^62 by a replay socket that lies (or belongs to another publisher).
    publisher.store(&prompt(500, 2 * BLOCK), 0, 2, "GPU");
    publisher.send(json!({"op": "replay_lie", "seq": 1u64 << 62}));
    let p = gateway(&[&s0, &s1], &publisher, true);
    wait_entries(&p, 2.0);
    // The live stream goes on from batch 1: not dropped as seen before. What the lying
    // replay gave is withdrawn.
    let more = prompt(600, 3 * BLOCK);
    assert!(until(
        || publisher
            .send(json!({"op": "stored", "hashes": [7, 8, 9], "parent": null, "tokens": more})),
        || p.metric(FEED) == 3.0
    ));
    assert_eq!(feed_event(&p, "duplicate"), 0.0);
    assert!(feed_event(&p, "malformed") >= 1.0);
}

#[test]
fn a_stream_that_keeps_going_back_is_not_replayed_at_every_message() {
    let (s0, s1) = sims();
    let mut publisher = Publisher::start();
    let p = gateway(&[&s0, &s1], &publisher, true);
    wait_connections(&p, 1);
    let tokens = prompt(700, 2 * BLOCK);
    let started = std::time::Instant::now();
    let rewound = |publisher: &mut Publisher| {
        publisher.send(json!({"op": "rewind"}));
        publisher.store(&tokens, 0, 2, "GPU");
    };
    // Until a first restart is seen: a restart is a live batch numbered at or below the last
    // live one, and batches published before the subscription reaches the publisher are
    // dropped (a replay at connect brings them, but not as live batches).
    assert!(until(
        || rewound(&mut publisher),
        || feed_event(&p, "restart") >= 1.0
    ));
    let first = feed_event(&p, "restart");
    // Each batch numbered 0 again: the proxy sees the publisher restart at every message.
    for _ in 0..30 {
        rewound(&mut publisher);
    }
    assert!(eventually(Duration::from_secs(20), || feed_event(
        &p, "restart"
    ) >= first + 30.0));
    // One replay at connect, then at most one a second.
    let bound = 2 + started.elapsed().as_secs();
    let replays = publisher.replays();
    assert!(
        replays <= bound,
        "{replays} replays in {:?}",
        started.elapsed()
    );
    // The feed still follows the stream.
    wait_entries(&p, 2.0);
}

#[test]
fn a_stream_with_a_gap_at_every_batch_is_not_replayed_at_every_batch() {
    let (s0, s1) = sims();
    let mut publisher = Publisher::start();
    let p = gateway(&[&s0, &s1], &publisher, true);
    wait_connections(&p, 1);
    let tokens = prompt(800, 3 * BLOCK);
    let started = std::time::Instant::now();
    assert!(until(
        || publisher.store(&tokens, 0, 2, "GPU"),
        || p.metric(FEED) == 2.0
    ));
    let at_connect = publisher.replays();
    // Every other batch is held back (buffered for replay, never published): each published
    // batch shows a gap. Each gap is settled (its replay served, or refused by the
    // allowance) before the next batches: a replay served later would bring them too and hide
    // the next gap.
    for gaps in 1..=30u32 {
        publisher.send(json!({"op": "hold"}));
        publisher.store(&tokens, 0, 2, "GPU");
        publisher.store(&tokens, 0, 2, "GPU");
        assert!(
            eventually(Duration::from_secs(10), || {
                let settled =
                    publisher.replays() - at_connect + feed_event(&p, "replay_limited") as u64;
                feed_event(&p, "gap") == f64::from(gaps) && settled == u64::from(gaps)
            }),
            "gap {gaps}: {} gaps, {} replays, {} refused",
            feed_event(&p, "gap"),
            publisher.replays() - at_connect,
            feed_event(&p, "replay_limited")
        );
    }
    // A last batch of its own, applied once every one before it was.
    publisher.store(&tokens, 0, 3, "GPU");
    wait_entries(&p, 3.0);
    let replays = publisher.replays();
    // The replay at connect, a burst of 4 gap replays, then one a second.
    let bound = at_connect + 4 + started.elapsed().as_secs() + 1;
    assert!(
        replays <= bound,
        "{replays} replays in {:?}",
        started.elapsed()
    );
    // Gaps past the allowance are lost: withdrawn, not left standing (unless the 30 gaps took
    // so long that the allowance covered every one).
    let refused = feed_event(&p, "replay_limited");
    assert!(refused >= 1.0 || started.elapsed() >= Duration::from_secs(25));
    assert!(feed_event(&p, "resync") >= refused);
}
