//! Model families: everything mmgate knows of one architecture, one file each behind [`Family`].
//!
//! A family says which `config.json` it serves (`model_type`), which media it takes and their
//! placeholder tokens, how a plugin's tensors for an item become its encoder's input (and how many
//! tokens they make), where embeddings made elsewhere go in the prompt (M-RoPE), and how its
//! encoder and LLM load onto their devices. The gateway asks [`read`] for a model directory's
//! family and names none itself. Adding a family is a file here and a line in [`registry`].
//!
//! The inference core knows nothing of HTTP or of the plugin host: plugin tensors arrive as plain
//! values ([`ItemTensors`]), and [`crate::prompt`] lays out what a family makes of them in the
//! prompt.

mod gemma3;
mod gemma4;
mod glm4v;
mod idefics3;
mod internvl;
mod llama4;
mod llava;
mod mistral3;
mod paddleocr_vl;
mod qwen2_audio;
mod qwen2_vl;
mod qwen3_vl;
mod vision;

use std::path::Path;
use std::sync::Arc;

use crate::backend::Backend;
use crate::devices::OpenDevice;
use crate::engine::{
    EncodeInput, Encoder, EncoderPool, Engine, EngineConfig, FeatureStore, PositionScheme,
    StartEngine,
};
use crate::error::{Error, Result};
pub use crate::item_tensors::ItemTensors;
use crate::models::Qwen2;
use crate::models::config::{ConfigFile, TextConfig};
use crate::rope::Grid;
use crate::text::{ContentPart, TextProcessor};

/// The kinds of media a request can carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MediaKind {
    Image,
    Video,
    Audio,
}

impl MediaKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::Image => "image",
            Self::Video => "video",
            Self::Audio => "audio",
        }
    }

    pub fn content_part(self) -> ContentPart {
        match self {
            Self::Image => ContentPart::Image,
            Self::Video => ContentPart::Video,
            Self::Audio => ContentPart::Audio,
        }
    }
}

/// What a family makes of an item's plugin tensors.
#[derive(Debug)]
pub struct PlannedInput {
    pub input: EncodeInput,
    /// Tokens the encoder makes of it.
    pub tokens: usize,
    /// M-RoPE's temporal step (1 but for Qwen2.5-VL videos).
    pub time_interval: f32,
    /// How the item's tokens sit in the prompt in place of its one templated placeholder: empty
    /// for one run of `tokens` placeholders; otherwise runs of the encoder's tokens in order, each
    /// between texts the model's processor writes (a Qwen3-VL video: a run per temporal patch,
    /// after its timestamp).
    pub runs: Vec<PromptRun>,
}

/// One run of an item's placeholder tokens in the prompt (see [`PlannedInput::runs`]).
#[derive(Debug, Clone, PartialEq)]
pub struct PromptRun {
    /// Text before the run, as the tokenizer reads a prompt (special tokens included).
    pub before: String,
    pub tokens: usize,
    /// The grid that places the run's tokens (M-RoPE).
    pub grid: Grid,
    /// Text after the run.
    pub after: String,
    /// Where the run is in its video, in seconds, when the family writes that into the prompt
    /// (a Qwen3-VL temporal patch's timestamp): what an engine given the run's embeddings out
    /// of band is told, to write the same text.
    pub at: Option<f64>,
}

/// Where an item's embeddings go in the prompt when they were made elsewhere.
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    /// A vision item's merged grid (M-RoPE); `None` for audio.
    pub grid: Option<Grid>,
    pub time_interval: f32,
    /// As [`PlannedInput::runs`].
    pub runs: Vec<PromptRun>,
}

/// An LLM loaded on its device, whatever its model and device.
pub struct LoadedLlm(Box<dyn StartEngine>);

impl LoadedLlm {
    /// Starts the engine that runs this LLM.
    pub fn start(
        self,
        config: EngineConfig,
        text: Arc<TextProcessor>,
        pool: Arc<EncoderPool>,
        store: Arc<FeatureStore>,
    ) -> Result<Engine> {
        self.0.start(config, text, pool, store)
    }
}

/// A model's encoders (one per encoder device) and its LLM, unless that runs elsewhere.
pub struct LoadedModel {
    pub encoders: Vec<Arc<dyn Encoder>>,
    pub llm: Option<LoadedLlm>,
}

