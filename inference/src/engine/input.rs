//! What the encoders take: the preprocessed tensors of one media item ([`EncodeInput`]), pixel
//! values in their compact forms, and the handoff through which a piece still being made when its
//! request was submitted arrives later.

use std::sync::Arc;

use super::handoff;
use crate::backend::ByteSamplesView;
use crate::rope::Grid;

/// A piece's meeting point with its maker: see [`handoff`].
pub type Handoff = handoff::Handoff<EncodeInput>;
/// The maker's side of a [`Handoff`].
pub type Delivery = handoff::Delivery<EncodeInput>;
/// A piece's input or why it could not be made.
pub type Handed = handoff::Handed<EncodeInput>;

/// The preprocessed tensors of one media item, as the plugins produce them.
#[derive(Debug, Clone)]
pub enum EncodeInput {
    /// Qwen2-VL `pixel_values` `[patches, C·T·P·P]` (an image or a video) and its grid.
    Vision {
        pixel_values: PixelValues,
        grid: Grid,
    },
    /// Whisper `input_features` `[chunks, mel, 3000]` and the valid frames of each chunk.
    Audio {
        features: Vec<f32>,
        valid_frames: Vec<usize>,
    },
    /// What an encoder of this model already made elsewhere (another mmgate that encoded the
    /// media, a client's `image_embeds`): `[tokens, hidden]` embeddings, merged without encoding;
    /// `grid` places a vision item's tokens for M-RoPE.
    Embeddings {
        embeddings: Arc<Vec<f32>>,
        grid: Option<Grid>,
    },
    /// A piece of an item still being made when its request was submitted: placed now by its
    /// grid (a vision piece's; `None` for audio), encoded when its input arrives through the
    /// handoff (see [`Handoff`]).
    Later {
        grid: Option<Grid>,
        handoff: Arc<Handoff>,
    },
}

/// Pixel values as an encoder takes them: the f32 values, or a compact source of them that the
/// encoder expands only when it packs its batch (8-bit samples and their normalisation table: a
/// quarter of the memory while an item waits, and normalising becomes the encoder's work).
#[derive(Debug, Clone)]
pub enum PixelValues {
    F32(Vec<f32>),
    Source(Arc<dyn PixelSource>),
}

/// What a compact form of pixel values offers the encoder.
pub trait PixelSource: std::fmt::Debug + Send + Sync {
    /// How many values [`PixelSource::extend_f32`] appends.
    fn value_count(&self) -> usize;
    /// Bytes held.
    fn bytes(&self) -> usize;
    /// Passes everything the values are computed from to `feed`, in order (for content hashing).
    fn feed_content(&self, feed: &mut dyn FnMut(&[u8]));
    /// Appends the values.
    fn extend_f32(&self, out: &mut Vec<f32>);
    /// Writes the values from `start` on into `out` (as many as it holds; past the end, nothing).
    fn write_f32(&self, start: usize, out: &mut [f32]);
    /// The 8-bit samples and table the values come from, for a device that expands them itself.
    fn byte_samples(&self) -> Option<ByteSamplesView<'_>> {
        None
    }
}

impl PixelValues {
    pub fn len(&self) -> usize {
        match self {
            Self::F32(values) => values.len(),
            Self::Source(source) => source.value_count(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn bytes(&self) -> usize {
        match self {
            Self::F32(values) => 4 * values.len(),
            Self::Source(source) => source.bytes(),
        }
    }

    fn hash_into(&self, h: &mut blake3::Hasher) {
        match self {
            Self::F32(values) => {
                h.update(b"f32");
                hash_f32s(h, values);
            }
            Self::Source(source) => {
                h.update(b"source");
                source.feed_content(&mut |bytes| {
                    h.update(bytes);
                });
            }
        }
    }

    /// The values from `start` on, into `out` (expanding a compact source).
    pub fn write_f32(&self, start: usize, out: &mut [f32]) {
        match self {
            Self::F32(values) => {
                if let Some(from) = values.get(start..start + out.len()) {
                    out.copy_from_slice(from);
                }
            }
            Self::Source(source) => source.write_f32(start, out),
        }
    }

    /// Appends the values (expanding a compact source).
    pub fn extend_f32(&self, out: &mut Vec<f32>) {
        match self {
            Self::F32(values) => out.extend_from_slice(values),
            Self::Source(source) => source.extend_f32(out),
        }
    }
}

impl From<Vec<f32>> for PixelValues {
    fn from(values: Vec<f32>) -> Self {
        Self::F32(values)
    }
}

fn hash_f32s(h: &mut blake3::Hasher, values: &[f32]) {
    for f in values {
        h.update(&f.to_le_bytes());
    }
}

fn hash_grid(h: &mut blake3::Hasher, grid: &Grid) {
    for d in [grid.t, grid.h, grid.w] {
        h.update(&(d as u64).to_le_bytes());
    }
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
    /// The encoder it needs; `None` for embeddings, which need none, and for an input still to
    /// come, which is not encodable yet.
    pub fn kind(&self) -> Option<EncoderKind> {
        match self {
            Self::Vision { .. } => Some(EncoderKind::Vision),
            Self::Audio { .. } => Some(EncoderKind::Audio),
            Self::Embeddings { .. } | Self::Later { .. } => None,
        }
    }

    /// Bytes of input data held (what a content hash covers).
    pub fn bytes(&self) -> usize {
        match self {
            Self::Vision { pixel_values, .. } => pixel_values.bytes(),
            Self::Audio { features, .. } => 4 * features.len(),
            Self::Embeddings { embeddings, .. } => 4 * embeddings.len(),
            Self::Later { .. } => 0,
        }
    }

    /// Feeds the input's exact content into a hasher.
    pub fn hash_into(&self, h: &mut blake3::Hasher) {
        match self {
            Self::Vision { pixel_values, grid } => {
                h.update(b"vision");
                hash_grid(h, grid);
                pixel_values.hash_into(h);
            }
            Self::Audio {
                features,
                valid_frames,
            } => {
                h.update(b"audio");
                for v in valid_frames {
                    h.update(&(*v as u64).to_le_bytes());
                }
                hash_f32s(h, features);
            }
            Self::Embeddings { embeddings, grid } => {
                h.update(b"embeddings");
                if let Some(grid) = grid {
                    hash_grid(h, grid);
                }
                hash_f32s(h, embeddings);
            }
            // Not content: no other request can have made the same piece yet, so it is named
            // by its handoff alone (and never shared).
            Self::Later { handoff, .. } => {
                h.update(b"later");
                h.update(&handoff.id().to_le_bytes());
            }
        }
    }
}
