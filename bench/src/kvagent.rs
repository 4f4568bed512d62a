//! `kvmesh-bench kvagent`: kvagent's data path against plain baselines measured in the same run.
//!
//! - `GetBlocks` from the RAM tier over loopback gRPC (a real `kvagent` process) vs an in-process
//!   copy of the same bytes;
//! - `Lookup` of 1,000 digests: latency percentiles;
//! - spill (RAM -> block files) and promote (block files -> RAM) through the store itself vs one
//!   plain sequential file write/read of the same bytes in the same directory.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use kvagent::metrics::Metrics;
use kvagent::pb;
use kvagent::store::{Block, BlockStore, StoreConfig};
use kvmesh_filters::chain::Digest;

use crate::load::percentiles;
use crate::procs;

/// What to run.
#[derive(Debug, Clone)]
pub struct KvagentBench {
    /// Directory for block files and the baseline file (the disk being measured).
    pub dir: PathBuf,
    /// Payload MiB moved per measurement.
    pub total_mib: usize,
    /// Rounds of each `GetBlocks` measurement (the best is reported).
    pub rounds: usize,
}

const MIB: f64 = 1024.0 * 1024.0;

fn digest(i: usize, size: usize) -> Digest {
    Digest(*blake3::hash(format!("bench {size} {i}").as_bytes()).as_bytes())
}

fn payload(i: usize, size: usize) -> Bytes {
    let mut v = vec![0u8; size];
    let mut x = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for chunk in v.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
    Bytes::from(v)
}

/// Runs every measurement and returns the Markdown tables.
pub async fn run(b: &KvagentBench) -> anyhow::Result<String> {
    std::fs::create_dir_all(&b.dir).with_context(|| format!("creating {}", b.dir.display()))?;
    let mut out = String::new();
    out += &grpc_tables(b).await?;
    out += "\n";
    out += &disk_table(b).await?;
    Ok(out)
}

