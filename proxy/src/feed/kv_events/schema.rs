//! The msgpack payload of a vLLM (or SGLang) KV events message, as `vllm/distributed/kv_events.py`
//! defines it: a `KVEventBatch {ts, events, data_parallel_rank}` of tagged events
//! `BlockStored {block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
//! lora_name, extra_keys, group_idx, ...}`, `BlockRemoved {block_hashes, medium, group_idx, ...}`
//! and `AllBlocksCleared {}`.
//!
//! Both encodings msgspec has produced are read, at both levels: positional arrays (`array_like`
//! structs; an event is `["BlockStored", field, ...]`, trailing defaults omitted; vLLM up to
//! v0.23, and the batch in forks since) and maps (`{"type": "BlockStored", "block_hashes": ...}`;
//! vLLM main since vllm#42892). Fields this proxy has no use for are skipped, whatever they
//! hold; fields added after those listed are ignored.

use std::fmt;

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

/// A block hash as vLLM exports it (an integer, the low 64 bits, by default; or bytes), kept
/// as a compact key: the integer itself, or the first 16 bytes of the bytes' BLAKE3 hash
/// (tagged apart). Decoded straight to the key, so a batch of hashes costs 16 bytes each (and
/// a batch holds at most [`MAX_BATCH_ITEMS`] of them and its events).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHash(u128);

/// Longest bytes hash accepted (vLLM's sha256 hashes are 32 bytes).
const MAX_HASH_BYTES: usize = 64;

impl BlockHash {
    /// The hash vLLM sends as the integer `v`.
    pub fn int(v: u64) -> Self {
        BlockHash(u128::from(v))
    }

    /// The hash vLLM sends as `bytes`.
    pub fn bytes(bytes: &[u8]) -> Self {
        let h = blake3::hash(bytes);
        let mut k = [0u8; 16];
        k.copy_from_slice(&h.as_bytes()[..16]);
        BlockHash(u128::from_be_bytes(k) | (1 << 127))
    }

    /// The key.
    pub fn key(&self) -> u128 {
        self.0
    }
}

impl<'de> Deserialize<'de> for BlockHash {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        spend()?;
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = BlockHash;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a block hash (an integer or bytes)")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<BlockHash, E> {
                Ok(BlockHash::int(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<BlockHash, E> {
                // The same 64 bits, as a publisher that packs signed integers would send them.
                Ok(BlockHash::int(v as u64))
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<BlockHash, E> {
                if v.len() > MAX_HASH_BYTES {
                    return Err(E::custom(format!(
                        "a block hash of {} bytes (at most {MAX_HASH_BYTES})",
                        v.len()
                    )));
                }
                Ok(BlockHash::bytes(v))
            }
        }
        d.deserialize_any(V)
    }
}

/// An optional field read leniently: nil, a string, an integer, a list (whether any entry is
/// not nil), or anything else (consumed, and reported as such). Publishers differ after the
/// fields vLLM has always sent (SGLang puts a metadata map where vLLM has `lora_name`).
enum Loose {
    Nil,
    Str(String),
    Int(u64),
    List(bool),
    Other,
}

impl Loose {
    /// `field` if it is an integer (absent or nil: none); another shape sets `odd`.
    fn int(field: Option<Loose>, odd: &mut bool) -> Option<u64> {
        match field {
            Some(Loose::Int(v)) => Some(v),
            None | Some(Loose::Nil) => None,
            Some(_) => {
                *odd = true;
                None
            }
        }
    }

