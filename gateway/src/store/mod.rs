//! Where state that replicas share lives: in this process (the default), or in Redis, so that
//! several replicas behind one load balancer see the same uploads, share encoder outputs and hold
//! per-key limits in sum.
//!
//! Each user of the store ([`crate::media::files`], [`crate::keylimits`], [`crate::media::feature_cache`]) has a
//! memory backend and a Redis backend of its own; this module holds what they share: the config,
//! the connection ([`Redis`]) and its error.

mod redis;

use std::time::Duration;

use http::StatusCode;
use serde::Deserialize;

use crate::error::ApiError;
pub use redis::Redis;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    /// Everything in this process; a restart forgets it, other replicas never see it.
    #[default]
    Memory,
    /// A Redis server (or anything speaking its protocol) that every replica reaches.
    Redis,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StoreConfig {
    pub kind: StoreKind,
    /// `redis://[user:password@]host:port[/db]`; needed with `kind = "redis"`.
    pub url: Option<String>,
    /// Prefixed to every key, so that several deployments can share one Redis.
    pub key_prefix: String,
    /// How long one command may take before the request that needed it gets a 503.
    pub timeout_ms: u64,
    /// How long connecting may take, at start and on each reconnection.
    pub connect_timeout_ms: u64,
    /// At start, how long to keep trying to reach Redis before giving up.
    pub startup_wait_seconds: u64,
    /// How long a shared encoder output is kept (0: encoder outputs are not shared).
    pub feature_ttl_seconds: u64,
    /// Encoder outputs larger than this are not shared.
    pub max_feature_entry_bytes: usize,
    /// How long a response stored by the Responses API (`store`) is kept for follow-ups.
    pub response_ttl_seconds: u64,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            kind: StoreKind::Memory,
            url: None,
            key_prefix: "mmgate:".to_owned(),
            timeout_ms: 1000,
            connect_timeout_ms: 1000,
            startup_wait_seconds: 30,
            feature_ttl_seconds: 3600,
            max_feature_entry_bytes: 64 << 20,
            response_ttl_seconds: 3600,
        }
    }
}

impl StoreConfig {
    pub fn validate(&self) -> anyhow::Result<()> {
        match (self.kind, &self.url) {
            (StoreKind::Redis, None) => anyhow::bail!("[store] kind = \"redis\" needs a url"),
            (StoreKind::Memory, Some(_)) => {
                anyhow::bail!("[store] has a url but kind = \"memory\": set kind = \"redis\"")
            }
            _ => {}
        }
        if self.timeout_ms == 0 || self.connect_timeout_ms == 0 {
            anyhow::bail!("[store] timeouts must be above 0");
        }
        Ok(())
    }

    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }
}

/// The shared store could not be reached (or did not answer in time).
#[derive(Debug, thiserror::Error)]
#[error("the shared store is unavailable: {0}")]
pub struct Unavailable(pub String);

impl From<Unavailable> for ApiError {
    fn from(e: Unavailable) -> Self {
        // The details (addresses) stay in the log.
        tracing::warn!(error = %e.0, "shared store");
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "store_unavailable",
            "the gateway's shared store is unavailable; retry shortly",
        )
    }
}

/// The owner of uploads and the subject of per-key limits: a short hash of the API key the
/// request authenticated with (keys themselves are never stored), or `public` on a gateway with no
/// keys.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Caller(String);

impl Caller {
    pub fn public() -> Caller {
        Caller("public".to_owned())
    }

    pub fn for_key(key: &str) -> Caller {
        use sha2::Digest;
        let digest = sha2::Sha256::digest(key.as_bytes());
        Caller(hex::encode(&digest[..12]))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn callers_are_stable_and_never_the_key() {
        let a = Caller::for_key("sk-secret");
        assert_eq!(a, Caller::for_key("sk-secret"));
        assert_ne!(a, Caller::for_key("sk-secreT"));
        assert!(!a.as_str().contains("secret"));
        assert_eq!(a.as_str().len(), 24);
    }

    #[test]
    fn a_redis_store_needs_a_url() {
        let mut config = StoreConfig {
            kind: StoreKind::Redis,
            ..StoreConfig::default()
        };
        assert!(config.validate().is_err());
        config.url = Some("redis://127.0.0.1:6379".into());
        assert!(config.validate().is_ok());
    }
}
