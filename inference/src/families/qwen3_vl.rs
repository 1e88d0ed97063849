//! Qwen3-VL: images as patches of 16 over a grid (as Qwen2-VL's, merged 2×2), a tower whose
//! deepstack mergers add features to the LLM's first layers at the image tokens, and the Qwen3 LLM
//! (q/k norms, interleaved M-RoPE). Each token's encoder output row carries its deepstack features
//! after its embedding.

use std::path::Path;
use std::sync::Arc;

use super::{
    Family, FamilyModel, LoadedModel, Loader, MediaKind, Placement, PlannedInput, PluginTensors,
    load_on_devices, vision,
};
use crate::backend::Backend;
use crate::devices::OpenDevice;
use crate::engine::{Encoder, PositionScheme};
use crate::error::Result;
use crate::models::Qwen2;
use crate::models::config::TextConfig;
use crate::models::qwen3_vl::{MODEL_TYPES, Qwen3VisionTower, Qwen3VlConfig};
use crate::weights::Weights;

pub(super) struct Qwen3VlFamily;

impl Family for Qwen3VlFamily {
    fn model_types(&self) -> &'static [&'static str] {
        &MODEL_TYPES
    }

    fn read(&self, dir: &Path) -> Result<Arc<dyn FamilyModel>> {
        Ok(Arc::new(Qwen3VlModel {
            config: Qwen3VlConfig::read(dir)?,
        }))
    }
}

struct Qwen3VlModel {
    config: Qwen3VlConfig,
}

impl FamilyModel for Qwen3VlModel {
    fn text_config(&self) -> &TextConfig {
        &self.config.text
    }

    fn media_kinds(&self) -> &'static [MediaKind] {
        &[MediaKind::Image]
    }

    fn placeholder(&self, kind: MediaKind) -> Option<u32> {
        match kind {
            MediaKind::Image => Some(self.config.image_token_id),
            MediaKind::Video | MediaKind::Audio => None,
        }
    }

    fn positions(&self) -> PositionScheme {
        PositionScheme::MRope {
            merge: self.config.vision.merge,
        }
    }

    fn deepstack_levels(&self) -> usize {
        self.config.vision.deepstack.len()
    }

    fn plan_input(&self, kind: MediaKind, tensors: &dyn PluginTensors) -> Result<PlannedInput> {
        let vision = &self.config.vision;
        let (input, tokens) =
            vision::plan_patches(kind, tensors, vision.patch_len(), vision.merge)?;
        Ok(PlannedInput {
            input,
            tokens,
            time_interval: 1.0,
        })
    }

    fn place_embeddings(
        &self,
        kind: MediaKind,
        tensors: Option<&dyn PluginTensors>,
        tokens: usize,
    ) -> Result<Placement> {
        let (grid, _) = vision::place_by_grid(kind, tensors, tokens, self.config.vision.merge)?;
        Ok(Placement {
            grid: Some(grid),
            time_interval: 1.0,
        })
    }

    fn load(
        &self,
        dir: &Path,
        encoders: &[OpenDevice],
        llm: Option<&OpenDevice>,
    ) -> Result<LoadedModel> {
        load_on_devices(
            &Qwen3VlLoader {
                dir,
                config: &self.config,
            },
            encoders,
            llm,
        )
    }
}

struct Qwen3VlLoader<'a> {
    dir: &'a Path,
    config: &'a Qwen3VlConfig,
}

impl Loader for Qwen3VlLoader<'_> {
    fn load<E: Backend, L: Backend>(
        &self,
        encoder: &E,
        llm: &L,
    ) -> Result<(Arc<dyn Encoder>, Qwen2<L>)> {
        let mut weights = Weights::load(self.dir, str::to_owned)?;
        let tower =
            Qwen3VisionTower::from_weights(self.config.vision.clone(), &mut weights, encoder)?;
        let llm = Qwen2::load(
            self.config.text.clone(),
            &mut weights,
            "model.language_model.",
            llm,
        )?;
        weights.warn_unused();
        Ok((Arc::new(tower), llm))
    }

    fn load_encoder<E: Backend>(&self, device: &E) -> Result<Arc<dyn Encoder>> {
        let mut weights = Weights::load(self.dir, str::to_owned)?;
        Ok(Arc::new(Qwen3VisionTower::from_weights(
            self.config.vision.clone(),
            &mut weights,
            device,
        )?))
    }
}
