//! `kvmesh-bench gossip`: residency convergence time and gossip bandwidth for N proxies.
//!
//! Runs N real gossip nodes (`kvmesh-cluster` on chitchat, real UDP sockets on loopback) in this
//! process, each with its own residency index holding `blocks` digests for its own engine, and
//! each running the proxy's loop: publish the record, re-encode residency only when the set
//! changed, apply peers' state. Measures:
//! - time until every node has every other node's full residency (initial sync);
//! - time until one more node joining the converged cluster holds every node's residency, by
//!   gossip alone, then with a bulk transfer from its seed (`cluster.bulk_sync`);
//! - steady-state gossip bytes per node per second (no changes), over `steady` seconds;
//! - convergence of one change: node 0 adds a 16-block chain; the time until every other node's
//!   index shows all 16 blocks for node 0 (median and max of `changes` trials).
//!
//! Each size runs twice in one invocation: with sealed gossip (the default: ChaCha20-Poly1305
//! frames through the loopback relays) and with plaintext gossip, the baseline the sealed run
//! is compared against.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_cluster::shards::SHARDS;
use kvmesh_cluster::{
    Cluster, ClusterConfig, GossipSecurity, Keyring, Membership, NodeRecord, ResidencySync,
};
use kvmesh_filters::chain::{text_chain, Namespace};
use kvmesh_filters::residency::{NodeId, ResidencyConfig, ResidencyIndex, Source};
use parking_lot::Mutex;

/// What to run.
#[derive(Debug, Clone)]
pub struct GossipBench {
    /// Cluster sizes.
    pub nodes: Vec<usize>,
    /// Resident digests per node.
    pub blocks: usize,
    /// Gossip interval, milliseconds (the proxy's default is 200).
    pub interval_ms: u64,
    /// Seconds of steady state measured.
    pub steady_secs: u64,
    /// Single-change trials.
    pub changes: usize,
    /// Whether the cluster's nodes serve and pull bulk transfers (the joiners measured run
    /// without and with one regardless; without it, the bulk joiner has no server to pull from).
    pub bulk_sync: bool,
}

/// The node's own engine in its index.
const OWN: NodeId = NodeId(0);

/// Peers get node ids from 1 up, in order of first sight.
#[derive(Default)]
struct Ids(Mutex<Vec<String>>);

impl Membership for Ids {
    fn upsert(&self, r: &NodeRecord, _origin: &kvmesh_cluster::PeerOrigin) -> Option<NodeId> {
        let mut ids = self.0.lock();
        let i = ids.iter().position(|n| *n == r.node_id).unwrap_or_else(|| {
            ids.push(r.node_id.clone());
            ids.len() - 1
        });
        Some(NodeId(1 + i as u32))
    }
    fn remove(&self, _: &str, _: NodeId) {}
}

struct Node {
    cluster: Cluster,
    index: ResidencyIndex,
    ids: Ids,
    sync: tokio::sync::Mutex<ResidencySync>,
    record: NodeRecord,
}

impl Node {
    /// One round of the proxy's gossip loop.
    async fn tick(&self) {
        self.cluster.publish_record(&self.record).await;
        self.cluster
            .publish_residency_of(&self.index, Some(OWN))
            .await;
        let mut sync = self.sync.lock().await;
        sync.sync(&self.cluster, &self.index, &self.ids).await;
    }

    /// Digests this node holds for peers.
    fn peer_entries(&self) -> usize {
        self.index
            .nodes()
            .into_iter()
            .filter(|n| *n != OWN)
            .map(|n| self.index.node_usage(n).0)
            .sum()
    }
}

/// The gossip configuration of a node of the `n`-node bench cluster (room for the joiners).
#[allow(clippy::too_many_arguments)]
fn node_config(
    n: usize,
    node_id: String,
    port: u16,
    seed: u16,
    interval: Duration,
    keyring: &Keyring,
    sealed: bool,
    bulk_sync: bool,
) -> anyhow::Result<ClusterConfig> {
    let addr = format!("127.0.0.1:{port}").parse()?;
    Ok(ClusterConfig {
        cluster_id: format!("bench-{n}"),
        node_id,
        listen: addr,
        advertise: addr,
        seeds: vec![format!("127.0.0.1:{seed}")],
        gossip_interval: interval,
        phi_threshold: 8.0,
        dead_node_grace: Duration::from_secs(60),
        security: if sealed {
            GossipSecurity::sealed(keyring.clone())
        } else {
            GossipSecurity::plaintext()
        },
        max_peers: n + 2,
        bulk_sync,
        bulk_max_bytes: kvmesh_cluster::bulk::DEFAULT_MAX_BYTES,
        residency_full: kvmesh_cluster::FullPublication::default(),
    })
}

