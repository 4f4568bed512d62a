//! The Envoy side of the picker: reading ext_proc requests (headers, the subset hint, the
//! processing mode) and building its replies (header mutations, the destination metadata,
//! streamed body chunks, immediate responses).

use std::collections::HashSet;
use std::net::SocketAddr;

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_response::Response as Reply, BodyMutation, BodyResponse,
    CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse, ProcessingRequest,
    ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use kvmesh_filters::ApiError;

/// The request header that names the chosen endpoint (`ip:port`); Envoy's `ORIGINAL_DST`
/// cluster routes on it. The picker always overwrites it: a client must not choose it.
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// The dynamic-metadata namespace of the result (the GIE protocol's `envoy.lb`).
pub const DESTINATION_NAMESPACE: &str = "envoy.lb";
/// The metadata namespace in which Envoy may offer the endpoints to pick from.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The key of that subset: a list of `ip:port` strings.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// The key under [`DESTINATION_NAMESPACE`] where Envoy reports the endpoint that served.
pub const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";
/// Largest body chunk sent back to Envoy (the protocol caps chunks at 64 KiB).
pub const MAX_CHUNK: usize = 64 << 10;

/// The value of header `name` (lower case) in `map`: Envoy sends `raw_value`, older builds
/// `value`. Values that are not UTF-8 are treated as absent.
pub fn header<'a>(map: Option<&'a HeaderMap>, name: &str) -> Option<&'a str> {
    let h = map?.headers.iter().find(|h| h.key == name)?;
    if h.raw_value.is_empty() {
        Some(h.value.as_str())
    } else {
        std::str::from_utf8(&h.raw_value).ok()
    }
}

/// Most endpoints a subset hint may list: a hint names (some of) the pool's endpoints, and
/// each is read on the request's path.
pub const MAX_SUBSET: usize = 16_384;

/// The endpoints Envoy allows among those `known` (the fleet's: the set is no larger), if it
/// sent a subset hint: `None` when there is no hint, `Some(empty)` when the hint is there but
/// lists nothing usable (entries that are not `ip:port` name no engine). Past [`MAX_SUBSET`]
/// entries it is refused whole.
pub fn subset_hint(
    req: &ProcessingRequest,
    known: impl Fn(&SocketAddr) -> bool,
) -> Result<Option<HashSet<SocketAddr>>, String> {
    let Some(value) = req
        .metadata_context
        .as_ref()
        .and_then(|m| m.filter_metadata.get(SUBSET_NAMESPACE))
        .and_then(|ns| ns.fields.get(SUBSET_KEY))
    else {
        return Ok(None);
    };
    let too_many = || format!("the subset hint lists more than {MAX_SUBSET} endpoints");
    let mut out = HashSet::new();
    let mut take = |entry: &str, seen: &mut usize| {
        *seen += 1;
        if let Ok(a) = entry.trim().parse::<SocketAddr>() {
            if known(&a) {
                out.insert(a);
            }
        }
    };
    let mut seen = 0usize;
    match value.kind.as_ref() {
        Some(Kind::ListValue(list)) => {
            if list.values.len() > MAX_SUBSET {
                return Err(too_many());
            }
            for v in &list.values {
                if let Some(Kind::StringValue(s)) = v.kind.as_ref() {
                    take(s, &mut seen);
                }
            }
        }
        // A single string, possibly a comma list.
        Some(Kind::StringValue(s)) => {
            for entry in s.split(',').filter(|x| !x.trim().is_empty()) {
                if seen == MAX_SUBSET {
                    return Err(too_many());
                }
                take(entry, &mut seen);
            }
        }
        _ => {}
    }
    Ok(Some(out))
}

fn set_header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_string(),
            value: String::new(),
            raw_value: value.as_bytes().to_vec(),
        }),
        // The default action appends to a client's own value; the destination must be ours.
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

fn string_value(s: String) -> Value {
    Value {
        kind: Some(Kind::StringValue(s)),
    }
}

