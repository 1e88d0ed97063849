//! The gateway's TOML configuration, validated when it is loaded.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use mmgate_host::SandboxLimits;
use serde::Deserialize;

/// Default listen address: local only, so a first `mmgate serve` exposes nothing.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Address the HTTP API listens on.
    pub listen: SocketAddr,
    /// A directory of extra plugins (`*.toml` manifests beside their `.wasm` components); they add to
    /// the built-ins or replace a built-in of the same name.
    pub plugin_dir: Option<PathBuf>,
    /// On SIGTERM, how long requests in flight get to finish before the gateway exits.
    pub shutdown_grace_seconds: u64,
    /// Limits of every plugin call.
    pub sandbox: SandboxLimits,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: DEFAULT_LISTEN
                .parse()
                .unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 8080))),
            plugin_dir: None,
            shutdown_grace_seconds: 5,
            sandbox: SandboxLimits::default(),
        }
    }
}

impl Config {
    pub fn load(path: &Path) -> anyhow::Result<Config> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read config {}", path.display()))?;
        let mut config: Config =
            toml::from_str(&text).with_context(|| format!("config {}", path.display()))?;
        // A relative plugin directory is relative to the config file, not to wherever mmgate started.
        if let (Some(dir), Some(base)) = (&config.plugin_dir, path.parent())
            && dir.is_relative()
        {
            config.plugin_dir = Some(base.join(dir));
        }
        config
            .validate()
            .with_context(|| format!("config {}", path.display()))?;
        Ok(config)
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        let s = &self.sandbox;
        if s.memory_bytes < (1 << 20) {
            bail!(
                "sandbox.memory_bytes must be at least 1 MiB (is {})",
                s.memory_bytes
            );
        }
        if s.deadline_ms == 0 {
            bail!("sandbox.deadline_ms must be positive");
        }
        if s.max_instances == 0 {
            bail!("sandbox.max_instances must be positive");
        }
        if let Some(dir) = &self.plugin_dir
            && !dir.is_dir()
        {
            bail!("plugin_dir {} is not a directory", dir.display());
        }
        Ok(())
    }
}
