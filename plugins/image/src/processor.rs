//! The image processors: reading HF `preprocessor_config.json`, planning tokens, producing tensors.

use std::ops::Range;

use mmgate_plugin_sdk::imagedecode::ImageRows;
use mmgate_plugin_sdk::imageops::{
    CLIP_MEAN, CLIP_STD, Filter, Normalize, RgbImage, qwen2vl_resized_patch_bytes_reusing,
};
use mmgate_plugin_sdk::*;
use serde::Deserialize;

pub use crate::choices::Choices;
use crate::choices::tokens_u32;
use crate::gemma3::{Gemma3, PanAndScan};
use crate::idefics3::Idefics3;
use crate::internvl::InternVl;
use crate::llama4::Llama4;
use crate::llava_next::LlavaNext;
use crate::pixtral::Pixtral;

/// Processor classes this plugin implements (HF's `...Fast` and `...Pil` variants of each compute
/// the same thing and are accepted too).
pub const SUPPORTED: &[&str] = &[
    "Qwen2VLImageProcessor",
    "Qwen2_5_VLImageProcessor",
    "CLIPImageProcessor",
    "CLIPFeatureExtractor",
    "SiglipImageProcessor",
    "Gemma3ImageProcessor",
    "PixtralImageProcessor",
    "LlavaNextImageProcessor",
    "LlavaOnevisionImageProcessor",
    "GotOcr2ImageProcessor",
    "Glm4vImageProcessor",
    "Idefics3ImageProcessor",
    "SmolVLMImageProcessor",
    "Llama4ImageProcessor",
];

/// `size` / `crop_size` in either of the forms checkpoints use: a bare number (old feature
/// extractors: the shortest edge for `size`, a square for `crop_size`) or a dict.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum SizeField {
    Edge(usize),
    Dict(SizeConfig),
}

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
    /// Checkpoints saved before image processors existed name the class here instead.
    feature_extractor_type: Option<String>,
    min_pixels: Option<usize>,
    max_pixels: Option<usize>,
    patch_size: Option<SizeField>,
    temporal_patch_size: Option<usize>,
    /// Pixtral: patches merged into a token a side (the model's; its family adds it).
    spatial_merge_size: Option<usize>,
    /// LLaVA-NeXT: the resolutions an image is fitted into, `[height, width]` each.
    image_grid_pinpoints: Option<Vec<[usize; 2]>>,
    /// LLaVA-NeXT: whether the base view keeps the class token ("full") or not ("default"); the
    /// model's, which its family adds.
    vision_feature_select_strategy: Option<String>,
    /// LLaVA-NeXT / OneVision: the base view's tokens beyond its patches (a class token: 1 for
    /// CLIP, 0 for SigLIP); the model's, which its family adds.
    num_additional_image_tokens: Option<usize>,
    /// LLaVA-OneVision: "anyres_max_N", the tiles' features pooled to about N views' worth.
    vision_aspect_ratio: Option<String>,
    merge_size: Option<usize>,
    image_mean: Option<[f32; 3]>,
    image_std: Option<[f32; 3]>,
    rescale_factor: Option<f64>,
    resample: Option<u32>,
    do_resize: Option<bool>,
    do_rescale: Option<bool>,
    do_normalize: Option<bool>,
    do_center_crop: Option<bool>,
    size: Option<SizeField>,
    crop_size: Option<SizeField>,
    /// Gemma 3: tokens per view, and pan-and-scan (null in checkpoints: the processor's defaults).
    image_seq_length: Option<usize>,
    do_pan_and_scan: Option<bool>,
    pan_and_scan_min_crop_size: Option<usize>,
    pan_and_scan_max_num_crops: Option<usize>,
    pan_and_scan_min_ratio_to_activate: Option<f64>,
    /// InternVL (`GotOcr2ImageProcessor`): tiling, and the tiles it may make.
    crop_to_patches: Option<bool>,
    min_patches: Option<usize>,
    max_patches: Option<usize>,
    /// Idefics3 / SmolVLM: splitting into tiles of `max_image_size`, each of `image_seq_len`
    /// tokens (the processor's, which the family adds).
    do_image_splitting: Option<bool>,
    max_image_size: Option<SizeField>,
    image_seq_len: Option<usize>,
    /// Llama 4: the canvas rule, and the tower's pixel shuffle (the model's, which its family
    /// adds with the tower's patch size).
    resize_to_max_canvas: Option<bool>,
    pixel_shuffle_ratio: Option<f64>,
}

