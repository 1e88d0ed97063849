//! Pixtral's image processor (`PixtralImageProcessor`, Mistral 3's too): an image at its own
//! resolution, shrunk only to fit `size.longest_edge`, then sized up to whole tokens of
//! `patch_size × spatial_merge_size` pixels (bicubic, CLIP mean and std). Its tokens are a row of
//! image tokens and an `[IMG_BREAK]` per token row (the last `[IMG_END]`): rows × (columns + 1).
//!
//! `spatial_merge_size` is the model's (Mistral 3 merges 2×2 patches into a token; Pixtral none):
//! its family adds it to the processor config, as transformers' `PixtralProcessor` passes it.
//! Under a budget the plan lowers the longest edge until the tokens fit; the image then goes to the
//! model's server at the planned size, which its processor keeps.

use mmgate_plugin_sdk::imageops::{CLIP_MEAN, CLIP_STD, Filter, Normalize, RgbImage};
use mmgate_plugin_sdk::*;
use serde::Deserialize;
use serde_json::Value;

use super::config::{BaseConfig, SizeConfig, SizeField, positive, read};
use super::{ImageProcessor, boxed};
use crate::choices::{Choices, tokens_u32};

pub fn make(config: &Value) -> PluginResult<Box<dyn ImageProcessor>> {
    boxed(Pixtral::from_config(config))
}

#[derive(Debug, Deserialize)]
struct Config {
    #[serde(flatten)]
    base: BaseConfig,
    size: Option<SizeField>,
    /// Patches merged into a token a side (the model's; its family adds it).
    spatial_merge_size: Option<usize>,
}

pub struct Pixtral {
    pub longest_edge: usize,
    /// Pixels a side of one token: the patch times the spatial merge.
    pub token_edge: usize,
    pub filter: Filter,
    pub normalize: Normalize,
}

impl Pixtral {
    fn from_config(config: &Value) -> PluginResult<Self> {
        let config: Config = read(config)?;
        let longest_edge = match config.size {
            Some(SizeField::Dict(SizeConfig {
                longest_edge: Some(edge),
                ..
            })) => positive("size.longest_edge", edge)?,
            None => 1024,
            _ => {
                return Err(PluginError::unsupported(
                    "processor config: Pixtral's size needs longest_edge",
                ));
            }
        };
        let patch = config.base.patch_edge(16)?;
        let merge = positive("spatial_merge_size", config.spatial_merge_size.unwrap_or(1))?;
        Ok(Pixtral {
            longest_edge,
            token_edge: patch * merge,
            filter: config.base.filter(Filter::Bicubic)?,
            normalize: config.base.normalize(CLIP_MEAN, CLIP_STD),
        })
    }

    /// transformers' `get_resize_output_image_size` with the longest edge `limit`: the image
    /// shrunk (floored) to fit, then each side up to whole tokens. Returns (width, height).
    fn resized(&self, width: usize, height: usize, limit: usize) -> (usize, usize) {
        let ratio = (height as f64 / limit as f64).max(width as f64 / limit as f64);
        let (mut w, mut h) = (width, height);
        if ratio > 1.0 {
            h = (height as f64 / ratio).floor() as usize;
            w = (width as f64 / ratio).floor() as usize;
        }
        let up = |side: usize| (side.max(1) - 1) / self.token_edge + 1;
        (up(w) * self.token_edge, up(h) * self.token_edge)
    }

    fn tokens(&self, (w, h): (usize, usize)) -> usize {
        (h / self.token_edge) * (w / self.token_edge + 1)
    }

    fn checked(&self, choices: &Choices) -> PluginResult<()> {
        let edge = self.token_edge;
        if choices.width == 0
            || choices.height == 0
            || !choices.width.is_multiple_of(edge)
            || !choices.height.is_multiple_of(edge)
        {
            return Err(PluginError::internal(format!(
                "planned size {}x{} is not whole tokens of {edge} px",
                choices.width, choices.height
            )));
        }
        Ok(())
    }
}

