//! Qwen2-VL's image processor (`Qwen2VLImageProcessor`, Qwen2.5-VL's too) and GLM-4.1V's
//! (`Glm4vImageProcessor`) and PaddleOCR-VL's (`PaddleOCRVLImageProcessor`), which size images
//! the same way with their own first step and limits:
//! `smart_resize` within min/max pixels, bicubic, CLIP mean and std, patches of `patch_size`
//! merged `merge_size` a side into a token, each still image tiled over the temporal patch. A large
//! JPEG is made in bands of rows (contract 0.4's parts), each a run of the whole's patches.

use std::ops::Range;

use mmgate_plugin_sdk::imagedecode::ImageRows;
use mmgate_plugin_sdk::imageops::{
    CLIP_MEAN, CLIP_STD, Filter, Normalize, RgbImage, qwen2vl_resized_patch_bytes_reusing,
};
use mmgate_plugin_sdk::*;
use serde::Deserialize;
use serde_json::Value;

use super::config::{BaseConfig, SizeField, positive, read};
use super::{ImageProcessor, boxed};
use crate::choices::{Choices, tokens_u32};

pub fn qwen2_vl(config: &Value) -> PluginResult<Box<dyn ImageProcessor>> {
    boxed(Qwen2Vl::from_config(config, SizeRule::Qwen2Vl))
}

pub fn glm4v(config: &Value) -> PluginResult<Box<dyn ImageProcessor>> {
    boxed(Qwen2Vl::from_config(config, SizeRule::Glm4v))
}

pub fn paddleocr_vl(config: &Value) -> PluginResult<Box<dyn ImageProcessor>> {
    boxed(Qwen2Vl::from_config(config, SizeRule::PaddleOcr))
}

#[derive(Debug, Deserialize)]
struct Config {
    #[serde(flatten)]
    base: BaseConfig,
    min_pixels: Option<usize>,
    max_pixels: Option<usize>,
    /// Newer checkpoints' form of the pixel limits: `shortest_edge` and `longest_edge` in pixels.
    size: Option<SizeField>,
    temporal_patch_size: Option<usize>,
    merge_size: Option<usize>,
}

/// How a processor of Qwen2-VL's patches sizes a still image against its pixel limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SizeRule {
    /// Qwen2-VL, Qwen2.5-VL: the image's pixels.
    Qwen2Vl,
    /// GLM-4.1V (`Glm4vImageProcessor`): a side under a token's scaled up first, and the pixels
    /// counted once for each frame of the temporal patch the image fills.
    Glm4v,
    /// PaddleOCR-VL (`PaddleOCRVLImageProcessor`): a side under a token's raised to it first, the
    /// other side scaled with it (rounded half to even); one frame a temporal patch.
    PaddleOcr,
}

impl SizeRule {
    /// The size `smart_resize` starts from, and the frames it counts the pixels for.
    fn start(
        self,
        height: usize,
        width: usize,
        factor: usize,
        temporal: usize,
    ) -> (usize, usize, usize) {
        match self {
            SizeRule::Qwen2Vl => (height, width, 1),
            SizeRule::Glm4v if height < factor || width < factor => {
                let scale = (factor as f64 / height as f64).max(factor as f64 / width as f64);
                let grown = |side: usize| (side as f64 * scale) as usize;
                (grown(height), grown(width), temporal)
            }
            SizeRule::Glm4v => (height, width, temporal),
            SizeRule::PaddleOcr => {
                let scaled = |side: usize, by: usize| {
                    ((side * factor) as f64 / by as f64).round_ties_even() as usize
                };
                let (mut h, mut w) = (height, width);
                if h < factor {
                    (h, w) = (factor, scaled(w, h));
                }
                if w < factor {
                    (h, w) = (scaled(h, w), factor);
                }
                (h, w, 1)
            }
        }
    }
}

pub struct Qwen2Vl {
    rule: SizeRule,
    min_pixels: usize,
    max_pixels: usize,
    patch: usize,
    temporal: usize,
    merge: usize,
    filter: Filter,
    normalize: Normalize,
}