/// The reply to the request headers once the endpoint is chosen: the destination header (and
/// `content-length` of the body streamed back), a route-cache clear so Envoy routes on it, the
/// `envoy.lb` metadata listing the choice then its fallbacks, and `headers` (name and value,
/// overwritten; removed when the value is empty).
pub fn routed_headers(
    endpoints: &[String],
    body_len: Option<usize>,
    headers: &[(&str, &str)],
) -> ProcessingResponse {
    let first = endpoints.first().cloned().unwrap_or_default();
    let mut set_headers = vec![set_header(DESTINATION_HEADER, &first)];
    if let Some(n) = body_len {
        set_headers.push(set_header("content-length", &n.to_string()));
    }
    let mut remove_headers = Vec::new();
    for (name, value) in headers {
        if value.is_empty() {
            remove_headers.push(name.to_string());
        } else {
            set_headers.push(set_header(name, value));
        }
    }
    let inner = Struct {
        fields: [(
            DESTINATION_HEADER.to_string(),
            string_value(endpoints.join(",")),
        )]
        .into(),
    };
    let metadata = Struct {
        fields: [(
            DESTINATION_NAMESPACE.to_string(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]
        .into(),
    };
    ProcessingResponse {
        response: Some(Reply::RequestHeaders(HeadersResponse {
            response: Some(CommonResponse {
                header_mutation: Some(HeaderMutation {
                    set_headers,
                    remove_headers,
                }),
                clear_route_cache: true,
                ..Default::default()
            }),
        })),
        dynamic_metadata: Some(metadata),
        ..Default::default()
    }
}

/// The endpoint Envoy reports it served (`envoy.lb / x-gateway-destination-endpoint-served`
/// in the metadata context of the response messages), if it reports one.
pub fn served_endpoint(req: &ProcessingRequest) -> Option<String> {
    let ns = req
        .metadata_context
        .as_ref()?
        .filter_metadata
        .get(DESTINATION_NAMESPACE)?;
    match ns.fields.get(SERVED_KEY)?.kind.as_ref()? {
        Kind::StringValue(s) if !s.trim().is_empty() => Some(s.trim().to_string()),
        _ => None,
    }
}

/// The string value of attribute `name` that Envoy sent (ext_proc `request_attributes` /
/// `response_attributes`), under whichever filter key.
pub fn attribute<'a>(req: &'a ProcessingRequest, name: &str) -> Option<&'a str> {
    req.attributes
        .values()
        .find_map(|s| match s.fields.get(name)?.kind.as_ref()? {
            Kind::StringValue(v) => Some(v.as_str()),
            _ => None,
        })
}

/// Whether Envoy's `response.code_details` says it could not connect to the upstream (its
/// own 503, not the engine's).
pub fn upstream_connect_failed(code_details: &str) -> bool {
    code_details.starts_with("upstream_reset_before_response_started")
        && code_details.contains("connection_failure")
}

/// The reply to the response headers, adding `extra` headers (e.g. which engine served).
pub fn response_headers(extra: &[(&str, &str)]) -> ProcessingResponse {
    let header_mutation = (!extra.is_empty()).then(|| HeaderMutation {
        set_headers: extra.iter().map(|(k, v)| set_header(k, v)).collect(),
        remove_headers: Vec::new(),
    });
    ProcessingResponse {
        response: Some(Reply::ResponseHeaders(HeadersResponse {
            response: Some(CommonResponse {
                header_mutation,
                ..Default::default()
            }),
        })),
        ..Default::default()
    }
}

/// Which direction a body or trailers reply belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Towards the engine.
    Request,
    /// Towards the client.
    Response,
}

/// `body` streamed back in chunks of at most [`MAX_CHUNK`] bytes; the last one carries
/// `end_of_stream`. An empty body is one empty chunk (Envoy needs the end of stream). A body
/// that fits one chunk is moved, not copied (every streamed response chunk takes this path).
pub fn body_chunks(dir: Direction, body: Vec<u8>, end_of_stream: bool) -> Vec<ProcessingResponse> {
    let chunks: Vec<Vec<u8>> = if body.len() <= MAX_CHUNK {
        vec![body]
    } else {
        body.chunks(MAX_CHUNK).map(<[u8]>::to_vec).collect()
    };
    let last = chunks.len() - 1;
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let r = BodyResponse {
                response: Some(CommonResponse {
                    body_mutation: Some(BodyMutation {
                        mutation: Some(body_mutation::Mutation::StreamedResponse(
                            StreamedBodyResponse {
                                body: c,
                                end_of_stream: end_of_stream && i == last,
                                ..Default::default()
                            },
                        )),
                    }),
                    ..Default::default()
                }),
            };
            ProcessingResponse {
                response: Some(match dir {
                    Direction::Request => Reply::RequestBody(r),
                    Direction::Response => Reply::ResponseBody(r),
                }),
                ..Default::default()
            }
        })
        .collect()
}

