//! Qwen2-Audio: a Whisper encoder (two convolutions, sinusoid-free learned positions, pre-LN
//! blocks), average pooling by two, and a linear projector into the LLM; the LLM half is [`Qwen2`].
//!
//! Input is the audio plugin's `input_features` (`[chunks, mel, 3000]`, 30 s per chunk) and its
//! `feature_attention_mask`; each chunk yields `((frames − 1) / 2 + 1 − 2) / 2 + 1` embeddings for
//! its valid frames (750 for a full chunk), in order: the rows its placeholder tokens stand for.

use std::path::Path;

use crate::backend::{Activation, AttentionMask, AttentionShape, Backend, Conv1dShape, Segment};
use crate::engine::encoder::{Encoder, packed_or_each, wrong_kind};
use crate::engine::{EncodeInput, EncoderKind};
use crate::error::{Error, Result};
use crate::models::config::{ConfigFile, TextConfig};
use crate::models::qwen2::Qwen2;
use crate::tensor::Tensor;
use crate::weights::{Linear, Scope, Weights};

/// nn.LayerNorm's default epsilon, which the Whisper encoder uses.
const LAYER_NORM_EPS: f32 = 1e-5;

#[derive(Debug, Clone, PartialEq)]
pub struct AudioEncoderConfig {
    pub mel_bins: usize,
    pub d_model: usize,
    pub layers: usize,
    pub heads: usize,
    pub ffn_dim: usize,
    pub activation: Activation,
    /// Encoder positions per chunk (1500); a chunk has twice as many mel frames.
    pub max_source_positions: usize,
}

impl AudioEncoderConfig {
    /// Mel frames per chunk.
    pub fn frames(&self) -> usize {
        2 * self.max_source_positions
    }

