//! Three nodes gossiping over real UDP on loopback, each with its own residency index.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvmesh_cluster::{Cluster, ClusterConfig, Membership, NodeRecord, ResidencySync};
use kvmesh_filters::chain::{text_chain, Namespace};
use kvmesh_filters::residency::{NodeId, ResidencyConfig, ResidencyIndex, Source};

/// Peers get node ids from 100 up, by node id.
#[derive(Default)]
struct Members {
    known: Mutex<Vec<String>>,
    removed: Mutex<Vec<String>>,
}

impl Membership for Members {
    fn upsert(&self, record: &NodeRecord) -> Option<NodeId> {
        let mut k = self.known.lock().unwrap();
        let i = match k.iter().position(|n| *n == record.node_id) {
            Some(i) => i,
            None => {
                k.push(record.node_id.clone());
                k.len() - 1
            }
        };
        Some(NodeId(100 + i as u32))
    }
    fn remove(&self, node_id: &str, _node: NodeId) {
        self.removed.lock().unwrap().push(node_id.to_string());
    }
}

fn udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Node {
    cluster: Cluster,
    index: ResidencyIndex,
    sync: ResidencySync,
    members: Members,
    record: NodeRecord,
}

async fn node(name: &str, port: u16, seed: u16) -> Node {
    let addr = format!("127.0.0.1:{port}").parse().unwrap();
    let cluster = Cluster::join(ClusterConfig {
        cluster_id: "test".into(),
        node_id: name.into(),
        listen: addr,
        advertise: addr,
        seeds: vec![format!("127.0.0.1:{seed}")],
        gossip_interval: Duration::from_millis(50),
        phi_threshold: 8.0,
        dead_node_grace: Duration::from_secs(60),
    })
    .await
    .unwrap();
    Node {
        cluster,
        index: ResidencyIndex::new(ResidencyConfig::default()),
        sync: ResidencySync::new(),
        members: Members::default(),
        record: NodeRecord {
            node_id: name.into(),
            proxy_url: format!("http://{name}"),
            engine_url: format!("http://{name}-engine"),
            models: vec!["m".into()],
            role: "both".into(),
            kv_epoch: 1,
            ready: true,
            ..Default::default()
        },
    }
}

impl Node {
    async fn tick(&mut self) {
        let own = self.index.node_keys(NodeId(0), 1_000_000);
        self.cluster.publish_record(&self.record).await;
        self.cluster.publish_residency(&own).await;
        self.sync
            .sync(&self.cluster, &self.index, &self.members)
            .await;
    }
}

async fn until(nodes: &mut [Node], what: &str, mut done: impl FnMut(&[Node]) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done(nodes) {
        assert!(Instant::now() < deadline, "timed out: {what}");
        for n in nodes.iter_mut() {
            n.tick().await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn residency_spreads_is_withdrawn_and_dies_with_its_node_or_epoch() {
    let ports = [udp_port(), udp_port(), udp_port()];
    let mut nodes = vec![
        node("a", ports[0], ports[0]).await,
        node("b", ports[1], ports[0]).await,
        node("c", ports[2], ports[0]).await,
    ];
    let ns = Namespace::new("m", b"");
    let chain = text_chain(&ns, &[b'x'; 256 * 40], 256);
    // "c" serves a 40-block prompt; its own index says so (node 0 = its own engine).
    nodes[2]
        .index
        .record(NodeId(0), &chain, Source::Reported, Instant::now());
    until(&mut nodes, "a and b learn c's residency", |n| {
        n[..2].iter().all(|x| {
            x.index
                .overlap(&chain, Instant::now())
                .iter()
                .any(|(_, b)| *b == 40)
        })
    })
    .await;
    let c_on_a = nodes[0].index.overlap(&chain, Instant::now())[0].0;

    // "c" evicts the tail half: the others see the withdrawal.
    let tail: Vec<u64> = chain[20..].iter().map(|d| d.short()).collect();
    nodes[2].index.remove_keys(NodeId(0), tail);
    until(&mut nodes, "withdrawal spreads", |n| {
        n[0].index.overlap(&chain, Instant::now()) == vec![(c_on_a, 20)]
    })
    .await;

    // New kv_epoch: everything "c" had published before is dropped at once.
    nodes[2].record.kv_epoch = 2;
    nodes[2].index.drop_node(NodeId(0));
    until(&mut nodes, "epoch change drops c's entries", |n| {
        n[0].index.overlap(&chain, Instant::now()).is_empty()
            && n[1].index.overlap(&chain, Instant::now()).is_empty()
    })
    .await;

    // "c" publishes again, then dies: its entries go with it.
    nodes[2]
        .index
        .record(NodeId(0), &chain, Source::Reported, Instant::now());
    until(&mut nodes, "re-learn", |n| {
        !n[0].index.overlap(&chain, Instant::now()).is_empty()
    })
    .await;
    let c = nodes.pop().unwrap();
    c.cluster.shutdown().await;
    until(&mut nodes, "failure detector drops c", |n| {
        n.iter()
            .all(|x| x.index.overlap(&chain, Instant::now()).is_empty())
    })
    .await;
    assert!(nodes[0]
        .members
        .removed
        .lock()
        .unwrap()
        .contains(&"c".to_string()));
    assert_eq!(nodes[0].cluster.live_peers().await, 1);
    assert!(nodes[0].cluster.stats().bytes_received() > 0);
}
