//! Qwen3-VL: images and videos as patches of 16 over a grid (as Qwen2-VL's, merged 2×2), a tower
//! whose deepstack mergers add features to the LLM's first layers at the media tokens, and the
//! Qwen3 LLM (q/k norms, interleaved M-RoPE). Each token's encoder output row carries its deepstack
//! features after its embedding. A video sits in the prompt as one block per temporal patch, each
//! after its timestamp (`<1.5 seconds><|vision_start|>…<|vision_end|>`, as the model's processor
//! writes it), and each block is placed by M-RoPE as a one-frame grid.
//!
//! Qwen3.5 (`qwen3_5`, `qwen3_5_moe`) has Qwen3-VL's tower, processor and prompts before a hybrid
//! LLM of linear and full attention layers that mmgate does not run: it is served in front of an
//! engine, its items planned here as Qwen3-VL's.

use std::path::Path;
use std::sync::Arc;

use serde::Deserialize as _;

use super::{
    Family, FamilyModel, ItemTensors, LoadedModel, Loader, MediaKind, NativeFamily, Placement,
    PlannedInput, PlannedItem, PromptPiece, PromptRun, RowBands, load_on_devices, vision,
};
use crate::backend::Backend;
use crate::devices::OpenDevice;
use crate::engine::{Encoder, PositionScheme};
use crate::error::{Error, Result};
use crate::models::Qwen2;
use crate::models::config::{ConfigFile, TextConfig};
use crate::models::qwen3_vl::{MODEL_TYPES, Qwen3VisionTower, Qwen3VlConfig};
use crate::rope::Grid;
use crate::weights::Weights;

pub(super) struct Qwen3VlFamily;

impl Family for Qwen3VlFamily {
    /// Qwen3-VL's (run here, [`MODEL_TYPES`]) and Qwen3.5's (planned for an engine).
    fn model_types(&self) -> &'static [&'static str] {
        &["qwen3_vl", "qwen3_5", "qwen3_5_moe"]
    }

    fn read(&self, dir: &Path) -> Result<Arc<dyn FamilyModel>> {
        let config = Qwen3VlConfig::read_of_types(dir, self.model_types())?;
        let native = ConfigFile::read(dir)?
            .model_type()
            .is_some_and(|t| MODEL_TYPES.contains(&t));
        Ok(Arc::new(Qwen3VlModel { config, native }))
    }
}

struct Qwen3VlModel {
    config: Qwen3VlConfig,
    /// Whether mmgate runs this checkpoint's LLM (Qwen3-VL's), else it plans for an engine.
    native: bool,
}

/// The processor's text around each temporal patch of a video.
const VISION_START: &str = "<|vision_start|>";
const VISION_END: &str = "<|vision_end|>";

impl Qwen3VlModel {
    /// A video's blocks, one per temporal patch after its timestamp; none for an image.
    fn runs(&self, kind: MediaKind, grid: Grid, tensors: &ItemTensors) -> Result<Vec<PromptRun>> {
        if kind != MediaKind::Video {
            return Ok(Vec::new());
        }
        let indices = tensors.ints("frame_indices")?;
        if indices.iter().any(|&i| i < 0) {
            return Err(Error::Input("frame_indices holds a negative index".into()));
        }
        let indices: Vec<u64> = indices.iter().map(|&i| i as u64).collect();
        let fps = match tensors.ints("video_fps_f64_bits")?[..] {
            [bits] => f64::from_bits(bits as u64),
            _ => return Err(Error::Input("video_fps_f64_bits is not one value".into())),
        };
        let seconds = self.patch_seconds(&indices, fps, grid.t)?;
        let frame = Grid { t: 1, ..grid };
        Ok(seconds
            .into_iter()
            .map(|at| PromptRun {
                before: timestamp(at),
                tokens: frame.tokens(self.config.vision.merge),
                grid: frame,
                after: VISION_END.to_owned(),
                at: Some(at),
            })
            .collect())
    }

