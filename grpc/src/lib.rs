//! What kvmesh's gRPC servers (the picker, kvagent) share: messages on their way in charged to
//! a byte budget before tonic buffers them ([`charge`]).

pub mod charge;
#[cfg(feature = "testing")]
pub mod testing;

pub use charge::{Budget, Charged};

/// The largest `grpc.health.v1` request a server takes: a service name. tonic's default (4
/// MiB) would let each health call hold 4 MiB before any budget sees it.
pub const HEALTH_MAX_MESSAGE_BYTES: usize = 1024;

/// What all health calls of a server may hold at once ([`health`]).
pub const HEALTH_BUDGET_BYTES: usize = 16 << 20;

/// `grpc.health.v1` bounded: requests of at most [`HEALTH_MAX_MESSAGE_BYTES`], one per call,
/// charged to a budget of [`HEALTH_BUDGET_BYTES`] of the health service's own (a peer that
/// fills it cannot take the other services' budget, nor theirs the health checks').
pub fn health<S>(
    service: tonic_health::pb::health_server::HealthServer<S>,
) -> Charged<tonic_health::pb::health_server::HealthServer<S>>
where
    S: tonic_health::pb::health_server::Health,
{
    Charged::new(
        service.max_decoding_message_size(HEALTH_MAX_MESSAGE_BYTES),
        Budget::new(HEALTH_BUDGET_BYTES, "the health service's 16 MiB"),
        HEALTH_MAX_MESSAGE_BYTES,
    )
    .one_message()
}