/// Joins one more node (no residency of its own) to the running cluster of `n` seeded at
/// `seed`; returns the seconds until its index holds all `n` nodes' residency.
async fn join_time(
    b: &GossipBench,
    n: usize,
    seed: u16,
    keyring: &Keyring,
    sealed: bool,
    bulk: bool,
) -> anyhow::Result<f64> {
    let interval = Duration::from_millis(b.interval_ms);
    let start = Instant::now();
    let node_id = format!("joiner-{}", if bulk { "bulk" } else { "gossip" });
    let port = crate::procs::gossip_port()?;
    let cfg = node_config(
        n,
        node_id.clone(),
        port,
        seed,
        interval,
        keyring,
        sealed,
        bulk,
    )?;
    let cluster = Cluster::join(cfg).await?;
    let node = Node {
        cluster,
        index: ResidencyIndex::new(ResidencyConfig {
            capacity_per_node: b.blocks * 2,
            ..Default::default()
        }),
        ids: Ids::default(),
        sync: tokio::sync::Mutex::new(ResidencySync::new()),
        record: NodeRecord {
            node_id,
            proxy_url: "http://127.0.0.1:9".into(),
            engine_url: "http://127.0.0.1:9".into(),
            models: vec!["m".into()],
            role: "both".into(),
            kv_epoch: 1,
            ready: true,
            ..Default::default()
        },
    };
    let want = n * b.blocks;
    let deadline = start + Duration::from_secs(600);
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while node.peer_entries() < want {
        anyhow::ensure!(
            Instant::now() < deadline,
            "a joining node did not learn the cluster in 600 s"
        );
        tick.tick().await;
        node.tick().await;
    }
    let secs = start.elapsed().as_secs_f64();
    if bulk {
        anyhow::ensure!(
            node.cluster.bulk_stats().pulled() == 1,
            "the bulk join did not pull a transfer"
        );
    }
    node.cluster.shutdown().await;
    Ok(secs)
}

/// Runs every cluster size; returns the Markdown table.
pub async fn run(b: &GossipBench) -> anyhow::Result<String> {
    let mut out = String::from(
        "| nodes | gossip | blocks/node | initial sync s | join, gossip only s | join, bulk transfer s | change p50 s | change max s | steady bytes/s/node (out+in) | steady out bytes/s/node |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for &n in &b.nodes {
        for sealed in [true, false] {
            let row = one(b, n, sealed).await?;
            eprintln!("{row}");
            out += &row;
            out += "\n";
        }
    }
    out += &format!(
        "\ngossip interval {} ms; shards of {SHARDS}, 8-byte digests, base64; nodes in one process, real UDP on loopback; cluster nodes' bulk_sync = {} (a join: one more node, the time until it holds every node's residency).\n",
        b.interval_ms, b.bulk_sync
    );
    Ok(out)
}

