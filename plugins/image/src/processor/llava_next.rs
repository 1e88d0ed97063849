//! LLaVA-NeXT's "anyres" (`LlavaNextImageProcessor`): the image is fitted into the best of the
//! model's `image_grid_pinpoints` and cut into tiles of the vision tower's size, beside a base view
//! of the whole. Its tokens, as transformers' `LlavaNextProcessor` and vLLM count them: the base
//! view's patches, then the tiles' patches with the padding the fit added taken off again, and a
//! newline token per row of them. They depend only on the image's size. LLaVA-OneVision
//! (`LlavaOnevisionImageProcessor`, "anyres_max_9") counts the same way but pools the tiles'
//! features down to about nine base views' worth.
//!
//! The plan counts them; under a budget it shrinks the image (aspect kept) until they fit, and the
//! image goes to the model's server at that size. The tensors are the server's to make: this
//! processor plans and counts for a model served in front of an engine.

use mmgate_plugin_sdk::imageops::{Filter, RgbImage};
use mmgate_plugin_sdk::*;
use serde::Deserialize;
use serde_json::Value;

use super::config::{BaseConfig, SizeConfig, SizeField, positive, read};
use super::{ImageProcessor, boxed};
use crate::choices::{Choices, tokens_u32};

pub fn llava_next(config: &Value) -> PluginResult<Box<dyn ImageProcessor>> {
    boxed(LlavaNext::from_config(config, false))
}

pub fn llava_onevision(config: &Value) -> PluginResult<Box<dyn ImageProcessor>> {
    boxed(LlavaNext::from_config(config, true))
}

#[derive(Debug, Deserialize)]
struct Config {
    #[serde(flatten)]
    base: BaseConfig,
    size: Option<SizeField>,
    crop_size: Option<SizeField>,
    /// The resolutions an image is fitted into, `[height, width]` each.
    image_grid_pinpoints: Option<Vec<[usize; 2]>>,
    /// Whether the base view keeps the class token ("full") or not ("default"); the model's,
    /// which its family adds.
    vision_feature_select_strategy: Option<String>,
    /// The base view's tokens beyond its patches (a class token: 1 for CLIP, 0 for SigLIP); the
    /// model's, which its family adds.
    num_additional_image_tokens: Option<usize>,
    /// OneVision's "anyres_max_N": the tiles' features pooled to about N views' worth.
    vision_aspect_ratio: Option<String>,
}

pub struct LlavaNext {
    /// `(height, width)` of each resolution the image may be fitted into.
    pub pinpoints: Vec<(usize, usize)>,
    /// The vision tower's input size (a tile's side) and patch size.
    pub tile: usize,
    pub patch: usize,
    /// Tokens of the base view: the tower's patches, its class token if it has one
    /// (`num_additional_image_tokens`: CLIP's, not SigLIP's) unless `vision_feature_select_strategy`
    /// "default" drops one.
    pub base_tokens: usize,
    /// LLaVA-OneVision's "anyres_max_N": the tiles' features pooled down when they pass N base
    /// views' worth (by more than a tenth).
    pub max_views: Option<usize>,
    pub filter: Filter,
}

