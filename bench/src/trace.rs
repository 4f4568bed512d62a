//! The Mooncake trace format (`../shared/data/traces/README.md`) and its text synthesis.
//!
//! Each line: `{"timestamp": ms, "input_length": tokens, "output_length": tokens,
//! "hash_ids": [..]}`; a hash id names a 512-token prefix block. To replay it over HTTP, each
//! hash id becomes a deterministic block of text (same id, same text; different ids, different
//! text) of 512 tokens for the simulator's tokenizer (4 bytes a token), and a request's prompt is
//! its blocks concatenated, cut to `input_length` tokens.

use std::path::Path;

use anyhow::{bail, Context};
use serde::Deserialize;

/// Tokens per trace block.
pub const BLOCK_TOKENS: usize = 512;
/// Bytes per token of the simulator's tokenizer.
pub const BYTES_PER_TOKEN: usize = 4;

/// One request of the trace.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceRequest {
    /// Arrival time, ms from the start of the trace.
    pub timestamp: u64,
    /// Prompt length, tokens.
    pub input_length: usize,
    /// Completion length, tokens.
    pub output_length: u64,
    /// Prefix block ids, one per 512 tokens (the last may be partial).
    pub hash_ids: Vec<u64>,
}

/// Parses a trace from JSON lines; errors name the line.
pub fn parse(text: &str) -> anyhow::Result<Vec<TraceRequest>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let r: TraceRequest =
            serde_json::from_str(line).with_context(|| format!("trace line {}", i + 1))?;
        if r.input_length == 0 {
            bail!("trace line {}: input_length is 0", i + 1);
        }
        if r.hash_ids.len() * BLOCK_TOKENS < r.input_length {
            bail!(
                "trace line {}: {} hash ids cover {} tokens, fewer than input_length {}",
                i + 1,
                r.hash_ids.len(),
                r.hash_ids.len() * BLOCK_TOKENS,
                r.input_length
            );
        }
        if let Some(prev) = out.last().map(|p: &TraceRequest| p.timestamp) {
            if r.timestamp < prev {
                bail!(
                    "trace line {}: timestamp {} goes back in time (previous {prev})",
                    i + 1,
                    r.timestamp
                );
            }
        }
        out.push(r);
    }
    Ok(out)
}

/// Reads a trace file.
pub fn read(path: &Path) -> anyhow::Result<Vec<TraceRequest>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    parse(&text).with_context(|| format!("in {}", path.display()))
}

/// The text of one block: `BLOCK_TOKENS * BYTES_PER_TOKEN` bytes of lowercase words, seeded by
/// the hash id, starting with the id itself so that no two blocks can be equal.
pub fn block_text(hash_id: u64) -> String {
    let len = BLOCK_TOKENS * BYTES_PER_TOKEN;
    let mut s = format!("[{hash_id}] ");
    s.push_str(&crate::load::text(
        hash_id.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5eed,
        len,
    ));
    s.truncate(len);
    s
}

/// A request's prompt: its blocks' text, cut to `input_length` tokens.
pub fn prompt(r: &TraceRequest) -> String {
    let len = r.input_length * BYTES_PER_TOKEN;
    let mut s = String::with_capacity(len);
    for id in &r.hash_ids {
        if s.len() >= len {
            break;
        }
        s.push_str(&block_text(*id));
    }
    s.truncate(len);
    s
}