/// The tensors by which an item made in bands of its patch rows is joined back into the whole (see
/// [`NativeFamily::row_bands`]): each band's patches are a run of the whole's, its grid the whole's
/// but for its height.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowBands {
    /// The `t, h, w` grid tensor: the bands' heights add up to the whole's.
    pub grid: &'static str,
    /// The patches, one per row: the bands' rows in order are the whole's.
    pub patches: &'static str,
}

/// An item as its plugin planned it, as [`FamilyModel::item_prompt`] writes it into the prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedItem {
    pub kind: MediaKind,
    /// Encoder tokens.
    pub tokens: usize,
    /// The plan's `choices` (the plugin's JSON object; `Null` for embeddings made here): for a
    /// family whose prompt text depends on more than the count (Idefics3's tile grid).
    pub choices: serde_json::Value,
}

impl PlannedItem {
    /// An item known only by its tokens.
    pub fn counted(kind: MediaKind, tokens: usize) -> Self {
        Self {
            kind,
            tokens,
            choices: serde_json::Value::Null,
        }
    }
}

/// A piece of an item's prompt ([`FamilyModel::item_prompt`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptPiece {
    /// Text, as a processor writes it into the prompt.
    Text(String),
    /// `count` times the token `id` (written as the tokenizer spells it).
    Tokens { id: u32, count: usize },
}

/// A registry entry: a family, matched by `config.json`'s `model_type`.
pub trait Family: Send + Sync {
    fn model_types(&self) -> &'static [&'static str];
    /// The model in `dir`, from its configs (no weights are read).
    fn read(&self, dir: &Path) -> Result<Arc<dyn FamilyModel>>;
}

/// One model of a family, as its config describes it: what its prompts are made of. That is all
/// an upstream-only family says (its engine runs it; the plugins plan its media, with the token
/// count its engine's processor makes); a family mmgate also runs says more in [`NativeFamily`].
pub trait FamilyModel: Send + Sync {
    /// The checkpoint's context (`max_position_embeddings`).
    fn context_length(&self) -> usize;
    fn media_kinds(&self) -> &'static [MediaKind];
    /// The token that stands for one item of `kind` in a templated prompt.
    fn placeholder(&self, kind: MediaKind) -> Option<u32>;
    /// Settings of the model's processor that come from the model's config rather than its
    /// processor config (Mistral 3's `spatial_merge_size`), as transformers' processor passes them
    /// to its image processor: added to the processor config the plugins get.
    fn processor_settings(&self) -> serde_json::Map<String, serde_json::Value> {
        serde_json::Map::new()
    }
    /// What a planned item is in the prompt, in place of its one templated placeholder, as the
    /// model's own processor writes it; `None` for a run of its tokens' placeholders. Its text is
    /// tokenized with the prompt around it (as the processor's is), so tokens may merge across
    /// its edges.
    fn item_prompt(&self, item: &PlannedItem) -> Result<Option<Vec<PromptPiece>>> {
        let _ = item;
        Ok(None)
    }
    /// How mmgate runs the model itself; `None` for a family served only in front of an engine
    /// that runs it (`media = "preprocess"` or `"forward"`).
    fn native(&self) -> Option<&dyn NativeFamily> {
        None
    }
}

