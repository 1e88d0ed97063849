//! What an encoder device runs: the [`Encoder`] trait over the preprocessed media of one modality,
//! implemented by the vision tower and the audio encoder, and the inputs they take.

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::models::qwen2_audio::AudioEncoder;
use crate::models::qwen2_vl::VisionTower;
use crate::rope::Grid;
use crate::tensor::Tensor;

/// The preprocessed tensors of one media item, as the plugins produce them.
#[derive(Debug, Clone, PartialEq)]
pub enum EncodeInput {
    /// Qwen2-VL `pixel_values` `[patches, C·T·P·P]` (an image or a video) and its grid.
    Vision { pixel_values: Vec<f32>, grid: Grid },
    /// Whisper `input_features` `[chunks, mel, 3000]` and the valid frames of each chunk.
    Audio {
        features: Vec<f32>,
        valid_frames: Vec<usize>,
    },
}

/// Which encoder an input needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EncoderKind {
    Vision,
    Audio,
}

impl EncoderKind {
    /// The name metrics and logs use.
    pub fn name(self) -> &'static str {
        match self {
            Self::Vision => "vision",
            Self::Audio => "audio",
        }
    }
}

impl EncodeInput {
    pub fn kind(&self) -> EncoderKind {
        match self {
            Self::Vision { .. } => EncoderKind::Vision,
            Self::Audio { .. } => EncoderKind::Audio,
        }
    }

    /// Bytes of input data (what a content hash covers).
    pub fn bytes(&self) -> usize {
        4 * match self {
            Self::Vision { pixel_values, .. } => pixel_values.len(),
            Self::Audio { features, .. } => features.len(),
        }
    }

    /// Feeds the input's exact content into a hasher.
    pub fn hash_into(&self, h: &mut blake3::Hasher) {
        let floats = match self {
            Self::Vision { pixel_values, grid } => {
                h.update(b"vision");
                for d in [grid.t, grid.h, grid.w] {
                    h.update(&(d as u64).to_le_bytes());
                }
                pixel_values
            }
            Self::Audio {
                features,
                valid_frames,
            } => {
                h.update(b"audio");
                for v in valid_frames {
                    h.update(&(*v as u64).to_le_bytes());
                }
                features
            }
        };
        for f in floats {
            h.update(&f.to_le_bytes());
        }
    }
}

/// An encoder placed on one device. `encode` takes a batch of inputs of its kind and returns each
/// item's embeddings (`[tokens, hidden]`, flattened, on the host) or that item's error: one bad
/// item does not fail the others.
pub trait Encoder: Send + Sync + 'static {
    fn kind(&self) -> EncoderKind;
    fn encode(&self, batch: &[&EncodeInput]) -> Vec<Result<Vec<f32>>>;
}

/// Runs the batch as one packed call; if that fails, item by item so each gets its own result.
fn packed_or_each(
    batch: &[&EncodeInput],
    packed: impl Fn(&[&EncodeInput]) -> Result<Vec<Vec<f32>>>,
) -> Vec<Result<Vec<f32>>> {
    if batch.len() > 1
        && let Ok(all) = packed(batch)
    {
        return all.into_iter().map(Ok).collect();
    }
    batch
        .iter()
        .map(|item| {
            packed(std::slice::from_ref(item))
                .and_then(|mut v| v.pop().ok_or_else(|| Error::Input("empty".into())))
        })
        .collect()
}

fn wrong_kind(kind: EncoderKind) -> Error {
    Error::Input(format!("input is not for the {kind:?} encoder"))
}

impl<B: Backend> Encoder for VisionTower<B> {
    fn kind(&self) -> EncoderKind {
        EncoderKind::Vision
    }

    /// Packs every item's patches into one call (attention stays within each frame) and splits the
    /// output by each grid's token count.
    fn encode(&self, batch: &[&EncodeInput]) -> Vec<Result<Vec<f32>>> {
        self.device().run_on(|| {
            packed_or_each(batch, |items| {
                let mut grids = Vec::with_capacity(items.len());
                let mut pixels = Vec::new();
                for item in items {
                    let EncodeInput::Vision { pixel_values, grid } = item else {
                        return Err(wrong_kind(EncoderKind::Vision));
                    };
                    grids.push(*grid);
                    pixels.extend_from_slice(pixel_values);
                }
                let c = self.config();
                let patches: usize = grids.iter().map(Grid::patches).sum();
                let input = Tensor::from_host(self.device(), &pixels, &[patches, c.patch_len()])?;
                let out = self.encode(&input, &grids)?.to_host()?;
                let width = c.out_dim;
                let mut at = 0;
                Ok(grids
                    .iter()
                    .map(|g| {
                        let n = g.tokens(c.merge) * width;
                        at += n;
                        out[at - n..at].to_vec()
                    })
                    .collect())
            })
        })
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
