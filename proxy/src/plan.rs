//! Planning and the decision: what the router knows of a parsed request (its digest chain,
//! size and session key), and the ranking of the engines that can serve it.
//!
//! The decision itself ([`Gateway::rank`]) takes plain [`RequestFacts`], not a Pingora
//! session: the Pingora path builds them from the parsed body and its headers
//! (`Gateway::plan`), and another front end (an external picker) can build them its own way.

use std::time::{Duration, Instant};

use kvmesh_filters::chain::{text_chain_capped, Digest, Namespace};
use kvmesh_filters::error::{ApiError, ErrorKind};
use kvmesh_filters::request::{Endpoint, ParsedRequest};
use kvmesh_filters::route::{Candidate, Decision, PromptSize};
use pingora::proxy::Session;

use crate::config::Mode;
use crate::fleet::NoRoute;
use crate::service::{Ctx, Gateway};
use crate::tokens::{Fallback, TokenChain};

/// The request header carrying the leading digests to the engine.
pub(crate) use kvmesh_filters::chain::DIGESTS_HEADER;

/// The facts about one request that the routing decision needs, free of any transport.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestFacts {
    /// The model asked for.
    pub model: String,
    /// Digests of the leading blocks of the prompt, first block first: of its canonical bytes
    /// (text mode), or of its tokens (token mode, `block_tokens` set).
    pub chain: Vec<Digest>,
    /// The prompt's size, and the bytes one chain block stands for.
    pub size: PromptSize,
    /// In token mode, the tokens in one chain block (the engine's KV block); `None` in text
    /// mode.
    pub block_tokens: Option<usize>,
    /// Session affinity key: the session header, else the body's `user`.
    pub session_key: Option<String>,
    /// Forwarded by a trusted peer proxy (the hop header): only local engines may serve it.
    pub hop: bool,
}

/// The engines that can serve a request, ranked.
#[derive(Debug, Clone)]
pub struct Ranking {
    /// Healthy engines serving the model, with the prefix overlap the residency index predicts.
    pub candidates: Vec<Candidate>,
    /// Indices into `candidates`, most preferred first, and why the first was chosen.
    pub decision: Decision,
    /// In sidecar mode, why the first choice is the local engine or a peer (the forward
    /// metrics' `reason`); `"rank"` otherwise.
    pub forward_reason: &'static str,
}

impl Ranking {
    /// The candidates in ranked order, most preferred first.
    pub fn ordered(&self) -> impl Iterator<Item = &Candidate> + '_ {
        self.decision.order.iter().map(|&i| &self.candidates[i])
    }
}

/// What the router knows of a parsed request.
pub struct Plan {
    /// The routing facts.
    pub(crate) facts: RequestFacts,
}

/// The namespace of `parsed`'s chain: its model and cache salt.
fn namespace(parsed: &ParsedRequest) -> Namespace {
    Namespace::new(
        &parsed.model,
        parsed.cache_salt.as_deref().unwrap_or("").as_bytes(),
    )
}

impl Gateway {
    /// The plan of a parsed request whose whole body is `body`. A token-mode prompt longer
    /// than [`crate::tokens::INLINE_TOKENIZE_BYTES`] is tokenized on a blocking thread.
    pub(crate) async fn plan(
        &self,
        session: &Session,
        endpoint: Endpoint,
        parsed: ParsedRequest,
        body: &bytes::Bytes,
        hop: bool,
    ) -> Plan {
        // Owned: the session is not held across the tokenizing below.
        let session_header = session
            .req_header()
            .headers
            .get(self.live().cfg.routing.session_header.as_str())
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        // Read before the await: a configuration guard is not held across it.
        let max_blocks = self.live().cfg.routing.max_prefix_blocks;
        let tokens = match self.block_tokens(endpoint, &parsed) {
            Some(_) => Some(
                self.tokens
                    .chain_off_worker(
                        &parsed.model,
                        endpoint,
                        body,
                        &namespace(&parsed),
                        max_blocks,
                    )
                    .await,
            ),
            None => None,
        };
        Plan {
            facts: self.facts(
                endpoint,
                parsed,
                body,
                session_header.as_deref(),
                hop,
                tokens,
            ),
        }
    }