impl Qwen2Vl {
    fn from_config(config: &Value, rule: SizeRule) -> PluginResult<Self> {
        let config: Config = read(config)?;
        let (default_pixels, default_temporal) = match rule {
            SizeRule::Glm4v => ((112 * 112, 28 * 28 * 15_000), 2),
            SizeRule::Qwen2Vl => ((56 * 56, 28 * 28 * 1280), 2),
            SizeRule::PaddleOcr => ((384 * 384, 1536 * 1536), 1),
        };
        let size = config.size.as_ref().and_then(SizeField::dict);
        let min_pixels = config
            .min_pixels
            .or_else(|| size.and_then(|s| s.shortest_edge))
            .unwrap_or(default_pixels.0);
        let max_pixels = config
            .max_pixels
            .or_else(|| size.and_then(|s| s.longest_edge))
            .unwrap_or(default_pixels.1);
        if min_pixels > max_pixels {
            return Err(PluginError::unsupported(format!(
                "processor config: min_pixels {min_pixels} > max_pixels {max_pixels}"
            )));
        }
        Ok(Qwen2Vl {
            rule,
            min_pixels,
            max_pixels: positive("max_pixels", max_pixels)?,
            patch: config.base.patch_edge(14)?,
            temporal: positive(
                "temporal_patch_size",
                config.temporal_patch_size.unwrap_or(default_temporal),
            )?,
            merge: positive("merge_size", config.merge_size.unwrap_or(2))?,
            filter: config.base.filter(Filter::Bicubic)?,
            normalize: config.base.normalize(CLIP_MEAN, CLIP_STD),
        })
    }
}

impl ImageProcessor for Qwen2Vl {
    fn plan(
        &self,
        width: usize,
        height: usize,
        jpeg: bool,
        budget: u32,
    ) -> PluginResult<TokenPlan> {
        let (patch, merge) = (self.patch, self.merge);
        let factor = patch * merge;
        let tokens_of = |(h, w): (usize, usize)| (h / factor) * (w / factor);
        let (start_h, start_w, frames) = self.rule.start(height, width, factor, self.temporal);
        let resize = |max_pixels| {
            smart_resize(
                start_h,
                start_w,
                factor,
                self.min_pixels,
                max_pixels,
                frames,
            )
        };
        let native_size = resize(self.max_pixels)?;
        let native = tokens_of(native_size);
        let budget_tokens = budget as usize;
        let ((h, w), reduced) = if native <= budget_tokens {
            (native_size, false)
        } else {
            // Over budget: the image is sized as if max_pixels were the budget's worth of
            // pixels (a token is factor² pixels), never less than min_pixels. smart_resize
            // floors both sides there, so the result fits unless min_pixels does not.
            // Flooring can also land below min_pixels (a 640x480 photo under a cap of
            // 3136 pixels becomes 56x28): a size the model's own processor, resizing with
            // its configured limits, would enlarge again — so a model server sent the
            // image at that size (`reduce`) would count other tokens than planned. The cap
            // then grows a token's worth at a time until the size reaches min_pixels.
            let mut tokens_worth = budget_tokens;
            let size = loop {
                let cap = tokens_worth
                    .saturating_mul(factor * factor * frames)
                    .clamp(self.min_pixels, self.max_pixels);
                let size = resize(cap)?;
                if frames * size.0 * size.1 >= self.min_pixels || cap >= self.max_pixels {
                    break size;
                }
                tokens_worth += 1;
            };
            if tokens_of(size) > budget_tokens {
                return Err(over_budget(tokens_of(size), budget, width, height));
            }
            (size, true)
        };
        let tokens = tokens_of((h, w));
        let reason = if reduced {
            format!(
                "{width}x{height} resized to {w}x{h} ({tokens} tokens) to fit the budget of \
                 {budget}; native size would cost {native}"
            )
        } else {
            format!("{width}x{height} resized to {w}x{h}: {tokens} tokens")
        };
        let large = w * h >= MIN_BANDED_PIXELS && h / factor >= BANDS;
        let choices = Choices {
            width: w,
            height: h,
            crop: None,
            grid_thw: Some([1, h / patch, w / patch]),
            bands: (jpeg && large).then_some(BANDS),
            crops: None,
            squashed: None,
            tile_grid: None,
        };
        TokenPlan::new(tokens_u32(tokens)?, reduced, reason, &choices)
    }

