//! kvagent's SSD block files as they are read back: header, declared lengths, checksum, model
//! name. The input is a file's bytes; half the time its checksum is made right, so the checks
//! behind it are reached too (an attacker who can write the directory can compute it).
//!
//! Checked: no panic; a block that decodes has the header's token count, model name and a
//! payload that is exactly the file's bytes between the model name and the checksum.
#![no_main]

use kvagent::disk::decode;
use kvmesh_filters::chain::Digest;
use libfuzzer_sys::fuzz_target;
// The capped allocator (src/lib.rs).
use kvmesh_fuzz as _;

fuzz_target!(|data: &[u8]| {
    let Some((&sel, file)) = data.split_first() else {
        return;
    };
    let mut file = file.to_vec();
    if sel % 2 == 1 && file.len() >= 32 {
        let body = file.len() - 32;
        let sum = *blake3::hash(&file[..body]).as_bytes();
        file[body..].copy_from_slice(&sum);
    }
    // The file's own digest field, so the name check passes and the rest is reached.
    let digest = match file.get(8..40) {
        Some(d) => Digest(d.try_into().expect("32 bytes")),
        None => Digest([0; 32]),
    };
    if let Ok(block) = decode(file.clone(), &digest) {
        // The layout, read independently: 54-byte header, model, payload, 32-byte checksum.
        let model_len = usize::from(u16::from_le_bytes([file[44], file[45]]));
        let model_end = 54 + model_len;
        assert_eq!(block.model.as_bytes(), &file[54..model_end]);
        assert_eq!(&block.payload[..], &file[model_end..file.len() - 32]);
        assert_eq!(
            block.token_count,
            u32::from_le_bytes(file[40..44].try_into().expect("4 bytes"))
        );
    }
});
