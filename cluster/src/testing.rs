//! Test instruments: chitchat datagrams written by hand, to reproduce attacks on gossip (the
//! regression tests of the forged-record and crafted-delta defects use them). Nothing in the
//! proxy's data path calls this module.

use chitchat::{ChitchatId, Serializable};

use crate::seal::{FrameHeader, Keyring};

/// A gossip frame with every header field chosen by the caller (fragment index and count,
/// session, counter, timestamp, destination), sealed with `keyring`'s primary key: what a peer
/// holding the cluster key could send, well-formed or not. The fuzz targets use it to reach the
/// opener's checks that run after authentication.
pub fn sealed_frame(
    keyring: &Keyring,
    cluster_id: &str,
    header: &FrameHeader,
    piece: &[u8],
) -> Option<Vec<u8>> {
    crate::seal::sealed_frame_for_test(keyring, cluster_id, header, piece)
}

/// chitchat's wire format, written with its public serialisers: an `Ack` whose delta for
/// `target` sets `key = value` at `version`, then, when `max_version` is given, a
/// `SetMaxVersion` op (one lower than `version` reaches chitchat's
/// `assert!(node_delta.max_version >= self.max_version)`). Protocol V0, one uncompressed
/// block.
pub fn crafted_ack(
    target: &ChitchatId,
    key: &str,
    value: &str,
    version: u64,
    max_version: Option<u64>,
) -> Vec<u8> {
    let mut ops = vec![0u8]; // Node op
    target.serialize(&mut ops);
    0u64.serialize(&mut ops); // last_gc_version
    0u64.serialize(&mut ops); // from_version_excluded
    ops.push(1); // KeyValue op
    key.serialize(&mut ops);
    value.serialize(&mut ops);
    version.serialize(&mut ops);
    ops.push(0); // Set
    if let Some(m) = max_version {
        ops.push(2); // SetMaxVersion
        m.serialize(&mut ops);
    }
    let mut msg = Vec::with_capacity(ops.len() + 8);
    45_139u16.serialize(&mut msg); // chitchat's magic number
    msg.push(0); // protocol V0
    msg.push(2); // Ack
    msg.push(2); // an uncompressed block
    (ops.len().min(u16::MAX as usize) as u16).serialize(&mut msg);
    msg.extend_from_slice(&ops);
    msg.push(0); // no more blocks
    msg
}

/// [`crafted_ack`] for a node named by its parts (generation 0 when unknown).
pub fn crafted_ack_for(
    node_id: &str,
    generation: u64,
    gossip_addr: std::net::SocketAddr,
    key: &str,
    value: &str,
    version: u64,
) -> Vec<u8> {
    let id = ChitchatId::new(node_id.to_string(), generation, gossip_addr);
    crafted_ack(&id, key, value, version, None)
}

/// A load beacon's plaintext as a node would seal it ([`crate::beacon`]): what an insider
/// holding the key could send under any node id.
pub fn beacon_plaintext(node_id: &str, session: u64, seq: u64, load: crate::Load) -> Vec<u8> {
    crate::beacon::plaintext(node_id, session, seq, load).unwrap_or_default()
}

/// The value this node has set for gossip key `key` (`None`: never set): what its peers are
/// sent for it.
pub async fn own_value(cluster: &crate::Cluster, key: &str) -> Option<String> {
    let chitchat = cluster.chitchat().await;
    let mut chitchat = chitchat.lock().await;
    chitchat.self_node_state().get(key).map(str::to_string)
}
