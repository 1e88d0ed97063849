//! The video processor configuration: the model's `preprocessor_config.json` (patch, merge and
//! temporal patch sizes, mean and std) plus the video sampling settings, named as qwen-vl-utils names
//! them (`fps`, `min_frames`, `max_frames`, `nframes`) or prefixed `video_` where the image processor
//! already uses the name (`video_min_pixels`, `video_max_pixels`, `video_total_pixels`).

use mmgate_plugin_sdk::imageops::{CLIP_MEAN, CLIP_STD, Normalize};
use mmgate_plugin_sdk::*;
use serde::Deserialize;

use crate::sampling::{FRAME_FACTOR, Strategy, floor_by_factor, smart_resize};

/// Processor classes whose video path this plugin implements.
pub const SUPPORTED: &[&str] = &[
    "Qwen2VLImageProcessor",
    "Qwen2VLImageProcessorFast",
    "Qwen2VLVideoProcessor",
];

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
}

pub struct VideoConfig {
    pub strategy: Strategy,
    pub fps: f64,
    pub min_frames: usize,
    pub max_frames: usize,
    pub nframes: usize,
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
        let raw: RawConfig = parse_config(json)?;
        let class = raw
            .video_processor_type
            .as_deref()
            .or(raw.image_processor_type.as_deref())
            .unwrap_or("Qwen2VLImageProcessor");
        if !SUPPORTED.contains(&class) {
            return Err(PluginError::unsupported(format!(
                "processor {class} has no video path here (supported: {})",
                SUPPORTED.join(", ")
            )));
        }
        let patch = raw.patch_size.unwrap_or(14);
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
        let max_frames = raw.max_frames.unwrap_or(FPS_MAX_FRAMES);
        if max_frames < min_frames {
            return Err(PluginError::unsupported(format!(
                "max_frames {max_frames} is below min_frames {min_frames}"
            )));
        }
        let min_pixels = raw
            .video_min_pixels
            .unwrap_or(VIDEO_MIN_TOKENS as f64 * factor * factor);
        let max_pixels = raw
            .video_max_pixels
            .unwrap_or(VIDEO_MAX_TOKENS as f64 * factor * factor);
        let total_pixels = raw
            .video_total_pixels
            .unwrap_or(VIDEO_TOTAL_TOKENS * factor * factor);
        if !(min_pixels > 0.0 && min_pixels <= max_pixels && total_pixels > 0.0) {
            return Err(PluginError::unsupported(format!(
                "video pixels: min {min_pixels}, max {max_pixels}, total {total_pixels} are inconsistent"
            )));
        }
        Ok(VideoConfig {
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
                mean: raw.image_mean.unwrap_or(CLIP_MEAN),
                std: raw.image_std.unwrap_or(CLIP_STD),
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

    /// qwen-vl-utils' per-frame size for `frames` frames: max pixels = max(min(VIDEO_MAX_PIXELS,
    /// total_pixels / frames × 2), int(min_pixels × 1.05)).
    pub fn frame_size(
        &self,
        source: &crate::Source,
        frames: usize,
    ) -> PluginResult<(usize, usize)> {
        let per_frame = self.total_pixels / frames.max(1) as f64 * FRAME_FACTOR as f64;
        let max_pixels = self
            .max_pixels
            .min(per_frame)
            .max((self.min_pixels * 1.05).floor());
        smart_resize(
            source.height,
            source.width,
            self.factor(),
            self.min_pixels,
            max_pixels,
        )
        .map_err(PluginError::limit)
    }

    pub fn strategy_label(&self) -> String {
        match self.strategy {
            Strategy::Fps => format!("{} fps", self.fps),
            Strategy::Uniform => "uniform".into(),
            Strategy::Keyframes => "keyframes".into(),
        }
    }
}
