//! The kvagent feed: the proxy follows an engine's kvagent `WatchResidency` stream and records
//! the digests it lists as the engine's `engine_feed` residency.
//!
//! The agent sends a snapshot first (`reset`), then changes; its `kv_epoch` names one lifetime
//! of its store. What the feed recorded is withdrawn when a snapshot starts over, when the
//! epoch changes (the agent restarted or was cleared), and when the stream is lost.
//!
//! A digest that is not 32 bytes is skipped and counted (`malformed`). A connection is given
//! up after 5 s, and an idle stream is pinged every 10 s (a dead agent or path is noticed
//! within 15 s). Pings do not show a stream that stopped in the middle of a message while the
//! agent's HTTP/2 still answers them, so the stream must also deliver whole messages: its
//! first within [`FIRST_MESSAGE`], and then, from an agent that announces a heartbeat
//! (`heartbeat_ms`: it sends an empty message when nothing changes), one within
//! [`STALL_HEARTBEATS`] heartbeats.

use async_trait::async_trait;
use kvmesh_filters::chain::Digest;

use super::{event, FedSet, Follow};
use crate::config::{EngineConfig, UpstreamConfig};

/// Largest `WatchResidency` message accepted (the agent sends at most ~2.3 MB). Kept close to
/// that: an empty `bytes` entry is 2 bytes on the wire and a 32-byte `Bytes` once decoded.
const MAX_MESSAGE_BYTES: usize = 3 << 20;
// The agent's largest update (32 bytes and 2 of framing a digest, and its few other fields)
// must fit: raising the agent's batch past this limit would cut every feed.
const _: () = assert!(kvagent::service::DIGESTS_PER_UPDATE * 34 + 4096 <= MAX_MESSAGE_BYTES);
/// Longest wait for the agent to answer the `WatchResidency` call (its first headers): an
/// agent whose HTTP/2 still answers pings but whose service hangs is retried, not waited on.
const WATCH_ANSWER: std::time::Duration = std::time::Duration::from_secs(10);
/// Longest wait for the stream's first whole message (the snapshot's first part, at most
/// ~2.3 MB, which every agent sends at once).
pub(crate) const FIRST_MESSAGE: std::time::Duration = std::time::Duration::from_secs(30);
/// Heartbeats a stream may go without a whole message before it is taken as stalled.
pub(crate) const STALL_HEARTBEATS: u32 = 3;
/// The range an agent's announced heartbeat is held to: a stream is never given up sooner
/// than 3 s, nor waited on for more than 30 min.
const HEARTBEAT_RANGE: std::ops::RangeInclusive<std::time::Duration> =
    std::time::Duration::from_secs(1)..=std::time::Duration::from_secs(600);
/// kvagent holds one medium, as far as routing is concerned.
const MEDIUM: u8 = 1;

/// One engine's kvagent feed.
#[derive(Clone)]
pub struct Feed {
    /// The engine's name.
    pub engine: String,
    url: String,
    token: Option<String>,
    tls: Option<kvagent::ClientTls>,
}

impl Feed {
    /// The feed of `e` (which has a `kvagent`); its token file is read now.
    pub fn new(e: &EngineConfig, up: &UpstreamConfig) -> Result<Self, String> {
        let token = match e.kvagent_token_file.as_str() {
            "" => None,
            path => {
                let text = std::fs::read_to_string(path).map_err(|err| {
                    format!("engine {:?}: kvagent_token_file {path}: {err}", e.name)
                })?;
                let first = text.lines().next().unwrap_or("").trim().to_string();
                if first.is_empty() {
                    return Err(format!(
                        "engine {:?}: kvagent_token_file {path} has no token on its first line",
                        e.name
                    ));
                }
                Some(first)
            }
        };
        // An `https://` agent is reached with `[upstream]`'s CA and client certificate.
        let tls = e
            .kvagent
            .starts_with("https://")
            .then(|| kvagent::ClientTls {
                ca_file: up.ca_file.clone(),
                cert_file: up.client_cert_file.clone(),
                key_file: up.client_key_file.clone(),
            });
        Ok(Feed {
            engine: e.name.clone(),
            url: e.kvagent.clone(),
            token,
            tls,
        })
    }
}