impl ImageProcessor for Pixtral {
    fn plan(
        &self,
        width: usize,
        height: usize,
        _jpeg: bool,
        budget: u32,
    ) -> PluginResult<TokenPlan> {
        let native = self.resized(width, height, self.longest_edge);
        let native_tokens = self.tokens(native);
        let budget_tokens = budget as usize;
        let (size, reduced) = if native_tokens <= budget_tokens {
            (native, false)
        } else {
            // A lower longest edge, as the server's processor would size the image under it: the
            // largest whose tokens fit (tokens never grow as the edge shrinks).
            let fits = (1..self.longest_edge)
                .rev()
                .map(|limit| self.resized(width, height, limit))
                .find(|&size| self.tokens(size) <= budget_tokens);
            match fits {
                Some(size) => (size, true),
                None => {
                    let least = self.tokens(self.resized(width, height, 1));
                    return Err(PluginError::over_budget(
                        tokens_u32(least)?,
                        budget,
                        format!("{width}x{height} needs at least {least} tokens"),
                    ));
                }
            }
        };
        let tokens = self.tokens(size);
        let (w, h) = size;
        let reason = if reduced {
            format!(
                "{width}x{height} resized to {w}x{h} ({tokens} tokens) to fit the budget of \
                 {budget}; its size within the longest edge would cost {native_tokens}"
            )
        } else {
            format!("{width}x{height} resized to {w}x{h}: {tokens} tokens")
        };
        let choices = Choices::sized(w, h);
        TokenPlan::new(tokens_u32(tokens)?, reduced, reason, &choices)
    }

    fn whole_resize(&self, choices: &Choices) -> Option<(usize, usize, Filter)> {
        Some((choices.width, choices.height, self.filter))
    }

    /// The image at its planned size, which the server's processor keeps as it is.
    fn reduced_image(&self, image: RgbImage, choices: &Choices) -> PluginResult<RgbImage> {
        self.checked(choices)?;
        Ok(image.into_resized(choices.width, choices.height, self.filter))
    }

    /// `pixel_values` [1, 3, H, W] and `image_sizes` [1, 2] (height, width).
    fn preprocess(&self, image: RgbImage, choices: &Choices) -> PluginResult<Vec<Tensor>> {
        let resized = self.reduced_image(image, choices)?;
        let (w, h) = (resized.width, resized.height);
        Ok(vec![
            Tensor::from_f32_bytes(
                "pixel_values",
                &[1, 3, h, w],
                self.normalize.planar_le_bytes(&resized),
            )?,
            Tensor::from_i64("image_sizes", &[1, 2], &[h as i64, w as i64])?,
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pixtral(longest_edge: usize, token_edge: usize) -> Pixtral {
        Pixtral {
            longest_edge,
            token_edge,
            filter: Filter::Bicubic,
            normalize: Normalize {
                rescale: 1.0 / 255.0,
                mean: [0.5; 3],
                std: [0.5; 3],
            },
        }
    }

    /// Sizes and counts worked by hand from transformers' source.
    #[test]
    fn sizes_follow_transformers() {
        let p = pixtral(1024, 16);
        // Within the edge: each side up to whole tokens.
        assert_eq!(p.resized(640, 480, 1024), (640, 480));
        assert_eq!(p.resized(650, 470, 1024), (656, 480));
        // 2048x1000: ratio 2, 1024x500, up to 1024x512.
        assert_eq!(p.resized(2048, 1000, 1024), (1024, 512));
        assert_eq!(p.tokens((1024, 512)), 32 * 65);
        assert_eq!(p.resized(1, 1, 1024), (16, 16));
        let merged = pixtral(336, 28);
        assert_eq!(merged.resized(640, 480, 336), (336, 252));
        assert_eq!(merged.tokens((336, 252)), 9 * 13);
    }

    #[test]
    fn a_budget_lowers_the_longest_edge() {
        let p = pixtral(336, 28);
        let plan = p.plan(640, 480, false, 1000).unwrap();
        assert_eq!((plan.tokens, plan.reduced), (117, false));
        let plan = p.plan(640, 480, false, 60).unwrap();
        assert!(plan.reduced && plan.tokens <= 60, "{}", plan.tokens);
        let choices: Choices = plan.choices().unwrap();
        // What the server's processor makes of the planned size: the same size, the same tokens.
        let again = p.resized(choices.width, choices.height, 336);
        assert_eq!(again, (choices.width, choices.height));
        assert_eq!(p.tokens(again) as u32, plan.tokens);
        assert!(p.plan(640, 480, false, 1).is_err());
    }
}
