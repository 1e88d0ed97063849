//! Qwen2-Audio: log-mel features in 30 s chunks (`input_features`, `feature_attention_mask`)
//! through the Whisper encoder and a projector; plain positions.

use std::path::Path;
use std::sync::Arc;

use super::{
    Family, FamilyModel, ItemTensors, LoadedModel, Loader, MediaKind, NativeFamily, Placement,
    PlannedInput, load_on_devices,
};
use crate::backend::Backend;
use crate::devices::OpenDevice;
use crate::engine::{EncodeInput, Encoder, PositionScheme};
use crate::error::{Error, Result};
use crate::models::config::TextConfig;
use crate::models::qwen2_audio::Qwen2AudioConfig;
use crate::models::{Qwen2, Qwen2Audio};

pub(super) struct Qwen2AudioFamily;

impl Family for Qwen2AudioFamily {
    fn model_types(&self) -> &'static [&'static str] {
        &["qwen2_audio"]
    }

    fn read(&self, dir: &Path) -> Result<Arc<dyn FamilyModel>> {
        Ok(Arc::new(Qwen2AudioModel {
            config: Qwen2AudioConfig::read(dir)?,
        }))
    }
}

struct Qwen2AudioModel {
    config: Qwen2AudioConfig,
}

impl FamilyModel for Qwen2AudioModel {
    fn context_length(&self) -> usize {
        self.config.text.max_position_embeddings
    }

    fn media_kinds(&self) -> &'static [MediaKind] {
        &[MediaKind::Audio]
    }

    fn placeholder(&self, kind: MediaKind) -> Option<u32> {
        (kind == MediaKind::Audio).then_some(self.config.audio_token_id)
    }

    fn native(&self) -> Option<&dyn NativeFamily> {
        Some(self)
    }
}

impl NativeFamily for Qwen2AudioModel {
    fn text_config(&self) -> &TextConfig {
        &self.config.text
    }

    fn positions(&self) -> PositionScheme {
        PositionScheme::Plain
    }

    fn plan_input(&self, kind: MediaKind, tensors: &mut ItemTensors) -> Result<PlannedInput> {
        if kind != MediaKind::Audio {
            return Err(Error::Input(format!(
                "this model does not take {} input",
                kind.name()
            )));
        }
        let encoder = &self.config.audio;
        let mask = "feature_attention_mask";
        let frames = tensors.shape(mask)?.last().copied().unwrap_or(0) as usize;
        if frames != encoder.frames() {
            return Err(Error::Input(format!(
                "{mask} has chunks of {frames} frames; the model takes {}",
                encoder.frames()
            )));
        }
        let valid: Vec<usize> = tensors
            .ints(mask)?
            .chunks(frames.max(1))
            .map(|c| c.iter().filter(|&&v| v != 0).count())
            .collect();
        let tokens = valid.iter().map(|&v| encoder.output_len(v)).sum();
        Ok(PlannedInput {
            input: EncodeInput::Audio {
                features: tensors.take_f32s("input_features")?,
                valid_frames: valid,
            },
            tokens,
            time_interval: 1.0,
            runs: Vec::new(),
        })
    }

    fn place_embeddings(
        &self,
        _kind: MediaKind,
        _tensors: Option<&ItemTensors>,
        _tokens: usize,
    ) -> Result<Placement> {
        Ok(Placement {
            grid: None,
            time_interval: 1.0,
            runs: Vec::new(),
        })
    }

    fn load(
        &self,
        dir: &Path,
        encoders: &[OpenDevice],
        llm: Option<&OpenDevice>,
    ) -> Result<LoadedModel> {
        load_on_devices(&AudioLoader(dir), encoders, llm)
    }
}

struct AudioLoader<'a>(&'a Path);

impl Loader for AudioLoader<'_> {
    fn load<E: Backend, L: Backend>(
        &self,
        encoder: &E,
        llm: &L,
    ) -> Result<(Arc<dyn Encoder>, Qwen2<L>)> {
        let model = Qwen2Audio::<E, L>::load(self.0, encoder, llm)?;
        Ok((Arc::new(model.audio), model.llm))
    }

    fn load_encoder<E: Backend>(&self, device: &E) -> Result<Arc<dyn Encoder>> {
        Ok(Arc::new(Qwen2Audio::<E, E>::load_audio(self.0, device)?))
    }
}
