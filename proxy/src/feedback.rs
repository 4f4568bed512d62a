//! Usage feedback: once a response is complete, its `usage` (prompt and cached tokens) settles
//! the residency prediction made when the engine was chosen.

use std::time::Instant;

use kvmesh_filters::usage::{JsonUsageScanner, SseUsageScanner, Usage};
use kvmesh_filters::NodeId;

use crate::plan::RequestFacts;
use crate::service::{Ctx, Gateway};

/// Most bytes of a non-streamed response's `usage` value kept while the body passes through
/// (the rest of the body is not kept).
const MAX_USAGE_VALUE: usize = 64 << 10;
/// Longest SSE line kept while looking for `usage` (a longer line is passed through unread:
/// usage events are short, and each stream in flight may hold this much).
const MAX_SSE_LINE: usize = 64 << 10;
/// Most tokens one answer's usage counts, in each field (about 4 billion: far beyond any
/// context, far below what would wrap a 64-bit counter).
pub(crate) const MAX_USAGE_TOKENS: u64 = u32::MAX as u64;

/// Where a successful response's `usage` is looked for while its body passes through: the SSE
/// events of a stream, or the JSON document's top-level `usage` value. Either keeps a bounded
/// number of bytes per response (a line, a value), not the body.
pub(crate) enum UsageScan {
    /// `text/event-stream`.
    Sse(SseUsageScanner),
    /// Anything else.
    Json(JsonUsageScanner),
}

impl UsageScan {
    /// The scan for a response of `content_type`.
    pub(crate) fn for_content_type(content_type: Option<&str>) -> Self {
        if content_type.is_some_and(|v| v.starts_with("text/event-stream")) {
            UsageScan::Sse(SseUsageScanner::new(MAX_SSE_LINE))
        } else {
            UsageScan::Json(JsonUsageScanner::new(MAX_USAGE_VALUE))
        }
    }

    /// Reads the next body chunk.
    pub(crate) fn feed(&mut self, chunk: &[u8]) {
        match self {
            UsageScan::Sse(s) => s.feed(chunk),
            UsageScan::Json(j) => j.feed(chunk),
        }
    }

    /// The `usage` read, once the body is complete.
    pub(crate) fn usage(&self) -> Option<Usage> {
        match self {
            UsageScan::Sse(s) => s.usage(),
            UsageScan::Json(j) => j.usage(),
        }
    }
}

/// `u` with each count at most [`MAX_USAGE_TOKENS`] and cached at most prompt. The engine's
/// numbers are its claim (or a peer's, passed through): one answer cannot wrap a counter, nor
/// report more cached tokens than prompt tokens (the hit ratio stays within 0..=1).
fn bounded(mut u: Usage) -> Usage {
    u.prompt_tokens = u.prompt_tokens.min(MAX_USAGE_TOKENS);
    u.completion_tokens = u.completion_tokens.map(|c| c.min(MAX_USAGE_TOKENS));
    u.cached_tokens = u.cached_tokens.map(|c| c.min(u.prompt_tokens));
    u
}

/// The prediction a response settles: where the request went and what the index expected.
pub(crate) struct Prediction<'a> {
    /// The request's routing facts.
    pub facts: &'a RequestFacts,
    /// The engine that served it.
    pub engine: NodeId,
    /// Leading blocks the index predicted that engine held.
    pub overlap_blocks: usize,
    /// The engine had no prefill queued when chosen, so the prediction was not a guess about
    /// work still in flight.
    pub settled: bool,
}

impl Gateway {
    /// The response is complete: confirm or refute the residency prediction from `usage`
    /// (returned, when the response carried one).
    pub(crate) fn settle_usage(&self, ctx: &Ctx) -> Option<Usage> {
        let u = ctx.usage.as_ref().and_then(UsageScan::usage).map(bounded);
        let (Some(plan), Some(d)) = (ctx.plan.as_ref(), ctx.dispatch.as_ref()) else {
            return u;
        };
        if let Some(u) = u {
            self.metrics.per_engine.tokens(&d.engine().name, &u);
        }
        self.settle(
            u,
            &Prediction {
                facts: &plan.facts,
                engine: d.engine().id,
                overlap_blocks: ctx.predicted_overlap,
                settled: ctx.prediction_settled,
            },
        );
        u
    }

