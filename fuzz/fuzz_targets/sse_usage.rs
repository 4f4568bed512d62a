//! The SSE usage scanner, fed an engine's event stream in fuzzer-chosen chunks, and the JSON
//! usage reader. First byte: the line bound; second: the chunk size.
//!
//! Checked: no panic; the usage found is the same whether the stream arrives whole, in
//! fuzzer-sized chunks, or byte by byte.
#![no_main]

use kvmesh_filters::usage::{from_json, SseUsageScanner};
use libfuzzer_sys::fuzz_target;
// The capped allocator (src/lib.rs).
use kvmesh_fuzz as _;

fuzz_target!(|data: &[u8]| {
    let [max_line, chunk, stream @ ..] = data else {
        return;
    };
    let max_line = usize::from(*max_line) * 4;
    let chunk = usize::from(*chunk).max(1);
    let mut whole = SseUsageScanner::new(max_line);
    whole.feed(stream);
    let mut cut = SseUsageScanner::new(max_line);
    for piece in stream.chunks(chunk) {
        cut.feed(piece);
    }
    assert_eq!(
        whole.usage(),
        cut.usage(),
        "the usage depends on the chunking"
    );
    let mut bytewise = SseUsageScanner::new(max_line);
    for b in stream {
        bytewise.feed(std::slice::from_ref(b));
    }
    assert_eq!(whole.usage(), bytewise.usage());
    let _ = from_json(stream);
});