/// Why a stream ended.
#[derive(Debug, thiserror::Error)]
enum FeedError {
    #[error(transparent)]
    Connect(#[from] kvagent::ConnectError),
    #[error("{0}")]
    Status(#[from] tonic::Status),
    #[error("the agent ended the stream")]
    Ended,
    #[error("no answer to WatchResidency within {0:?}")]
    NoAnswer(std::time::Duration),
    #[error("no whole message within {0:?}: the stream stalled")]
    Stalled(std::time::Duration),
}

/// How long the stream may go without a whole message, once its last one announced
/// `heartbeat_ms` (0: the agent sends none, and an idle stream is not a stalled one).
fn stall_bound(heartbeat_ms: u32) -> Option<std::time::Duration> {
    (heartbeat_ms > 0).then(|| {
        let beat = std::time::Duration::from_millis(u64::from(heartbeat_ms));
        beat.clamp(*HEARTBEAT_RANGE.start(), *HEARTBEAT_RANGE.end()) * STALL_HEARTBEATS
    })
}

/// One kvagent feed's state.
pub(crate) struct Follower {
    feed: Feed,
    set: FedSet,
    /// [`FIRST_MESSAGE`], but in tests.
    first_message: std::time::Duration,
}

#[async_trait]
impl Follow for Follower {
    async fn follow(&mut self) -> String {
        self.stream().await.to_string()
    }

    fn lost(&mut self) {
        self.set.withdraw();
        self.set.count(event::LOST, 1);
    }

    fn names(&self) -> (&str, &str) {
        (&self.feed.engine, &self.feed.url)
    }
}

impl Follower {
    pub(crate) fn new(feed: Feed, set: FedSet) -> Self {
        Follower {
            feed,
            set,
            first_message: FIRST_MESSAGE,
        }
    }

    /// One stream, until it fails.
    async fn stream(&mut self) -> FeedError {
        let client = kvagent::connect_with(
            self.feed.url.clone(),
            MAX_MESSAGE_BYTES,
            self.feed.token.as_deref(),
            self.feed.tls.as_ref(),
        )
        .await;
        let mut client = match client {
            Ok(c) => c,
            Err(e) => return e.into(),
        };
        let answer = tokio::time::timeout(
            WATCH_ANSWER,
            client.watch_residency(kvagent::pb::WatchResidencyRequest {}),
        )
        .await;
        let mut stream = match answer {
            Ok(Ok(s)) => s.into_inner(),
            Ok(Err(e)) => return e.into(),
            Err(_) => return FeedError::NoAnswer(WATCH_ANSWER),
        };
        self.set.count(event::CONNECTED, 1);
        tracing::info!(engine = %self.feed.engine, kvagent = %self.feed.url, "residency feed connected");
        let mut epoch = None;
        let mut refresh = tokio::time::interval(self.set.shared.refresh);
        refresh.tick().await;
        let mut bound = Some(self.first_message);
        let mut last = tokio::time::Instant::now();
        loop {
            let deadline = bound.map(|b| last + b);
            let msg = tokio::select! {
                m = stream.message() => m,
                _ = refresh.tick() => {
                    self.set.rerecord();
                    continue;
                }
                _ = sleep_until(deadline) => {
                    return FeedError::Stalled(bound.unwrap_or(self.first_message));
                }
            };
            match msg {
                Ok(Some(u)) => {
                    last = tokio::time::Instant::now();
                    bound = stall_bound(u.heartbeat_ms);
                    self.on_update(&mut epoch, u);
                }
                Ok(None) => return FeedError::Ended,
                Err(e) => return e.into(),
            }
        }
    }

    /// One message of the stream, whose agent has been at `epoch` so far.
    fn on_update(&mut self, epoch: &mut Option<u64>, u: kvagent::pb::ResidencyUpdate) {
        let heartbeat = !u.reset && u.added.is_empty() && u.removed.is_empty();
        if heartbeat && *epoch == Some(u.kv_epoch) {
            return;
        }
        if epoch.is_some_and(|e| e != u.kv_epoch) {
            self.set.count(event::EPOCH, 1);
            self.set.withdraw();
        }
        *epoch = Some(u.kv_epoch);
        if u.reset {
            self.set.count(event::RESET, 1);
            self.set.withdraw();
        }
        let mut malformed = 0u64;
        let mut short = |b: &[u8]| match <[u8; 32]>::try_from(b) {
            Ok(d) => Some((Digest(d).short(), MEDIUM)),
            Err(_) => {
                malformed += 1;
                None
            }
        };
        // Removals first: they free room for this update's additions.
        let removed: Vec<_> = u.removed.iter().filter_map(|b| short(b)).collect();
        let added: Vec<_> = u.added.iter().filter_map(|b| short(b)).collect();
        self.set.remove(removed);
        self.set.add(added);
        self.set.count(event::MALFORMED, malformed);
    }
}

/// Sleeps until `deadline`, or forever without one.
async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::feed::tests::{events, feed_entries, set};
    use kvmesh_filters::residency::Source;
    use std::time::Instant;

    fn follower(cap: usize) -> Follower {
        Follower {
            feed: Feed {
                engine: "e".into(),
                url: "http://127.0.0.1:2".into(),
                token: None,
                tls: None,
            },
            set: set(cap),
            first_message: FIRST_MESSAGE,
        }
    }

    fn digest(i: u8) -> bytes::Bytes {
        bytes::Bytes::from(vec![i; 32])
    }

    fn update(
        epoch: u64,
        reset: bool,
        added: Vec<bytes::Bytes>,
        removed: Vec<bytes::Bytes>,
    ) -> kvagent::pb::ResidencyUpdate {
        kvagent::pb::ResidencyUpdate {
            kv_epoch: epoch,
            reset,
            added,
            removed,
            heartbeat_ms: 0,
        }
    }

    /// A snapshot message can list more digests than the cap (kvagent sends 65,536 a
    /// message; the default cap is 50,000): those it pushes out before the message ends were
    /// never recorded, so the proxy's own entries for them stay.
    #[test]
    fn an_over_cap_message_withdraws_nothing_the_feed_never_recorded() {
        let mut f = follower(2);
        let mut epoch = None;
        let node = f.set.node().expect("the engine is in the fleet");
        let index = f.set.shared.index.clone();
        let now = Instant::now();
        index.record_keys(node, [Digest([1; 32]).short()], Source::Reported, now);
        f.on_update(
            &mut epoch,
            update(1, true, vec![digest(1), digest(2), digest(3)], vec![]),
        );
        assert_eq!(events(&f.set, event::OVER_CAP), 1);
        assert_eq!(feed_entries(&f.set), 2);
        for i in 1..=3 {
            assert_eq!(
                index.overlap(&[Digest([i; 32])], Instant::now()),
                vec![(node, 1)],
                "digest {i}"
            );
        }
        // What the feed did record is still its to withdraw when pushed out later.
        f.on_update(&mut epoch, update(1, false, vec![digest(4)], vec![]));
        assert_eq!(index.overlap(&[Digest([2; 32])], Instant::now()), vec![]);
        assert_eq!(
            index.overlap(&[Digest([1; 32])], Instant::now()),
            vec![(node, 1)]
        );
    }

    #[test]
    fn hostile_updates_are_bounded_and_counted() {
        let mut f = follower(2);
        let mut epoch = None;
        let short = bytes::Bytes::from_static(b"short");
        let long = bytes::Bytes::from(vec![7u8; 33]);
        f.on_update(
            &mut epoch,
            update(
                1,
                true,
                vec![digest(1), short, long, digest(2), digest(3)],
                vec![],
            ),
        );
        // At the bound the newest replace the oldest: 2 and 3 are held.
        assert_eq!(feed_entries(&f.set), 2);
        assert_eq!(events(&f.set, event::MALFORMED), 2);
        assert_eq!(events(&f.set, event::OVER_CAP), 1);
        let node = f.set.node.unwrap();
        let index = f.set.shared.index.clone();
        let key = |i: u8| Digest([i; 32]).short();
        assert_eq!(index.overlap(&[Digest([1; 32])], Instant::now()), vec![]);
        // The proxy's own entry for 9: the agent cannot remove it, only what it listed.
        index.record_keys(node, [key(9)], Source::Reported, Instant::now());
        f.on_update(
            &mut epoch,
            update(1, false, vec![], vec![digest(9), digest(2)]),
        );
        assert_eq!(feed_entries(&f.set), 1);
        assert_eq!(index.node_usage(node).0, 2);
        // A new epoch withdraws what the feed recorded first.
        f.on_update(&mut epoch, update(2, false, vec![digest(4)], vec![]));
        assert_eq!(events(&f.set, event::EPOCH), 1);
        assert_eq!(feed_entries(&f.set), 1);
        assert_eq!(
            index.overlap(&[Digest([4; 32])], Instant::now()),
            vec![(node, 1)]
        );
        // A snapshot starts over.
        f.on_update(
            &mut epoch,
            update(2, true, vec![digest(5), digest(6)], vec![]),
        );
        assert_eq!(events(&f.set, event::RESET), 2);
        assert_eq!(feed_entries(&f.set), 2);
        f.set.withdraw();
        assert_eq!(feed_entries(&f.set), 0);
        assert_eq!(index.node_usage(node).0, 1, "the reported entry stays");
    }

    /// A gRPC message as it goes on the wire: uncompressed, its length, its bytes.
    fn grpc_frame(message: &[u8]) -> bytes::Bytes {
        let mut frame = vec![0u8];
        frame.extend_from_slice(&(message.len() as u32).to_be_bytes());
        frame.extend_from_slice(message);
        frame.into()
    }

    /// `ResidencyUpdate { kv_epoch: 1, reset: true, added: [digest(1)], heartbeat_ms }`,
    /// protobuf-encoded by hand (the proxy does not link prost's encoder itself).
    fn snapshot_message(heartbeat_ms: u8) -> Vec<u8> {
        let mut m = vec![0x08, 1, 0x10, 1, 0x1a, 32];
        m.extend_from_slice(&[1u8; 32]);
        m.extend_from_slice(&[0x28, heartbeat_ms & 0x7f]);
        m
    }

    /// A kvagent whose `WatchResidency` answer sends the messages `whole`, then the first byte
    /// of a 256-byte message, and nothing more, while its HTTP/2 connection stays up (and
    /// answers pings).
    async fn stalling_agent(whole: Vec<Vec<u8>>) -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            let answer = hyper::service::service_fn(move |_| {
                let whole = whole.clone();
                async move {
                    let (mut tx, body) = http_body_util::channel::Channel::<
                        bytes::Bytes,
                        std::convert::Infallible,
                    >::new(4);
                    tokio::spawn(async move {
                        for m in &whole {
                            let _ = tx.send_data(grpc_frame(m)).await;
                        }
                        let _ = tx.send_data(vec![0u8, 0, 0, 1, 0, 0x08].into()).await;
                        // Holding the sender keeps the body, and the stream, open.
                        std::future::pending::<()>().await;
                        drop(tx);
                    });
                    http::Response::builder()
                        .header("content-type", "application/grpc")
                        .body(body)
                }
            });
            let _ = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                .serve_connection(hyper_util::rt::TokioIo::new(tcp), answer)
                .await;
        });
        addr
    }

    // Defect: an agent whose stream stopped in the middle of a message, while its HTTP/2
    // connection still answered pings, kept the engine's last residency recorded (and
    // re-recorded every refresh) until the connection ended, which might be never. A stream
    // that announced a heartbeat and then delivers no whole message for three of them is
    // given up, and what it recorded is withdrawn.
    #[tokio::test]
    async fn a_stream_that_stalls_in_a_message_is_given_up() {
        let addr = stalling_agent(vec![snapshot_message(100)]).await;
        let mut f = follower(16);
        f.feed.url = format!("http://{addr}");
        // The agent announced 100 ms: held to the 1 s floor, three of them.
        let ended = tokio::time::timeout(std::time::Duration::from_secs(20), f.stream())
            .await
            .expect("the stalled stream was waited on");
        assert!(
            matches!(ended, FeedError::Stalled(b) if b == std::time::Duration::from_secs(3)),
            "{ended}"
        );
        assert_eq!(events(&f.set, event::CONNECTED), 1);
        assert_eq!(feed_entries(&f.set), 1, "the snapshot was recorded");
        f.lost();
        assert_eq!(feed_entries(&f.set), 0);
    }

    // The first message is bounded whatever the agent (heartbeats are announced in messages).
    #[tokio::test]
    async fn a_stream_that_stalls_in_its_first_message_is_given_up() {
        let addr = stalling_agent(Vec::new()).await;
        let mut f = follower(16);
        f.feed.url = format!("http://{addr}");
        f.first_message = std::time::Duration::from_secs(1);
        let ended = tokio::time::timeout(std::time::Duration::from_secs(20), f.stream())
            .await
            .expect("the stalled stream was waited on");
        assert!(
            matches!(ended, FeedError::Stalled(b) if b == f.first_message),
            "{ended}"
        );
    }

    // A heartbeat changes nothing: not the entries, not the events.
    #[test]
    fn a_heartbeat_is_only_a_sign_of_life() {
        let mut f = follower(16);
        let mut epoch = None;
        f.on_update(&mut epoch, update(1, true, vec![digest(1)], vec![]));
        f.on_update(&mut epoch, update(1, false, vec![], vec![]));
        assert_eq!(feed_entries(&f.set), 1);
        assert_eq!(events(&f.set, event::EPOCH), 0);
        // Of another epoch, it is a restarted agent's: what the old one listed goes.
        f.on_update(&mut epoch, update(2, false, vec![], vec![]));
        assert_eq!(events(&f.set, event::EPOCH), 1);
        assert_eq!(feed_entries(&f.set), 0);
    }

    #[test]
    fn an_announced_heartbeat_bounds_the_stream() {
        use std::time::Duration;
        assert_eq!(stall_bound(0), None, "an agent without heartbeats");
        assert_eq!(stall_bound(10_000), Some(Duration::from_secs(30)));
        assert_eq!(stall_bound(1), Some(Duration::from_secs(3)));
        assert_eq!(stall_bound(u32::MAX), Some(Duration::from_secs(1800)));
    }
}