    /// The KV block size, tokens, of `parsed`'s model when it is in token mode and `endpoint`
    /// reuses KV (`None`: text mode).
    fn block_tokens(&self, endpoint: Endpoint, parsed: &ParsedRequest) -> Option<usize> {
        match endpoint {
            Endpoint::Embeddings => None,
            _ => self.tokens.block_tokens(&parsed.model),
        }
    }

    /// The first `routing.forward_digests` digests of `facts`' chain, hex, comma-separated (for
    /// [`DIGESTS_HEADER`]; empty when there are none).
    pub(crate) fn forwarded_digests(&self, facts: &RequestFacts) -> String {
        let n = self
            .live()
            .cfg
            .routing
            .forward_digests
            .min(facts.chain.len());
        let hex: Vec<String> = facts.chain[..n].iter().map(Digest::to_hex).collect();
        hex.join(",")
    }

    /// Parses a request body for `endpoint`, keeping of the canonical prompt only what the
    /// digest chain hashes (`routing.max_prefix_blocks` blocks).
    pub fn parse(
        &self,
        endpoint: Endpoint,
        body: &[u8],
    ) -> std::result::Result<ParsedRequest, ApiError> {
        let routing = &self.live().cfg.routing;
        let keep = routing
            .max_prefix_blocks
            .saturating_mul(routing.block_bytes);
        kvmesh_filters::request::parse_limited(endpoint, body, keep)
    }

    /// The routing facts of a parsed request (whose whole `body` it is): the digest chain of
    /// its prompt's leading blocks (at most `routing.max_prefix_blocks`; token mode when its
    /// model has a tokenizer, see [`crate::tokens`]), its size, and its session key (the value
    /// of the `routing.session_header` header, else the body's `user`). A token-mode chain
    /// already computed, and the time it took, come in `tokens`; with `None` it is computed
    /// here.
    pub fn facts(
        &self,
        endpoint: Endpoint,
        parsed: ParsedRequest,
        body: &[u8],
        session_header: Option<&str>,
        hop: bool,
        tokens: Option<(Result<TokenChain, Fallback>, Duration)>,
    ) -> RequestFacts {
        let routing = &self.live().cfg.routing;
        let ns = namespace(&parsed);
        let mut size = PromptSize {
            total_bytes: parsed.canonical_len,
            block_bytes: routing.block_bytes,
        };
        let block_tokens = self.block_tokens(endpoint, &parsed);
        let chain = match block_tokens {
            None => text_chain_capped(
                &ns,
                &parsed.canonical,
                routing.block_bytes,
                routing.max_prefix_blocks,
            ),
            Some(_) => {
                let (tokens, took) = tokens.unwrap_or_else(|| {
                    self.tokens.chain_timed(
                        &parsed.model,
                        endpoint,
                        body,
                        &ns,
                        routing.max_prefix_blocks,
                    )
                });
                // Zero: the tokenizer panicked (counted as a `tokenizer` fallback below).
                if !took.is_zero() {
                    self.metrics.tokenize_seconds.observe(took.as_secs_f64());
                }
                match tokens {
                    Ok(t) => {
                        // The engine's prompt, in the unit the chain's blocks are measured in.
                        size = PromptSize {
                            total_bytes: t.total_bytes,
                            block_bytes: t.block_bytes,
                        };
                        t.chain
                    }
                    Err(why) => {
                        tracing::debug!(model = %parsed.model, reason = why.label(), "no token chain");
                        self.metrics
                            .token_mode_fallbacks
                            .with_label_values(&[why.label()])
                            .inc();
                        Vec::new()
                    }
                }
            }
        };
        RequestFacts {
            model: parsed.model,
            chain,
            size,
            block_tokens,
            session_key: session_header.map(String::from).or(parsed.user),
            hop,
        }
    }

