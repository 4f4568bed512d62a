//! End-to-end tests: a real `kvagent` process on loopback, driven over gRPC.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvagent::pb::{self, Tier};
use tonic::Code;

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A running agent; killed on drop.
struct Agent {
    child: Child,
    port: u16,
    metrics_port: u16,
    dir: PathBuf,
    extra: String,
}

impl Agent {
    /// Starts an agent on `dir` with `extra` TOML appended after the ports and log level.
    async fn start(dir: &Path, extra: &str) -> Agent {
        let port = free_port();
        let metrics_port = free_port();
        let config = dir.join(format!("kvagent-{port}.toml"));
        std::fs::write(
            &config,
            format!(
                "listen = \"127.0.0.1:{port}\"\nmetrics_listen = \"127.0.0.1:{metrics_port}\"\nlog = \"warn\"\n{extra}\n"
            ),
        )
        .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_kvagent"))
            .arg("--config")
            .arg(&config)
            .env("KVAGENT_SSD_DIR", dir.join("ssd"))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn kvagent");
        let agent = Agent {
            child,
            port,
            metrics_port,
            dir: dir.to_owned(),
            extra: extra.to_owned(),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "kvagent did not start");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        agent
    }

    /// A plain channel to the agent, for calls the client does not make.
    async fn channel(&self) -> tonic::transport::Channel {
        tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{}", self.port))
            .unwrap()
            .connect()
            .await
            .unwrap()
    }

    async fn client(&self) -> kvagent::Client {
        kvagent::connect(format!("http://127.0.0.1:{}", self.port), 64 << 20)
            .await
            .expect("connect")
    }

    /// SIGTERM and wait: a graceful stop (RAM flushed to SSD).
    fn stop(&mut self) {
        Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.child.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "kvagent ignored SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL: no chance to flush anything.
    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    async fn restart(mut self) -> Agent {
        if self.child.try_wait().unwrap().is_none() {
            self.stop();
        }
        Agent::start(&self.dir.clone(), &self.extra.clone()).await
    }

    fn metrics(&self) -> String {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.metrics_port)).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill9();
    }
}

fn digest(i: u32) -> Bytes {
    Bytes::copy_from_slice(blake3::hash(format!("block {i}").as_bytes()).as_bytes())
}

/// Deterministic payload for block `i`, so any served copy can be checked.
fn payload(i: u32, size: usize) -> Bytes {
    let mut out = vec![0u8; size];
    blake3::Hasher::new()
        .update(&i.to_le_bytes())
        .finalize_xof()
        .fill(&mut out);
    Bytes::from(out)
}

fn block(i: u32, size: usize) -> pb::Block {
    pb::Block {
        digest: digest(i),
        model: "smollm2".into(),
        token_count: 16,
        payload: payload(i, size),
    }
}

async fn put(c: &mut kvagent::Client, blocks: Vec<pb::Block>) -> pb::PutBlocksResponse {
    c.put_blocks(pb::PutBlocksRequest { blocks })
        .await
        .expect("put")
        .into_inner()
}

async fn get(c: &mut kvagent::Client, ids: &[u32]) -> Vec<pb::GetBlocksResponse> {
    let mut stream = c
        .get_blocks(pb::GetBlocksRequest {
            digests: ids.iter().map(|i| digest(*i)).collect(),
        })
        .await
        .expect("get")
        .into_inner();
    let mut out = Vec::new();
    while let Some(m) = stream.message().await.expect("stream") {
        out.push(m);
    }
    out
}

async fn stats(c: &mut kvagent::Client) -> pb::StatsResponse {
    c.stats(pb::StatsRequest {})
        .await
        .expect("stats")
        .into_inner()
}

async fn lookup(c: &mut kvagent::Client, ids: &[u32]) -> Vec<pb::LookupEntry> {
    c.lookup(pb::LookupRequest {
        digests: ids.iter().map(|i| digest(*i)).collect(),
    })
    .await
    .expect("lookup")
    .into_inner()
    .entries
}

/// The agent's `WatchResidency` stream, through `c`.
async fn watch_stream(c: &mut kvagent::Client) -> tonic::Streaming<pb::ResidencyUpdate> {
    c.watch_residency(pb::WatchResidencyRequest {})
        .await
        .expect("WatchResidency answered")
        .into_inner()
}

