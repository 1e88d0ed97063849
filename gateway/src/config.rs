//! The gateway's TOML configuration, validated when it is loaded.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use mmgate_host::SandboxLimits;
use mmgate_inference::devices::DeviceName;
use serde::Deserialize;

use crate::keylimits::KeyLimitsConfig;
pub use crate::media::documents::DocumentsConfig;
use crate::media::fetch::FetchConfig;
use crate::media::files::FilesConfig;
pub use crate::media::plugins::{PluginsConfig, cores};
use crate::store::StoreConfig;

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
    /// front of fast upstreams gains throughput; `bench/proxy.py`), but a request that keeps its
    /// thread busy (a large body to parse) delays the others on that thread.
    pub http_work_stealing: bool,
    /// On SIGTERM, how long requests in flight get to finish before the gateway exits.
    pub shutdown_grace_seconds: u64,
    /// On SIGTERM, how long the gateway goes on accepting requests while `/ready` answers 503,
    /// before it stops accepting: the time a load balancer (Kubernetes' endpoints) needs to notice.
    pub drain_seconds: u64,
    /// How log lines are written (`text` or `json`); `--log-format` overrides it.
    pub log_format: crate::logging::LogFormat,
    /// The threads plugin calls run on, and where compiled plugins are kept.
    pub plugins: PluginsConfig,
    /// Limits of every plugin call.
    pub sandbox: SandboxLimits,
    /// The models served, by name. Absent: the demo models (`demo`, a Qwen2-VL-architecture model, and
    /// `demo-audio`, a Qwen2-Audio one); `models = []` serves none.
    #[serde(default = "demo_models")]
    pub models: Vec<ModelConfig>,
    /// Bearer tokens accepted on `/v1/*`; empty (the default) leaves the API open.
    pub api_keys: Vec<String>,
    /// Networks of proxies in front of this gateway (a load balancer) whose `X-Forwarded-For`,
    /// `X-Forwarded-Proto` and `Forwarded` headers are kept, this hop appended; from anyone else
    /// they are replaced by the connection's own address.
    pub trusted_proxies: Vec<ipnet::IpNet>,
    /// Serve HTTPS on `listen` with this certificate and key (PEM files, relative to the config
    /// file); absent, plain HTTP.
    pub tls: Option<TlsConfig>,
    /// What one request may carry.
    pub limits: RequestLimits,
    /// How documents (PDFs) become the pages a model sees.
    pub documents: DocumentsConfig,
    /// How many client connections, and how long a client may take to send and to receive.
    pub connections: ConnectionsConfig,
    /// Fetching http(s) media URLs.
    pub fetch: FetchConfig,
    /// The `/v1/files` upload store.
    pub files: FilesConfig,
    /// Requests per minute and in flight, per API key (held across replicas with a Redis store).
    pub key_limits: KeyLimitsConfig,
    /// Where state shared by replicas lives (uploads, per-key limits): this process (the default)
    /// or Redis.
    pub store: StoreConfig,
}