    pub(crate) fn decide(&self, ctx: &mut Ctx) -> std::result::Result<(), ApiError> {
        let Some(plan) = ctx.plan.as_ref() else {
            return Err(ApiError::new(ErrorKind::Internal, "no request plan"));
        };
        let ranking = self.rank_traced(&plan.facts, ctx.trace.as_ref())?;
        ctx.forward_reason = ranking.forward_reason;
        ctx.decision = Some((ranking.candidates, ranking.decision));
        Ok(())
    }

    /// [`Self::rank`], recorded as a `kvmesh.route` span of `trace` when there is one.
    pub(crate) fn rank_traced(
        &self,
        facts: &RequestFacts,
        trace: Option<&crate::otel::RequestTrace>,
    ) -> std::result::Result<Ranking, ApiError> {
        let started = std::time::SystemTime::now();
        let ranking = self.rank(facts);
        if let Some(t) = trace {
            match &ranking {
                Ok(r) => t.route(started, self.route_attributes(facts, r), None),
                Err(e) => t.route(started, Vec::new(), Some(&e.message)),
            }
        }
        ranking
    }

    /// What a `kvmesh.route` span says of `ranking`.
    fn route_attributes(
        &self,
        facts: &RequestFacts,
        ranking: &Ranking,
    ) -> Vec<opentelemetry::KeyValue> {
        use crate::otel::attr;
        use opentelemetry::KeyValue;
        let mut a = vec![
            crate::otel::client_attr("gen_ai.request.model", &facts.model),
            attr("kvmesh.route.policy", self.live().router.policy().label()),
            attr("kvmesh.route.reason", ranking.decision.reason.label()),
            KeyValue::new("kvmesh.route.candidates", ranking.candidates.len() as i64),
            KeyValue::new("kvmesh.prompt_blocks", facts.chain.len() as i64),
        ];
        if let Some(first) = ranking.ordered().next() {
            if let Some(e) = self.fleet.get(first.node) {
                a.push(attr("kvmesh.engine", e.name.clone()));
            }
            a.push(KeyValue::new(
                "kvmesh.overlap_blocks",
                first.overlap_blocks as i64,
            ));
        }
        if self.live().cfg.mode == Mode::Sidecar && !facts.hop {
            a.push(attr("kvmesh.forward_reason", ranking.forward_reason));
        }
        a
    }

