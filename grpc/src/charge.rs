//! gRPC messages on their way in, charged to a byte budget before tonic buffers them.
//!
//! tonic gathers each message whole before a handler sees it, and it reserves a buffer of the
//! message's declared length as soon as the 5-byte prefix arrives; the call keeps that buffer
//! until it ends. So a peer that opens many calls and declares a large message on each holds
//! calls x message bytes that no budget counted (200 picker streams that declared 8 MiB, with
//! nothing after the prefix, took 415 MiB). [`Charged`] wraps each call's request body,
//! follows gRPC's framing as the bytes pass, and charges the call, from its first prefix to its
//! end, with the largest message it has begun (its length taken up to the decoder's own limit,
//! past which tonic refuses the message). A message the budget cannot cover ends the call with
//! `RESOURCE_EXHAUSTED` before tonic reserves anything for it.

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::Status;

/// gRPC's message prefix: a compression flag and a big-endian u32 length.
const PREFIX: usize = 5;

/// Where the calls' charges come from: one [`Charge`] per call.
pub trait Charger: Clone + Send + Sync + 'static {
    /// One call's share of the budget.
    type Charge: Charge;
    /// The config key of the budget, named in the refusal.
    const BUDGET: &'static str;
    /// A charge of nothing yet, for a new call; what it covers goes back when it is dropped.
    fn begin(&self) -> Self::Charge;
}

/// One call's share of a budget.
pub trait Charge: Send + Unpin + 'static {
    /// Makes the share at least `bytes`; `false`, and nothing more taken, past the budget.
    fn cover(&mut self, bytes: usize) -> bool;
}

/// A plain shared byte budget: a [`Charger`] for a server with no budget of its own to share.
#[derive(Clone, Debug)]
pub struct Budget {
    used: Arc<AtomicUsize>,
    cap: usize,
}

impl Budget {
    /// A budget of `cap` bytes.
    pub fn new(cap: usize) -> Self {
        Budget {
            used: Arc::new(AtomicUsize::new(0)),
            cap,
        }
    }

    /// Bytes charged now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }
}

/// A call's share of a [`Budget`].
#[derive(Debug)]
pub struct BudgetCharge {
    budget: Budget,
    bytes: usize,
}

impl Charger for Budget {
    type Charge = BudgetCharge;
    const BUDGET: &'static str = "the message budget";

    fn begin(&self) -> BudgetCharge {
        BudgetCharge {
            budget: self.clone(),
            bytes: 0,
        }
    }
}

impl Charge for BudgetCharge {
    fn cover(&mut self, bytes: usize) -> bool {
        if bytes <= self.bytes {
            return true;
        }
        let more = bytes - self.bytes;
        let cap = self.budget.cap;
        let ok = self
            .budget
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |cur| {
                cur.checked_add(more).filter(|&t| t <= cap)
            })
            .is_ok();
        if ok {
            self.bytes = bytes;
        }
        ok
    }
}

impl Drop for BudgetCharge {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// A gRPC service whose request bodies are charged as they arrive (see the module docs).
#[derive(Clone)]
pub struct Charged<S, C> {
    inner: S,
    charger: C,
    max_message: usize,
}

impl<S, C> Charged<S, C> {
    /// `inner`, its calls charged by `charger`; `max_message` is `inner`'s decoding limit.
    pub fn new(inner: S, charger: C, max_message: usize) -> Self {
        Charged {
            inner,
            charger,
            max_message,
        }
    }
}

impl<S: NamedService, C> NamedService for Charged<S, C> {
    const NAME: &'static str = S::NAME;
}

impl<S, C> tower::Service<http::Request<Body>> for Charged<S, C>
where
    S: tower::Service<http::Request<Body>>,
    C: Charger,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let (charger, max_message) = (&self.charger, self.max_message);
        self.inner.call(req.map(|inner| {
            Body::new(ChargedBody::<C> {
                inner,
                charge: charger.begin(),
                framing: Framing::new(max_message),
                refused: false,
            })
        }))
    }
}

/// One call's body, charged with the largest message it has begun.
struct ChargedBody<C: Charger> {
    inner: Body,
    /// Given back when tonic drops the body: when the call ends.
    charge: C::Charge,
    framing: Framing,
    refused: bool,
}

impl<C: Charger> http_body::Body for ChargedBody<C> {
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
            if !this.charge.cover(this.framing.largest) {
                this.refused = true;
                return Poll::Ready(Some(Err(Status::resource_exhausted(format!(
                    "a gRPC message of {} bytes is past what {} has left",
                    this.framing.largest - PREFIX,
                    C::BUDGET
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

    #[test]
    fn a_budget_takes_what_fits_and_gets_it_back_on_drop() {
        let b = Budget::new(100);
        let mut one = b.begin();
        assert!(one.cover(60));
        assert!(one.cover(40), "already covered");
        let mut two = b.begin();
        assert!(!two.cover(41));
        assert_eq!(b.used(), 60, "a refusal takes nothing");
        assert!(two.cover(40));
        assert!(!one.cover(61));
        drop(one);
        assert_eq!(b.used(), 40);
        drop(two);
        assert_eq!(b.used(), 0);
    }
}
