//! A model's prompts: what a request's text and media become in the LLM's input, read from the
//! model's directory without any weights (tokenizer, chat template, processor and generation
//! configs, context) and the placement of each media item, which its family decides
//! ([`placement`]). Enough to template a request, count its tokens and plan its media: a model
//! whose server preprocesses for itself needs no more.

mod placement;

use std::path::Path;
use std::sync::Arc;

pub use placement::{PartLayout, PieceMaker};

use crate::engine::MediaItem;
use crate::error::{Error, Result};
use crate::families::{
    self, FamilyModel, MediaKind, NativeFamily, PlannedItem, PromptPiece, RowBands,
};
use crate::models::GenerationConfig;
use crate::text::{ChatMessage, TextProcessor};

/// What a model's prompts are made of (see the module's doc).
pub struct PromptModel {
    pub name: String,
    /// What the model's family makes of its media (the registry's answer for its config).
    family: Arc<dyn FamilyModel>,
    pub text: Arc<TextProcessor>,
    /// `preprocessor_config.json` (and the video processor's), handed to the plugins.
    pub processor_config: String,
    /// `generation_config.json`: its eos ids end generations, its sampling settings are the
    /// defaults of requests that leave them out.
    pub generation: GenerationConfig,
    pub context_length: usize,
    /// Values per media token in the encoder's output (the LLM's width, once per feature set); 0
    /// for a family that runs only upstream.
    pub embedding_width: usize,
}

impl PromptModel {
    /// Reads a model directory's config, tokenizer, chat template, processor and generation
    /// configs; weights, if any, are not read. `max_model_len` is the context served, below the
    /// checkpoint's own (`max_position_embeddings`), as vLLM's `--max-model-len`.
    pub fn load(name: &str, dir: &Path, max_model_len: Option<usize>) -> Result<Self> {
        Self::with_family(name, dir, families::read(dir)?, max_model_len)
    }