    /// Ranks the engines for a request: the policy over the residency index and live load, and
    /// in sidecar mode the sidecar rule. Counts the decision in the metrics. The error is the
    /// answer the proxy gives: an unknown model (404), or no healthy engine serving it (503).
    pub fn rank(&self, facts: &RequestFacts) -> std::result::Result<Ranking, ApiError> {
        let mut cands = self
            .fleet
            .candidates(&facts.model, facts.hop)
            .map_err(|e| match e {
                NoRoute::UnknownModel => ApiError::new(
                    ErrorKind::ModelNotFound,
                    format!(
                        "the model `{}` does not exist or is not served by any engine",
                        facts.model
                    ),
                )
                .with_param("model"),
                NoRoute::NoneHealthy => ApiError::new(
                    ErrorKind::NoEngine,
                    format!("no healthy engine serves `{}`", facts.model),
                ),
            })?;
        for (node, blocks) in self.index.overlap(&facts.chain, Instant::now()) {
            if let Some(c) = cands.iter_mut().find(|c| c.node == node) {
                c.overlap_blocks = blocks;
            }
        }
        let live = self.live();
        let mut decision = live.router.rank(
            &cands,
            &facts.size,
            facts.session_key.as_deref(),
            &mut fastrand::Rng::new(),
        );
        let mut forward_reason = crate::placement::reason::RANK;
        if live.cfg.mode == Mode::Sidecar && !facts.hop {
            forward_reason = self.prefer_local(&cands, &mut decision, facts);
        }
        self.metrics
            .decisions
            .with_label_values(&[live.router.policy().label(), decision.reason.label()])
            .inc();
        Ok(Ranking {
            candidates: cands,
            decision,
            forward_reason,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use kvmesh_filters::chain::{text_chain_capped, Namespace};
    use kvmesh_filters::error::ErrorKind;
    use kvmesh_filters::residency::{NodeId, Source};

    use super::RequestFacts;
    use crate::config::ProxyConfig;
    use crate::fleet::Fleet;
    use crate::service::Gateway;
    use crate::testing::{engine_addr, gateway_over, peer_engine};

    /// A gateway over three healthy engines serving `m`, with the default configuration.
    fn gateway() -> Gateway {
        let addrs = ["a", "b", "c"]
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let addr = format!("127.0.0.1:{}", i + 1);
                engine_addr(name, &format!("http://{addr}"), &addr, &["m"])
            })
            .collect();
        let fleet = Fleet::new(addrs, Duration::from_secs(5));
        for e in fleet.engines().iter() {
            e.mark_up();
        }
        gateway_over(ProxyConfig::default(), fleet)
    }

    /// Facts for a long shared prompt to `model`.
    fn facts(gw: &Gateway, model: &str) -> RequestFacts {
        let prompt = "You are a helpful assistant. Answer briefly. ".repeat(100);
        let chain = text_chain_capped(
            &Namespace::new(model, b""),
            prompt.as_bytes(),
            gw.live().cfg.routing.block_bytes,
            gw.live().cfg.routing.max_prefix_blocks,
        );
        RequestFacts {
            model: model.into(),
            chain,
            size: kvmesh_filters::route::PromptSize {
                total_bytes: prompt.len(),
                block_bytes: gw.live().cfg.routing.block_bytes,
            },
            block_tokens: None,
            session_key: None,
            hop: false,
        }
    }

    #[test]
    fn the_engine_holding_the_prefix_ranks_first() {
        let gw = gateway();
        let facts = facts(&gw, "m");
        assert!(facts.chain.len() > 1);
        let b = gw.fleet.engines()[1].id;
        assert_eq!(b, NodeId(1));
        gw.index
            .record(b, &facts.chain, Source::Optimistic, Instant::now());
        let ranking = gw.rank(&facts).unwrap();
        assert_eq!(ranking.candidates.len(), 3);
        let ordered: Vec<_> = ranking.ordered().collect();
        assert_eq!(ordered.len(), 3);
        assert_eq!(ordered[0].node, b);
        assert_eq!(ordered[0].overlap_blocks, facts.chain.len());
        assert!(ordered[1..].iter().all(|c| c.overlap_blocks == 0));
        assert_eq!(ranking.decision.reason.label(), "prefix_hit");
        assert_eq!(ranking.forward_reason, "rank");
    }

    #[test]
    fn a_hop_is_ranked_over_local_engines_only() {
        let gw = gateway();
        let peer = gw.fleet.upsert_peer(&peer_engine("peer", 9, 0, 0));
        let mut facts = facts(&gw, "m");
        gw.index
            .record(peer, &facts.chain, Source::Optimistic, Instant::now());
        assert_eq!(
            gw.rank(&facts).unwrap().ordered().next().unwrap().node,
            peer
        );
        facts.hop = true;
        let ranking = gw.rank(&facts).unwrap();
        assert_eq!(ranking.candidates.len(), 3);
        assert!(ranking.ordered().all(|c| c.node != peer));
    }

    #[test]
    fn an_unknown_model_is_no_route() {
        let gw = gateway();
        let e = gw.rank(&facts(&gw, "nope")).unwrap_err();
        assert_eq!(e.kind, ErrorKind::ModelNotFound);
        assert_eq!(e.status(), 404);
        assert_eq!(
            e.message,
            "the model `nope` does not exist or is not served by any engine"
        );
        assert_eq!(e.param.as_deref(), Some("model"));
    }

    #[test]
    fn no_healthy_engine_is_no_engine() {
        let gw = gateway();
        for e in gw.fleet.engines().iter() {
            e.mark_down();
        }
        let e = gw.rank(&facts(&gw, "m")).unwrap_err();
        assert_eq!(e.kind, ErrorKind::NoEngine);
        assert_eq!(e.message, "no healthy engine serves `m`");
    }
}
