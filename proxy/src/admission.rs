//! Per-model admission (`[admission]`): at most `cap` requests of a model in flight; up to
//! `queue_depth` more wait (at most `queue_timeout_ms`) for a slot; the rest get 429 with
//! `Retry-After`. A request waits after its body is read and its model is known to be served,
//! so the gates are bounded by the models the fleet serves.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvmesh_filters::error::{ApiError, ErrorKind};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::AdmissionConfig;

/// Why a model's gate refused a request (the `reason` label of
/// `kvmesh_admission_rejections_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The model's queue was full.
    QueueFull,
    /// No slot came free within `queue_timeout_ms`.
    QueueTimeout,
}

impl Refusal {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::QueueFull => "model_queue_full",
            Refusal::QueueTimeout => "model_queue_timeout",
        }
    }

    /// The 429 to send.
    pub fn error(self, model: &str) -> ApiError {
        let why = match self {
            Refusal::QueueFull => "its queue is full",
            Refusal::QueueTimeout => "no slot came free in time",
        };
        ApiError::new(
            ErrorKind::Overloaded,
            format!("model `{model}` is at its in-flight cap and {why}; retry shortly"),
        )
    }
}

struct Gate {
    slots: Arc<Semaphore>,
    waiting: AtomicU64,
}

/// One request in a model's queue; leaves it on drop.
struct Waiting<'a>(&'a AtomicU64);

impl<'a> Waiting<'a> {
    /// Joins a queue holding fewer than `depth`.
    fn enter(count: &'a AtomicU64, depth: u64) -> Option<Self> {
        count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < depth).then_some(n + 1)
            })
            .ok()
            .map(|_| Waiting(count))
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A request's slot of its model; released on drop.
#[derive(Debug)]
pub struct ModelSlot(#[allow(dead_code)] OwnedSemaphorePermit);

/// What [`ModelGates::enter`] gives: the slot, if the model has a cap, and whether the
/// request had to wait for it.
#[derive(Debug)]
pub struct Entered {
    /// The slot (`None`: the model has no cap).
    pub slot: Option<ModelSlot>,
    /// The request waited in the queue.
    pub waited: bool,
}

/// The per-model gates.
pub struct ModelGates {
    cfg: AdmissionConfig,
    gates: parking_lot::Mutex<HashMap<String, Arc<Gate>>>,
}

impl ModelGates {
    /// Gates with `cfg`'s caps.
    pub fn new(cfg: AdmissionConfig) -> Self {
        ModelGates {
            cfg,
            gates: parking_lot::Mutex::new(HashMap::new()),
        }
    }

    fn gate(&self, model: &str, cap: u64) -> Arc<Gate> {
        let mut gates = self.gates.lock();
        gates
            .entry(model.to_string())
            .or_insert_with(|| {
                let permits = usize::try_from(cap)
                    .unwrap_or(usize::MAX)
                    .min(Semaphore::MAX_PERMITS);
                Arc::new(Gate {
                    slots: Arc::new(Semaphore::new(permits)),
                    waiting: AtomicU64::new(0),
                })
            })
            .clone()
    }

    /// A slot for a request of `model` (`None` when the model has no cap), waiting in the
    /// model's bounded queue if need be; `waited` says whether it did (what was decided before
    /// may be stale by then).
    pub async fn enter(&self, model: &str) -> Result<Entered, Refusal> {
        let Some(cap) = self.cfg.cap(model) else {
            return Ok(Entered {
                slot: None,
                waited: false,
            });
        };
        let gate = self.gate(model, cap);
        if let Ok(p) = gate.slots.clone().try_acquire_owned() {
            return Ok(Entered {
                slot: Some(ModelSlot(p)),
                waited: false,
            });
        }
        // Counted while waiting, also when the wait is abandoned (the request's task dropped).
        let _waiting =
            Waiting::enter(&gate.waiting, self.cfg.queue_depth).ok_or(Refusal::QueueFull)?;
        let waited = tokio::time::timeout(
            Duration::from_millis(self.cfg.queue_timeout_ms),
            gate.slots.clone().acquire_owned(),
        )
        .await;
        match waited {
            Ok(Ok(p)) => Ok(Entered {
                slot: Some(ModelSlot(p)),
                waited: true,
            }),
            // The semaphore is never closed; a timeout is the only other way out.
            _ => Err(Refusal::QueueTimeout),
        }
    }

    /// Requests of `model` waiting for a slot now.
    pub fn waiting(&self, model: &str) -> u64 {
        self.gates
            .lock()
            .get(model)
            .map_or(0, |g| g.waiting.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn cap_queue_and_timeout() {
        let mut cfg = AdmissionConfig::default();
        cfg.model_max_inflight.insert("m".into(), 1);
        cfg.queue_depth = 1;
        cfg.queue_timeout_ms = 50;
        let gates = Arc::new(ModelGates::new(cfg));
        assert!(gates.enter("free").await.unwrap().slot.is_none(), "no cap");
        let first = gates.enter("m").await.unwrap();
        assert!(first.slot.is_some() && !first.waited);
        // One waits (and times out), a second waiter finds the queue full.
        let g = gates.clone();
        let waiter = tokio::spawn(async move { g.enter("m").await.map(|_| ()) });
        while gates.waiting("m") == 0 {
            tokio::task::yield_now().await;
        }
        assert_eq!(gates.enter("m").await.unwrap_err(), Refusal::QueueFull);
        assert_eq!(waiter.await.unwrap().unwrap_err(), Refusal::QueueTimeout);
        // An abandoned wait leaves the queue.
        let g = gates.clone();
        let abandoned = tokio::spawn(async move { g.enter("m").await.map(|_| ()) });
        while gates.waiting("m") == 0 {
            tokio::task::yield_now().await;
        }
        abandoned.abort();
        let _ = abandoned.await;
        assert_eq!(gates.waiting("m"), 0);
        // A waiter gets the slot when it frees.
        let g = gates.clone();
        let waiter =
            tokio::spawn(async move { g.enter("m").await.map(|e| e.slot.is_some() && e.waited) });
        while gates.waiting("m") == 0 {
            tokio::task::yield_now().await;
        }
        drop(first);
        assert!(waiter.await.unwrap().unwrap());
    }
}