/// How a processor of Qwen2-VL's patches sizes a still image against its pixel limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SizeRule {
    /// Qwen2-VL, Qwen2.5-VL: the image's pixels.
    Qwen2Vl,
    /// GLM-4.1V (`Glm4vImageProcessor`): a side under a token's scaled up first, and the pixels
    /// counted once for each frame of the temporal patch the image fills.
    Glm4v,
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
        }
    }
}

pub enum Processor {
    Qwen2Vl {
        rule: SizeRule,
        min_pixels: usize,
        max_pixels: usize,
        patch: usize,
        temporal: usize,
        merge: usize,
        filter: Filter,
        normalize: Normalize,
    },
    Fixed {
        resize: FixedResize,
        crop: Option<(usize, usize)>,
        patch: usize,
        filter: Filter,
        normalize: Normalize,
    },
    Gemma3(Gemma3),
    Pixtral(Pixtral),
    LlavaNext(LlavaNext),
    InternVl(InternVl),
    Idefics3(Idefics3),
    Llama4(Llama4),
}

pub enum FixedResize {
    ShortestEdge(usize),
    Exact { width: usize, height: usize },
}

impl RawConfig {
    /// `patch_size` as a number, or as `{height, width}` (square: Pixtral's).
    fn patch_edge(&self) -> PluginResult<Option<usize>> {
        match &self.patch_size {
            None => Ok(None),
            Some(SizeField::Edge(edge)) => Ok(Some(*edge)),
            Some(SizeField::Dict(SizeConfig {
                height: Some(h),
                width: Some(w),
                ..
            })) if h == w => Ok(Some(*h)),
            Some(_) => Err(PluginError::unsupported(
                "processor config: patch_size must be a number or a square {height, width}",
            )),
        }
    }
}

/// Idefics3's and SmolVLM's processor (their defaults are Idefics3-8B's).
fn idefics3(raw: &RawConfig) -> PluginResult<Idefics3> {
    let longest = |field: &Option<SizeField>, name: &str, default: usize| match field {
        None => Ok(default),
        Some(SizeField::Dict(SizeConfig {
            longest_edge: Some(edge),
            ..
        })) => positive(name, *edge),
        Some(_) => Err(PluginError::unsupported(format!(
            "processor config: {name} needs longest_edge"
        ))),
    };
    Ok(Idefics3 {
        splitting: raw.do_image_splitting.unwrap_or(true),
        longest_edge: longest(&raw.size, "size", 4 * 364)?,
        tile: longest(&raw.max_image_size, "max_image_size", 364)?,
        tokens_per_tile: positive("image_seq_len", raw.image_seq_len.unwrap_or(169))?,
    })
}

