//! A served model: its directory (a real HF checkpoint or a generated demo), the native inference
//! core running it (encoder devices, engine), and the glue between the plugins' tensors and the
//! engine's inputs: which media a model takes, how its prompt's placeholders expand, and the token
//! budget left for media.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, anyhow, bail};
use mmgate_host::{ByteSamples, Dtype, PartPlan, Tensor};
use mmgate_inference::Error as InferenceError;
use mmgate_inference::backend::ByteSamplesView;
use mmgate_inference::demo::{self, DemoFamily};
use mmgate_inference::devices::{OpenDevice, Placement as DevicePlacement};
use mmgate_inference::engine::{
    BatchObserver, Delivery, DeviceSpec, EncodeInput, EncoderPool, Engine, EngineConfig,
    FeatureStore, Handoff, InputPart, MediaItem, Piece, PixelSource, PixelValues, SharedFeatures,
};
use mmgate_inference::families::{self, FamilyModel, LoadedModel, Placement, PluginTensors};
use mmgate_inference::models::GenerationConfig;
use mmgate_inference::text::TextProcessor;

use crate::media::feature_cache::SharedCache;

pub use mmgate_inference::families::MediaKind;

/// Where each part of a model runs: the LLM, and each encoder device.
#[derive(Debug, Clone)]
pub struct Devices {
    pub llm: DevicePlacement,
    /// One entry per encoder device.
    pub encoders: Vec<DevicePlacement>,
}