    /// The prompt side of a model whose family is already read.
    pub fn with_family(
        name: &str,
        dir: &Path,
        family: Arc<dyn FamilyModel>,
        max_model_len: Option<usize>,
    ) -> Result<Self> {
        let embedding_width = family.native().map_or(0, |n| n.embedding_width());
        let checkpoint_context = family.context_length();
        let context_length = match max_model_len {
            Some(n) if n > checkpoint_context => {
                return Err(Error::Config {
                    path: dir.join("config.json"),
                    reason: format!(
                        "max_model_len {n} is over the checkpoint's context of \
                         {checkpoint_context} tokens (max_position_embeddings)"
                    ),
                });
            }
            Some(n) => n,
            None => checkpoint_context,
        };
        let processor_config = with_settings(dir, read_processor_config(dir)?, &*family)?;
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

    /// For a model whose server runs its own processor (`media = "preprocess"`): the processor
    /// config plugins get says so (`"mmgate_server_processor": true`), so they plan what that
    /// processor makes of an item where it differs from what this gateway would (HF's audio
    /// processors keep only the first 30 s chunk). `kwargs` are the settings that processor runs
    /// with over the checkpoint's (vLLM's `--mm-processor-kwargs`), which the plans follow too.
    pub fn for_server_processor(
        mut self,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Self> {
        let config_error = |reason: &str| Error::Config {
            path: "preprocessor_config.json".into(),
            reason: reason.to_owned(),
        };
        let mut config: serde_json::Value =
            serde_json::from_str(&self.processor_config).map_err(|_| config_error("not JSON"))?;
        let Some(fields) = config.as_object_mut() else {
            return Err(config_error("not a JSON object"));
        };
        for (key, value) in kwargs {
            fields.insert(key.clone(), value.clone());
        }
        fields.insert("mmgate_server_processor".into(), true.into());
        self.processor_config = config.to_string();
        Ok(self)
    }

    /// The model's family.
    pub fn family(&self) -> &Arc<dyn FamilyModel> {
        &self.family
    }

    /// How mmgate runs the model itself, or why it does not (an upstream-only family).
    pub fn native(&self) -> Result<&dyn NativeFamily> {
        native(&self.family, &self.name)
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

    /// Tokens of the prompt of `messages` (templated as `ids`, each media item one placeholder)
    /// once each item stands for the encoder tokens its plugin planned (`items`, in prompt
    /// order), as the model's own processor counts them: the text's tokens and the items' where
    /// the family writes an item as a run of placeholders; else the prompt tokenized with each
    /// item's text in its placeholder's place (tokens merge across an item's edges there, as they
    /// do in the processor).
    pub fn planned_prompt_tokens(
        &self,
        messages: &[ChatMessage],
        ids: &[u32],
        items: &[PlannedItem],
    ) -> Result<usize> {
        let mut texts = Vec::with_capacity(items.len());
        for item in items {
            texts.push(self.family.item_prompt(item)?);
        }
        if texts.iter().all(Option::is_none) {
            return Ok(self.text_tokens(ids) + items.iter().map(|i| i.tokens).sum::<usize>());
        }
        let templated = self.text.apply_chat_template(messages, true)?;
        let mut expanded = String::with_capacity(templated.len());
        let mut rest = templated.as_str();
        for (&PlannedItem { kind, tokens, .. }, text) in items.iter().zip(texts) {
            let placeholder = self.placeholder(kind)?;
            let spelled = self.token_text(placeholder)?;
            let Some(at) = rest.find(spelled.as_str()) else {
                return Err(Error::Input(
                    "the chat template placed fewer media placeholders than there are media items"
                        .into(),
                ));
            };
            expanded.push_str(&rest[..at]);
            rest = &rest[at + spelled.len()..];
            let pieces = text.unwrap_or(vec![PromptPiece::Tokens {
                id: placeholder,
                count: tokens,
            }]);
            for piece in pieces {
                match piece {
                    PromptPiece::Text(text) => expanded.push_str(&text),
                    PromptPiece::Tokens { id, count } => {
                        expanded.push_str(&self.token_text(id)?.repeat(count));
                    }
                }
            }
        }
        expanded.push_str(rest);
        Ok(self.text.encode(&expanded)?.len())
    }

    /// How the tokenizer spells token `id`.
    fn token_text(&self, id: u32) -> Result<String> {
        self.text.tokenizer().id_to_token(id).ok_or_else(|| {
            Error::Input(format!(
                "model {}: token {id} is not in its tokenizer's vocabulary",
                self.name
            ))
        })
    }

    /// The placeholder token for a media kind, or why this model does not take it.
    pub fn placeholder(&self, kind: MediaKind) -> Result<u32> {
        self.family.placeholder(kind).ok_or_else(|| {
            Error::Input(format!(
                "model {} does not take {} input",
                self.name,
                kind.name()
            ))
        })
    }

    /// For an item of `kind` its encoder must see whole, the tensors by which parts a plugin made
    /// of it (bands of its patch rows) join back into it before [`Self::media_item`] places it;
    /// `None` where each part is a piece of its own ([`Self::media_parts`]).
    pub fn row_bands(&self, kind: MediaKind) -> Option<RowBands> {
        self.family.native()?.row_bands(kind)
    }
}

/// `family`'s native side, or why model `name` has none.
fn native<'a>(family: &'a Arc<dyn FamilyModel>, name: &str) -> Result<&'a dyn NativeFamily> {
    family.native().ok_or_else(|| {
        Error::Input(format!(
            "model {name} is served only in front of an engine that runs it: mmgate does not \
             encode its media"
        ))
    })
}

/// Where a model's video processor config goes inside the processor config the plugins get.
const VIDEO_PROCESSOR_KEY: &str = "video_preprocessor_config";

/// The processor config the plugins get: `preprocessor_config.json`, and the model's own video
/// processor config (`video_preprocessor_config.json`, as Qwen3-VL ships) under
/// `"video_preprocessor_config"` when there is one: one string, so one cache key and one
/// argument, while the video plugin reads the video processor's keys over the image processor's.
/// A checkpoint as transformers 5 saves it has neither file but one `processor_config.json`
/// holding them (`image_processor`, or `feature_extractor` for audio, and `video_processor`): the
/// same config is made of those.
pub fn read_processor_config(dir: &Path) -> Result<String> {
    let read = |name: &str| -> Result<Option<(String, serde_json::Value)>> {
        let path = dir.join(name);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(Error::Io { path, source }),
        };
        let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Config {
            path: path.clone(),
            reason: format!("not valid JSON: {e}"),
        })?;
        if !value.is_object() {
            return Err(Error::Config {
                path,
                reason: "not a JSON object".into(),
            });
        }
        Ok(Some((text, value)))
    };
    let Some((text, mut config)) = read("preprocessor_config.json")? else {
        let Some((_, combined)) = read("processor_config.json")? else {
            return Err(Error::Config {
                path: dir.join("preprocessor_config.json"),
                reason: "it is missing (and so is processor_config.json)".into(),
            });
        };
        return from_combined(dir, combined, read("video_preprocessor_config.json")?);
    };
    let Some((_, video)) = read("video_preprocessor_config.json")? else {
        return Ok(text);
    };
    if let Some(fields) = config.as_object_mut() {
        fields.insert(VIDEO_PROCESSOR_KEY.into(), video);
    }
    Ok(config.to_string())
}