#[tokio::test]
async fn put_get_round_trip_lookup_and_bad_requests() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), "[limits]\nmax_block_bytes = 1048576\n").await;
    let mut c = agent.client().await;
    let r = put(&mut c, vec![block(1, 1000), block(2, 300_000)]).await;
    assert_eq!(r.stored, 2);
    let got = get(&mut c, &[2, 3, 1]).await;
    assert_eq!(got.len(), 3, "one message per requested digest, in order");
    assert_eq!(got[0].digest, digest(2));
    let b2 = got[0].block.as_ref().expect("2 served");
    assert_eq!((b2.model.as_str(), b2.token_count), ("smollm2", 16));
    assert_eq!(b2.payload, payload(2, 300_000));
    assert_eq!(got[0].tier(), Tier::Ram);
    assert!(got[1].block.is_none() && got[1].tier() == Tier::None);
    assert_eq!(got[2].block.as_ref().unwrap().payload, payload(1, 1000));

    let l = lookup(&mut c, &[1, 3]).await;
    assert_eq!(
        (l[0].tier(), l[0].size, l[0].token_count),
        (Tier::Ram, 1000, 16)
    );
    assert!(l[0].last_access_unix_ms > 0);
    assert_eq!((l[1].tier(), l[1].size), (Tier::None, 0));
    let s = stats(&mut c).await;
    // Capacity accounting: payload + model name + the per-block overhead, per block.
    let charged = 301_000 + 2 * ("smollm2".len() as u64 + kvagent::store::RAM_BLOCK_OVERHEAD_BYTES);
    assert_eq!(
        (s.ram_blocks, s.ram_bytes, s.hits_ram, s.misses),
        (2, charged, 2, 1)
    );

    // Oversize block, bad digest, empty model, nothing to delete: InvalidArgument, clear message,
    // and nothing stored.
    let e = c
        .put_blocks(pb::PutBlocksRequest {
            blocks: vec![block(9, 1000), block(10, (1 << 20) + 1)],
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(
        e.message().contains("blocks[1].payload") && e.message().contains("1048576"),
        "{}",
        e.message()
    );
    let mut bad = block(11, 10);
    bad.digest = Bytes::from_static(b"short");
    let e = c
        .put_blocks(pb::PutBlocksRequest { blocks: vec![bad] })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(
        e.message().contains("32-byte digest, got 5"),
        "{}",
        e.message()
    );
    let mut unnamed = block(12, 10);
    unnamed.model.clear();
    let e = c
        .put_blocks(pb::PutBlocksRequest {
            blocks: vec![unnamed],
        })
        .await
        .unwrap_err();
    assert!(e.message().contains("model"), "{}", e.message());
    let e = c
        .get_blocks(pb::GetBlocksRequest {
            digests: vec![Bytes::from_static(b"x")],
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    let e = c.delete(pb::DeleteRequest::default()).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert_eq!(stats(&mut c).await.ram_blocks, 2);

    // Delete one, then all (a new epoch).
    let d = c
        .delete(pb::DeleteRequest {
            digests: vec![digest(1)],
            all: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(d.deleted, 1);
    let d2 = c
        .delete(pb::DeleteRequest {
            digests: vec![],
            all: true,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(d2.deleted, 1);
    assert_ne!(d2.kv_epoch, d.kv_epoch);
    assert_eq!(stats(&mut c).await.ram_blocks, 0);

    // The standard health service answers SERVING for the KvAgent service.
    let channel = agent.channel().await;
    let h = tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest {
            service: "kvmesh.kvagent.v1.KvAgent".into(),
        })
        .await
        .expect("health")
        .into_inner();
    assert_eq!(
        h.status(),
        tonic_health::pb::health_check_response::ServingStatus::Serving
    );

    let m = agent.metrics();
    assert!(m.contains("kvagent_hits_total{tier=\"ram\"} 2"), "{m}");
    assert!(m.contains("kvagent_put_blocks_total 2"), "{m}");
    // The agent's own process metrics (from /proc).
    assert!(m.contains("process_resident_memory_bytes "), "{m}");
    assert!(m.contains("process_open_fds "), "{m}");
}

#[tokio::test]
async fn ram_pressure_spills_to_ssd_and_reads_promote() {
    let dir = tempfile::tempdir().unwrap();
    // 1 MiB of RAM, 64 KiB blocks: 40 blocks must spill.
    let agent = Agent::start(
        dir.path(),
        "[ram]\ncapacity_bytes = 1048576\n[limits]\nmax_block_bytes = 65536\n",
    )
    .await;
    let mut c = agent.client().await;
    for i in 0..40 {
        put(&mut c, vec![block(i, 65536)]).await;
    }
    let s = stats(&mut c).await;
    assert!(s.ram_bytes <= 1 << 20, "RAM over capacity: {}", s.ram_bytes);
    assert!(s.spilled_blocks >= 24, "spilled {}", s.spilled_blocks);
    assert_eq!(s.ram_blocks + s.ssd_blocks, 40, "nothing lost");
    // The oldest is on SSD, the newest in RAM.
    let l = lookup(&mut c, &[0, 39]).await;
    assert_eq!((l[0].tier(), l[1].tier()), (Tier::Ssd, Tier::Ram));
    let got = get(&mut c, &[0]).await;
    assert_eq!(got[0].tier(), Tier::Ssd);
    assert_eq!(got[0].block.as_ref().unwrap().payload, payload(0, 65536));
    assert_eq!(
        lookup(&mut c, &[0]).await[0].tier(),
        Tier::Ram,
        "promoted by the read"
    );
    let s = stats(&mut c).await;
    assert_eq!((s.promoted_blocks, s.hits_ssd), (1, 1));
    // Every block still reads back intact.
    let all: Vec<u32> = (0..40).collect();
    for (i, m) in get(&mut c, &all).await.iter().enumerate() {
        assert_eq!(
            m.block.as_ref().expect("served").payload,
            payload(i as u32, 65536)
        );
    }
    let m = agent.metrics();
    assert!(m.contains("kvagent_spilled_blocks_total"), "{m}");
}

#[tokio::test]
async fn restart_keeps_blocks_and_watch_sees_adds_removes_and_new_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), "").await;
    let mut c = agent.client().await;
    let mut watch = watch_stream(&mut c).await;
    let first = watch.message().await.unwrap().unwrap();
    assert!(first.reset && first.added.is_empty());
    let epoch = first.kv_epoch;

    put(&mut c, vec![block(1, 100), block(2, 100), block(3, 100)]).await;
    let added = watch.message().await.unwrap().unwrap();
    assert_eq!(added.added, vec![digest(1), digest(2), digest(3)]);
    assert!(!added.reset && added.kv_epoch == epoch);
    // Replacing a resident block is not an add.
    put(&mut c, vec![block(1, 100)]).await;
    c.delete(pb::DeleteRequest {
        digests: vec![digest(2)],
        all: false,
    })
    .await
    .unwrap();
    let removed = watch.message().await.unwrap().unwrap();
    assert!(removed.added.is_empty(), "re-put announced as an add");
    assert_eq!(removed.removed, vec![digest(2)]);

    // Graceful restart: RAM blocks go to SSD and are served by the new process, new epoch.
    let agent = agent.restart().await;
    let mut c = agent.client().await;
    let got = get(&mut c, &[1, 2, 3]).await;
    assert_eq!(got[0].block.as_ref().unwrap().payload, payload(1, 100));
    assert!(got[1].block.is_none());
    assert_eq!(got[2].tier(), Tier::Ssd);
    let mut watch = watch_stream(&mut c).await;
    let snap = watch.message().await.unwrap().unwrap();
    assert!(snap.reset);
    assert_ne!(snap.kv_epoch, epoch, "epoch must change on restart");
    let mut resident = snap.added.clone();
    resident.sort();
    let mut want = vec![digest(1), digest(3)];
    want.sort();
    assert_eq!(resident, want);
    // Delete everything: a reset with a new epoch.
    c.delete(pb::DeleteRequest {
        digests: vec![],
        all: true,
    })
    .await
    .unwrap();
    let reset = watch.message().await.unwrap().unwrap();
    assert!(reset.reset && reset.added.is_empty() && reset.kv_epoch != snap.kv_epoch);
}

// An idle stream still gets a message every RESIDENCY_HEARTBEAT, empty and of the same epoch,
// and every message says how often: a watcher can then tell an idle agent from one whose
// stream stopped in the middle of a message.
#[tokio::test]
async fn an_idle_watch_gets_a_heartbeat() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), "").await;
    let mut c = agent.client().await;
    let mut watch = watch_stream(&mut c).await;
    let heartbeat = kvagent::service::RESIDENCY_HEARTBEAT;
    let first = watch.message().await.unwrap().unwrap();
    assert_eq!(u128::from(first.heartbeat_ms), heartbeat.as_millis());
    let started = std::time::Instant::now();
    let beat = tokio::time::timeout(heartbeat * 2, watch.message())
        .await
        .expect("no message from an idle agent within two heartbeats")
        .unwrap()
        .unwrap();
    assert!(started.elapsed() >= heartbeat / 2, "sent before it was due");
    assert_eq!(
        (
            beat.kv_epoch,
            beat.reset,
            beat.added.len(),
            beat.removed.len()
        ),
        (first.kv_epoch, false, 0, 0)
    );
    assert_eq!(beat.heartbeat_ms, first.heartbeat_ms);
}

