//! The `[otel]` table: OpenTelemetry traces exported over OTLP/gRPC (off by default).

use serde::{Deserialize, Serialize};

/// Most spans `otel.max_queue_spans` may hold.
pub const MAX_QUEUE_SPANS: usize = 1 << 16;

/// The `[otel]` table. With `endpoint` set, every API request is traced: a `kvmesh.request`
/// span (a child of the client's W3C `traceparent`, when it sends one), a `kvmesh.route` span
/// for the decision and a `kvmesh.upstream` span per attempt, whose context travels to the
/// engine or peer proxy in `traceparent` (docs/observability.md).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct OtelConfig {
    /// The OTLP/gRPC collector, `http://host:port` (an OpenTelemetry Collector listens on
    /// 4317); empty (the default): no tracing, and a client's `traceparent` passes through
    /// untouched. TLS towards the collector is not supported yet: run a collector beside the
    /// proxy. Env: `KVMESH_OTEL__ENDPOINT`.
    pub endpoint: String,
    /// `service.name` of the spans' resource.
    pub service_name: String,
    /// Share of new traces recorded, 0.0 to 1.0 (by trace id).
    pub sample_ratio: f64,
    /// Whether a client's `traceparent` makes the request span its child (and its sampled flag
    /// is followed). Off (the default): a client's context only becomes a span link, and the
    /// trace is new, so that clients can neither force sampling nor write into other traces.
    /// A peer proxy's context (a trusted hop, docs/sidecar.md) is always followed.
    pub trust_client_context: bool,
    /// Most milliseconds between a span's end and its export (spans leave in batches).
    pub export_interval_ms: u64,
    /// Most milliseconds one export may take before it counts as failed.
    pub export_timeout_ms: u64,
    /// Most ended spans waiting for export; past it new spans are dropped (counted: see
    /// `kvmesh_otel_spans_total`). At most [`MAX_QUEUE_SPANS`].
    pub max_queue_spans: usize,
}

impl Default for OtelConfig {
    fn default() -> Self {
        OtelConfig {
            endpoint: String::new(),
            service_name: "kvmesh-proxy".into(),
            sample_ratio: 1.0,
            trust_client_context: false,
            export_interval_ms: 1000,
            export_timeout_ms: 10_000,
            max_queue_spans: 4096,
        }
    }
}

impl OtelConfig {
    /// Whether traces are exported.
    pub fn enabled(&self) -> bool {
        !self.endpoint.is_empty()
    }

    /// What is wrong with the table, each naming its key.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.enabled() {
            match self.endpoint.parse::<http::Uri>() {
                Ok(uri) if uri.scheme_str() == Some("http") && uri.host().is_some() => {
                    let says = |what: &str| {
                        format!(
                            "`otel.endpoint` = {:?}: {what} (http://host:port)",
                            self.endpoint
                        )
                    };
                    if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
                        p.push(says("OTLP/gRPC takes no path or query"));
                    }
                    if uri.authority().is_some_and(|a| a.as_str().contains('@')) {
                        p.push(says("no user or password in the URL"));
                    }
                    if uri.port_u16().is_none_or(|port| port == 0) {
                        p.push(says("name the port (a collector listens on 4317)"));
                    }
                }
                Ok(uri) if uri.scheme_str() == Some("https") => p.push(format!(
                    "`otel.endpoint` = {:?}: TLS towards the collector is not supported yet; \
                     run a collector beside the proxy and give its http:// address",
                    self.endpoint
                )),
                _ => p.push(format!(
                    "`otel.endpoint` = {:?} is not an http://host:port address",
                    self.endpoint
                )),
            }
        }
        if self.service_name.trim().is_empty() {
            p.push("`otel.service_name` is empty".into());
        }
        if !(0.0..=1.0).contains(&self.sample_ratio) {
            p.push(format!(
                "`otel.sample_ratio` ({}) must be between 0.0 and 1.0",
                self.sample_ratio
            ));
        }
        for (key, v) in [
            ("otel.export_interval_ms", self.export_interval_ms),
            ("otel.export_timeout_ms", self.export_timeout_ms),
        ] {
            if !(1..=600_000).contains(&v) {
                p.push(format!("`{key}` ({v}) must be between 1 and 600000"));
            }
        }
        if !(1..=MAX_QUEUE_SPANS).contains(&self.max_queue_spans) {
            p.push(format!(
                "`otel.max_queue_spans` ({}) must be between 1 and {MAX_QUEUE_SPANS}",
                self.max_queue_spans
            ));
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_endpoint(e: &str) -> OtelConfig {
        OtelConfig {
            endpoint: e.into(),
            ..OtelConfig::default()
        }
    }

    #[test]
    fn off_by_default_and_valid() {
        assert!(!OtelConfig::default().enabled());
        assert!(OtelConfig::default().problems().is_empty());
        assert!(with_endpoint("http://127.0.0.1:4317").problems().is_empty());
        assert!(with_endpoint("http://collector:4317/")
            .problems()
            .is_empty());
    }

    #[test]
    fn bad_values_are_named() {
        for (e, says) in [
            ("https://collector:4317", "not supported yet"),
            ("collector:4317", "not an http://host:port"),
            ("http://collector:4317/v1/traces", "takes no path"),
            ("http://collector:4317/?x=1", "takes no path"),
            ("http://collector", "name the port"),
            ("http://collector:0", "name the port"),
            ("http://user:secret@collector:4317", "no user or password"),
            ("ftp://x", "not an http://host:port"),
        ] {
            let p = with_endpoint(e).problems();
            assert!(p.len() == 1 && p[0].contains(says), "{e}: {p:?}");
        }
        let c = OtelConfig {
            sample_ratio: 1.5,
            export_interval_ms: 0,
            max_queue_spans: 0,
            service_name: " ".into(),
            ..OtelConfig::default()
        };
        let p = c.problems().join("\n");
        for key in [
            "otel.sample_ratio",
            "otel.export_interval_ms",
            "otel.max_queue_spans",
            "otel.service_name",
        ] {
            assert!(p.contains(key), "{key} in {p}");
        }
    }
}
