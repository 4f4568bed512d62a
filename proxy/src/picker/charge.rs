//! ext_proc messages on their way in, charged to `body_budget_bytes` before tonic buffers them.
//!
//! tonic gathers each gRPC message whole before the picker sees it, and it reserves a buffer of
//! the message's declared length as soon as the 5-byte prefix arrives; the stream keeps that
//! buffer until it ends. So a peer that opens many streams and declares a large message on each
//! holds streams x message bytes that no budget counted (200 streams declaring 8 MiB, with
//! nothing after the prefix, took 415 MiB of the picker's memory). This wraps each stream's
//! body, follows gRPC's framing as the bytes pass, and charges the stream, from its first
//! prefix to its end, with the largest message it has begun (at most
//! `picker.max_message_bytes`; tonic refuses a longer one). A message the budget cannot cover
//! ends the stream with `RESOURCE_EXHAUSTED` before tonic reserves anything for it.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::Status;

use crate::body::{BodyPermit, Limits};

/// gRPC's message prefix: a compression flag and a big-endian u32 length.
const PREFIX: usize = 5;

/// A gRPC service whose request bodies are charged as they arrive (see the module docs).
#[derive(Clone)]
pub(super) struct Charged<S> {
    inner: S,
    limits: Arc<Limits>,
    max_message: usize,
}

impl<S> Charged<S> {
    /// `inner`, its streams charged to `limits`' body budget; `max_message` is the decoder's
    /// own limit.
    pub(super) fn new(inner: S, limits: Arc<Limits>, max_message: usize) -> Self {
        Charged {
            inner,
            limits,
            max_message,
        }
    }
}

impl<S: NamedService> NamedService for Charged<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> tower::Service<http::Request<Body>> for Charged<S>
where
    S: tower::Service<http::Request<Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let (limits, max_message) = (&self.limits, self.max_message);
        self.inner.call(req.map(|inner| {
            Body::new(ChargedBody {
                inner,
                permit: BodyPermit::new(limits),
                framing: Framing::new(max_message),
                refused: false,
            })
        }))
    }
}

/// One stream's body, charged with the largest message it has begun.
struct ChargedBody {
    inner: Body,
    /// Released when tonic drops the body: when the stream ends.
    permit: BodyPermit,
    framing: Framing,
    refused: bool,
}

impl http_body::Body for ChargedBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if self.refused {
            return Poll::Ready(None);
        }
        let frame = std::task::ready!(Pin::new(&mut self.inner).poll_frame(cx));
        if let Some(data) = frame.as_ref().and_then(|f| f.as_ref().ok()?.data_ref()) {
            let this = &mut *self;
            this.framing.feed(data);
            if !this.permit.cover(this.framing.largest) {
                this.refused = true;
                return Poll::Ready(Some(Err(Status::resource_exhausted(format!(
                    "an ext_proc message of {} bytes is past what `body_budget_bytes` has left",
                    this.framing.largest - PREFIX
                )))));
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.refused || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Where a body is in gRPC's length-prefixed framing.
struct Framing {
    prefix: [u8; PREFIX],
    /// Bytes of the current message's prefix seen (`PREFIX`: its payload is under way).
    have: usize,
    /// Payload bytes of the current message still to come.
    left: usize,
    /// The largest message begun, prefix included, its length taken up to `cap`.
    largest: usize,
    cap: usize,
}

impl Framing {
    fn new(cap: usize) -> Self {
        Framing {
            prefix: [0; PREFIX],
            have: 0,
            left: 0,
            largest: 0,
            cap,
        }
    }

    /// Follows the bytes of one frame.
    fn feed(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            if self.have < PREFIX {
                let take = (PREFIX - self.have).min(data.len());
                self.prefix[self.have..self.have + take].copy_from_slice(&data[..take]);
                self.have += take;
                data = &data[take..];
                if self.have < PREFIX {
                    return;
                }
                let [_, a, b, c, d] = self.prefix;
                let len = u32::from_be_bytes([a, b, c, d]) as usize;
                self.left = len;
                self.largest = self.largest.max(PREFIX.saturating_add(len.min(self.cap)));
            }
            let take = self.left.min(data.len());
            self.left -= take;
            data = &data[take..];
            if self.left == 0 {
                self.have = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(len: u32) -> Vec<u8> {
        let mut m = vec![0];
        m.extend_from_slice(&len.to_be_bytes());
        m.extend(std::iter::repeat_n(7u8, len as usize));
        m
    }

    #[test]
    fn the_largest_message_begun_is_found_whatever_the_frames_split() {
        let stream: Vec<u8> = [message(10), message(0), message(300), message(20)].concat();
        for split in [1, 2, 3, 4, 5, 6, 7, 64, stream.len()] {
            let mut f = Framing::new(1 << 20);
            let mut largest_seen = Vec::new();
            for chunk in stream.chunks(split) {
                f.feed(chunk);
                largest_seen.push(f.largest);
            }
            assert_eq!(f.largest, PREFIX + 300, "frames of {split} bytes");
            // Between messages: nothing of a prefix is held.
            assert_eq!((f.have, f.left), (0, 0), "frames of {split} bytes");
            assert!(largest_seen.windows(2).all(|w| w[0] <= w[1]));
        }
    }

    #[test]
    fn a_declared_length_counts_from_its_prefix_and_is_capped() {
        let mut f = Framing::new(1000);
        f.feed(&[0, 0, 0]);
        assert_eq!(f.largest, 0);
        f.feed(&[0x01, 0x00]);
        assert_eq!(f.largest, PREFIX + 256, "charged before any payload");
        let mut g = Framing::new(1000);
        g.feed(&message(u32::MAX)[..PREFIX]);
        assert_eq!(g.largest, PREFIX + 1000);
    }
}