impl Devices {
    /// The LLM's pool as wide as the machine, one encoder device with half the cores (at least
    /// one thread each). The pools overlap on purpose: while the encoder is idle (a text-only
    /// request, or the long prefill after a video's last piece) the LLM's threads use its cores,
    /// and while both are busy the OS shares them. Measured on 2 cores: a long item's TTFT
    /// 27-35 % shorter than with half the cores each, a mixed burst on one server 0.93x the time,
    /// three servers bursting together 0.98x (`bench/llm_pool.py`; `llm_threads` and
    /// `encoder_devices` set other sizes).
    pub fn for_this_machine() -> Self {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        Self {
            llm: DevicePlacement::Cpu { threads: cores },
            encoders: vec![DevicePlacement::Cpu {
                threads: (cores / 2).max(1),
            }],
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
fn weights_fingerprint(dir: &Path) -> anyhow::Result<String> {
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

/// What a model's prompts are made of, read from its directory without any weights: the
/// tokenizer and chat template, the placeholder tokens and encoder shapes of its config, its
/// processor and generation configs, its context. Enough to template a request, count its text
/// tokens and plan its media: a model whose server preprocesses for itself needs no more here.
pub struct PromptModel {
    pub name: String,
    /// What the model's family makes of its media (the registry's answer for its config).
    family: Arc<dyn FamilyModel>,
    pub text: Arc<TextProcessor>,
    /// `preprocessor_config.json`, handed to the plugins.
    pub processor_config: String,
    /// `generation_config.json`: its eos ids end generations, its sampling settings are the
    /// defaults of requests that leave them out.
    pub generation: GenerationConfig,
    pub context_length: usize,
    /// Values per media token in the encoder's output (the LLM's width, once per feature set:
    /// Qwen3-VL's deepstack adds some).
    pub embedding_width: usize,
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

/// The names that stand for a generated demo model where a model directory is expected.
pub const DEMO_MODELS: [(&str, DemoFamily); 4] = [
    ("demo", DemoFamily::Qwen2Vl),
    ("demo-qwen2.5-vl", DemoFamily::Qwen2_5Vl),
    ("demo-audio", DemoFamily::Qwen2Audio),
    ("demo-qwen3-vl", DemoFamily::Qwen3Vl),
];

/// Whether `spec` names a demo model rather than a directory.
pub fn is_demo_model(spec: &Path) -> bool {
    DEMO_MODELS
        .iter()
        .any(|(name, _)| spec.to_str() == Some(name))
}

/// A [`DEMO_MODELS`] name is the generated demo model (written under `cache_dir` on first use);
/// anything else is a model directory.
pub fn resolve_model_dir(spec: &Path, cache_dir: &Path) -> anyhow::Result<PathBuf> {
    let Some(&(_, family)) = DEMO_MODELS
        .iter()
        .find(|(name, _)| spec.to_str() == Some(name))
    else {
        return Ok(spec.to_owned());
    };
    demo::ensure(cache_dir, family)
        .with_context(|| format!("writing the demo model under {}", cache_dir.display()))
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
                .with_context(|| format!("encoder device {i}"))?;
            device_names.push(label);
            encoder_devices.push(device);
        }
        let llm_dev = if with_llm {
            Some(OpenDevice::open(devices.llm, &format!("{name}-llm")).context("LLM device")?)
        } else {
            None
        };
        let LoadedModel { encoders, llm } = family.load(dir, &encoder_devices, llm_dev.as_ref())?;
        let positions = family.positions();
        let specs = device_names
            .into_iter()
            .zip(encoders)
            .map(|(name, encoder)| DeviceSpec {
                name,
                encoders: vec![encoder],
            })
            .collect();
        let prompt = PromptModel::assemble(name, dir, family, options.max_model_len)?;
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
                    deepstack_levels: prompt.family.deepstack_levels(),
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

impl PromptModel {
    /// Reads a model directory's config, tokenizer, chat template, processor and generation
    /// configs; weights, if any, are not read. `max_model_len` as in [`RuntimeOptions`].
    pub fn load(name: &str, dir: &Path, max_model_len: Option<usize>) -> anyhow::Result<Self> {
        Self::assemble(name, dir, families::read(dir)?, max_model_len)
    }

    /// For a model whose server runs its own processor (`media = "preprocess"`): the processor
    /// config plugins get says so (`"mmgate_server_processor": true`), so they plan what that
    /// processor makes of an item where it differs from what this gateway would (HF's audio
    /// processors keep only the first 30 s chunk).
    pub fn for_server_processor(mut self) -> anyhow::Result<Self> {
        let mut config: serde_json::Value = serde_json::from_str(&self.processor_config)
            .context("preprocessor_config.json is not JSON")?;
        let Some(fields) = config.as_object_mut() else {
            bail!("preprocessor_config.json is not a JSON object");
        };
        fields.insert("mmgate_server_processor".into(), true.into());
        self.processor_config = config.to_string();
        Ok(self)
    }

    /// The prompt side of a model whose config is already read.
    fn assemble(
        name: &str,
        dir: &Path,
        family: Arc<dyn FamilyModel>,
        max_model_len: Option<usize>,
    ) -> anyhow::Result<Self> {
        let embedding_width = family.embedding_width();
        let checkpoint_context = family.text_config().max_position_embeddings;
        let context_length = match max_model_len {
            Some(n) if n > checkpoint_context => bail!(
                "max_model_len {n} is over the checkpoint's context of {checkpoint_context} tokens \
                 (max_position_embeddings)"
            ),
            Some(n) => n,
            None => checkpoint_context,
        };
        let processor_config = read_processor_config(dir)?;
        Ok(Self {
            name: name.to_owned(),
            family,
            text: Arc::new(TextProcessor::load(dir)?),
            processor_config,
            generation: GenerationConfig::read(dir)?,
            context_length,
            embedding_width,
        })
    }

    /// The media kinds this model takes.
    pub fn media_kinds(&self) -> &'static [MediaKind] {
        self.family.media_kinds()
    }

    /// Tokens of a templated prompt that are not media placeholders (each media item is one
    /// placeholder before expansion).
    pub fn text_tokens(&self, ids: &[u32]) -> usize {
        let placeholders: Vec<u32> = self
            .media_kinds()
            .iter()
            .filter_map(|&k| self.placeholder(k).ok())
            .collect();
        ids.iter().filter(|id| !placeholders.contains(id)).count()
    }

    /// The placeholder token for a media kind, or why this model does not take it.
    pub fn placeholder(&self, kind: MediaKind) -> anyhow::Result<u32> {
        self.family
            .placeholder(kind)
            .ok_or_else(|| anyhow!("model {} does not take {} input", self.name, kind.name()))
    }

    /// The engine's input for one preprocessed item (the plugin's tensors), checking that the
    /// plugin's token count is what the encoder will produce.
    pub fn media_item(
        &self,
        kind: MediaKind,
        tokens: u32,
        tensors: &[Tensor],
    ) -> anyhow::Result<PlacedItem> {
        let view = PluginView {
            tensors,
            lacks: |name| {
                format!(
                    "the plugin's output lacks {name}: does this model's processor config match?"
                )
            },
        };
        let planned = self.family.plan_input(kind, &view)?;
        if planned.tokens != tokens as usize {
            bail!(
                "the plugin planned {tokens} tokens but its tensors make {}",
                planned.tokens
            );
        }
        self.place(
            kind,
            planned.input,
            planned.tokens,
            Placement {
                grid: None,
                time_interval: planned.time_interval,
                runs: planned.runs,
            },
        )
    }

    /// The engine's items for an item the plugin made in parts (contract 0.4): each part planned by
    /// the family as an item of its own and placed as a piece of item `index` of the request, so
    /// that each is encoded, merged and prefilled as soon as it and what precedes it are ready. A
    /// piece laid out as one run of placeholders continues the previous piece's M-RoPE block (a
    /// Qwen2-VL video: one block whose temporal patches the pieces share out); one laid out in
    /// runs (a Qwen3-VL video's frames after their timestamps) places each run itself. The parts'
    /// tokens must add up to the plugin's plan. An item the encoder must see whole (an image in
    /// bands of rows: the tower attends across the image) is joined back first and placed whole.
    pub fn media_parts(
        &self,
        kind: MediaKind,
        tokens: u32,
        parts: &[Vec<Tensor>],
        index: usize,
    ) -> anyhow::Result<PlacedItem> {
        if let Some(bands) = self.family.row_bands(kind) {
            let whole = super::bands::join(parts, bands).context("the plugin's bands of rows")?;
            return self.media_item(kind, tokens, &whole);
        }
        let mut placed = PlacedItem {
            items: Vec::with_capacity(parts.len()),
            ids: Vec::new(),
        };
        let mut temporal_patches = 0;
        for (n, part) in parts.iter().enumerate() {
            let view = PluginView {
                tensors: part,
                lacks: |name| format!("a part of the plugin's output lacks {name}"),
            };
            let planned = self
                .family
                .plan_input(kind, &view)
                .with_context(|| format!("part {n}"))?;
            let grid = match &planned.input {
                EncodeInput::Vision { grid, .. } => Some(*grid),
                _ => None,
            };
            // Only a vision input has an M-RoPE block to continue.
            let one_block = planned.runs.is_empty() && grid.is_some();
            let piece = Piece {
                item: index,
                continues_at: (one_block && n > 0).then_some(temporal_patches),
            };
            temporal_patches += grid.map_or(0, |g| g.t);
            let tokens = planned.tokens;
            let mut part = self.place(
                kind,
                planned.input,
                tokens,
                Placement {
                    grid: None,
                    time_interval: planned.time_interval,
                    runs: planned.runs,
                },
            )?;
            for item in &mut part.items {
                item.piece = Some(piece);
            }
            placed.items.append(&mut part.items);
            placed.ids.append(&mut part.ids);
        }
        let made: usize = placed.items.iter().map(|i| i.tokens).sum();
        if made != tokens as usize {
            bail!("the plugin planned {tokens} tokens but its parts make {made}");
        }
        Ok(placed)
    }

    /// The engine's items for an item whose parts are still being made (contract 0.5): each part
    /// placed from its part plan (its tokens, and its placing tensors read as the family reads
    /// embeddings made elsewhere) as a piece of item `index` whose input comes later through a
    /// handoff; and, per part, the [`PieceMaker`] that turns its tensors into that input once
    /// made. Pieces continue each other's M-RoPE block as [`Self::media_parts`] places them.
    /// With `share_keys` (one per part, or none), each piece's output is stored in the shared
    /// cache under its part's key. `None` when the model's encoder must see such an item whole
    /// (see [`FamilyModel::row_bands`]): its parts are joined once all are made.
    pub fn coming_parts(
        &self,
        kind: MediaKind,
        tokens: u32,
        plans: &[PartPlan],
        share_keys: &[[u8; 32]],
        index: usize,
    ) -> anyhow::Result<Option<(PlacedItem, Vec<PieceMaker>)>> {
        if self.family.row_bands(kind).is_some() {
            return Ok(None);
        }
        let mut makers = Vec::with_capacity(plans.len());
        let placed =
            self.placed_pieces(kind, tokens, plans, share_keys, index, |n, placement| {
                let (handoff, delivery) = Handoff::new();
                makers.push(PieceMaker {
                    family: self.family.clone(),
                    kind,
                    item: index,
                    part: n,
                    placement: placement.clone(),
                    tokens: plans[n].tokens as usize,
                    delivery: Some(delivery),
                });
                Ok(EncodeInput::Later {
                    grid: placement.grid,
                    handoff,
                })
            })?;
        Ok(Some((placed, makers)))
    }

    /// The engine's items for an item whose parts another replica encoded (stored piece by piece,
    /// see [`Self::coming_parts`]): each part's output placed by its part plan as a piece of item
    /// `index`, exactly as the parts made here would be.
    pub fn encoded_parts(
        &self,
        kind: MediaKind,
        tokens: u32,
        plans: &[PartPlan],
        features: Vec<Arc<Vec<f32>>>,
        index: usize,
    ) -> anyhow::Result<PlacedItem> {
        if features.len() != plans.len() {
            bail!(
                "the shared entry has {} parts, not {}",
                features.len(),
                plans.len()
            );
        }
        let mut features = features.into_iter();
        self.placed_pieces(kind, tokens, plans, &[], index, |n, placement| {
            let embeddings = features
                .next()
                .ok_or_else(|| anyhow!("the shared entry lacks part {n}"))?;
            if embeddings.len() != plans[n].tokens as usize * self.embedding_width {
                bail!(
                    "the shared entry's part {n} is not {} tokens",
                    plans[n].tokens
                );
            }
            Ok(EncodeInput::Embeddings {
                embeddings,
                grid: placement.grid,
            })
        })
    }

    /// An item's parts placed by their part plans (their placing tensors read as the family reads
    /// embeddings made elsewhere), each the input `input_of` gives for it, as pieces of item
    /// `index`: a piece laid out as one run continues the previous piece's M-RoPE block, as
    /// [`Self::media_parts`] places them. The plans' tokens must add up to the plugin's plan. A
    /// piece's engine items (one per run) carry its part's key in `share_keys`, if any.
    fn placed_pieces(
        &self,
        kind: MediaKind,
        tokens: u32,
        plans: &[PartPlan],
        share_keys: &[[u8; 32]],
        index: usize,
        mut input_of: impl FnMut(usize, &Placement) -> anyhow::Result<EncodeInput>,
    ) -> anyhow::Result<PlacedItem> {
        let mut placed = PlacedItem {
            items: Vec::with_capacity(plans.len()),
            ids: Vec::new(),
        };
        let mut temporal_patches = 0;
        for (n, plan) in plans.iter().enumerate() {
            let view = PluginView {
                tensors: &plan.placing,
                lacks: |name| format!("a part plan lacks {name}"),
            };
            let part_tokens = plan.tokens as usize;
            let placement = self
                .family
                .place_embeddings(kind, Some(&view), part_tokens)
                .with_context(|| format!("part plan {n}"))?;
            let one_block = placement.runs.is_empty() && placement.grid.is_some();
            let piece = Piece {
                item: index,
                continues_at: (one_block && n > 0).then_some(temporal_patches),
            };
            temporal_patches += placement.grid.map_or(0, |g| g.t);
            let input = input_of(n, &placement)?;
            let mut part = self.place(kind, input, part_tokens, placement)?;
            for item in &mut part.items {
                item.piece = Some(piece);
                item.share_key = share_keys.get(n).copied();
            }
            placed.items.append(&mut part.items);
            placed.ids.append(&mut part.ids);
        }
        let made: usize = placed.items.iter().map(|i| i.tokens).sum();
        if made != tokens as usize {
            bail!("the plugin planned {tokens} tokens but its part plans make {made}");
        }
        Ok(placed)
    }

    /// The engine's items for an item's input and the prompt ids that replace its templated
    /// placeholder: one run of `tokens` placeholders, or the family's runs between their texts,
    /// each an item taking its share of the input's tokens.
    fn place(
        &self,
        kind: MediaKind,
        input: EncodeInput,
        tokens: usize,
        placement: Placement,
    ) -> anyhow::Result<PlacedItem> {
        let placeholder = self.placeholder(kind)?;
        let item = |input: Arc<EncodeInput>, tokens, part| MediaItem {
            input,
            placeholder,
            tokens,
            processor_config: self.processor_config.clone(),
            time_interval: placement.time_interval,
            share_key: None,
            part,
            piece: None,
        };
        let input = Arc::new(input);
        if placement.runs.is_empty() {
            return Ok(PlacedItem {
                ids: vec![placeholder; tokens],
                items: vec![item(input, tokens, None)],
            });
        }
        let in_runs: usize = placement.runs.iter().map(|r| r.tokens).sum();
        if in_runs != tokens {
            bail!("the item's runs hold {in_runs} tokens, not its {tokens}");
        }
        let mut placed = PlacedItem {
            items: Vec::with_capacity(placement.runs.len()),
            ids: Vec::with_capacity(tokens + 8 * placement.runs.len()),
        };
        let mut first_token = 0;
        for run in &placement.runs {
            placed.ids.extend(self.text.encode(&run.before)?);
            placed
                .ids
                .extend(std::iter::repeat_n(placeholder, run.tokens));
            placed.ids.extend(self.text.encode(&run.after)?);
            let part = InputPart {
                first_token,
                grid: run.grid,
            };
            placed
                .items
                .push(item(input.clone(), run.tokens, Some(part)));
            first_token += run.tokens;
        }
        Ok(placed)
    }
}

impl PromptModel {
    /// The engine's input for `features` this model's encoder made of an item on another replica,
    /// placed by the item's small tensors (its grid, a video's `second_per_grid_ts`) as
    /// [`Self::media_item`] places the item itself.
    pub fn encoded_item(
        &self,
        kind: MediaKind,
        tokens: u32,
        small: &[Tensor],
        features: Arc<Vec<f32>>,
    ) -> anyhow::Result<PlacedItem> {
        let view = PluginView {
            tensors: small,
            lacks: |name| format!("the shared entry lacks {name}"),
        };
        let placement = self
            .family
            .place_embeddings(kind, Some(&view), tokens as usize)?;
        if tokens == 0 || !features.len().is_multiple_of(tokens as usize) {
            bail!("the shared entry's features do not split into {tokens} tokens");
        }
        let input = EncodeInput::Embeddings {
            embeddings: features,
            grid: placement.grid,
        };
        self.place(kind, input, tokens as usize, placement)
    }

    /// The engine's input for embeddings an encoder of this model made elsewhere (vLLM's
    /// `image_embeds`): `[tokens, hidden]` in f32, f16 or bf16, and for a vision model the grid
    /// that places them (`(3,)` or `(1, 3)` integers).
    pub fn embeddings_item(
        &self,
        kind: MediaKind,
        embeddings: &Tensor,
        grid: Option<&Tensor>,
    ) -> anyhow::Result<MediaItem> {
        let placeholder = self.placeholder(kind)?;
        if grid.is_none() {
            // A family that places embeddings by a grid says so before anything else is read.
            self.family.place_embeddings(kind, None, 0)?;
        }
        let [tokens, hidden] = embeddings.shape[..] else {
            bail!(
                "image_embeds has shape {:?}; [tokens, hidden] is expected",
                embeddings.shape
            )
        };
        let tokens = usize::try_from(tokens)?;
        if hidden != self.embedding_width as u64 {
            bail!(
                "image_embeds are {hidden} wide; model {} embeds tokens in {}",
                self.name,
                self.embedding_width
            );
        }
        if tokens == 0 {
            bail!("image_embeds holds no tokens");
        }
        let values: Vec<f32> = match embeddings.dtype {
            Dtype::F32 => mmgate_host::le_f32s(&embeddings.data),
            Dtype::F16 => embeddings
                .data
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::Bf16 => embeddings
                .data
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => bail!("image_embeds are {}; floats are expected", other.name()),
        };
        if values.len() != tokens * self.embedding_width {
            bail!(
                "image_embeds holds {} values, not {tokens}x{hidden}",
                values.len()
            );
        }
        if !values.iter().all(|v| v.is_finite()) {
            bail!("image_embeds holds values that are not finite");
        }
        // The client's grid, under the name the family reads it by.
        let grid: Option<Vec<Tensor>> = grid.map(|g| {
            vec![Tensor {
                name: "image_grid_thw".into(),
                ..g.clone()
            }]
        });
        let views = grid.as_deref().map(|tensors| PluginView {
            tensors,
            lacks: |name| format!("{name} is missing"),
        });
        let Placement { grid, .. } = self.family.place_embeddings(
            kind,
            views.as_ref().map(|v| v as &dyn PluginTensors),
            tokens,
        )?;
        Ok(MediaItem {
            input: Arc::new(EncodeInput::Embeddings {
                embeddings: Arc::new(values),
                grid,
            }),
            placeholder,
            tokens,
            processor_config: self.processor_config.clone(),
            time_interval: 1.0,
            share_key: None,
            part: None,
            piece: None,
        })
    }
}

/// What turns one part of an item, placed before it was made ([`PromptModel::coming_parts`]),
/// into its encoder input once made, and hands that to the engine. Dropped before delivering
/// while its request still waits, it is a bug in whatever drives the request: it fails the item
/// saying which part was never made, and logs that once.
pub struct PieceMaker {
    family: Arc<dyn FamilyModel>,
    kind: MediaKind,
    /// The media item's index in the request, and the part's within the item.
    item: usize,
    part: usize,
    /// Where the part was placed: what its tensors must make.
    placement: Placement,
    tokens: usize,
    /// Taken when delivered.
    delivery: Option<Delivery>,
}

impl PieceMaker {
    /// Hands the part's input to the engine: its tensors as the family reads them, checked to
    /// make what was placed (the same tokens, grid, runs and M-RoPE step); or why there is none
    /// (the maker's own error), which fails the item in the engine as an encode error does.
    pub fn deliver(mut self, made: Result<Vec<Tensor>, String>) {
        let input = made.and_then(|tensors| {
            self.input_of(&tensors)
                .map_err(|e| format!("media item {} part {}: {e:#}", self.item, self.part))
        });
        if let Some(delivery) = self.delivery.take() {
            delivery.deliver(input);
        }
    }

    /// Lets the part go unmade because its request is being stopped (the client left, or the
    /// request is rerun without its media): not the bug dropping an awaited maker is.
    pub fn cancel(mut self) {
        self.delivery.take();
    }

    fn input_of(&self, tensors: &[Tensor]) -> anyhow::Result<EncodeInput> {
        let view = PluginView {
            tensors,
            lacks: |name| format!("the part's output lacks {name}"),
        };
        let planned = self.family.plan_input(self.kind, &view)?;
        let grid = match &planned.input {
            EncodeInput::Vision { grid, .. } => Some(*grid),
            _ => None,
        };
        let made = Placement {
            grid,
            time_interval: planned.time_interval,
            runs: planned.runs,
        };
        if planned.tokens != self.tokens || made != self.placement {
            bail!(
                "its tensors make {} tokens placed as {made:?}, not the {} tokens placed as {:?} its part plan gave",
                planned.tokens,
                self.tokens,
                self.placement
            );
        }
        Ok(planned.input)
    }
}

impl Drop for PieceMaker {
    fn drop(&mut self) {
        let Some(delivery) = self.delivery.take() else {
            return;
        };
        if !delivery.awaited() {
            // The request is gone (cancelled or over): nobody waits for this part.
            return;
        }
        let message = format!(
            "media item {} part {} was never made: what drove the request stopped feeding its parts to the engine",
            self.item, self.part
        );
        tracing::error!(item = self.item, part = self.part, "{message}");
        delivery.deliver(Err(message));
    }
}

/// A plugin's 8-bit samples as the encoder's pixel source: expanded through their table when the
/// encoder packs a batch.
#[derive(Debug)]
struct PluginSamples(ByteSamples);

impl PixelSource for PluginSamples {
    fn value_count(&self) -> usize {
        self.0.len()
    }

    fn bytes(&self) -> usize {
        self.0.bytes()
    }

    fn feed_content(&self, feed: &mut dyn FnMut(&[u8])) {
        let (samples, table) = self.0.parts();
        feed(&(self.0.repeats() as u64).to_le_bytes());
        feed(samples);
        for v in table {
            feed(&v.to_le_bytes());
        }
    }

    fn extend_f32(&self, out: &mut Vec<f32>) {
        self.0.map_into(out);
    }

    fn write_f32(&self, start: usize, out: &mut [f32]) {
        self.0.map_range_into(start, out);
    }

    fn byte_samples(&self) -> Option<ByteSamplesView<'_>> {
        let (samples, table) = self.0.parts();
        Some(ByteSamplesView {
            samples,
            table,
            run: self.0.run(),
            channels: self.0.channels(),
            repeats: self.0.repeats(),
        })
    }
}

/// A plugin's tensors as the model families read them; `lacks` words the error for a tensor that
/// is not there (a plugin's output, a shared entry, a client's part).
struct PluginView<'a> {
    tensors: &'a [Tensor],
    lacks: fn(&str) -> String,
}

impl PluginView<'_> {
    fn find(&self, name: &str) -> mmgate_inference::Result<&Tensor> {
        self.tensors
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| InferenceError::Input((self.lacks)(name)))
    }
}