impl LlavaNext {
    /// `onevision`: LLaVA-OneVision's processor (SigLIP's tower of 384 px, no class token, the
    /// base view kept whole, the tiles pooled).
    fn from_config(config: &Value, onevision: bool) -> PluginResult<Self> {
        let config: Config = read(config)?;
        let tile = match (&config.crop_size, &config.size) {
            (
                Some(SizeField::Dict(SizeConfig {
                    height: Some(h), ..
                })),
                _,
            ) => *h,
            (Some(SizeField::Edge(edge)), _) => *edge,
            (
                None,
                Some(SizeField::Dict(SizeConfig {
                    shortest_edge: Some(edge),
                    ..
                })),
            ) => *edge,
            (
                None,
                Some(SizeField::Dict(SizeConfig {
                    height: Some(h), ..
                })),
            ) => *h,
            _ if onevision => 384,
            _ => 336,
        };
        let tile = positive("crop_size", tile)?;
        let pinpoints: Vec<(usize, usize)> = config
            .image_grid_pinpoints
            .unwrap_or_default()
            .into_iter()
            .map(|[h, w]| (h, w))
            .collect();
        if pinpoints.is_empty() || pinpoints.iter().any(|&(h, w)| h < tile || w < tile) {
            return Err(PluginError::unsupported(
                "processor config: anyres needs image_grid_pinpoints of at least a tile each",
            ));
        }
        let strategy = config.vision_feature_select_strategy.as_deref();
        let drops_one = match strategy.unwrap_or(if onevision { "full" } else { "default" }) {
            "default" => true,
            "full" => false,
            other => {
                return Err(PluginError::unsupported(format!(
                    "processor config: vision_feature_select_strategy {other:?} (default, full)"
                )));
            }
        };
        let patch = config.base.patch_edge(14)?;
        // CLIP's class token (LLaVA-NeXT's towers); SigLIP (OneVision's) has none.
        let additional = config
            .num_additional_image_tokens
            .unwrap_or(usize::from(!onevision));
        let side = tile / patch;
        let max_views = match (onevision, config.vision_aspect_ratio.as_deref()) {
            (false, _) => None,
            (true, None) => Some(9),
            (true, Some(aspect)) => Some(
                aspect
                    .strip_prefix("anyres_max_")
                    .and_then(|n| n.parse().ok())
                    .filter(|&n: &usize| n > 0)
                    .ok_or_else(|| {
                        PluginError::unsupported(format!(
                            "processor config: vision_aspect_ratio {aspect:?} (anyres_max_N)"
                        ))
                    })?,
            ),
        };
        Ok(LlavaNext {
            pinpoints,
            tile,
            patch,
            base_tokens: (side * side + additional).saturating_sub(usize::from(drops_one)),
            max_views,
            filter: config.base.filter(Filter::Bicubic)?,
        })
    }

    /// transformers' `select_best_resolution`: the most of the image's pixels kept, then the least
    /// space wasted; the first such pinpoint on a tie.
    fn best_resolution(&self, height: usize, width: usize) -> (usize, usize) {
        let (h, w) = (height as f64, width as f64);
        let mut best = self.pinpoints[0];
        let (mut most_kept, mut least_wasted) = (0usize, usize::MAX);
        for &(ph, pw) in &self.pinpoints {
            let scale = (pw as f64 / w).min(ph as f64 / h);
            let kept = ((w * scale) as usize * (h * scale) as usize).min(width * height);
            let wasted = ph * pw - kept;
            if kept > most_kept || (kept == most_kept && wasted < least_wasted) {
                (most_kept, least_wasted, best) = (kept, wasted, (ph, pw));
            }
        }
        best
    }

    /// Tokens of a `width`×`height` image.
    pub fn tokens(&self, width: usize, height: usize) -> usize {
        let side = self.tile / self.patch;
        let (best_h, best_w) = self.best_resolution(height, width);
        let (mut rows, mut columns) = (side * (best_h / self.tile), side * (best_w / self.tile));
        // Python's `round(x, 7)` before `int`: the ratio's float noise cannot flip a whole number.
        let rounded = |x: f64| ((x * 1e7).round() / 1e7) as usize;
        if width as f64 / height as f64 > columns as f64 / rows as f64 {
            let new_height = rounded(height as f64 * (columns as f64 / width as f64));
            rows -= (rows - new_height) / 2 * 2;
        } else {
            let new_width = rounded(width as f64 * (rows as f64 / height as f64));
            columns -= (columns - new_width) / 2 * 2;
        }
        if let Some(views) = self.max_views {
            // transformers' and vLLM's `current_height // ratio`: a float floor.
            let ratio = ((rows * columns) as f64 / (views * side * side) as f64).sqrt();
            if ratio > 1.1 {
                rows = (rows as f64 / ratio).floor() as usize;
                columns = (columns as f64 / ratio).floor() as usize;
            }
        }
        self.base_tokens + rows * columns + rows
    }
}

impl ImageProcessor for LlavaNext {
    fn plan(
        &self,
        width: usize,
        height: usize,
        _jpeg: bool,
        budget: u32,
    ) -> PluginResult<TokenPlan> {
        let native = self.tokens(width, height);
        let budget_tokens = budget as usize;
        let (w, h) = if native <= budget_tokens {
            (width, height)
        } else {
            // Shrunk a step at a time (aspect kept) until the tokens fit: the fit into the
            // pinpoints, and so the count, follow the size.
            let mut size = None;
            let mut least = native;
            for step in (1..100).rev() {
                let (sw, sh) = (width * step / 100, height * step / 100);
                if sw == 0 || sh == 0 {
                    break;
                }
                let tokens = self.tokens(sw, sh);
                least = least.min(tokens);
                if tokens <= budget_tokens {
                    size = Some((sw, sh));
                    break;
                }
            }
            size.ok_or_else(|| {
                PluginError::over_budget(
                    u32::try_from(least).unwrap_or(u32::MAX),
                    budget,
                    format!("{width}x{height} needs at least {least} tokens, however small"),
                )
            })?
        };
        let tokens = self.tokens(w, h);
        let reduced = (w, h) != (width, height);
        let (best_h, best_w) = self.best_resolution(h, w);
        let tiles = (best_h / self.tile) * (best_w / self.tile);
        let reason = if reduced {
            format!(
                "{width}x{height} resized to {w}x{h}: {tiles} tiles of {best_w}x{best_h} and a \
                 base view, {tokens} tokens, to fit the budget of {budget}; as it came it would \
                 cost {native}"
            )
        } else {
            format!(
                "{width}x{height}: {tiles} tiles of {best_w}x{best_h} and a base view, {tokens} tokens"
            )
        };
        let choices = Choices {
            crops: Some(tiles),
            ..Choices::sized(w, h)
        };
        TokenPlan::new(tokens_u32(tokens)?, reduced, reason, &choices)
    }

