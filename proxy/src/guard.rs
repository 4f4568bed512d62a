//! The request path's access checks, in the order the gateway runs them: the API key and its
//! in-flight limit (before the body is read), then, once the body is parsed, the key's model
//! allow-list and its tenant's cache salt (written into the body the engine gets), and after
//! the decision the model's admission gate ([`crate::admission`]).

use bytes::Bytes;
use kvmesh_filters::error::{ApiError, ErrorKind};
use kvmesh_filters::request::ParsedRequest;
use pingora::proxy::Session;

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
    /// `parsed` (the digest chain's namespace) and in the body the engine gets.
    pub(crate) fn apply_tenant(
        &self,
        ctx: &Ctx,
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
        parsed.cache_salt = Some(salt);
        Ok(body)
    }

    /// The model's admission slot (waiting in its queue if need be), or the counted 429. It
    /// runs after the decision, so that only models the fleet serves get a gate; a request that
    /// waited is decided again (load has moved meanwhile).
    pub(crate) async fn enter_model(&self, ctx: &mut Ctx) -> std::result::Result<(), ApiError> {
        let Some(model) = ctx.plan.as_ref().map(|p| p.facts.model.clone()) else {
            return Ok(());
        };
        match self.model_gates.enter(&model).await {
            Ok(entered) => {
                ctx.model_slot = entered.slot;
                if entered.waited {
                    self.decide(ctx)?;
                }
                Ok(())
            }
            Err(r) => Err(self.refuse(r.label(), r.error(&model))),
        }
    }
}

/// `body` (a JSON object) with its `cache_salt` member set to `salt`. A body without one gets
/// it spliced in after the opening brace; otherwise the document is rewritten (a second
/// member would be a duplicate key, which engines read differently).
pub fn with_cache_salt(body: &[u8], salt: &str) -> std::result::Result<Bytes, ApiError> {
    let quoted = serde_json::to_string(salt).unwrap_or_else(|_| "\"\"".into());
    let open = body.iter().position(|&b| b == b'{');
    let mentions = memchr_str(body, b"\"cache_salt\"");
    match open {
        Some(i) if !mentions => {
            let mut out = Vec::with_capacity(body.len() + quoted.len() + 16);
            out.extend_from_slice(&body[..=i]);
            out.extend_from_slice(b"\"cache_salt\":");
            out.extend_from_slice(quoted.as_bytes());
            // `{}` cannot reach here (a parsed request has a model), but stay valid anyway.
            let rest = &body[i + 1..];
            if rest.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'}') {
                out.push(b',');
            }
            out.extend_from_slice(rest);
            Ok(Bytes::from(out))
        }
        _ => {
            let mut doc: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(body)
                .map_err(|e| {
                    ApiError::new(
                        ErrorKind::InvalidRequest,
                        format!("request body is not a JSON object: {e}"),
                    )
                })?;
            doc.insert("cache_salt".into(), serde_json::Value::String(salt.into()));
            serde_json::to_vec(&doc).map(Bytes::from).map_err(|e| {
                ApiError::new(ErrorKind::Internal, format!("re-encoding the body: {e}"))
            })
        }
    }
}

fn memchr_str(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::with_cache_salt;

    fn salt_of(body: &[u8]) -> serde_json::Value {
        let v: serde_json::Value = serde_json::from_slice(body).unwrap();
        v["cache_salt"].clone()
    }

    #[test]
    fn the_salt_is_set_once() {
        let b = with_cache_salt(br#" {"model":"m","prompt":"x"}"#, "tenant/a").unwrap();
        assert_eq!(salt_of(&b), "tenant/a");
        assert_eq!(
            std::str::from_utf8(&b).unwrap(),
            r#" {"cache_salt":"tenant/a","model":"m","prompt":"x"}"#
        );
        // Present (even as null, or with escapes in the key's neighbourhood): rewritten, one key.
        for body in [
            &br#"{"model":"m","cache_salt":"mine"}"#[..],
            br#"{"model":"m","cache_salt":null}"#,
        ] {
            let b = with_cache_salt(body, "tenant/a/\"q\"").unwrap();
            assert_eq!(salt_of(&b), "tenant/a/\"q\"");
            assert_eq!(
                std::str::from_utf8(&b)
                    .unwrap()
                    .matches("cache_salt")
                    .count(),
                1
            );
        }
        // A string value that mentions the key stays as it was.
        let b = with_cache_salt(br#"{"model":"m","prompt":"\"cache_salt\""}"#, "t").unwrap();
        assert_eq!(salt_of(&b), "t");
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["prompt"], "\"cache_salt\"");
    }
}
