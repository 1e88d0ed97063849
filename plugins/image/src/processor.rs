//! The image processors: reading HF `preprocessor_config.json`, planning tokens, producing tensors.

use mmgate_plugin_sdk::imageops::{Normalize, RgbImage, qwen2vl_patches};
use mmgate_plugin_sdk::*;
use serde::{Deserialize, Serialize};

/// Processor types this plugin implements.
pub const SUPPORTED: &[&str] = &[
    "Qwen2VLImageProcessor",
    "Qwen2VLImageProcessorFast",
    "CLIPImageProcessor",
    "CLIPImageProcessorFast",
    "SiglipImageProcessor",
    "SiglipImageProcessorFast",
];

const CLIP_MEAN: [f32; 3] = [0.481_454_66, 0.457_827_5, 0.408_210_73];
// Written exactly as HF's OPENAI_CLIP_STD so the two can be compared by eye.
#[allow(clippy::excessive_precision)]
const CLIP_STD: [f32; 3] = [0.268_629_54, 0.261_302_58, 0.275_777_11];

#[derive(Debug, Default, Deserialize)]
struct SizeConfig {
    shortest_edge: Option<usize>,
    longest_edge: Option<usize>,
    height: Option<usize>,
    width: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
struct RawConfig {
    image_processor_type: Option<String>,
    min_pixels: Option<usize>,
    max_pixels: Option<usize>,
    patch_size: Option<usize>,
    temporal_patch_size: Option<usize>,
    merge_size: Option<usize>,
    image_mean: Option<[f32; 3]>,
    image_std: Option<[f32; 3]>,
    rescale_factor: Option<f64>,
    size: Option<SizeConfig>,
    crop_size: Option<SizeConfig>,
    do_center_crop: Option<bool>,
}

pub enum Processor {
    Qwen2Vl {
        min_pixels: usize,
        max_pixels: usize,
        patch: usize,
        temporal: usize,
        merge: usize,
        normalize: Normalize,
    },
    Fixed {
        resize: FixedResize,
        crop: Option<(usize, usize)>,
        patch: usize,
        normalize: Normalize,
    },
}

pub enum FixedResize {
    ShortestEdge(usize),
    Exact { width: usize, height: usize },
}

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
}

fn positive(name: &str, value: usize) -> PluginResult<usize> {
    if value == 0 {
        return Err(PluginError::unsupported(format!(
            "processor config: {name} must be positive"
        )));
    }
    Ok(value)
}

impl Processor {
    pub fn from_config(json: &str) -> PluginResult<Processor> {
        let raw: RawConfig = parse_config(json)?;
        let kind = raw.image_processor_type.as_deref().ok_or_else(|| {
            PluginError::unsupported("processor config has no image_processor_type")
        })?;
        let normalize = |mean, std| Normalize {
            rescale: raw.rescale_factor.unwrap_or(1.0 / 255.0),
            mean: raw.image_mean.unwrap_or(mean),
            std: raw.image_std.unwrap_or(std),
        };
        match kind {
            "Qwen2VLImageProcessor" | "Qwen2VLImageProcessorFast" => {
                let size = raw.size.as_ref();
                let min_pixels = raw
                    .min_pixels
                    .or_else(|| size.and_then(|s| s.shortest_edge))
                    .unwrap_or(56 * 56);
                let max_pixels = raw
                    .max_pixels
                    .or_else(|| size.and_then(|s| s.longest_edge))
                    .unwrap_or(28 * 28 * 1280);
                if min_pixels > max_pixels {
                    return Err(PluginError::unsupported(format!(
                        "processor config: min_pixels {min_pixels} > max_pixels {max_pixels}"
                    )));
                }
                Ok(Processor::Qwen2Vl {
                    min_pixels,
                    max_pixels: positive("max_pixels", max_pixels)?,
                    patch: positive("patch_size", raw.patch_size.unwrap_or(14))?,
                    temporal: positive(
                        "temporal_patch_size",
                        raw.temporal_patch_size.unwrap_or(2),
                    )?,
                    merge: positive("merge_size", raw.merge_size.unwrap_or(2))?,
                    normalize: normalize(CLIP_MEAN, CLIP_STD),
                })
            }
            "CLIPImageProcessor"
            | "CLIPImageProcessorFast"
            | "SiglipImageProcessor"
            | "SiglipImageProcessorFast" => {
                let siglip = kind.starts_with("Siglip");
                let size = raw.size.unwrap_or_default();
                let resize = match (size.shortest_edge, size.height, size.width) {
                    (Some(edge), _, _) => FixedResize::ShortestEdge(positive("size", edge)?),
                    (None, Some(h), Some(w)) => FixedResize::Exact {
                        width: positive("size.width", w)?,
                        height: positive("size.height", h)?,
                    },
                    _ => {
                        return Err(PluginError::unsupported(
                            "processor config: size needs shortest_edge or height and width",
                        ));
                    }
                };
                let crop = match (raw.do_center_crop.unwrap_or(!siglip), raw.crop_size) {
                    (
                        true,
                        Some(SizeConfig {
                            height: Some(h),
                            width: Some(w),
                            ..
                        }),
                    ) => Some((
                        positive("crop_size.width", w)?,
                        positive("crop_size.height", h)?,
                    )),
                    (
                        true,
                        Some(SizeConfig {
                            shortest_edge: Some(e),
                            ..
                        }),
                    ) => Some((positive("crop_size", e)?, e)),
                    (true, _) => {
                        return Err(PluginError::unsupported(
                            "processor config: do_center_crop needs crop_size",
                        ));
                    }
                    (false, _) => None,
                };
                let (mean, std) = if siglip {
                    ([0.5; 3], [0.5; 3])
                } else {
                    (CLIP_MEAN, CLIP_STD)
                };
                Ok(Processor::Fixed {
                    resize,
                    crop,
                    patch: positive("patch_size", raw.patch_size.unwrap_or(14))?,
                    normalize: normalize(mean, std),
                })
            }
            other => Err(PluginError::unsupported(format!(
                "image processor type {other:?} is not supported (supported: {})",
                SUPPORTED.join(", ")
            ))),
        }
    }

