//! What an encoder device runs: the [`Encoder`] trait over the preprocessed media of one modality,
//! implemented by the vision tower and the audio encoder, and the inputs they take.

use std::sync::Arc;

use super::handoff::Handoff;
use crate::backend::{Backend, ByteSamplesView};
use crate::error::{Error, Result};
use crate::models::qwen2_audio::AudioEncoder;
use crate::models::qwen2_vl::VisionTower;
use crate::models::qwen3_vl::Qwen3VisionTower;
use crate::rope::Grid;
use crate::tensor::Tensor;

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

/// The embeddings of `items`' patches (each its pixel values and how many patches of `patch_len`
/// values they hold, in order), `embed` run on a block of rows at a time: the pixel values are
/// expanded (8-bit samples to f32) one block at a time into one buffer, never all at once. Blocks
/// run over the items' rows as one sequence (an item may end mid-block) and hold a multiple of 64
/// rows, so that the blocks' GEMMs tile the rows as one GEMM over all of them would: the values are
/// the same bits.
pub fn embed_blockwise<B: Backend>(
    device: &B,
    items: &[(&PixelValues, usize)],
    patch_len: usize,
    embed: impl Fn(&Tensor<B>) -> Result<Tensor<B>>,
) -> Result<Vec<f32>> {
    let patches: usize = items.iter().map(|(_, rows)| rows).sum();
    let rows_per_block = patch_block_rows(patch_len, device.pixel_block_values());
    if rows_per_block >= patches
        && let Some(input) = expanded_on_device(device, items, patch_len)?
    {
        return embed(&input)?.to_host();
    }
    let mut block = vec![0.0; rows_per_block.min(patches) * patch_len];
    let mut embedded = Vec::new();
    let (mut item, mut item_row) = (0, 0);
    let mut row = 0;
    while row < patches {
        let rows = (patches - row).min(rows_per_block);
        let mut filled = 0;
        while filled < rows {
            let Some(&(pixel_values, item_rows)) = items.get(item) else {
                return Err(Error::Input("pixel values ran out".into()));
            };
            let n = (item_rows - item_row).min(rows - filled);
            let values = &mut block[filled * patch_len..(filled + n) * patch_len];
            pixel_values.write_f32(item_row * patch_len, values);
            (filled, item_row) = (filled + n, item_row + n);
            if item_row == item_rows {
                (item, item_row) = (item + 1, 0);
            }
        }
        let input = Tensor::from_host(device, &block[..rows * patch_len], &[rows, patch_len])?;
        let out = embed(&input)?.to_host()?;
        if embedded.is_empty() {
            embedded.reserve_exact(out.len() / rows * patches);
        }
        embedded.extend(out);
        row += rows;
    }
    Ok(embedded)
}

/// Rows of patches per block (the device's [`Backend::pixel_block_values`]; on the CPU 4 MiB of f32:
/// cache-sized, and enough rows for the embedding's GEMM to run at full speed): a multiple of 64, so that the blocks' GEMMs tile the rows as one GEMM
/// over all of them does, and give the same values.
fn patch_block_rows(patch_len: usize, block_values: usize) -> usize {
    (block_values / patch_len.max(1) / 64)
        .max(1)
        .saturating_mul(64)
}

/// The batch's pixel values as one tensor made on `device`, when the device expands 8-bit samples
/// itself and every item has them (`None` otherwise: the host packs them).
fn expanded_on_device<B: Backend>(
    device: &B,
    items: &[(&PixelValues, usize)],
    patch_len: usize,
) -> Result<Option<Tensor<B>>> {
    let mut parts = Vec::with_capacity(items.len());
    for (pixels, rows) in items {
        let PixelValues::Source(source) = pixels else {
            return Ok(None);
        };
        let Some(view) = source.byte_samples() else {
            return Ok(None);
        };
        if view.value_count() != rows * patch_len {
            return Err(Error::Input("pixel values ran out".into()));
        }
        let Some(buffer) = device.expand_samples(&view)? else {
            return Ok(None);
        };
        parts.push((
            Tensor::from_buffer(device, buffer, &[*rows, patch_len])?,
            *rows,
        ));
    }
    let patches: usize = items.iter().map(|(_, rows)| rows).sum();
    if parts.len() == 1 {
        return Ok(parts.pop().map(|(t, _)| t));
    }
    let mut all = Tensor::zeros(device, &[patches, patch_len])?;
    let mut at = 0;
    for (part, rows) in &parts {
        all.write_rows(at, part)?;
        at += rows;
    }
    Ok(Some(all))
}

fn wrong_kind(kind: EncoderKind) -> Error {
    Error::Input(format!("input is not for the {kind:?} encoder"))
}

/// What a vision tower offers the encoder pool: patches embedded a block at a time, then the rest
/// of the tower over every item's embeddings at once.
trait PatchTower<B: Backend> {
    fn device(&self) -> &B;
    fn patch_len(&self) -> usize;
    fn embed_dim(&self) -> usize;
    fn merge(&self) -> usize;
    fn embed_patches(&self, pixels: &Tensor<B>) -> Result<Tensor<B>>;
    /// Every item's output rows, `[Σ tokens, width]` on the host.
    fn encode_embedded(&self, embedded: Tensor<B>, grids: &[Grid]) -> Result<Vec<f32>>;
}

