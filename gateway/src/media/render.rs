//! Pictures of preprocessed tensors, for people checking what a plugin made of their media.

use anyhow::{Context, anyhow, bail};
use mmgate_host::{Dtype, Tensor};

/// Widest spectrogram drawn, in pixels; longer audio is averaged over groups of frames to fit.
const MAX_WIDTH: usize = 6000;
/// A separator between chunks is one column per this many frames of audio (at least one).
const SEPARATOR_EVERY: usize = 400;
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
pub fn mel_png(tensors: &[Tensor]) -> anyhow::Result<Vec<u8>> {
    let find = |name: &str| {
        tensors
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| anyhow!("the plugin produced no {name} (is this audio?)"))
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

    // Columns: the audible frames of each chunk, then a separator (None) between chunks, wide
    // enough to stay visible when the picture is shown smaller than it is drawn.
    let audible: Vec<usize> = (0..chunks)
        .map(|chunk| {
            let mask = &mask[chunk * frames..(chunk + 1) * frames];
            mask.iter().filter(|&&m| m != 0).count()
        })
        .collect();
    let separator = (audible.iter().sum::<usize>() / SEPARATOR_EVERY).max(1);
    let mut columns: Vec<Option<(usize, usize)>> = Vec::new();
    for (chunk, &audible) in audible.iter().enumerate() {
        if chunk > 0 {
            columns.extend(std::iter::repeat_n(None, separator));
        }
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

    rgb_png(width, height, &rgb)
}

/// `rgb` (8-bit, row after row) as a PNG.
fn rgb_png(width: usize, height: usize, rgb: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut png = Vec::new();
    let mut encoder = png::Encoder::new(&mut png, width as u32, height as u32);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    encoder
        .write_header()
        .and_then(|mut writer| writer.write_image_data(rgb))
        .context("encoding a PNG")?;
    Ok(png)
}

/// Widest thumbnail in a contact sheet; frames are scaled down (nearest pixel) to fit.
const THUMB_WIDTH: usize = 240;
const SHEET_COLUMNS: usize = 4;
const GAP: usize = 8;
/// The label font's pixel size: 3×5 glyphs drawn at this scale.
const FONT_SCALE: usize = 2;

/// 3×5 bitmap glyphs, one row per byte (bit 2 is the left column), for the few characters labels use.
fn glyph(c: char) -> [u8; 5] {
    match c {
        '0' => [7, 5, 5, 5, 7],
        '1' => [2, 6, 2, 2, 7],
        '2' => [7, 1, 7, 4, 7],
        '3' => [7, 1, 7, 1, 7],
        '4' => [5, 5, 7, 1, 1],
        '5' => [7, 4, 7, 1, 7],
        '6' => [7, 4, 7, 5, 7],
        '7' => [7, 1, 1, 1, 1],
        '8' => [7, 5, 7, 5, 7],
        '9' => [7, 5, 7, 1, 7],
        '.' => [0, 0, 0, 0, 2],
        '#' => [5, 7, 5, 7, 5],
        's' => [3, 4, 2, 1, 6],
        't' => [2, 7, 2, 2, 3],
        'o' => [0, 7, 5, 5, 7],
        'k' => [4, 5, 6, 5, 5],
        'e' => [7, 5, 7, 4, 7],
        'n' => [0, 6, 5, 5, 5],
        _ => [0; 5],
    }
}

struct Canvas {
    width: usize,
    height: usize,
    rgb: Vec<u8>,
}

impl Canvas {
    fn put(&mut self, x: usize, y: usize, pixel: [u8; 3]) {
        if x < self.width && y < self.height {
            self.rgb[(y * self.width + x) * 3..][..3].copy_from_slice(&pixel);
        }
    }

    fn text(&mut self, x: usize, y: usize, text: &str) {
        for (i, c) in text.chars().enumerate() {
            for (row, bits) in glyph(c).iter().enumerate() {
                for col in 0..3 {
                    if bits & (4 >> col) != 0 {
                        for dy in 0..FONT_SCALE {
                            for dx in 0..FONT_SCALE {
                                let px = x + (i * 4 + col) * FONT_SCALE + dx;
                                self.put(px, y + row * FONT_SCALE + dy, [255, 255, 255]);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Render the frames a video plugin chose, as the model will see them (rebuilt from
/// `pixel_values_videos`, un-normalised with `mean`/`std`), in a grid: each with its index and
/// timestamp, the sheet headed by the token cost.
pub fn contact_sheet(
    tensors: &[Tensor],
    mean: [f32; 3],
    std: [f32; 3],
    tokens: u32,
) -> anyhow::Result<Vec<u8>> {
    const PATCH: usize = 14;
    const MERGE: usize = 2;
    const TEMPORAL: usize = 2;
    let find = |name: &str| {
        tensors
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| anyhow!("the plugin produced no {name} (is this a video?)"))
    };
    let grid = values(find("video_grid_thw")?, Dtype::I64, i64::from_le_bytes)?;
    let [t, gh, gw] = <[i64; 3]>::try_from(grid.as_slice())
        .map_err(|_| anyhow!("video_grid_thw is not [t, h, w]"))?
        .map(|d| d.max(0) as usize);
    find("pixel_values_videos")?; // for its explanation when missing
    let pixels = mmgate_host::f32_values(tensors, "pixel_values_videos")?;
    let indices = values(find("frame_indices")?, Dtype::I64, i64::from_le_bytes)?;
    let times = values(find("frame_timestamps")?, Dtype::F32, f32::from_le_bytes)?;
    let row_len = 3 * TEMPORAL * PATCH * PATCH;
    if pixels.len() != t * gh * gw * row_len
        || indices.len() != t * TEMPORAL
        || !gh.is_multiple_of(MERGE)
        || !gw.is_multiple_of(MERGE)
    {
        bail!("pixel_values_videos, video_grid_thw and frame_indices do not agree");
    }
    let (height, width) = (gh * PATCH, gw * PATCH);
    let step = width.div_ceil(THUMB_WIDTH).max(1);
    let (tw, th) = (width.div_ceil(step), height.div_ceil(step));
    let label = 5 * FONT_SCALE + GAP;
    let frames = indices.len();
    let columns = SHEET_COLUMNS.min(frames).max(1);
    let rows = frames.div_ceil(columns);
    let mut canvas = Canvas {
        width: GAP + columns * (tw + GAP),
        height: label + GAP + rows * (th + label + GAP),
        rgb: vec![24; (GAP + columns * (tw + GAP)) * (label + GAP + rows * (th + label + GAP)) * 3],
    };
    canvas.text(GAP, GAP, &format!("{tokens} tokens"));
    let pixel = |frame: usize, y: usize, x: usize| -> [u8; 3] {
        let (group, tp) = (frame / TEMPORAL, frame % TEMPORAL);
        let (ph, pw) = (y / PATCH, x / PATCH);
        let row = ((group * (gh / MERGE) + ph / MERGE) * (gw / MERGE) + pw / MERGE) * MERGE * MERGE
            + (ph % MERGE) * MERGE
            + pw % MERGE;
        std::array::from_fn(|c| {
            let at = row * row_len
                + (c * TEMPORAL + tp) * PATCH * PATCH
                + (y % PATCH) * PATCH
                + x % PATCH;
            ((pixels[at] * std[c] + mean[c]) * 255.0)
                .round()
                .clamp(0.0, 255.0) as u8
        })
    };
    for (frame, index) in indices.iter().enumerate() {
        let (col, row) = (frame % columns, frame / columns);
        let x0 = GAP + col * (tw + GAP);
        let y0 = label + GAP + row * (th + label + GAP);
        for y in 0..th {
            for x in 0..tw {
                canvas.put(x0 + x, y0 + y, pixel(frame, y * step, x * step));
            }
        }
        let time = times.get(frame).copied().unwrap_or(0.0);
        let text = format!("#{index} {time:.2}s");
        canvas.text(x0, y0 + th + GAP / 2, &text);
    }
    rgb_png(canvas.width, canvas.height, &canvas.rgb)
}
