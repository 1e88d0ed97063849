//! The built-in video plugin.
//!
//! - `probe`: the host's FFmpeg decoder opens and indexes the video (exact frame count, fps,
//!   displayed size, rotation, keyframes); nothing is decoded.
//! - `plan`: qwen-vl-utils' rules choose the frames (`fps`: 2 a second, 4–768, even; `uniform`:
//!   `nframes`; `keyframes`: the encoder's keyframes) and the per-frame size (VIDEO_MIN/MAX/TOTAL
//!   pixels); over budget, frames are cut first (down to the minimum), then resolution.
//! - `preprocess`: the host decodes only the chosen frames, one at a time; each pair is resized as
//!   torchvision does (bicubic, antialias) and patchified as Qwen2-VL's processor does.
//!
//! Outputs: `pixel_values_videos` (f32, HF layout), `video_grid_thw` (i64 [1,3]), `frame_indices`
//! (i64), `frame_timestamps` (f32 seconds), `second_per_grid_ts` (f32 [1], Qwen2.5-VL's) and
//! `video_fps_f64_bits` (i64 [1]: the source frame rate's f64 bits, for Qwen3-VL's timestamps).
//!
//! Two sets of rules choose frames and sizes: qwen-vl-utils' (Qwen2-VL, Qwen2.5-VL) and
//! transformers' `Qwen3VLVideoProcessor` (see `config`). LLaVA-OneVision's videos are planned and
//! counted only, for an engine that makes their tensors (see `onevision`).

mod config;
mod onevision;
pub mod sampling;

use mmgate_plugin_sdk::imageops::{RgbImage, qwen2vl_frame_patches};
use mmgate_plugin_sdk::video::VideoDecoder;
use mmgate_plugin_sdk::*;
use serde::{Deserialize, Serialize};

use config::{Rules, VideoConfig, with_video_config};
use onevision::OneVision;
use sampling::{
    FRAME_FACTOR, Strategy, evenly, linspace_indices, numpy_linspace_indices, pad_to_pairs,
};

pub struct VideoPlugin;

/// Most temporal patches (pairs of frames) in one part: 16 frames, 8 seconds at 2 frames a second,
/// enough that opening the video and seeking again for each part costs little beside decoding them.
const PAIRS_PER_PART: usize = 8;

/// Temporal patches of the first part, and the fewest of any other. The first piece is what the
/// engine waits for before it can begin the item's prefill, so it is small; the later ones, made
/// while the engine prefills, can be larger.
const FIRST_PART_PAIRS: usize = 2;

/// The temporal patches of each part of a video of `pairs` temporal patches (at least one part):
/// the first [`FIRST_PART_PAIRS`], the rest in near-equal runs (the smaller last) of at most a
/// quarter of the video and [`PAIRS_PER_PART`], and at least [`FIRST_PART_PAIRS`] (a shorter rest
/// joins the first part). What the last piece holds is encoded and prefilled after every frame is
/// made, so it must not be most of a short video: the 11 temporal patches of a 60 s video planned
/// for 8k tokens, in runs of 2, 3, 3 and 3, answer sooner than in runs of 4 and 7, their first
/// piece encoded sooner too (measured by `bench/pieces.py`), while a long video keeps runs of 7
/// or 8.
fn part_runs(pairs: usize) -> Vec<std::ops::Range<usize>> {
    let rest = pairs.saturating_sub(FIRST_PART_PAIRS);
    if rest < FIRST_PART_PAIRS {
        return std::iter::once(0..pairs).collect();
    }
    let most = pairs.div_ceil(4).clamp(FIRST_PART_PAIRS, PAIRS_PER_PART);
    let count = rest.div_ceil(most).min(rest / FIRST_PART_PAIRS);
    let mut runs = Vec::with_capacity(count + 1);
    runs.push(0..FIRST_PART_PAIRS);
    let mut first = FIRST_PART_PAIRS;
    for part in 0..count {
        let len = rest / count + usize::from(part < rest % count);
        runs.push(first..first + len);
        first += len;
    }
    runs
}

