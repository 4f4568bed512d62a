//! What kvmesh's gRPC servers (the picker, kvagent) share: messages on their way in charged to
//! a byte budget before tonic buffers them ([`charge`]).

pub mod charge;
#[cfg(feature = "testing")]
pub mod testing;

pub use charge::{Budget, Charge, Charged, Charger};