fn wrong_type(t: &Tensor, expected: &str) -> InferenceError {
    InferenceError::Input(format!("{} is {:?}, expected {expected}", t.name, t.dtype))
}

impl PluginTensors for PluginView<'_> {
    fn shape(&self, name: &str) -> mmgate_inference::Result<Vec<u64>> {
        Ok(self.find(name)?.shape.clone())
    }

    fn f32s(&self, name: &str) -> mmgate_inference::Result<Vec<f32>> {
        let t = self.find(name)?;
        if t.dtype != Dtype::F32 {
            return Err(wrong_type(t, "f32"));
        }
        Ok(mmgate_host::le_f32s(&t.data))
    }

    fn ints(&self, name: &str) -> mmgate_inference::Result<Vec<i64>> {
        let t = self.find(name)?;
        Ok(match t.dtype {
            Dtype::I64 => mmgate_host::le_i64s(&t.data),
            Dtype::I32 => t
                .data
                .chunks_exact(4)
                .map(|b| i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])))
                .collect(),
            _ => return Err(wrong_type(t, "i64")),
        })
    }

    fn pixel_values(&self, name: &str) -> mmgate_inference::Result<PixelValues> {
        let t = self.find(name)?; // for its explanation when the tensor is missing
        match ByteSamples::from_tensors(self.tensors, name)
            .map_err(|e| InferenceError::Input(e.to_string()))?
        {
            Some(samples) => Ok(PixelValues::Source(Arc::new(PluginSamples(samples)))),
            None if t.dtype == Dtype::F32 => Ok(PixelValues::F32(mmgate_host::le_f32s(&t.data))),
            None => Err(wrong_type(t, "f32")),
        }
    }
}