    pub fn plan(&self, width: usize, height: usize, budget: u32) -> PluginResult<TokenPlan> {
        match self {
            Processor::Qwen2Vl {
                min_pixels,
                max_pixels,
                patch,
                merge,
                ..
            } => {
                let factor = patch * merge;
                let tokens_of = |h: usize, w: usize| (h / factor) * (w / factor);
                let (h, w) = smart_resize(height, width, factor, *min_pixels, *max_pixels)?;
                let native = tokens_of(h, w);
                let (h, w, reduced) = if native <= budget as usize {
                    (h, w, false)
                } else {
                    // The largest resolution that fits: smart_resize with max_pixels lowered to the
                    // budget's worth of pixels (each token is factor² pixels).
                    let cap = (budget as usize).saturating_mul(factor * factor);
                    let smallest = smart_resize(height, width, factor, *min_pixels, *min_pixels)?;
                    let needed = tokens_of(smallest.0, smallest.1);
                    if cap < *min_pixels {
                        return Err(over_budget(needed, budget, width, height));
                    }
                    let (h, w) = smart_resize(height, width, factor, *min_pixels, cap)?;
                    if tokens_of(h, w) > budget as usize {
                        return Err(over_budget(
                            needed.max(tokens_of(h, w)),
                            budget,
                            width,
                            height,
                        ));
                    }
                    (h, w, true)
                };
                let tokens = tokens_of(h, w);
                let reason = if reduced {
                    format!(
                        "{width}x{height} resized to {w}x{h} ({tokens} tokens) to fit the budget of \
                         {budget}; native size would cost {native}"
                    )
                } else {
                    format!("{width}x{height} resized to {w}x{h}: {tokens} tokens")
                };
                let choices = Choices {
                    width: w,
                    height: h,
                    crop: None,
                    grid_thw: Some([1, h / patch, w / patch]),
                };
                TokenPlan::new(tokens_u32(tokens)?, reduced, reason, &choices)
            }
            Processor::Fixed {
                resize,
                crop,
                patch,
                ..
            } => {
                let (rw, rh) = match *resize {
                    FixedResize::ShortestEdge(edge) => shortest_edge_size(width, height, edge),
                    FixedResize::Exact { width, height } => (width, height),
                };
                let (fw, fh) = crop.unwrap_or((rw, rh));
                let tokens = (fh / patch) * (fw / patch);
                if tokens > budget as usize {
                    return Err(PluginError::over_budget(
                        tokens_u32(tokens)?,
                        budget,
                        format!("this model's images always cost {tokens} tokens"),
                    ));
                }
                let choices = Choices {
                    width: rw,
                    height: rh,
                    crop: crop.map(|(w, h)| [w, h]),
                    grid_thw: None,
                };
                let reason = format!("{width}x{height} → {fw}x{fh}: fixed {tokens} tokens");
                TokenPlan::new(tokens_u32(tokens)?, false, reason, &choices)
            }
        }
    }

