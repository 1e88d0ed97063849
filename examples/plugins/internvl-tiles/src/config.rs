//! The processor configuration: InternVL3's `preprocessor_config.json` (transformers'
//! `GotOcr2ImageProcessor`), plus `image_seq_length` from its `processor_config.json` as an override.

use mmgate_plugin_sdk::imageops::{Filter, Normalize};
use mmgate_plugin_sdk::{PluginError, PluginResult, parse_config};
use serde::Deserialize;

/// The `image_processor_type`s this plugin implements.
pub const PROCESSOR_TYPES: &[&str] = &[
    "GotOcr2ImageProcessor",
    "GotOcr2ImageProcessorFast",
    "GotOcr2ImageProcessorPil",
];

/// ImageNet's mean and std, what InternVL checkpoints normalise with.
const IMAGENET_MEAN: [f32; 3] = [0.485, 0.456, 0.406];
const IMAGENET_STD: [f32; 3] = [0.229, 0.224, 0.225];

#[derive(Debug, Deserialize)]
struct Raw {
    image_processor_type: Option<String>,
    #[serde(default = "yes")]
    crop_to_patches: bool,
    #[serde(default = "one")]
    min_patches: u32,
    #[serde(default = "twelve")]
    max_patches: u32,
    size: Option<Size>,
    #[serde(default = "bicubic")]
    resample: u32,
    #[serde(default = "yes")]
    do_rescale: bool,
    rescale_factor: Option<f64>,
    #[serde(default = "yes")]
    do_normalize: bool,
    image_mean: Option<[f32; 3]>,
    image_std: Option<[f32; 3]>,
    #[serde(default = "tokens_per_tile")]
    image_seq_length: u32,
}

#[derive(Debug, Deserialize)]
struct Size {
    height: u32,
    width: u32,
}

fn yes() -> bool {
    true
}
fn one() -> u32 {
    1
}
fn twelve() -> u32 {
    12
}
fn bicubic() -> u32 {
    3
}
fn tokens_per_tile() -> u32 {
    256
}

/// A validated configuration.
#[derive(Debug)]
pub struct Config {
    pub crop_to_patches: bool,
    pub min_patches: u32,
    pub max_patches: u32,
    /// Tile side in pixels (square tiles).
    pub tile: u32,
    pub filter: Filter,
    pub normalize: Normalize,
    pub tokens_per_tile: u32,
}

impl Config {
    pub fn parse(json: &str) -> PluginResult<Config> {
        let raw: Raw = parse_config(json)?;
        if let Some(kind) = &raw.image_processor_type
            && !PROCESSOR_TYPES.contains(&kind.as_str())
        {
            return Err(PluginError::unsupported(format!(
                "image_processor_type {kind:?} is not InternVL tiling (supported: {})",
                PROCESSOR_TYPES.join(", ")
            )));
        }
        let size = raw.size.unwrap_or(Size {
            height: 448,
            width: 448,
        });
        if size.height != size.width || size.height == 0 || size.height > 4096 {
            return Err(PluginError::unsupported(format!(
                "tiles must be square and at most 4096 px (size is {}x{})",
                size.width, size.height
            )));
        }
        if raw.min_patches == 0 || raw.min_patches > raw.max_patches || raw.max_patches > 64 {
            return Err(PluginError::unsupported(format!(
                "need 1 <= min_patches <= max_patches <= 64 (min {}, max {})",
                raw.min_patches, raw.max_patches
            )));
        }
        let filter = Filter::from_pil_code(raw.resample).ok_or_else(|| {
            PluginError::unsupported(format!("resample {} is not supported", raw.resample))
        })?;
        if raw.image_seq_length == 0 {
            return Err(PluginError::unsupported(
                "image_seq_length must be positive",
            ));
        }
        let normalize = Normalize {
            rescale: if raw.do_rescale {
                raw.rescale_factor.unwrap_or(1.0 / 255.0)
            } else {
                1.0
            },
            mean: if raw.do_normalize {
                raw.image_mean.unwrap_or(IMAGENET_MEAN)
            } else {
                [0.0; 3]
            },
            std: if raw.do_normalize {
                raw.image_std.unwrap_or(IMAGENET_STD)
            } else {
                [1.0; 3]
            },
        };
        Ok(Config {
            crop_to_patches: raw.crop_to_patches,
            min_patches: raw.min_patches,
            max_patches: raw.max_patches,
            tile: size.height,
            filter,
            normalize,
            tokens_per_tile: raw.image_seq_length,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_internvl3s() {
        let config = Config::parse("{}").unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(
            (config.tile, config.min_patches, config.max_patches),
            (448, 1, 12)
        );
        assert_eq!(config.tokens_per_tile, 256);
        assert_eq!(config.normalize.mean, IMAGENET_MEAN);
    }

    #[test]
    fn other_processors_and_impossible_settings_are_refused() {
        for bad in [
            r#"{"image_processor_type": "Qwen2VLImageProcessor"}"#,
            r#"{"size": {"height": 448, "width": 224}}"#,
            r#"{"min_patches": 4, "max_patches": 2}"#,
            r#"{"resample": 42}"#,
            r#"{"image_seq_length": 0}"#,
        ] {
            assert!(
                matches!(Config::parse(bad), Err(PluginError::Unsupported(_))),
                "{bad}"
            );
        }
    }
}
