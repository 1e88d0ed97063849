//! Reading HF `config.json` files. Checkpoints in the wild come in two layouts: the Hub's original
//! flat one (text fields at the top level, `rope_theta` + `rope_scaling: {type: "mrope"}`,
//! `vision_config.in_chans`) and the nested one transformers 5 writes (`text_config`,
//! `rope_parameters`, `in_channels`). Both are read through the same accessors here.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::backend::Activation;
use crate::error::{Error, Result};

/// A JSON object with the config file's path, for error messages.
pub(crate) struct Section<'a> {
    pub path: &'a Path,
    pub name: &'static str,
    pub value: &'a Value,
}

impl<'a> Section<'a> {
    pub(crate) fn err(&self, reason: String) -> Error {
        Error::Config {
            path: self.path.to_owned(),
            reason: format!(
                "{}{reason}",
                if self.name.is_empty() {
                    String::new()
                } else {
                    format!("{}: ", self.name)
                }
            ),
        }
    }

    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.value.get(key).filter(|v| !v.is_null())
    }

    pub fn usize_or(&self, keys: &[&str], default: Option<usize>) -> Result<usize> {
        for key in keys {
            if let Some(v) = self.get(key) {
                return v
                    .as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| {
                        self.err(format!("{key} must be a non-negative integer, got {v}"))
                    });
            }
        }
        default.ok_or_else(|| self.err(format!("missing {}", keys.join(" / "))))
    }

    pub fn usize(&self, key: &str) -> Result<usize> {
        self.usize_or(&[key], None)
    }

    pub fn f32_or(&self, key: &str, default: f32) -> Result<f32> {
        match self.get(key) {
            Some(v) => v
                .as_f64()
                .map(|f| f as f32)
                .ok_or_else(|| self.err(format!("{key} must be a number, got {v}"))),
            None => Ok(default),
        }
    }

    pub fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.err(format!("{key} must be true or false"))),
            None => Ok(default),
        }
    }

    pub fn activation(&self, key: &str, default: &str) -> Result<Activation> {
        let name = match self.get(key) {
            Some(v) => v
                .as_str()
                .ok_or_else(|| self.err(format!("{key} must be a string")))?,
            None => default,
        };
        Activation::from_hf(name)
            .ok_or_else(|| self.err(format!("{key} {name:?} is not supported")))
    }

    /// Token ids that may be one integer or a list (`eos_token_id`).
    pub fn token_ids(&self, key: &str) -> Result<Vec<u32>> {
        let one = |v: &Value| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| self.err(format!("{key} must hold token ids")))
        };
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items.iter().map(one).collect(),
            Some(v) => Ok(vec![one(v)?]),
        }
    }

    pub fn sub(&self, key: &str, name: &'static str) -> Option<Section<'a>> {
        self.get(key)
            .filter(|v| v.is_object())
            .map(|value| Section {
                path: self.path,
                name,
                value,
            })
    }
}

/// The parsed `config.json` of a model directory.
pub struct ConfigFile {
    pub path: PathBuf,
    pub value: Value,
}

impl ConfigFile {
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        let value: Value = serde_json::from_str(&text).map_err(|e| Error::Config {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        if !value.is_object() {
            return Err(Error::Config {
                path,
                reason: "not a JSON object".into(),
            });
        }
        Ok(Self { path, value })
    }

    pub(crate) fn root(&self) -> Section<'_> {
        Section {
            path: &self.path,
            name: "",
            value: &self.value,
        }
    }

    pub fn model_type(&self) -> Option<&str> {
        self.value.get("model_type").and_then(|v| v.as_str())
    }

    /// The LLM's config: the `text_config` object, or the top level of a flat config.
    pub fn text_config(&self) -> Result<TextConfig> {
        let root = self.root();
        match root.sub("text_config", "text_config") {
            Some(t) => TextConfig::parse(&t, &root),
            None => TextConfig::parse(&root, &root),
        }
    }

    /// A config error naming this file.
    pub(crate) fn error(&self, reason: String) -> Error {
        Error::Config {
            path: self.path.clone(),
            reason,
        }
    }

    /// Reads `dir/config.json` and checks it describes a `model_type` model.
    pub(crate) fn read_of_type(dir: &Path, model_type: &str) -> Result<Self> {
        Self::read_of_types(dir, &[model_type])
    }

    /// Reads `dir/config.json` and checks its `model_type` is one of `model_types`.
    pub(crate) fn read_of_types(dir: &Path, model_types: &[&str]) -> Result<Self> {
        let file = Self::read(dir)?;
        match file.model_type() {
            Some(t) if model_types.contains(&t) => Ok(file),
            other => Err(file.error(format!(
                "model_type {other:?} is not {}",
                model_types.join(" or ")
            ))),
        }
    }
}

