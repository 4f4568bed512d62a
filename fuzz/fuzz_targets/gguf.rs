//! GGUF model files: header, metadata (nested arrays included), the tensor directory, and the
//! dequantisation of every tensor the directory declares.
//!
//! Checked: no panic, no allocation beyond what the file's size allows; every tensor that
//! dequantises yields as many values as its shape says.
#![no_main]

use kvmesh_gguf::Gguf;
use libfuzzer_sys::fuzz_target;
// The capped allocator (src/lib.rs).
use kvmesh_fuzz as _;

fuzz_target!(|data: &[u8]| {
    let Ok(g) = Gguf::parse(data.to_vec()) else {
        return;
    };
    for (name, info) in &g.tensors {
        if let Ok((values, shape)) = g.dequantize(name) {
            let n: i64 = shape.iter().product();
            assert_eq!(values.len() as i64, n, "tensor {name}: {info:?}");
        }
    }
    for key in g.metadata.keys() {
        let _ = (
            g.get_u64(key),
            g.get_f64(key),
            g.get_str(key),
            g.get_strings(key),
        );
    }
});