/// One served model: run natively from a model directory, or by a pool of upstream servers, whose
/// media reach them as `media` says.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The name clients send as `model`.
    pub name: String,
    /// A Hugging Face model directory, or `demo` / `demo-audio`: served by the native inference core.
    /// With `upstreams`, what `media` needs of it: the tokenizer, chat template and processor config
    /// (`preprocess`, no weights needed), the encoders too (`embed`).
    pub path: Option<PathBuf>,
    /// With `upstreams`: how a request's media reach them. `forward` (the default without a
    /// `path`): as they came, URLs and uploads inlined as data URLs. `preprocess`: planned here
    /// under the request-wide budget and sent as planned (images at their planned size, a video's
    /// chosen frames, audio cut and resampled). `embed` (the default with a `path`): images encoded
    /// here and sent as `image_embeds`. `ec`: encoded here and written to `ec_storage`, which vLLM
    /// reads through its EC connector; the request carries only each item's grid and identifier.
    pub media: Option<MediaMode>,
    /// With `media = "ec"`: the directory vLLM's `ECExampleConnector` reads (its
    /// `shared_storage_path`), on a memory-backed volume both processes see.
    pub ec_storage: Option<PathBuf>,
    /// With `media = "ec"`: the most bytes of encoder outputs kept in `ec_storage`; items of
    /// requests in flight stay, the rest go least recently used first.
    #[serde(default = "default_ec_storage_bytes")]
    pub ec_storage_bytes: u64,
    /// With `media = "ec"`: the dtype vLLM runs the model in (its `--dtype`), which the files are
    /// written in; the checkpoint's `torch_dtype` when left out.
    pub ec_dtype: Option<EcDtype>,
    /// OpenAI-compatible servers (vLLM, SGLang, another mmgate) serving this model:
    /// `host:port` or `http://host:port` (plain HTTP), `https://host[:port]` (TLS, the host name
    /// checked against the server's certificate). Host names are resolved at start.
    #[serde(default)]
    pub upstreams: Vec<UpstreamAddr>,
    /// The name the upstreams serve the model by, when it is not `name` (vLLM's
    /// `--served-model-name`): requests go upstream with it as their `model`. Lets one upstream
    /// model be offered under several names (say, one per `media` mode).
    pub upstream_model: Option<String>,
    /// Sent to the upstreams as `Authorization: Bearer <key>`. Without it the client's own
    /// `Authorization` goes through, unless this gateway checked it (`api_keys`): a key for this
    /// gateway is never passed on.
    pub upstream_api_key: Option<String>,
    /// PEM certificates trusted for `https://` upstreams instead of the system's roots (a private
    /// CA). Relative to the config file.
    pub upstream_ca_file: Option<PathBuf>,
    #[serde(default)]
    pub balance: Balance,
    #[serde(default)]
    pub health_check: HealthCheck,
    /// How long an upstream may take to begin its answer, and then to send each next piece of it,
    /// before the request fails: 504 `upstream_timeout` before the answer began, an error event
    /// ending a stream after. Generous by default: a non-streamed completion's answer begins only
    /// when it is generated.
    #[serde(default = "default_upstream_timeout_ms")]
    pub upstream_timeout_ms: u64,
    /// With `media = "preprocess"`: the settings the upstreams' processor runs with beside the
    /// checkpoint's processor config, as vLLM's `--mm-processor-kwargs` (say
    /// `{ do_pan_and_scan = true }` for Gemma 3): the plans made here must count what it makes.
    #[serde(default)]
    pub processor_kwargs: serde_json::Map<String, serde_json::Value>,
    /// The context served, when below the checkpoint's (`max_position_embeddings`): as vLLM's
    /// `--max-model-len`, every token budget uses it.
    pub max_model_len: Option<usize>,
    /// Threads of the LLM's device (default: as many as the machine has cores), when it is the CPU.
    pub llm_threads: Option<usize>,
    /// The LLM's device: `"cpu"` (default) or `"cuda:N"`.
    pub llm_device: Option<DeviceName>,
    /// With a bf16 checkpoint on CPU devices that have AVX-512 BF16: its linears and attention
    /// round their inputs to bf16, as the CUDA backend's linears and bf16 engines do, for kernels
    /// about twice as fast; off (the default), activations stay f32 throughout.
    #[serde(default)]
    pub cpu_bf16_inputs: bool,
    /// Dedicated encoder devices, each a thread pool of its own (default: one, half the cores; the
    /// LLM's threads share them while the encoder is idle).
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
    /// Whether clients may send `image_embeds` parts (embeddings made elsewhere, merged with no
    /// vision encoder) for this model. Off by default, as vLLM's `--enable-mm-embeds` is: such
    /// vectors steer the model past what any image could; turn it on for a trusted front (another
    /// mmgate encoding images for this one).
    #[serde(default)]
    pub accept_image_embeds: bool,
    /// Whether items go to the encoders in their plugin's parts (contract 0.4: a long video in runs
    /// of frames made on several cores at once, each encoded and prefilled as it is ready) or
    /// whole, one plugin call each. On by default; the output is the same either way.
    #[serde(default = "default_media_parts")]
    pub media_parts: bool,
}

fn default_media_parts() -> bool {
    true
}