    /// `field` if it is a string (absent or nil: none); another shape sets `odd`.
    fn string(field: Option<Loose>, odd: &mut bool) -> Option<String> {
        match field {
            Some(Loose::Str(v)) => Some(v),
            None | Some(Loose::Nil) => None,
            Some(_) => {
                *odd = true;
                None
            }
        }
    }
}

impl<'de> Deserialize<'de> for Loose {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Loose;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("any value")
            }
            fn visit_unit<E: de::Error>(self) -> Result<Loose, E> {
                Ok(Loose::Nil)
            }
            fn visit_none<E: de::Error>(self) -> Result<Loose, E> {
                Ok(Loose::Nil)
            }
            fn visit_some<D2: Deserializer<'de>>(self, d: D2) -> Result<Loose, D2::Error> {
                Loose::deserialize(d)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Loose, E> {
                Ok(Loose::Str(v.to_string()))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Loose, E> {
                Ok(Loose::Int(v))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Loose, E> {
                Ok(Loose::Other)
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Loose, E> {
                Ok(Loose::Other)
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Loose, E> {
                Ok(Loose::Other)
            }
            fn visit_bytes<E: de::Error>(self, _: &[u8]) -> Result<Loose, E> {
                Ok(Loose::Other)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Loose, A::Error> {
                // Nesting is bounded by the decoder's depth limit.
                let mut any = false;
                while let Some(entry) = a.next_element::<Loose>()? {
                    any |= !matches!(entry, Loose::Nil);
                }
                Ok(Loose::List(any))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<Loose, A::Error> {
                while a.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Loose::Other)
            }
        }
        d.deserialize_any(V)
    }
}

/// One event.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Blocks were stored: `block_hashes[i]` holds `token_ids[i * block_size..][..block_size]`,
    /// the first one following `parent_block_hash`. (Boxed, as is `BlockRemoved`: a batch of
    /// many small events then costs a pointer each, not the largest variant's size.)
    BlockStored(Box<Stored>),
    /// Blocks were evicted from `medium`.
    BlockRemoved(Box<Removed>),
    /// The engine's cache was cleared.
    AllBlocksCleared,
    /// An event type this proxy does not know (skipped).
    Unknown(String),
}

/// `BlockStored`'s fields that matter here.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stored {
    /// The stored blocks' hashes, in prompt order.
    pub block_hashes: Vec<BlockHash>,
    /// The hash of the block before the first one (`None`: they start a prompt).
    pub parent_block_hash: Option<BlockHash>,
    /// The stored blocks' tokens.
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u64,
    /// A LoRA adapter's id (deprecated by vLLM for `lora_name`).
    pub lora_id: Option<u64>,
    /// Where the blocks are (`GPU`, `CPU`, ...; `None`: GPU).
    pub medium: Option<String>,
    /// A LoRA adapter's name: its blocks are not the base model's.
    pub lora_name: Option<String>,
    /// Whether any block's hash took extra keys (images, a cache salt, prompt embeddings), or
    /// a field held what this proxy does not recognise: then its tokens alone may not name its
    /// contents.
    pub has_extra_keys: bool,
    /// The KV cache group (hybrid models have several).
    pub group_idx: Option<u64>,
}

/// `BlockRemoved`'s fields that matter here.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Removed {
    /// The evicted blocks' hashes.
    pub block_hashes: Vec<BlockHash>,
    /// Where they were evicted from (`None`: GPU).
    pub medium: Option<String>,
    /// The KV cache group.
    pub group_idx: Option<u64>,
}

/// One batch: the payload of one message. Read it with [`decode`], which sets the batch's
/// budget (deserialised any other way, its first event or hash is refused).
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// Its events, in order.
    pub events: Vec<Event>,
}

/// Most events and block hashes, together, one batch may hold. A publisher sends a batch per
/// scheduler step: a few thousand at most (a removal per evicted block, a store per request
/// with new full blocks). The bound keeps what a hostile publisher can make this proxy hold
/// per message within about 8 MiB whatever the message's size: each event and each block hash
/// is an item, and a boxed event (a store or a removal, ~180 bytes decoded from 17 of
/// message) also pays its box in items of an event's size (at most 32 bytes); token ids, 4
/// bytes each from at least 1, are bounded by the message size alone.
pub const MAX_BATCH_ITEMS: usize = 1 << 18;

thread_local! {
    /// Items the batch being decoded on this thread may still hold ([`decode`] sets it).
    static BUDGET: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Takes one item of the batch's budget, or fails once it is spent.
fn spend<E: de::Error>() -> Result<(), E> {
    spend_n(1)
}

/// Takes `n` items of the batch's budget, or fails once it is spent.
fn spend_n<E: de::Error>(n: usize) -> Result<(), E> {
    BUDGET.with(|b| match b.get().checked_sub(n) {
        None => Err(E::custom(format!(
            "a batch of more than {MAX_BATCH_ITEMS} events and block hashes"
        ))),
        Some(left) => {
            b.set(left);
            Ok(())
        }
    })
}

/// What a boxed event costs beside its own item: its box, in items of an [`Event`]'s size,
/// so that a batch's events and hashes together stay within [`MAX_BATCH_ITEMS`] x 32 bytes
/// (an item is at most that: an event, or a 16-byte hash).
fn boxed<T, E: de::Error>() -> Result<(), E> {
    spend_n(std::mem::size_of::<T>().div_ceil(std::mem::size_of::<Event>()))
}

/// The decoder's depth budget: rmp-serde refuses the level that spends it, so a batch nests
/// at most 15 levels. vLLM's nest about 5 (batch, events, event, `extra_keys`, a block's
/// keys); deeper is refused before it can use the stack.
pub const MAX_DEPTH: usize = 16;

/// Decodes one payload, within [`MAX_BATCH_ITEMS`] and [`MAX_DEPTH`].
pub fn decode(payload: &[u8]) -> Result<Batch, rmp_serde::decode::Error> {
    BUDGET.with(|b| b.set(MAX_BATCH_ITEMS));
    let mut d = rmp_serde::Deserializer::from_read_ref(payload);
    d.set_max_depth(MAX_DEPTH);
    Batch::deserialize(&mut d)
}

/// `extra_keys`: one entry per block, `None` or a tuple of whatever vLLM hashed in; true when
/// any entry is not `None`, or the field is not a list at all.
struct ExtraKeys(bool);

impl<'de> Deserialize<'de> for ExtraKeys {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(ExtraKeys(match Loose::deserialize(d)? {
            Loose::Nil => false,
            Loose::List(any) => any,
            _ => true,
        }))
    }
}