/// Llama 4's processor (its defaults are Llama 4 Scout's).
fn llama4(raw: &RawConfig) -> PluginResult<Llama4> {
    let tile = match &raw.size {
        None => 336,
        Some(SizeField::Dict(SizeConfig {
            height: Some(h),
            width: Some(w),
            ..
        })) if h == w => positive("size.height", *h)?,
        Some(_) => {
            return Err(PluginError::unsupported(
                "processor config: Llama 4's tiles need a square size {height, width}",
            ));
        }
    };
    let patch = positive("patch_size", raw.patch_edge()?.unwrap_or(14))?;
    let ratio = raw.pixel_shuffle_ratio.unwrap_or(0.5);
    if !(ratio > 0.0 && ratio <= 1.0) || tile < patch {
        return Err(PluginError::unsupported(format!(
            "processor config: tiles of {tile} px in patches of {patch} px, shuffled by {ratio}"
        )));
    }
    // transformers' and vLLM's `(tile // patch)² // round(1 / ratio²)`.
    let shuffle = (1.0 / (ratio * ratio)).round() as usize;
    Ok(Llama4 {
        tile,
        max_tiles: positive("max_patches", raw.max_patches.unwrap_or(16))?,
        resize_to_max_canvas: raw.resize_to_max_canvas.unwrap_or(false),
        tokens_per_tile: positive("tokens per tile", (tile / patch).pow(2) / shuffle.max(1))?,
    })
}

