//! The fixed-size processors of CLIP (`CLIPImageProcessor`, and `CLIPFeatureExtractor` of older
//! checkpoints) and SigLIP (`SiglipImageProcessor`): resize (the shortest edge, or an exact size),
//! an optional centre crop, normalise → `pixel_values` [1, 3, H, W] f32. Every image costs the
//! same tokens: the patches of the size it ends at, and for LLaVA-1.5 (whose family adds its
//! tower's settings, as transformers' `LlavaProcessor` passes them) the class token where
//! `vision_feature_select_strategy` keeps it ("full"; "default" drops it).

use mmgate_plugin_sdk::imageops::{CLIP_MEAN, CLIP_STD, Filter, Normalize, RgbImage};
use mmgate_plugin_sdk::*;
use serde::Deserialize;
use serde_json::Value;

use super::config::{BaseConfig, SizeConfig, SizeField, positive, read};
use super::{ImageProcessor, boxed};
use crate::choices::{Choices, tokens_u32};

pub fn clip(config: &Value) -> PluginResult<Box<dyn ImageProcessor>> {
    boxed(Fixed::from_config(config, false))
}

pub fn siglip(config: &Value) -> PluginResult<Box<dyn ImageProcessor>> {
    boxed(Fixed::from_config(config, true))
}

#[derive(Debug, Deserialize)]
struct Config {
    #[serde(flatten)]
    base: BaseConfig,
    size: Option<SizeField>,
    do_center_crop: Option<bool>,
    crop_size: Option<SizeField>,
    /// LLaVA-1.5: the tower's tokens beyond its patches (CLIP's class token) and whether the
    /// features keep it; the model's, which its family adds.
    num_additional_image_tokens: Option<usize>,
    vision_feature_select_strategy: Option<String>,
}

enum FixedResize {
    ShortestEdge(usize),
    Exact { width: usize, height: usize },
}

struct Fixed {
    resize: FixedResize,
    /// `(width, height)` of the centre crop after the resize.
    crop: Option<(usize, usize)>,
    patch: usize,
    /// Tokens beside the patches' (LLaVA-1.5's class token, where its features keep it).
    extra_tokens: usize,
    filter: Filter,
    normalize: Normalize,
}

impl Fixed {
    /// SigLIP's processor crops nothing unless told to and normalises to [-1, 1]; CLIP's crops
    /// and uses its own mean and std.
    fn from_config(config: &Value, siglip: bool) -> PluginResult<Self> {
        let config: Config = read(config)?;
        let resize = match config.size {
            Some(SizeField::Edge(edge)) => FixedResize::ShortestEdge(positive("size", edge)?),
            Some(SizeField::Dict(SizeConfig {
                shortest_edge: Some(edge),
                ..
            })) => FixedResize::ShortestEdge(positive("size.shortest_edge", edge)?),
            Some(SizeField::Dict(SizeConfig {
                height: Some(h),
                width: Some(w),
                ..
            })) => FixedResize::Exact {
                width: positive("size.width", w)?,
                height: positive("size.height", h)?,
            },
            _ => {
                return Err(PluginError::unsupported(
                    "processor config: size needs shortest_edge or height and width",
                ));
            }
        };
        let crop = match (config.do_center_crop.unwrap_or(!siglip), config.crop_size) {
            (false, _) => None,
            (true, Some(SizeField::Edge(edge))) => {
                let edge = positive("crop_size", edge)?;
                Some((edge, edge))
            }
            (
                true,
                Some(SizeField::Dict(SizeConfig {
                    height: Some(h),
                    width: Some(w),
                    ..
                })),
            ) => Some((
                positive("crop_size.width", w)?,
                positive("crop_size.height", h)?,
            )),
            (true, _) => {
                return Err(PluginError::unsupported(
                    "processor config: do_center_crop needs crop_size (height and width)",
                ));
            }
        };
        let additional = config.num_additional_image_tokens.unwrap_or(0);
        let extra_tokens = match config.vision_feature_select_strategy.as_deref() {
            None | Some("full") => additional,
            Some("default") => additional.saturating_sub(1),
            Some(other) => {
                return Err(PluginError::unsupported(format!(
                    "processor config: vision_feature_select_strategy {other:?} (default, full)"
                )));
            }
        };
        let (mean, std) = if siglip {
            ([0.5; 3], [0.5; 3])
        } else {
            (CLIP_MEAN, CLIP_STD)
        };
        Ok(Fixed {
            resize,
            crop,
            patch: config.base.patch_edge(14)?,
            extra_tokens,
            filter: config.base.filter(Filter::Bicubic)?,
            normalize: config.base.normalize(mean, std),
        })
    }
}