/// Keyframe indices ride in `media-info.extra` from `probe` to `plan` (which sees nothing else).
const KEYFRAMES_KEY: &str = "keyframes";
/// At most this many keyframes are carried; beyond it they are spread evenly.
const MAX_KEYFRAMES_CARRIED: usize = 4096;

/// What `plan` decided, handed back to `preprocess`.
#[derive(Debug, Serialize, Deserialize)]
pub struct Choices {
    pub strategy: Strategy,
    pub frame_indices: Vec<u64>,
    pub width: usize,
    pub height: usize,
    /// Frames in the source video (checked again at preprocess: the bytes must be the same video).
    pub source_frames: u64,
    /// Frames a second of the chosen frames, as qwen-vl-utils computes it.
    pub sample_fps: f64,
    /// The source's frame rate as its f64 bits (JSON numbers need not parse back to the same
    /// float; integers do): every part's `video_fps_f64_bits`, known from the plan alone.
    pub source_fps_bits: u64,
}

impl Plugin for VideoPlugin {
    fn describe() -> Descriptor {
        Descriptor::new(
            "video",
            env!("CARGO_PKG_VERSION"),
            "Video through the host's FFmpeg: frame sampling under a token budget (qwen-vl-utils), \
             torchvision resize, Qwen2-VL patches",
            &["video"],
            &[
                "video/mp4",
                "video/webm",
                "video/x-matroska",
                "video/x-msvideo",
                "video/quicktime",
                "video/mpeg",
                "video/ogg",
                "video/x-flv",
                "video/3gpp",
            ],
            config::SUPPORTED,
        )
    }

    fn probe(media: Media) -> PluginResult<MediaInfo> {
        let video = VideoDecoder::open(&media.data)?;
        let info = video.info();
        let keyframes = evenly(&video.keyframes(), MAX_KEYFRAMES_CARRIED);
        let keyframes: Vec<String> = keyframes.iter().map(u64::to_string).collect();
        let mut media_info = MediaInfo::new("video", format!("{}/{}", info.container, info.codec));
        media_info.width = Some(info.width);
        media_info.height = Some(info.height);
        media_info.frame_count = Some(info.frame_count);
        media_info.fps = Some(info.fps);
        media_info.duration_seconds = Some(info.duration_seconds);
        media_info.extra = vec![
            ("codec".into(), info.codec.clone()),
            ("rotation".into(), info.rotation.to_string()),
            (KEYFRAMES_KEY.into(), keyframes.join(",")),
        ];
        Ok(media_info)
    }

