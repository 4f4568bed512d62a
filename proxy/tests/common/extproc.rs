//! Speaking ext_proc to a picker directly, as Envoy would (requests the tests cannot make Envoy
//! send).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Msg;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Reply;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
};

/// The destination the picker names for a chat request with `doc` as its body.
pub fn pick_chat(port: u16, doc: &[u8]) -> String {
    rt().block_on(pick(port, doc))
}

/// [`pick_chat`], from inside a runtime.
pub async fn pick(port: u16, doc: &[u8]) -> String {
    let replies = exchange(port, vec![chat_headers(), body(doc, true)])
        .await
        .unwrap();
    destination(&replies[0])
}

pub fn headers(pairs: &[(&str, &str)], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Msg::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: pairs
                    .iter()
                    .map(|(k, v)| HeaderValue {
                        key: k.to_string(),
                        raw_value: v.as_bytes().to_vec(),
                        ..Default::default()
                    })
                    .collect(),
            }),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

pub fn chat_headers() -> ProcessingRequest {
    headers(
        &[(":method", "POST"), (":path", "/v1/chat/completions")],
        false,
    )
}

pub fn body(b: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Msg::RequestBody(HttpBody {
            body: b.to_vec(),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// Sends `msgs` on one stream and collects every reply until the picker ends it (or a
/// gRPC error, returned as `Err`).
pub async fn exchange(
    port: u16,
    msgs: Vec<ProcessingRequest>,
) -> Result<Vec<ProcessingResponse>, tonic::Status> {
    let mut client = ExternalProcessorClient::connect(format!("http://127.0.0.1:{port}"))
        .await
        .unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    for m in msgs {
        tx.send(m).await.unwrap();
    }
    let mut replies = Vec::new();
    let mut stream = client
        .process(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await?
        .into_inner();
    loop {
        // The picker keeps the stream open for the response side: stop once the request
        // side is answered (or it closes).
        match tokio::time::timeout(Duration::from_secs(5), stream.message()).await {
            Ok(Ok(Some(r))) => {
                let last = matches!(
                    r.response,
                    Some(Reply::ImmediateResponse(_)) | Some(Reply::RequestBody(_))
                );
                replies.push(r);
                if last {
                    break;
                }
            }
            Ok(Ok(None)) => break,
            Ok(Err(status)) => return Err(status),
            Err(_) => panic!("no reply within 5 s; got {replies:?}"),
        }
    }
    drop(tx);
    Ok(replies)
}

pub fn destination(r: &ProcessingResponse) -> String {
    let Some(Reply::RequestHeaders(h)) = r.response.as_ref() else {
        panic!("not a headers reply: {r:?}")
    };
    let set = &h
        .response
        .as_ref()
        .unwrap()
        .header_mutation
        .as_ref()
        .unwrap()
        .set_headers;
    let dest = set
        .iter()
        .find(|o| o.header.as_ref().unwrap().key == "x-gateway-destination-endpoint")
        .unwrap();
    String::from_utf8(dest.header.as_ref().unwrap().raw_value.clone()).unwrap()
}

/// The `envoy.lb / x-gateway-destination-endpoint` metadata of a headers reply, split.
pub fn metadata_endpoints(r: &ProcessingResponse) -> Vec<String> {
    use envoy_types::pb::google::protobuf::value::Kind;
    let md = r.dynamic_metadata.as_ref().expect("dynamic metadata");
    let Some(Kind::StructValue(lb)) = md.fields["envoy.lb"].kind.as_ref() else {
        panic!("no envoy.lb struct: {md:?}")
    };
    let Some(Kind::StringValue(list)) = lb.fields["x-gateway-destination-endpoint"].kind.as_ref()
    else {
        panic!("no destination in envoy.lb: {lb:?}")
    };
    list.split(',').map(String::from).collect()
}

pub fn immediate_status(r: &ProcessingResponse) -> i32 {
    let Some(Reply::ImmediateResponse(i)) = r.response.as_ref() else {
        panic!("not an immediate response: {r:?}")
    };
    i.status.as_ref().unwrap().code
}

pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// One ext_proc stream held open, for exchanges that go past the request side.
pub struct Stream {
    tx: Option<tokio::sync::mpsc::Sender<ProcessingRequest>>,
    rx: tonic::Streaming<ProcessingResponse>,
}

impl Stream {
    pub async fn open(port: u16) -> Stream {
        let mut client = ExternalProcessorClient::connect(format!("http://127.0.0.1:{port}"))
            .await
            .unwrap();
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let rx = client
            .process(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        Stream { tx: Some(tx), rx }
    }

    pub async fn send(&self, m: ProcessingRequest) {
        self.tx.as_ref().unwrap().send(m).await.unwrap();
    }

    /// The next reply (`None`: the picker ended the stream); panics after 5 s.
    pub async fn recv(&mut self) -> Option<ProcessingResponse> {
        tokio::time::timeout(Duration::from_secs(5), self.rx.message())
            .await
            .expect("no reply within 5 s")
            .unwrap()
    }

    /// The next reply, or the status the picker ended the stream with; panics after 5 s.
    pub async fn recv_status(&mut self) -> Result<Option<ProcessingResponse>, tonic::Status> {
        tokio::time::timeout(Duration::from_secs(5), self.rx.message())
            .await
            .expect("no reply within 5 s")
    }

    /// Ends the stream from Envoy's side (as Envoy does once the response is through).
    pub fn close(&mut self) {
        self.tx = None;
    }
}

/// Response headers as Envoy sends them, optionally reporting the endpoint that served.
pub fn response_headers(
    status: u16,
    content_type: &str,
    served: Option<&str>,
) -> ProcessingRequest {
    use envoy_types::pb::envoy::config::core::v3::Metadata;
    use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
    let mut m = headers(
        &[
            (":status", &status.to_string()),
            ("content-type", content_type),
        ],
        false,
    );
    let Some(Msg::RequestHeaders(h)) = m.request.take() else {
        unreachable!()
    };
    m.request = Some(Msg::ResponseHeaders(h));
    if let Some(s) = served {
        m.metadata_context = Some(Metadata {
            filter_metadata: [(
                "envoy.lb".to_string(),
                Struct {
                    fields: [(
                        "x-gateway-destination-endpoint-served".to_string(),
                        Value {
                            kind: Some(Kind::StringValue(s.to_string())),
                        },
                    )]
                    .into(),
                },
            )]
            .into(),
            ..Default::default()
        });
    }
    m
}

/// Request trailers as Envoy sends them (none in particular).
pub fn request_trailers() -> ProcessingRequest {
    use envoy_types::pb::envoy::service::ext_proc::v3::HttpTrailers;
    ProcessingRequest {
        request: Some(Msg::RequestTrailers(HttpTrailers::default())),
        ..Default::default()
    }
}

/// A response body chunk as Envoy sends it.
pub fn response_body(b: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Msg::ResponseBody(HttpBody {
            body: b.to_vec(),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// The header mutation of a headers reply: (set headers as name/value, removed names).
pub fn mutation(r: &ProcessingResponse) -> (Vec<(String, String)>, Vec<String>) {
    let h = match r.response.as_ref() {
        Some(Reply::RequestHeaders(h)) | Some(Reply::ResponseHeaders(h)) => h,
        other => panic!("not a headers reply: {other:?}"),
    };
    let m = h
        .response
        .as_ref()
        .unwrap()
        .header_mutation
        .clone()
        .unwrap_or_default();
    let set = m
        .set_headers
        .into_iter()
        .map(|o| {
            let hv = o.header.unwrap();
            (hv.key, String::from_utf8(hv.raw_value).unwrap())
        })
        .collect();
    (set, m.remove_headers)
}

/// An immediate response's status and JSON body.
pub fn immediate(r: &ProcessingResponse) -> (i32, serde_json::Value) {
    let Some(Reply::ImmediateResponse(i)) = r.response.as_ref() else {
        panic!("not an immediate response: {r:?}")
    };
    (
        i.status.as_ref().unwrap().code,
        serde_json::from_slice(&i.body).unwrap(),
    )
}

/// A plaintext gRPC channel to a port on loopback.
pub async fn channel(port: u16) -> tonic::transport::Channel {
    tonic::transport::Channel::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// Polls `f` every 20 ms, yielding to the runtime between polls, until it holds or `timeout`
/// passes.
pub async fn eventually_async(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = tokio::time::Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if tokio::time::Instant::now() >= end {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
