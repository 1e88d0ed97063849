//! Qwen2-VL and Qwen2.5-VL: images and videos as patches (`pixel_values`, `*_grid_thw`), merged
//! 2×2 into tokens placed by M-RoPE over each item's grid; Qwen2.5-VL videos step time by the
//! seconds between temporal patches.

use std::path::Path;
use std::sync::Arc;

use super::{
    Family, FamilyModel, ItemTensors, LoadedModel, Loader, MediaKind, NativeFamily, Placement,
    PlannedInput, RowBands, load_on_devices, vision,
};
use crate::backend::Backend;
use crate::devices::OpenDevice;
use crate::engine::{Encoder, PositionScheme};
use crate::error::{Error, Result};
use crate::models::config::TextConfig;
use crate::models::qwen2_vl::{MODEL_TYPES, Qwen2VlConfig};
use crate::models::{Qwen2, Qwen2Vl};

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

impl Qwen2VlModel {
    /// M-RoPE's temporal step for a video: Qwen2.5-VL's from the seconds between its temporal
    /// patches (`second_per_grid_ts`), one position per patch otherwise.
    fn time_interval(&self, kind: MediaKind, tensors: &ItemTensors) -> Result<f32> {
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
    fn context_length(&self) -> usize {
        self.config.text.max_position_embeddings
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

    fn native(&self) -> Option<&dyn NativeFamily> {
        Some(self)
    }
}

impl NativeFamily for Qwen2VlModel {
    fn text_config(&self) -> &TextConfig {
        &self.config.text
    }

    fn positions(&self) -> PositionScheme {
        PositionScheme::MRope {
            merge: self.config.vision.merge,
        }
    }

    fn row_bands(&self, kind: MediaKind) -> Option<RowBands> {
        vision::row_bands(kind)
    }

    fn plan_input(&self, kind: MediaKind, tensors: &mut ItemTensors) -> Result<PlannedInput> {
        let vision = &self.config.vision;
        let (input, grid) = vision::plan_patches(kind, tensors, vision.patch_len(), vision.merge)?;
        Ok(PlannedInput {
            time_interval: self.time_interval(kind, tensors)?,
            tokens: grid.tokens(vision.merge),
            input,
            runs: Vec::new(),
        })
    }

    fn place_embeddings(
        &self,
        kind: MediaKind,
        tensors: Option<&ItemTensors>,
        tokens: usize,
    ) -> Result<Placement> {
        let (grid, tensors) =
            vision::place_by_grid(kind, tensors, tokens, self.config.vision.merge)?;
        Ok(Placement {
            grid: Some(grid),
            time_interval: self.time_interval(kind, tensors)?,
            runs: Vec::new(),
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