#[tokio::test]
async fn kill_9_during_a_burst_of_puts_never_serves_a_damaged_block() {
    let dir = tempfile::tempdir().unwrap();
    let ssd = dir.path().join("ssd");
    // A small RAM tier so that most of the burst is being spilled when the process dies.
    let extra = "[ram]\ncapacity_bytes = 524288\n[limits]\nmax_block_bytes = 65536\n";
    let mut agent = Agent::start(dir.path(), extra).await;
    let size = 48 * 1024;
    let writer = {
        let mut c = agent.client().await;
        tokio::spawn(async move {
            let mut acked = 0u32;
            for i in 0..100_000u32 {
                match c
                    .put_blocks(pb::PutBlocksRequest {
                        blocks: vec![block(i, size)],
                    })
                    .await
                {
                    Ok(_) => acked = i + 1,
                    Err(_) => break,
                }
            }
            acked
        })
    };
    tokio::time::sleep(Duration::from_millis(1500)).await;
    agent.kill9();
    let acked = writer.await.unwrap();
    assert!(acked > 20, "the burst barely started ({acked} puts)");

    let agent = agent.restart().await;
    let mut c = agent.client().await;
    // The crash's half-written temp files are gone once the store is open (checked before any
    // read: reads promote blocks to RAM, whose spills write temp files of their own).
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::fs::read_dir(ssd.join("tmp")).map_or(1, |d| d.count()) != 0 {
        assert!(
            Instant::now() < deadline,
            "half-written temp files left behind"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ids: Vec<u32> = (0..acked + 1).collect();
    let mut served = 0;
    for chunk in ids.chunks(512) {
        for m in get(&mut c, chunk).await {
            if let Some(b) = m.block {
                let i =
                    chunk[0] + chunk.iter().position(|x| digest(*x) == m.digest).unwrap() as u32;
                assert_eq!(
                    blake3::hash(&b.payload),
                    blake3::hash(&payload(i, size)),
                    "block {i} served damaged"
                );
                served += 1;
            }
        }
    }
    assert!(served > 0, "nothing survived on SSD (acked {acked})");
    eprintln!("kill -9: {acked} puts acknowledged, {served} blocks served intact after restart");
}

#[tokio::test]
async fn corrupt_and_truncated_files_are_dropped_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let ssd = dir.path().join("ssd");
    let mut agent = Agent::start(dir.path(), "").await;
    let mut c = agent.client().await;
    put(&mut c, vec![block(1, 5000), block(2, 5000), block(3, 5000)]).await;
    agent.stop();
    let file = |i: u32| ssd.join("blocks").join(format!("{}.kvb", hex(&digest(i))));
    // Flip one payload bit in block 1, cut block 2 short.
    let mut b1 = std::fs::read(file(1)).unwrap();
    b1[2000] ^= 0x10;
    std::fs::write(file(1), &b1).unwrap();
    let b2 = std::fs::read(file(2)).unwrap();
    std::fs::write(file(2), &b2[..b2.len() - 100]).unwrap();

    let agent = agent.restart().await;
    let mut c = agent.client().await;
    assert_eq!(
        stats(&mut c).await.corrupt_dropped,
        1,
        "truncated file dropped at start"
    );
    assert!(!file(2).exists());
    let got = get(&mut c, &[1, 2, 3]).await;
    assert!(got[0].block.is_none(), "bit-flipped block was served");
    assert!(got[1].block.is_none());
    assert_eq!(got[2].block.as_ref().unwrap().payload, payload(3, 5000));
    let s = stats(&mut c).await;
    assert_eq!(s.corrupt_dropped, 2);
    assert_eq!(s.ssd_blocks, 0, "block 3 promoted, the others gone");
    assert!(agent.metrics().contains("kvagent_corrupt_dropped_total 2"));
    // Maintenance removes the corrupt file shortly after.
    let deadline = Instant::now() + Duration::from_secs(10);
    while file(1).exists() {
        assert!(Instant::now() < deadline, "corrupt file never removed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn ssd_blocks_expire_after_their_ttl() {
    let dir = tempfile::tempdir().unwrap();
    let extra = "[ram]\ncapacity_bytes = 65536\n[ssd]\nttl_secs = 1\nsweep_interval_secs = 1\n[limits]\nmax_block_bytes = 32768\n";
    let agent = Agent::start(dir.path(), extra).await;
    let mut c = agent.client().await;
    let mut watch = watch_stream(&mut c).await;
    watch.message().await.unwrap();
    for i in 0..4 {
        put(&mut c, vec![block(i, 30000)]).await;
    }
    assert_eq!(lookup(&mut c, &[0]).await[0].tier(), Tier::Ssd);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut removed = Vec::new();
    while !removed.contains(&digest(0)) {
        assert!(Instant::now() < deadline, "TTL never removed block 0");
        let m = tokio::time::timeout(Duration::from_secs(5), watch.message())
            .await
            .expect("an update")
            .unwrap()
            .unwrap();
        removed.extend(m.removed);
    }
    assert_eq!(lookup(&mut c, &[0]).await[0].tier(), Tier::None);
    assert!(get(&mut c, &[0]).await[0].block.is_none());
    assert!(stats(&mut c).await.expired >= 1);
}

#[tokio::test]
async fn node_load_reads_the_engine_metrics() {
    let dir = tempfile::tempdir().unwrap();
    // No engine configured: not available, and says why.
    let agent = Agent::start(dir.path(), "").await;
    let l = agent
        .client()
        .await
        .node_load(pb::NodeLoadRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(!l.available && l.error.contains("no engine"), "{l:?}");
    drop(agent);

    // A real kvmesh-sim-engine exposes vLLM's metric names.
    let sim_bin = PathBuf::from(env!("CARGO_BIN_EXE_kvagent"))
        .parent()
        .unwrap()
        .join("kvmesh-sim-engine");
    assert!(
        sim_bin.exists(),
        "run `cargo build --workspace --bins` first"
    );
    let mut sim = Command::new(sim_bin)
        .args(["--listen", "127.0.0.1:0", "--name", "e0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(sim.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let url = format!("{}/metrics", line.trim().rsplit(' ').next().unwrap());
    let agent = Agent::start(
        dir.path(),
        &format!("[telemetry]\nengine_metrics_url = \"{url}\"\nscrape_interval_ms = 100\n"),
    )
    .await;
    let mut c = agent.client().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let l = loop {
        let l = c
            .node_load(pb::NodeLoadRequest {})
            .await
            .unwrap()
            .into_inner();
        if l.available {
            break l;
        }
        assert!(Instant::now() < deadline, "never scraped: {l:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        (l.flavor.as_str(), l.running, l.waiting),
        ("vllm", 0.0, 0.0)
    );
    assert!(l.scraped_unix_ms > 0);
    // The engine goes away: the next scrapes fail and say so.
    let _ = sim.kill();
    let _ = sim.wait();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let l = c
            .node_load(pb::NodeLoadRequest {})
            .await
            .unwrap()
            .into_inner();
        if !l.available {
            assert!(!l.error.is_empty());
            break;
        }
        assert!(
            Instant::now() < deadline,
            "a dead engine still reads as available"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_flood_of_empty_blocks_is_charged_and_bounded() {
    let dir = tempfile::tempdir().unwrap();
    // 64 KiB of RAM and 64 KiB of SSD: at most 256 + 16 blocks, however small.
    let agent = Agent::start(
        dir.path(),
        "[ram]\ncapacity_bytes = 65536\n[ssd]\ncapacity_bytes = 65536\nfsync = false\n\
         [limits]\nmax_block_bytes = 32768\n",
    )
    .await;
    let mut c = agent.client().await;
    for batch in 0..20 {
        put(
            &mut c,
            (0..100).map(|i| block(batch * 100 + i, 0)).collect(),
        )
        .await;
    }
    let s = stats(&mut c).await;
    let overhead = kvagent::store::RAM_BLOCK_OVERHEAD_BYTES;
    assert!(
        s.ram_blocks + s.ssd_blocks <= 65536 / overhead + 65536 / 4096,
        "{} + {} of 2000 empty blocks kept",
        s.ram_blocks,
        s.ssd_blocks
    );
    assert!(s.ram_bytes <= 65536 && s.ssd_bytes <= 65536, "{s:?}");
    assert!(
        s.ram_bytes >= s.ram_blocks * (overhead + 7),
        "overhead not charged: {s:?}"
    );
    assert!(
        s.ssd_bytes >= s.ssd_blocks * 4096,
        "SSD files not charged: {s:?}"
    );
    assert!(s.evicted > 0, "{s:?}");
    // A batch whose per-block overhead alone passes the RAM capacity is refused whole.
    let e = c
        .put_blocks(pb::PutBlocksRequest {
            blocks: (0..300).map(|i| block(50_000 + i, 0)).collect(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("capacity"), "{}", e.message());
    // The spiller may still be moving blocks to SSD: compare the gauge with the store once both
    // are read between two of its moves.
    let mut m = String::new();
    let mut agreed = false;
    for _ in 0..100 {
        m = agent.metrics();
        let line = format!(
            "kvagent_bytes{{tier=\"ram\"}} {}",
            stats(&mut c).await.ram_bytes
        );
        if m.contains(&line) {
            agreed = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(agreed, "the RAM bytes gauge never matched the store: {m}");
}

/// `PutBlocksRequest` with a field kvagent does not know: decoded, skipped, and (before the fix)
/// kept alive by the stored payload, which was a slice of the request buffer.
#[derive(Clone, PartialEq, prost::Message)]
struct PaddedPut {
    #[prost(message, repeated, tag = "1")]
    blocks: Vec<pb::Block>,
    #[prost(bytes = "bytes", tag = "99")]
    padding: Bytes,
}

fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kib * 1024
}

#[tokio::test]
async fn a_small_block_in_a_big_request_does_not_pin_the_request() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), "[ssd]\ncapacity_bytes = 0\n").await;
    let channel = agent.channel().await;
    let mut grpc = tonic::client::Grpc::new(channel);
    let before = rss_bytes(agent.child.id());
    let requests = 12u32;
    for i in 0..requests {
        grpc.ready().await.unwrap();
        let msg = PaddedPut {
            blocks: vec![block(i, 1)],
            padding: Bytes::from(vec![7u8; 32 << 20]),
        };
        let r: tonic::Response<pb::PutBlocksResponse> = grpc
            .unary(
                tonic::Request::new(msg),
                tonic::codegen::http::uri::PathAndQuery::from_static(
                    "/kvmesh.kvagent.v1.KvAgent/PutBlocks",
                ),
                tonic_prost::ProstCodec::default(),
            )
            .await
            .expect("put");
        assert_eq!(r.into_inner().stored, 1);
    }
    let mut c = agent.client().await;
    assert_eq!(stats(&mut c).await.ram_blocks, u64::from(requests));
    let grown = rss_bytes(agent.child.id()).saturating_sub(before);
    // Pinned, the 12 request buffers would hold 384 MiB; a few in flight are normal.
    assert!(
        grown < 160 << 20,
        "12 one-byte blocks grew the agent by {} MiB",
        grown >> 20
    );
}

/// Starts kvagent with `config` and waits (bounded) for it to exit; returns (success, stderr).
fn run_to_exit(config: &Path, ssd: &Path) -> (bool, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvagent"))
        .arg("--config")
        .arg(config)
        .env("KVAGENT_SSD_DIR", ssd)
        .env("KVAGENT_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("kvagent kept running on a busy port");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let mut text = String::from_utf8_lossy(&out.stderr).into_owned();
    text += &String::from_utf8_lossy(&out.stdout);
    (out.status.success(), text)
}

#[test]
fn a_busy_port_makes_kvagent_exit_naming_the_address_before_touching_the_ssd_dir() {
    let dir = tempfile::tempdir().unwrap();
    for key in ["listen", "metrics_listen"] {
        let busy = TcpListener::bind("127.0.0.1:0").unwrap();
        let busy_addr = busy.local_addr().unwrap();
        let other = format!("127.0.0.1:{}", free_port());
        let (listen, metrics) = if key == "listen" {
            (busy_addr.to_string(), other)
        } else {
            (other, busy_addr.to_string())
        };
        let config = dir.path().join(format!("{key}.toml"));
        std::fs::write(
            &config,
            format!("listen = \"{listen}\"\nmetrics_listen = \"{metrics}\"\n"),
        )
        .unwrap();
        let ssd = dir.path().join(format!("ssd-{key}"));
        let (ok, err) = run_to_exit(&config, &ssd);
        assert!(!ok, "{key}: exited 0 on a busy port: {err}");
        assert!(
            err.contains(&busy_addr.to_string()) && err.contains(&format!("({key})")),
            "{key}: the message does not name {busy_addr}: {err}"
        );
        assert!(!err.contains("serving"), "{key}: logged serving: {err}");
        assert!(
            !ssd.exists(),
            "{key}: the SSD directory was opened before the port was bound"
        );
        drop(busy);
    }
}

#[test]
fn check_config_rejects_a_bad_file_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("bad.toml");
    std::fs::write(&f, "[ram]\nhigh_watermark = 2.0\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvagent"))
        .arg("check-config")
        .arg(&f)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("high_watermark"), "{err}");
    let ok = Command::new(env!("CARGO_BIN_EXE_kvagent"))
        .arg("check-config")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../examples/kvagent.toml"
        ))
        .output()
        .unwrap();
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// With `auth.token_file`, a caller without the token (or with a wrong one) can neither write,
/// read nor delete; the read-only token reads but cannot write or delete; the engine's token
/// does everything. A listener beyond loopback without a token does not start.
#[tokio::test]
async fn tokens_gate_every_call() {
    let dir = tempfile::tempdir().unwrap();
    let engine_token = "engine-token-0123456789abcdef";
    let read_token = "reader-token-0123456789abcdef";
    std::fs::write(dir.path().join("engine.token"), format!("{engine_token}\n")).unwrap();
    std::fs::write(dir.path().join("read.token"), read_token).unwrap();
    let agent = Agent::start(
        dir.path(),
        &format!(
            "[auth]\ntoken_file = \"{}\"\nread_token_file = \"{}\"\n",
            dir.path().join("engine.token").display(),
            dir.path().join("read.token").display()
        ),
    )
    .await;
    let url = format!("http://127.0.0.1:{}", agent.port);
    let connect = |token: Option<&'static str>| {
        let url = url.clone();
        async move {
            kvagent::connect_with_token(url, 64 << 20, token)
                .await
                .unwrap()
        }
    };
    let mut engine = connect(Some(engine_token)).await;
    assert_eq!(put(&mut engine, vec![block(1, 1024)]).await.stored, 1);

    for (who, token, read_ok) in [
        ("no token", None, false),
        ("a wrong token", Some("not-the-token-0123456789"), false),
        ("the read-only token", Some(read_token), true),
    ] {
        let mut c = connect(token).await;
        let denied = if read_ok {
            Code::PermissionDenied
        } else {
            Code::Unauthenticated
        };
        let e = c
            .put_blocks(pb::PutBlocksRequest {
                blocks: vec![block(2, 1024)],
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), denied, "{who}: put");
        let e = c
            .delete(pb::DeleteRequest {
                digests: vec![],
                all: true,
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), denied, "{who}: delete");
        let got = c
            .get_blocks(pb::GetBlocksRequest {
                digests: vec![digest(1)],
            })
            .await;
        let lookup = c
            .lookup(pb::LookupRequest {
                digests: vec![digest(1)],
            })
            .await;
        let watch = c.watch_residency(pb::WatchResidencyRequest {}).await;
        if read_ok {
            assert!(
                got.is_ok() && lookup.is_ok() && watch.is_ok(),
                "{who}: reads"
            );
        } else {
            for (call, r) in [
                ("get", got.err()),
                ("lookup", lookup.err()),
                ("watch", watch.err()),
            ] {
                assert_eq!(
                    r.map(|e| e.code()),
                    Some(Code::Unauthenticated),
                    "{who}: {call}"
                );
            }
            let e = c.stats(pb::StatsRequest {}).await.unwrap_err();
            assert_eq!(e.code(), Code::Unauthenticated, "{who}: stats");
        }
    }
    // Nothing the refused callers sent landed: block 1 is there, block 2 is not.
    let entries = lookup(&mut engine, &[1, 2]).await;
    assert_eq!(
        entries.iter().map(|e| e.tier()).collect::<Vec<_>>(),
        [Tier::Ram, Tier::None]
    );
    assert_eq!(stats(&mut engine).await.ram_blocks, 1);

    // Beyond loopback without a token: refused at start, naming the fix.
    let cfg = dir.path().join("open.toml");
    std::fs::write(&cfg, "listen = \"0.0.0.0:0\"\nmetrics_listen = \"\"\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvagent"))
        .args(["check-config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("auth.token_file"), "{err}");
}

/// With `[tls]`, the port speaks TLS only: a client trusting the agent's CA works; plaintext and
/// a client trusting another CA get no service; with `require_client_cert`, a client without a
/// certificate of the client CA is refused at the handshake. SIGHUP reloads a replaced
/// certificate.
#[tokio::test]
async fn tls_port_serves_only_verified_clients_and_reloads() {
    use kvmesh_tls::testing::{Ca, Validity};
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("kvagent test CA");
    let other = Ca::new("another CA");
    let (cert, key) = ca
        .leaf("kvagent", &["127.0.0.1"], &[], Validity::Now)
        .write(dir.path(), "server");
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, &ca.pem).unwrap();
    let other_file = dir.path().join("other.pem");
    std::fs::write(&other_file, &other.pem).unwrap();
    let (ccert, ckey) = ca
        .leaf("engine", &["engine.local"], &[], Validity::Now)
        .write(dir.path(), "client");
    let agent = Agent::start(
        dir.path(),
        &format!(
            "[tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\nclient_ca_file = \"{}\"\nrequire_client_cert = true\nreload_interval_secs = 3600\n",
            cert.display(),
            key.display(),
            ca_file.display()
        ),
    )
    .await;
    let https = format!("https://127.0.0.1:{}", agent.port);
    let tls = |ca: &std::path::Path, with_cert: bool| kvagent::ClientTls {
        ca_file: ca.display().to_string(),
        cert_file: if with_cert {
            ccert.display().to_string()
        } else {
            String::new()
        },
        key_file: if with_cert {
            ckey.display().to_string()
        } else {
            String::new()
        },
    };
    let mut ok = kvagent::connect_with(https.clone(), 64 << 20, None, Some(&tls(&ca_file, true)))
        .await
        .unwrap();
    assert_eq!(put(&mut ok, vec![block(7, 512)]).await.stored, 1);
    assert_eq!(stats(&mut ok).await.ram_blocks, 1);

    // Plaintext, another CA, no client certificate: no call gets through.
    let refused = |what: &'static str, r: Result<kvagent::Client, kvagent::ConnectError>| async move {
        if let Ok(mut c) = r {
            let r = c.stats(pb::StatsRequest {}).await;
            assert!(r.is_err(), "{what}: a call got through");
        }
    };
    refused(
        "plaintext",
        kvagent::connect(format!("http://127.0.0.1:{}", agent.port), 64 << 20).await,
    )
    .await;
    refused(
        "another CA",
        kvagent::connect_with(https.clone(), 64 << 20, None, Some(&tls(&other_file, true))).await,
    )
    .await;
    refused(
        "no client certificate",
        kvagent::connect_with(https.clone(), 64 << 20, None, Some(&tls(&ca_file, false))).await,
    )
    .await;

    // The certificate replaced by one of the other CA, and SIGHUP: new connections need that CA.
    let rotated = other.leaf("kvagent", &["127.0.0.1"], &[], Validity::Now);
    std::fs::write(&key, &rotated.key_pem).unwrap();
    std::fs::write(&cert, &rotated.cert_pem).unwrap();
    Command::new("kill")
        .args(["-HUP", &agent.child.id().to_string()])
        .status()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let c = kvagent::connect_with(https.clone(), 64 << 20, None, Some(&tls(&other_file, true)))
            .await;
        if let Ok(mut c) = c {
            if c.stats(pb::StatsRequest {}).await.is_ok() {
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "the reloaded certificate was not served"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(agent_alive(&agent), "SIGHUP ended the agent");
}

fn agent_alive(agent: &Agent) -> bool {
    Command::new("kill")
        .args(["-0", &agent.child.id().to_string()])
        .status()
        .unwrap()
        .success()
}

/// An agent address that accepts TCP and never answers the TLS ClientHello: connecting gives
/// up with `Timeout` rather than holding its caller (the proxy's residency feed, the engine's
/// page-in client) forever. tonic's own connect timeout covers the TCP connect only.
#[tokio::test]
async fn connecting_to_a_peer_that_never_answers_the_tls_handshake_gives_up() {
    use kvmesh_tls::testing::Ca;
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("kvmesh test CA");
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, &ca.pem).unwrap();
    let tarpit = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = tarpit.local_addr().unwrap().port();
    // Accepts and holds every connection, reading nothing.
    let held = tokio::spawn(async move {
        let mut conns = Vec::new();
        while let Ok((c, _)) = tarpit.accept().await {
            conns.push(c);
        }
    });
    let tls = kvagent::ClientTls {
        ca_file: ca_file.display().to_string(),
        cert_file: String::new(),
        key_file: String::new(),
    };
    let connecting = kvagent::connect_with(
        format!("https://127.0.0.1:{port}"),
        64 << 20,
        None,
        Some(&tls),
    );
    // Far past the bound: before it, this waited forever.
    let outcome = tokio::time::timeout(kvagent::CONNECT_TIMEOUT * 6, connecting)
        .await
        .expect("connecting to a peer that never answers the handshake never gave up");
    assert!(
        matches!(outcome, Err(kvagent::ConnectError::Timeout)),
        "expected a connection timeout, got {:?}",
        outcome.map(|_| "a client")
    );
    held.abort();
}

/// tonic reserves a message's declared length at its 5-byte prefix and keeps that buffer until
/// the request ends, so calls that declare large messages and send nothing more are charged
/// to `limits.message_budget_bytes` from the prefix: past it, `ResourceExhausted`.
#[tokio::test]
async fn calls_that_declare_large_messages_are_charged_to_the_message_budget() {
    use kvmesh_grpc::testing::{await_answers, still_open, RawCall};
    const PUT: &str = "/kvmesh.kvagent.v1.KvAgent/PutBlocks";
    const CALLS: usize = 64;
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(
        dir.path(),
        "[limits]\nmax_block_bytes = 65536\nmax_message_bytes = 1048576\n\
         message_budget_bytes = 4194304\n",
    )
    .await;
    let channel = agent.channel().await;
    // Each declares a message a little under the limit and sends nothing more: each is charged
    // more than that message and less than that message and 64 KiB, so 3 (at most 4) fit.
    let declared = (1u32 << 20) - 64;
    let mut calls = Vec::new();
    for _ in 0..CALLS {
        let mut c = RawCall::open(&channel, PUT).await;
        c.declare(declared).await;
        calls.push(c);
    }
    let fit = (4 << 20) / (declared as usize + 5);
    let answered = await_answers(&calls, CALLS - fit, Duration::from_secs(10)).await;
    assert!(
        answered >= CALLS - fit,
        "{answered} of {CALLS} calls answered; all but {fit} must be refused"
    );
    let gauge = |m: &str| {
        m.lines()
            .find_map(|l| l.strip_prefix("kvagent_message_bytes "))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .expect("kvagent_message_bytes")
    };
    let held = gauge(&agent.metrics());
    assert!(held <= 4 << 20 && held >= 3 * u64::from(declared), "{held}");
    let holding = still_open(calls, Code::ResourceExhausted).await;
    assert!(holding.len() <= fit);
    // Their charge goes back as they end; a put is served again.
    drop(holding);
    let deadline = Instant::now() + Duration::from_secs(10);
    while gauge(&agent.metrics()) != 0 {
        assert!(Instant::now() < deadline, "the charge never went back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut c = agent.client().await;
    assert_eq!(put(&mut c, vec![block(1, 1000)]).await.stored, 1);
    // Every method takes one message: a second would make tonic keep the first (whose
    // payloads point into its buffer) and reserve again.
    let mut two = RawCall::open(&channel, "/kvmesh.kvagent.v1.KvAgent/Stats").await;
    two.send(vec![0, 0, 0, 0, 0, 0]).await;
    let code = two.answer(Duration::from_secs(5)).await.unwrap();
    assert_eq!(code, Code::InvalidArgument);
    // The health service on the same port takes a service name, not 4 MiB, and one of them.
    let mut check = RawCall::open(&channel, "/grpc.health.v1.Health/Check").await;
    check.declare(2048).await;
    let code = check.answer(Duration::from_secs(5)).await.unwrap();
    assert_eq!(code, Code::OutOfRange);
    let mut checks = RawCall::open(&channel, "/grpc.health.v1.Health/Check").await;
    checks.send(vec![0; 10]).await;
    let code = checks.answer(Duration::from_secs(5)).await.unwrap();
    assert_eq!(code, Code::InvalidArgument);
}
