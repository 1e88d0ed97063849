//! What an image plan chose, which the plugin's later calls read back (the plan's `choices`), shared
//! by the processors.

use mmgate_plugin_sdk::imageops::{Filter, RgbImage};
use mmgate_plugin_sdk::*;
use serde::{Deserialize, Serialize};

/// What `plan` chose; `preprocess` reads it back.
#[derive(Debug, Serialize, Deserialize)]
pub struct Choices {
    /// Size the image is resized to.
    pub width: usize,
    pub height: usize,
    /// Centre crop after the resize (fixed-size processors).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crop: Option<[usize; 2]>,
    /// Qwen2-VL `image_grid_thw`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grid_thw: Option<[usize; 3]>,
    /// Bands of rows the image is made in, on as many instances at once (contract 0.4's parts);
    /// absent: whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bands: Option<usize>,
    /// Views beside or instead of the whole image: Gemma 3's pan-and-scan crops, LLaVA-NeXT's
    /// tiles, InternVL's tiles and thumbnail.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crops: Option<usize>,
    /// A reduced plan of Gemma 3 or InternVL: the size the image is squashed to, so that the
    /// server's processor makes the planned crops or tiles.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub squashed: Option<[usize; 2]>,
    /// Idefics3's tiles as `[rows, columns]` (absent: not split), which its prompt spells out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tile_grid: Option<[usize; 2]>,
}

pub fn tokens_u32(tokens: usize) -> PluginResult<u32> {
    u32::try_from(tokens).map_err(|_| PluginError::limit(format!("{tokens} tokens is too many")))
}

impl Choices {
    /// `image` squashed to the size a reduced plan names (`squashed`), with `filter`: what the
    /// model's server is sent so that its processor makes the planned crops or tiles.
    pub fn squash(&self, image: RgbImage, filter: Filter) -> PluginResult<RgbImage> {
        let [w, h] = self
            .squashed
            .ok_or_else(|| PluginError::internal("a reduced plan names no squashed size"))?;
        Ok(image.into_resized(w, h, filter))
    }

    /// A plan of only a size (no crop, grid, bands or crops).
    pub fn sized(width: usize, height: usize) -> Self {
        Self {
            width,
            height,
            crop: None,
            grid_thw: None,
            bands: None,
            crops: None,
            squashed: None,
            tile_grid: None,
        }
    }
}
