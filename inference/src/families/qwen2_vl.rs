//! Qwen2-VL and Qwen2.5-VL: images and videos as patches (`pixel_values`, `*_grid_thw`), merged
//! 2×2 into tokens placed by M-RoPE over each item's grid; Qwen2.5-VL videos step time by the
//! seconds between temporal patches.

use std::path::Path;
use std::sync::Arc;

use super::{
    Family, FamilyModel, LoadedModel, Loader, MediaKind, Placement, PlannedInput, PluginTensors,
    load_on_devices,
};
use crate::backend::Backend;
use crate::devices::OpenDevice;
use crate::engine::{EncodeInput, Encoder, PositionScheme};
use crate::error::{Error, Result};
use crate::models::config::TextConfig;
use crate::models::qwen2_vl::{MODEL_TYPES, Qwen2VlConfig};
use crate::models::{Qwen2, Qwen2Vl};
use crate::rope::Grid;

pub(super) struct Qwen2VlFamily;

impl Family for Qwen2VlFamily {
    fn model_types(&self) -> &'static [&'static str] {
        &MODEL_TYPES
    }

    fn read(&self, dir: &Path) -> Result<Arc<dyn FamilyModel>> {
        Ok(Arc::new(Qwen2VlModel {
            config: Qwen2VlConfig::read(dir)?,
        }))
    }
}

struct Qwen2VlModel {
    config: Qwen2VlConfig,
}

/// The tensors of an item of `kind`: its grid's and its patches' names.
fn names(kind: MediaKind) -> Result<(&'static str, &'static str)> {
    match kind {
        MediaKind::Image => Ok(("image_grid_thw", "pixel_values")),
        MediaKind::Video => Ok(("video_grid_thw", "pixel_values_videos")),
        MediaKind::Audio => Err(Error::Input("this model does not take audio input".into())),
    }
}

/// Tokens a grid makes (`t · h/merge · w/merge`), `None` past usize.
fn grid_tokens(grid: Grid, merge: usize) -> Option<usize> {
    grid.t
        .checked_mul(grid.h / merge)
        .and_then(|n| n.checked_mul(grid.w / merge))
}

/// A `*_grid_thw` tensor (`t, h, w` in patches) checked against the model's patch merge: it comes
/// from a plugin or a client.
fn merged_grid(tensors: &dyn PluginTensors, name: &str, merge: usize) -> Result<Grid> {
    let thw = tensors.ints(name)?;
    let [t, h, w] = thw[..] else {
        return Err(Error::Input(format!(
            "{name} has {} values, not 3",
            thw.len()
        )));
    };
    let dim = |v: i64| {
        usize::try_from(v).map_err(|_| Error::Input(format!("{name} has a negative dimension")))
    };
    let grid = Grid {
        t: dim(t)?,
        h: dim(h)?,
        w: dim(w)?,
    };
    if grid.t == 0 || !grid.h.is_multiple_of(merge) || !grid.w.is_multiple_of(merge) {
        return Err(Error::Input(format!(
            "{name} {}x{}x{} is not a grid of the model's {merge}x{merge} merged patches",
            grid.t, grid.h, grid.w
        )));
    }
    Ok(grid)
}

impl Qwen2VlModel {
    /// M-RoPE's temporal step for a video: Qwen2.5-VL's from the seconds between its temporal
    /// patches (`second_per_grid_ts`), one position per patch otherwise.
    fn time_interval(&self, kind: MediaKind, tensors: &dyn PluginTensors) -> Result<f32> {
        let vision = &self.config.vision;
        if kind != MediaKind::Video || vision.tokens_per_second.is_none() {
            return Ok(1.0);
        }
        let seconds = tensors.f32s("second_per_grid_ts")?;
        let [seconds] = seconds[..] else {
            return Err(Error::Input(format!(
                "second_per_grid_ts has {} values, not 1",
                seconds.len()
            )));
        };
        if !(seconds.is_finite() && seconds >= 0.0) {
            return Err(Error::Input(format!(
                "second_per_grid_ts {seconds} is not a duration"
            )));
        }
        Ok(vision.time_interval(seconds))
    }
}