    fn whole_resize(&self, choices: &Choices) -> Option<(usize, usize, Filter)> {
        Some((choices.width, choices.height, self.filter))
    }

    /// When the planned size has at most half the image's pixels, the model server's processor
    /// would decode all of them and resize, which costs it more than reading the planned image
    /// (bench/fronting.py measures it). Its resize of an image already at its planned size changes
    /// nothing, so the server sees the pixels it would have made.
    fn sends_resized(&self, width: usize, height: usize, choices: &Choices) -> bool {
        choices.width * choices.height * 2 <= width * height
    }

    /// Resized exactly as [`Self::preprocess`] resizes it, so the model server's own processor
    /// (whose resize of an image already at a planned size changes nothing) sees the same pixels.
    fn reduced_image(&self, image: RgbImage, choices: &Choices) -> PluginResult<RgbImage> {
        check_planned_size(choices, self.patch * self.merge)?;
        Ok(image.into_resized(choices.width, choices.height, self.filter))
    }

    fn preprocess(&self, image: RgbImage, choices: &Choices) -> PluginResult<Vec<Tensor>> {
        check_planned_size(choices, self.patch * self.merge)?;
        let source_height = image.height;
        let samples = qwen2vl_resized_patch_bytes_reusing(
            image,
            (0, source_height),
            (choices.width, choices.height),
            self.filter,
            (self.patch, self.merge),
            0..choices.height,
        );
        self.tensors(samples, choices.height, choices)
    }

    /// As the plan chose: the patches are laid out merge block row by merge block row, so a band
    /// of whole block rows is a run of the whole's patches, made from only the source rows under
    /// it.
    fn parts(&self, choices: &Choices) -> PluginResult<usize> {
        let Some(bands) = choices.bands else {
            return Ok(1);
        };
        check_planned_size(choices, self.patch * self.merge)?;
        if bands == 0 || bands > choices.height / (self.patch * self.merge) {
            return Err(PluginError::internal(format!(
                "{bands} bands of a {}-row image",
                choices.height
            )));
        }
        Ok(bands)
    }

    /// The merge block rows shared out so that each band costs about the same (see
    /// [`band_rows`]).
    fn band(&self, choices: &Choices, parts: usize, index: usize) -> PluginResult<Range<usize>> {
        if index >= parts {
            return Err(PluginError::internal(format!(
                "part {index} of an image made in {parts}"
            )));
        }
        let unit = self.patch * self.merge;
        let blocks = band_rows(choices.height / unit, parts, index);
        Ok(blocks.start * unit..blocks.end * unit)
    }

    fn preprocess_band(
        &self,
        rows: ImageRows,
        choices: &Choices,
        band: Range<usize>,
    ) -> PluginResult<Vec<Tensor>> {
        check_planned_size(choices, self.patch * self.merge)?;
        let height = band.len();
        let samples = qwen2vl_resized_patch_bytes_reusing(
            rows.rows,
            (rows.first_row, rows.image_height),
            (choices.width, choices.height),
            self.filter,
            (self.patch, self.merge),
            band,
        );
        self.tensors(samples, height, choices)
    }
}

impl Qwen2Vl {
    /// A Qwen2-VL image's tensors from its patches' samples (`rows` output rows of the planned
    /// width): raw samples plus the exact normalisation table (the host maps them back to HF's
    /// floats), a quarter of the bytes of f32 through the sandbox and in memory. HF tiles a still
    /// image over the temporal patch; its copies are not written but counted
    /// (`pixel_values_repeats`): half the bytes again, the same values.
    fn tensors(
        &self,
        samples: Vec<u8>,
        rows: usize,
        choices: &Choices,
    ) -> PluginResult<Vec<Tensor>> {
        let (gh, gw) = (rows / self.patch, choices.width / self.patch);
        let row = 3 * self.patch * self.patch;
        let table: Vec<f32> = self.normalize.table().into_iter().flatten().collect();
        Ok(vec![
            Tensor::from_u8("pixel_values", &[gh * gw, row], samples)?,
            Tensor::from_f32("pixel_values_table", &[3, 256], &table)?,
            Tensor::from_i64("pixel_values_repeats", &[], &[self.temporal as i64])?,
            Tensor::from_i64("image_grid_thw", &[1, 3], &[1, gh as i64, gw as i64])?,
        ])
    }
}