/// The reply to trailers: pass them on unchanged.
pub fn trailers(dir: Direction) -> ProcessingResponse {
    let r = TrailersResponse::default();
    ProcessingResponse {
        response: Some(match dir {
            Direction::Request => Reply::RequestTrailers(r),
            Direction::Response => Reply::ResponseTrailers(r),
        }),
        ..Default::default()
    }
}

/// A local answer Envoy sends to the client instead of routing: `e` as OpenAI-style JSON,
/// with `request_id` echoed.
pub fn immediate(e: &ApiError, request_id: &str) -> ProcessingResponse {
    let mut r = local_json(e.status(), e.to_json(), request_id);
    if let Some(Reply::ImmediateResponse(i)) = r.response.as_mut() {
        if let Some(h) = i.headers.as_mut() {
            if e.status() == 429 || e.status() == 503 {
                h.set_headers.push(set_header("retry-after", "1"));
            }
            if let Some(allow) = e.allow {
                h.set_headers.push(set_header("allow", allow));
            }
        }
        i.details = format!("kvmesh_picker_{}", e.kind.code());
    }
    r
}

/// A local JSON answer with `status`, with `request_id` echoed.
pub fn local_json(status: u16, body: Vec<u8>, request_id: &str) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Reply::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus {
                // Envoy's StatusCode values are the HTTP codes themselves.
                code: i32::from(status),
            }),
            headers: Some(HeaderMutation {
                set_headers: vec![
                    set_header("content-type", "application/json"),
                    set_header(crate::access::REQUEST_ID, request_id),
                ],
                remove_headers: Vec::new(),
            }),
            body,
            details: "kvmesh_picker".into(),
            ..Default::default()
        })),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use envoy_types::pb::envoy::config::core::v3::Metadata;
    use envoy_types::pb::google::protobuf::ListValue;
    use kvmesh_filters::ErrorKind;

    use super::*;

    fn with_hint(value: Value) -> ProcessingRequest {
        let ns = Struct {
            fields: [(SUBSET_KEY.to_string(), value)].into(),
        };
        ProcessingRequest {
            metadata_context: Some(Metadata {
                filter_metadata: [(SUBSET_NAMESPACE.to_string(), ns)].into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn the_subset_hint_is_read_as_a_list_or_a_comma_string() {
        let set =
            |v: &[&str]| -> HashSet<SocketAddr> { v.iter().map(|a| a.parse().unwrap()).collect() };
        assert_eq!(
            subset_hint(&ProcessingRequest::default(), |_| true),
            Ok(None)
        );
        let list = Value {
            kind: Some(Kind::ListValue(ListValue {
                values: vec![
                    string_value("10.0.0.1:8000".into()),
                    string_value(" ".into()),
                    string_value("10.0.0.2:8000".into()),
                ],
            })),
        };
        assert_eq!(
            subset_hint(&with_hint(list.clone()), |_| true),
            Ok(Some(set(&["10.0.0.1:8000", "10.0.0.2:8000"])))
        );
        // Only the fleet's engines are kept.
        let one: SocketAddr = "10.0.0.2:8000".parse().unwrap();
        assert_eq!(
            subset_hint(&with_hint(list), |a| *a == one),
            Ok(Some(set(&["10.0.0.2:8000"])))
        );
        let s = string_value("10.0.0.3:1, 10.0.0.4:2, not-an-address".into());
        assert_eq!(
            subset_hint(&with_hint(s), |_| true),
            Ok(Some(set(&["10.0.0.3:1", "10.0.0.4:2"])))
        );
        // Present but empty: the caller answers 503.
        assert_eq!(
            subset_hint(&with_hint(string_value(String::new())), |_| true),
            Ok(Some(HashSet::new()))
        );
        // Past MAX_SUBSET entries, refused whole (a long comma string is not split to its end).
        let many = vec!["10.0.0.9:1"; MAX_SUBSET + 1].join(",");
        assert!(subset_hint(&with_hint(string_value(many.repeat(2))), |_| true).is_err());
        let list = Value {
            kind: Some(Kind::ListValue(ListValue {
                values: vec![string_value("10.0.0.9:1".into()); MAX_SUBSET + 1],
            })),
        };
        assert!(subset_hint(&with_hint(list), |_| true).is_err());
        let at_most = vec!["10.0.0.9:1"; MAX_SUBSET].join(",");
        assert!(subset_hint(&with_hint(string_value(at_most)), |_| true).is_ok());
    }

    #[test]
    fn the_destination_overwrites_and_lists_fallbacks_in_metadata() {
        let eps = ["127.0.0.1:1".to_string(), "127.0.0.1:2".to_string()];
        let r = routed_headers(&eps, Some(42), &[("x-kvmesh-prefix-digests", "")]);
        let Some(Reply::RequestHeaders(h)) = r.response else {
            panic!("not a headers reply")
        };
        let common = h.response.unwrap();
        assert!(common.clear_route_cache);
        let mutation = common.header_mutation.unwrap();
        let set = mutation.set_headers;
        let dest = set[0].header.as_ref().unwrap();
        assert_eq!(dest.key, DESTINATION_HEADER);
        assert_eq!(dest.raw_value, b"127.0.0.1:1");
        assert_eq!(
            set[0].append_action,
            HeaderAppendAction::OverwriteIfExistsOrAdd as i32
        );
        assert_eq!(set[1].header.as_ref().unwrap().raw_value, b"42");
        // No digests: a client's own header is removed, not passed on.
        assert_eq!(mutation.remove_headers, ["x-kvmesh-prefix-digests"]);
        let md = r.dynamic_metadata.unwrap();
        let Some(Kind::StructValue(lb)) = md.fields[DESTINATION_NAMESPACE].kind.as_ref() else {
            panic!("no envoy.lb struct")
        };
        assert_eq!(
            lb.fields[DESTINATION_HEADER].kind,
            Some(Kind::StringValue("127.0.0.1:1,127.0.0.1:2".into()))
        );
    }

    #[test]
    fn bodies_go_back_in_chunks_of_at_most_64_kib() {
        let body = vec![7u8; 2 * MAX_CHUNK + 5];
        let chunks = body_chunks(Direction::Request, body.clone(), true);
        assert_eq!(chunks.len(), 3);
        let mut total = Vec::new();
        for (i, c) in chunks.iter().enumerate() {
            let Some(Reply::RequestBody(b)) = c.response.as_ref() else {
                panic!("not a request body reply")
            };
            let Some(body_mutation::Mutation::StreamedResponse(s)) = b
                .response
                .as_ref()
                .and_then(|r| r.body_mutation.as_ref())
                .and_then(|m| m.mutation.as_ref())
            else {
                panic!("not streamed")
            };
            assert!(s.body.len() <= MAX_CHUNK);
            assert_eq!(s.end_of_stream, i == 2);
            total.extend_from_slice(&s.body);
        }
        assert_eq!(total, body);
        assert_eq!(body_chunks(Direction::Response, Vec::new(), true).len(), 1);
    }

    #[test]
    fn an_immediate_response_carries_the_status_and_openai_json() {
        let e = ApiError::new(ErrorKind::Overloaded, "busy");
        let Some(Reply::ImmediateResponse(r)) = immediate(&e, "rid").response else {
            panic!("not immediate")
        };
        assert_eq!(r.status.unwrap().code, 429);
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(v["error"]["message"], "busy");
        let keys: Vec<_> = r
            .headers
            .unwrap()
            .set_headers
            .into_iter()
            .map(|h| h.header.unwrap().key)
            .collect();
        assert_eq!(keys, ["content-type", "x-request-id", "retry-after"]);
    }
}