    pub fn preprocess(&self, image: &RgbImage, choices: &Choices) -> PluginResult<Vec<Tensor>> {
        match self {
            Processor::Qwen2Vl {
                patch,
                merge,
                temporal,
                normalize,
                ..
            } => {
                let factor = patch * merge;
                if !choices.width.is_multiple_of(factor)
                    || !choices.height.is_multiple_of(factor)
                    || choices.width == 0
                {
                    return Err(PluginError::internal(
                        "planned size is not a multiple of the patch factor",
                    ));
                }
                let resized = image.resize_bicubic(choices.width, choices.height);
                let table = normalize.table();
                let values = qwen2vl_patches(&resized, *patch, *merge, *temporal, |c, v| {
                    table[c][usize::from(v)]
                });
                let (gh, gw) = (choices.height / patch, choices.width / patch);
                let row = 3 * temporal * patch * patch;
                Ok(vec![
                    Tensor::from_f32("pixel_values", &[gh * gw, row], &values)?,
                    Tensor::from_i64("image_grid_thw", &[1, 3], &[1, gh as i64, gw as i64])?,
                ])
            }
            Processor::Fixed { normalize, .. } => {
                let mut resized = image.resize_bicubic(choices.width, choices.height);
                if let Some([cw, ch]) = choices.crop {
                    // HF's center_crop: top = (h - ch) // 2, left = (w - cw) // 2, padding with zeros
                    // when the crop is larger than the image.
                    let top = (resized.height as isize - ch as isize).div_euclid(2);
                    let left = (resized.width as isize - cw as isize).div_euclid(2);
                    resized = resized.crop(left, top, cw, ch);
                }
                let table = normalize.table();
                let (w, h) = (resized.width, resized.height);
                let mut values = vec![0f32; 3 * w * h];
                for (i, px) in resized.data.chunks_exact(3).enumerate() {
                    for c in 0..3 {
                        values[c * w * h + i] = table[c][usize::from(px[c])];
                    }
                }
                Ok(vec![Tensor::from_f32(
                    "pixel_values",
                    &[1, 3, h, w],
                    &values,
                )?])
            }
        }
    }
}

fn tokens_u32(tokens: usize) -> PluginResult<u32> {
    u32::try_from(tokens).map_err(|_| PluginError::limit(format!("{tokens} tokens is too many")))
}

fn over_budget(needed: usize, budget: u32, width: usize, height: usize) -> PluginError {
    PluginError::over_budget(
        u32::try_from(needed).unwrap_or(u32::MAX),
        budget,
        format!(
            "a {width}x{height} image needs at least {needed} tokens at the smallest resolution this \
             model accepts"
        ),
    )
}

/// Python's `round`: halves go to the even neighbour.
fn round_half_even(x: f64) -> f64 {
    let r = x.round();
    if (x - x.trunc()).abs() == 0.5 {
        2.0 * (x / 2.0).round()
    } else {
        r
    }
}

/// Qwen2-VL's `smart_resize`: both sides multiples of `factor`, pixel count within
/// [`min_pixels`, `max_pixels`], aspect ratio kept as closely as possible. Returns (height, width).
pub fn smart_resize(
    height: usize,
    width: usize,
    factor: usize,
    min_pixels: usize,
    max_pixels: usize,
) -> PluginResult<(usize, usize)> {
    let (hf, wf, ff) = (height as f64, width as f64, factor as f64);
    if height.max(width) as f64 / height.min(width).max(1) as f64 > 200.0 {
        return Err(PluginError::limit(format!(
            "absolute aspect ratio must be smaller than 200, got {}",
            height.max(width) as f64 / height.min(width).max(1) as f64
        )));
    }
    let mut h_bar = (round_half_even(hf / ff) * ff) as usize;
    let mut w_bar = (round_half_even(wf / ff) * ff) as usize;
    if h_bar * w_bar > max_pixels {
        let beta = ((hf * wf) / max_pixels as f64).sqrt();
        h_bar = factor.max(((hf / beta / ff).floor() * ff) as usize);
        w_bar = factor.max(((wf / beta / ff).floor() * ff) as usize);
    } else if h_bar * w_bar < min_pixels {
        let beta = (min_pixels as f64 / (hf * wf)).sqrt();
        h_bar = ((hf * beta / ff).ceil() * ff) as usize;
        w_bar = ((wf * beta / ff).ceil() * ff) as usize;
    }
    Ok((h_bar, w_bar))
}

/// CLIP's `get_resize_output_image_size` for `shortest_edge`: the short side becomes `edge`, the long
/// side `int(edge * long / short)`. Returns (width, height).
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
