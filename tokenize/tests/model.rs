//! The tokenizer of the real model (SmolLM2-135M-Instruct, installed by scripts/setup.sh):
//! tokenizing a prefix gives the whole text's first tokens, for chat prompts and for texts
//! made of the pieces where byte-level BPE boundaries are subtle.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::sync::OnceLock;

use kvmesh_tokenize::gguf::Gguf;
use kvmesh_tokenize::{ModelTokenizer, PrefixCache, TextStream};
use proptest::prelude::*;

fn tokenizer() -> &'static ModelTokenizer {
    static T: OnceLock<ModelTokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
        let g = Gguf::open(&path).expect("the model (scripts/setup.sh installs it)");
        ModelTokenizer::from_gguf(&g).expect("tokenizer")
    })
}

/// Pieces whose joins exercise the pre-tokenizer: words, runs of spaces and newlines, digits
/// (split one by one by SmolLM2's pre-tokenizer), punctuation, contractions, multi-byte text and
/// the chat template's control tokens.
const PIECES: &[&str] = &[
    "the",
    " the",
    "  ",
    " ",
    "   ",
    "\n",
    "\n\n",
    " \n",
    "\t",
    "2024",
    " 7",
    "3.14",
    ",",
    ".",
    "!?",
    "'s",
    "'re",
    " don't",
    "é",
    " naïve",
    "日本語",
    " 😀",
    "<|im_start|>",
    "<|im_end|>",
    "user",
    "assistant",
    "\u{a0}",
    "x",
    "supercalifragilistic",
    "--",
    " ==",
];

fn text() -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(PIECES), 0..160).prop_map(|p| p.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// In chunks of 1 to 64 bytes, tokenized afresh, then again from the cache (a shared
    /// one: chunks of earlier cases too), and without a cache.
    #[test]
    fn a_prefix_encoding_is_the_whole_encodings_prefix(
        t in text(),
        min in 0usize..200,
        chunk in 1usize..64,
    ) {
        static SHARED: OnceLock<PrefixCache> = OnceLock::new();
        let tok = tokenizer();
        let whole = tok.encode(&t).unwrap();
        let fresh = PrefixCache::new(chunk, 1 << 16);
        let shared = SHARED.get_or_init(|| PrefixCache::new(8, 1 << 12));
        let none = PrefixCache::new(chunk, 0);
        for (cache, want) in [(&fresh, min), (&fresh, min), (shared, min), (&none, min), (&fresh, usize::MAX)] {
            let (prefix, bytes) = tok.encode_prefix(&t, want, cache, b"").unwrap();
            prop_assert!(bytes <= t.len());
            prop_assert_eq!(&tok.encode(&t[..bytes]).unwrap(), &prefix);
            prop_assert_eq!(&whole[..prefix.len()], &prefix[..]);
            let c = cache.chunk_bytes();
            if prefix.len() < want.min(whole.len()) {
                // Stopped early: only where no boundary came within four chunks of the last cut.
                prop_assert!(bytes + 4 * c < t.len(), "stopped at {bytes} of {}", t.len());
                prop_assert!(!has_cut(&t, bytes + c, bytes + 4 * c), "stopped at {bytes} before a cut");
            }
        }
    }
}

/// The pieces [`ModelTokenizer::decode_step`] gives, then what it holds back, are the text of all
/// the ids decoded at once.
fn streamed(tok: &ModelTokenizer, ids: &[u32]) -> String {
    let mut stream = TextStream::default();
    let mut out = String::new();
    for &id in ids {
        if let Some(piece) = tok.decode_step(&mut stream, id).unwrap() {
            assert!(!piece.is_empty(), "an empty piece after {id}");
            out.push_str(&piece);
        }
    }
    out + &tok.decode_rest(&stream).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// Ids of real text (multi-byte characters split across tokens, control tokens skipped).
    #[test]
    fn streamed_text_is_the_whole_decoding(t in text()) {
        let tok = tokenizer();
        let ids = tok.encode(&t).unwrap();
        prop_assert_eq!(streamed(tok, &ids), tok.decode(&ids).unwrap());
    }

    /// Any ids, so also byte tokens that never complete a character, mid-sequence and last.
    #[test]
    fn streamed_ids_are_the_whole_decoding(
        ids in prop::collection::vec(0u32..tokenizer().vocab_size() as u32, 0..200),
    ) {
        let tok = tokenizer();
        prop_assert_eq!(streamed(tok, &ids), tok.decode(&ids).unwrap());
    }
}

/// Whether `t` has a whitespace character after a non-whitespace one at a byte offset in
/// `from..until` (the test's own statement of a chunk boundary).
fn has_cut(t: &str, from: usize, until: usize) -> bool {
    let mut prev: Option<char> = None;
    for (i, c) in t.char_indices() {
        if i >= from && i < until && c.is_whitespace() && prev.is_some_and(|p| !p.is_whitespace()) {
            return true;
        }
        prev = Some(c);
    }
    false
}

#[test]
fn a_long_chat_prompt_is_cut_early_and_agrees() {
    let tok = tokenizer();
    let passage = "The quick brown fox jumps over the lazy dog, 42 times. ".repeat(400);
    let prompt = tok
        .render_chat(&[
            ("system".into(), "You are helpful.".into()),
            ("user".into(), passage),
        ])
        .unwrap();
    let whole = tok.encode(&prompt).unwrap();
    let cache = PrefixCache::new(1024, 1 << 16);
    let (prefix, bytes) = tok.encode_prefix(&prompt, 256, &cache, b"").unwrap();
    assert!(
        !cache.is_empty() && cache.len() < 4,
        "{} chunks",
        cache.len()
    );
    assert!(
        bytes < prompt.len() / 4,
        "{bytes} of {} bytes",
        prompt.len()
    );
    assert!(prefix.len() >= 256);
    // Only about the first blocks were tokenized, not the whole 22 KB prompt.
    assert!(
        prefix.len() < whole.len() / 4,
        "{} of {}",
        prefix.len(),
        whole.len()
    );
    assert_eq!(&whole[..prefix.len()], &prefix[..]);
}

#[test]
fn a_prompt_without_whitespace_costs_a_bounded_amount() {
    let tok = tokenizer();
    let cache = PrefixCache::new(1024, 1 << 20);
    // 1 MiB of digits (one token each) and of letters: no cut anywhere.
    for text in ["1".repeat(1 << 20), "a".repeat(1 << 20)] {
        let (ids, bytes) = tok.encode_prefix(&text, 16_384, &cache, b"").unwrap();
        assert_eq!((ids.len(), bytes), (0, 0));
    }
    // Words, then 1 MiB without a boundary: the prefix stops at the last chunk cut before it
    // (chunks of at least 1 KiB: at byte 1024, a space).
    let text = format!("{}{}", "word ".repeat(300), "x".repeat(1 << 20));
    let (ids, bytes) = tok.encode_prefix(&text, 16_384, &cache, b"").unwrap();
    assert_eq!(bytes, 1024);
    assert_eq!(tok.encode(&text[..bytes]).unwrap(), ids);
    assert!(cache.ids() < 1000, "{} ids cached", cache.ids());
}
