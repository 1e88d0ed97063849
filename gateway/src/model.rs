//! A model whose files this gateway holds ([`LocalModel`]): its directory (a real HF checkpoint or
//! a generated demo), its prompts (read by the inference core's [`PromptModel`]), and the native
//! inference core running it where it does (encoder devices, engine).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, anyhow};
use mmgate_inference::demo;
use mmgate_inference::devices::{OpenDevice, Placement as DevicePlacement};
use mmgate_inference::engine::{
    BatchObserver, DeviceSpec, EncoderPool, Engine, EngineConfig, FeatureStore, SharedFeatures,
};
use mmgate_inference::families::{self, LoadedModel};
use mmgate_inference::prompt::PromptModel;

use crate::config::EncodeErrorPolicy;
use crate::media::feature_cache::SharedCache;
use crate::media::pipeline;

/// A model whose files this gateway holds, and how it serves it: its prompt side always (what
/// plans its requests), its encoders and LLM where it runs them (native serving, or `media =
/// "embed"` / `"ec"` in front of an engine).
pub struct LocalModel {
    pub runtime: ModelRuntime,
    pub on_encode_error: EncodeErrorPolicy,
    /// Whether clients may send `image_embeds` parts.
    pub accept_image_embeds: bool,
    /// Whether items are made in their plugin's parts (see the config's `media_parts`).
    pub media_parts: bool,
}

impl LocalModel {
    /// How this model's items are made: in parts handed to the engine as each is made when the
    /// LLM runs here and parts are on; all parts first for an encoder-only model (the request
    /// goes upstream once every item is encoded anyway).
    pub fn parts(&self) -> pipeline::Parts {
        match (self.media_parts, self.runtime.engine().is_ok()) {
            (false, _) => pipeline::Parts::Whole,
            (true, true) => pipeline::Parts::Coming,
            (true, false) => pipeline::Parts::Made,
        }
    }
}

/// Where each part of a model runs: the LLM, and each encoder device.
#[derive(Debug, Clone)]
pub struct Devices {
    pub llm: DevicePlacement,
    /// One entry per encoder device.
    pub encoders: Vec<DevicePlacement>,
    /// CPU devices run bf16-weight linears as bf16 GEMMs, and attention in bf16, where they can
    /// ([`OpenDevice::with_bf16_inputs`]).
    pub cpu_bf16_inputs: bool,
}

impl Devices {
    /// The LLM's pool as wide as the machine, one encoder device with half the cores (at least
    /// one thread each). The pools overlap on purpose: while the encoder is idle (a text-only
    /// request, or the long prefill after a video's last piece) the LLM's threads use its cores,
    /// and while both are busy the OS shares them. Against half the cores each, this shortens a
    /// long item's TTFT and a mixed burst's time, on one server and with several bursting together
    /// (measured by `bench/pieces.py` and `bench/llm_pool.py`; `llm_threads` and
    /// `encoder_devices` set other sizes).
    pub fn for_this_machine() -> Self {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        Self {
            llm: DevicePlacement::Cpu { threads: cores },
            encoders: vec![DevicePlacement::Cpu {
                threads: (cores / 2).max(1),
            }],
            cpu_bf16_inputs: false,
        }
    }

    /// CPU pools of the given sizes.
    #[cfg(test)]
    pub fn cpu(llm: usize, encoders: &[usize]) -> Self {
        Self {
            llm: DevicePlacement::Cpu { threads: llm },
            encoders: encoders
                .iter()
                .map(|&threads| DevicePlacement::Cpu { threads })
                .collect(),
            cpu_bf16_inputs: false,
        }
    }
}

/// How a model runs: its devices and engine settings.
#[derive(Clone)]
pub struct RuntimeOptions {
    pub devices: Devices,
    pub max_running: usize,
    pub prefill_chunk: usize,
    pub feature_cache_bytes: usize,
    /// The context served, below the checkpoint's own (`max_position_embeddings`), as vLLM's
    /// `--max-model-len`: every budget and the KV cache use it.
    pub max_model_len: Option<usize>,
    /// An encoder feature cache beyond this process (replicas'), under this model's name and its
    /// weights' fingerprint.
    pub shared_features: Option<Arc<dyn SharedFeatures>>,
}

impl Default for RuntimeOptions {
    fn default() -> Self {
        Self {
            devices: Devices::for_this_machine(),
            max_running: 16,
            prefill_chunk: 512,
            feature_cache_bytes: 256 << 20,
            max_model_len: None,
            shared_features: None,
        }
    }
}

/// A fingerprint of the weights in `dir`, cheap enough to take at every start: `config.json`, and
/// per safetensors file its name, size and first and last MiB (the header, with every tensor's
/// shape and offset, and samples of the values). Replicas sharing encoder outputs must run the
/// same weights; a checkpoint retrained in place under the same name gets a new fingerprint.
pub fn weights_fingerprint(dir: &Path) -> anyhow::Result<String> {
    use sha2::Digest;
    use std::io::{Read, Seek, SeekFrom};
    const SAMPLE: u64 = 1 << 20;
    let mut h = sha2::Sha256::new();
    h.update(std::fs::read(dir.join("config.json")).context("reading config.json")?);
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    for path in files {
        let mut file = std::fs::File::open(&path)
            .with_context(|| format!("fingerprinting {}", path.display()))?;
        let len = file.metadata()?.len();
        h.update(
            path.file_name()
                .map(|n| n.as_encoded_bytes())
                .unwrap_or_default(),
        );
        h.update(len.to_le_bytes());
        let mut sample = Vec::new();
        (&mut file).take(SAMPLE).read_to_end(&mut sample)?;
        file.seek(SeekFrom::Start(len.saturating_sub(SAMPLE)))?;
        file.take(SAMPLE).read_to_end(&mut sample)?;
        h.update(&sample);
    }
    Ok(hex::encode(&h.finalize()[..8]))
}

