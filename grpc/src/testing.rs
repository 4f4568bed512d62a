//! A gRPC call with the framing written by hand, as a hostile peer would write it: a message
//! can be declared and then sent in part, or never finished. For this workspace's attack tests.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use bytes::Bytes;

/// One call held open, its request body written raw.
pub struct RawCall {
    body: http_body_util::channel::Sender<Bytes>,
    /// The server's answer: the gRPC status its trailers carry (or what ended the call).
    answer: tokio::task::JoinHandle<Result<tonic::Code, String>>,
}

impl RawCall {
    /// Opens a call of `path` (`/package.Service/Method`) on `channel`: one HTTP/2 connection
    /// carries many calls.
    pub async fn open(channel: &tonic::transport::Channel, path: &str) -> RawCall {
        use tower::Service;
        let (body, rx) = http_body_util::channel::Channel::<Bytes>::new(4);
        let req = http::Request::builder()
            .method("POST")
            .uri(format!("http://server{path}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(tonic::body::Body::new(rx))
            .unwrap();
        let mut channel = channel.clone();
        std::future::poll_fn(|cx| channel.poll_ready(cx))
            .await
            .unwrap();
        let call = channel.call(req);
        let answer = tokio::spawn(async move {
            use http_body_util::BodyExt;
            let resp = call.await.map_err(|e| e.to_string())?;
            if let Some(status) = tonic::Status::from_header_map(resp.headers()) {
                return Ok(status.code());
            }
            let mut body = resp.into_body();
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|e| e.to_string())?;
                if let Some(trailers) = frame.trailers_ref() {
                    return tonic::Status::from_header_map(trailers)
                        .map(|s| s.code())
                        .ok_or_else(|| "trailers without grpc-status".to_string());
                }
            }
            Err("the call ended without trailers".into())
        });
        RawCall { body, answer }
    }

    /// Sends the 5-byte prefix of an uncompressed message of `len` bytes.
    pub async fn declare(&mut self, len: u32) -> bool {
        let mut prefix = vec![0u8];
        prefix.extend_from_slice(&len.to_be_bytes());
        self.send(prefix).await
    }

    /// Sends raw bytes; `false` once the server no longer takes them.
    pub async fn send(&mut self, bytes: Vec<u8>) -> bool {
        self.body.send_data(bytes.into()).await.is_ok()
    }

    /// Whether the server has answered (ended the call).
    pub fn answered(&self) -> bool {
        self.answer.is_finished()
    }

    /// The server's answer, waiting at most `within`.
    pub async fn answer(self, within: Duration) -> Result<tonic::Code, String> {
        drop(self.body);
        match tokio::time::timeout(within, self.answer).await {
            Ok(joined) => joined.map_err(|e| e.to_string())?,
            Err(_) => Err(format!("no answer within {within:?}")),
        }
    }
}

/// Waits, at most `within`, until at least `n` of `calls` are answered; how many are.
pub async fn await_answers(calls: &[RawCall], n: usize, within: Duration) -> usize {
    let answered = || calls.iter().filter(|c| c.answered()).count();
    let end = tokio::time::Instant::now() + within;
    while answered() < n && tokio::time::Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    answered()
}

/// The calls still open, once each answered one is checked to have ended with `code`.
pub async fn still_open(calls: Vec<RawCall>, code: tonic::Code) -> Vec<RawCall> {
    let mut open = Vec::new();
    for c in calls {
        if c.answered() {
            assert_eq!(c.answer(Duration::from_secs(1)).await.unwrap(), code);
        } else {
            open.push(c);
        }
    }
    open
}
