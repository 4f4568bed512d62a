//! Gossip datagrams as anyone on the network can send them, to a node with a cluster key: the
//! sealed-frame opener (framing, key ids, authentication). The input is a sequence of datagrams,
//! each prefixed by a little-endian u16 length. (chitchat's own message decoder is private to
//! it, so it is not reached here; with a key set it only ever sees authenticated plaintext.)
//!
//! Checked: no panic; without the key nothing opens; the opener's memory stays bounded.
#![no_main]

use std::net::SocketAddr;
use std::time::Duration;

use kvmesh_cluster::seal::{Keyring, Opener};
use libfuzzer_sys::fuzz_target;
// The capped allocator (src/lib.rs).
use kvmesh_fuzz as _;

const KEY: &str = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";

fuzz_target!(|data: &[u8]| {
    let keyring = Keyring::from_base64(&[KEY]).expect("the fixed key is valid");
    let own: SocketAddr = "10.0.0.1:7946".parse().expect("literal address");
    let from: SocketAddr = "10.0.0.2:7946".parse().expect("literal address");
    let mut opener = Opener::new(keyring, "fuzz", vec![own], Duration::from_secs(30), 8);
    let mut rest = data;
    while let [lo, hi, tail @ ..] = rest {
        let len = usize::from(u16::from_le_bytes([*lo, *hi])).min(tail.len());
        let (datagram, next) = tail.split_at(len);
        rest = next;
        assert!(
            opener.open(datagram, from).is_err(),
            "a frame forged without the key was accepted"
        );
    }
    assert_eq!(opener.sessions(), 0);
    assert_eq!(opener.reassembling(), 0);
});