    fn plan(info: MediaInfo, budget: Budget, config: ProcessorConfig) -> PluginResult<TokenPlan> {
        let source = Source::from_info(&info)?;
        if let Some(onevision) = OneVision::from_config(&with_video_config(&config)?)? {
            return onevision.plan(&source, budget);
        }
        let config = VideoConfig::parse(&config)?;
        let choices_for = |frames: Vec<u64>, (height, width): (usize, usize)| Choices {
            strategy: config.strategy.clone(),
            sample_fps: frames.len() as f64 / (source.frames as f64).max(1e-6) * source.fps,
            frame_indices: frames,
            width,
            height,
            source_frames: source.frames,
            source_fps_bits: source.fps.to_bits(),
        };
        let tokens = |frames: usize, (h, w): (usize, usize)| {
            (frames / FRAME_FACTOR) * (h / config.factor()) * (w / config.factor())
        };

        // Sized for the frames the rule chose, then padded to whole temporal patches with the last
        // frame (Qwen3-VL's rule may choose an odd count; qwen-vl-utils' never does).
        let wanted = source.frames_for(&config)?;
        let size = config.frame_size(&source, wanted.len())?;
        let wanted = pad_to_pairs(wanted);
        let full = tokens(wanted.len(), size);
        let max = budget.max_tokens as usize;
        if full <= max {
            let reason = format!(
                "{} frames ({}) at {}x{}",
                wanted.len(),
                config.strategy_label(),
                size.1,
                size.0
            );
            let tokens = tokens_u32(full)?;
            return TokenPlan::new(tokens, false, reason, &choices_for(wanted, size));
        }

        // Over budget: fewer frames at the same size, down to the minimum count.
        let min_frames = config.min_frames_for(source.frames).min(wanted.len());
        let per_pair = tokens(FRAME_FACTOR, size).max(1);
        let fit = (max / per_pair) * FRAME_FACTOR;
        if fit >= min_frames {
            let frames = source.reduce(&config, &wanted, fit);
            let cost = tokens(frames.len(), size);
            let reason = format!(
                "{} of {} frames at {}x{} to fit {max} tokens",
                frames.len(),
                wanted.len(),
                size.1,
                size.0
            );
            return TokenPlan::new(tokens_u32(cost)?, true, reason, &choices_for(frames, size));
        }

        // Then the minimum count at a lower resolution, never below the minimum pixels.
        let frames = source.reduce(&config, &wanted, min_frames);
        let smallest = config.smallest_size(&source, frames.len())?;
        let needed = tokens(frames.len(), smallest);
        if needed > max {
            return Err(PluginError::over_budget(
                tokens_u32(needed)?,
                budget.max_tokens,
                format!(
                    "a {}x{} video needs at least {needed} tokens ({} frames at {}x{})",
                    source.width,
                    source.height,
                    frames.len(),
                    smallest.1,
                    smallest.0
                ),
            ));
        }
        let pairs = (frames.len() / FRAME_FACTOR).max(1);
        let cap = ((max / pairs) * config.factor() * config.factor()) as f64;
        let mut smaller = config.size_within(&source, frames.len(), cap)?;
        if tokens(frames.len(), smaller) > max {
            smaller = smallest;
        }
        let cost = tokens(frames.len(), smaller);
        let reason = format!(
            "{} of {} frames at {}x{} (down from {}x{}) to fit {max} tokens",
            frames.len(),
            wanted.len(),
            smaller.1,
            smaller.0,
            size.1,
            size.0
        );
        TokenPlan::new(
            tokens_u32(cost)?,
            true,
            reason,
            &choices_for(frames, smaller),
        )
    }

    fn preprocess(
        media: Media,
        plan: TokenPlan,
        config: ProcessorConfig,
    ) -> PluginResult<Vec<Tensor>> {
        let choices: Choices = plan.choices()?;
        let pairs = choices.frame_indices.len() / FRAME_FACTOR;
        temporal_patches(&media, &choices, &config, 0..pairs)
    }

    /// Runs of temporal patches ([`part_runs`]: 4, then up to 8 each): each part decodes and resizes
    /// only its frames, and a vision tower that attends within each frame encodes each part on its
    /// own.
    fn parts(plan: TokenPlan, _config: ProcessorConfig) -> PluginResult<u32> {
        let choices: Choices = plan.choices()?;
        let pairs = choices.frame_indices.len() / FRAME_FACTOR;
        u32::try_from(part_runs(pairs).len()).map_err(|_| PluginError::limit("too many frames"))
    }

    fn preprocess_part(
        media: Media,
        plan: TokenPlan,
        config: ProcessorConfig,
        index: u32,
    ) -> PluginResult<Vec<Tensor>> {
        let choices: Choices = plan.choices()?;
        let pairs = choices.frame_indices.len() / FRAME_FACTOR;
        let run = part_runs(pairs)
            .into_iter()
            .nth(index as usize)
            .ok_or_else(|| {
                PluginError::internal(format!(
                    "part {index} of a video of {pairs} temporal patches"
                ))
            })?;
        temporal_patches(&media, &choices, &config, run)
    }

    /// Each part's tokens and its placing tensors, from the plan alone: the same values
    /// [`temporal_patches`] returns beside the pixels (one function makes both).
    fn part_plans(plan: TokenPlan, config: ProcessorConfig) -> PluginResult<Vec<PartPlan>> {
        let config = VideoConfig::parse(&config)?;
        let choices: Choices = plan.choices()?;
        let pairs = choices.frame_indices.len() / FRAME_FACTOR;
        part_runs(pairs)
            .into_iter()
            .map(|run| {
                let tokens = run.len()
                    * (choices.height / config.factor())
                    * (choices.width / config.factor());
                Ok(PartPlan {
                    tokens: u32::try_from(tokens)
                        .map_err(|_| PluginError::limit("too many tokens"))?,
                    placing: placing_tensors(&choices, &config, run)?,
                })
            })
            .collect()
    }