impl<'de> Deserialize<'de> for Batch {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Batch;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a KVEventBatch (an array or a map)")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Batch, A::Error> {
                let _ts: IgnoredAny = a
                    .next_element()?
                    .ok_or_else(|| de::Error::custom("a batch without ts"))?;
                let events = a
                    .next_element()?
                    .ok_or_else(|| de::Error::custom("a batch without events"))?;
                while a.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Batch { events })
            }
            fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<Batch, A::Error> {
                let mut events = None;
                while let Some(k) = a.next_key::<String>()? {
                    match k.as_str() {
                        "events" => events = Some(a.next_value()?),
                        _ => {
                            a.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(Batch {
                    events: events.ok_or_else(|| de::Error::custom("a batch without events"))?,
                })
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for Event {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        spend()?;
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Event;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a KV cache event (a tagged array or map)")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Event, A::Error> {
                let tag: String = a
                    .next_element()?
                    .ok_or_else(|| de::Error::custom("an event without its type"))?;
                let ev = match tag.as_str() {
                    "BlockStored" => {
                        let mut s = Stored {
                            block_hashes: next(&mut a, "block_hashes")?,
                            parent_block_hash: next(&mut a, "parent_block_hash")?,
                            ..Default::default()
                        };
                        s.token_ids = next(&mut a, "token_ids")?;
                        s.block_size = next(&mut a, "block_size")?;
                        // Later fields are optional (omitted when they hold their default)
                        // and read leniently: what is not vLLM's shape makes the blocks
                        // unsupported, not the batch unreadable.
                        let mut odd = false;
                        s.lora_id = Loose::int(a.next_element()?, &mut odd);
                        s.medium = Loose::string(a.next_element()?, &mut odd);
                        s.lora_name = Loose::string(a.next_element()?, &mut odd);
                        s.has_extra_keys = a.next_element::<ExtraKeys>()?.is_some_and(|k| k.0);
                        s.group_idx = Loose::int(a.next_element()?, &mut odd);
                        s.has_extra_keys |= odd;
                        boxed::<Stored, _>()?;
                        Event::BlockStored(Box::new(s))
                    }
                    "BlockRemoved" => {
                        let block_hashes = next(&mut a, "block_hashes")?;
                        // Another medium or group than the default only when it says so
                        // plainly; the odd shape is ignored.
                        let mut ignored = false;
                        let medium = Loose::string(a.next_element()?, &mut ignored);
                        let group_idx = Loose::int(a.next_element()?, &mut ignored);
                        boxed::<Removed, _>()?;
                        Event::BlockRemoved(Box::new(Removed {
                            block_hashes,
                            medium,
                            group_idx,
                        }))
                    }
                    "AllBlocksCleared" => Event::AllBlocksCleared,
                    _ => Event::Unknown(tag),
                };
                while a.next_element::<IgnoredAny>()?.is_some() {}
                Ok(ev)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<Event, A::Error> {
                let mut tag: Option<String> = None;
                let mut s = Stored::default();
                let (mut hashes, mut tokens, mut size) = (false, false, false);
                // As in the positional form: the fields after `block_size` are read
                // leniently (an odd shape makes a stored block unsupported, and is ignored in
                // a removal).
                let mut odd = false;
                while let Some(k) = a.next_key::<String>()? {
                    match k.as_str() {
                        "type" => tag = Some(a.next_value()?),
                        "block_hashes" => {
                            s.block_hashes = a.next_value()?;
                            hashes = true;
                        }
                        "parent_block_hash" => s.parent_block_hash = a.next_value()?,
                        "token_ids" => {
                            s.token_ids = a.next_value()?;
                            tokens = true;
                        }
                        "block_size" => {
                            s.block_size = a.next_value()?;
                            size = true;
                        }
                        "lora_id" => s.lora_id = Loose::int(Some(a.next_value()?), &mut odd),
                        "medium" => s.medium = Loose::string(Some(a.next_value()?), &mut odd),
                        "lora_name" => {
                            s.lora_name = Loose::string(Some(a.next_value()?), &mut odd);
                        }
                        "extra_keys" => s.has_extra_keys |= a.next_value::<ExtraKeys>()?.0,
                        "group_idx" => s.group_idx = Loose::int(Some(a.next_value()?), &mut odd),
                        _ => {
                            a.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                let tag = tag.ok_or_else(|| de::Error::custom("an event without its type"))?;
                let missing = |what: &str| de::Error::custom(format!("{tag} without {what}"));
                Ok(match tag.as_str() {
                    "BlockStored" if !hashes => return Err(missing("block_hashes")),
                    "BlockStored" if !tokens => return Err(missing("token_ids")),
                    "BlockStored" if !size => return Err(missing("block_size")),
                    "BlockStored" => {
                        s.has_extra_keys |= odd;
                        boxed::<Stored, _>()?;
                        Event::BlockStored(Box::new(s))
                    }
                    "BlockRemoved" if !hashes => return Err(missing("block_hashes")),
                    "BlockRemoved" => {
                        boxed::<Removed, _>()?;
                        Event::BlockRemoved(Box::new(Removed {
                            block_hashes: s.block_hashes,
                            medium: s.medium,
                            group_idx: s.group_idx,
                        }))
                    }
                    "AllBlocksCleared" => Event::AllBlocksCleared,
                    _ => Event::Unknown(tag),
                })
            }
        }
        d.deserialize_any(V)
    }
}

/// A required positional field.
fn next<'de, A: SeqAccess<'de>, T: Deserialize<'de>>(a: &mut A, what: &str) -> Result<T, A::Error> {
    a.next_element()?
        .ok_or_else(|| de::Error::custom(format!("an event without {what}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_is_small_whatever_its_variant() {
        // What MAX_BATCH_ITEMS' bound on a batch's memory relies on.
        assert!(std::mem::size_of::<Event>() <= 32);
    }
    use serde::Serialize;

    fn pack(v: &impl Serialize) -> Vec<u8> {
        rmp_serde::to_vec(v).unwrap()
    }

    #[test]
    fn both_encodings_decode_alike() {
        let array = pack(&(
            1.5f64,
            (
                (
                    "BlockStored",
                    vec![7u64, 8],
                    Some(6u64),
                    vec![1u32, 2, 3, 4],
                    2u64,
                    None::<u64>,
                    "GPU",
                ),
                ("BlockRemoved", vec![7u64], "CPU"),
                ("AllBlocksCleared",),
                ("SomethingNew", 1),
            ),
        ));
        let map = rmp_serde::to_vec_named(&serde_json::json!({
        "ts": 1.5, "data_parallel_rank": 0, "events": [
            {"type": "BlockStored", "block_hashes": [7, 8], "parent_block_hash": 6,
             "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": null, "medium": "GPU",
             "lora_name": null, "kv_cache_spec_kind": "full_attention"},
            {"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU"},
            {"type": "AllBlocksCleared"},
            {"type": "SomethingNew", "x": [1, 2]},
        ]}))
        .unwrap();
        let a = decode(&array).unwrap();
        assert_eq!(a, decode(&map).unwrap());
        let Event::BlockStored(s) = &a.events[0] else {
            panic!("{:?}", a.events[0])
        };
        assert_eq!(s.block_hashes, vec![BlockHash::int(7), BlockHash::int(8)]);
        assert_eq!(s.parent_block_hash, Some(BlockHash::int(6)));
        assert_eq!(s.medium.as_deref(), Some("GPU"));
        assert_eq!(a.events[3], Event::Unknown("SomethingNew".into()));
    }

    #[test]
    fn a_field_in_another_shape_makes_the_blocks_unsupported_not_the_batch_unreadable() {
        // SGLang's positional layout: a metadata map where vLLM has lora_name.
        let sglang = pack(&(
            0.0f64,
            vec![(
                "BlockStored",
                vec![1u64],
                None::<u64>,
                vec![1u32, 2],
                2u64,
                None::<u64>,
                "CPU_PINNED",
                std::collections::BTreeMap::from([("cache_salt", "t")]),
            )],
        ));
        let b = decode(&sglang).unwrap();
        let Event::BlockStored(s) = &b.events[0] else {
            panic!("{:?}", b.events[0])
        };
        assert!(s.has_extra_keys);
        let plain = pack(&(
            0.0f64,
            vec![(
                "BlockStored",
                vec![1u64],
                None::<u64>,
                vec![1u32, 2],
                2u64,
                None::<u64>,
                "GPU",
                None::<String>,
                None::<Vec<u8>>,
                0u64,
            )],
        ));
        let Event::BlockStored(s) = &decode(&plain).unwrap().events[0] else {
            panic!()
        };
        assert!(!s.has_extra_keys);
        assert_eq!(s.group_idx, Some(0));
        // The same in the map form: the batch stays readable, the blocks unsupported; an odd
        // medium in a removal is ignored.
        for (field, value) in [
            ("lora_name", serde_json::json!({"cache_salt": "t"})),
            ("lora_id", serde_json::json!("one")),
            ("medium", serde_json::json!(3)),
            ("group_idx", serde_json::json!([0])),
        ] {
            let mut stored = serde_json::json!({"type": "BlockStored", "block_hashes": [1],
                "parent_block_hash": null, "token_ids": [1, 2], "block_size": 2});
            stored[field] = value.clone();
            let mut removed = serde_json::json!({"type": "BlockRemoved", "block_hashes": [1]});
            removed[field] = value;
            let map =
                rmp_serde::to_vec_named(&serde_json::json!({"events": [stored, removed]})).unwrap();
            let b = decode(&map).unwrap_or_else(|e| panic!("{field}: {e}"));
            let Event::BlockStored(s) = &b.events[0] else {
                panic!("{:?}", b.events[0])
            };
            assert!(s.has_extra_keys, "{field}");
            assert!(matches!(b.events[1], Event::BlockRemoved(_)), "{field}");
        }
    }

    #[test]
    fn hostile_payloads_are_errors() {
        for bad in [
            &b"\xc1"[..],              // a reserved msgpack byte
            b"\x92\xcb",               // truncated
            b"\xdd\xff\xff\xff\xff",   // an array claiming 4G elements, with none
            b"\x81\xa6events\x91\x90", // an event without a type
        ] {
            assert!(decode(bad).is_err(), "{bad:?}");
        }
        // A token id past u32, a bytes hash of 65 bytes.
        let big = rmp_serde::to_vec_named(&serde_json::json!({"events": [
            {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": null,
             "token_ids": [4294967296u64], "block_size": 1}]}))
        .unwrap();
        assert!(decode(&big).is_err());
        let long_hash = pack(&(0, vec![("BlockRemoved", vec![Bin(65)])]));
        assert!(decode(&long_hash).is_err());
        let ok_hash = pack(&(0, vec![("BlockRemoved", vec![Bin(32)])]));
        assert!(decode(&ok_hash).is_ok());
        // One-byte hashes decode to 16 bytes each: a batch past the bound is refused, in one
        // list or spread over events; at the bound it is read.
        let n = MAX_BATCH_ITEMS;
        let one_list = pack(&(0, vec![("BlockRemoved", vec![0u8; n])]));
        assert!(decode(&one_list)
            .unwrap_err()
            .to_string()
            .contains("more than"));
        let spread = pack(&(0, vec![("BlockRemoved", vec![0u8; 3]); n / 4 + 1]));
        assert!(decode(&spread)
            .unwrap_err()
            .to_string()
            .contains("more than"));
        let removal = std::mem::size_of::<Removed>().div_ceil(std::mem::size_of::<Event>());
        let at_bound = pack(&(0, vec![("BlockRemoved", vec![0u8; n - 1 - removal])]));
        assert_eq!(decode(&at_bound).unwrap().events.len(), 1);
        // The budget is the batch's, not the thread's: the next batch starts afresh.
        assert!(decode(&at_bound).is_ok());
        // Stores decode to ~180 bytes from 17: they pay for their boxes, so a batch of
        // minimal stores holds far fewer than MAX_BATCH_ITEMS / 2 of them (which it did).
        let store = ("BlockStored", vec![0u8], None::<u8>, Vec::<u8>::new(), 1u8);
        let stores = |k: usize| pack(&(0, vec![store.clone(); k]));
        let per = 2 + std::mem::size_of::<Stored>().div_ceil(std::mem::size_of::<Event>());
        assert!(
            per >= 6,
            "a store's box is {} bytes",
            std::mem::size_of::<Stored>()
        );
        assert_eq!(decode(&stores(n / per)).unwrap().events.len(), n / per);
        assert!(decode(&stores(n / per + 1))
            .unwrap_err()
            .to_string()
            .contains("more than"));
    }

    /// `n` bytes, packed as msgpack bin.
    struct Bin(usize);

    impl Serialize for Bin {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_bytes(&vec![1; self.0])
        }
    }
}
