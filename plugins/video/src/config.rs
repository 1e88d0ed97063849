//! The video processor configuration: the model's `preprocessor_config.json` (patch, merge and
//! temporal patch sizes, mean and std) plus the video sampling settings, named as qwen-vl-utils names
//! them (`fps`, `min_frames`, `max_frames`, `nframes`) or prefixed `video_` where the image processor
//! already uses the name (`video_min_pixels`, `video_max_pixels`, `video_total_pixels`).
//!
//! A model with a video processor of its own (`video_preprocessor_config.json`, which the host
//! hands over under [`VIDEO_CONFIG_KEY`]) is read from that file's keys over the image processor's.
//! `Qwen3VLVideoProcessor` follows transformers' rules rather than qwen-vl-utils': `size`'s
//! `shortest_edge` and `longest_edge` bound the pixels of all the frames together, and frames are
//! sampled without rounding to pairs.

use mmgate_plugin_sdk::imageops::{
    CLIP_MEAN, CLIP_STD, Normalize, RgbImage, resize_like_torch_uint8, resize_like_torchvision,
};
use mmgate_plugin_sdk::*;
use serde::Deserialize;

use crate::sampling::{FRAME_FACTOR, Strategy, floor_by_factor, qwen3_smart_resize, smart_resize};

/// Processor classes whose video path this plugin implements.
pub const SUPPORTED: &[&str] = &[
    "Qwen2VLImageProcessor",
    "Qwen2VLImageProcessorFast",
    "Qwen2VLVideoProcessor",
    "Qwen3VLVideoProcessor",
    // Planned and counted only (`onevision`).
    "LlavaOnevisionVideoProcessor",
    "LlavaOnevisionImageProcessor",
];

/// Where the host puts a model's `video_preprocessor_config.json` inside the processor config.
pub const VIDEO_CONFIG_KEY: &str = "video_preprocessor_config";

// transformers' `Qwen3VLVideoProcessor` defaults.
const QWEN3_MIN_PIXELS: f64 = (128 * 32 * 32) as f64;
const QWEN3_MAX_PIXELS: f64 = (32 * 32 * 768) as f64;

/// Whose rules choose the frames and their size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rules {
    /// qwen-vl-utils' (Qwen2-VL, Qwen2.5-VL): pixel bounds per frame, frames in pairs.
    QwenVlUtils,
    /// transformers' `Qwen3VLVideoProcessor`: pixel bounds over all the frames.
    Qwen3Vl,
}

#[derive(Debug, Default, Deserialize)]
struct SizeConfig {
    shortest_edge: Option<f64>,
    longest_edge: Option<f64>,
}

// qwen-vl-utils' constants.
const FPS: f64 = 2.0;
const FPS_MIN_FRAMES: usize = 4;
const FPS_MAX_FRAMES: usize = 768;
const VIDEO_MIN_TOKENS: usize = 128;
const VIDEO_MAX_TOKENS: usize = 768;
/// MODEL_SEQ_LEN (128000) × 0.9 tokens' worth of pixels for the whole video.
const VIDEO_TOTAL_TOKENS: f64 = 128_000.0 * 0.9;

#[derive(Debug, Default, Deserialize)]
struct RawConfig {
    image_processor_type: Option<String>,
    video_processor_type: Option<String>,
    patch_size: Option<usize>,
    temporal_patch_size: Option<usize>,
    merge_size: Option<usize>,
    image_mean: Option<[f32; 3]>,
    image_std: Option<[f32; 3]>,
    rescale_factor: Option<f64>,
    video_sampling: Option<Strategy>,
    fps: Option<f64>,
    min_frames: Option<usize>,
    max_frames: Option<usize>,
    nframes: Option<usize>,
    video_min_pixels: Option<f64>,
    video_max_pixels: Option<f64>,
    video_total_pixels: Option<f64>,
    size: Option<SizeConfig>,
}

pub struct VideoConfig {
    pub rules: Rules,
    pub strategy: Strategy,
    pub fps: f64,
    pub min_frames: usize,
    pub max_frames: usize,
    pub nframes: usize,
    /// Per frame under qwen-vl-utils' rules; over all the frames under Qwen3-VL's.
    pub min_pixels: f64,
    pub max_pixels: f64,
    pub total_pixels: f64,
    pub patch: usize,
    pub temporal: usize,
    pub merge: usize,
    pub normalize: Normalize,
}