/// The smallest output (in pixels) made in bands: a band costs a plugin call and the entropy
/// decoding of the JPEG's rows above it, which a small image's few milliseconds do not repay.
const MIN_BANDED_PIXELS: usize = 4 << 20;

/// Bands a large image is made in. Each band after the first entropy-decodes the rows above it
/// again, so more bands cost more in all: on 2 cores, 2 bands of equal cost are the fastest
/// (4 would run in two rounds); more cores would want more (see [`band_rows`]).
const BANDS: usize = 2;

/// Of a band row's cost in the plugin (decode, resize, layout), the share that every band below
/// it pays again: the JPEG's entropy decoding, which cannot skip rows. Measured on a 12 MP photo
/// (quality 90, no resize; `plugin_parts`) made in two bands of unequal rows: each row above the
/// second band cost it about half of what the row cost the first (the entropy decoding is about
/// half of the call once the layout is fast). Bands are sized so that each costs the same (see
/// [`band_rows`]).
const REDECODED_SHARE: f64 = 1.0 / 2.0;

/// Band `index` of `bands` over `block_rows` rows of merge blocks, so that each band costs about
/// the same: band i's rows cost `a` each, plus `a·REDECODED_SHARE` for every row above it, so
/// equal costs need rows in proportion to (1 - REDECODED_SHARE)^i (on 2 bands, 2/3 and 1/3).
/// Every band has at least one block row (callers ask for at most `block_rows` bands).
fn band_rows(block_rows: usize, bands: usize, index: usize) -> Range<usize> {
    let ratio = 1.0 - REDECODED_SHARE;
    let total: f64 = (0..bands).map(|i| ratio.powi(i as i32)).sum();
    let boundary = |i: usize| -> usize {
        if i >= bands {
            return block_rows;
        }
        let above: f64 = (0..i).map(|k| ratio.powi(k as i32)).sum();
        let at = (block_rows as f64 * above / total).round() as usize;
        // At least one block row per band, before and after.
        at.clamp(i, block_rows - (bands - i))
    };
    boundary(index)..boundary(index + 1)
}

fn check_planned_size(choices: &Choices, factor: usize) -> PluginResult<()> {
    if !choices.width.is_multiple_of(factor)
        || !choices.height.is_multiple_of(factor)
        || choices.width == 0
        || choices.height == 0
    {
        return Err(PluginError::internal(
            "planned size is not a multiple of the patch factor",
        ));
    }
    Ok(())
}

fn over_budget(needed: usize, budget: u32, width: usize, height: usize) -> PluginError {
    PluginError::over_budget(
        u32::try_from(needed).unwrap_or(u32::MAX),
        budget,
        format!(
            "a {width}x{height} image needs at least {needed} tokens (at this model's min_pixels)"
        ),
    )
}

