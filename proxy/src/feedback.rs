//! Usage feedback: once a response is complete, its `usage` (prompt and cached tokens) settles
//! the residency prediction made when the engine was chosen.

use std::time::Instant;

use kvmesh_filters::usage;

use crate::service::{Ctx, Gateway};

impl Gateway {
    /// The response is complete: confirm or refute the residency prediction from `usage`.
    pub(crate) fn settle_usage(&self, ctx: &Ctx) {
        let u = match (&ctx.sse, &ctx.json) {
            (Some(s), _) => s.usage(),
            (None, Some(body)) => usage::from_json(body),
            _ => None,
        };
        let (Some(u), Some(plan), Some(d)) = (u, ctx.plan.as_ref(), ctx.dispatch.as_ref()) else {
            return;
        };
        self.metrics.prompt_tokens.inc_by(u.prompt_tokens);
        let Some(cached) = u.cached_tokens else {
            return;
        };
        self.metrics.cached_tokens.inc_by(cached);
        if u.prompt_tokens == 0 || plan.facts.chain.is_empty() {
            return;
        }
        // Text-mode estimate: the cached share of the prompt, in blocks of canonical bytes.
        let cached_bytes =
            (plan.facts.total_bytes as u128 * cached as u128 / u.prompt_tokens as u128) as usize;
        let cached_blocks =
            (cached_bytes / self.cfg.routing.block_bytes).min(plan.facts.chain.len());
        let verdict = self.index.confirm(
            d.engine().id,
            &plan.facts.chain,
            ctx.predicted_overlap,
            cached_blocks,
            ctx.prediction_settled,
            Instant::now(),
        );
        self.metrics
            .residency_verdicts
            .with_label_values(&[verdict.label()])
            .inc();
    }
}