/// A model on this machine's devices: its prompts, its encoders, and its LLM unless that runs
/// upstream.
pub struct ModelRuntime {
    pub prompt: PromptModel,
    /// `None` when the LLM runs upstream and only the encoders are here.
    engine: Option<Engine>,
    /// The dedicated encoder devices (shared with the engine).
    pub encoders: Arc<EncoderPool>,
    /// The feature cache shared with other replicas, under this model's namespace.
    pub shared: Option<SharedCache>,
}

/// A demo model's name is the generated demo model (written under `cache_dir` on first use);
/// anything else is a model directory.
pub fn resolve_model_dir(spec: &Path, cache_dir: &Path) -> anyhow::Result<PathBuf> {
    let Some(demo) = spec
        .to_str()
        .and_then(|name| demo::ensure_served(cache_dir, name))
    else {
        return Ok(spec.to_owned());
    };
    demo.with_context(|| format!("writing the demo model under {}", cache_dir.display()))
}

/// Where generated demo models live: `$XDG_CACHE_HOME/mmgate/models`, else `~/.cache/mmgate/models`,
/// else the system temp directory.
pub fn default_cache_dir() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("mmgate").join("models")
}

impl ModelRuntime {
    /// Loads the model onto its devices; `observer`, if any, hears of every encoded batch.
    pub fn load(
        name: &str,
        dir: &Path,
        options: &RuntimeOptions,
        observer: Option<BatchObserver>,
    ) -> anyhow::Result<Self> {
        Self::load_parts(name, dir, options, observer, true)
    }

    /// Only what encodes media for an upstream that runs the LLM: the encoders, the tokenizer and
    /// the processor config; no LLM weights are read and there is no engine.
    pub fn load_encoders(
        name: &str,
        dir: &Path,
        options: &RuntimeOptions,
        observer: Option<BatchObserver>,
    ) -> anyhow::Result<Self> {
        Self::load_parts(name, dir, options, observer, false)
    }

    fn load_parts(
        name: &str,
        dir: &Path,
        options: &RuntimeOptions,
        observer: Option<BatchObserver>,
        with_llm: bool,
    ) -> anyhow::Result<Self> {
        let family = families::read(dir)?;
        let devices = &options.devices;
        let mut device_names = Vec::new();
        let mut encoder_devices = Vec::new();
        for (i, &placement) in devices.encoders.iter().enumerate() {
            let label = format!("{name}-enc{i}");
            let device = OpenDevice::open(placement, &label)
                .with_context(|| format!("encoder device {i}"))?
                .with_bf16_inputs(devices.cpu_bf16_inputs);
            device_names.push(label);
            encoder_devices.push(device);
        }
        let llm_dev = if with_llm {
            Some(
                OpenDevice::open(devices.llm, &format!("{name}-llm"))
                    .context("LLM device")?
                    .with_bf16_inputs(devices.cpu_bf16_inputs),
            )
        } else {
            None
        };
        let prompt = PromptModel::with_family(name, dir, family, options.max_model_len)?;
        let native = prompt.native()?;
        let LoadedModel { encoders, llm } = native.load(dir, &encoder_devices, llm_dev.as_ref())?;
        let (positions, deepstack_levels) = (native.positions(), native.deepstack_levels());
        let specs = device_names
            .into_iter()
            .zip(encoders)
            .map(|(name, encoder)| DeviceSpec {
                name,
                encoders: vec![encoder],
            })
            .collect();
        let shared = match &options.shared_features {
            Some(features) => Some(SharedCache {
                features: features.clone(),
                namespace: format!("{name}@{}", weights_fingerprint(dir)?),
            }),
            None => None,
        };
        let features = shared.as_ref().map(|s| s.features.clone());
        let pool = Arc::new(EncoderPool::start(specs, 8, observer, features)?);
        let engine = match llm {
            Some(llm) => {
                let store = Arc::new(FeatureStore::new(options.feature_cache_bytes));
                let engine_config = EngineConfig {
                    model_name: name.to_owned(),
                    positions,
                    max_running: options.max_running,
                    prefill_chunk: options.prefill_chunk,
                    kv_budget_tokens: prompt.context_length.max(1) * 4,
                    eos_token_ids: prompt.generation.eos_token_ids.clone(),
                    deepstack_levels,
                };
                Some(llm.start(engine_config, prompt.text.clone(), pool.clone(), store)?)
            }
            None => None,
        };
        Ok(Self {
            prompt,
            engine,
            encoders: pool,
            shared,
        })
    }

    /// The engine that runs the LLM, unless the model was loaded for its encoders only.
    pub fn engine(&self) -> anyhow::Result<&Engine> {
        self.engine.as_ref().ok_or_else(|| {
            anyhow!(
                "model {} runs its LLM upstream: it has no engine here",
                self.prompt.name
            )
        })
    }
}
