//! The request path's access checks, in the order the gateway runs them: the API key and its
//! in-flight limit (before the body is read), then, once the body is parsed, the key's model
//! allow-list and its tenant's cache salt (written into the body the engine gets), and after
//! the decision the model's admission gate ([`crate::admission`]).

use bytes::Bytes;
use kvmesh_filters::error::{ApiError, ErrorKind};
use kvmesh_filters::request::ParsedRequest;
use pingora::proxy::Session;

use crate::config::HopTrust;
use crate::service::{Ctx, Gateway};

/// The longest client `cache_salt` accepted with API keys (it is sent on to engines).
pub const MAX_CACHE_SALT_BYTES: usize = 256;

impl Gateway {
    fn refuse(&self, reason: &str, e: ApiError) -> ApiError {
        self.metrics
            .admission_rejections
            .with_label_values(&[reason])
            .inc();
        e
    }

    /// With `[auth]`: the caller's key (401 without a valid one) and one of its in-flight slots
    /// (429 at its limit), kept in `ctx`. Nothing without `[auth]`.
    pub(crate) fn authenticate(
        &self,
        session: &Session,
        ctx: &mut Ctx,
    ) -> std::result::Result<(), ApiError> {
        let Some(auth) = self.auth.as_ref() else {
            return Ok(());
        };
        let header = session
            .req_header()
            .headers
            .get(http::header::AUTHORIZATION)
            .map(|v| v.as_bytes());
        let principal = auth
            .authenticate(header)
            .map_err(|e| self.refuse("unauthenticated", e))?;
        if ctx.local_only && self.live().cfg.sidecar.accept_hop_from == HopTrust::ClusterCert {
            // Forwarded by a peer that proved itself with its cluster certificate, and that holds
            // the key's slot for it already. (Loopback or member-IP trust proves no such thing:
            // any local client could send the hop header to skip the key's cap.)
            ctx.principal = Some(principal);
            return Ok(());
        }
        let slot = principal.enter().ok_or_else(|| {
            self.refuse(
                "key_inflight",
                ApiError::new(
                    ErrorKind::Overloaded,
                    format!(
                        "API key {:?} is at its limit of requests in flight; retry shortly",
                        principal.name
                    ),
                ),
            )
        })?;
        ctx.key_slot = Some(slot);
        ctx.principal = Some(principal);
        Ok(())
    }

    /// With a key: 403 for a model the key may not use; the tenant's cache salt set in
    /// `parsed` (the digest chain's namespace) and in the body the engine gets (whose larger
    /// size is charged to the body budget).
    pub(crate) fn apply_tenant(
        &self,
        ctx: &mut Ctx,
        parsed: &mut ParsedRequest,
        body: Bytes,
    ) -> std::result::Result<Bytes, ApiError> {
        let Some(p) = ctx.principal.as_ref() else {
            return Ok(body);
        };
        if !p.allows(&parsed.model) {
            return Err(self.refuse(
                "model_forbidden",
                ApiError::new(
                    ErrorKind::Forbidden,
                    format!(
                        "API key {:?} may not use the model `{}`",
                        p.name, parsed.model
                    ),
                )
                .with_param("model"),
            ));
        }
        if parsed
            .cache_salt
            .as_ref()
            .is_some_and(|s| s.len() > MAX_CACHE_SALT_BYTES)
        {
            return Err(ApiError::new(
                ErrorKind::InvalidRequest,
                format!("`cache_salt` must be at most {MAX_CACHE_SALT_BYTES} bytes"),
            )
            .with_param("cache_salt"));
        }
        let salt = p.cache_salt(parsed.cache_salt.as_deref());
        let body = with_cache_salt(&body, &salt)?;
        if let Some(permit) = ctx.body_permit.as_mut() {
            if !permit.cover(body.len()) {
                return Err(self.over_body_budget());
            }
        }
        parsed.cache_salt = Some(salt);
        Ok(body)
    }