    /// Embeddings a chunk with `valid` mel frames yields (transformers'
    /// `_get_feat_extract_output_lengths`): after the stride-2 convolution, then the pooling.
    pub fn output_len(&self, valid: usize) -> usize {
        let after_conv = valid.saturating_sub(1) / 2 + 1;
        after_conv.saturating_sub(2) / 2 + 1
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Qwen2AudioConfig {
    pub text: TextConfig,
    pub audio: AudioEncoderConfig,
    pub audio_token_id: u32,
}

impl Qwen2AudioConfig {
    pub fn read(dir: &Path) -> Result<Self> {
        let file = ConfigFile::read_of_type(dir, "qwen2_audio")?;
        let root = file.root();
        let err = |reason: String| file.error(reason);
        let text = root
            .sub("text_config", "text_config")
            .ok_or_else(|| err("missing text_config".into()))?;
        let text = TextConfig::parse(&text, &root)?;
        let a = root
            .sub("audio_config", "audio_config")
            .ok_or_else(|| err("missing audio_config".into()))?;
        let audio = AudioEncoderConfig {
            mel_bins: a.usize_or(&["num_mel_bins"], Some(128))?,
            d_model: a.usize_or(&["d_model"], Some(1280))?,
            layers: a.usize_or(&["encoder_layers"], Some(32))?,
            heads: a.usize_or(&["encoder_attention_heads"], Some(20))?,
            ffn_dim: a.usize_or(&["encoder_ffn_dim"], Some(5120))?,
            activation: a.activation("activation_function", "gelu")?,
            max_source_positions: a.usize_or(&["max_source_positions"], Some(1500))?,
        };
        if audio.heads == 0 || !audio.d_model.is_multiple_of(audio.heads) {
            return Err(err(format!(
                "audio d_model {} over {} heads",
                audio.d_model, audio.heads
            )));
        }
        if a.bool_or("scale_embedding", false)? {
            return Err(err("audio_config.scale_embedding is not supported".into()));
        }
        let audio_token_id = root
            .token_ids("audio_token_index")?
            .into_iter()
            .chain(root.token_ids("audio_token_id")?)
            .next()
            .unwrap_or(151646);
        Ok(Self {
            text,
            audio,
            audio_token_id,
        })
    }
}

/// Maps the Hub's names (`language_model.model.*`, `language_model.lm_head.*`, `audio_tower.*`,
/// `multi_modal_projector.*`) to the ones transformers 5 saves (`model.language_model.*`,
/// `lm_head.*`, `model.audio_tower.*`, `model.multi_modal_projector.*`).
pub fn canonical_name(name: &str) -> String {
    for (old, new) in [
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("audio_tower.", "model.audio_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    ] {
        if let Some(rest) = name.strip_prefix(old) {
            return format!("{new}{rest}");
        }
    }
    name.to_owned()
}

struct EncoderLayer<B: Backend> {
    attn_norm: (Tensor<B>, Tensor<B>),
    q: Linear<B>,
    k: Linear<B>,
    v: Linear<B>,
    out: Linear<B>,
    ffn_norm: (Tensor<B>, Tensor<B>),
    fc1: Linear<B>,
    fc2: Linear<B>,
}

pub struct AudioEncoder<B: Backend> {
    config: AudioEncoderConfig,
    conv1: Linear<B>,
    conv2: Linear<B>,
    positions: Tensor<B>,
    layers: Vec<EncoderLayer<B>>,
    final_norm: (Tensor<B>, Tensor<B>),
    projector: Linear<B>,
    device: B,
}

fn apply<B: Backend>(x: &Tensor<B>, l: &Linear<B>) -> Result<Tensor<B>> {
    x.linear(&l.0, l.1.as_ref())
}

impl<B: Backend> AudioEncoder<B> {
    /// Loads the encoder (`{prefix}audio_tower.*`) and the projector into `text_hidden`
    /// (`{prefix}multi_modal_projector.linear.*`).
    pub fn load(
        config: AudioEncoderConfig,
        text_hidden: usize,
        weights: &mut Weights,
        prefix: &str,
        device: &B,
    ) -> Result<Self> {
        let c = &config;
        let d = c.d_model;
        let mut s = Scope::new(weights, device, format!("{prefix}audio_tower."));
        // Convolution weights [out, in, kernel] are linear maps of im2col rows ordered (in, kernel).
        let conv = |s: &mut Scope<'_, B>, name: &str, inp: usize| -> Result<Linear<B>> {
            let w = s
                .weights
                .take_host(&format!("{}{name}.weight", s.prefix), &[d, inp, 3])?;
            Ok((
                Tensor::from_host(device, &w.data, &[d, inp * 3])?,
                Some(s.tensor(&format!("{name}.bias"), &[d])?),
            ))
        };
        let conv1 = conv(&mut s, "conv1", c.mel_bins)?;
        let conv2 = conv(&mut s, "conv2", d)?;
        let positions = s.tensor("embed_positions.weight", &[c.max_source_positions, d])?;
        let mut layers = Vec::with_capacity(c.layers);
        for i in 0..c.layers {
            let l = format!("layers.{i}.");
            layers.push(EncoderLayer {
                attn_norm: s.layer_norm(&format!("{l}self_attn_layer_norm"), d)?,
                q: s.linear(&format!("{l}self_attn.q_proj"), d, d, true)?,
                k: s.linear(&format!("{l}self_attn.k_proj"), d, d, false)?,
                v: s.linear(&format!("{l}self_attn.v_proj"), d, d, true)?,
                out: s.linear(&format!("{l}self_attn.out_proj"), d, d, true)?,
                ffn_norm: s.layer_norm(&format!("{l}final_layer_norm"), d)?,
                fc1: s.linear(&format!("{l}fc1"), c.ffn_dim, d, true)?,
                fc2: s.linear(&format!("{l}fc2"), d, c.ffn_dim, true)?,
            });
        }
        let final_norm = s.layer_norm("layer_norm", d)?;
        let mut p = Scope::new(weights, device, format!("{prefix}multi_modal_projector."));
        let projector = p.linear("linear", text_hidden, d, true)?;
        Ok(Self {
            config,
            conv1,
            conv2,
            positions,
            layers,
            final_norm,
            projector,
            device: device.clone(),
        })
    }

    pub fn config(&self) -> &AudioEncoderConfig {
        &self.config
    }

    pub fn device(&self) -> &B {
        &self.device
    }

    /// Encodes `[chunks, mel, frames]` log-mel features (host, the plugin's layout) of which the
    /// first `valid_frames[i]` frames of chunk `i` are audio, into `[Σ output_len, text_hidden]`.
    pub fn encode(&self, features: &[f32], valid_frames: &[usize]) -> Result<Tensor<B>> {
        let c = &self.config;
        let (chunks, mel, frames) = (valid_frames.len(), c.mel_bins, c.frames());
        if features.len() != chunks * mel * frames || chunks == 0 {
            return Err(Error::Input(format!(
                "{} feature values for {chunks} chunks of {mel} mel bins x {frames} frames",
                features.len()
            )));
        }
        if let Some(bad) = valid_frames.iter().find(|&&v| v == 0 || v > frames) {
            return Err(Error::Input(format!(
                "a chunk with {bad} valid frames (1..={frames})"
            )));
        }
        // The convolutions run over time-major rows; the plugin's layout is mel-major per chunk.
        let mut time_major = vec![0.0f32; features.len()];
        for (src, dst) in features
            .chunks(mel * frames)
            .zip(time_major.chunks_mut(mel * frames))
        {
            for (m, row) in src.chunks(frames).enumerate() {
                for (t, v) in row.iter().enumerate() {
                    dst[t * mel + m] = *v;
                }
            }
        }
        let x = Tensor::from_host(&self.device, &time_major, &[chunks * frames, mel])?;
        let conv = |x: &Tensor<B>,
                    l: &Linear<B>,
                    len: usize,
                    channels: usize,
                    stride: usize|
         -> Result<Tensor<B>> {
            let shape = Conv1dShape {
                segments: chunks,
                len,
                channels,
                kernel: 3,
                stride,
                padding: 1,
            };
            x.im2col_1d(&shape)?
                .linear(&l.0, l.1.as_ref())?
                .activate(Activation::Gelu)
        };
        let x = conv(&x, &self.conv1, frames, mel, 1)?;
        let mut x = conv(&x, &self.conv2, frames, c.d_model, 2)?;
        let positions_per_chunk = c.max_source_positions;
        let ids: Vec<u32> = (0..chunks)
            .flat_map(|_| 0..positions_per_chunk as u32)
            .collect();
        x.add_assign(&self.positions.gather_rows(&ids)?)?;

        // Padding frames are computed but never attended to (transformers' key mask).
        let mask = AttentionMask::Segments(
            valid_frames
                .iter()
                .enumerate()
                .map(|(i, &v)| Segment {
                    rows: i * positions_per_chunk..(i + 1) * positions_per_chunk,
                    visible_keys: (v - 1) / 2 + 1,
                })
                .collect(),
        );
        let head_dim = c.d_model / c.heads;
        let shape = AttentionShape {
            q_rows: chunks * positions_per_chunk,
            kv_rows: chunks * positions_per_chunk,
            heads: c.heads,
            kv_heads: c.heads,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
            mask,
        };
        for l in &self.layers {
            let h = x.layer_norm(&l.attn_norm.0, &l.attn_norm.1, LAYER_NORM_EPS)?;
            let (q, k, v) = (apply(&h, &l.q)?, apply(&h, &l.k)?, apply(&h, &l.v)?);
            x.add_assign(&apply(&q.attention(&k, &v, &shape)?, &l.out)?)?;
            let h = x.layer_norm(&l.ffn_norm.0, &l.ffn_norm.1, LAYER_NORM_EPS)?;
            let h = apply(&h, &l.fc1)?.activate(c.activation)?;
            x.add_assign(&apply(&h, &l.fc2)?)?;
        }
        let x = x.mean_pool_rows(2)?;
        let x = x.layer_norm(&self.final_norm.0, &self.final_norm.1, LAYER_NORM_EPS)?;
        let x = apply(&x, &self.projector)?;
        // Keep each chunk's embeddings of real audio, in order.
        let pooled = positions_per_chunk / 2;
        let keep: Vec<u32> = valid_frames
            .iter()
            .enumerate()
            .flat_map(|(i, &v)| {
                (0..c.output_len(v).min(pooled)).map(move |j| (i * pooled + j) as u32)
            })
            .collect();
        x.gather_rows(&keep)
    }
}

/// A loaded Qwen2-Audio: the audio encoder on an encoder device and the LLM on its own device.
pub struct Qwen2Audio<E: Backend, L: Backend> {
    pub config: Qwen2AudioConfig,
    pub audio: AudioEncoder<E>,
    pub llm: Qwen2<L>,
}

impl<E: Backend, L: Backend> Qwen2Audio<E, L> {
    pub fn load(dir: &Path, encoder_device: &E, llm_device: &L) -> Result<Self> {
        let config = Qwen2AudioConfig::read(dir)?;
        let mut weights = Weights::load(dir, canonical_name)?;
        let audio = AudioEncoder::load(
            config.audio.clone(),
            config.text.hidden_size,
            &mut weights,
            "model.",
            encoder_device,
        )?;
        let llm = Qwen2::load(
            config.text.clone(),
            &mut weights,
            "model.language_model.",
            llm_device,
        )?;
        weights.warn_unused();
        Ok(Self { config, audio, llm })
    }

    /// Only the audio encoder and projector, on `device`: another encoder device's copy, reading
    /// nothing of the LLM's weights.
    pub fn load_audio(dir: &Path, device: &E) -> Result<AudioEncoder<E>> {
        let config = Qwen2AudioConfig::read(dir)?;
        let mut weights = Weights::load(dir, canonical_name)?;
        AudioEncoder::load(
            config.audio,
            config.text.hidden_size,
            &mut weights,
            "model.",
            device,
        )
    }
}

impl<B: Backend> Encoder for AudioEncoder<B> {
    fn kind(&self) -> EncoderKind {
        EncoderKind::Audio
    }

    /// Packs every item's chunks into one call and splits the output by each item's token count.
    fn encode(&self, batch: &[&EncodeInput]) -> Vec<Result<Vec<f32>>> {
        self.device().run_on(|| {
            packed_or_each(batch, |items| {
                let mut features = Vec::new();
                let mut valid = Vec::new();
                let mut per_item = Vec::with_capacity(items.len());
                for item in items {
                    let EncodeInput::Audio {
                        features: f,
                        valid_frames,
                    } = item
                    else {
                        return Err(wrong_kind(EncoderKind::Audio));
                    };
                    features.extend_from_slice(f);
                    valid.extend_from_slice(valid_frames);
                    per_item.push(
                        valid_frames
                            .iter()
                            .map(|&v| self.config().output_len(v))
                            .sum::<usize>(),
                    );
                }
                let out = AudioEncoder::encode(self, &features, &valid)?.to_host()?;
                let width = out.len() / per_item.iter().sum::<usize>().max(1);
                let mut at = 0;
                Ok(per_item
                    .iter()
                    .map(|&n| {
                        at += n * width;
                        out[at - n * width..at].to_vec()
                    })
                    .collect())
            })
        })
    }
}