/// What mmgate needs to run a family's model itself: its encoder's input and the placement of its
/// output in the prompt, its positions, and its weights on the devices.
pub trait NativeFamily: FamilyModel {
    fn text_config(&self) -> &TextConfig;
    fn positions(&self) -> PositionScheme;
    /// Feature sets the encoder makes beside each token's embedding (Qwen3-VL's deepstack), which
    /// the LLM adds to its first layers' hidden states: see [`EngineConfig::deepstack_levels`].
    fn deepstack_levels(&self) -> usize {
        0
    }
    /// Values per media token in the encoder's output: the LLM's width, once per feature set.
    fn embedding_width(&self) -> usize {
        self.text_config().hidden_size * (1 + self.deepstack_levels())
    }
    /// For an item of `kind` the encoder must see whole, because its attention spans all of it
    /// (an image: Qwen-VL towers attend across the whole frame), how parts the plugin made of it
    /// (bands of its patch rows) are joined before encoding; `None` where each part is encoded on
    /// its own as a piece of the item (a video's temporal patch groups, an audio file's chunks).
    fn row_bands(&self, kind: MediaKind) -> Option<RowBands> {
        let _ = kind;
        None
    }
    /// The encoder input for an item's plugin tensors, checked against the model's shapes.
    fn plan_input(&self, kind: MediaKind, tensors: &mut ItemTensors) -> Result<PlannedInput>;
    /// Where `tokens` embeddings of an item made elsewhere go, from the small tensors that place
    /// it (a vision item's grid, a video's seconds between temporal patches); `None` when there
    /// are none.
    fn place_embeddings(
        &self,
        kind: MediaKind,
        tensors: Option<&ItemTensors>,
        tokens: usize,
    ) -> Result<Placement>;
    /// Loads the encoder onto every encoder device and the LLM onto `llm` if given (the first
    /// encoder and the LLM from one read of the weights, which warns of tensors neither took).
    fn load(
        &self,
        dir: &Path,
        encoders: &[OpenDevice],
        llm: Option<&OpenDevice>,
    ) -> Result<LoadedModel>;
}

/// A model served only in front of an engine whose images (and videos, if it takes them) are each
/// a run of one placeholder token (however the plugin counts them), with settings its processor
/// takes from the model's config.
struct UpstreamImageModel {
    context: usize,
    image_token: u32,
    video_token: Option<u32>,
    settings: serde_json::Map<String, serde_json::Value>,
}

impl UpstreamImageModel {
    /// From `config.json`: its context (else `default_context`), its image token (the first of
    /// `token_keys` present, else `default_token`), and `settings`.
    fn read(
        config: &ConfigFile,
        default_context: usize,
        token_keys: &[&str],
        default_token: usize,
        settings: serde_json::Map<String, serde_json::Value>,
    ) -> Result<Self> {
        let image_token = config.root().usize_or(token_keys, Some(default_token))?;
        Ok(Self {
            context: upstream_context(config, default_context)?,
            image_token: u32::try_from(image_token).map_err(|_| {
                config.error(format!("image token {image_token} is not a token id"))
            })?,
            video_token: None,
            settings,
        })
    }

    /// Videos too, each a run of the token under the first of `token_keys` present (else
    /// `default_token`).
    fn with_videos(
        mut self,
        config: &ConfigFile,
        token_keys: &[&str],
        default_token: usize,
    ) -> Result<Self> {
        let token = config.root().usize_or(token_keys, Some(default_token))?;
        self.video_token = Some(
            u32::try_from(token)
                .map_err(|_| config.error(format!("video token {token} is not a token id")))?,
        );
        Ok(self)
    }
}

impl FamilyModel for UpstreamImageModel {
    fn context_length(&self) -> usize {
        self.context
    }

    fn media_kinds(&self) -> &'static [MediaKind] {
        match self.video_token {
            Some(_) => &[MediaKind::Image, MediaKind::Video],
            None => &[MediaKind::Image],
        }
    }

    fn placeholder(&self, kind: MediaKind) -> Option<u32> {
        match kind {
            MediaKind::Image => Some(self.image_token),
            MediaKind::Video => self.video_token,
            MediaKind::Audio => None,
        }
    }

    fn processor_settings(&self) -> serde_json::Map<String, serde_json::Value> {
        self.settings.clone()
    }
}

/// How an upstream-only family writes an image into the prompt when it is more than a run of its
/// placeholder (tokens around it, a tile grid spelled out).
trait ImagePrompt: Send + Sync {
    /// The pieces of `item`, an image whose placeholder token is `image_token`.
    fn write(&self, item: &PlannedItem, image_token: u32) -> Result<Vec<PromptPiece>>;
}

/// An [`UpstreamImageModel`] whose images `prompt` writes.
struct WrittenImages<P> {
    model: UpstreamImageModel,
    prompt: P,
}

impl<P: ImagePrompt> FamilyModel for WrittenImages<P> {
    fn context_length(&self) -> usize {
        self.model.context_length()
    }

