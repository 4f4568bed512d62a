//! Sealed frames from a peer that holds the cluster key but chooses every header field
//! (fragment index and count, session, counter, timestamp, destination): the opener's checks
//! that run after authentication (replay window, clock skew, reassembly). Each 16-byte record
//! of the input describes one frame; the frames carry small pieces.
//!
//! Checked: no panic; the sessions and messages in reassembly stay within their bounds; a
//! message that completes is exactly its frames' pieces (at most `MAX_FRAGMENTS`); a frame
//! accepted once is refused when sent again.
#![no_main]

use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvmesh_cluster::seal::{FrameHeader, Keyring, Opener, MAX_FRAGMENTS, MAX_PARTIAL};
use kvmesh_cluster::testing::sealed_frame;
use libfuzzer_sys::fuzz_target;
// The capped allocator (src/lib.rs).
use kvmesh_fuzz as _;

const KEY: &str = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
/// With 4 partial messages per session, more than 16 sessions can fill the global bound
/// (`MAX_PARTIAL`, 64), so both bounds are exercised.
const MAX_SESSIONS: usize = 20;
const PIECE: usize = 3;

fuzz_target!(|data: &[u8]| {
    let keyring = Keyring::from_base64(&[KEY]).expect("the fixed key is valid");
    let own: SocketAddr = "10.0.0.1:7946".parse().expect("literal address");
    let elsewhere: SocketAddr = "10.0.0.9:7946".parse().expect("literal address");
    let mut opener = Opener::new(
        keyring.clone(),
        "fuzz",
        vec![own],
        Duration::from_secs(30),
        MAX_SESSIONS,
    );
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    for r in data.chunks_exact(16) {
        let header = FrameHeader {
            index: r[0] % 6,
            count: r[1] % 6,
            session: u64::from(r[2] % 32),
            counter: u64::from(u32::from_le_bytes([r[3], r[4], r[5], r[6]])),
            // Mostly fresh, sometimes minutes off either way.
            timestamp_ms: now_ms
                .wrapping_add(u64::from(r[7] % 4) * 60_000)
                .wrapping_sub(if r[7] & 0x80 != 0 { 120_000 } else { 0 }),
            dest: if r[8] % 8 == 0 { elsewhere } else { own },
            source: SocketAddr::from(([10, 0, 0, 2 + (r[8] / 8 % 3)], 7946)),
        };
        let from = SocketAddr::from(([10, 0, 0, 2 + (r[9] % 3)], 7946));
        let Some(frame) = sealed_frame(&keyring, "fuzz", &header, &r[10..10 + PIECE]) else {
            continue;
        };
        let opened = opener.open_from(&frame, from);
        if let Ok(o) = &opened {
            assert_eq!(o.from_named_source, header.source.ip() == from.ip());
        }
        let opened = opened.map(|o| o.message);
        if let Ok(Some(message)) = &opened {
            assert!(usize::from(header.count) <= MAX_FRAGMENTS);
            assert_eq!(
                message.len(),
                usize::from(header.count) * PIECE,
                "{header:?}"
            );
        }
        if opened.is_ok() {
            assert!(
                opener.open(&frame, from).is_err(),
                "a replayed frame was accepted"
            );
        }
        assert!(opener.sessions() <= MAX_SESSIONS);
        assert!(opener.reassembling() <= MAX_PARTIAL);
    }
});