fn default_ec_storage_bytes() -> u64 {
    8 << 30
}

/// The dtype of the encoder outputs written for vLLM's EC connector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EcDtype {
    #[serde(alias = "bf16")]
    Bfloat16,
    #[serde(alias = "fp16", alias = "half")]
    Float16,
    #[serde(alias = "fp32", alias = "float")]
    Float32,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// The certificate chain, leaf first.
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// One upstream server as configured: its scheme, host and port.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub struct UpstreamAddr {
    /// `https://`: the connection is TLS.
    pub tls: bool,
    /// A host name (the TLS server name and the `Host` header) or an IP address.
    pub host: String,
    pub port: u16,
}

impl UpstreamAddr {
    /// `host:port` as the `Host` header carries it (IPv6 in brackets).
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

impl std::fmt::Display for UpstreamAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let scheme = if self.tls { "https" } else { "http" };
        write!(f, "{scheme}://{}", self.authority())
    }
}

impl TryFrom<String> for UpstreamAddr {
    type Error = String;

    fn try_from(text: String) -> Result<Self, String> {
        let bad = |why: &str| format!("upstream {text:?} {why}");
        let (tls, rest) = if let Some(rest) = text.strip_prefix("https://") {
            (true, rest)
        } else if let Some(rest) = text.strip_prefix("http://") {
            (false, rest)
        } else if text.contains("://") {
            return Err(bad("has a scheme other than http:// or https://"));
        } else {
            (false, text.as_str())
        };
        // The server is all there is: requests keep the client's path.
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        if rest.contains(['/', '?', '#', '@']) {
            return Err(bad("has more than a host and a port"));
        }
        let (host, port) = if let Some(v6) = rest.strip_prefix('[') {
            let (host, after) = v6
                .split_once(']')
                .ok_or_else(|| bad("opens an IPv6 bracket it does not close"))?;
            (host, after.strip_prefix(':'))
        } else {
            match rest.rsplit_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (rest, None),
            }
        };
        let port = match port {
            Some(port) => port
                .parse::<u16>()
                .ok()
                .filter(|&p| p != 0)
                .ok_or_else(|| bad("has no valid port"))?,
            // A bare host:port form needs its port; a URL defaults to its scheme's.
            None if !text.contains("://") => return Err(bad("is not host:port")),
            None if tls => 443,
            None => 80,
        };
        if host.is_empty() || host.contains(char::is_whitespace) {
            return Err(bad("has no host"));
        }
        Ok(UpstreamAddr {
            tls,
            host: host.to_owned(),
            port,
        })
    }
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EncoderDevice {
    /// `"cpu"` (the default: a thread pool of its own, `threads` wide) or `"cuda:N"` (GPU N).
    #[serde(default = "cpu_device")]
    pub device: DeviceName,
    /// Threads of a CPU device (required for one; a GPU takes none).
    pub threads: Option<usize>,
}

fn cpu_device() -> DeviceName {
    DeviceName::Cpu
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

/// What an upstream model's servers get of a request's media (see [`ModelConfig::media`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MediaMode {
    Forward,
    Preprocess,
    Embed,
    Ec,
}

impl MediaMode {
    pub fn name(self) -> &'static str {
        match self {
            Self::Forward => "forward",
            Self::Preprocess => "preprocess",
            Self::Embed => "embed",
            Self::Ec => "ec",
        }
    }
}

