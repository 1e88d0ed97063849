//! torchvision's antialiased bicubic resize on u8 images, for video frames, in both of the ways
//! torchvision runs it: through `torchvision.transforms.functional` (qwen-vl-utils), which resizes
//! a float copy; and through `torchvision.transforms.v2.functional` (transformers' video
//! processors), which hands the u8 tensor to PyTorch's native u8 kernel.

use super::{CHANNELS, RgbImage};
use mmgate_resample::bicubic;

/// Resize as torchvision's `F.resize(uint8 tensor, size, BICUBIC, antialias=True)` does (what
/// qwen-vl-utils runs on video frames): PyTorch's separable antialiased bicubic (Keys a = -0.5, support
/// widened by the downscale factor, weights normalised per output pixel) computed in f32 with no
/// rounding between the passes (width first, then height; an unchanged axis is skipped), then clamped
/// and rounded half to even back to u8. Unlike Pillow's 8-bit path there is no fixed point.
pub fn resize_like_torchvision(image: &RgbImage, width: usize, height: usize) -> RgbImage {
    if (image.width, image.height) == (width, height) {
        return image.clone();
    }
    let mut plane: Vec<f32> = image.data.iter().map(|&v| f32::from(v)).collect();
    let (mut w, h) = (image.width, image.height);
    if w != width {
        let axis = float_axis_weights(w, width);
        let mut next = vec![0f32; width * h * CHANNELS];
        for y in 0..h {
            let src = &plane[y * w * CHANNELS..(y + 1) * w * CHANNELS];
            let dst = &mut next[y * width * CHANNELS..(y + 1) * width * CHANNELS];
            for (x, out) in dst.chunks_exact_mut(CHANNELS).enumerate() {
                let (start, weights) = axis.taps(x);
                let mut acc = [0f32; CHANNELS];
                for (k, &wk) in weights.iter().enumerate() {
                    let p = &src[(start + k) * CHANNELS..(start + k + 1) * CHANNELS];
                    for c in 0..CHANNELS {
                        acc[c] += p[c] * wk;
                    }
                }
                out.copy_from_slice(&acc);
            }
        }
        plane = next;
        w = width;
    }
    if h != height {
        let axis = float_axis_weights(h, height);
        let row = w * CHANNELS;
        let mut next = vec![0f32; row * height];
        for (y, dst) in next.chunks_exact_mut(row).enumerate() {
            let (start, weights) = axis.taps(y);
            for (k, &wk) in weights.iter().enumerate() {
                let src = &plane[(start + k) * row..(start + k + 1) * row];
                for (d, &s) in dst.iter_mut().zip(src) {
                    *d += s * wk;
                }
            }
        }
        plane = next;
    }
    RgbImage {
        width,
        height,
        data: plane
            .iter()
            .map(|&v| v.clamp(0.0, 255.0).round_ties_even() as u8)
            .collect(),
    }
}

/// PyTorch's `_compute_indices_weights_aa` for bicubic: per output index, the first input index and
/// the normalised f32 weights.
struct FloatAxisWeights {
    starts: Vec<usize>,
    lens: Vec<usize>,
    ksize: usize,
    weights: Vec<f32>,
}

impl FloatAxisWeights {
    fn taps(&self, i: usize) -> (usize, &[f32]) {
        let row = &self.weights[i * self.ksize..i * self.ksize + self.lens[i]];
        (self.starts[i], row)
    }
}

fn float_axis_weights(in_size: usize, out_size: usize) -> FloatAxisWeights {
    // PyTorch computes these in the tensor's scalar type (f32 here).
    let scale = in_size as f32 / out_size as f32;
    let support = if scale >= 1.0 { 2.0 * scale } else { 2.0 };
    let inverse = if scale >= 1.0 { 1.0 / scale } else { 1.0 };
    let ksize = support.ceil() as usize * 2 + 1;
    let mut starts = Vec::with_capacity(out_size);
    let mut lens = Vec::with_capacity(out_size);
    let mut weights = vec![0f32; out_size * ksize];
    for (i, row) in weights.chunks_exact_mut(ksize).enumerate() {
        let center = scale * (i as f32 + 0.5);
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
        let len = xmax.saturating_sub(xmin).min(ksize);
        let mut total = 0f32;
        for (j, w) in row.iter_mut().enumerate().take(len) {
            *w = bicubic(f64::from((j as f32 + xmin as f32 - center + 0.5) * inverse)) as f32;
            total += *w;
        }
        if total != 0.0 {
            for w in row.iter_mut().take(len) {
                *w /= total;
            }
        }
        starts.push(xmin);
        lens.push(len);
    }
    FloatAxisWeights {
        starts,
        lens,
        ksize,
        weights,
    }
}