async fn one(b: &GossipBench, n: usize, sealed: bool) -> anyhow::Result<String> {
    let interval = Duration::from_millis(b.interval_ms);
    let seed = crate::procs::gossip_port()?;
    let keyring = Keyring::from_base64(&[Keyring::generate_base64()])?;
    let mut nodes = Vec::new();
    for i in 0..n {
        let port = if i == 0 {
            seed
        } else {
            crate::procs::gossip_port()?
        };
        let cfg = node_config(
            n,
            format!("node-{i}"),
            port,
            seed,
            interval,
            &keyring,
            sealed,
            b.bulk_sync,
        )?;
        let cluster = Cluster::join(cfg).await?;
        let index = ResidencyIndex::new(ResidencyConfig {
            capacity_per_node: b.blocks * 2,
            ..Default::default()
        });
        let mut rng = fastrand::Rng::with_seed(i as u64 + 1);
        let keys: Vec<u64> = (0..b.blocks).map(|_| rng.u64(..)).collect();
        index.record_keys(OWN, keys, Source::Reported, Instant::now());
        nodes.push(Arc::new(Node {
            cluster,
            index,
            ids: Ids::default(),
            sync: tokio::sync::Mutex::new(ResidencySync::new()),
            record: NodeRecord {
                node_id: format!("node-{i}"),
                proxy_url: format!("http://127.0.0.1:{}", 10_000 + i),
                engine_url: format!("http://127.0.0.1:{}", 20_000 + i),
                models: vec!["m".into()],
                role: "both".into(),
                kv_epoch: 1,
                ready: true,
                ..Default::default()
            },
        }));
    }
    // Each node runs the proxy's loop on its own task.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut loops = tokio::task::JoinSet::new();
    for node in &nodes {
        let (node, stop) = (node.clone(), stop.clone());
        loops.spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                tick.tick().await;
                node.tick().await;
            }
        });
    }
    let start = Instant::now();
    let want = (n - 1) * b.blocks;
    let deadline = start + Duration::from_secs(600);
    while nodes.iter().any(|x| x.peer_entries() < want) {
        anyhow::ensure!(
            Instant::now() < deadline,
            "{n} nodes did not converge in 600 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let initial = start.elapsed();

    // Steady state: nothing changes; count bytes.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before: Vec<(u64, u64)> = nodes
        .iter()
        .map(|x| {
            (
                x.cluster.stats().bytes_sent(),
                x.cluster.stats().bytes_received(),
            )
        })
        .collect();
    let t = Instant::now();
    tokio::time::sleep(Duration::from_secs(b.steady_secs)).await;
    let secs = t.elapsed().as_secs_f64();
    let (mut out_sum, mut both_sum) = (0u64, 0u64);
    for (x, (s0, r0)) in nodes.iter().zip(before) {
        let s = x.cluster.stats().bytes_sent() - s0;
        let r = x.cluster.stats().bytes_received() - r0;
        out_sum += s;
        both_sum += s + r;
    }
    let steady_both = both_sum as f64 / n as f64 / secs;
    let steady_out = out_sum as f64 / n as f64 / secs;

    // One change at a time on node 0: a new 16-block chain.
    let mut times = Vec::new();
    for trial in 0..b.changes {
        let chain = text_chain(
            &Namespace::new("m", format!("trial {trial}").as_bytes()),
            &[b'z'; 256 * 16],
            256,
        );
        let t = Instant::now();
        nodes[0]
            .index
            .record(OWN, &chain, Source::Reported, Instant::now());
        let deadline = t + Duration::from_secs(60);
        loop {
            let seen = nodes[1..].iter().all(|x| {
                x.index
                    .overlap(&chain, Instant::now())
                    .iter()
                    .any(|(_, blocks)| *blocks == 16)
            });
            if seen {
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "a change did not converge in 60 s"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        times.push(t.elapsed().as_secs_f64());
        tokio::time::sleep(interval * 2).await;
    }
    times.sort_by(f64::total_cmp);

    // A node joining the converged cluster (a restart is the same for the learner): the time
    // until it holds every node's residency, by gossip alone, then with a bulk transfer.
    let mut joins = Vec::new();
    for bulk in [false, true] {
        joins.push(if bulk && !b.bulk_sync {
            // No node serves a transfer to pull.
            "n/a".to_string()
        } else {
            format!(
                "{:.2}",
                join_time(b, n, seed, &keyring, sealed, bulk).await?
            )
        });
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    while loops.join_next().await.is_some() {}
    for node in nodes {
        if let Ok(node) = Arc::try_unwrap(node) {
            node.cluster.shutdown().await;
        }
    }
    Ok(format!(
        "| {n} | {} | {} | {:.2} | {} | {} | {:.2} | {:.2} | {:.0} | {:.0} |",
        if sealed { "sealed" } else { "plaintext" },
        b.blocks,
        initial.as_secs_f64(),
        joins[0],
        joins[1],
        times.get(times.len() / 2).copied().unwrap_or(0.0),
        times.last().copied().unwrap_or(0.0),
        steady_both,
        steady_out
    ))
}