    /// The time of each of a video's `patches` temporal patches: the mean of its first and last
    /// frame's time (`indices` over the source's frame rate `fps`), as transformers'
    /// `Qwen3VLProcessor` and vLLM compute it in double precision.
    fn patch_seconds(&self, indices: &[u64], fps: f64, patches: usize) -> Result<Vec<f64>> {
        let per_patch = self.config.vision.temporal_patch_size;
        if patches == 0 || indices.len() != patches * per_patch {
            return Err(Error::Input(format!(
                "frame_indices holds {} frames, not the {} of {patches} temporal patches",
                indices.len(),
                patches * per_patch,
            )));
        }
        if !(fps.is_finite() && fps > 0.0) {
            return Err(Error::Input(format!(
                "the video's frame rate {fps} is not positive"
            )));
        }
        Ok(indices
            .chunks_exact(per_patch)
            .map(|patch| (patch[0] as f64 / fps + patch[per_patch - 1] as f64 / fps) / 2.0)
            .collect())
    }
}

/// What the processor writes before a temporal patch's tokens: its time, with one decimal.
fn timestamp(seconds: f64) -> String {
    format!("<{seconds:.1} seconds>{VISION_START}")
}

/// What a plan of the built-in video plugin says of the frames it chose.
#[derive(serde::Deserialize)]
struct VideoChoices {
    frame_indices: Vec<u64>,
    /// The frame rate the indices count in, as its f64 bits.
    source_fps_bits: u64,
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

    /// A video as its blocks, each temporal patch's tokens after its timestamp, from the frames
    /// and frame rate its plan names (an engine given the frames numbers them as it is told).
    fn item_prompt(&self, item: &PlannedItem) -> Result<Option<Vec<PromptPiece>>> {
        if item.kind != MediaKind::Video {
            return Ok(None);
        }
        let choices = VideoChoices::deserialize(&item.choices).map_err(|e| {
            Error::Input(format!(
                "a Qwen3-VL video's plan must name its frame_indices and source_fps_bits: {e}"
            ))
        })?;
        let patches = choices.frame_indices.len() / self.config.vision.temporal_patch_size;
        let seconds = self.patch_seconds(
            &choices.frame_indices,
            f64::from_bits(choices.source_fps_bits),
            patches,
        )?;
        if !item.tokens.is_multiple_of(patches) {
            return Err(Error::Input(format!(
                "a video of {} tokens is not {patches} equal temporal patches",
                item.tokens
            )));
        }
        let mut pieces = Vec::with_capacity(3 * patches);
        for at in seconds {
            pieces.push(PromptPiece::Text(timestamp(at)));
            pieces.push(PromptPiece::Tokens {
                id: self.config.video_token_id,
                count: item.tokens / patches,
            });
            pieces.push(PromptPiece::Text(VISION_END.to_owned()));
        }
        Ok(Some(pieces))
    }

    fn native(&self) -> Option<&dyn NativeFamily> {
        self.native.then_some(self as &dyn NativeFamily)
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::MediaKind;

    /// A Qwen3.5 checkpoint (the Hub's key set, a tiny size) is planned as Qwen3-VL's: its
    /// placeholders and context from its config, no native LLM.
    #[test]
    fn qwen3_5_is_planned_as_qwen3_vl_for_an_engine() {
        let dir = tempfile::tempdir().unwrap();
        let config = r#"{"architectures": ["Qwen3_5ForConditionalGeneration"],
            "model_type": "qwen3_5", "image_token_id": 248056, "video_token_id": 248057,
            "vision_start_token_id": 248053, "vision_end_token_id": 248054,
            "text_config": {"model_type": "qwen3_5_text", "hidden_size": 64, "head_dim": 256,
                "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                "num_key_value_heads": 1, "vocab_size": 248320, "max_position_embeddings": 262144,
                "layer_types": ["linear_attention", "full_attention"], "rms_norm_eps": 1e-06,
                "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                "rope_parameters": {"mrope_interleaved": true, "mrope_section": [11, 11, 10],
                    "partial_rotary_factor": 0.25, "rope_theta": 10000000.0,
                    "rope_type": "default"}},
            "vision_config": {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 64,
                "num_heads": 2, "intermediate_size": 128, "out_hidden_size": 64,
                "num_position_embeddings": 256, "patch_size": 16, "spatial_merge_size": 2,
                "temporal_patch_size": 2, "hidden_act": "gelu_pytorch_tanh"}}"#;
        std::fs::write(dir.path().join("config.json"), config).unwrap();
        let model = crate::families::read(dir.path()).unwrap();
        assert_eq!(model.media_kinds(), [MediaKind::Image, MediaKind::Video]);
        assert_eq!(model.placeholder(MediaKind::Image), Some(248_056));
        assert_eq!(model.placeholder(MediaKind::Video), Some(248_057));
        assert_eq!(model.context_length(), 262_144);
        assert!(model.native().is_none());
    }
}