    /// The chosen frames only, each at the planned size as a PNG, with its timestamp: a server
    /// that takes a video as its frames (vLLM's `video/jpeg` frame list) samples nothing more and,
    /// the frames being at a size its resize keeps, counts the plan's tokens.
    fn reduce(media: Media, plan: TokenPlan, config: ProcessorConfig) -> PluginResult<ReducedItem> {
        let choices: Choices = plan.choices()?;
        let resize: Box<dyn Fn(&RgbImage) -> RgbImage> =
            match OneVision::from_config(&with_video_config(&config)?)? {
                Some(onevision) => Box::new(move |frame| onevision.resize_frame(frame)),
                None => {
                    let config = VideoConfig::parse(&config)?;
                    let (width, height) = (choices.width, choices.height);
                    Box::new(move |frame| config.resize_frame(frame, width, height))
                }
            };
        let video = VideoDecoder::open(&media.data)?;
        if video.info().frame_count != choices.source_frames {
            return Err(PluginError::internal(format!(
                "the plan was made for a video of {} frames; this one has {}",
                choices.source_frames,
                video.info().frame_count
            )));
        }
        let mut files = Vec::with_capacity(choices.frame_indices.len());
        let mut timestamps = Vec::with_capacity(choices.frame_indices.len());
        for &index in &choices.frame_indices {
            let frame = video.frame(index)?;
            let decoded = RgbImage {
                width: frame.width as usize,
                height: frame.height as usize,
                data: frame.rgb,
            };
            let resized = resize(&decoded);
            files.push(files::png(&resized)?);
            timestamps.push(frame.timestamp);
        }
        Ok(ReducedItem { files, timestamps })
    }
}

// Natively (unit tests) there is no component to export, and the linker would choke on the
// component-model symbol names.
#[cfg(target_arch = "wasm32")]
mmgate_plugin_sdk::export_plugin!(VideoPlugin);

/// What `probe` found, as `plan` needs it.
pub(crate) struct Source {
    frames: u64,
    fps: f64,
    width: usize,
    height: usize,
    keyframes: Vec<u64>,
}

impl Source {
    fn from_info(info: &MediaInfo) -> PluginResult<Source> {
        let (Some(frames), Some(fps), Some(width), Some(height)) =
            (info.frame_count, info.fps, info.width, info.height)
        else {
            return Err(PluginError::invalid(
                "the video's frame count, rate or size is unknown",
            ));
        };
        if frames < FRAME_FACTOR as u64 {
            return Err(PluginError::invalid(format!(
                "the video has {frames} frame(s); at least {FRAME_FACTOR} are needed"
            )));
        }
        if !(fps.is_finite() && fps > 0.0) {
            return Err(PluginError::invalid("the video has no frame rate"));
        }
        let keyframes = info
            .extra
            .iter()
            .find(|(k, _)| k == KEYFRAMES_KEY)
            .map(|(_, v)| v.split(',').filter_map(|s| s.parse().ok()).collect())
            .unwrap_or_default();
        Ok(Source {
            frames,
            fps,
            width: width as usize,
            height: height as usize,
            keyframes,
        })
    }

    /// (height, width) as displayed.
    pub(crate) fn size(&self) -> (usize, usize) {
        (self.height, self.width)
    }

