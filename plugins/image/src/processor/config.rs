//! What image processors' configs share: a size in either of its forms, HF's base settings (the
//! resampling filter, rescaling, normalisation, the patch size), and that a size is positive. Each
//! family reads its own settings beside these (`#[serde(flatten)] base: BaseConfig`).

use mmgate_plugin_sdk::imageops::{Filter, Normalize};
use mmgate_plugin_sdk::*;
use serde::Deserialize;
use serde::de::DeserializeOwned;

/// A family's config, read from the JSON the table parsed once.
pub fn read<T: DeserializeOwned>(config: &serde_json::Value) -> PluginResult<T> {
    T::deserialize(config).map_err(|e| PluginError::unsupported(format!("processor config: {e}")))
}

/// `size` / `crop_size` in either of the forms checkpoints use: a bare number (old feature
/// extractors: the shortest edge for `size`, a square for `crop_size`) or a dict.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum SizeField {
    Edge(usize),
    Dict(SizeConfig),
}

#[derive(Debug, Default, Deserialize)]
pub struct SizeConfig {
    pub shortest_edge: Option<usize>,
    pub longest_edge: Option<usize>,
    pub height: Option<usize>,
    pub width: Option<usize>,
}

impl SizeField {
    /// The dict form's fields (`None` for a bare number).
    pub fn dict(&self) -> Option<&SizeConfig> {
        match self {
            SizeField::Dict(size) => Some(size),
            SizeField::Edge(_) => None,
        }
    }

    /// The side of a square `{height, width}`.
    pub fn square(&self) -> Option<usize> {
        match self.dict()? {
            SizeConfig {
                height: Some(h),
                width: Some(w),
                ..
            } if h == w => Some(*h),
            _ => None,
        }
    }
}

/// The side of a square tile `size` sets (`{height, width}`, equal), `default` when absent;
/// `family` names whose tiles the error is about.
pub fn square_tile(size: &Option<SizeField>, default: usize, family: &str) -> PluginResult<usize> {
    let Some(size) = size else {
        return Ok(default);
    };
    let side = size.square().ok_or_else(|| {
        PluginError::unsupported(format!(
            "processor config: {family}'s tiles need a square size {{height, width}}"
        ))
    })?;
    positive("size.height", side)
}

/// The settings of HF's base image processor that most families read.
#[derive(Debug, Default, Deserialize)]
pub struct BaseConfig {
    patch_size: Option<SizeField>,
    resample: Option<u32>,
    do_rescale: Option<bool>,
    rescale_factor: Option<f64>,
    do_normalize: Option<bool>,
    image_mean: Option<[f32; 3]>,
    image_std: Option<[f32; 3]>,
}

impl BaseConfig {
    /// `patch_size` as a number, or as a square `{height, width}` (Pixtral's); `default` when
    /// absent.
    pub fn patch_edge(&self, default: usize) -> PluginResult<usize> {
        let edge = match &self.patch_size {
            None => default,
            Some(SizeField::Edge(edge)) => *edge,
            Some(size) => size.square().ok_or_else(|| {
                PluginError::unsupported(
                    "processor config: patch_size must be a number or a square {height, width}",
                )
            })?,
        };
        positive("patch_size", edge)
    }

    /// The PIL filter `resample` names (2 bilinear, 3 bicubic); `default` when absent.
    pub fn filter(&self, default: Filter) -> PluginResult<Filter> {
        match self.resample {
            None => Ok(default),
            Some(code) => Filter::from_pil_code(code).ok_or_else(|| {
                PluginError::unsupported(format!(
                    "processor config: resample {code} is not supported (2 = bilinear and \
                     3 = bicubic are)"
                ))
            }),
        }
    }

    /// The rescale and normalisation the config sets, with the family's own `mean` and `std`
    /// where it names none.
    pub fn normalize(&self, mean: [f32; 3], std: [f32; 3]) -> Normalize {
        let normalizes = self.do_normalize.unwrap_or(true);
        Normalize {
            rescale: if self.do_rescale.unwrap_or(true) {
                self.rescale_factor.unwrap_or(1.0 / 255.0)
            } else {
                1.0
            },
            mean: if normalizes {
                self.image_mean.unwrap_or(mean)
            } else {
                [0.0; 3]
            },
            std: if normalizes {
                self.image_std.unwrap_or(std)
            } else {
                [1.0; 3]
            },
        }
    }
}

/// `value`, refused where a processor would divide by it or make nothing of it.
pub fn positive(name: &str, value: usize) -> PluginResult<usize> {
    if value == 0 {
        return Err(PluginError::unsupported(format!(
            "processor config: {name} must be positive"
        )));
    }
    Ok(value)
}
