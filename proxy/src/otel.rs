//! OpenTelemetry traces (`[otel]`, off by default), exported over OTLP/gRPC.
//!
//! Each API request gets a `kvmesh.request` span (kind server), a child of the caller's W3C
//! `traceparent` when it sends one. Under it: a `kvmesh.route` span per routing decision (its
//! reason, the chosen engine and its cached-prefix overlap) and a `kvmesh.upstream` span (kind
//! client) per attempt, from the moment the engine is chosen to the end of its answer, with the
//! time to first byte. The attempt's context goes to the engine or peer proxy in `traceparent`,
//! so a peer's `kvmesh.request` is a child of this proxy's `kvmesh.upstream`: one trace across a
//! sidecar hop. Operators' endpoints (`/metrics`, `/health`, the dashboard) are not traced.
//!
//! Spans leave in batches from a bounded queue on the SDK's own thread; the gRPC client runs on a
//! small runtime of its own, so that export never competes with the request path's threads.
//! `kvmesh_otel_spans_total{outcome}` counts spans `ended`, `exported` and `failed` (an export
//! the collector refused or that timed out); the difference is the queue, or spans dropped
//! because it was full.

use std::borrow::Cow;
use std::time::{Duration, SystemTime};

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{
    Link, Span as _, SpanKind, Status, TraceContextExt, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{WithExportConfig, WithTonicConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracer, SdkTracerProvider, SpanData,
    SpanExporter, SpanProcessor,
};
use opentelemetry_sdk::Resource;
use prometheus::{IntCounter, IntCounterVec};

use crate::config::OtelConfig;

/// Errors starting the exporter.
#[derive(Debug, thiserror::Error)]
pub enum OtelError {
    /// The exporter's runtime could not start.
    #[error("cannot start the OTLP exporter's runtime: {0}")]
    Runtime(std::io::Error),
    /// `otel.endpoint` is not a URI tonic can dial.
    #[error("`otel.endpoint` = {endpoint:?}: {source}")]
    Endpoint {
        /// The endpoint.
        endpoint: String,
        /// Why.
        source: tonic::transport::Error,
    },
    /// The OTLP exporter could not be built.
    #[error("the OTLP exporter: {0}")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
}

/// Most bytes of a client-supplied string recorded in a span (paths, model names, messages
/// quoting them): a span's cost stays bounded whatever a client sends.
pub const MAX_ATTRIBUTE_BYTES: usize = 256;

/// Longest wait for the last export at shutdown.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(5);

/// The tracer and its export pipeline. Dropping it flushes what is queued (bounded by
/// `otel.export_timeout_ms`).
pub struct Otel {
    tracer: SdkTracer,
    provider: SdkTracerProvider,
    /// Whether a caller's `traceparent` is followed (`otel.trust_client_context`).
    trust_clients: bool,
    /// Set once shut down.
    down: std::sync::atomic::AtomicBool,
    /// Runs the gRPC client's connection; stopped last.
    runtime: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for Otel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Otel").finish_non_exhaustive()
    }
}

