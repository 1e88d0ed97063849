//! torchvision's antialiased bicubic resize on u8 images, for video frames.

use super::resample::bicubic;
use super::{CHANNELS, RgbImage};

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