    fn media_kinds(&self) -> &'static [MediaKind] {
        self.model.media_kinds()
    }

    fn placeholder(&self, kind: MediaKind) -> Option<u32> {
        self.model.placeholder(kind)
    }

    fn processor_settings(&self) -> serde_json::Map<String, serde_json::Value> {
        self.model.processor_settings()
    }

    fn item_prompt(&self, item: &PlannedItem) -> Result<Option<Vec<PromptPiece>>> {
        if item.kind != MediaKind::Image {
            return Ok(None);
        }
        self.prompt.write(item, self.model.image_token).map(Some)
    }
}

/// The context of a checkpoint that only an engine runs: its `text_config`'s
/// `max_position_embeddings`, else `default` (the family's released models'); nothing else of
/// the LLM is read.
fn upstream_context(config: &ConfigFile, default: usize) -> Result<usize> {
    match config.root().sub("text_config", "text_config") {
        Some(text) => text.usize_or(&["max_position_embeddings"], Some(default)),
        None => Ok(default),
    }
}

/// A JSON file of the model's directory beside `config.json` (its processor's or tokenizer's
/// config), if it has one.
fn json_file(dir: &Path, name: &str) -> Result<Option<serde_json::Value>> {
    let path = dir.join(name);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(Error::Io { path, source }),
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| Error::Config {
            path,
            reason: format!("not valid JSON: {e}"),
        })
}

/// A positive count under `key` in the model's `processor_config.json` (a tile's tokens, as the
/// processor takes them), if the file names one.
fn processor_count(dir: &Path, key: &str) -> Result<Option<usize>> {
    let Some(value) =
        json_file(dir, "processor_config.json")?.and_then(|mut v| v.get_mut(key).map(|v| v.take()))
    else {
        return Ok(None);
    };
    match value.as_u64().filter(|&n| n > 0) {
        Some(n) => Ok(Some(n as usize)),
        None => Err(Error::Config {
            path: dir.join("processor_config.json"),
            reason: format!("{key} {value} is not a positive number"),
        }),
    }
}

/// Every family mmgate serves.
pub fn registry() -> &'static [&'static dyn Family] {
    &[
        &qwen2_vl::Qwen2VlFamily,
        &qwen2_audio::Qwen2AudioFamily,
        &qwen3_vl::Qwen3VlFamily,
        &gemma3::Gemma3Family,
        &gemma4::Gemma4Family,
        &mistral3::Mistral3Family,
        &llava::LlavaFamily,
        &internvl::InternVlFamily,
        &glm4v::Glm4vFamily,
        &paddleocr_vl::PaddleOcrVlFamily,
        &idefics3::Idefics3Family,
        &llama4::Llama4Family,
    ]
}

/// Whether the checkpoint in `dir` is of a family mmgate knows (its `config.json`'s `model_type`).
pub fn is_known(dir: &Path) -> Result<bool> {
    let config = ConfigFile::read(dir)?;
    Ok(config
        .model_type()
        .is_some_and(|t| registry().iter().any(|f| f.model_types().contains(&t))))
}

/// The family model of the checkpoint in `dir`.
pub fn read(dir: &Path) -> Result<Arc<dyn FamilyModel>> {
    let config = ConfigFile::read(dir)?;
    let model_type = config.model_type();
    let family = registry()
        .iter()
        .find(|f| model_type.is_some_and(|t| f.model_types().contains(&t)))
        .ok_or_else(|| {
            let known: Vec<&str> = registry()
                .iter()
                .flat_map(|f| f.model_types().iter().copied())
                .collect();
            Error::Config {
                path: config.path.clone(),
                reason: format!(
                    "model_type {model_type:?} is not supported ({})",
                    known.join(", ")
                ),
            }
        })?;
    family.read(dir)
}

/// A family's loaders, generic over the devices' backends; [`load_on_devices`] picks the
/// instance for each pair of devices a config can name.
trait Loader {
    /// The encoder on `encoder` and the LLM on `llm`, from one read of the weights.
    fn load<E: Backend, L: Backend>(
        &self,
        encoder: &E,
        llm: &L,
    ) -> Result<(Arc<dyn Encoder>, Qwen2<L>)>;
    /// Only the encoder, reading nothing of the LLM's weights.
    fn load_encoder<E: Backend>(&self, device: &E) -> Result<Arc<dyn Encoder>>;
}

