//! Vision items as Qwen-VL processors make them: patches (`pixel_values`, `pixel_values_videos`)
//! over a grid of `t × h × w` patches (`image_grid_thw`, `video_grid_thw`), merged `merge × merge`
//! into tokens. Shared by every family with such a tower.

use super::{ItemTensors, MediaKind, RowBands};
use crate::engine::EncodeInput;
use crate::error::{Error, Result};
use crate::rope::Grid;

/// The tensors of an item of `kind`: its grid's and its patches' names.
pub(super) fn names(kind: MediaKind) -> Result<(&'static str, &'static str)> {
    match kind {
        MediaKind::Image => Ok(("image_grid_thw", "pixel_values")),
        MediaKind::Video => Ok(("video_grid_thw", "pixel_values_videos")),
        MediaKind::Audio => Err(Error::Input("this model does not take audio input".into())),
    }
}

/// An image's bands of patch rows join back into it: its vision tower attends across the whole
/// image (within each frame), so it is encoded whole. A video's parts are runs of whole frames,
/// which the tower sees apart anyway: each is encoded as a piece.
pub(super) fn row_bands(kind: MediaKind) -> Option<RowBands> {
    let (grid, patches) = names(kind).ok()?;
    (kind == MediaKind::Image).then_some(RowBands { grid, patches })
}

/// Tokens a grid makes (`t · h/merge · w/merge`), `None` past usize.
pub(super) fn grid_tokens(grid: Grid, merge: usize) -> Option<usize> {
    grid.t
        .checked_mul(grid.h / merge)
        .and_then(|n| n.checked_mul(grid.w / merge))
}

/// A `*_grid_thw` tensor (`t, h, w` in patches) checked against the model's patch merge: it comes
/// from a plugin or a client.
pub(super) fn merged_grid(tensors: &ItemTensors, name: &str, merge: usize) -> Result<Grid> {
    let thw = tensors.ints(name)?;
    let [t, h, w] = thw[..] else {
        return Err(Error::Input(format!(
            "{name} has {} values, not 3",
            thw.len()
        )));
    };
    let dim = |v: i64| {
        usize::try_from(v).map_err(|_| Error::Input(format!("{name} has a negative dimension")))
    };
    let grid = Grid {
        t: dim(t)?,
        h: dim(h)?,
        w: dim(w)?,
    };
    if grid.t == 0 || !grid.h.is_multiple_of(merge) || !grid.w.is_multiple_of(merge) {
        return Err(Error::Input(format!(
            "{name} {}x{}x{} is not a grid of the model's {merge}x{merge} merged patches",
            grid.t, grid.h, grid.w
        )));
    }
    Ok(grid)
}

/// An item's encoder input and its grid from its patches and grid tensor, checked against each
/// other and the model's patch length and merge.
pub(super) fn plan_patches(
    kind: MediaKind,
    tensors: &mut ItemTensors,
    patch_len: usize,
    merge: usize,
) -> Result<(EncodeInput, Grid)> {
    let (grid_name, pixels_name) = names(kind)?;
    let grid = merged_grid(tensors, grid_name, merge)?;
    // 8-bit samples stay bytes until the encoder packs its batch.
    let pixel_values = tensors.take_pixel_values(pixels_name)?;
    let patches = grid
        .t
        .checked_mul(grid.h)
        .and_then(|p| p.checked_mul(grid.w));
    if patches.and_then(|p| p.checked_mul(patch_len)) != Some(pixel_values.len()) {
        return Err(Error::Input(format!(
            "{pixels_name} holds {} values, not the {}x{}x{} grid's patches of {patch_len}",
            pixel_values.len(),
            grid.t,
            grid.h,
            grid.w
        )));
    }
    Ok((EncodeInput::Vision { pixel_values, grid }, grid))
}

/// The grid that places `tokens` embeddings of an item made elsewhere, read from its tensors
/// (which are handed back for the family's other placing tensors).
pub(super) fn place_by_grid(
    kind: MediaKind,
    tensors: Option<&ItemTensors>,
    tokens: usize,
    merge: usize,
) -> Result<(Grid, &ItemTensors)> {
    let (grid_name, _) = names(kind)?;
    let tensors = tensors.ok_or_else(|| {
        Error::Input(format!(
            "{grid_name} is missing: this model places {} tokens by their grid",
            kind.name()
        ))
    })?;
    let grid = merged_grid(tensors, grid_name, merge)?;
    let planned = grid_tokens(grid, merge);
    if planned != Some(tokens) {
        return Err(Error::Input(format!(
            "{grid_name} {}x{}x{} makes {} tokens, not the item's {tokens}",
            grid.t,
            grid.h,
            grid.w,
            planned.map_or_else(|| "too many".into(), |n| n.to_string())
        )));
    }
    Ok((grid, tensors))
}