/// Qwen2-VL's `smart_resize`: both sides multiples of `factor`, pixel count (times `frames`, which
/// GLM-4.1V counts) within [`min_pixels`, `max_pixels`], aspect ratio kept as closely as possible.
/// Returns (height, width).
pub fn smart_resize(
    height: usize,
    width: usize,
    factor: usize,
    min_pixels: usize,
    max_pixels: usize,
    frames: usize,
) -> PluginResult<(usize, usize)> {
    let (hf, wf, ff) = (height as f64, width as f64, factor as f64);
    let counted = frames as f64;
    if height.max(width) as f64 / height.min(width).max(1) as f64 > 200.0 {
        return Err(PluginError::limit(format!(
            "absolute aspect ratio must be smaller than 200, got {}",
            height.max(width) as f64 / height.min(width).max(1) as f64
        )));
    }
    let mut h_bar = ((hf / ff).round_ties_even() * ff) as usize;
    let mut w_bar = ((wf / ff).round_ties_even() * ff) as usize;
    if frames * h_bar * w_bar > max_pixels {
        let beta = ((counted * hf * wf) / max_pixels as f64).sqrt();
        h_bar = factor.max(((hf / beta / ff).floor() * ff) as usize);
        w_bar = factor.max(((wf / beta / ff).floor() * ff) as usize);
    } else if frames * h_bar * w_bar < min_pixels {
        let beta = (min_pixels as f64 / (counted * hf * wf)).sqrt();
        h_bar = ((hf * beta / ff).ceil() * ff) as usize;
        w_bar = ((wf * beta / ff).ceil() * ff) as usize;
    }
    Ok((h_bar, w_bar))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::processor::for_config;

    /// Bands cover every block row once, in order, none empty; later bands are smaller, since
    /// each entropy-decodes the rows above it again (two bands: 2/3 and 1/3).
    #[test]
    fn bands_share_out_every_row_by_cost() {
        assert_eq!(band_rows(108, 2, 0), 0..72);
        assert_eq!(band_rows(108, 2, 1), 72..108);
        for (block_rows, bands) in [(108, 2), (2, 2), (3, 3), (50, 4), (7, 5), (1000, 8)] {
            let mut next = 0;
            let mut last = usize::MAX;
            for i in 0..bands {
                let rows = band_rows(block_rows, bands, i);
                assert_eq!(rows.start, next, "{block_rows} rows, {bands} bands");
                assert!(
                    !rows.is_empty() && rows.len() <= last.saturating_add(1),
                    "{rows:?}"
                );
                last = rows.len();
                next = rows.end;
            }
            assert_eq!(next, block_rows);
        }
    }

    /// Only a large JPEG is planned in bands: another format would be decoded whole for each.
    #[test]
    fn only_large_jpegs_are_planned_in_bands() {
        let processor = for_config(
            r#"{"image_processor_type": "Qwen2VLImageProcessor", "max_pixels": 12845056}"#,
        )
        .unwrap();
        let bands = |width, height, jpeg| {
            let plan = processor.plan(width, height, jpeg, u32::MAX).unwrap();
            processor.parts(&plan.choices().unwrap()).unwrap()
        };
        assert_eq!(bands(4032, 3024, true), 2);
        assert_eq!(bands(4032, 3024, false), 1);
        assert_eq!(bands(1280, 960, true), 1);
    }

    /// A Qwen2-VL image its plan shrinks to half its pixels or fewer goes to a model server
    /// resized; one kept near its size, or another family's, goes as it came.
    #[test]
    fn only_much_shrunk_qwen2_vl_images_are_sent_resized() {
        let qwen = for_config(
            r#"{"image_processor_type": "Qwen2VLImageProcessor", "max_pixels": 1003520}"#,
        )
        .unwrap();
        let sent_resized = |processor: &dyn ImageProcessor, width, height| {
            let plan = processor.plan(width, height, true, u32::MAX).unwrap();
            processor.sends_resized(width, height, &plan.choices().unwrap())
        };
        assert!(sent_resized(qwen.as_ref(), 4032, 3024));
        assert!(sent_resized(qwen.as_ref(), 1920, 1080));
        assert!(!sent_resized(qwen.as_ref(), 1280, 720));
        assert!(!sent_resized(qwen.as_ref(), 640, 480));
        let clip = for_config(
            r#"{"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 224},
                "crop_size": {"height": 224, "width": 224}}"#,
        )
        .unwrap();
        assert!(!sent_resized(clip.as_ref(), 4032, 3024));
    }

    /// PaddleOCR-VL's grids as transformers' `PaddleOCRVLImageProcessor` makes them (between 4 and
    /// 64 tokens' worth of pixels): a side under a token's raised first (20x30).
    #[test]
    fn paddleocr_vl_sizes_as_transformers() {
        let processor = for_config(
            r#"{"image_processor_type": "PaddleOCRVLImageProcessor", "min_pixels": 3136,
                "max_pixels": 50176, "patch_size": 14, "merge_size": 2}"#,
        )
        .unwrap();
        let grid = |width, height| {
            let plan = processor.plan(width, height, true, u32::MAX).unwrap();
            let choices: Choices = plan.choices().unwrap();
            (choices.grid_thw.unwrap(), plan.tokens)
        };
        assert_eq!(grid(640, 480), ([1, 12, 18], 54));
        assert_eq!(grid(20, 30), ([1, 6, 4], 6));
        assert_eq!(grid(900, 300), ([1, 8, 26], 52));
    }
}
