//! gRPC messages on their way in, charged to a byte budget before tonic buffers them.
//!
//! tonic gathers each message whole before a handler sees it: it copies every HTTP/2 DATA
//! frame into one buffer per call (8 KiB to start with), reserves the message's declared length
//! in it as soon as the 5-byte prefix arrives, and keeps that buffer until the request ends. So
//! a peer that opens many calls and declares a large message on each holds calls x message
//! bytes that no budget counted (200 picker streams that declared 8 MiB, with nothing after the
//! prefix, took 415 MiB). [`Charged`] wraps each call's request body, follows gRPC's framing as
//! the frames pass, and charges the call, from its first frame until the request ends, with
//! what that buffer may grow to. The buffer holds the message in progress, at most one frame
//! past it, and bytes already read that it has not reclaimed, and grows by doubling
//! (`Vec::reserve`), so with `M` the largest message begun (prefix included) and `F` the
//! largest frame:
//! - a call that carries [one message](Charged::one_message) is charged `M + 2F + 16 KiB`
//!   (reserving `M` with a frame already held, or doubling the first frame); a byte past its
//!   message is refused, so no second message is reserved beside a decoded one;
//! - any other call, `4 (M + F) + 16 KiB`: what the buffer needs stays under `2M + F` (a
//!   message, unreclaimed bytes of the one before it, a frame), and each growth at most
//!   doubles it.
//!
//! A message over the decoder's own limit is not counted: tonic refuses it at its prefix,
//! before reserving anything. A charge the budget cannot cover ends the call with
//! `RESOURCE_EXHAUSTED` before the frame reaches tonic. Compressed messages are charged by
//! their compressed length: neither server accepts compression.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::Status;

use crate::budget::{Budget, Share};

/// gRPC's message prefix: a compression flag and a big-endian u32 length.
const PREFIX: usize = 5;
/// Twice tonic's starting buffer (8 KiB, allocated with the call and charged from its first
/// frame), which a first frame may double.
const START: usize = 16 << 10;

/// A gRPC service whose request bodies are charged as they arrive (see the module docs).
#[derive(Clone)]
pub struct Charged<S> {
    inner: S,
    budget: Budget,
    max_message: usize,
    one_message: bool,
}

impl<S> Charged<S> {
    /// `inner`, its calls charged to `budget`; `max_message` is `inner`'s decoding limit.
    pub fn new(inner: S, budget: Budget, max_message: usize) -> Self {
        Charged {
            inner,
            budget,
            max_message,
            one_message: false,
        }
    }

    /// Every method takes a single request message (unary and server-streaming calls): a
    /// byte past it ends the call with `INVALID_ARGUMENT`, and the buffer is charged once,
    /// not for doubling.
    pub fn one_message(mut self) -> Self {
        self.one_message = true;
        self
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
        let share = self.budget.share();
        let (max_message, one_message) = (self.max_message, self.one_message);
        self.inner.call(req.map(|inner| {
            Body::new(ChargedBody {
                inner,
                share,
                framing: Framing::new(max_message),
                one_message,
                ended: false,
            })
        }))
    }
}

/// One call's body and its share of the budget.
struct ChargedBody {
    inner: Body,
    share: Share,
    framing: Framing,
    one_message: bool,
    /// Refused: nothing more is read.
    ended: bool,
}

impl ChargedBody {
    /// What tonic's buffer may grow to, after the frames seen so far (see the module docs).
    fn holds(&self) -> usize {
        let f = &self.framing;
        let held = if self.one_message {
            f.largest.saturating_add(f.largest_frame.saturating_mul(2))
        } else {
            f.largest.saturating_add(f.largest_frame).saturating_mul(4)
        };
        held.saturating_add(START)
    }

    fn refuse(&mut self, status: Status) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        self.ended = true;
        Poll::Ready(Some(Err(status)))
    }
}

impl http_body::Body for ChargedBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        let frame = std::task::ready!(Pin::new(&mut self.inner).poll_frame(cx));
        let Some(data) = frame.as_ref().and_then(|f| f.as_ref().ok()?.data_ref()) else {
            return Poll::Ready(frame);
        };
        let this = &mut *self;
        this.framing.feed(data);
        if this.one_message && this.framing.past_first {
            return this.refuse(Status::invalid_argument(
                "bytes after the request message: this call takes exactly one",
            ));
        }
        let holds = this.holds();
        if !this.share.cover(holds) {
            let key = this.share.budget_key();
            return this.refuse(Status::resource_exhausted(format!(
                "a gRPC request holding {holds} bytes is past what {key} has left"
            )));
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.inner.is_end_stream()
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
    /// The largest message begun, prefix included (messages over `cap` left out: the decoder
    /// refuses them at their prefix).
    largest: usize,
    /// The largest frame seen.
    largest_frame: usize,
    /// A byte came after the first message.
    past_first: bool,
    /// The first message is complete.
    first_done: bool,
    cap: usize,
}

impl Framing {
    fn new(cap: usize) -> Self {
        Framing {
            prefix: [0; PREFIX],
            have: 0,
            left: 0,
            largest: 0,
            largest_frame: 0,
            past_first: false,
            first_done: false,
            cap,
        }
    }

    /// Follows the bytes of one frame.
    fn feed(&mut self, mut data: &[u8]) {
        self.largest_frame = self.largest_frame.max(data.len());
        while !data.is_empty() {
            if self.first_done {
                self.past_first = true;
            }
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
                if len <= self.cap {
                    self.largest = self.largest.max(PREFIX + len);
                }
            }
            let take = self.left.min(data.len());
            self.left -= take;
            data = &data[take..];
            if self.left == 0 {
                self.have = 0;
                self.first_done = true;
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
            assert_eq!(f.largest_frame, split.min(stream.len()));
            // Between messages: nothing of a prefix is held.
            assert_eq!((f.have, f.left), (0, 0), "frames of {split} bytes");
            assert!(f.past_first);
            assert!(largest_seen.windows(2).all(|w| w[0] <= w[1]));
        }
    }

    #[test]
    fn a_declared_length_counts_from_its_prefix_unless_the_decoder_refuses_it() {
        let mut f = Framing::new(1000);
        f.feed(&[0, 0, 0]);
        assert_eq!(f.largest, 0);
        f.feed(&[0x01, 0x00]);
        assert_eq!(f.largest, PREFIX + 256, "charged before any payload");
        let mut g = Framing::new(1000);
        g.feed(&message(u32::MAX)[..PREFIX]);
        assert_eq!(g.largest, 0, "over the decoder's limit: refused there");
    }

    #[test]
    fn one_byte_after_the_first_message_is_seen() {
        let one = message(3);
        let mut f = Framing::new(1000);
        f.feed(&one);
        assert!(!f.past_first, "exactly one message");
        f.feed(&[0]);
        assert!(f.past_first);
        let mut g = Framing::new(1000);
        g.feed(&[one.as_slice(), &[0]].concat());
        assert!(g.past_first, "in the same frame");
    }
}
