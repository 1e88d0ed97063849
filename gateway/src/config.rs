//! The gateway's TOML configuration, validated when it is loaded.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use mmgate_host::SandboxLimits;
use serde::Deserialize;

use crate::fetch::FetchConfig;
use crate::files::FilesConfig;

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
    /// Threads serving HTTP (default: one per core).
    pub http_threads: Option<usize>,
    /// Whether an idle HTTP thread takes requests queued on a busy one (the default). Off, each
    /// thread serves its own connections, as nginx workers do: cheaper per request (a proxy in
    /// front of fast upstreams gains ~10%), but a request that keeps its thread busy (a large body
    /// to parse) delays the others on that thread.
    pub http_work_stealing: bool,
    /// On SIGTERM, how long requests in flight get to finish before the gateway exits.
    pub shutdown_grace_seconds: u64,
    /// Limits of every plugin call.
    pub sandbox: SandboxLimits,
    /// The models served, by name. Absent: the demo models (`demo`, a Qwen2-VL-architecture model, and
    /// `demo-audio`, a Qwen2-Audio one); `models = []` serves none.
    #[serde(default = "demo_models")]
    pub models: Vec<ModelConfig>,
    /// Bearer tokens accepted on `/v1/*`; empty (the default) leaves the API open.
    pub api_keys: Vec<String>,
    /// What one request may carry.
    pub limits: RequestLimits,
    /// Fetching http(s) media URLs.
    pub fetch: FetchConfig,
    /// The `/v1/files` upload store.
    pub files: FilesConfig,
}

