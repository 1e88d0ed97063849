//! Image operations shared by image-like plugins, on packed RGB8 buffers (row-major, 3 bytes a pixel).
//!
//! The resampler reproduces Pillow's `Image.resize(..., BICUBIC | BILINEAR)` on 8-bit images, because
//! that is what HF processors run: a separable convolution (horizontal pass, then vertical) whose
//! support widens with the downscale factor (so downsampling is antialiased), Keys' cubic with
//! a = -0.5 or the triangle filter, weights normalised per output pixel then turned into 22-bit fixed
//! point, and each pass rounded and clamped back to u8.

/// Bytes per RGB pixel.
const CHANNELS: usize = 3;
/// Pillow's fixed-point precision for 8-bit resampling (32 - 8 - 2).
const PRECISION_BITS: u32 = 22;

/// A resampling filter, as Pillow defines it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filter {
    /// `Image.BILINEAR` (2): the triangle filter, support 1.
    Bilinear,
    /// `Image.BICUBIC` (3): Keys' cubic with a = -0.5, support 2.
    Bicubic,
}

impl Filter {
    /// The filter for a PIL resample code (as HF configs store it), if it is one this crate has.
    pub fn from_pil_code(code: u32) -> Option<Filter> {
        match code {
            2 => Some(Filter::Bilinear),
            3 => Some(Filter::Bicubic),
            _ => None,
        }
    }

    /// Support radius at scale 1.
    fn support(self) -> f64 {
        match self {
            Filter::Bilinear => 1.0,
            Filter::Bicubic => 2.0,
        }
    }

    fn weight(self, x: f64) -> f64 {
        match self {
            Filter::Bilinear => {
                let x = x.abs();
                if x < 1.0 { 1.0 - x } else { 0.0 }
            }
            Filter::Bicubic => bicubic(x),
        }
    }
}

/// A packed RGB8 image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage {
    pub width: usize,
    pub height: usize,
    /// `width * height * 3` bytes.
    pub data: Vec<u8>,
}

fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// For each output index along one axis: the first input index and the fixed-point weights.
struct AxisWeights {
    starts: Vec<usize>,
    /// `ksize` weights per output index (zero-padded).
    weights: Vec<i32>,
    ksize: usize,
}

fn axis_weights(in_size: usize, out_size: usize, filter: Filter) -> AxisWeights {
    let scale = in_size as f64 / out_size as f64;
    let filter_scale = scale.max(1.0);
    let support = filter.support() * filter_scale;
    // Pillow multiplies by the reciprocal; dividing instead can differ in the last bit.
    let inverse_scale = 1.0 / filter_scale;
    let ksize = support.ceil() as usize * 2 + 1;
    let mut starts = Vec::with_capacity(out_size);
    let mut weights = vec![0i32; out_size * ksize];
    let mut row = vec![0f64; ksize];
    for (xx, kk) in weights.chunks_exact_mut(ksize).enumerate() {
        let center = (xx as f64 + 0.5) * scale;
        // Pillow truncates towards zero here; both values are >= -0.5 + 0.5 so `as` matches.
        let xmin = ((center - support + 0.5).max(0.0)) as usize;
        let xmax = (((center + support + 0.5) as usize).min(in_size)).saturating_sub(xmin);
        let mut total = 0.0;
        for (x, w) in row.iter_mut().enumerate().take(xmax) {
            *w = filter.weight((x as f64 + xmin as f64 - center + 0.5) * inverse_scale);
            total += *w;
        }
        for (x, k) in kk.iter_mut().enumerate().take(xmax) {
            let w = if total != 0.0 { row[x] / total } else { 0.0 };
            let fixed = w * f64::from(1u32 << PRECISION_BITS);
            *k = if fixed < 0.0 {
                (fixed - 0.5) as i32
            } else {
                (fixed + 0.5) as i32
            };
        }
        starts.push(xmin);
    }
    AxisWeights {
        starts,
        weights,
        ksize,
    }
}

// Accumulators are i32 as in Pillow: with weights normalised to 2^22, |sum| < 2^31 for u8 input.
#[inline]
fn clip8(acc: i32) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}

const ROUNDING: i32 = 1 << (PRECISION_BITS - 1);