impl Otel {
    /// The pipeline `cfg` asks for, counting spans in `spans` (labels `ended`, `exported`,
    /// `failed`); `None` when `otel.endpoint` is empty.
    pub fn start(cfg: &OtelConfig, spans: &IntCounterVec) -> Result<Option<Otel>, OtelError> {
        if !cfg.enabled() {
            return Ok(None);
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvmesh-otlp")
            .enable_all()
            .build()
            .map_err(OtelError::Runtime)?;
        let timeout = Duration::from_millis(cfg.export_timeout_ms);
        // Connecting is bounded too (a collector that black-holes SYNs must not hold the
        // export thread past the timeout). The channel spawns its connection task on the
        // runtime it is built in: entered, not blocked on (the picker calls this from inside
        // its own runtime).
        let endpoint = tonic::transport::Endpoint::from_shared(cfg.endpoint.clone())
            .map_err(|source| OtelError::Endpoint {
                endpoint: cfg.endpoint.clone(),
                source,
            })?
            .connect_timeout(timeout)
            .timeout(timeout);
        let exporter = {
            let _in = runtime.enter();
            opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_channel(endpoint.connect_lazy())
                .with_timeout(timeout)
                .build()?
        };
        let exporter = Counted {
            inner: exporter,
            exported: spans.with_label_values(&["exported"]),
            failed: spans.with_label_values(&["failed"]),
        };
        let batch = BatchConfigBuilder::default()
            .with_max_queue_size(cfg.max_queue_spans)
            .with_max_export_batch_size(cfg.max_queue_spans.min(512))
            .with_scheduled_delay(Duration::from_millis(cfg.export_interval_ms))
            .build();
        let processor = CountEnded {
            inner: BatchSpanProcessor::builder(exporter)
                .with_batch_config(batch)
                .build(),
            ended: spans.with_label_values(&["ended"]),
        };
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                cfg.sample_ratio,
            ))))
            .with_resource(
                Resource::builder_empty()
                    .with_service_name(cfg.service_name.clone())
                    .with_attribute(KeyValue::new("service.version", crate::VERSION))
                    .build(),
            )
            .build();
        let tracer = provider.tracer("kvmesh-proxy");
        Ok(Some(Otel {
            tracer,
            provider,
            trust_clients: cfg.trust_client_context,
            down: std::sync::atomic::AtomicBool::new(false),
            runtime: Some(runtime),
        }))
    }

    /// Starts the trace of one API request from its `traceparent` and `tracestate`. The
    /// request span is a child of that context when it comes from a peer proxy (`peer`: a
    /// trusted hop) or `otel.trust_client_context` is on; otherwise it starts a new trace
    /// (sampled by `otel.sample_ratio`) and only links to the caller's span, so that a client
    /// can neither force sampling nor write into another trace.
    pub fn request(
        &self,
        traceparent: Option<&str>,
        tracestate: Option<&str>,
        peer: bool,
        attributes: Vec<KeyValue>,
    ) -> RequestTrace {
        let caller = TraceContextPropagator::new().extract(&Incoming {
            traceparent,
            tracestate,
        });
        let builder = self
            .tracer
            .span_builder("kvmesh.request")
            .with_kind(SpanKind::Server)
            .with_attributes(attributes);
        let remote = caller.span().span_context().clone();
        let (parent, builder) = if peer || self.trust_clients || !remote.is_valid() {
            (caller, builder)
        } else {
            (
                Context::new(),
                builder.with_links(vec![Link::with_context(remote)]),
            )
        };
        let span = builder.start_with_context(&self.tracer, &parent);
        RequestTrace {
            tracer: self.tracer.clone(),
            request: parent.with_span(span),
            attempt: None,
            attempt_failed: false,
        }
    }

    /// Exports what is queued and stops the pipeline, waiting at most 5 s (blocking: call it
    /// once requests have drained). Spans ended afterwards are not exported.
    pub fn shutdown(&self) {
        if self.down.swap(true, std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        if let Err(e) = self.provider.shutdown_with_timeout(SHUTDOWN_WAIT) {
            tracing::warn!(error = %e, "OTLP exporter shut down with spans unexported");
        }
    }
}