fn load_on_devices(
    loader: &impl Loader,
    encoders: &[OpenDevice],
    llm: Option<&OpenDevice>,
) -> Result<LoadedModel> {
    use OpenDevice::{Cpu, Cuda};
    let Some((first, others)) = encoders.split_first() else {
        return Err(Error::Input(
            "a model needs at least one encoder device".into(),
        ));
    };
    let (encoder, llm) = match (first, llm) {
        (Cpu(e), Some(Cpu(l))) => loaded(loader.load(e, l)?),
        (Cpu(e), Some(Cuda(l))) => loaded(loader.load(e, l)?),
        (Cuda(e), Some(Cpu(l))) => loaded(loader.load(e, l)?),
        (Cuda(e), Some(Cuda(l))) => loaded(loader.load(e, l)?),
        (Cpu(e), None) => (loader.load_encoder(e)?, None),
        (Cuda(e), None) => (loader.load_encoder(e)?, None),
    };
    let mut all = vec![encoder];
    for device in others {
        all.push(match device {
            Cpu(d) => loader.load_encoder(d)?,
            Cuda(d) => loader.load_encoder(d)?,
        });
    }
    Ok(LoadedModel { encoders: all, llm })
}

fn loaded<L: Backend>(
    (encoder, llm): (Arc<dyn Encoder>, Qwen2<L>),
) -> (Arc<dyn Encoder>, Option<LoadedLlm>) {
    (encoder, Some(LoadedLlm(Box::new(llm))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(family: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/models")
            .join(family)
            .join("model")
    }

    #[test]
    fn the_registry_finds_each_fixture_family_by_its_model_type() {
        let vl = read(&fixture("qwen2-vl")).unwrap();
        assert_eq!(vl.media_kinds(), [MediaKind::Image, MediaKind::Video]);
        assert_eq!(vl.placeholder(MediaKind::Image), Some(500));
        assert_eq!(vl.placeholder(MediaKind::Audio), None);
        assert_eq!(
            vl.native().unwrap().positions(),
            PositionScheme::MRope { merge: 2 }
        );
        assert!(read(&fixture("qwen2.5-vl")).is_ok());
        let audio = read(&fixture("qwen2-audio")).unwrap();
        assert_eq!(audio.media_kinds(), [MediaKind::Audio]);
        assert_eq!(audio.placeholder(MediaKind::Audio), Some(504));
        assert_eq!(audio.native().unwrap().positions(), PositionScheme::Plain);
        let qwen3 = read(&fixture("qwen3-vl")).unwrap();
        assert_eq!(qwen3.media_kinds(), [MediaKind::Image, MediaKind::Video]);
        assert_eq!(qwen3.placeholder(MediaKind::Video), Some(501));
        assert_eq!(qwen3.native().unwrap().deepstack_levels(), 2);
        assert_eq!(qwen3.native().unwrap().embedding_width(), 3 * 64);
        assert_eq!(vl.native().unwrap().deepstack_levels(), 0);
    }

    #[test]
    fn an_unknown_model_type_names_the_supported_ones() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"model_type": "no_such_family"}"#,
        )
        .unwrap();
        let err = read(dir.path()).err().unwrap().to_string();
        for part in [
            "\"no_such_family\"",
            "is not supported",
            "qwen2_vl",
            "qwen2_5_vl",
            "qwen2_audio",
            "qwen3_vl",
        ] {
            assert!(err.contains(part), "{err}");
        }
    }
    /// docs/families.md's table names every model type the registry knows, and no other: it
    /// cannot drift from the code.
    #[test]
    fn the_family_table_in_the_docs_names_the_registry() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/families.md");
        let doc = std::fs::read_to_string(path).unwrap();
        let table = doc
            .lines()
            .skip_while(|line| !line.starts_with("| family (`model_type`)"))
            .skip(2)
            .take_while(|line| line.starts_with('|'));
        let mut documented = std::collections::BTreeSet::new();
        for row in table {
            let family = row.split('|').nth(1).unwrap();
            documented.extend(family.split('`').skip(1).step_by(2));
        }
        let registered: std::collections::BTreeSet<&str> = registry()
            .iter()
            .flat_map(|family| family.model_types().iter().copied())
            .collect();
        assert_eq!(documented, registered);
    }
}