    /// The frames the strategy wants before any budget cut (not yet padded to pairs).
    fn frames_for(&self, config: &VideoConfig) -> PluginResult<Vec<u64>> {
        let last = self.frames - 1;
        let total = usize::try_from(self.frames).unwrap_or(usize::MAX);
        match config.strategy {
            Strategy::Fps if config.rules == Rules::Qwen3Vl => {
                let n = sampling::qwen3_frame_count(
                    total,
                    self.fps,
                    config.fps,
                    config.min_frames,
                    config.max_frames,
                );
                Ok(numpy_linspace_indices(0, last, n))
            }
            Strategy::Fps => {
                let n = sampling::fps_frame_count(
                    total,
                    self.fps,
                    config.fps,
                    config.min_frames,
                    config.max_frames,
                );
                Ok(linspace_indices(0, last, n))
            }
            Strategy::Uniform => {
                let n = sampling::round_by_factor(config.nframes as f64, FRAME_FACTOR);
                if !(FRAME_FACTOR..=total).contains(&n) {
                    return Err(PluginError::invalid(format!(
                        "nframes {} (rounded to {n}) must be between {FRAME_FACTOR} and the video's {total} frames",
                        config.nframes
                    )));
                }
                Ok(linspace_indices(0, last, n))
            }
            Strategy::Keyframes => {
                let keyframes = if self.keyframes.is_empty() {
                    vec![0]
                } else {
                    self.keyframes.clone()
                };
                let cap = sampling::floor_by_factor(config.max_frames as f64, FRAME_FACTOR);
                Ok(pad_to_pairs(evenly(&keyframes, cap.max(FRAME_FACTOR))))
            }
        }
    }

    /// `count` frames instead of `wanted`: the same rule over fewer frames.
    fn reduce(&self, config: &VideoConfig, wanted: &[u64], count: usize) -> Vec<u64> {
        match (config.strategy.clone(), config.rules) {
            (Strategy::Keyframes, _) => pad_to_pairs(evenly(wanted, count)),
            (Strategy::Fps, Rules::Qwen3Vl) => {
                pad_to_pairs(numpy_linspace_indices(0, self.frames - 1, count))
            }
            (Strategy::Fps | Strategy::Uniform, _) => linspace_indices(0, self.frames - 1, count),
        }
    }
}

fn tokens_u32(tokens: usize) -> PluginResult<u32> {
    u32::try_from(tokens).map_err(|_| PluginError::limit(format!("{tokens} tokens is too many")))
}

/// The tensors of temporal patches `pairs` of the planned video (all of them: `preprocess`; a run
/// of them: a part), as the model's processor makes them of those frames alone.
fn temporal_patches(
    media: &Media,
    choices: &Choices,
    config: &str,
    pairs: std::ops::Range<usize>,
) -> PluginResult<Vec<Tensor>> {
    let config = VideoConfig::parse(config)?;
    let video = VideoDecoder::open(&media.data)?;
    let source_frames = video.info().frame_count;
    if source_frames != choices.source_frames {
        return Err(PluginError::internal(format!(
            "the plan was made for a video of {} frames; this one has {source_frames}",
            choices.source_frames
        )));
    }
    if choices.frame_indices.is_empty() || !choices.frame_indices.len().is_multiple_of(FRAME_FACTOR)
    {
        return Err(PluginError::internal("the plan has no whole frame pairs"));
    }
    let table: Vec<f32> = config.normalize.table().into_iter().flatten().collect();
    let (patch, merge) = (config.patch, config.merge);
    let (height, width) = (choices.height, choices.width);
    let frames = choices
        .frame_indices
        .get(pairs.start * config.temporal..pairs.end * config.temporal)
        .filter(|f| !f.is_empty())
        .ok_or_else(|| PluginError::internal("the plan has no such temporal patches"))?;
    let rows = pairs.len() * (height / patch) * (width / patch);
    let row_len = 3 * config.temporal * patch * patch;
    // Raw samples plus the exact normalisation table, as the image plugin sends them: a quarter
    // of the bytes of f32 in the sandbox (whose memory is capped) and in the gateway.
    let mut pixels: Vec<u8> = Vec::with_capacity(rows * row_len);
    let mut timestamps = Vec::with_capacity(frames.len());
    for group in frames.chunks(config.temporal) {
        // A pair is decoded and resized once per distinct index: keyframe padding repeats the
        // last index, and the patch walk copies a repeated frame.
        let mut resized: Vec<RgbImage> = Vec::with_capacity(group.len());
        let mut slots = Vec::with_capacity(group.len());
        for (i, &index) in group.iter().enumerate() {
            if i > 0 && group[i - 1] == index {
                slots.push(slots[i - 1]);
                let time = timestamps.last().copied().unwrap_or(0.0);
                timestamps.push(time);
                continue;
            }
            let frame = video.frame(index)?;
            timestamps.push(frame.timestamp as f32);
            let decoded = RgbImage {
                width: frame.width as usize,
                height: frame.height as usize,
                data: frame.rgb,
            };
            slots.push(resized.len());
            resized.push(config.resize_frame(&decoded, width, height));
        }
        let refs: Vec<&RgbImage> = slots.iter().map(|&s| &resized[s]).collect();
        qwen2vl_frame_patches(&refs, patch, merge, &mut pixels);
    }
    let mut tensors = vec![
        Tensor::from_u8("pixel_values_videos", &[rows, row_len], pixels)?,
        Tensor::from_f32("pixel_values_videos_table", &[3, 256], &table)?,
        Tensor::from_f32("frame_timestamps", &[timestamps.len()], &timestamps)?,
    ];
    tensors.extend(placing_tensors(choices, &config, pairs)?);
    Ok(tensors)
}