    /// The engine the decision ranked first, if any.
    fn first_ranked(&self, ctx: &Ctx) -> Option<std::sync::Arc<crate::fleet::Engine>> {
        let (cands, decision) = ctx.decision.as_ref()?;
        let first = cands.get(*decision.order.first()?)?;
        self.fleet.get(first.node)
    }

    /// With a deadline header: 400 for a value that is not milliseconds, 429 (counted as
    /// `deadline`) when the time already spent on the request plus the chosen engine's recent
    /// time to first token is over it. Engines with no recent answer are given the benefit of
    /// the doubt.
    pub(crate) fn check_deadline(
        &self,
        session: &Session,
        ctx: &Ctx,
    ) -> std::result::Result<(), ApiError> {
        let live = self.live();
        let name = live.cfg.admission.deadline_header.as_str();
        if name.is_empty() {
            return Ok(());
        }
        let Some(value) = session.req_header().headers.get(name) else {
            return Ok(());
        };
        let deadline = value
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(std::time::Duration::from_millis)
            .ok_or_else(|| {
                ApiError::new(
                    ErrorKind::InvalidRequest,
                    format!("the {name} header must be a whole number of milliseconds"),
                )
            })?;
        let estimate = self
            .first_ranked(ctx)
            .and_then(|e| e.ttft_estimate().map(|t| (e, t)));
        let spent = ctx.started.elapsed();
        match estimate {
            Some((engine, t)) if t.saturating_add(spent) > deadline => Err(self.refuse(
                "deadline",
                ApiError::new(
                    ErrorKind::Overloaded,
                    format!(
                        "the first token would likely come after the {} ms deadline ({} ms spent here; engine {} answers in about {} ms now); retry shortly",
                        deadline.as_millis(),
                        spent.as_millis(),
                        engine.name,
                        t.as_millis()
                    ),
                ),
            )),
            _ => Ok(()),
        }
    }

    /// The model's admission slot (waiting in its queue if need be), or the counted 429. It
    /// runs after the decision, so that only models the fleet serves get a gate; a request that
    /// waited is decided again (load has moved meanwhile).
    pub(crate) async fn enter_model(&self, ctx: &mut Ctx) -> std::result::Result<(), ApiError> {
        if ctx.plan.is_none() {
            return Ok(());
        }
        // A request going to a peer proxy takes a slot there, not here (two sidecars
        // forwarding to each other must not hold each other's slots while they wait).
        let to_peer = self.first_ranked(ctx).is_some_and(|e| e.via_peer());
        if to_peer {
            return Ok(());
        }
        if self.take_model_slot(ctx).await? {
            self.decide(ctx)?;
        }
        Ok(())
    }

    /// Takes the model's admission slot for `ctx` (none when the model has no cap), waiting in
    /// its queue if need be: `Ok(true)` when it waited. The refusal is counted.
    pub(crate) async fn take_model_slot(
        &self,
        ctx: &mut Ctx,
    ) -> std::result::Result<bool, ApiError> {
        let Some(model) = ctx.plan.as_ref().map(|p| p.facts.model.clone()) else {
            return Ok(false);
        };
        match self.model_gates.enter(&model).await {
            Ok(entered) => {
                ctx.model_slot = entered.slot;
                Ok(entered.waited)
            }
            Err(r) => Err(self.refuse(r.label(), r.error(&model))),
        }
    }
}

/// Copies a JSON object's top-level members into `out` as it reads them (names decoded,
/// escapes and all; values as the raw text they were sent as, never materialised), leaving out
/// those named `cache_salt`; each member is followed by a comma. Nothing but the output grows
/// with the body.
struct CopyMembers<'o>(&'o mut Vec<u8>);

