//! Pictures of preprocessed tensors, for people checking what a plugin made of their media.

use std::path::Path;

use anyhow::{Context, anyhow, bail};
use mmgate_host::{Dtype, Tensor};

/// Widest spectrogram drawn, in pixels; longer audio is averaged over groups of frames to fit.
const MAX_WIDTH: usize = 6000;
/// Pixel rows per mel bin, so 80 bins are still visible.
const ROWS_PER_BIN: usize = 2;

/// Anchors of a perceptually ordered dark-to-bright colour map (close to matplotlib's "magma").
const COLORMAP: [[f32; 3]; 5] = [
    [0.0, 0.0, 4.0],
    [81.0, 18.0, 124.0],
    [183.0, 55.0, 121.0],
    [252.0, 137.0, 97.0],
    [252.0, 253.0, 191.0],
];

fn color(t: f32) -> [u8; 3] {
    let x = t.clamp(0.0, 1.0) * (COLORMAP.len() - 1) as f32;
    let i = (x.floor() as usize).min(COLORMAP.len() - 2);
    let f = x - i as f32;
    std::array::from_fn(|c| (COLORMAP[i][c] + (COLORMAP[i + 1][c] - COLORMAP[i][c]) * f) as u8)
}

fn values<T, const N: usize>(
    tensor: &Tensor,
    dtype: Dtype,
    read: fn([u8; N]) -> T,
) -> anyhow::Result<Vec<T>> {
    if tensor.dtype != dtype {
        bail!(
            "tensor {} is {}, expected {}",
            tensor.name,
            tensor.dtype.name(),
            dtype.name()
        );
    }
    Ok(tensor
        .data
        .chunks_exact(N)
        .map(|b| read(b.try_into().unwrap_or([0; N])))
        .collect())
}

/// Render `input_features` [chunks, n_mels, frames] as a spectrogram PNG: time left to right (the
/// chunks one after another, only their frames that hold audio, per `feature_attention_mask`), low
/// frequencies at the bottom, quiet dark and loud bright. Chunks are separated by a white line.
pub fn mel_png(tensors: &[Tensor], path: &Path) -> anyhow::Result<()> {
    let find = |name: &str| {
        tensors
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| anyhow!("--mel-png: the plugin produced no {name} (is this audio?)"))
    };
    let features = find("input_features")?;
    let mask = find("feature_attention_mask")?;
    let [chunks, n_mels, frames] = <[u64; 3]>::try_from(features.shape.as_slice())
        .map_err(|_| anyhow!("input_features is not [chunks, n_mels, frames]"))?
        .map(|d| d as usize);
    let features = values(features, Dtype::F32, f32::from_le_bytes)?;
    let mask = values(mask, Dtype::I64, i64::from_le_bytes)?;
    if features.len() != chunks * n_mels * frames || mask.len() != chunks * frames {
        bail!("input_features and feature_attention_mask do not agree in shape");
    }

    // Columns: the audible frames of each chunk, then a separator (None) between chunks.
    let mut columns: Vec<Option<(usize, usize)>> = Vec::new();
    for chunk in 0..chunks {
        if chunk > 0 {
            columns.push(None);
        }
        let audible = mask[chunk * frames..(chunk + 1) * frames]
            .iter()
            .filter(|&&m| m != 0)
            .count();
        columns.extend((0..audible).map(|f| Some((chunk, f))));
    }
    let group = columns.len().div_ceil(MAX_WIDTH).max(1);
    let width = columns.len().div_ceil(group).max(1);
    let height = n_mels * ROWS_PER_BIN;

    let value =
        |chunk: usize, mel: usize, frame: usize| features[(chunk * n_mels + mel) * frames + frame];
    let (lo, hi) = columns
        .iter()
        .flatten()
        .flat_map(|&(c, f)| (0..n_mels).map(move |m| (c, m, f)))
        .map(|(c, m, f)| value(c, m, f))
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    let span = if hi > lo { hi - lo } else { 1.0 };

    let mut rgb = vec![0u8; width * height * 3];
    for (x, group_columns) in columns.chunks(group).enumerate() {
        let is_separator = group_columns.iter().any(Option::is_none);
        for mel in 0..n_mels {
            let pixel = if is_separator {
                [255, 255, 255]
            } else {
                let frames = group_columns.iter().flatten();
                let mean = frames.clone().map(|&(c, f)| value(c, mel, f)).sum::<f32>()
                    / group_columns.len() as f32;
                color((mean - lo) / span)
            };
            for r in 0..ROWS_PER_BIN {
                let y = height - 1 - (mel * ROWS_PER_BIN + r);
                rgb[(y * width + x) * 3..][..3].copy_from_slice(&pixel);
            }
        }
    }

    let file =
        std::fs::File::create(path).with_context(|| format!("cannot write {}", path.display()))?;
    let mut encoder = png::Encoder::new(std::io::BufWriter::new(file), width as u32, height as u32);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    encoder
        .write_header()
        .and_then(|mut writer| writer.write_image_data(&rgb))
        .with_context(|| format!("cannot write {}", path.display()))
}