fn positive(name: &str, value: usize) -> PluginResult<usize> {
    if value == 0 {
        return Err(PluginError::unsupported(format!(
            "processor config: {name} must be positive"
        )));
    }
    Ok(value)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Family {
    Qwen2Vl,
    Clip,
    Siglip,
    Gemma3,
    Pixtral,
    LlavaNext,
    LlavaOnevision,
    InternVl,
    Glm4v,
    Idefics3,
    Llama4,
}

/// The processor family a class name belongs to: HF's PIL (`...Pil`), torchvision (`...Fast`) and
/// feature-extractor classes all compute the same thing.
fn family(class: &str) -> Option<Family> {
    let class = class.strip_suffix("Pil").unwrap_or(class);
    let class = class.strip_suffix("Fast").unwrap_or(class);
    match class {
        "Qwen2VLImageProcessor" | "Qwen2_5_VLImageProcessor" => Some(Family::Qwen2Vl),
        "CLIPImageProcessor" | "CLIPFeatureExtractor" => Some(Family::Clip),
        "SiglipImageProcessor" => Some(Family::Siglip),
        "Gemma3ImageProcessor" => Some(Family::Gemma3),
        "PixtralImageProcessor" => Some(Family::Pixtral),
        "LlavaNextImageProcessor" => Some(Family::LlavaNext),
        "LlavaOnevisionImageProcessor" => Some(Family::LlavaOnevision),
        "GotOcr2ImageProcessor" => Some(Family::InternVl),
        "Glm4vImageProcessor" => Some(Family::Glm4v),
        "Idefics3ImageProcessor" | "SmolVLMImageProcessor" => Some(Family::Idefics3),
        "Llama4ImageProcessor" => Some(Family::Llama4),
        _ => None,
    }
}

impl Processor {
    pub fn from_config(json: &str) -> PluginResult<Processor> {
        let raw: RawConfig = parse_config(json)?;
        let kind = raw
            .image_processor_type
            .as_deref()
            .or(raw.feature_extractor_type.as_deref())
            .ok_or_else(|| {
                PluginError::unsupported(
                    "processor config names no image_processor_type (or feature_extractor_type)",
                )
            })?;
        let family = family(kind).ok_or_else(|| {
            PluginError::unsupported(format!(
                "image processor type {kind:?} is not supported (supported: {})",
                SUPPORTED.join(", ")
            ))
        })?;
        let filter = match raw.resample {
            // Planned and counted only: the resampling is the engine's (Idefics3's is Lanczos).
            _ if matches!(family, Family::Idefics3 | Family::Llama4) => Filter::Bicubic,
            None => Filter::Bicubic,
            Some(code) => Filter::from_pil_code(code).ok_or_else(|| {
                PluginError::unsupported(format!(
                    "processor config: resample {code} is not supported (2 = bilinear and \
                     3 = bicubic are)"
                ))
            })?,
        };
        let normalize = |mean, std| Normalize {
            rescale: if raw.do_rescale.unwrap_or(true) {
                raw.rescale_factor.unwrap_or(1.0 / 255.0)
            } else {
                1.0
            },
            mean: if raw.do_normalize.unwrap_or(true) {
                raw.image_mean.unwrap_or(mean)
            } else {
                [0.0; 3]
            },
            std: if raw.do_normalize.unwrap_or(true) {
                raw.image_std.unwrap_or(std)
            } else {
                [1.0; 3]
            },
        };
        if raw.do_resize == Some(false) {
            return Err(PluginError::unsupported(
                "processor config: do_resize = false is not supported",
            ));
        }
        match family {
            Family::Qwen2Vl | Family::Glm4v => {
                let (rule, default_pixels) = match family {
                    Family::Glm4v => (SizeRule::Glm4v, (112 * 112, 28 * 28 * 15_000)),
                    _ => (SizeRule::Qwen2Vl, (56 * 56, 28 * 28 * 1280)),
                };
                let size = match &raw.size {
                    Some(SizeField::Dict(size)) => Some(size),
                    _ => None,
                };
                let min_pixels = raw
                    .min_pixels
                    .or_else(|| size.and_then(|s| s.shortest_edge))
                    .unwrap_or(default_pixels.0);
                let max_pixels = raw
                    .max_pixels
                    .or_else(|| size.and_then(|s| s.longest_edge))
                    .unwrap_or(default_pixels.1);
                if min_pixels > max_pixels {
                    return Err(PluginError::unsupported(format!(
                        "processor config: min_pixels {min_pixels} > max_pixels {max_pixels}"
                    )));
                }
                Ok(Processor::Qwen2Vl {
                    rule,
                    min_pixels,
                    max_pixels: positive("max_pixels", max_pixels)?,
                    patch: positive("patch_size", raw.patch_edge()?.unwrap_or(14))?,
                    temporal: positive(
                        "temporal_patch_size",
                        raw.temporal_patch_size.unwrap_or(2),
                    )?,
                    merge: positive("merge_size", raw.merge_size.unwrap_or(2))?,
                    filter,
                    normalize: normalize(CLIP_MEAN, CLIP_STD),
                })
            }
            Family::LlavaNext | Family::LlavaOnevision => {
                let tile = match (&raw.crop_size, &raw.size) {
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
                    _ if family == Family::LlavaOnevision => 384,
                    _ => 336,
                };
                let tile = positive("crop_size", tile)?;
                let pinpoints: Vec<(usize, usize)> = raw
                    .image_grid_pinpoints
                    .clone()
                    .unwrap_or_default()
                    .into_iter()
                    .map(|[h, w]| (h, w))
                    .collect();
                if pinpoints.is_empty() || pinpoints.iter().any(|&(h, w)| h < tile || w < tile) {
                    return Err(PluginError::unsupported(
                        "processor config: anyres needs image_grid_pinpoints of at least a tile each",
                    ));
                }
                let onevision = family == Family::LlavaOnevision;
                let strategy = raw.vision_feature_select_strategy.as_deref();
                let drops_one = match strategy.unwrap_or(if onevision { "full" } else { "default" })
                {
                    "default" => true,
                    "full" => false,
                    other => {
                        return Err(PluginError::unsupported(format!(
                            "processor config: vision_feature_select_strategy {other:?} (default, full)"
                        )));
                    }
                };
                let patch = positive("patch_size", raw.patch_edge()?.unwrap_or(14))?;
                // CLIP's class token (LLaVA-NeXT's towers); SigLIP (OneVision's) has none.
                let additional = raw
                    .num_additional_image_tokens
                    .unwrap_or(usize::from(!onevision));
                let side = tile / patch;
                let max_views = match (onevision, raw.vision_aspect_ratio.as_deref()) {
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
                Ok(Processor::LlavaNext(LlavaNext {
                    pinpoints,
                    tile,
                    patch,
                    base_tokens: (side * side + additional).saturating_sub(usize::from(drops_one)),
                    max_views,
                    filter,
                }))
            }
            Family::Idefics3 => idefics3(&raw).map(Processor::Idefics3),
            Family::Llama4 => llama4(&raw).map(Processor::Llama4),
            Family::InternVl => {
                let tile = match raw.size {
                    Some(SizeField::Dict(SizeConfig {
                        height: Some(h),
                        width: Some(w),
                        ..
                    })) if h == w => positive("size.height", h)?,
                    None => 448,
                    _ => {
                        return Err(PluginError::unsupported(
                            "processor config: InternVL's tiles need a square size {height, width}",
                        ));
                    }
                };
                let min_patches = positive("min_patches", raw.min_patches.unwrap_or(1))?;
                let max_patches = positive("max_patches", raw.max_patches.unwrap_or(12))?;
                if min_patches > max_patches || max_patches > 64 {
                    return Err(PluginError::unsupported(format!(
                        "processor config: need min_patches <= max_patches <= 64 (min \
                         {min_patches}, max {max_patches})"
                    )));
                }
                Ok(Processor::InternVl(InternVl {
                    crop_to_patches: raw.crop_to_patches.unwrap_or(true),
                    min_patches,
                    max_patches,
                    tile,
                    tokens_per_tile: positive(
                        "image_seq_length",
                        raw.image_seq_length.unwrap_or(256),
                    )?,
                    filter,
                    normalize: normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
                }))
            }
            Family::Pixtral => {
                let longest_edge = match raw.size {
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
                let patch = positive("patch_size", raw.patch_edge()?.unwrap_or(16))?;
                let merge = positive("spatial_merge_size", raw.spatial_merge_size.unwrap_or(1))?;
                Ok(Processor::Pixtral(Pixtral {
                    longest_edge,
                    token_edge: patch * merge,
                    filter,
                    normalize: normalize(CLIP_MEAN, CLIP_STD),
                }))
            }
            Family::Gemma3 => {
                let size = match raw.size {
                    Some(SizeField::Dict(SizeConfig {
                        height: Some(h),
                        width: Some(w),
                        ..
                    })) => (positive("size.width", w)?, positive("size.height", h)?),
                    None => (896, 896),
                    _ => {
                        return Err(PluginError::unsupported(
                            "processor config: Gemma 3's size needs height and width",
                        ));
                    }
                };
                let pan_and_scan = raw.do_pan_and_scan.unwrap_or(false).then(|| {
                    PanAndScan::new(
                        raw.pan_and_scan_min_crop_size,
                        raw.pan_and_scan_max_num_crops,
                        raw.pan_and_scan_min_ratio_to_activate,
                    )
                });
                if let Some(p) = &pan_and_scan {
                    positive("pan_and_scan_min_crop_size", p.min_crop)?;
                    positive("pan_and_scan_max_num_crops", p.max_crops)?;
                }
                let filter = match raw.resample {
                    None => Filter::Bilinear,
                    Some(_) => filter,
                };
                Ok(Processor::Gemma3(Gemma3::new(
                    size,
                    raw.image_seq_length
                        .map(|t| positive("image_seq_length", t))
                        .transpose()?,
                    pan_and_scan,
                    filter,
                    normalize([0.5; 3], [0.5; 3]),
                )))
            }
            Family::Clip | Family::Siglip => {
                let siglip = family == Family::Siglip;
                let resize = match raw.size {
                    Some(SizeField::Edge(edge)) => {
                        FixedResize::ShortestEdge(positive("size", edge)?)
                    }
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
                let patch = positive("patch_size", raw.patch_edge()?.unwrap_or(14))?;
                let crop = match (raw.do_center_crop.unwrap_or(!siglip), raw.crop_size) {
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
                let (mean, std) = if siglip {
                    ([0.5; 3], [0.5; 3])
                } else {
                    (CLIP_MEAN, CLIP_STD)
                };
                Ok(Processor::Fixed {
                    resize,
                    crop,
                    patch,
                    filter,
                    normalize: normalize(mean, std),
                })
            }
        }
    }

    /// `jpeg`: the image is a JPEG, whose rows the host decodes a band at a time (only such an
    /// image is made in bands: any other is decoded whole for each band).
    pub fn plan(
        &self,
        width: usize,
        height: usize,
        jpeg: bool,
        budget: u32,
    ) -> PluginResult<TokenPlan> {
        match self {
            Processor::Qwen2Vl {
                rule,
                min_pixels,
                max_pixels,
                patch,
                merge,
                temporal,
                ..
            } => {
                let factor = patch * merge;
                let tokens_of = |(h, w): (usize, usize)| (h / factor) * (w / factor);
                let (start_h, start_w, frames) = rule.start(height, width, factor, *temporal);
                let resize = |max_pixels| {
                    smart_resize(start_h, start_w, factor, *min_pixels, max_pixels, frames)
                };
                let native_size = resize(*max_pixels)?;
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
                            .clamp(*min_pixels, *max_pixels);
                        let size = resize(cap)?;
                        if frames * size.0 * size.1 >= *min_pixels || cap >= *max_pixels {
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
                    bands: None,
                    crops: None,
                    squashed: None,
                    tile_grid: None,
                };
                let reason = format!("{width}x{height} → {fw}x{fh}: fixed {tokens} tokens");
                TokenPlan::new(tokens_u32(tokens)?, false, reason, &choices)
            }
            Processor::Gemma3(gemma3) => gemma3.plan(width, height, budget),
            Processor::Pixtral(pixtral) => pixtral.plan(width, height, budget),
            Processor::LlavaNext(llava) => llava.plan(width, height, budget),
            Processor::InternVl(internvl) => internvl.plan(width, height, budget),
            Processor::Idefics3(idefics3) => idefics3.plan(width, height, budget),
            Processor::Llama4(llama4) => llama4.plan(width, height, budget),
        }
    }

    /// The size and filter the whole image is resized to before anything else, by both
    /// [`Self::preprocess`] and [`Self::reduced_image`], where they begin so: the caller then
    /// decodes it at that size at once (a JPEG's resize runs in the host) and the resize here
    /// finds it done. `None` where the first step is something else (crops of the image as it
    /// came, tiles) or none.
    pub fn whole_resize(&self, choices: &Choices) -> Option<(usize, usize, Filter)> {
        let planned = |filter: Filter| Some((choices.width, choices.height, filter));
        let squashed = |filter: Filter| choices.squashed.map(|[w, h]| (w, h, filter));
        match self {
            Processor::Qwen2Vl { filter, .. } | Processor::Fixed { filter, .. } => planned(*filter),
            Processor::Pixtral(pixtral) => planned(pixtral.filter),
            Processor::LlavaNext(llava) => planned(llava.filter),
            Processor::Gemma3(gemma3) => squashed(gemma3.filter),
            Processor::InternVl(internvl) => squashed(internvl.filter),
            Processor::Idefics3(_) | Processor::Llama4(_) => None,
        }
    }

    /// Whether an image its plan keeps at the processor's own size is still sent resized to it:
    /// when that size has at most half its pixels, the model server's processor would decode all
    /// of them and resize, which costs it more than reading the planned image (bench/fronting.py
    /// measures it). Only for Qwen2-VL plans, whose resize of an image already at its planned
    /// size changes nothing, so the server sees the pixels it would have made.
    pub fn sends_resized(&self, width: usize, height: usize, choices: &Choices) -> bool {
        matches!(self, Processor::Qwen2Vl { .. })
            && choices.width * choices.height * 2 <= width * height
    }

    /// The image a reduced plan chose, at its planned size: resized exactly as [`Self::preprocess`]
    /// resizes it, so the model server's own processor (whose resize of an image already at a
    /// planned size changes nothing) sees the same pixels. Only Qwen2-VL plans are ever reduced.
    pub fn reduced_image(&self, image: RgbImage, choices: &Choices) -> PluginResult<RgbImage> {
        match self {
            Processor::Qwen2Vl {
                patch,
                merge,
                filter,
                ..
            } => {
                check_planned_size(choices, patch * merge)?;
                Ok(image.into_resized(choices.width, choices.height, *filter))
            }
            Processor::Fixed { .. } => Err(PluginError::internal(
                "a fixed-size processor's plan is never reduced",
            )),
            Processor::Gemma3(gemma3) => gemma3.reduced_image(image, choices),
            Processor::Pixtral(pixtral) => pixtral.reduced_image(image, choices),
            Processor::LlavaNext(llava) => llava.reduced_image(image, choices),
            Processor::InternVl(internvl) => internvl.reduced_image(image, choices),
            Processor::Idefics3(idefics3) => idefics3.reduced_image(image, choices),
            Processor::Llama4(llama4) => llama4.reduced_image(image, choices),
        }
    }

    pub fn preprocess(&self, image: RgbImage, choices: &Choices) -> PluginResult<Vec<Tensor>> {
        match self {
            Processor::Qwen2Vl {
                patch,
                merge,
                temporal,
                filter,
                normalize,
                ..
            } => {
                check_planned_size(choices, patch * merge)?;
                let source_height = image.height;
                let samples = qwen2vl_resized_patch_bytes_reusing(
                    image,
                    (0, source_height),
                    (choices.width, choices.height),
                    *filter,
                    (*patch, *merge),
                    0..choices.height,
                );
                qwen2vl_tensors(
                    samples,
                    choices.height,
                    choices,
                    *patch,
                    *temporal,
                    normalize,
                )
            }
            Processor::Fixed {
                filter, normalize, ..
            } => {
                let mut resized = image.into_resized(choices.width, choices.height, *filter);
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
                    normalize.planar_le_bytes(&resized),
                )?])
            }
            Processor::Gemma3(gemma3) => gemma3.preprocess(image, choices),
            Processor::Pixtral(pixtral) => pixtral.preprocess(image, choices),
            Processor::InternVl(internvl) => internvl.preprocess(image, choices),
            Processor::LlavaNext(_) | Processor::Idefics3(_) | Processor::Llama4(_) => {
                Err(PluginError::unsupported(
                    "this model's images are planned here for an engine that makes their tensors: \
                 this plugin counts their tokens but does not make them",
                ))
            }
        }
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

/// A band of an image's output rows: whole merge blocks of `patch * merge` rows of its planned
/// size.
pub struct Band {
    pub rows: Range<usize>,
}

impl Processor {
    /// How many bands of rows a planned image is made in (contract 0.4's parts), as its plan
    /// chose: a Qwen2-VL image's patches are laid out merge block row by merge block row, so a
    /// band of whole block rows is a run of the whole's patches, made from only the source rows
    /// under it. Fixed-size images (a few hundred pixels a side) are made whole.
    pub fn parts(&self, choices: &Choices) -> PluginResult<usize> {
        match (self, choices.bands) {
            (Processor::Qwen2Vl { patch, merge, .. }, Some(bands)) => {
                check_planned_size(choices, patch * merge)?;
                if bands == 0 || bands > choices.height / (patch * merge) {
                    return Err(PluginError::internal(format!(
                        "{bands} bands of a {}-row image",
                        choices.height
                    )));
                }
                Ok(bands)
            }
            _ => Ok(1),
        }
    }

    /// Band `index` of `parts` of a planned image: the merge block rows shared out so that each
    /// band costs about the same (see [`band_rows`]).
    pub fn band(&self, choices: &Choices, parts: usize, index: usize) -> PluginResult<Band> {
        let Processor::Qwen2Vl { patch, merge, .. } = self else {
            return Err(PluginError::internal("a fixed-size image is made whole"));
        };
        if index >= parts {
            return Err(PluginError::internal(format!(
                "part {index} of an image made in {parts}"
            )));
        }
        let unit = patch * merge;
        let blocks = band_rows(choices.height / unit, parts, index);
        let rows = blocks.start * unit..blocks.end * unit;
        Ok(Band { rows })
    }

    /// The tensors of `band`, made from `rows`: the rows of the source image, or of the image
    /// already resized, that the band's rows read. What [`Self::preprocess`] makes of the whole,
    /// those patches only, with the band's own grid: the bands' tensors in order join into the
    /// whole's.
    pub fn preprocess_band(
        &self,
        rows: ImageRows,
        choices: &Choices,
        band: &Band,
    ) -> PluginResult<Vec<Tensor>> {
        let Processor::Qwen2Vl {
            patch,
            merge,
            temporal,
            filter,
            normalize,
            ..
        } = self
        else {
            return Err(PluginError::internal("a fixed-size image is made whole"));
        };
        check_planned_size(choices, patch * merge)?;
        let samples = qwen2vl_resized_patch_bytes_reusing(
            rows.rows,
            (rows.first_row, rows.image_height),
            (choices.width, choices.height),
            *filter,
            (*patch, *merge),
            band.rows.clone(),
        );
        qwen2vl_tensors(
            samples,
            band.rows.len(),
            choices,
            *patch,
            *temporal,
            normalize,
        )
    }
}

/// A Qwen2-VL image's tensors from its patches' samples (`rows` output rows of the planned width):
/// raw samples plus the exact normalisation table (the host maps them back to HF's floats), a
/// quarter of the bytes of f32 through the sandbox and in memory. HF tiles a still image over the
/// temporal patch; its copies are not written but counted (`pixel_values_repeats`): half the bytes
/// again, the same values.
fn qwen2vl_tensors(
    samples: Vec<u8>,
    rows: usize,
    choices: &Choices,
    patch: usize,
    temporal: usize,
    normalize: &Normalize,
) -> PluginResult<Vec<Tensor>> {
    let (gh, gw) = (rows / patch, choices.width / patch);
    let row = 3 * patch * patch;
    let table: Vec<f32> = normalize.table().into_iter().flatten().collect();
    Ok(vec![
        Tensor::from_u8("pixel_values", &[gh * gw, row], samples)?,
        Tensor::from_f32("pixel_values_table", &[3, 256], &table)?,
        Tensor::from_i64("pixel_values_repeats", &[], &[temporal as i64])?,
        Tensor::from_i64("image_grid_thw", &[1, 3], &[1, gh as i64, gw as i64])?,
    ])
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

/// Python's `round`: halves go to the even neighbour.
fn round_half_even(x: f64) -> f64 {
    let r = x.round();
    if (x - x.trunc()).abs() == 0.5 {
        2.0 * (x / 2.0).round()
    } else {
        r
    }
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
    let mut h_bar = (round_half_even(hf / ff) * ff) as usize;
    let mut w_bar = (round_half_even(wf / ff) * ff) as usize;
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

#[cfg(test)]
mod tests {
    use super::*;

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
        let processor = Processor::from_config(
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
        let qwen = Processor::from_config(
            r#"{"image_processor_type": "Qwen2VLImageProcessor", "max_pixels": 1003520}"#,
        )
        .unwrap();
        let sent_resized = |processor: &Processor, width, height| {
            let plan = processor.plan(width, height, true, u32::MAX).unwrap();
            processor.sends_resized(width, height, &plan.choices().unwrap())
        };
        assert!(sent_resized(&qwen, 4032, 3024));
        assert!(sent_resized(&qwen, 1920, 1080));
        assert!(!sent_resized(&qwen, 1280, 720));
        assert!(!sent_resized(&qwen, 640, 480));
        let clip = Processor::from_config(
            r#"{"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 224},
                "crop_size": {"height": 224, "width": 224}}"#,
        )
        .unwrap();
        assert!(!sent_resized(&clip, 4032, 3024));
    }
}