/// One served model: run natively from a model directory, or by a pool of upstream servers — with a
/// model directory too, media are encoded here and sent upstream as embeddings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The name clients send as `model`.
    pub name: String,
    /// A Hugging Face model directory, or `demo` / `demo-audio`: served by the native inference core.
    /// With `upstreams`, only its encoders, tokenizer and processor config are loaded: images are
    /// encoded here and sent to the upstreams as `image_embeds` (vLLM: `--enable-mm-embeds`).
    pub path: Option<PathBuf>,
    /// `host:port` of OpenAI-compatible servers (vLLM, SGLang, another mmgate) serving this model.
    #[serde(default)]
    pub upstreams: Vec<String>,
    #[serde(default)]
    pub balance: Balance,
    #[serde(default)]
    pub health_check: HealthCheck,
    /// Threads of the LLM's device (default: half the cores).
    pub llm_threads: Option<usize>,
    /// Dedicated encoder devices, each a thread pool of its own (default: one, half the cores).
    #[serde(default)]
    pub encoder_devices: Vec<EncoderDevice>,
    /// Sequences decoded together.
    #[serde(default = "default_max_running")]
    pub max_running: usize,
    /// Prompt tokens prefilled per engine step.
    #[serde(default = "default_prefill_chunk")]
    pub prefill_chunk: usize,
    /// Bytes of encoder outputs kept for reuse (identical media skip encoding).
    #[serde(default = "default_feature_cache_bytes")]
    pub feature_cache_bytes: usize,
    /// What happens to a request when one of its media items fails to encode: its encoder fails,
    /// or its plugin's tensors do not fit the model (corrupt media are the client's error either way).
    #[serde(default)]
    pub on_encode_error: EncodeErrorPolicy,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EncoderDevice {
    pub threads: usize,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EncodeErrorPolicy {
    /// The request fails (HTTP 500).
    #[default]
    Error,
    /// The item is dropped and the request goes on without it; the response says so.
    Drop,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Balance {
    #[default]
    RoundRobin,
    /// Requests with the same `user` (else the same body) go to the same upstream while it is healthy.
    ConsistentHash,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HealthCheck {
    /// `GET` this path; a 2xx answer is healthy. Empty: a TCP connect is the check.
    pub path: String,
    pub interval_ms: u64,
    /// Consecutive results before an upstream changes state.
    pub failures: usize,
    pub successes: usize,
}

impl Default for HealthCheck {
    fn default() -> Self {
        HealthCheck {
            path: "/health".into(),
            interval_ms: 1000,
            failures: 1,
            successes: 1,
        }
    }
}

/// Item counts and sizes, checked before anything is decoded or fetched. Defaults like OpenAI's.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RequestLimits {
    /// The whole request body.
    pub max_body_bytes: usize,
    pub max_media_items: usize,
    pub max_image_bytes: usize,
    /// All images of one request together.
    pub max_total_image_bytes: usize,
    pub max_audio_bytes: usize,
    pub max_video_bytes: usize,
}

impl Default for RequestLimits {
    fn default() -> Self {
        RequestLimits {
            max_body_bytes: 128 << 20,
            max_media_items: 32,
            max_image_bytes: 20_000_000,
            max_total_image_bytes: 50_000_000,
            max_audio_bytes: 25_000_000,
            max_video_bytes: 64_000_000,
        }
    }
}

fn default_max_running() -> usize {
    16
}

fn default_prefill_chunk() -> usize {
    512
}

fn default_feature_cache_bytes() -> usize {
    256 << 20
}

fn demo_models() -> Vec<ModelConfig> {
    ["demo", "demo-audio"]
        .into_iter()
        .map(|name| ModelConfig::native(name, Path::new(name)))
        .collect()
}

impl ModelConfig {
    /// A natively served model with default engine settings.
    pub fn native(name: &str, path: &Path) -> ModelConfig {
        ModelConfig {
            name: name.to_owned(),
            path: Some(path.to_owned()),
            upstreams: Vec::new(),
            balance: Balance::default(),
            health_check: HealthCheck::default(),
            llm_threads: None,
            encoder_devices: Vec::new(),
            max_running: default_max_running(),
            prefill_chunk: default_prefill_chunk(),
            feature_cache_bytes: default_feature_cache_bytes(),
            on_encode_error: EncodeErrorPolicy::default(),
        }
    }

    fn validate(&self) -> anyhow::Result<()> {
        let name = &self.name;
        if name.is_empty() {
            bail!("a model has an empty name");
        }
        if self.path.is_none() && self.upstreams.is_empty() {
            bail!("model {name:?}: give a path (served here) or upstreams");
        }
        for upstream in &self.upstreams {
            if upstream.parse::<SocketAddr>().is_err()
                && upstream
                    .rsplit_once(':')
                    .is_none_or(|(_, p)| p.parse::<u16>().is_err())
            {
                bail!("model {name:?}: upstream {upstream:?} is not host:port");
            }
        }
        if self.llm_threads == Some(0) || self.encoder_devices.iter().any(|d| d.threads == 0) {
            bail!("model {name:?}: a device needs at least one thread");
        }
        if self.max_running == 0 || self.prefill_chunk == 0 {
            bail!("model {name:?}: max_running and prefill_chunk must be positive");
        }
        if self.health_check.interval_ms == 0 {
            bail!("model {name:?}: health_check.interval_ms must be positive");
        }
        Ok(())
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: DEFAULT_LISTEN
                .parse()
                .unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 8080))),
            plugin_dir: None,
            http_threads: None,
            http_work_stealing: true,
            shutdown_grace_seconds: 5,
            sandbox: SandboxLimits::default(),
            models: demo_models(),
            api_keys: Vec::new(),
            limits: RequestLimits::default(),
            fetch: FetchConfig::default(),
            files: FilesConfig::default(),
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
        if let Some(base) = path.parent() {
            if let Some(dir) = &config.plugin_dir
                && dir.is_relative()
            {
                config.plugin_dir = Some(base.join(dir));
            }
            // So are model directories (the demo names are not paths).
            for model in &mut config.models {
                if let Some(dir) = &model.path
                    && dir.is_relative()
                    && !crate::model::is_demo_model(dir)
                {
                    model.path = Some(base.join(dir));
                }
            }
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
        if self.http_threads == Some(0) {
            bail!("http_threads must be positive");
        }
        if s.max_instances == 0 {
            bail!("sandbox.max_instances must be positive");
        }
        if let Some(dir) = &self.plugin_dir
            && !dir.is_dir()
        {
            bail!("plugin_dir {} is not a directory", dir.display());
        }
        let mut names = std::collections::HashSet::new();
        for model in &self.models {
            model.validate()?;
            if !names.insert(&model.name) {
                bail!("model {:?} is configured twice", model.name);
            }
        }
        if self.api_keys.iter().any(String::is_empty) {
            bail!("api_keys holds an empty key");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> anyhow::Result<Config> {
        let config: Config = toml::from_str(text)?;
        config.validate()?;
        Ok(config)
    }

    #[test]
    fn the_example_config_is_valid_and_matches_the_defaults() {
        let example = include_str!("../../examples/mmgate.toml");
        let config = parse(example).unwrap_or_else(|e| panic!("{e:#}"));
        let names: Vec<_> = config.models.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["demo", "demo-audio"]);
        let default = Config::default();
        assert_eq!(
            config.limits.max_image_bytes,
            default.limits.max_image_bytes
        );
        assert_eq!(config.models.len(), default.models.len());
    }

    #[test]
    fn invalid_configs_say_what_is_wrong() {
        for (text, expected) in [
            ("[[models]]\nname = \"m\"\n", "give a path"),
            (
                "[[models]]\nname = \"m\"\nupstreams = [\"nope\"]\n",
                "not host:port",
            ),
            (
                "[[models]]\nname = \"m\"\npath = \"demo\"\n[[models]]\nname = \"m\"\npath = \"demo\"\n",
                "configured twice",
            ),
            ("api_keys = [\"\"]\n", "empty key"),
            ("[limits]\nmax_image_byte = 5\n", "unknown field"),
            ("[fetch]\nallow = [\"not a network\"]\n", "invalid"),
        ] {
            let error = parse(text)
                .err()
                .map(|e| format!("{e:#}"))
                .unwrap_or_default();
            assert!(error.contains(expected), "{text:?}: {error}");
        }
    }

    #[test]
    fn without_a_models_key_the_demo_models_are_served_and_an_empty_list_serves_none() {
        let names = |text: &str| -> Vec<String> {
            parse(text)
                .map(|c| c.models.into_iter().map(|m| m.name).collect())
                .unwrap_or_default()
        };
        assert_eq!(
            names("listen = \"127.0.0.1:9000\"\n"),
            ["demo", "demo-audio"]
        );
        assert!(names("models = []\n").is_empty());
    }
}