impl VideoConfig {
    pub fn parse(json: &str) -> PluginResult<VideoConfig> {
        let raw: RawConfig = parse_config(&with_video_config(json)?)?;
        let class = raw
            .video_processor_type
            .as_deref()
            .or(raw.image_processor_type.as_deref())
            .unwrap_or("Qwen2VLImageProcessor");
        if crate::onevision::CLASSES.contains(&class) {
            return Err(PluginError::unsupported(
                "LLaVA-OneVision's videos are planned here for an engine that makes their \
                 tensors: this plugin counts their tokens but does not make them",
            ));
        }
        if !SUPPORTED.contains(&class) {
            return Err(PluginError::unsupported(format!(
                "processor {class} has no video path here (supported: {})",
                SUPPORTED.join(", ")
            )));
        }
        let rules = if class == "Qwen3VLVideoProcessor" {
            Rules::Qwen3Vl
        } else {
            Rules::QwenVlUtils
        };
        let qwen3 = rules == Rules::Qwen3Vl;
        let patch = raw.patch_size.unwrap_or(if qwen3 { 16 } else { 14 });
        let merge = raw.merge_size.unwrap_or(2);
        let temporal = raw.temporal_patch_size.unwrap_or(2);
        if patch == 0 || merge == 0 || temporal != FRAME_FACTOR {
            return Err(PluginError::unsupported(format!(
                "patch_size {patch}, merge_size {merge}, temporal_patch_size {temporal}: \
                 need positive sizes and a temporal patch of {FRAME_FACTOR}"
            )));
        }
        let factor = (patch * merge) as f64;
        let fps = raw.fps.unwrap_or(FPS);
        if !(fps.is_finite() && fps > 0.0) {
            return Err(PluginError::unsupported(format!(
                "fps {fps} must be positive"
            )));
        }
        let strategy = raw.video_sampling.unwrap_or(if raw.nframes.is_some() {
            Strategy::Uniform
        } else {
            Strategy::Fps
        });
        if strategy == Strategy::Uniform && raw.nframes.is_none() {
            return Err(PluginError::unsupported(
                "video_sampling \"uniform\" needs nframes",
            ));
        }
        let min_frames = raw.min_frames.unwrap_or(FPS_MIN_FRAMES).max(FRAME_FACTOR);
        // transformers' processor takes `do_sample_frames` and `fps`; qwen-vl-utils' settings
        // (`video_sampling`, `nframes`) are mmgate's and apply under both rules.
        let max_frames = raw.max_frames.unwrap_or(FPS_MAX_FRAMES);
        if max_frames < min_frames {
            return Err(PluginError::unsupported(format!(
                "max_frames {max_frames} is below min_frames {min_frames}"
            )));
        }
        let size = raw.size.unwrap_or_default();
        let min_pixels = match rules {
            Rules::Qwen3Vl => size.shortest_edge.unwrap_or(QWEN3_MIN_PIXELS),
            Rules::QwenVlUtils => raw
                .video_min_pixels
                .unwrap_or(VIDEO_MIN_TOKENS as f64 * factor * factor),
        };
        let max_pixels = match rules {
            Rules::Qwen3Vl => size.longest_edge.unwrap_or(QWEN3_MAX_PIXELS),
            Rules::QwenVlUtils => raw
                .video_max_pixels
                .unwrap_or(VIDEO_MAX_TOKENS as f64 * factor * factor),
        };
        let total_pixels = raw
            .video_total_pixels
            .unwrap_or(VIDEO_TOTAL_TOKENS * factor * factor);
        if !(min_pixels > 0.0 && min_pixels <= max_pixels && total_pixels > 0.0) {
            return Err(PluginError::unsupported(format!(
                "video pixels: min {min_pixels}, max {max_pixels}, total {total_pixels} are inconsistent"
            )));
        }
        Ok(VideoConfig {
            rules,
            strategy,
            fps,
            min_frames,
            max_frames,
            nframes: raw.nframes.unwrap_or(0),
            min_pixels,
            max_pixels,
            total_pixels,
            patch,
            temporal,
            merge,
            normalize: Normalize {
                rescale: raw.rescale_factor.unwrap_or(1.0 / 255.0),
                // Qwen3-VL's defaults are ImageNet's standard 0.5s, Qwen2-VL's CLIP's.
                mean: raw
                    .image_mean
                    .unwrap_or(if qwen3 { [0.5; 3] } else { CLIP_MEAN }),
                std: raw
                    .image_std
                    .unwrap_or(if qwen3 { [0.5; 3] } else { CLIP_STD }),
            },
        })
    }

