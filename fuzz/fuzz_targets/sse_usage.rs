//! The SSE usage scanner, fed an engine's event stream in fuzzer-chosen chunks, the JSON body
//! usage scanner the same way, and the JSON usage reader. First byte: the line bound; second:
//! the chunk size.
//!
//! Checked: no panic; the usage found is the same whether the stream arrives whole, in
//! fuzzer-sized chunks, or byte by byte; for a body that is a JSON object without `\u` escapes,
//! the body scanner finds what a full parse finds in its top-level `usage`.
#![no_main]

use std::collections::HashMap;

use kvmesh_filters::usage::{from_json, from_usage_value, JsonUsageScanner, SseUsageScanner};
use libfuzzer_sys::fuzz_target;
use serde_json::value::RawValue;
// The capped allocator (src/lib.rs).
use kvmesh_fuzz as _;

fuzz_target!(|data: &[u8]| {
    let [max_line, chunk, stream @ ..] = data else {
        return;
    };
    let max_line = usize::from(*max_line) * 4;
    let chunk = usize::from(*chunk).max(1);
    let sse = |piece| {
        fed(
            stream,
            piece,
            || SseUsageScanner::new(max_line),
            SseUsageScanner::feed,
        )
    };
    let whole = sse(stream.len().max(1)).usage();
    assert_eq!(
        whole,
        sse(chunk).usage(),
        "the usage depends on the chunking"
    );
    assert_eq!(whole, sse(1).usage());
    let _ = from_json(stream);

    // Bound well above any value a fuzzer input holds: only the scan is compared.
    let bound = stream.len() + 1;
    let json = |piece| {
        fed(
            stream,
            piece,
            || JsonUsageScanner::new(bound),
            JsonUsageScanner::feed,
        )
    };
    let whole = json(stream.len().max(1)).usage();
    assert_eq!(
        whole,
        json(chunk).usage(),
        "the usage depends on the chunking"
    );
    // Without `\u` escapes: the scanner does not decode a key spelt with them (documented);
    // other escapes cannot spell `usage`, and stay in.
    let plain = !stream.windows(2).any(|w| w == b"\\u");
    let top = serde_json::from_slice::<HashMap<String, Box<RawValue>>>(stream);
    if let (true, Ok(top)) = (plain, top) {
        // The full parse's top-level usage (the last of repeated keys, as a map keeps it),
        // read from its own bytes as the scanner reads the bytes it kept.
        let truth = top
            .get("usage")
            .and_then(|u| from_usage_value(u.get().as_bytes()));
        assert_eq!(whole, truth, "the scan and a full parse disagree");
    }
});

/// A scanner `make` builds, fed `stream` in pieces of `piece` bytes.
fn fed<S>(stream: &[u8], piece: usize, make: impl Fn() -> S, feed: impl Fn(&mut S, &[u8])) -> S {
    let mut s = make();
    for p in stream.chunks(piece) {
        feed(&mut s, p);
    }
    s
}
