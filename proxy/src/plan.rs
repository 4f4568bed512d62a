//! Planning and the decision: what the router knows of a parsed request (its digest chain,
//! size and session key), and the ranking of the engines that can serve it.

use std::time::Instant;

use kvmesh_filters::chain::{text_chain_capped, Digest, Namespace};
use kvmesh_filters::error::{ApiError, ErrorKind};
use kvmesh_filters::request::{Endpoint, ParsedRequest};
use pingora::proxy::Session;

use crate::config::Mode;
use crate::fleet::NoRoute;
use crate::service::{Ctx, Gateway};

/// What the router knows of a parsed request.
pub struct Plan {
    pub(crate) endpoint: Endpoint,
    pub(crate) model: String,
    pub(crate) chain: Vec<Digest>,
    pub(crate) total_bytes: usize,
    pub(crate) session_key: Option<String>,
}

impl Gateway {
    pub(crate) fn plan(&self, session: &Session, parsed: ParsedRequest) -> Plan {
        let ns = Namespace::new(
            &parsed.model,
            parsed.cache_salt.as_deref().unwrap_or("").as_bytes(),
        );
        let chain = text_chain_capped(
            &ns,
            &parsed.canonical,
            self.cfg.routing.block_bytes,
            self.cfg.routing.max_prefix_blocks,
        );
        let session_key = session
            .req_header()
            .headers
            .get(self.cfg.routing.session_header.as_str())
            .and_then(|v| v.to_str().ok())
            .map(String::from)
            .or(parsed.user);
        Plan {
            endpoint: parsed.endpoint,
            model: parsed.model,
            chain,
            total_bytes: parsed.canonical_len,
            session_key,
        }
    }

    pub(crate) fn decide(&self, ctx: &mut Ctx) -> std::result::Result<(), ApiError> {
        let Some(plan) = ctx.plan.as_ref() else {
            return Err(ApiError::new(ErrorKind::Internal, "no request plan"));
        };
        let mut cands =
            self.fleet
                .candidates(&plan.model, ctx.local_only)
                .map_err(|e| match e {
                    NoRoute::UnknownModel => ApiError::new(
                        ErrorKind::ModelNotFound,
                        format!(
                            "the model `{}` does not exist or is not served by any engine",
                            plan.model
                        ),
                    )
                    .with_param("model"),
                    NoRoute::NoneHealthy => ApiError::new(
                        ErrorKind::NoEngine,
                        format!("no healthy engine serves `{}`", plan.model),
                    ),
                })?;
        for (node, blocks) in self.index.overlap(&plan.chain, Instant::now()) {
            if let Some(c) = cands.iter_mut().find(|c| c.node == node) {
                c.overlap_blocks = blocks;
            }
        }
        let mut decision = self.router.rank(
            &cands,
            plan.total_bytes,
            plan.session_key.as_deref(),
            &mut fastrand::Rng::new(),
        );
        if self.cfg.mode == Mode::Sidecar && !ctx.local_only {
            ctx.forward_reason = self.prefer_local(&cands, &mut decision, plan);
        }
        self.metrics
            .decisions
            .with_label_values(&[self.router.policy().label(), decision.reason.label()])
            .inc();
        ctx.decision = Some((cands, decision));
        Ok(())
    }
}