    /// Pixels of a side's unit: patch × merge (28 for Qwen2-VL).
    pub fn factor(&self) -> usize {
        self.patch * self.merge
    }

    /// The fewest frames a budget cut may leave.
    pub fn min_frames_for(&self, source_frames: u64) -> usize {
        let total = usize::try_from(source_frames).unwrap_or(usize::MAX);
        self.min_frames
            .min(floor_by_factor(total as f64, FRAME_FACTOR))
            .max(FRAME_FACTOR)
    }

    /// The frame size before any budget cut for `frames` frames (before padding to pairs).
    /// qwen-vl-utils: max pixels per frame = max(min(VIDEO_MAX_PIXELS, total_pixels / frames ×
    /// 2), int(min_pixels × 1.05)); Qwen3-VL: `size`'s bounds over all the frames.
    pub fn frame_size(
        &self,
        source: &crate::Source,
        frames: usize,
    ) -> PluginResult<(usize, usize)> {
        match self.rules {
            Rules::QwenVlUtils => {
                let per_frame = self.total_pixels / frames.max(1) as f64 * FRAME_FACTOR as f64;
                let max_pixels = self
                    .max_pixels
                    .min(per_frame)
                    .max((self.min_pixels * 1.05).floor());
                self.size_within(source, frames, max_pixels)
            }
            Rules::Qwen3Vl => self.resize(source, frames, self.min_pixels, self.max_pixels),
        }
    }

    /// The frame size for `frames` frames (in pairs) of at most `per_frame` pixels each, never
    /// below the minimum pixels.
    pub fn size_within(
        &self,
        source: &crate::Source,
        frames: usize,
        per_frame: f64,
    ) -> PluginResult<(usize, usize)> {
        match self.rules {
            Rules::QwenVlUtils => self.resize(
                source,
                frames,
                self.min_pixels,
                per_frame.max(self.min_pixels),
            ),
            Rules::Qwen3Vl => {
                let all = (per_frame * frames as f64).max(self.min_pixels);
                self.resize(source, frames, self.min_pixels, all)
            }
        }
    }

    /// The smallest frame size the minimum pixels allow for `frames` frames.
    pub fn smallest_size(
        &self,
        source: &crate::Source,
        frames: usize,
    ) -> PluginResult<(usize, usize)> {
        self.resize(source, frames, self.min_pixels, self.min_pixels)
    }

    fn resize(
        &self,
        source: &crate::Source,
        frames: usize,
        min_pixels: f64,
        max_pixels: f64,
    ) -> PluginResult<(usize, usize)> {
        let (height, width) = source.size();
        match self.rules {
            Rules::QwenVlUtils => {
                smart_resize(height, width, self.factor(), min_pixels, max_pixels)
            }
            Rules::Qwen3Vl => qwen3_smart_resize(
                frames,
                height,
                width,
                self.temporal,
                self.factor(),
                min_pixels,
                max_pixels,
            ),
        }
        .map_err(PluginError::limit)
    }

    /// A decoded frame at the planned size, resized as the rules' reference does: qwen-vl-utils
    /// through torchvision's float path, transformers' video processors through PyTorch's u8 kernel.
    pub fn resize_frame(&self, frame: &RgbImage, width: usize, height: usize) -> RgbImage {
        match self.rules {
            Rules::QwenVlUtils => resize_like_torchvision(frame, width, height),
            Rules::Qwen3Vl => resize_like_torch_uint8(frame, width, height),
        }
    }

    pub fn strategy_label(&self) -> String {
        match self.strategy {
            Strategy::Fps => format!("{} fps", self.fps),
            Strategy::Uniform => "uniform".into(),
            Strategy::Keyframes => "keyframes".into(),
        }
    }
}

/// The processor config with a model's own video processor config (under [`VIDEO_CONFIG_KEY`])
/// laid over the image processor's keys, as one JSON object.
pub(crate) fn with_video_config(json: &str) -> PluginResult<String> {
    let mut config: serde_json::Value = parse_config(json)?;
    let Some(fields) = config.as_object_mut() else {
        return Err(PluginError::unsupported(
            "processor config: not a JSON object",
        ));
    };
    match fields.remove(VIDEO_CONFIG_KEY) {
        Some(serde_json::Value::Object(video)) => fields.extend(video),
        Some(_) => {
            return Err(PluginError::unsupported(format!(
                "processor config: {VIDEO_CONFIG_KEY} is not an object"
            )));
        }
        None => {}
    }
    Ok(config.to_string())
}