impl ModelConfig {
    /// How this upstream model's media go (`None` for a natively served model).
    pub fn media_mode(&self) -> Option<MediaMode> {
        if self.upstreams.is_empty() {
            return None;
        }
        Some(self.media.unwrap_or(if self.path.is_some() {
            MediaMode::Embed
        } else {
            MediaMode::Forward
        }))
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Balance {
    #[default]
    RoundRobin,
    /// Requests with the same `user` (else the same body) go to the same upstream while it is healthy.
    ConsistentHash,
    /// Requests carrying media go by the content of their media: the same image reaches the same
    /// upstream while it is healthy, whose processor and encoder caches then hit (as llm-d's
    /// encoder-cache affinity). Requests without media go as `consistent_hash` sends them.
    MediaHash,
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
    /// The text of all messages together (UTF-8 bytes): a request's text is held, templated and
    /// tokenized several times over, so its size bounds what one request costs in memory.
    pub max_text_bytes: usize,
    /// Chat's messages (the Responses API's input items, earlier turns included).
    pub max_messages: usize,
    /// Content parts of all messages together: each costs memory when the request is parsed,
    /// however small it is on the wire.
    pub max_content_parts: usize,
    /// One document (PDF) file.
    pub max_document_bytes: usize,
    /// Pages of one request's documents together, checked before any is rendered (each page is
    /// an image to render and encode).
    pub max_document_pages: usize,
}

impl RequestLimits {
    /// The counts checked while a body is read, before it is parsed.
    pub fn shape(&self) -> crate::wire::openai::shape::ShapeLimits {
        crate::wire::openai::shape::ShapeLimits {
            max_messages: self.max_messages,
            max_content_parts: self.max_content_parts,
        }
    }
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
            max_text_bytes: 8 << 20,
            max_messages: 4096,
            max_content_parts: 16384,
            max_document_bytes: 32_000_000,
            max_document_pages: 100,
        }
    }
}

/// Client connections: how many at once, and the clock each runs on. Clients that hold a
/// connection without using it (slowloris: a head sent a byte at a time; a client that reads none
/// of its answer) are cut off instead of holding memory and a slot for ever.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConnectionsConfig {
    /// Client connections open at once; one more is answered 503 `server_busy` and closed.
    pub max: usize,
    /// How long a request's head may take to arrive, from a new connection's start or a kept-alive
    /// one's first byte of it (408 `request_timeout`, as nginx's `client_header_timeout`).
    pub head_timeout_ms: u64,
    /// How long a kept-alive connection may wait for its next request, and a request body for
    /// each next piece.
    pub idle_timeout_ms: u64,
    /// How long a client may take none of its answer before the connection is dropped (and its
    /// generation cancelled), as nginx's `send_timeout`.
    pub send_timeout_ms: u64,
}

impl Default for ConnectionsConfig {
    fn default() -> Self {
        ConnectionsConfig {
            max: 4096,
            head_timeout_ms: 30_000,
            idle_timeout_ms: 60_000,
            send_timeout_ms: 60_000,
        }
    }
}

impl ConnectionsConfig {
    fn validate(&self) -> anyhow::Result<()> {
        if self.max == 0
            || self.head_timeout_ms == 0
            || self.idle_timeout_ms == 0
            || self.send_timeout_ms == 0
        {
            bail!("connections: max and the timeouts must be positive");
        }
        Ok(())
    }

    pub fn head_timeout(&self) -> Duration {
        Duration::from_millis(self.head_timeout_ms)
    }

    pub fn idle_timeout(&self) -> Duration {
        Duration::from_millis(self.idle_timeout_ms)
    }