/// Leading blocks each request shares with any earlier request: the trace's own upper bound
/// on prefix reuse, in tokens (one engine, infinite cache, 512-token granularity).
pub fn block_oracle(trace: &[TraceRequest]) -> f64 {
    let mut seen = std::collections::HashSet::new();
    let (mut hit, mut total) = (0usize, 0usize);
    for r in trace {
        let shared = r.hash_ids.iter().take_while(|h| seen.contains(*h)).count();
        hit += (shared * BLOCK_TOKENS).min(r.input_length);
        total += r.input_length;
        seen.extend(r.hash_ids.iter().copied());
    }
    if total == 0 {
        0.0
    } else {
        hit as f64 / total as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_filters::chain::{text_chain, Namespace};
    use kvmesh_filters::request::{parse as parse_request, Endpoint};

    const SAMPLE: &str = r#"{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]}
{"timestamp": 10, "input_length": 1024, "output_length": 7, "hash_ids": [1, 2]}
{"timestamp": 20, "input_length": 600, "output_length": 7, "hash_ids": [1, 9]}
"#;

    #[test]
    fn reads_the_format_and_rejects_bad_lines() {
        let t = parse(SAMPLE).unwrap();
        assert_eq!(t.len(), 3);
        assert_eq!(
            t[0],
            TraceRequest {
                timestamp: 0,
                input_length: 1100,
                output_length: 5,
                hash_ids: vec![1, 2, 3]
            }
        );
        let e = parse("{\"timestamp\": 0}\n").unwrap_err();
        assert!(format!("{e:#}").contains("line 1"), "{e:#}");
        let e =
            parse(r#"{"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1]}"#)
                .unwrap_err();
        assert!(
            format!("{e:#}").contains("fewer than input_length"),
            "{e:#}"
        );
        let e = parse(&format!(
            "{}\n{}",
            r#"{"timestamp": 5, "input_length": 1, "output_length": 1, "hash_ids": [1]}"#,
            r#"{"timestamp": 4, "input_length": 1, "output_length": 1, "hash_ids": [1]}"#
        ))
        .unwrap_err();
        assert!(format!("{e:#}").contains("back in time"), "{e:#}");
    }

    #[test]
    fn the_shared_trace_file_parses() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../shared/data/traces/mooncake_synthetic_trace.jsonl");
        if let Ok(t) = read(&path) {
            assert_eq!(t.len(), 3993);
            let o = block_oracle(&t);
            assert!(o > 0.6 && o < 0.7, "{o}");
        } else {
            // shared/ sits beside the checkout in CI and development; say so if it does not.
            panic!(
                "{} not readable: the trace ships in ../shared",
                path.display()
            );
        }
    }

    #[test]
    fn same_id_same_text_different_ids_different_text() {
        assert_eq!(block_text(7), block_text(7));
        assert_ne!(block_text(7), block_text(8));
        assert_eq!(block_text(7).len(), BLOCK_TOKENS * BYTES_PER_TOKEN);
        let t = parse(SAMPLE).unwrap();
        assert_eq!(prompt(&t[0]).len(), 1100 * BYTES_PER_TOKEN);
        assert_eq!(prompt(&t[2]).len(), 600 * BYTES_PER_TOKEN);
    }

    #[test]
    fn shared_ids_give_a_shared_prefix_after_canonicalisation() {
        let t = parse(SAMPLE).unwrap();
        let chain = |r: &TraceRequest| {
            let body = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": prompt(r)}]});
            let p = parse_request(
                Endpoint::ChatCompletions,
                &serde_json::to_vec(&body).unwrap(),
            )
            .unwrap();
            text_chain(&Namespace::new("m", b""), &p.canonical, 256)
        };
        let (a, b, c) = (chain(&t[0]), chain(&t[1]), chain(&t[2]));
        let common = |x: &[kvmesh_filters::Digest], y: &[kvmesh_filters::Digest]| {
            x.iter().zip(y).take_while(|(p, q)| p == q).count()
        };
        // Two shared 2,048-byte blocks = 4,096 canonical bytes after the "user\n" header: 16 full
        // 256-byte blocks in common (the 17th straddles the divergence).
        assert_eq!(common(&a, &b), 16);
        assert_eq!(common(&a, &c), 8);
        assert_eq!(
            block_oracle(&t),
            (1024.0 + 512.0) / (1100.0 + 1024.0 + 600.0)
        );
    }
}
