//! Request processing shared by the kvmesh proxy and its Envoy ext_proc endpoint picker.
//!
//! The request path, in the order the proxy runs it:
//!
//! 1. [`request`]: parse and validate an OpenAI request body in one streaming pass (no JSON tree),
//!    produce its canonical prompt bytes (optionally only the leading ones).
//! 2. [`chain`]: cut the canonical prompt into blocks and hash them (optionally only the leading
//!    ones) into the BLAKE3 digest chain.
//! 3. [`residency`]: look up which nodes hold how much of that chain.
//! 4. [`route`]: rank the candidate nodes by prefix overlap balanced against load.
//!
//! [`error`] holds the OpenAI-style errors every step returns.

pub mod chain;
pub mod error;
pub mod request;
pub mod residency;
pub mod route;
pub mod usage;

pub use chain::{Digest, Namespace};
pub use error::{ApiError, ErrorKind};
pub use request::{Endpoint, ParsedRequest};
pub use residency::{NodeId, ResidencyIndex, Source};