    pub fn send_timeout(&self) -> Duration {
        Duration::from_millis(self.send_timeout_ms)
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

fn default_upstream_timeout_ms() -> u64 {
    600_000
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
            media: None,
            upstreams: Vec::new(),
            upstream_model: None,
            upstream_api_key: None,
            upstream_ca_file: None,
            balance: Balance::default(),
            health_check: HealthCheck::default(),
            upstream_timeout_ms: default_upstream_timeout_ms(),
            max_model_len: None,
            processor_kwargs: serde_json::Map::new(),
            llm_threads: None,
            llm_device: None,
            cpu_bf16_inputs: false,
            encoder_devices: Vec::new(),
            max_running: default_max_running(),
            prefill_chunk: default_prefill_chunk(),
            feature_cache_bytes: default_feature_cache_bytes(),
            on_encode_error: EncodeErrorPolicy::default(),
            accept_image_embeds: false,
            media_parts: true,
            ec_storage: None,
            ec_storage_bytes: default_ec_storage_bytes(),
            ec_dtype: None,
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
        match (self.media, self.upstreams.is_empty(), self.path.is_some()) {
            (Some(mode), true, _) => bail!(
                "model {name:?}: media = {:?} is for a model served by upstreams; this one is served here",
                mode.name()
            ),
            (
                Some(mode @ (MediaMode::Preprocess | MediaMode::Embed | MediaMode::Ec)),
                false,
                false,
            ) => bail!(
                "model {name:?}: media = {:?} needs a path: a model directory with the tokenizer, \
                 chat template and processor config{}",
                mode.name(),
                if mode != MediaMode::Preprocess {
                    " and the encoder's weights"
                } else {
                    " (no weights needed)"
                }
            ),
            (Some(MediaMode::Forward), false, true) => {
                bail!("model {name:?}: media = \"forward\" uses no model directory: drop the path")
            }
            _ => {}
        }
        match (self.media_mode() == Some(MediaMode::Ec), &self.ec_storage) {
            (true, None) => bail!(
                "model {name:?}: media = \"ec\" needs ec_storage: the directory vLLM's EC \
                 connector reads (its shared_storage_path)"
            ),
            (false, Some(_)) => {
                bail!("model {name:?}: ec_storage is for media = \"ec\"")
            }
            _ => {}
        }
        if self.upstream_api_key.as_ref().is_some_and(|key| {
            key.is_empty() || key.bytes().any(|b| b.is_ascii_control() || b == b' ')
        }) {
            bail!("model {name:?}: upstream_api_key must be a non-empty token without spaces");
        }
        if let Some(ca) = &self.upstream_ca_file {
            crate::tls_files::check_ca_file(ca)
                .with_context(|| format!("model {name:?}: upstream_ca_file"))?;
        }
        if self.llm_threads == Some(0) || self.encoder_devices.iter().any(|d| d.threads == Some(0))
        {
            bail!("model {name:?}: a device needs at least one thread");
        }
        for d in &self.encoder_devices {
            match (d.device, d.threads) {
                (DeviceName::Cpu, None) => {
                    bail!("model {name:?}: a cpu encoder device needs `threads`")
                }
                (DeviceName::Cuda(n), Some(_)) => {
                    bail!(
                        "model {name:?}: encoder device cuda:{n}: threads apply to cpu devices only"
                    )
                }
                _ => {}
            }
        }
        if let (Some(DeviceName::Cuda(n)), Some(_)) = (self.llm_device, self.llm_threads) {
            bail!("model {name:?}: llm_device cuda:{n}: llm_threads applies to a cpu LLM only");
        }
        if !self.processor_kwargs.is_empty() && self.media_mode() != Some(MediaMode::Preprocess) {
            bail!(
                "model {name:?}: processor_kwargs describe an upstream's processor: they apply \
                 with media = \"preprocess\" only"
            );
        }
        if self.max_model_len == Some(0) {
            bail!("model {name:?}: max_model_len must be positive");
        }
        if self.max_running == 0 || self.prefill_chunk == 0 {
            bail!("model {name:?}: max_running and prefill_chunk must be positive");
        }
        if self.upstream_timeout_ms == 0 {
            bail!("model {name:?}: upstream_timeout_ms must be positive");
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
            drain_seconds: 0,
            log_format: crate::logging::LogFormat::default(),
            plugins: PluginsConfig::default(),
            sandbox: SandboxLimits::default(),
            models: demo_models(),
            api_keys: Vec::new(),
            trusted_proxies: Vec::new(),
            tls: None,
            limits: RequestLimits::default(),
            documents: DocumentsConfig::default(),
            connections: ConnectionsConfig::default(),
            fetch: FetchConfig::default(),
            files: FilesConfig::default(),
            key_limits: KeyLimitsConfig::default(),
            store: StoreConfig::default(),
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
            if let Some(dir) = &mut config.plugins.compile_cache_dir {
                *dir = base.join(&*dir);
            }
            if let Some(tls) = &mut config.tls {
                tls.cert = base.join(&tls.cert);
                tls.key = base.join(&tls.key);
            }
            // So are model directories (the demo names are not paths) and CA files.
            for model in &mut config.models {
                if let Some(ca) = &mut model.upstream_ca_file {
                    *ca = base.join(&*ca);
                }
                if let Some(dir) = &model.path
                    && dir.is_relative()
                    && !dir
                        .to_str()
                        .is_some_and(mmgate_inference::demo::is_served_name)
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
        self.plugins.validate(s)?;
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
        self.store.validate()?;
        self.key_limits.validate()?;
        self.documents.validate()?;
        self.connections.validate()?;
        if let Some(tls) = &self.tls {
            crate::tls_files::check_server_files(&tls.cert, &tls.key).context("tls")?;
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

    /// The `mmgate.toml` a Kubernetes manifest's config map holds, parsed and checked.
    fn config_map(manifest: &str) -> Config {
        let (_, embedded) = manifest
            .split_once("mmgate.toml: |\n")
            .unwrap_or_else(|| panic!("the manifest has no mmgate.toml"));
        let toml: String = embedded
            .lines()
            .take_while(|l| *l != "---")
            .map(|l| l.strip_prefix("    ").unwrap_or(l))
            .map(|l| format!("{l}\n"))
            .collect();
        parse(&toml).unwrap_or_else(|e| panic!("{e:#}"))
    }

    #[test]
    fn the_epd_manifest_holds_a_valid_ec_config() {
        let config = config_map(include_str!("../../deploy/epd/epd.yaml"));
        assert_eq!(config.models[0].media_mode(), Some(MediaMode::Ec));
    }

    #[test]
    fn the_kubernetes_config_map_holds_a_valid_replica_config_and_kustomize_lists_every_manifest() {
        let config = config_map(include_str!("../../deploy/kubernetes/configmap.yaml"));
        assert_eq!(config.store.kind, crate::store::StoreKind::Redis);
        assert!(config.drain_seconds > 0);

        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes");
        let listed = std::fs::read_to_string(dir.join("kustomization.yaml")).unwrap_or_default();
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.ends_with(".yaml") && name != "kustomization.yaml" {
                assert!(
                    listed.contains(&format!("- {name}")),
                    "kustomization.yaml misses {name}"
                );
            }
        }
    }

    #[test]
    fn devices_are_cpu_pools_or_gpus_and_threads_go_only_with_cpus() {
        let model = |devices: &str| {
            parse(&format!(
                "[[models]]\nname = \"m\"\npath = \"demo\"\n{devices}\n"
            ))
        };
        let config = model(
            "llm_device = \"cuda:0\"\nencoder_devices = [{ threads = 2 }, { device = \"cuda:1\" }]",
        )
        .unwrap();
        let m = &config.models[0];
        assert_eq!(m.llm_device, Some(DeviceName::Cuda(0)));
        assert_eq!(m.encoder_devices[0].device, DeviceName::Cpu);
        assert_eq!(m.encoder_devices[0].threads, Some(2));
        assert_eq!(m.encoder_devices[1].device, DeviceName::Cuda(1));
        for bad in [
            "encoder_devices = [{ device = \"cpu\" }]",
            "encoder_devices = [{ device = \"cuda:1\", threads = 2 }]",
            "encoder_devices = [{ threads = 0 }]",
            "encoder_devices = [{ device = \"tpu:0\" }]",
            "llm_device = \"cuda:0\"\nllm_threads = 2",
            "llm_device = \"cuda\"",
        ] {
            assert!(model(bad).is_err(), "{bad}");
        }
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
        assert_eq!(
            config.limits.max_document_pages,
            default.limits.max_document_pages
        );
        assert_eq!(config.documents, default.documents);
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
                "[[models]]\nname = \"m\"\nupstreams = [\"ftp://h:1\"]\n",
                "scheme other than",
            ),
            (
                "[[models]]\nname = \"m\"\nupstreams = [\"https://h/v1\"]\n",
                "more than a host and a port",
            ),
            (
                "[[models]]\nname = \"m\"\nupstreams = [\"h:1\"]\nupstream_ca_file = \"/nonexistent/ca.pem\"\n",
                "upstream_ca_file",
            ),
            (
                "[[models]]\nname = \"m\"\nupstreams = [\"h:1\"]\nupstream_api_key = \"a b\"\n",
                "upstream_api_key",
            ),
            (
                "[[models]]\nname = \"m\"\nupstreams = [\"h:1\"]\npath = \"demo\"\nmedia = \"ec\"\n",
                "needs ec_storage",
            ),
            (
                "[[models]]\nname = \"m\"\nupstreams = [\"h:1\"]\npath = \"demo\"\nec_storage = \"/ec\"\n",
                "ec_storage is for media = \"ec\"",
            ),
            (
                "[[models]]\nname = \"m\"\nupstreams = [\"h:1\"]\nmedia = \"ec\"\nec_storage = \"/ec\"\n",
                "needs a path",
            ),
            (
                "[tls]\ncert = \"/nonexistent/cert.pem\"\nkey = \"/nonexistent/key.pem\"\n",
                "tls",
            ),
            (
                "[[models]]\nname = \"m\"\npath = \"demo\"\n[[models]]\nname = \"m\"\npath = \"demo\"\n",
                "configured twice",
            ),
            (
                "[[models]]\nname = \"m\"\npath = \"demo\"\nmedia = \"preprocess\"\n",
                "served by upstreams",
            ),
            (
                "[[models]]\nname = \"m\"\nupstreams = [\"h:1\"]\nmedia = \"preprocess\"\n",
                "needs a path",
            ),
            (
                "[[models]]\nname = \"m\"\nupstreams = [\"h:1\"]\npath = \"demo\"\nmedia = \"forward\"\n",
                "drop the path",
            ),
            (
                "[[models]]\nname = \"m\"\nupstreams = [\"h:1\"]\nmedia = \"tensors\"\n",
                "unknown variant",
            ),
            ("api_keys = [\"\"]\n", "empty key"),
            ("[limits]\nmax_image_byte = 5\n", "unknown field"),
            ("[documents]\nscale = 0\n", "documents.scale"),
            ("[documents]\nmin_long_side = 4000\n", "min_long_side"),
            ("[documents]\noverflow = \"middle\"\n", "unknown variant"),
            ("[fetch]\nallow = [\"not a network\"]\n", "invalid"),
            (
                "[plugins]\nthreads = 0\n",
                "plugins.threads must be positive",
            ),
            ("[plugins]\nqueue = 0\n", "plugins.queue must be positive"),
            ("[plugins]\nnice = 20\n", "plugins.nice must be 0 to 19"),
            ("[plugins]\nnice = -1\n", "invalid value"),
            (
                "[plugins]\nthreads = 8\n[sandbox]\nmax_instances = 4\n",
                "more than sandbox.max_instances",
            ),
            ("[plugins]\nthread = 2\n", "unknown field"),
        ] {
            let error = parse(text)
                .err()
                .map(|e| format!("{e:#}"))
                .unwrap_or_default();
            assert!(error.contains(expected), "{text:?}: {error}");
        }
    }

    #[test]
    fn upstreams_are_host_port_or_http_and_https_urls() {
        let parse = |text: &str| UpstreamAddr::try_from(text.to_owned());
        let addr = |tls, host: &str, port| UpstreamAddr {
            tls,
            host: host.into(),
            port,
        };
        assert_eq!(parse("10.0.0.1:8000"), Ok(addr(false, "10.0.0.1", 8000)));
        assert_eq!(parse("vllm:8000"), Ok(addr(false, "vllm", 8000)));
        assert_eq!(parse("http://vllm"), Ok(addr(false, "vllm", 80)));
        assert_eq!(
            parse("https://api.example.com/"),
            Ok(addr(true, "api.example.com", 443))
        );
        assert_eq!(parse("https://[::1]:8443"), Ok(addr(true, "::1", 8443)));
        assert_eq!(
            parse("[::1]:8000").map(|a| a.authority()),
            Ok("[::1]:8000".into())
        );
        assert_eq!(
            parse("https://h:8443").map(|a| a.to_string()),
            Ok("https://h:8443".into())
        );
        for bad in [
            "vllm",
            "h:0",
            "h:99999",
            "https://",
            "https://:443",
            "http://u@h:1",
            "[::1",
        ] {
            assert!(parse(bad).is_err(), "{bad:?} was taken");
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