/// Resize as `torchvision.transforms.v2.functional.resize(uint8 tensor, size, BICUBIC,
/// antialias=True)` does (transformers' `Qwen3VLVideoProcessor`): PyTorch's native u8 kernel, a
/// port of Pillow-SIMD's. The antialiased bicubic weights are computed in f64 as for floats, then
/// turned into i16 fixed point at the largest precision that keeps the axis's largest weight
/// within i16; each pass (width first, then height; an unchanged axis is skipped) accumulates in
/// i32 and is rounded and clamped back to u8. Up to 8 levels away from the float path
/// ([`resize_like_torchvision`]) on a 4x downscale.
pub fn resize_like_torch_uint8(image: &RgbImage, width: usize, height: usize) -> RgbImage {
    let (mut data, mut w) = (image.data.clone(), image.width);
    let h = image.height;
    if w != width {
        let axis = Int16AxisWeights::new(w, width);
        let mut next = vec![0u8; width * h * CHANNELS];
        for y in 0..h {
            let src = &data[y * w * CHANNELS..(y + 1) * w * CHANNELS];
            let dst = &mut next[y * width * CHANNELS..(y + 1) * width * CHANNELS];
            for (x, out) in dst.chunks_exact_mut(CHANNELS).enumerate() {
                let (start, weights) = axis.taps(x);
                for (c, out) in out.iter_mut().enumerate() {
                    let taps = weights
                        .iter()
                        .enumerate()
                        .map(|(k, &wk)| (wk, src[(start + k) * CHANNELS + c]));
                    *out = axis.sum(taps);
                }
            }
        }
        data = next;
        w = width;
    }
    if h != height {
        let axis = Int16AxisWeights::new(h, height);
        let row = w * CHANNELS;
        let mut next = vec![0u8; row * height];
        for (y, dst) in next.chunks_exact_mut(row).enumerate() {
            let (start, weights) = axis.taps(y);
            for (i, out) in dst.iter_mut().enumerate() {
                let taps = weights
                    .iter()
                    .enumerate()
                    .map(|(k, &wk)| (wk, data[(start + k) * row + i]));
                *out = axis.sum(taps);
            }
        }
        data = next;
    }
    RgbImage {
        width,
        height,
        data,
    }
}

/// PyTorch's `_compute_index_ranges_int16_weights` for antialiased bicubic on one axis.
struct Int16AxisWeights {
    starts: Vec<usize>,
    lens: Vec<usize>,
    ksize: usize,
    weights: Vec<i32>,
    precision: u32,
}

impl Int16AxisWeights {
    fn new(in_size: usize, out_size: usize) -> Self {
        let scale = in_size as f64 / out_size as f64;
        let support = if scale >= 1.0 { 2.0 * scale } else { 2.0 };
        let inverse = if scale >= 1.0 { 1.0 / scale } else { 1.0 };
        let ksize = support.ceil() as usize * 2 + 1;
        let mut starts = Vec::with_capacity(out_size);
        let mut lens = Vec::with_capacity(out_size);
        let mut float = vec![0f64; out_size * ksize];
        let mut largest = 0f64;
        for (i, row) in float.chunks_exact_mut(ksize).enumerate() {
            let center = scale * (i as f64 + 0.5);
            // C++ casts to int64 truncate towards zero.
            let xmin = ((center - support + 0.5) as i64).max(0);
            let xmax = ((center + support + 0.5) as i64).min(in_size as i64);
            let len = (xmax - xmin).clamp(0, ksize as i64) as usize;
            let mut total = 0f64;
            for (j, w) in row.iter_mut().enumerate().take(len) {
                *w = bicubic(((j as i64 + xmin) as f64 - center + 0.5) * inverse);
                total += *w;
            }
            if total != 0.0 {
                for w in row.iter_mut().take(len) {
                    *w /= total;
                    largest = largest.max(*w);
                }
            }
            starts.push(xmin as usize);
            lens.push(len);
        }
        // The most bits for which the largest weight, doubled, still fits in i16.
        let mut precision = 0;
        while precision < 22 {
            let next = (0.5 + largest * f64::from(1u32 << (precision + 1))) as i32;
            if next >= 1 << 15 {
                break;
            }
            precision += 1;
        }
        let weights = float
            .iter()
            .map(|&w| {
                let v = w * f64::from(1u32 << precision);
                if v < 0.0 {
                    (-0.5 + v) as i32
                } else {
                    (0.5 + v) as i32
                }
            })
            .collect();
        Self {
            starts,
            lens,
            ksize,
            weights,
            precision,
        }
    }

    fn taps(&self, i: usize) -> (usize, &[i32]) {
        let row = &self.weights[i * self.ksize..i * self.ksize + self.lens[i]];
        (self.starts[i], row)
    }

    /// One output value: the rounded fixed-point sum of the taps, clamped to u8.
    fn sum(&self, taps: impl Iterator<Item = (i32, u8)>) -> u8 {
        let rounding = (1i32 << self.precision) >> 1;
        let acc = taps.fold(rounding, |acc, (w, p)| acc + w * i32::from(p));
        (acc >> self.precision).clamp(0, 255) as u8
    }
}
