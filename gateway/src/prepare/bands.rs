//! Joining an item the plugin made in bands of rows back into the whole before it is encoded.
//!
//! A large image is made in parts (contract 0.4) that are bands of its patch rows, each on its own
//! plugin instance; its vision tower attends across the whole image, so unlike a video's or an
//! audio file's parts the bands cannot be encoded apart. Each band's patches are a run of the
//! whole's and its grid is the whole's but for its height, so the join is exact: the whole's
//! tensors, byte for byte.

use anyhow::{Context, bail};
use mmgate_host::Tensor;
use mmgate_inference::families::RowBands;

/// The whole item's tensors from its bands' (in order): `bands.patches` concatenated row after
/// row, `bands.grid`'s heights added up, every other tensor the same in each band.
pub fn join(parts: &[Vec<Tensor>], bands: RowBands) -> anyhow::Result<Vec<Tensor>> {
    let Some((first, rest)) = parts.split_first() else {
        bail!("an item in no parts");
    };
    let mut whole = first.clone();
    for (n, part) in rest.iter().enumerate() {
        let n = n + 1;
        if part.len() != whole.len() {
            bail!(
                "part {n} has {} tensors, part 0 {}",
                part.len(),
                whole.len()
            );
        }
        for joined in &mut whole {
            let band = part
                .iter()
                .find(|t| t.name == joined.name)
                .with_context(|| format!("part {n} lacks {}", joined.name))?;
            if joined.name == bands.patches {
                append_rows(joined, band).with_context(|| format!("part {n}"))?;
            } else if joined.name == bands.grid {
                add_heights(joined, band).with_context(|| format!("part {n}"))?;
            } else if !same(joined, band) {
                bail!("part {n}'s {} is not part 0's", joined.name);
            }
        }
    }
    Ok(whole)
}

fn same(a: &Tensor, b: &Tensor) -> bool {
    (a.dtype, &a.shape, &a.data) == (b.dtype, &b.shape, &b.data)
}

/// `band`'s rows after `whole`'s: the same type and row shape.
fn append_rows(whole: &mut Tensor, band: &Tensor) -> anyhow::Result<()> {
    let (Some((rows, row)), Some((band_rows, band_row))) =
        (whole.shape.split_first(), band.shape.split_first())
    else {
        bail!("{} has no rows", whole.name);
    };
    if whole.dtype != band.dtype || row != band_row {
        bail!(
            "{}: rows of {:?} {:?} and {:?} {:?} do not join",
            whole.name,
            band.dtype,
            band_row,
            whole.dtype,
            row
        );
    }
    let rows = rows + band_rows;
    whole.shape[0] = rows;
    whole.data.extend_from_slice(&band.data);
    Ok(())
}

/// `band`'s grid height added to `whole`'s (`[t, h, w]` or `[1, 3]`, i64): the same `t` and `w`.
fn add_heights(whole: &mut Tensor, band: &Tensor) -> anyhow::Result<()> {
    let grid = |t: &Tensor| -> anyhow::Result<[i64; 3]> {
        match (t.dtype, &mmgate_host::le_i64s(&t.data)[..]) {
            (mmgate_host::Dtype::I64, &[t, h, w]) => Ok([t, h, w]),
            _ => bail!("{} is not one t, h, w grid of i64", t.name),
        }
    };
    let ([t, h, w], [band_t, band_h, band_w]) = (grid(whole)?, grid(band)?);
    let height = h.checked_add(band_h).filter(|_| band_h > 0);
    let (Some(height), true) = (height, (t, w) == (band_t, band_w)) else {
        bail!(
            "{}: a band {band_t}x{band_h}x{band_w} is not a band of rows of {t}x{h}x{w}",
            whole.name
        );
    };
    let joined: Vec<u8> = [t, height, w]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    whole.data = joined;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use mmgate_host::Dtype;

    const BANDS: RowBands = RowBands {
        grid: "image_grid_thw",
        patches: "pixel_values",
    };

    fn grid(t: i64, h: i64, w: i64) -> Tensor {
        let data = [t, h, w].iter().flat_map(|v| v.to_le_bytes()).collect();
        Tensor::new("image_grid_thw", Dtype::I64, &[1, 3], data)
    }

    fn band(rows: std::ops::Range<u8>, h: i64) -> Vec<Tensor> {
        let patches: Vec<u8> = rows.clone().flat_map(|r| [r, r, r]).collect();
        vec![
            Tensor::new("pixel_values", Dtype::U8, &[rows.len() as u64, 3], patches),
            Tensor::new("pixel_values_table", Dtype::F32, &[1], vec![1, 2, 3, 4]),
            grid(1, h, 4),
        ]
    }

    #[test]
    fn bands_join_into_the_whole() {
        let whole = band(0..12, 6);
        let parts = [band(0..4, 2), band(4..6, 1), band(6..12, 3)];
        let all_same = |a: &[Tensor], b: &[Tensor]| {
            a.len() == b.len() && a.iter().zip(b).all(|(a, b)| a.name == b.name && same(a, b))
        };
        assert!(all_same(&join(&parts, BANDS).unwrap(), &whole));
        assert!(all_same(&join(&parts[..1], BANDS).unwrap(), &parts[0]));
    }

    #[test]
    fn parts_that_are_not_bands_of_one_item_are_refused() {
        let (a, b) = (band(0..4, 2), band(4..8, 2));
        let mut other_table = b.clone();
        other_table[1].data = vec![9; 4];
        let mut other_width = b.clone();
        other_width[2] = grid(1, 2, 8);
        let mut other_rows = b.clone();
        other_rows[0].shape = vec![2, 6];
        let mut missing = b.clone();
        missing.pop();
        let mut overflowing = b.clone();
        overflowing[2] = grid(1, i64::MAX, 4);
        for bad in [other_table, other_width, other_rows, missing, overflowing] {
            assert!(join(&[a.clone(), bad], BANDS).is_err());
        }
        assert!(join(&[], BANDS).is_err());
    }
}
