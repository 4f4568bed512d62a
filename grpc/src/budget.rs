//! A byte budget shared by many holders, each with a share it can grow and that is given back
//! when dropped: gRPC calls ([`crate::Charged`]) and the proxy's request bodies.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// A byte budget: what its [`Share`]s hold together never passes its cap.
#[derive(Clone, Debug)]
pub struct Budget {
    used: Arc<AtomicUsize>,
    cap: usize,
    /// Where `cap` is set, named in refusals.
    key: &'static str,
}

impl Budget {
    /// A budget of `cap` bytes; `key` says where it is set, in refusals (e.g. a config key in
    /// backquotes).
    pub fn new(cap: usize, key: &'static str) -> Self {
        Budget {
            used: Arc::new(AtomicUsize::new(0)),
            cap,
            key,
        }
    }

    /// Bytes held by all shares now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// A share of nothing yet.
    pub fn share(&self) -> Share {
        Share {
            budget: self.clone(),
            bytes: 0,
        }
    }
}

/// One holder's part of a [`Budget`], given back when it is dropped.
#[derive(Debug)]
pub struct Share {
    budget: Budget,
    bytes: usize,
}

impl Share {
    /// Makes the share at least `bytes`; `false`, and nothing more taken, past the budget.
    pub fn cover(&mut self, bytes: usize) -> bool {
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

    /// Where the budget's cap is set (for refusals).
    pub fn budget_key(&self) -> &'static str {
        self.budget.key
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_takes_what_fits_and_gets_it_back_on_drop() {
        let b = Budget::new(100, "test.budget");
        let mut one = b.share();
        assert!(one.cover(60));
        assert!(one.cover(40), "already covered");
        let mut two = b.share();
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