/// The processor config the plugins get for the model in `dir`, as a served model's
/// ([`PromptModel::processor_config`]): [`read_processor_config`], with the settings its family
/// adds from `config.json` when the directory has one of a family mmgate knows (a directory of
/// only a processor config, or of another architecture, gets the processor config alone).
pub fn plugin_processor_config(dir: &Path) -> Result<String> {
    let config = read_processor_config(dir)?;
    if !dir.join("config.json").is_file() || !families::is_known(dir)? {
        return Ok(config);
    }
    with_settings(dir, config, &*families::read(dir)?)
}

/// `config` (a processor config) with the settings `family` adds from the model's config.
fn with_settings(dir: &Path, config: String, family: &dyn FamilyModel) -> Result<String> {
    let settings = family.processor_settings();
    if settings.is_empty() {
        return Ok(config);
    }
    let mut value: serde_json::Value =
        serde_json::from_str(&config).map_err(|e| Error::Config {
            path: dir.join("preprocessor_config.json"),
            reason: format!("not valid JSON: {e}"),
        })?;
    if let Some(fields) = value.as_object_mut() {
        fields.extend(settings);
    }
    Ok(value.to_string())
}

/// [`read_processor_config`] of a transformers 5 `processor_config.json`: its image processor (or,
/// for an audio model, its feature extractor) as the base, its video processor (or a separate
/// `video_preprocessor_config.json`) under [`VIDEO_PROCESSOR_KEY`].
fn from_combined(
    dir: &Path,
    combined: serde_json::Value,
    video_file: Option<(String, serde_json::Value)>,
) -> Result<String> {
    let part = |key: &str| combined.get(key).filter(|v| v.is_object()).cloned();
    let Some(mut config) = part("image_processor").or_else(|| part("feature_extractor")) else {
        return Err(Error::Config {
            path: dir.join("processor_config.json"),
            reason: "it holds neither an image_processor nor a feature_extractor".into(),
        });
    };
    let video = part("video_processor").or(video_file.map(|(_, value)| value));
    if let (Some(video), Some(fields)) = (video, config.as_object_mut()) {
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
pub fn expand_placeholders(ids: &[u32], media: &[PlacedItem]) -> Result<Vec<u32>> {
    let mut out = Vec::with_capacity(ids.len() + media.iter().map(|m| m.ids.len()).sum::<usize>());
    let mut used = vec![false; media.len()];
    for &id in ids {
        match (0..media.len()).find(|&i| !used[i] && media[i].placeholder() == Some(id)) {
            Some(i) => {
                used[i] = true;
                out.extend_from_slice(&media[i].ids);
            }
            None if media.iter().any(|m| m.placeholder() == Some(id)) => {
                return Err(Error::Input(
                    "the prompt has more media placeholders than media items".into(),
                ));
            }
            None => out.push(id),
        }
    }
    if used.iter().any(|u| !u) {
        return Err(Error::Input(
            "the chat template placed fewer media placeholders than there are media items".into(),
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::demo::{self, DemoFamily};
    use crate::item_tensors::ItemTensors;
    use crate::models::config::{ConfigFile, TextConfig};

    /// A family served only in front of an engine: its prompts, and nothing that runs it.
    struct UpstreamOnly {
        text: TextConfig,
    }

    impl FamilyModel for UpstreamOnly {
        fn context_length(&self) -> usize {
            self.text.max_position_embeddings
        }

        fn media_kinds(&self) -> &'static [MediaKind] {
            &[MediaKind::Image]
        }

        fn placeholder(&self, kind: MediaKind) -> Option<u32> {
            (kind == MediaKind::Image).then_some(500)
        }
    }

    /// An upstream-only family needs no weights code: its prompts are read, templated and counted,
    /// and what only a running model can do is refused with a reason.
    #[test]
    fn an_upstream_only_family_templates_and_counts_but_places_nothing() {
        let dir = tempfile::tempdir().unwrap();
        demo::write(dir.path(), DemoFamily::Qwen2Vl, 1).unwrap();
        let text = ConfigFile::read(dir.path()).unwrap().text_config().unwrap();
        let family = Arc::new(UpstreamOnly { text });
        let prompt = PromptModel::with_family("upstream", dir.path(), family, Some(64)).unwrap();
        assert_eq!(prompt.context_length, 64);
        assert_eq!(prompt.embedding_width, 0);
        assert_eq!(prompt.media_kinds(), [MediaKind::Image]);
        assert_eq!(prompt.text_tokens(&[1, 500, 2]), 2);
        assert!(prompt.placeholder(MediaKind::Audio).is_err());
        assert!(prompt.row_bands(MediaKind::Image).is_none());
        let refused = prompt
            .media_item(MediaKind::Image, 4, ItemTensors::default())
            .err()
            .unwrap()
            .to_string();
        assert!(
            refused.contains("served only in front of an engine"),
            "{refused}"
        );
        assert!(prompt.native().is_err());
    }

    /// A checkpoint as transformers 5 saves it (one `processor_config.json`) gives the plugins the
    /// config its older layout gives (`preprocessor_config.json`, `video_preprocessor_config.json`),
    /// for an image-and-video model and an audio one.
    #[test]
    fn a_transformers_5_processor_config_reads_as_the_older_files() {
        for (family, part) in [
            (DemoFamily::Qwen3Vl, "image_processor"),
            (DemoFamily::Qwen2Audio, "feature_extractor"),
        ] {
            let dir = tempfile::tempdir().unwrap();
            demo::write(dir.path(), family, 1).unwrap();
            let older: serde_json::Value =
                serde_json::from_str(&read_processor_config(dir.path()).unwrap()).unwrap();
            // Qwen3-VL ships a video processor config of its own: the test covers that key.
            let has_video = older.get(VIDEO_PROCESSOR_KEY).is_some();
            assert_eq!(has_video, family == DemoFamily::Qwen3Vl, "{family:?}");
            let read = |name: &str| -> Option<serde_json::Value> {
                let text = std::fs::read_to_string(dir.path().join(name)).ok()?;
                std::fs::remove_file(dir.path().join(name)).unwrap();
                Some(serde_json::from_str(&text).unwrap())
            };
            let mut combined =
                serde_json::json!({ part: read("preprocessor_config.json").unwrap() });
            if let Some(video) = read("video_preprocessor_config.json") {
                combined["video_processor"] = video;
            }
            std::fs::write(
                dir.path().join("processor_config.json"),
                combined.to_string(),
            )
            .unwrap();
            let newer: serde_json::Value =
                serde_json::from_str(&read_processor_config(dir.path()).unwrap()).unwrap();
            assert_eq!(newer, older, "{family:?}");
            std::fs::remove_file(dir.path().join("processor_config.json")).unwrap();
            let missing = read_processor_config(dir.path()).unwrap_err().to_string();
            assert!(missing.contains("processor_config.json"), "{missing}");
        }
    }
}
