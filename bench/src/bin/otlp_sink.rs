//! `kvmesh-otlp-sink`: a test instrument, not part of the product. An OTLP/gRPC trace receiver
//! (`opentelemetry.proto.collector.trace.v1.TraceService`, the service an OpenTelemetry
//! Collector serves on 4317), its stubs generated from the official protos by the
//! `opentelemetry-proto` crate. Every span it receives becomes one JSON line on stdout, flat
//! enough for a test to assert on: ids in hex, attributes as an object.

use std::io::Write;
use std::net::SocketAddr;

use clap::Parser;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue};
use serde_json::{json, Map, Value};

/// Command line.
#[derive(Parser, Debug)]
#[command(about = "OTLP/gRPC trace receiver printing each span as a JSON line (test instrument)")]
struct Args {
    /// Address to serve OTLP/gRPC on (port 0: any free one). The address bound is the first
    /// line on stderr: `kvmesh-otlp-sink listening on http://ADDR`.
    #[arg(long, default_value = "127.0.0.1:4317")]
    listen: SocketAddr,
    /// Refuse every export with UNAVAILABLE (to test an exporter's failure path).
    #[arg(long)]
    refuse: bool,
}

struct Sink {
    refuse: bool,
}

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        if self.refuse {
            return Err(tonic::Status::unavailable("kvmesh-otlp-sink --refuse"));
        }
        let mut out = std::io::stdout().lock();
        for rs in request.into_inner().resource_spans {
            let resource = rs
                .resource
                .map(|r| attributes(&r.attributes))
                .unwrap_or_default();
            let service = resource.get("service.name").cloned().unwrap_or(Value::Null);
            for ss in rs.scope_spans {
                for s in ss.spans {
                    let status = s.status.unwrap_or_default();
                    let events: Vec<Value> = s
                        .events
                        .iter()
                        .map(|e| json!({"name": e.name, "attributes": attributes(&e.attributes)}))
                        .collect();
                    let links: Vec<Value> = s
                        .links
                        .iter()
                        .map(|l| json!({"trace_id": hex::encode(&l.trace_id), "span_id": hex::encode(&l.span_id)}))
                        .collect();
                    let line = json!({
                        "service": service,
                        "resource": resource,
                        "trace_id": hex::encode(&s.trace_id),
                        "span_id": hex::encode(&s.span_id),
                        "parent_span_id": hex::encode(&s.parent_span_id),
                        "name": s.name,
                        "kind": kind(s.kind),
                        "start_unix_nano": s.start_time_unix_nano,
                        "end_unix_nano": s.end_time_unix_nano,
                        "attributes": attributes(&s.attributes),
                        "events": events,
                        "links": links,
                        "status": {"code": status.code, "message": status.message},
                    });
                    writeln!(out, "{line}")
                        .map_err(|e| tonic::Status::internal(format!("stdout: {e}")))?;
                }
            }
        }
        out.flush()
            .map_err(|e| tonic::Status::internal(format!("stdout: {e}")))?;
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

fn kind(k: i32) -> &'static str {
    match k {
        1 => "internal",
        2 => "server",
        3 => "client",
        4 => "producer",
        5 => "consumer",
        _ => "unspecified",
    }
}

fn attributes(kvs: &[KeyValue]) -> Map<String, Value> {
    kvs.iter()
        .map(|kv| (kv.key.clone(), value(kv.value.as_ref())))
        .collect()
}

fn value(v: Option<&AnyValue>) -> Value {
    match v.and_then(|v| v.value.as_ref()) {
        Some(Any::StringValue(s)) => json!(s),
        Some(Any::BoolValue(b)) => json!(b),
        Some(Any::IntValue(i)) => json!(i),
        Some(Any::DoubleValue(d)) => json!(d),
        Some(Any::ArrayValue(a)) => a.values.iter().map(|v| value(Some(v))).collect(),
        Some(Any::KvlistValue(l)) => Value::Object(attributes(&l.values)),
        Some(Any::BytesValue(b)) => json!(hex::encode(b)),
        Some(Any::StringValueStrindex(i)) => json!({ "strindex": i }),
        None => Value::Null,
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    eprintln!(
        "kvmesh-otlp-sink listening on http://{}",
        listener.local_addr()?
    );
    tonic::transport::Server::builder()
        .add_service(TraceServiceServer::new(Sink {
            refuse: args.refuse,
        }))
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
        .await?;
    Ok(())
}