/// Where a model's video processor config goes inside the processor config the plugins get.
const VIDEO_PROCESSOR_KEY: &str = "video_preprocessor_config";

/// The processor config the plugins get: `preprocessor_config.json`, and the model's own video
/// processor config (`video_preprocessor_config.json`, as Qwen3-VL ships) under
/// `"video_preprocessor_config"` when there is one: one string, so one cache key and one
/// argument, while the video plugin reads the video processor's keys over the image processor's.
pub fn read_processor_config(dir: &Path) -> anyhow::Result<String> {
    let read = |name: &str| -> anyhow::Result<Option<(String, serde_json::Value)>> {
        let path = dir.join(name);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
        };
        let value: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", path.display()))?;
        if !value.is_object() {
            bail!("{} is not a JSON object", path.display());
        }
        Ok(Some((text, value)))
    };
    let (text, mut config) = read("preprocessor_config.json")?.ok_or_else(|| {
        anyhow!(
            "cannot read {}: it is missing",
            dir.join("preprocessor_config.json").display()
        )
    })?;
    let Some((_, video)) = read("video_preprocessor_config.json")? else {
        return Ok(text);
    };
    if let Some(fields) = config.as_object_mut() {
        fields.insert(VIDEO_PROCESSOR_KEY.into(), video);
    }
    Ok(config.to_string())
}

