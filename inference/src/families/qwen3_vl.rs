//! Qwen3-VL: images and videos as patches of 16 over a grid (as Qwen2-VL's, merged 2×2), a tower
//! whose deepstack mergers add features to the LLM's first layers at the media tokens, and the
//! Qwen3 LLM (q/k norms, interleaved M-RoPE). Each token's encoder output row carries its deepstack
//! features after its embedding. A video sits in the prompt as one block per temporal patch, each
//! after its timestamp (`<1.5 seconds><|vision_start|>…<|vision_end|>`, as the model's processor
//! writes it), and each block is placed by M-RoPE as a one-frame grid.

use std::path::Path;
use std::sync::Arc;

use super::{
    Family, FamilyModel, ItemTensors, LoadedModel, Loader, MediaKind, NativeFamily, Placement,
    PlannedInput, PromptRun, RowBands, load_on_devices, vision,
};
use crate::backend::Backend;
use crate::devices::OpenDevice;
use crate::engine::{Encoder, PositionScheme};
use crate::error::{Error, Result};
use crate::models::Qwen2;
use crate::models::config::TextConfig;
use crate::models::qwen3_vl::{MODEL_TYPES, Qwen3VisionTower, Qwen3VlConfig};
use crate::rope::Grid;
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

/// The processor's text around each temporal patch of a video.
const VISION_START: &str = "<|vision_start|>";
const VISION_END: &str = "<|vision_end|>";

impl Qwen3VlModel {
    /// A video's blocks, one per temporal patch after its timestamp; none for an image.
    ///
    /// The timestamp of a temporal patch is the mean of its first and last frame's time
    /// (`frame_indices` over the source's frame rate, `video_fps_f64_bits`), written with one
    /// decimal, as transformers' `Qwen3VLProcessor` computes it in double precision.
    fn runs(&self, kind: MediaKind, grid: Grid, tensors: &ItemTensors) -> Result<Vec<PromptRun>> {
        if kind != MediaKind::Video {
            return Ok(Vec::new());
        }
        let per_patch = self.config.vision.temporal_patch_size;
        let indices = tensors.ints("frame_indices")?;
        if indices.len() != grid.t * per_patch || indices.iter().any(|&i| i < 0) {
            return Err(Error::Input(format!(
                "frame_indices holds {} frames, not the {} of {} temporal patches",
                indices.len(),
                grid.t * per_patch,
                grid.t
            )));
        }
        let fps = match tensors.ints("video_fps_f64_bits")?[..] {
            [bits] => f64::from_bits(bits as u64),
            _ => return Err(Error::Input("video_fps_f64_bits is not one value".into())),
        };
        if !(fps.is_finite() && fps > 0.0) {
            return Err(Error::Input(format!(
                "the video's frame rate {fps} is not positive"
            )));
        }
        let merge = self.config.vision.merge;
        let frame = Grid { t: 1, ..grid };
        Ok(indices
            .chunks_exact(per_patch)
            .map(|patch| {
                let first = patch[0] as f64 / fps;
                let last = patch[per_patch - 1] as f64 / fps;
                PromptRun {
                    before: format!("<{:.1} seconds>{VISION_START}", (first + last) / 2.0),
                    tokens: frame.tokens(merge),
                    grid: frame,
                    after: VISION_END.to_owned(),
                }
            })
            .collect())
    }
}

impl FamilyModel for Qwen3VlModel {
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

impl NativeFamily for Qwen3VlModel {
    fn text_config(&self) -> &TextConfig {
        &self.config.text
    }

    fn positions(&self) -> PositionScheme {
        PositionScheme::MRope {
            merge: self.config.vision.merge,
        }
    }

    fn deepstack_levels(&self) -> usize {
        self.config.vision.deepstack.len()
    }

    fn row_bands(&self, kind: MediaKind) -> Option<RowBands> {
        vision::row_bands(kind)
    }

    fn plan_input(&self, kind: MediaKind, tensors: &mut ItemTensors) -> Result<PlannedInput> {
        let vision = &self.config.vision;
        let (input, grid) = vision::plan_patches(kind, tensors, vision.patch_len(), vision.merge)?;
        Ok(PlannedInput {
            input,
            tokens: grid.tokens(vision.merge),
            time_interval: 1.0,
            runs: self.runs(kind, grid, tensors)?,
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
            time_interval: 1.0,
            runs: self.runs(kind, grid, tensors)?,
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