async fn grpc_tables(b: &KvagentBench) -> anyhow::Result<String> {
    let total = b.total_mib << 20;
    let agent = procs::kvagent(
        &b.dir.join("agent"),
        &format!(
            "[ram]\ncapacity_bytes = {}\n[ssd]\ncapacity_bytes = 0\n[limits]\nmax_block_bytes = 8388608\nmax_message_bytes = 67108864\n",
            2 * total + (64 << 20)
        ),
    )
    .await?;
    let mut c = kvagent::connect(format!("http://{}", agent.addr), 64 << 20).await?;
    let mut out = String::from(
        "| block size | blocks | GetBlocks MB/s | in-process copy MB/s | GetBlocks / copy |\n|---:|---:|---:|---:|---:|\n",
    );
    for size in [64 << 10, 1 << 20, 8 << 20] {
        let n = (total / size).max(1);
        let payloads: Vec<Bytes> = (0..n).map(|i| payload(i, size)).collect();
        // Puts in messages of at most 32 MiB.
        let per_put = ((32 << 20) / size).max(1);
        for (chunk_no, chunk) in payloads.chunks(per_put).enumerate() {
            let blocks = chunk
                .iter()
                .enumerate()
                .map(|(j, p)| pb::Block {
                    digest: Bytes::copy_from_slice(&digest(chunk_no * per_put + j, size).0),
                    model: "bench".into(),
                    token_count: 16,
                    payload: p.clone(),
                })
                .collect();
            c.put_blocks(pb::PutBlocksRequest { blocks }).await?;
        }
        let digests: Vec<Bytes> = (0..n)
            .map(|i| Bytes::copy_from_slice(&digest(i, size).0))
            .collect();
        let mut best_grpc = Duration::MAX;
        for _ in 0..b.rounds {
            let t = Instant::now();
            let mut got = 0usize;
            for ds in digests.chunks(4096) {
                let mut s = c
                    .get_blocks(pb::GetBlocksRequest {
                        digests: ds.to_vec(),
                    })
                    .await?
                    .into_inner();
                while let Some(m) = s.message().await? {
                    got += m.block.map(|b| b.payload.len()).unwrap_or(0);
                }
            }
            best_grpc = best_grpc.min(t.elapsed());
            anyhow::ensure!(
                got == n * size,
                "GetBlocks returned {got} of {} bytes",
                n * size
            );
        }
        // Baseline: copy the same payloads into one preallocated buffer (a memcpy per block).
        let mut dst = vec![0u8; n * size];
        let mut best_copy = Duration::MAX;
        for _ in 0..b.rounds {
            let t = Instant::now();
            for (i, p) in payloads.iter().enumerate() {
                dst[i * size..(i + 1) * size].copy_from_slice(p);
            }
            std::hint::black_box(&dst);
            best_copy = best_copy.min(t.elapsed());
        }
        let bytes = (n * size) as f64;
        let grpc = bytes / MIB / best_grpc.as_secs_f64();
        let copy = bytes / MIB / best_copy.as_secs_f64();
        out += &format!(
            "| {} KiB | {n} | {grpc:.0} | {copy:.0} | {:.3} |\n",
            size >> 10,
            grpc / copy
        );
        c.delete(pb::DeleteRequest {
            digests: vec![],
            all: true,
        })
        .await?;
    }

    // Lookup: 1,000 digests per call, 4,096 resident.
    let resident: Vec<pb::Block> = (0..4096)
        .map(|i| pb::Block {
            digest: Bytes::copy_from_slice(&digest(i, 1).0),
            model: "bench".into(),
            token_count: 16,
            payload: Bytes::from_static(b"x"),
        })
        .collect();
    c.put_blocks(pb::PutBlocksRequest { blocks: resident })
        .await?;
    out += "\n| Lookup, 2,000 calls (half the digests resident) | p50 us | p90 us | p99 us |\n|---|---:|---:|---:|\n";
    for per_call in [1usize, 1000] {
        let mut lat = Vec::new();
        for call in 0..2000usize {
            let digests: Vec<Bytes> = (0..per_call)
                .map(|j| Bytes::copy_from_slice(&digest((call * 7 + j * 13) % 8192, 1).0))
                .collect();
            let t = Instant::now();
            let r = c.lookup(pb::LookupRequest { digests }).await?.into_inner();
            lat.push(t.elapsed().as_secs_f64() * 1e6);
            anyhow::ensure!(
                r.entries.len() == per_call,
                "Lookup answered {} entries",
                r.entries.len()
            );
        }
        let p = percentiles(lat);
        out += &format!(
            "| {per_call} digest(s) per call, loopback gRPC | {:.0} | {:.0} | {:.0} |\n",
            p[0], p[1], p[2]
        );
    }
    // The store's own share: the same lookups in process, no RPC.
    let store = BlockStore::open(
        StoreConfig {
            ram_capacity: 1 << 30,
            ram_high: 1 << 30,
            ram_low: 1 << 29,
            ssd_capacity: 0,
            ssd_ttl: Duration::from_secs(3600),
            max_block_bytes: 1 << 20,
        },
        None,
        Arc::new(Metrics::new()),
    )?;
    for i in 0..4096 {
        store
            .put(vec![Block {
                digest: digest(i, 1),
                model: "bench".into(),
                token_count: 16,
                payload: Bytes::from_static(b"x"),
            }])
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    let mut lat = Vec::new();
    for call in 0..2000usize {
        let digests: Vec<Digest> = (0..1000)
            .map(|j| digest((call * 7 + j * 13) % 8192, 1))
            .collect();
        let t = Instant::now();
        std::hint::black_box(store.lookup(&digests));
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let p = percentiles(lat);
    out += &format!(
        "| 1000 digests per call, in-process store (no RPC) | {:.0} | {:.0} | {:.0} |\n",
        p[0], p[1], p[2]
    );
    Ok(out)
}

async fn disk_table(b: &KvagentBench) -> anyhow::Result<String> {
    let total = b.total_mib << 20;
    let mut out = String::from(
        "| what | block size | fsync | MB/s | plain sequential MB/s | ratio |\n|---|---:|---|---:|---:|---:|\n",
    );
    for (size, fsync) in [
        (64 << 10, true),
        (256 << 10, true),
        (1 << 20, true),
        (64 << 10, false),
        (1 << 20, false),
    ] {
        let n = (total / size).max(1);
        let bytes = (n * size) as f64;
        let dir = b.dir.join(format!("store-{size}-{fsync}"));
        let _ = std::fs::remove_dir_all(&dir);
        let store = BlockStore::open(
            StoreConfig {
                ram_capacity: 2 * total as u64 + (64 << 20),
                ram_high: u64::MAX,
                ram_low: u64::MAX,
                ssd_capacity: 4 * total as u64,
                ssd_ttl: Duration::from_secs(3600),
                max_block_bytes: size as u64,
            },
            Some((&dir, fsync)),
            Arc::new(Metrics::new()),
        )?;
        for i in 0..n {
            store
                .put(vec![Block {
                    digest: digest(i, size),
                    model: "bench".into(),
                    token_count: 16,
                    payload: payload(i, size),
                }])
                .await
                .map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        let t = Instant::now();
        store.flush().await;
        let spill = bytes / MIB / t.elapsed().as_secs_f64();
        anyhow::ensure!(store.occupancy().2 == n as u64, "not every block spilled");
        let t = Instant::now();
        for i in 0..n {
            let (blk, _) = store
                .get(digest(i, size))
                .await
                .context("a spilled block was not served")?;
            anyhow::ensure!(blk.payload.len() == size);
        }
        let promote = bytes / MIB / t.elapsed().as_secs_f64();
        anyhow::ensure!(store.occupancy().0 == n as u64, "not every block promoted");
        let (seq_write, seq_read) = sequential(&dir, n, size, fsync)?;
        out += &format!(
            "| spill | {} KiB | {fsync} | {spill:.0} | {seq_write:.0} | {:.2} |\n",
            size >> 10,
            spill / seq_write
        );
        out += &format!(
            "| promote | {} KiB | {fsync} | {promote:.0} | {seq_read:.0} | {:.2} |\n",
            size >> 10,
            promote / seq_read
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(out)
}

/// One file written sequentially with the same bytes (one fsync at the end when `fsync`), then
/// read back: MB/s of each.
fn sequential(dir: &Path, n: usize, size: usize, fsync: bool) -> anyhow::Result<(f64, f64)> {
    use std::io::{Read, Write};
    let path = dir.join("sequential.bin");
    let payloads: Vec<Bytes> = (0..n).map(|i| payload(i, size)).collect();
    let bytes = (n * size) as f64;
    let t = Instant::now();
    let mut f = std::fs::File::create(&path)?;
    for p in &payloads {
        f.write_all(p)?;
    }
    if fsync {
        f.sync_data()?;
    }
    drop(f);
    let write = bytes / MIB / t.elapsed().as_secs_f64();
    let t = Instant::now();
    let mut f = std::fs::File::open(&path)?;
    let mut buf = vec![0u8; size];
    for _ in 0..n {
        f.read_exact(&mut buf)?;
        std::hint::black_box(&buf);
    }
    let read = bytes / MIB / t.elapsed().as_secs_f64();
    std::fs::remove_file(&path)?;
    Ok((write, read))
}