impl Drop for Otel {
    fn drop(&mut self) {
        self.shutdown();
        // Not a blocking drop: this may run inside another runtime.
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// The spans of one request, carried in its context from the first hook to `logging`.
pub struct RequestTrace {
    tracer: SdkTracer,
    /// Holds the `kvmesh.request` span.
    request: Context,
    /// The current attempt's `kvmesh.upstream` span, until it ends.
    attempt: Option<Context>,
    /// The current attempt's failure is recorded already (its first cause is kept).
    attempt_failed: bool,
}

impl RequestTrace {
    /// Records a routing decision that began at `started` and ends now.
    pub fn route(&self, started: SystemTime, attributes: Vec<KeyValue>, error: Option<&str>) {
        let mut span = self
            .tracer
            .span_builder("kvmesh.route")
            .with_kind(SpanKind::Internal)
            .with_start_time(started)
            .with_attributes(attributes)
            .start_with_context(&self.tracer, &self.request);
        if let Some(e) = error {
            span.set_status(Status::error(
                crate::access::prefix(e, MAX_ATTRIBUTE_BYTES).to_string(),
            ));
        }
        span.end();
    }

    /// Starts the span of a new attempt; one still open (an attempt that failed before its
    /// answer) ends first, as failed.
    pub fn attempt(&mut self, attributes: Vec<KeyValue>) {
        self.attempt_failed("failed before answering");
        self.end_attempt();
        let span = self
            .tracer
            .span_builder("kvmesh.upstream")
            .with_kind(SpanKind::Client)
            .with_attributes(attributes)
            .start_with_context(&self.tracer, &self.request);
        self.attempt = Some(self.request.with_span(span));
        self.attempt_failed = false;
    }

    /// Marks the current attempt failed (`why`; its first cause is kept), leaving it open until
    /// the next attempt or the end of the request.
    pub fn attempt_failed(&mut self, why: &str) {
        if let (Some(a), false) = (self.attempt.as_ref(), self.attempt_failed) {
            a.span().set_status(Status::error(why.to_string()));
            self.attempt_failed = true;
        }
    }

    /// Records `name` with `attributes` on the current attempt (the request, if none).
    pub fn event(&self, name: &'static str, attributes: Vec<KeyValue>) {
        let cx = self.attempt.as_ref().unwrap_or(&self.request);
        cx.span().add_event(name, attributes.clone());
        if !attributes.is_empty() {
            cx.span().set_attributes(attributes);
        }
    }

    /// The `traceparent` and `tracestate` headers an upstream request carries: the current
    /// attempt's context. An empty value means the header is to be removed (a caller's
    /// `tracestate` must not travel with a context that is not its own).
    pub fn headers(&self) -> Vec<(&'static str, String)> {
        let mut out = Injected(Vec::new());
        let cx = self.attempt.as_ref().unwrap_or(&self.request);
        TraceContextPropagator::new().inject_context(cx, &mut out);
        [TRACEPARENT, TRACESTATE]
            .into_iter()
            .map(|name| {
                let value = out
                    .0
                    .iter()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v.clone());
                (name, value.unwrap_or_default())
            })
            .collect()
    }

    fn end_attempt(&mut self) {
        if let Some(a) = self.attempt.take() {
            a.span().end();
        }
    }

    /// Ends the request (and its open attempt) with `attributes`. A failed request's span
    /// carries `failure`'s message; so does the open attempt's when the engine's side failed
    /// (not when only the client went away).
    pub fn finish(mut self, attributes: Vec<KeyValue>, failure: Option<Failure>) {
        if let Some(f) = failure.as_ref().filter(|f| f.upstream) {
            self.attempt_failed(&f.message);
        }
        self.end_attempt();
        let span = self.request.span();
        span.set_attributes(attributes);
        if let Some(f) = failure {
            span.set_status(Status::error(f.message));
        }
        span.end();
    }
}

/// Why a traced request failed.
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    /// What the span says (cut to [`MAX_ATTRIBUTE_BYTES`]).
    pub message: String,
    /// The engine's (or peer's) side failed: its attempt is marked too.
    pub upstream: bool,
}

impl Failure {
    /// The failure of a request answered `status`: `refusal` is the proxy's own error message
    /// if it refused; `cut` says the engine's answer broke off after its first byte. `None`
    /// for a success or a client's error (4xx but 499).
    pub fn of(status: u16, refusal: Option<&str>, cut: bool) -> Option<Failure> {
        let (message, upstream) = match (cut, refusal, status) {
            (true, _, _) => ("the engine's answer broke off".to_string(), true),
            (false, _, 499) => ("the client went away".to_string(), false),
            (false, Some(m), s) if s >= 500 => (m.to_string(), true),
            (false, None, s) if s >= 500 => (format!("status {s}"), true),
            _ => return None,
        };
        Some(Failure {
            message: crate::access::prefix(&message, MAX_ATTRIBUTE_BYTES).to_string(),
            upstream,
        })
    }
}

