//! Who may call the agent: bearer tokens in the `authorization` metadata of each call.
//!
//! The engine's token (`auth.token_file`) may make every call; a reader's token
//! (`auth.read_token_file`), for a router or an operator, may only read (GetBlocks, Lookup,
//! Stats, WatchResidency, NodeLoad): PutBlocks and Delete need the engine's. Without
//! `token_file` every local process may call, which is why a listener beyond loopback needs
//! one (or `auth.insecure_no_auth = true`). Tokens are compared by their BLAKE3 hashes, whose
//! equality is constant-time.

use tonic::metadata::MetadataMap;
use tonic::Status;

use crate::config::{AuthConfig, ConfigError};

/// What a call does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Reads blocks, residency or load.
    Read,
    /// Writes or deletes blocks.
    Write,
}

/// The tokens in force.
#[derive(Clone, Default)]
pub struct AccessControl {
    engine: Option<blake3::Hash>,
    reader: Option<blake3::Hash>,
}

impl std::fmt::Debug for AccessControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AccessControl")
            .field("engine_token", &self.engine.is_some())
            .field("read_token", &self.reader.is_some())
            .finish()
    }
}

/// The first line of a token file, trimmed; at least 16 bytes.
fn read_token(path: &str, key: &str) -> Result<blake3::Hash, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError::Invalid(format!("{key} {path:?}: {e}")))?;
    let token = text.lines().next().unwrap_or("").trim();
    if token.len() < 16 || !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ConfigError::Invalid(format!(
            "{key} {path:?}: the token must be one line of at least 16 printable ASCII characters"
        )));
    }
    Ok(blake3::hash(token.as_bytes()))
}

impl AccessControl {
    /// The tokens `[auth]` names (read now).
    pub fn from_config(cfg: &AuthConfig) -> Result<Self, ConfigError> {
        let engine = (!cfg.token_file.is_empty())
            .then(|| read_token(&cfg.token_file, "auth.token_file"))
            .transpose()?;
        let reader = (!cfg.read_token_file.is_empty())
            .then(|| read_token(&cfg.read_token_file, "auth.read_token_file"))
            .transpose()?;
        if reader.is_some() && engine.is_none() {
            return Err(ConfigError::Invalid(
                "auth.read_token_file needs auth.token_file (without it every caller may write)"
                    .into(),
            ));
        }
        if reader.is_some() && reader == engine {
            return Err(ConfigError::Invalid(
                "auth.read_token_file and auth.token_file hold the same token".into(),
            ));
        }
        Ok(AccessControl { engine, reader })
    }

    /// Whether calls need a token.
    pub fn enabled(&self) -> bool {
        self.engine.is_some()
    }

    /// Checks a call's token: `unauthenticated` without one or with an unknown one,
    /// `permission_denied` for a reader's token on a write.
    pub fn check(&self, metadata: &MetadataMap, access: Access) -> Result<(), Status> {
        let Some(engine) = self.engine else {
            return Ok(());
        };
        let token = metadata
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .ok_or_else(|| {
                Status::unauthenticated("kvagent needs `authorization: Bearer <token>`")
            })?;
        let presented = blake3::hash(token.trim().as_bytes());
        if presented == engine {
            return Ok(());
        }
        if self.reader == Some(presented) {
            return match access {
                Access::Read => Ok(()),
                Access::Write => Err(Status::permission_denied(
                    "this token may only read; PutBlocks and Delete need the engine's token",
                )),
            };
        }
        Err(Status::unauthenticated("the kvagent token is not valid"))
    }
}