    /// Counts the tokens `u` reports (each count at most [`MAX_USAGE_TOKENS`], cached at most
    /// prompt) and confirms or refutes `p` in the residency index.
    pub(crate) fn settle(&self, u: Option<Usage>, p: &Prediction<'_>) {
        let Some(u) = u.map(bounded) else {
            return;
        };
        self.metrics.prompt_tokens.inc_by(u.prompt_tokens);
        if let Some(c) = u.completion_tokens {
            self.metrics.completion_tokens.inc_by(c);
        }
        let Some(cached) = u.cached_tokens else {
            return;
        };
        self.metrics.cached_tokens.inc_by(cached);
        // An engine that left meanwhile (a reload, a peer's departure) has no residency.
        if u.prompt_tokens == 0 || p.facts.chain.is_empty() || self.fleet.get(p.engine).is_none() {
            return;
        }
        let cached_blocks = match p.facts.block_tokens {
            // Token mode: the engine's blocks are the chain's.
            Some(block_tokens) => (cached / block_tokens.max(1) as u64) as usize,
            // Text mode, an estimate: the cached share of the prompt, in blocks of its bytes.
            None => {
                let size = &p.facts.size;
                let cached_bytes =
                    size.total_bytes as u128 * cached as u128 / u.prompt_tokens as u128;
                (cached_bytes / size.block_bytes.max(1) as u128) as usize
            }
        }
        .min(p.facts.chain.len());
        let verdict = self.index.confirm(
            p.engine,
            &p.facts.chain,
            p.overlap_blocks,
            cached_blocks,
            p.settled,
            Instant::now(),
        );
        self.metrics
            .residency_verdicts
            .with_label_values(&[verdict.label()])
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ProxyConfig;
    use crate::fleet::Fleet;
    use crate::testing::{engine_addr, gateway_over};
    use kvmesh_filters::route::PromptSize;

    /// An engine's usage is its claim: more cached than prompt tokens counts as all of the
    /// prompt, and a count near u64::MAX neither wraps the counters nor reaches them whole.
    #[test]
    fn hostile_usage_numbers_are_bounded_in_the_counters() {
        let fleet = Fleet::new(
            vec![engine_addr(
                "a",
                "http://127.0.0.1:1",
                "127.0.0.1:1",
                &["m"],
            )],
            std::time::Duration::from_secs(5),
        );
        let gw = gateway_over(ProxyConfig::default(), fleet);
        let facts = RequestFacts {
            model: "m".into(),
            chain: Vec::new(),
            size: PromptSize {
                total_bytes: 0,
                block_bytes: 1,
            },
            block_tokens: None,
            session_key: None,
            hop: false,
        };
        let p = Prediction {
            facts: &facts,
            engine: NodeId(0),
            overlap_blocks: 0,
            settled: true,
        };
        let usage = |prompt, cached, completion| Usage {
            prompt_tokens: prompt,
            cached_tokens: Some(cached),
            completion_tokens: Some(completion),
        };
        gw.settle(Some(usage(10, u64::MAX, 3)), &p);
        let m = &gw.metrics;
        assert_eq!((m.prompt_tokens.get(), m.cached_tokens.get()), (10, 10));
        for _ in 0..3 {
            gw.settle(Some(usage(u64::MAX, u64::MAX, u64::MAX)), &p);
        }
        let big = 3 * MAX_USAGE_TOKENS;
        assert_eq!(m.prompt_tokens.get(), 10 + big);
        assert_eq!(m.cached_tokens.get(), 10 + big);
        assert_eq!(m.completion_tokens.get(), 3 + big);
    }
}
