//! LLaVA-OneVision's videos (`LlavaOnevisionVideoProcessor`), planned and counted for an engine that
//! makes the tensors: every frame is resized to the vision tower's square (`size`) and its
//! features pooled by 2 a side, so each frame costs the same tokens, and the video one more (its
//! newline), as transformers' `LlavaOnevisionProcessor` and vLLM count them. The frames are chosen
//! evenly over the video (`nframes`, 32 unless configured; all of a shorter video's); under a
//! budget, fewer. They go to the engine as its frame list, each already at the tower's size.

use mmgate_plugin_sdk::imageops::{Filter, RgbImage};
use mmgate_plugin_sdk::*;
use serde::Deserialize;

use crate::sampling::{Strategy, linspace_indices};
use crate::{Choices, Source, tokens_u32};

/// The classes whose videos this module plans.
pub const CLASSES: &[&str] = &[
    "LlavaOnevisionVideoProcessor",
    "LlavaOnevisionImageProcessor",
];

/// Frames chosen when `nframes` is not configured (vLLM's video loader's default).
const DEFAULT_FRAMES: usize = 32;
/// transformers' and vLLM's `spatial_pool_stride`.
const POOL_STRIDE: usize = 2;

#[derive(Debug, Deserialize)]
struct Size {
    height: usize,
    width: usize,
}

/// The classes a processor config names (read first: other classes' keys differ).
#[derive(Debug, Deserialize)]
struct Classes {
    video_processor_type: Option<String>,
    image_processor_type: Option<String>,
}

#[derive(Debug, Deserialize)]
struct RawConfig {
    size: Option<Size>,
    /// The tower's patch size (the model's, which its family adds).
    patch_size: Option<usize>,
    nframes: Option<usize>,
}

pub struct OneVision {
    /// The tower's square, every frame's size.
    side: usize,
    tokens_per_frame: usize,
    frames: usize,
}

impl OneVision {
    /// The config's OneVision video processor, `None` for another class.
    pub fn from_config(json: &str) -> PluginResult<Option<OneVision>> {
        let classes: Classes = parse_config(json)?;
        let class = classes
            .video_processor_type
            .as_deref()
            .or(classes.image_processor_type.as_deref())
            .map(|c| c.strip_suffix("Fast").unwrap_or(c));
        if !class.is_some_and(|c| CLASSES.contains(&c)) {
            return Ok(None);
        }
        let raw: RawConfig = parse_config(json)?;
        let side = match raw.size {
            None => 384,
            Some(Size { height, width }) if height == width && height > 0 => height,
            Some(_) => {
                return Err(PluginError::unsupported(
                    "processor config: LLaVA-OneVision's frames need a square size",
                ));
            }
        };
        let patch = raw.patch_size.unwrap_or(14);
        let frames = raw.nframes.unwrap_or(DEFAULT_FRAMES);
        if patch == 0 || patch > side || frames == 0 {
            return Err(PluginError::unsupported(format!(
                "processor config: frames of {side} px in patches of {patch} px, {frames} of them"
            )));
        }
        let pooled = (side / patch).div_ceil(POOL_STRIDE);
        Ok(Some(OneVision {
            side,
            tokens_per_frame: pooled * pooled,
            frames,
        }))
    }

    fn tokens(&self, frames: usize) -> usize {
        frames * self.tokens_per_frame + 1
    }

    pub fn plan(&self, source: &Source, budget: Budget) -> PluginResult<TokenPlan> {
        let available = usize::try_from(source.frames).unwrap_or(usize::MAX);
        let wanted = self.frames.min(available);
        let max = budget.max_tokens as usize;
        let fit = max.saturating_sub(1) / self.tokens_per_frame;
        let frames = wanted.min(fit);
        if frames == 0 {
            return Err(PluginError::over_budget(
                tokens_u32(self.tokens(1))?,
                budget.max_tokens,
                format!(
                    "a frame of this model's videos costs {} tokens",
                    self.tokens_per_frame
                ),
            ));
        }
        let indices = linspace_indices(0, source.frames - 1, frames);
        let tokens = self.tokens(frames);
        let reduced = frames < wanted;
        let reason = if reduced {
            format!(
                "{frames} of {wanted} frames, evenly, at {0}x{0}: {tokens} tokens, to fit {max}",
                self.side
            )
        } else {
            format!(
                "{frames} frames, evenly, at {0}x{0}: {tokens} tokens",
                self.side
            )
        };
        let choices = Choices {
            strategy: Strategy::Uniform,
            sample_fps: frames as f64 / (source.frames as f64).max(1e-6) * source.fps,
            frame_indices: indices,
            width: self.side,
            height: self.side,
            source_frames: source.frames,
            source_fps_bits: source.fps.to_bits(),
        };
        TokenPlan::new(tokens_u32(tokens)?, reduced, reason, &choices)
    }

    /// A chosen frame at the tower's size (the engine's processor keeps a frame of that size).
    pub fn resize_frame(&self, frame: &RgbImage) -> RgbImage {
        frame.resize(self.side, self.side, Filter::Bicubic)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(frames: u64) -> Source {
        Source {
            frames,
            fps: 10.0,
            width: 640,
            height: 480,
            keyframes: Vec::new(),
        }
    }

    #[test]
    fn frames_are_chosen_evenly_and_cut_to_the_budget() {
        let config = r#"{"image_processor_type": "LlavaOnevisionImageProcessor",
            "size": {"height": 384, "width": 384}, "patch_size": 14}"#;
        let onevision = OneVision::from_config(config).unwrap().unwrap();
        // 27 patches a side pooled to 14: 196 a frame.
        assert_eq!(onevision.tokens_per_frame, 196);
        let plan = onevision
            .plan(
                &source(300),
                Budget {
                    max_tokens: u32::MAX,
                },
            )
            .unwrap();
        assert_eq!(plan.tokens, 32 * 196 + 1);
        assert!(!plan.reduced);
        let plan = onevision
            .plan(
                &source(10),
                Budget {
                    max_tokens: u32::MAX,
                },
            )
            .unwrap();
        assert_eq!(plan.tokens, 10 * 196 + 1);
        let plan = onevision
            .plan(&source(300), Budget { max_tokens: 1000 })
            .unwrap();
        assert_eq!(plan.tokens, 5 * 196 + 1);
        assert!(plan.reduced);
        assert!(
            onevision
                .plan(&source(300), Budget { max_tokens: 196 })
                .is_err()
        );
        // Other classes' keys are not read (Qwen3-VL's `size` holds pixel bounds).
        let qwen = r#"{"image_processor_type": "Qwen2VLImageProcessor"}"#;
        assert!(OneVision::from_config(qwen).unwrap().is_none());
        let qwen3 = r#"{"video_processor_type": "Qwen3VLVideoProcessor",
            "size": {"shortest_edge": 4096, "longest_edge": 25165824}}"#;
        assert!(OneVision::from_config(qwen3).unwrap().is_none());
    }
}
