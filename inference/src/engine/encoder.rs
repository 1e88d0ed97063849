//! What an encoder device runs: the [`Encoder`] trait over the preprocessed media of one modality
//! (its inputs are in [`input`](super::input)), and the generic machinery the models' encoders
//! share: packing a batch into one call, and the flow of a patch-based vision tower
//! (`PatchTower`, `encode_patches`). Each model implements the traits beside its tower in
//! [`models`](crate::models); the engine names no model.

use super::input::{EncodeInput, EncoderKind, PixelValues};
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::rope::Grid;
use crate::tensor::Tensor;

/// An encoder placed on one device. `encode` takes a batch of inputs of its kind and returns each
/// item's embeddings (`[tokens, hidden]`, flattened, on the host) or that item's error: one bad
/// item does not fail the others.
pub trait Encoder: Send + Sync + 'static {
    fn kind(&self) -> EncoderKind;
    fn encode(&self, batch: &[&EncodeInput]) -> Vec<Result<Vec<f32>>>;
}

/// Runs the batch as one packed call; if that fails, item by item so each gets its own result.
pub(crate) fn packed_or_each(
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

/// The error for an input given to an encoder of another kind.
pub(crate) fn wrong_kind(kind: EncoderKind) -> Error {
    Error::Input(format!("input is not for the {kind:?} encoder"))
}

/// What a vision tower offers the encoder pool: patches embedded a block at a time, then the rest
/// of the tower over every item's embeddings at once.
pub(crate) trait PatchTower<B: Backend> {
    fn device(&self) -> &B;
    fn patch_len(&self) -> usize;
    fn embed_dim(&self) -> usize;
    fn merge(&self) -> usize;
    fn embed_patches(&self, pixels: &Tensor<B>) -> Result<Tensor<B>>;
    /// Every item's output rows, `[Σ tokens, width]` on the host.
    fn encode_embedded(&self, embedded: Tensor<B>, grids: &[Grid]) -> Result<Vec<f32>>;
}

/// Packs every item's patches into one call (attention stays within each frame) and splits the
/// output by each grid's token count. The pixel values are expanded (8-bit samples to f32) and
/// embedded a block of patches at a time: the f32 pixels of a whole batch (290 MB for a 12 MP
/// photo) are never held, only their embedding, which the tower needs anyway.
pub(crate) fn encode_patches<B: Backend>(
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