fn resample_horizontal(src: &RgbImage, out_width: usize, filter: Filter) -> RgbImage {
    let axis = axis_weights(src.width, out_width, filter);
    let mut data = vec![0u8; out_width * src.height * CHANNELS];
    let in_row = src.width * CHANNELS;
    // Each source row is widened to 4 bytes a pixel first, so a tap is one 4-lane multiply-add
    // (which the compiler vectorises, natively and to wasm SIMD) instead of three scalar ones.
    let mut padded = vec![0u8; src.width * 4];
    for (y, out_row) in data.chunks_exact_mut(out_width * CHANNELS).enumerate() {
        let row = &src.data[y * in_row..(y + 1) * in_row];
        for (p, s) in padded.chunks_exact_mut(4).zip(row.chunks_exact(CHANNELS)) {
            p[..CHANNELS].copy_from_slice(s);
        }
        for (xx, out) in out_row.chunks_exact_mut(CHANNELS).enumerate() {
            let start = axis.starts[xx];
            let kk = &axis.weights[xx * axis.ksize..(xx + 1) * axis.ksize];
            let mut acc = [ROUNDING; 4];
            for (k, px) in kk.iter().zip(padded[start * 4..].chunks_exact(4)) {
                for (a, &p) in acc.iter_mut().zip(px) {
                    *a += i32::from(p) * k;
                }
            }
            for (o, &a) in out.iter_mut().zip(&acc) {
                *o = clip8(a);
            }
        }
    }
    RgbImage {
        width: out_width,
        height: src.height,
        data,
    }
}

fn resample_vertical(src: &RgbImage, out_height: usize, filter: Filter) -> RgbImage {
    let axis = axis_weights(src.height, out_height, filter);
    let row_len = src.width * CHANNELS;
    let mut data = vec![0u8; row_len * out_height];
    let mut acc = vec![0i32; row_len];
    for (yy, out_row) in data.chunks_exact_mut(row_len).enumerate() {
        let start = axis.starts[yy];
        let kk = &axis.weights[yy * axis.ksize..(yy + 1) * axis.ksize];
        acc.fill(ROUNDING);
        // Row-wise accumulation keeps the inner loop contiguous (and vectorisable).
        for (k, y) in kk.iter().zip(start..src.height) {
            let k = *k;
            if k == 0 {
                continue;
            }
            let row = &src.data[y * row_len..(y + 1) * row_len];
            for (a, &p) in acc.iter_mut().zip(row) {
                *a += i32::from(p) * k;
            }
        }
        for (o, &a) in out_row.iter_mut().zip(&acc) {
            *o = clip8(a);
        }
    }
    RgbImage {
        width: src.width,
        height: out_height,
        data,
    }
}

impl RgbImage {
    /// Resize like Pillow's `Image.resize((width, height), filter)` on an RGB image (which, like
    /// this, returns a copy when the size does not change).
    pub fn resize(&self, width: usize, height: usize, filter: Filter) -> RgbImage {
        let mut image = if width != self.width {
            resample_horizontal(self, width, filter)
        } else {
            self.clone()
        };
        if height != self.height {
            image = resample_vertical(&image, height, filter);
        }
        image
    }

    /// The `width` x `height` window whose top-left corner is (`left`, `top`); parts outside the
    /// image are black, as Pillow's `crop` does.
    pub fn crop(&self, left: isize, top: isize, width: usize, height: usize) -> RgbImage {
        let mut data = vec![0u8; width * height * CHANNELS];
        for y in 0..height {
            let sy = top + y as isize;
            if sy < 0 || sy as usize >= self.height {
                continue;
            }
            for x in 0..width {
                let sx = left + x as isize;
                if sx < 0 || sx as usize >= self.width {
                    continue;
                }
                let s = (sy as usize * self.width + sx as usize) * CHANNELS;
                let d = (y * width + x) * CHANNELS;
                data[d..d + CHANNELS].copy_from_slice(&self.data[s..s + CHANNELS]);
            }
        }
        RgbImage {
            width,
            height,
            data,
        }
    }
}

/// OpenAI CLIP's normalisation (HF's OPENAI_CLIP_MEAN / OPENAI_CLIP_STD), Qwen2-VL's too.
pub const CLIP_MEAN: [f32; 3] = [0.481_454_66, 0.457_827_5, 0.408_210_73];
// Written exactly as HF's OPENAI_CLIP_STD so the two can be compared by eye.
#[allow(clippy::excessive_precision)]
pub const CLIP_STD: [f32; 3] = [0.268_629_54, 0.261_302_58, 0.275_777_11];