/// The W3C headers of an incoming request, for the propagator.
struct Incoming<'a> {
    traceparent: Option<&'a str>,
    tracestate: Option<&'a str>,
}

impl Extractor for Incoming<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        match key {
            TRACEPARENT => self.traceparent,
            TRACESTATE => self.tracestate,
            _ => None,
        }
    }

    fn keys(&self) -> Vec<&str> {
        vec![TRACEPARENT, TRACESTATE]
    }
}

/// The W3C trace context headers.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C vendor trace state header.
pub const TRACESTATE: &str = "tracestate";

/// Headers to set on an upstream request.
struct Injected(Vec<(String, String)>);

impl Injector for Injected {
    fn set(&mut self, key: &str, value: String) {
        self.0.push((key.to_string(), value));
    }
}

/// Counts spans exported and failed.
#[derive(Debug)]
struct Counted {
    inner: opentelemetry_otlp::SpanExporter,
    exported: IntCounter,
    failed: IntCounter,
}

impl SpanExporter for Counted {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let n = batch.len() as u64;
        let r = self.inner.export(batch).await;
        match &r {
            Ok(()) => self.exported.inc_by(n),
            Err(e) => {
                // One line per failed batch (at most one per `otel.export_interval_ms`).
                tracing::warn!(error = %e, spans = n, "OTLP export failed");
                self.failed.inc_by(n);
            }
        }
        r
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// Counts spans ended (those that reach the queue, or find it full).
#[derive(Debug)]
struct CountEnded {
    inner: BatchSpanProcessor,
    ended: IntCounter,
}

impl SpanProcessor for CountEnded {
    fn on_start(&self, span: &mut opentelemetry_sdk::trace::Span, cx: &Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        self.ended.inc();
        self.inner.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// A request span's closing attributes: what its access-log line says (`hop`: forwarded by a
/// peer proxy).
pub fn span_attributes(line: &crate::access::Line<'_>, hop: bool) -> Vec<KeyValue> {
    let mut a = vec![
        KeyValue::new("http.response.status_code", i64::from(line.status)),
        KeyValue::new("kvmesh.hop", hop),
        KeyValue::new("kvmesh.bytes_in", line.bytes_in as i64),
        KeyValue::new(
            "kvmesh.bytes_out",
            i64::try_from(line.bytes_out).unwrap_or(i64::MAX),
        ),
    ];
    for (key, value) in [
        ("gen_ai.request.model", line.model),
        ("kvmesh.engine", line.engine),
        ("kvmesh.route.reason", line.reason),
    ] {
        if !value.is_empty() {
            a.push(client_attr(key, value));
        }
    }
    if let Some(t) = line.ttft {
        a.push(KeyValue::new("kvmesh.ttft_ms", millis(t)));
    }
    if let Some(n) = line.cached_tokens {
        a.push(KeyValue::new(
            "kvmesh.cached_tokens",
            i64::try_from(n).unwrap_or(i64::MAX),
        ));
    }
    if let Some(n) = line.completion_tokens {
        a.push(KeyValue::new(
            "gen_ai.usage.output_tokens",
            i64::try_from(n).unwrap_or(i64::MAX),
        ));
    }
    a
}

/// `d` in fractional milliseconds.
pub fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// An attribute from a string that may be borrowed.
pub fn attr(key: &'static str, value: impl Into<Cow<'static, str>>) -> KeyValue {
    KeyValue::new(key, value.into())
}

/// An attribute from a client-supplied string, cut to [`MAX_ATTRIBUTE_BYTES`].
pub fn client_attr(key: &'static str, value: &str) -> KeyValue {
    KeyValue::new(
        key,
        crate::access::prefix(value, MAX_ATTRIBUTE_BYTES).to_string(),
    )
}