impl<B: Backend> PatchTower<B> for VisionTower<B> {
    fn device(&self) -> &B {
        VisionTower::device(self)
    }
    fn patch_len(&self) -> usize {
        self.config().patch_len()
    }
    fn embed_dim(&self) -> usize {
        self.config().embed_dim
    }
    fn merge(&self) -> usize {
        self.config().merge
    }
    fn embed_patches(&self, pixels: &Tensor<B>) -> Result<Tensor<B>> {
        VisionTower::embed_patches(self, pixels)
    }
    fn encode_embedded(&self, embedded: Tensor<B>, grids: &[Grid]) -> Result<Vec<f32>> {
        VisionTower::encode_embedded(self, embedded, grids)?.to_host()
    }
}

impl<B: Backend> PatchTower<B> for Qwen3VisionTower<B> {
    fn device(&self) -> &B {
        Qwen3VisionTower::device(self)
    }
    fn patch_len(&self) -> usize {
        self.config().patch_len()
    }
    fn embed_dim(&self) -> usize {
        self.config().embed_dim
    }
    fn merge(&self) -> usize {
        self.config().merge
    }
    fn embed_patches(&self, pixels: &Tensor<B>) -> Result<Tensor<B>> {
        Qwen3VisionTower::embed_patches(self, pixels)
    }
    /// Each token's row is its merged embedding followed by its deepstack features, level by level
    /// (the layout vLLM's Qwen3-VL uses too): one row per token keeps the pool, the feature store
    /// and the shared cache unaware of deepstack; the engine splits the row at the merge.
    fn encode_embedded(&self, embedded: Tensor<B>, grids: &[Grid]) -> Result<Vec<f32>> {
        let (merged, deepstack) = Qwen3VisionTower::encode_embedded(self, embedded, grids)?;
        let merged = merged.to_host()?;
        let deepstack = deepstack
            .iter()
            .map(Tensor::to_host)
            .collect::<Result<Vec<_>>>()?;
        let width = self.config().out_dim;
        let mut rows = Vec::with_capacity(merged.len() * (1 + deepstack.len()));
        for (token, row) in merged.chunks_exact(width).enumerate() {
            rows.extend_from_slice(row);
            for level in &deepstack {
                rows.extend_from_slice(&level[token * width..(token + 1) * width]);
            }
        }
        Ok(rows)
    }
}

impl<B: Backend> Encoder for VisionTower<B> {
    fn kind(&self) -> EncoderKind {
        EncoderKind::Vision
    }
    fn encode(&self, batch: &[&EncodeInput]) -> Vec<Result<Vec<f32>>> {
        encode_patches(self, batch)
    }
}

impl<B: Backend> Encoder for Qwen3VisionTower<B> {
    fn kind(&self) -> EncoderKind {
        EncoderKind::Vision
    }
    fn encode(&self, batch: &[&EncodeInput]) -> Vec<Result<Vec<f32>>> {
        encode_patches(self, batch)
    }
}

/// Packs every item's patches into one call (attention stays within each frame) and splits the
/// output by each grid's token count. The pixel values are expanded (8-bit samples to f32) and
/// embedded a block of patches at a time: the f32 pixels of a whole batch (290 MB for a 12 MP
/// photo) are never held, only their embedding, which the tower needs anyway.
fn encode_patches<B: Backend>(
    tower: &(impl PatchTower<B> + Sync),
    batch: &[&EncodeInput],
) -> Vec<Result<Vec<f32>>> {
    tower.device().run_on(|| {
        packed_or_each(batch, |items| {
            let patch_len = tower.patch_len();
            let mut grids = Vec::with_capacity(items.len());
            let mut sources = Vec::with_capacity(items.len());
            for item in items {
                let EncodeInput::Vision { pixel_values, grid } = item else {
                    return Err(wrong_kind(EncoderKind::Vision));
                };
                if pixel_values.len() != grid.patches() * patch_len {
                    return Err(Error::Input(format!(
                        "{} pixel values for a {}x{}x{} grid of patches of {patch_len}",
                        pixel_values.len(),
                        grid.t,
                        grid.h,
                        grid.w
                    )));
                }
                grids.push(*grid);
                sources.push(pixel_values);
            }
            let patches: usize = grids.iter().map(Grid::patches).sum();
            let items: Vec<(&PixelValues, usize)> = sources
                .iter()
                .copied()
                .zip(grids.iter().map(Grid::patches))
                .collect();
            let embedded = embed_blockwise(tower.device(), &items, patch_len, |pixels| {
                tower.embed_patches(pixels)
            })?;
            let embedded =
                Tensor::from_host_vec(tower.device(), embedded, &[patches, tower.embed_dim()])?;
            let out = tower.encode_embedded(embedded, &grids)?;
            let tokens: usize = grids.iter().map(|g| g.tokens(tower.merge())).sum();
            let width = out.len() / tokens.max(1);
            let mut at = 0;
            Ok(grids
                .iter()
                .map(|g| {
                    let n = g.tokens(tower.merge()) * width;
                    at += n;
                    out[at - n..at].to_vec()
                })
                .collect())
        })
    })
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