impl FamilyModel for Qwen2VlModel {
    fn text_config(&self) -> &TextConfig {
        &self.config.text
    }

    fn media_kinds(&self) -> &'static [MediaKind] {
        &[MediaKind::Image, MediaKind::Video]
    }

    fn placeholder(&self, kind: MediaKind) -> Option<u32> {
        match kind {
            MediaKind::Image => Some(self.config.image_token_id),
            MediaKind::Video => Some(self.config.video_token_id),
            MediaKind::Audio => None,
        }
    }

    fn positions(&self) -> PositionScheme {
        PositionScheme::MRope {
            merge: self.config.vision.merge,
        }
    }

    fn plan_input(&self, kind: MediaKind, tensors: &dyn PluginTensors) -> Result<PlannedInput> {
        let vision = &self.config.vision;
        let (grid_name, pixels_name) = names(kind)?;
        let patch_len = vision.patch_len();
        let grid = merged_grid(tensors, grid_name, vision.merge)?;
        // 8-bit samples stay bytes until the encoder packs its batch.
        let pixel_values = tensors.pixel_values(pixels_name)?;
        let patches = grid
            .t
            .checked_mul(grid.h)
            .and_then(|p| p.checked_mul(grid.w));
        if patches.and_then(|p| p.checked_mul(patch_len)) != Some(pixel_values.len()) {
            return Err(Error::Input(format!(
                "{pixels_name} holds {} values, not the {}x{}x{} grid's patches of {patch_len}",
                pixel_values.len(),
                grid.t,
                grid.h,
                grid.w
            )));
        }
        Ok(PlannedInput {
            time_interval: self.time_interval(kind, tensors)?,
            tokens: grid.tokens(vision.merge),
            input: EncodeInput::Vision { pixel_values, grid },
        })
    }

    fn place_embeddings(
        &self,
        kind: MediaKind,
        tensors: Option<&dyn PluginTensors>,
        tokens: usize,
    ) -> Result<Placement> {
        let (grid_name, _) = names(kind)?;
        let tensors = tensors.ok_or_else(|| {
            Error::Input(format!(
                "{grid_name} is missing: this model places {} tokens by their grid",
                kind.name()
            ))
        })?;
        let merge = self.config.vision.merge;
        let grid = merged_grid(tensors, grid_name, merge)?;
        let planned = grid_tokens(grid, merge);
        if planned != Some(tokens) {
            return Err(Error::Input(format!(
                "{grid_name} {}x{}x{} makes {} tokens, not the item's {tokens}",
                grid.t,
                grid.h,
                grid.w,
                planned.map_or_else(|| "too many".into(), |n| n.to_string())
            )));
        }
        Ok(Placement {
            grid: Some(grid),
            time_interval: self.time_interval(kind, tensors)?,
        })
    }

    fn load(
        &self,
        dir: &Path,
        encoders: &[OpenDevice],
        llm: Option<&OpenDevice>,
    ) -> Result<LoadedModel> {
        load_on_devices(&VlLoader(dir), encoders, llm)
    }
}

struct VlLoader<'a>(&'a Path);

impl Loader for VlLoader<'_> {
    fn load<E: Backend, L: Backend>(
        &self,
        encoder: &E,
        llm: &L,
    ) -> Result<(Arc<dyn Encoder>, Qwen2<L>)> {
        let model = Qwen2Vl::<E, L>::load(self.0, encoder, llm)?;
        Ok((Arc::new(model.vision), model.llm))
    }

    fn load_encoder<E: Backend>(&self, device: &E) -> Result<Arc<dyn Encoder>> {
        Ok(Arc::new(Qwen2Vl::<E, E>::load_vision(self.0, device)?))
    }
}
