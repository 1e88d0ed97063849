//! Gemma 4's image processor (`Gemma4ImageProcessor`): an image resized, aspect kept, to the
//! largest size of whole `patch_size × pooling_kernel_size` cells within `max_soft_tokens` pooled
//! cells (up or down: a small image is enlarged), each cell one soft token. Its tokens therefore
//! depend on its aspect ratio only, nearly `max_soft_tokens` for any ordinary image; counted as
//! vLLM counts them (`_compute_num_soft_tokens`, which transformers' processor agrees with but for
//! strips past about 250:1, where both cap the count at `max_soft_tokens`).
//!
//! Nothing can be cut by resizing: a context that cannot hold an image at the model's
//! `max_soft_tokens` is refused. The plugin plans and counts for an engine that makes the tensors.

use mmgate_plugin_sdk::imageops::{Filter, RgbImage};
use mmgate_plugin_sdk::*;
use serde::Deserialize;
use serde_json::Value;

use super::config::{BaseConfig, positive, read};
use super::{ImageProcessor, boxed};
use crate::choices::{Choices, tokens_u32};

/// The soft token counts transformers' processor and vLLM accept.
const SUPPORTED_SOFT_TOKENS: [usize; 5] = [70, 140, 280, 560, 1120];

pub fn make(config: &Value) -> PluginResult<Box<dyn ImageProcessor>> {
    boxed(Gemma4::from_config(config))
}

#[derive(Debug, Deserialize)]
struct Config {
    #[serde(flatten)]
    base: BaseConfig,
    max_soft_tokens: Option<usize>,
    pooling_kernel_size: Option<usize>,
}

struct Gemma4 {
    patch: usize,
    pooling: usize,
    max_soft_tokens: usize,
    filter: Filter,
}

impl Gemma4 {
    fn from_config(config: &Value) -> PluginResult<Self> {
        let config: Config = read(config)?;
        let max_soft_tokens = config.max_soft_tokens.unwrap_or(280);
        if !SUPPORTED_SOFT_TOKENS.contains(&max_soft_tokens) {
            return Err(PluginError::unsupported(format!(
                "processor config: max_soft_tokens {max_soft_tokens} is not one of \
                 {SUPPORTED_SOFT_TOKENS:?}"
            )));
        }
        Ok(Gemma4 {
            patch: config.base.patch_edge(16)?,
            pooling: positive(
                "pooling_kernel_size",
                config.pooling_kernel_size.unwrap_or(3),
            )?,
            max_soft_tokens,
            filter: config.base.filter(Filter::Bicubic)?,
        })
    }

    /// The size a `width`×`height` image is resized to, as (width, height), and its tokens.
    fn sized(&self, width: usize, height: usize) -> ((usize, usize), usize) {
        let unit = self.patch * self.pooling;
        let max_patches = (self.max_soft_tokens * self.pooling * self.pooling) as f64;
        let patches = (height as f64 / self.patch as f64) * (width as f64 / self.patch as f64);
        let scale = (max_patches / patches).sqrt();
        let side = |length: usize| {
            let cells = (length as f64 * scale / unit as f64).floor() as usize;
            (cells * unit).max(unit)
        };
        let (w, h) = (side(width), side(height));
        let cells = (h / self.patch) * (w / self.patch) / (self.pooling * self.pooling);
        ((w, h), cells.min(self.max_soft_tokens))
    }
}

impl ImageProcessor for Gemma4 {
    fn plan(
        &self,
        width: usize,
        height: usize,
        _jpeg: bool,
        budget: u32,
    ) -> PluginResult<TokenPlan> {
        let ((w, h), tokens) = self.sized(width, height);
        if tokens > budget as usize {
            return Err(PluginError::over_budget(
                tokens_u32(tokens)?,
                budget,
                format!(
                    "a {width}x{height} image costs {tokens} tokens at this model's \
                     max_soft_tokens of {} (its aspect ratio decides them, not its size)",
                    self.max_soft_tokens
                ),
            ));
        }
        let reason = format!("{width}x{height} resized to {w}x{h}: {tokens} tokens");
        TokenPlan::new(tokens_u32(tokens)?, false, reason, &Choices::sized(w, h))
    }

    fn whole_resize(&self, choices: &Choices) -> Option<(usize, usize, Filter)> {
        Some((choices.width, choices.height, self.filter))
    }

    fn reduced_image(&self, _image: RgbImage, _choices: &Choices) -> PluginResult<RgbImage> {
        Err(PluginError::internal("a Gemma 4 plan is never reduced"))
    }
}

#[cfg(test)]
mod tests {
    use crate::processor::for_config;

    /// transformers' Gemma4ImageProcessor at 280 soft tokens (16 px patches pooled 3x3), as
    /// `processor(images=...)["num_soft_tokens_per_image"]` gives them.
    #[test]
    fn tokens_follow_the_aspect_ratio_not_the_size() {
        let processor = for_config(r#"{"image_processor_type": "Gemma4ImageProcessor"}"#).unwrap();
        let tokens = |w, h| processor.plan(w, h, true, u32::MAX).unwrap().tokens;
        // 640x480: sqrt(2520·256/307200) = 1.449; 927/48 → 19, 695/48 → 14: 266 tokens.
        assert_eq!(tokens(640, 480), 19 * 14);
        assert_eq!(tokens(1280, 960), 19 * 14);
        assert_eq!(tokens(64, 48), 19 * 14);
        assert_eq!(tokens(1000, 1000), 16 * 16);
        let under = processor.plan(640, 480, true, 100);
        assert!(under.is_err());
        let unsupported =
            r#"{"image_processor_type": "Gemma4ImageProcessor", "max_soft_tokens": 100}"#;
        assert!(for_config(unsupported).is_err());
    }
}