/// The Qwen2 LLM's hyper-parameters (also the text half of Qwen2-VL and Qwen2-Audio).
#[derive(Debug, Clone, PartialEq)]
pub struct TextConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    /// M-RoPE's split of the rotary frequencies among (temporal, height, width); `None` for plain
    /// 1-D RoPE.
    pub mrope_section: Option<Vec<usize>>,
    /// Dimensions of each head the rotary embedding turns (`head_dim` unless the config's
    /// `partial_rotary_factor` says less, as Qwen3.5's does).
    pub rotary_dim: usize,
    /// Qwen3-VL's interleaved assignment of the M-RoPE frequencies (see
    /// [`crate::rope::frequency_components`]).
    pub mrope_interleaved: bool,
    pub activation: Activation,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    pub eos_token_ids: Vec<u32>,
}

impl TextConfig {
    /// Reads the text config from `text` (the `text_config` object, or the top level of a flat
    /// config); `root` supplies keys some checkpoints keep only at the top level.
    pub(crate) fn parse(text: &Section<'_>, root: &Section<'_>) -> Result<Self> {
        let hidden_size = text.usize("hidden_size")?;
        let heads = text.usize("num_attention_heads")?;
        let kv_heads = text.usize_or(&["num_key_value_heads"], Some(heads))?;
        let err = |reason: String| Error::Config {
            path: text.path.to_owned(),
            reason,
        };
        if heads == 0 || kv_heads == 0 || heads % kv_heads != 0 {
            return Err(err(format!(
                "{heads} attention heads cannot share {kv_heads} key/value heads"
            )));
        }
        let head_dim = text.usize_or(&["head_dim"], Some(hidden_size / heads))?;
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(err(format!(
                "head_dim {head_dim} must be even and positive"
            )));
        }
        let rope = text
            .sub("rope_parameters", "rope_parameters")
            .or_else(|| text.sub("rope_scaling", "rope_scaling"));
        let rope_type = rope
            .as_ref()
            .and_then(|r| r.get("rope_type").or_else(|| r.get("type")))
            .and_then(|v| v.as_str())
            .unwrap_or("default");
        if !matches!(rope_type, "default" | "mrope") {
            return Err(err(format!(
                "rope type {rope_type:?} is not supported (default, mrope)"
            )));
        }
        let rope_theta = match rope.as_ref().filter(|r| r.get("rope_theta").is_some()) {
            Some(r) => r.f32_or("rope_theta", 0.0)?,
            None => text.f32_or("rope_theta", root.f32_or("rope_theta", 10000.0)?)?,
        };
        let rotary_fraction = match rope.as_ref() {
            Some(r) => r.f32_or(
                "partial_rotary_factor",
                text.f32_or("partial_rotary_factor", 1.0)?,
            )?,
            None => text.f32_or("partial_rotary_factor", 1.0)?,
        };
        let rotary_dim = (head_dim as f32 * rotary_fraction).round() as usize;
        let fits = rotary_fraction > 0.0 && rotary_fraction <= 1.0;
        if !(fits && rotary_dim.is_multiple_of(2)) {
            return Err(err(format!(
                "partial_rotary_factor {rotary_fraction} of head_dim {head_dim} is not an even \
                 number of dimensions"
            )));
        }
        let mrope_section = match rope.as_ref().and_then(|r| r.get("mrope_section")) {
            Some(v) => {
                let parts: Option<Vec<usize>> = v.as_array().map(|a| {
                    a.iter()
                        .filter_map(|x| x.as_u64().map(|n| n as usize))
                        .collect()
                });
                let parts =
                    parts.ok_or_else(|| err("mrope_section must be a list of integers".into()))?;
                if parts.iter().sum::<usize>() != rotary_dim / 2 || parts.len() != 3 {
                    return Err(err(format!(
                        "mrope_section {parts:?} must be 3 parts summing to half the rotary \
                         dimensions = {}",
                        rotary_dim / 2
                    )));
                }
                Some(parts)
            }
            None => None,
        };
        if text.bool_or("use_sliding_window", false)? {
            return Err(err("use_sliding_window is not supported".into()));
        }
        let eos = text.token_ids("eos_token_id")?;
        Ok(Self {
            vocab_size: text.usize("vocab_size")?,
            hidden_size,
            intermediate_size: text.usize("intermediate_size")?,
            layers: text.usize("num_hidden_layers")?,
            heads,
            kv_heads,
            head_dim,
            rms_norm_eps: text.f32_or("rms_norm_eps", 1e-6)?,
            rope_theta,
            mrope_interleaved: rope
                .as_ref()
                .map_or(Ok(false), |r| r.bool_or("mrope_interleaved", false))?,
            mrope_section,
            rotary_dim,
            activation: text.activation("hidden_act", "silu")?,
            tie_word_embeddings: root.bool_or(
                "tie_word_embeddings",
                text.bool_or("tie_word_embeddings", false)?,
            )?,
            max_position_embeddings: text.usize_or(&["max_position_embeddings"], Some(32768))?,
            eos_token_ids: if eos.is_empty() {
                root.token_ids("eos_token_id")?
            } else {
                eos
            },
        })
    }
}