impl ImageProcessor for Fixed {
    fn plan(
        &self,
        width: usize,
        height: usize,
        _jpeg: bool,
        budget: u32,
    ) -> PluginResult<TokenPlan> {
        let (rw, rh) = match self.resize {
            FixedResize::ShortestEdge(edge) => shortest_edge_size(width, height, edge),
            FixedResize::Exact { width, height } => (width, height),
        };
        let (fw, fh) = self.crop.unwrap_or((rw, rh));
        let tokens = (fh / self.patch) * (fw / self.patch) + self.extra_tokens;
        if tokens > budget as usize {
            return Err(PluginError::over_budget(
                tokens_u32(tokens)?,
                budget,
                format!("this model's images always cost {tokens} tokens"),
            ));
        }
        let choices = Choices {
            crop: self.crop.map(|(w, h)| [w, h]),
            ..Choices::sized(rw, rh)
        };
        let reason = format!("{width}x{height} → {fw}x{fh}: fixed {tokens} tokens");
        TokenPlan::new(tokens_u32(tokens)?, false, reason, &choices)
    }

    fn whole_resize(&self, choices: &Choices) -> Option<(usize, usize, Filter)> {
        Some((choices.width, choices.height, self.filter))
    }

    fn reduced_image(&self, _image: RgbImage, _choices: &Choices) -> PluginResult<RgbImage> {
        Err(PluginError::internal(
            "a fixed-size processor's plan is never reduced",
        ))
    }

    fn preprocess(&self, image: RgbImage, choices: &Choices) -> PluginResult<Vec<Tensor>> {
        let mut resized = image.into_resized(choices.width, choices.height, self.filter);
        if let Some([cw, ch]) = choices.crop {
            // HF's center_crop: top = (h - ch) // 2, left = (w - cw) // 2, padding with zeros
            // when the crop is larger than the image.
            let top = (resized.height as isize - ch as isize).div_euclid(2);
            let left = (resized.width as isize - cw as isize).div_euclid(2);
            resized = resized.crop(left, top, cw, ch);
        }
        let (w, h) = (resized.width, resized.height);
        Ok(vec![Tensor::from_f32_bytes(
            "pixel_values",
            &[1, 3, h, w],
            self.normalize.planar_le_bytes(&resized),
        )?])
    }
}

/// CLIP's `get_resize_output_image_size` for `shortest_edge`: the short side becomes `edge`, the
/// long side `int(edge * long / short)`. Returns (width, height).
fn shortest_edge_size(width: usize, height: usize, edge: usize) -> (usize, usize) {
    let (short, long) = if width <= height {
        (width, height)
    } else {
        (height, width)
    };
    let new_long = (edge as f64 * long as f64 / short as f64) as usize;
    if width <= height {
        (edge, new_long)
    } else {
        (new_long, edge)
    }
}

#[cfg(test)]
mod tests {
    use crate::processor::for_config;

    /// LLaVA-1.5's CLIP at 336 px: 576 patches; the class token counted only where the features
    /// keep it.
    #[test]
    fn llava_counts_the_class_token_only_where_kept() {
        let tokens = |extra: &str| {
            let config = format!(
                r#"{{"image_processor_type": "CLIPImageProcessor", "size": {{"shortest_edge": 336}},
                    "crop_size": {{"height": 336, "width": 336}}{extra}}}"#
            );
            let processor = for_config(&config).unwrap();
            processor.plan(640, 480, true, u32::MAX).unwrap().tokens
        };
        assert_eq!(tokens(""), 576);
        let llava = r#", "num_additional_image_tokens": 1, "vision_feature_select_strategy""#;
        assert_eq!(tokens(&format!(r#"{llava}: "default""#)), 576);
        assert_eq!(tokens(&format!(r#"{llava}: "full""#)), 577);
        let config = r#"{"image_processor_type": "CLIPImageProcessor", "size": 336,
            "crop_size": 336, "vision_feature_select_strategy": "cls"}"#;
        assert!(for_config(config).is_err());
    }
}