/// A media item as the prompt holds it: the engine's items for it (one, or one per run of its
/// tokens) and the ids that replace its one placeholder in the templated prompt.
#[derive(Debug, Clone)]
pub struct PlacedItem {
    pub items: Vec<MediaItem>,
    pub ids: Vec<u32>,
}

impl PlacedItem {
    /// One item in one run of its placeholders.
    pub fn single(item: MediaItem) -> Self {
        Self {
            ids: vec![item.placeholder; item.tokens],
            items: vec![item],
        }
    }

    fn placeholder(&self) -> Option<u32> {
        self.items.first().map(|i| i.placeholder)
    }
}

/// Replaces each media item's single placeholder in the templated prompt by its ids, items taken
/// in prompt order per placeholder token.
pub fn expand_placeholders(ids: &[u32], media: &[PlacedItem]) -> anyhow::Result<Vec<u32>> {
    let mut out = Vec::with_capacity(ids.len() + media.iter().map(|m| m.ids.len()).sum::<usize>());
    let mut used = vec![false; media.len()];
    for &id in ids {
        match (0..media.len()).find(|&i| !used[i] && media[i].placeholder() == Some(id)) {
            Some(i) => {
                used[i] = true;
                out.extend_from_slice(&media[i].ids);
            }
            None if media.iter().any(|m| m.placeholder() == Some(id)) => {
                bail!("the prompt has more media placeholders than media items")
            }
            None => out.push(id),
        }
    }
    if used.iter().any(|u| !u) {
        bail!("the chat template placed fewer media placeholders than there are media items");
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn tensor(name: &str, dtype: Dtype, shape: &[u64], data: Vec<u8>) -> Tensor {
        Tensor::new(name, dtype, shape, data)
    }

    /// A video's preprocessed tensors: 3 temporal patches of 4x4, `second_per_grid_ts` if given.
    fn video(seconds: Option<f32>) -> Vec<Tensor> {
        let grid: Vec<u8> = [3i64, 4, 4].iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut tensors = vec![
            tensor(
                "pixel_values_videos",
                Dtype::F32,
                &[48, 1176],
                vec![0; 48 * 1176 * 4],
            ),
            tensor("video_grid_thw", Dtype::I64, &[1, 3], grid),
        ];
        if let Some(s) = seconds {
            let data = s.to_le_bytes().to_vec();
            tensors.push(tensor("second_per_grid_ts", Dtype::F32, &[1], data));
        }
        tensors
    }

    fn runtime(spec: &str, cache: &Path) -> ModelRuntime {
        let dir = resolve_model_dir(Path::new(spec), cache).unwrap();
        let options = RuntimeOptions {
            devices: Devices::cpu(1, &[1]),
            ..RuntimeOptions::default()
        };
        ModelRuntime::load(spec, &dir, &options, None).unwrap()
    }

    #[test]
    fn qwen2_5_vl_videos_take_their_time_step_from_the_plugin() {
        let cache = tempfile::tempdir().unwrap();
        let model = runtime("demo-qwen2.5-vl", cache.path());
        // The demo's 2 tokens per second × 0.75 s between temporal patches.
        let item = model
            .prompt
            .media_item(MediaKind::Video, 12, &video(Some(0.75)))
            .unwrap();
        assert_eq!(item.items[0].time_interval, 1.5);
        let err = model
            .prompt
            .media_item(MediaKind::Video, 12, &video(None))
            .unwrap_err();
        assert!(err.to_string().contains("second_per_grid_ts"), "{err}");
        let err = model
            .prompt
            .media_item(MediaKind::Video, 12, &video(Some(f32::NAN)))
            .unwrap_err();
        assert!(err.to_string().contains("not a duration"), "{err}");

        // Qwen2-VL steps one position per temporal patch whatever the seconds.
        let model = runtime("demo", cache.path());
        let item = model
            .prompt
            .media_item(MediaKind::Video, 12, &video(Some(0.75)))
            .unwrap();
        assert_eq!(item.items[0].time_interval, 1.0);
    }

    #[test]
    fn qwen3_vl_videos_are_a_block_per_temporal_patch_after_its_timestamp() {
        let cache = tempfile::tempdir().unwrap();
        let model = runtime("demo-qwen3-vl", cache.path());
        let ints = |v: &[i64]| v.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
        let video = vec![
            tensor(
                "pixel_values_videos",
                Dtype::F32,
                &[32, 1536],
                vec![0; 32 * 1536 * 4],
            ),
            tensor("video_grid_thw", Dtype::I64, &[1, 3], ints(&[2, 4, 4])),
            // Frames 0, 15 and 30, 45 of a 30 fps video: temporal patches at 0.25 s and 1.25 s.
            tensor("frame_indices", Dtype::I64, &[4], ints(&[0, 15, 30, 45])),
            tensor(
                "video_fps_f64_bits",
                Dtype::I64,
                &[1],
                ints(&[30f64.to_bits() as i64]),
            ),
        ];
        let placed = model
            .prompt
            .media_item(MediaKind::Video, 8, &video)
            .unwrap();
        let parts: Vec<_> = placed.items.iter().map(|i| (i.tokens, i.part)).collect();
        let frame = mmgate_inference::rope::Grid { t: 1, h: 4, w: 4 };
        assert_eq!(
            parts,
            [
                (
                    4,
                    Some(InputPart {
                        first_token: 0,
                        grid: frame
                    })
                ),
                (
                    4,
                    Some(InputPart {
                        first_token: 4,
                        grid: frame
                    })
                ),
            ]
        );
        assert!(Arc::ptr_eq(&placed.items[0].input, &placed.items[1].input));
        let text = model.prompt.text.decode(&placed.ids, false).unwrap();
        let pads = "<|video_pad|>".repeat(4);
        assert_eq!(
            text,
            format!(
                "<0.2 seconds><|vision_start|>{pads}<|vision_end|><1.2 seconds><|vision_start|>{pads}<|vision_end|>"
            )
        );
        // Without the frame rate there are no timestamps to write.
        let err = model
            .prompt
            .media_item(MediaKind::Video, 8, &video[..3])
            .unwrap_err();
        assert!(err.to_string().contains("video_fps_f64_bits"), "{err}");
    }

    /// A built-in plugin's output for an item.
    struct Made {
        plan: mmgate_host::TokenPlan,
        /// By `preprocess`.
        whole: Vec<Tensor>,
        /// By `preprocess-part`, in order.
        parts: Vec<Vec<Tensor>>,
        /// What `part-plans` said of the parts beforehand, if it places them.
        part_plans: Option<Vec<PartPlan>>,
    }

    /// A built-in plugin's output for `media` under `model`'s processor config (`config` adjusts
    /// it): whole (`preprocess`) and in its parts.
    fn whole_and_parts(
        model: &ModelRuntime,
        modality: &str,
        media: &[u8],
        config: impl FnOnce(&mut serde_json::Value),
    ) -> Made {
        let sandbox =
            Arc::new(mmgate_host::Sandbox::new(mmgate_host::SandboxLimits::default()).unwrap());
        let registry = mmgate_host::PluginRegistry::builtin(&sandbox).unwrap();
        let plugin = registry.for_modality(modality).unwrap();
        let mut json: serde_json::Value =
            serde_json::from_str(&model.prompt.processor_config).unwrap();
        config(&mut json);
        let config = json.to_string();
        let media = mmgate_host::Media {
            data: media.to_vec(),
            mime_type: None,
        };
        let info = plugin.probe(&media).unwrap();
        let plan = plugin
            .plan(
                &info,
                mmgate_host::Budget {
                    max_tokens: 1 << 20,
                },
                &config,
            )
            .unwrap();
        let whole = plugin.preprocess(&media, &plan, &config).unwrap();
        let count = plugin.parts(&plan, &config).unwrap();
        let parts = (0..count)
            .map(|i| plugin.preprocess_part(&media, &plan, &config, i).unwrap())
            .collect::<Vec<_>>();
        let part_plans = plugin.part_plans(&plan, &config, count).unwrap();
        Made {
            plan,
            whole,
            parts,
            part_plans,
        }
    }

    /// The built-in video plugin's output for a 48-frame clip sampled at 12 fps under `model`'s
    /// processor config: whole and in parts (runs of 2, 6, 6, 5 and 5 of its 24 temporal patches).
    fn video_whole_and_parts(model: &ModelRuntime) -> Made {
        let clip = std::fs::read(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/video/clips/12fps.mp4"),
        )
        .unwrap();
        // Every frame, at the model's smallest size: 24 temporal patches.
        let made = whole_and_parts(model, "video", &clip, |config| {
            config["fps"] = 12.into();
            if let Some(video) = config.get_mut("video_preprocessor_config") {
                video["fps"] = 12.into();
            }
        });
        assert_eq!(made.parts.len(), 5);
        made
    }

    /// Each piece of `pieces` encoded as the engine's pool encodes it, their features in order,
    /// and how many inputs they were.
    fn piece_features(model: &ModelRuntime, pieces: &PlacedItem) -> (Vec<f32>, usize) {
        let mut features = Vec::new();
        let mut inputs: Vec<&Arc<EncodeInput>> = Vec::new();
        for item in &pieces.items {
            if !inputs.iter().any(|i| Arc::ptr_eq(i, &item.input)) {
                inputs.push(&item.input);
                features.extend(encode(model, &item.input).iter().copied());
            }
        }
        (features, inputs.len())
    }

    fn encode(model: &ModelRuntime, input: &Arc<EncodeInput>) -> Arc<Vec<f32>> {
        let (tx, rx) = std::sync::mpsc::channel();
        model
            .encoders
            .submit(input.clone(), move |r| {
                let _ = tx.send(r);
            })
            .unwrap();
        rx.recv().unwrap().unwrap()
    }

    /// Greedy tokens of a prompt holding `placed`, and the prompt's length.
    fn generate(model: &ModelRuntime, placed: &PlacedItem) -> (Vec<u32>, usize) {
        let (events, prompt) = submit(model, placed);
        match run(events) {
            Ok(ids) => (ids, prompt),
            Err(failure) => panic!("{failure:?}"),
        }
    }

    /// Submits a prompt holding `placed`: its events, and the prompt's length.
    fn submit(
        model: &ModelRuntime,
        placed: &PlacedItem,
    ) -> (
        tokio::sync::mpsc::UnboundedReceiver<mmgate_inference::engine::Event>,
        usize,
    ) {
        let text = &model.prompt.text;
        let mut prompt = text.encode("<|im_start|>user\nDescribe.").unwrap();
        prompt.extend(&placed.ids);
        prompt.extend(text.encode("<|im_end|>\n<|im_start|>assistant\n").unwrap());
        let handle = model
            .engine()
            .unwrap()
            .submit(mmgate_inference::engine::GenerateRequest {
                prompt: prompt.clone(),
                media: placed.items.clone(),
                sampling: mmgate_inference::sampling::SamplingParams::greedy(),
                max_tokens: 12,
                stop: Vec::new(),
            })
            .unwrap();
        (handle.events, prompt.len())
    }

    /// A request's greedy tokens, or how it failed.
    fn run(
        mut events: tokio::sync::mpsc::UnboundedReceiver<mmgate_inference::engine::Event>,
    ) -> Result<Vec<u32>, mmgate_inference::engine::Failure> {
        let mut ids = Vec::new();
        loop {
            match events.blocking_recv() {
                Some(mmgate_inference::engine::Event::Token { id, .. }) => ids.push(id),
                Some(mmgate_inference::engine::Event::Done { .. }) => return Ok(ids),
                Some(mmgate_inference::engine::Event::Failed(failure)) => return Err(failure),
                None => panic!("the engine stopped"),
            }
        }
    }

    /// A video made in parts is encoded piece by piece, each merged as it is ready: the same
    /// encoder features, bit for bit, and the same greedy tokens as the video made whole, on
    /// Qwen2-VL, Qwen2.5-VL (time-scaled positions continued across pieces) and Qwen3-VL (each
    /// piece's frames after their timestamps).
    #[test]
    fn a_video_in_pieces_is_exactly_the_video_whole() {
        let cache = tempfile::tempdir().unwrap();
        for spec in ["demo", "demo-qwen2.5-vl", "demo-qwen3-vl"] {
            let model = runtime(spec, cache.path());
            let made = video_whole_and_parts(&model);
            assert_pieces_are_the_whole(&model, MediaKind::Video, &made, spec);
        }
    }

    /// The same for a 65 s PCM audio file at 22.05 kHz (resampled) on Qwen2-Audio: a piece of two
    /// 30 s chunks and one of the last 5 s.
    #[test]
    fn an_audio_file_in_pieces_is_exactly_the_file_whole() {
        let cache = tempfile::tempdir().unwrap();
        let model = runtime("demo-audio", cache.path());
        let made = whole_and_parts(&model, "audio", &long_pcm_wav(), |_| {});
        assert_eq!(made.parts.len(), 2);
        assert_pieces_are_the_whole(&model, MediaKind::Audio, &made, "demo-audio");
    }

    /// A large image made in bands of rows is joined back and placed whole (the vision tower
    /// attends across the image): the same prompt, one engine item that is not a piece, and the
    /// whole's encoder input value for value, on Qwen2-VL and Qwen3-VL (its 16-pixel patches).
    #[test]
    fn an_image_in_bands_is_placed_as_the_image_whole() {
        let cache = tempfile::tempdir().unwrap();
        let photo = std::fs::read(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../tests/fixtures/image/images/photo-640x480.jpg"),
        )
        .unwrap();
        for spec in ["demo", "demo-qwen3-vl"] {
            let model = runtime(spec, cache.path());
            let Made {
                plan,
                whole,
                parts,
                part_plans,
            } = whole_and_parts(&model, "image", &photo, |config| {
                config["min_pixels"] = 10_000_000.into();
                config["max_pixels"] = 12_000_000.into();
            });
            // Bands are joined before encoding: the image plugin does not place them ahead.
            assert!(part_plans.is_none(), "{spec}");
            assert!(parts.len() > 1, "{spec}: {} parts", parts.len());
            let kind = MediaKind::Image;
            let bands = model
                .prompt
                .media_parts(kind, plan.tokens, &parts, 0)
                .unwrap();
            let whole = model.prompt.media_item(kind, plan.tokens, &whole).unwrap();
            assert_eq!(bands.ids, whole.ids, "{spec}");
            let ([band], [one]) = (&bands.items[..], &whole.items[..]) else {
                panic!(
                    "{spec}: {} and {} items",
                    bands.items.len(),
                    whole.items.len()
                );
            };
            assert!(band.piece.is_none() && band.tokens == one.tokens, "{spec}");
            let values = |input: &EncodeInput| match input {
                EncodeInput::Vision {
                    pixel_values: PixelValues::Source(source),
                    grid,
                } => {
                    let mut values = Vec::new();
                    source.extend_f32(&mut values);
                    (values, *grid)
                }
                other => panic!("{spec}: {other:?}"),
            };
            assert!(values(&band.input) == values(&one.input), "{spec}");
        }
    }

    /// 65 s of a 16-bit mono WAV at 22.05 kHz: a chirp under a little noise.
    fn long_pcm_wav() -> Vec<u8> {
        let (rate, frames) = (22_050u32, 65 * 22_050u32);
        let mut wav = Vec::with_capacity(44 + 2 * frames as usize);
        for chunk in [
            &b"RIFF"[..],
            &(36 + 2 * frames).to_le_bytes(),
            b"WAVEfmt ",
            &16u32.to_le_bytes(),
            &1u16.to_le_bytes(),
            &1u16.to_le_bytes(),
            &rate.to_le_bytes(),
            &(2 * rate).to_le_bytes(),
            &2u16.to_le_bytes(),
            &16u16.to_le_bytes(),
            b"data",
            &(2 * frames).to_le_bytes(),
        ] {
            wav.extend_from_slice(chunk);
        }
        for i in 0..frames {
            let t = f64::from(i) / f64::from(rate);
            let chirp = 0.3 * (std::f64::consts::TAU * (200.0 + 15.0 * t) * t).sin();
            let noise = 0.02 * ((f64::from(i) * 12.9898).sin() * 43_758.545).fract();
            wav.extend_from_slice(&(((chirp + noise) * 32_767.0) as i16).to_le_bytes());
        }
        wav
    }

    /// The item made in parts, placed once all are made and placed beforehand with each part
    /// handed over after the request was submitted (last part first, so the engine holds the
    /// earlier pieces back until theirs arrive): the same prompt, the same encoder features bit
    /// for bit, the same greedy tokens as the item made whole.
    fn assert_pieces_are_the_whole(model: &ModelRuntime, kind: MediaKind, made: &Made, spec: &str) {
        let tokens = made.plan.tokens;
        let whole = model.prompt.media_item(kind, tokens, &made.whole).unwrap();
        let pieces = model
            .prompt
            .media_parts(kind, tokens, &made.parts, 0)
            .unwrap();
        assert_eq!(pieces.ids, whole.ids, "{spec}: the same prompt");
        let whole_features = encode(model, &whole.items[0].input);
        let (features, inputs) = piece_features(model, &pieces);
        assert_eq!(inputs, made.parts.len(), "{spec}");
        assert!(
            features == *whole_features,
            "{spec}: the pieces' features are the whole's"
        );
        let (whole_tokens, prompt_len) = generate(model, &whole);
        let (piece_tokens, _) = generate(model, &pieces);
        assert_eq!(
            piece_tokens, whole_tokens,
            "{spec}: {prompt_len} prompt tokens"
        );

        let plans = made
            .part_plans
            .as_ref()
            .expect("the plugin places its parts");
        let (coming, makers) = model
            .prompt
            .coming_parts(kind, tokens, plans, &[], 0)
            .unwrap()
            .unwrap();
        assert_eq!(
            coming.ids, whole.ids,
            "{spec}: placed beforehand, the same prompt"
        );
        let placed = |p: &PlacedItem| -> Vec<_> {
            p.items
                .iter()
                .map(|i| (i.tokens, i.part, i.piece, i.time_interval))
                .collect()
        };
        assert_eq!(placed(&coming), placed(&pieces), "{spec}");
        let (events, _) = submit(model, &coming);
        for (maker, part) in makers.into_iter().zip(&made.parts).rev() {
            maker.deliver(Ok(part.clone()));
        }
        assert_eq!(
            run(events).unwrap(),
            whole_tokens,
            "{spec}: pieces handed over after submission"
        );
    }

    /// A piece that fails to be made, or is made unlike its part plan, fails its request as an
    /// encode error of its item; the engine goes on with the next request.
    #[test]
    fn a_piece_made_wrong_or_not_at_all_fails_its_item() {
        let cache = tempfile::tempdir().unwrap();
        let model = runtime("demo", cache.path());
        let made = video_whole_and_parts(&model);
        let plans = made.part_plans.unwrap();
        let kind = MediaKind::Video;
        let tokens = made.plan.tokens;
        // What goes wrong with part 1 (the others are made right), and what the failure says.
        enum Fault {
            PluginFailed,
            /// The whole video's tensors where one part was placed.
            UnlikeItsPlan,
            MakerGone,
        }
        for (fault, expected) in [
            (Fault::PluginFailed, "the plugin failed"),
            (Fault::UnlikeItsPlan, "part plan"),
            // Which part of which item was never made (item 3 below).
            (Fault::MakerGone, "media item 3 part 1 was never made"),
        ] {
            let (coming, makers) = model
                .prompt
                .coming_parts(kind, tokens, &plans, &[], 3)
                .unwrap()
                .unwrap();
            let (events, _) = submit(&model, &coming);
            for (n, maker) in makers.into_iter().enumerate() {
                match (n, &fault) {
                    (1, Fault::PluginFailed) => maker.deliver(Err("the plugin failed".into())),
                    (1, Fault::UnlikeItsPlan) => maker.deliver(Ok(made.whole.clone())),
                    (1, Fault::MakerGone) => drop(maker),
                    _ => maker.deliver(Ok(made.parts[n].clone())),
                }
            }
            match run(events) {
                Err(mmgate_inference::engine::Failure::Encode { message, .. }) => {
                    assert!(message.contains(expected), "{expected}: {message}")
                }
                other => panic!("{expected}: {other:?}"),
            }
        }
        let whole = model.prompt.media_item(kind, tokens, &made.whole).unwrap();
        let (ids, _) = generate(&model, &whole);
        assert!(!ids.is_empty());
    }
}