    fn whole_resize(&self, choices: &Choices) -> Option<(usize, usize, Filter)> {
        Some((choices.width, choices.height, self.filter))
    }

    /// The image at its planned size: the server's processor counts what the plan counted.
    fn reduced_image(&self, image: RgbImage, choices: &Choices) -> PluginResult<RgbImage> {
        Ok(image.into_resized(choices.width, choices.height, self.filter))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llava-v1.6's pinpoints and 336 px CLIP tower of 14 px patches.
    fn llava_v16() -> LlavaNext {
        LlavaNext {
            pinpoints: vec![(336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008)],
            tile: 336,
            patch: 14,
            base_tokens: 576,
            max_views: None,
            filter: Filter::Bicubic,
        }
    }

    /// Counts worked by hand from transformers' `LlavaNextProcessor._get_number_of_features`.
    #[test]
    fn tokens_follow_transformers() {
        let p = llava_v16();
        // 640x480 fits 672x672 best: 48x48 patches, 4:3 so rows 48 - 2*6 = 36; 576 base.
        assert_eq!(p.best_resolution(480, 640), (672, 672));
        assert_eq!(p.tokens(640, 480), 576 + 36 * 48 + 36);
        // A square image: no padding taken off.
        assert_eq!(p.tokens(672, 672), 576 + 48 * 48 + 48);
        // 1000x300: 336x1008 (24x72 patches); 1000/300 > 72/24: rows = round(300 * 72/1000) = 21,
        // padding (24 - 21) // 2 = 1 a side: 22 rows.
        assert_eq!(p.best_resolution(300, 1000), (336, 1008));
        assert_eq!(p.tokens(1000, 300), 576 + 22 * 72 + 22);
    }

    /// OneVision's pooling, worked by hand from transformers' `LlavaOnevisionProcessor`: SigLIP's
    /// 27x27 patches of 384 px tiles, no class token.
    #[test]
    fn onevision_pools_many_tiles_down_to_nine_views() {
        let p = LlavaNext {
            pinpoints: vec![(384, 384), (768, 768), (1152, 1152), (384, 1152)],
            tile: 384,
            patch: 14,
            base_tokens: 729,
            max_views: Some(9),
            filter: Filter::Bicubic,
        };
        // 1152x1152: 81x81 features; ratio sqrt(6561 / 6561) = 1, kept.
        assert_eq!(p.tokens(1152, 1152), 729 + 81 * 81 + 81);
        // 768x768 fits 768x768 (54x54 features), within nine views.
        assert_eq!(p.tokens(768, 768), 729 + 54 * 54 + 54);
        // 1152x384 (27x81): within.
        assert_eq!(p.tokens(1152, 384), 729 + 27 * 81 + 27);
        let q = LlavaNext {
            max_views: Some(4),
            ..p
        };
        // 81x81 over 4 views (54x54 worth): ratio 1.5, pooled to 54x54.
        assert_eq!(q.tokens(1152, 1152), 729 + 54 * 54 + 54);
    }

    #[test]
    fn a_budget_shrinks_the_image() {
        let p = llava_v16();
        let plan = p.plan(640, 480, false, 10_000).unwrap();
        assert!(!plan.reduced);
        let plan = p.plan(640, 480, false, 2000).unwrap();
        assert!(plan.reduced && plan.tokens <= 2000, "{}", plan.tokens);
        let choices: Choices = plan.choices().unwrap();
        assert_eq!(p.tokens(choices.width, choices.height) as u32, plan.tokens);
        assert!(p.plan(640, 480, false, 100).is_err());
    }
}
