//! What kvmesh's gRPC servers (the picker, kvagent) share: messages on their way in charged to
//! a byte budget before tonic buffers them ([`charge`]), and the budget itself ([`budget`],
//! which the proxy's request bodies use too).

pub mod budget;
pub mod charge;
#[cfg(feature = "testing")]
pub mod testing;

pub use budget::{Budget, Share};
pub use charge::Charged;

/// The largest `grpc.health.v1` request a server takes: a service name. tonic's default (4
/// MiB) would let each health call hold 4 MiB before any budget sees it.
pub const HEALTH_MAX_MESSAGE_BYTES: usize = 1024;

/// `grpc.health.v1` bounded per call: one request of at most [`HEALTH_MAX_MESSAGE_BYTES`], a
/// byte past it refused, so a call holds tonic's starting buffer and one small frame (about
/// 20 KiB). Health calls are not charged to a budget that could refuse them: a peer holding
/// stalled calls would then fail the node's health checks.
pub fn health<S>(
    service: tonic_health::pb::health_server::HealthServer<S>,
) -> Charged<tonic_health::pb::health_server::HealthServer<S>>
where
    S: tonic_health::pb::health_server::Health,
{
    Charged::new(
        service.max_decoding_message_size(HEALTH_MAX_MESSAGE_BYTES),
        Budget::new(usize::MAX, "no budget"),
        HEALTH_MAX_MESSAGE_BYTES,
    )
    .one_message()
}