impl<'de> serde::de::DeserializeSeed<'de> for CopyMembers<'_> {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> serde::de::Visitor<'de> for CopyMembers<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(
        self,
        mut map: A,
    ) -> std::result::Result<(), A::Error> {
        use serde::de::Error as _;
        while let Some(name) = map.next_key::<String>()? {
            let value: &'de serde_json::value::RawValue = map.next_value()?;
            if name == "cache_salt" {
                continue;
            }
            // A name is re-encoded from its decoded form: the same text for what clients send.
            let quoted = serde_json::to_string(&name).map_err(A::Error::custom)?;
            self.0.extend_from_slice(quoted.as_bytes());
            self.0.push(b':');
            self.0.extend_from_slice(value.get().as_bytes());
            self.0.push(b',');
        }
        Ok(())
    }
}

/// `body` (a JSON object) with one `cache_salt` member, `salt`: every member whose name decodes
/// to `cache_salt` (however it is escaped, e.g. `cache\u005fsalt`, and whatever its value) is
/// dropped, the others are kept byte for byte in their order, and `salt` is added last. Engines
/// read duplicate names differently (first, last, or refused), so none is left.
pub fn with_cache_salt(body: &[u8], salt: &str) -> std::result::Result<Bytes, ApiError> {
    use serde::de::DeserializeSeed as _;
    let not_an_object = |e: serde_json::Error| {
        ApiError::new(
            ErrorKind::InvalidRequest,
            format!("request body is not a JSON object: {e}"),
        )
    };
    let mut out = Vec::with_capacity(body.len() + salt.len() + 16);
    out.push(b'{');
    let mut de = serde_json::Deserializer::from_slice(body);
    CopyMembers(&mut out)
        .deserialize(&mut de)
        .map_err(not_an_object)?;
    de.end().map_err(not_an_object)?;
    out.extend_from_slice(b"\"cache_salt\":");
    let quoted = serde_json::to_string(salt)
        .map_err(|e| ApiError::new(ErrorKind::Internal, format!("re-encoding the body: {e}")))?;
    out.extend_from_slice(quoted.as_bytes());
    out.push(b'}');
    Ok(Bytes::from(out))
}

#[cfg(test)]
mod tests {
    use super::with_cache_salt;

    fn parsed(body: &[u8]) -> serde_json::Value {
        serde_json::from_slice(body).unwrap()
    }

    #[test]
    fn exactly_one_salt_reaches_the_engine() {
        let b = with_cache_salt(br#" {"model":"m","prompt":"x"} "#, "tenant/a").unwrap();
        assert_eq!(
            std::str::from_utf8(&b).unwrap(),
            r#"{"model":"m","prompt":"x","cache_salt":"tenant/a"}"#
        );
        // The client's own member, however spelt, and whatever its value, is replaced.
        for body in [
            &br#"{"model":"m","cache_salt":"mine"}"#[..],
            br#"{"model":"m","cache_salt":null}"#,
            br#"{"model":"m","cache\u005fsalt":"tenant/acme"}"#,
            br#"{"cache\u005fsalt":1,"model":"m","cache_salt":"x","\u0063ache_salt":[]}"#,
        ] {
            let b = with_cache_salt(body, "tenant/b/\"q\"").unwrap();
            let text = std::str::from_utf8(&b).unwrap();
            assert_eq!(parsed(&b)["cache_salt"], "tenant/b/\"q\"", "{text}");
            assert_eq!(text.matches("salt").count(), 1, "{text}");
            assert!(!text.contains("\\u"), "{text}");
        }
        // Everything else is kept as sent: numbers past f64, escapes in values, order.
        let body = br#"{"seed":18446744073709551615,"big":123456789012345678901234567890,"prompt":"caf\u00e9 \"cache_salt\"","model":"m"}"#;
        let b = with_cache_salt(body, "t").unwrap();
        assert_eq!(
            std::str::from_utf8(&b).unwrap(),
            r#"{"seed":18446744073709551615,"big":123456789012345678901234567890,"prompt":"caf\u00e9 \"cache_salt\"","model":"m","cache_salt":"t"}"#
        );
        assert!(with_cache_salt(b"[1]", "t").is_err());
        assert!(with_cache_salt(b"{\"a\":", "t").is_err());
    }
}
