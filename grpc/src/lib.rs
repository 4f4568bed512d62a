//! What kvmesh's gRPC servers (the picker, kvagent) share: messages on their way in charged to
//! a byte budget before tonic buffers them ([`charge`]).

pub mod charge;
#[cfg(feature = "testing")]
pub mod testing;

pub use charge::{Budget, Charged};

/// The largest `grpc.health.v1` request a server takes: a service name. tonic's default (4
/// MiB) would let each health call hold 4 MiB before any budget sees it.
pub const HEALTH_MAX_MESSAGE_BYTES: usize = 1024;