/// The tensors that place temporal patches `pairs` of the planned video in the prompt, which the
/// plan alone decides: their grid, their frames' indices and timing.
fn placing_tensors(
    choices: &Choices,
    config: &VideoConfig,
    pairs: std::ops::Range<usize>,
) -> PluginResult<Vec<Tensor>> {
    let frames = choices
        .frame_indices
        .get(pairs.start * config.temporal..pairs.end * config.temporal)
        .filter(|f| !f.is_empty())
        .ok_or_else(|| PluginError::internal("the plan has no such temporal patches"))?;
    let grid = [
        pairs.len() as i64,
        (choices.height / config.patch) as i64,
        (choices.width / config.patch) as i64,
    ];
    let indices: Vec<i64> = frames.iter().map(|&i| i as i64).collect();
    let second_per_grid = config.temporal as f32 / choices.sample_fps as f32;
    Ok(vec![
        Tensor::from_i64("video_grid_thw", &[1, 3], &grid)?,
        Tensor::from_i64("frame_indices", &[indices.len()], &indices)?,
        Tensor::from_f32("second_per_grid_ts", &[1], &[second_per_grid])?,
        // The source's frame rate in double precision (the contract has no f64): Qwen3-VL's
        // prompt shows each temporal patch's time, computed from it as transformers does.
        Tensor::from_i64(
            "video_fps_f64_bits",
            &[1],
            &[choices.source_fps_bits as i64],
        )?,
    ])
}

#[cfg(test)]
mod tests {
    use super::part_runs;

    #[test]
    fn parts_begin_with_two_temporal_patches_then_at_most_eight_and_cover_the_video_once() {
        assert_eq!(part_runs(0), vec![0..0]);
        assert_eq!(part_runs(1), vec![0..1]);
        assert_eq!(part_runs(3), vec![0..3]);
        assert_eq!(part_runs(5), [0..2, 2..5]);
        assert_eq!(part_runs(11), [0..2, 2..5, 5..8, 8..11]);
        assert_eq!(part_runs(24), [0..2, 2..8, 8..14, 14..19, 19..24]);
        assert_eq!(
            part_runs(60),
            [
                0..2,
                2..10,
                10..18,
                18..25,
                25..32,
                32..39,
                39..46,
                46..53,
                53..60
            ]
        );
        for pairs in 1..300 {
            let runs = part_runs(pairs);
            assert!(runs.windows(2).all(|w| w[0].end == w[1].start), "{runs:?}");
            assert!(
                runs.windows(2)
                    .all(|w| w[0].len() >= w[1].len() || w[0].start == 0)
            );
            assert_eq!((runs[0].start, runs[runs.len() - 1].end), (0, pairs));
            assert!(runs.iter().all(|r| !r.is_empty()
                && r.len() <= super::PAIRS_PER_PART
                && (pairs < super::FIRST_PART_PAIRS || r.len() >= super::FIRST_PART_PAIRS)));
        }
    }
}