/// Per-channel `(x * rescale - mean) / std`, done as HF does it: rescale in f64 then cast to f32,
/// normalise in f32.
#[derive(Debug, Clone, Copy)]
pub struct Normalize {
    pub rescale: f64,
    pub mean: [f32; 3],
    pub std: [f32; 3],
}

impl Normalize {
    /// A lookup table per channel: 256 entries, so normalising is one load per byte.
    pub fn table(&self) -> [[f32; 256]; 3] {
        let mut table = [[0f32; 256]; 3];
        for (c, channel) in table.iter_mut().enumerate() {
            for (v, out) in channel.iter_mut().enumerate() {
                let rescaled = (v as f64 * self.rescale) as f32;
                *out = (rescaled - self.mean[c]) / self.std[c];
            }
        }
        table
    }

    /// [`Normalize::table`] as little-endian bytes, for writing f32 tensors without a second copy.
    pub fn table_le_bytes(&self) -> [[[u8; 4]; 256]; 3] {
        self.table().map(|channel| channel.map(f32::to_le_bytes))
    }
}

/// Qwen2-VL's patch layout of one image repeated over `temporal` frames (HF: `np.tile` of a single
/// image to `temporal_patch_size` frames). See [`qwen2vl_frame_patches`].
pub fn qwen2vl_patches<T: Copy>(
    image: &RgbImage,
    patch: usize,
    merge: usize,
    temporal: usize,
    map: impl Fn(usize, u8) -> T,
) -> Vec<T> {
    let frames = vec![image; temporal];
    let mut out = Vec::new();
    qwen2vl_frame_patches(&frames, patch, merge, map, &mut out);
    out
}

/// Qwen2-VL's patch layout of one temporal group of frames (a video's `temporal_patch_size`
/// consecutive frames, all the same size), appended to `out` as rows of
/// `3 * frames.len() * patch * patch` values: reshape (t, tp, C, gh/m, m, p, gw/m, m, p) → transpose
/// (0,3,6,4,7,2,1,5,8), i.e. per patch: channel, then frame, then the patch's pixels.
///
/// Frames must have dimensions divisible by `patch * merge`. Values are written through `map`, so the
/// same walk emits normalised floats or raw bytes. A frame repeated (the same reference twice, as an
/// image's temporal copies are) is copied rather than mapped again.
pub fn qwen2vl_frame_patches<T: Copy>(
    frames: &[&RgbImage],
    patch: usize,
    merge: usize,
    map: impl Fn(usize, u8) -> T,
    out: &mut Vec<T>,
) {
    let Some(first_frame) = frames.first() else {
        return;
    };
    let (width, height) = (first_frame.width, first_frame.height);
    let (gh, gw) = (height / patch, width / patch);
    out.reserve(gh * gw * CHANNELS * frames.len() * patch * patch);
    for bh in 0..gh / merge {
        for bw in 0..gw / merge {
            for mh in 0..merge {
                for mw in 0..merge {
                    let py = (bh * merge + mh) * patch;
                    let px = (bw * merge + mw) * patch;
                    for c in 0..CHANNELS {
                        for (t, frame) in frames.iter().enumerate() {
                            let start = out.len();
                            if t > 0 && std::ptr::eq(*frame, frames[t - 1]) {
                                let previous = start - patch * patch;
                                out.extend_from_within(previous..start);
                                continue;
                            }
                            for y in 0..patch {
                                let base = ((py + y) * width + px) * CHANNELS;
                                let row = &frame.data[base..base + patch * CHANNELS];
                                out.extend(
                                    row.iter().skip(c).step_by(CHANNELS).map(|&v| map(c, v)),
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_sum_to_one_in_fixed_point() {
        for (input, output) in [(100, 37), (37, 100), (1000, 28), (3, 3)] {
            let axis = axis_weights(input, output, Filter::Bicubic);
            for kk in axis.weights.chunks_exact(axis.ksize) {
                let sum: i64 = kk.iter().map(|&k| i64::from(k)).sum();
                assert!(
                    (sum - (1 << PRECISION_BITS)).abs() <= axis.ksize as i64,
                    "{sum}"
                );
            }
        }
    }

    #[test]
    fn constant_image_stays_constant() {
        let image = RgbImage {
            width: 50,
            height: 30,
            data: [10u8, 200, 77].repeat(50 * 30),
        };
        let resized = image.resize(17, 61, Filter::Bicubic);
        assert!(resized.data.chunks_exact(3).all(|p| p == [10, 200, 77]));
    }
}
