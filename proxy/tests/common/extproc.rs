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
    rt().block_on(async {
        let replies = exchange(port, vec![chat_headers(), body(doc, true)])
            .await
            .unwrap();
        destination(&replies[0])
    })
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
