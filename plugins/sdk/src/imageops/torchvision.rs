//! torchvision's antialiased bicubic resize on u8 images, for video frames, in both of the ways
//! torchvision runs it: through `torchvision.transforms.functional` (qwen-vl-utils), which resizes
//! a float copy; and through `torchvision.transforms.v2.functional` (transformers' video
//! processors), which hands the u8 tensor to PyTorch's native u8 kernel. Both are one separable
//! resize ([`separable`]) over the lanes of [`super::lanes`], f32 or fixed point.

use super::lanes::{Fixed, Float, Lanes};
use super::{CHANNELS, RgbImage};
use mmgate_resample::bicubic;

/// Resize as torchvision's `F.resize(uint8 tensor, size, BICUBIC, antialias=True)` does (what
/// qwen-vl-utils runs on video frames): PyTorch's separable antialiased bicubic (Keys a = -0.5, support
/// widened by the downscale factor, weights normalised per output pixel) computed in f32 with no
/// rounding between the passes (width first, then height; an unchanged axis is skipped), then clamped
/// and rounded half to even back to u8. Unlike Pillow's 8-bit path there is no fixed point. Each
/// value is its taps' products added in order, as torch's kernel adds them.
pub fn resize_like_torchvision(image: &RgbImage, width: usize, height: usize) -> RgbImage {
    let taps = |from, to| {
        let axis = float_axis_weights(from, to);
        Taps::<Float>::new((axis.starts, axis.lens, axis.ksize), &axis.weights, 0.0, 0)
    };
    separable(image, (width, height), taps)
}

/// Resize as `torchvision.transforms.v2.functional.resize(uint8 tensor, size, BICUBIC,
/// antialias=True)` does (transformers' `Qwen3VLVideoProcessor`): PyTorch's native u8 kernel, a
/// port of Pillow-SIMD's. The antialiased bicubic weights are computed in f64 as for floats, then
/// turned into i16 fixed point at the largest precision that keeps the axis's largest weight
/// within i16; each pass (width first, then height; an unchanged axis is skipped) accumulates in
/// i32 and is rounded and clamped back to u8. Up to 8 levels away from the float path
/// ([`resize_like_torchvision`]) on a 4x downscale.
pub fn resize_like_torch_uint8(image: &RgbImage, width: usize, height: usize) -> RgbImage {
    let taps = |from, to| {
        let axis = Int16AxisWeights::new(from, to);
        let rounding = f64::from((1i32 << axis.precision) >> 1);
        Taps::<Fixed>::new(
            (axis.starts, axis.lens, axis.ksize),
            &axis.weights,
            rounding,
            axis.precision,
        )
    };
    separable(image, (width, height), taps)
}

/// One axis of a resize in `L`'s lanes: for each output index, its first input index and weights.
struct Taps<L: Lanes> {
    starts: Vec<usize>,
    lens: Vec<usize>,
    ksize: usize,
    weights: Vec<L::Weight>,
    /// A sum before its first tap.
    empty: L::Pixel,
    /// The bits a sum is shifted right by when narrowed to u8.
    shift: u32,
}

impl<L: Lanes> Taps<L> {
    /// The taps of an axis whose weights were computed as `weights` (each exact as an f64), with
    /// sums starting at `empty` and narrowed by `shift` bits.
    fn new<W: Copy + Into<f64>>(
        (starts, lens, ksize): (Vec<usize>, Vec<usize>, usize),
        weights: &[W],
        empty: f64,
        shift: u32,
    ) -> Self {
        Taps {
            starts,
            lens,
            ksize,
            weights: weights.iter().map(|&w| L::weight(w.into())).collect(),
            empty: L::splat(empty),
            shift,
        }
    }

    fn of(&self, i: usize) -> (usize, &[L::Weight]) {
        let row = &self.weights[i * self.ksize..i * self.ksize + self.lens[i]];
        (self.starts[i], row)
    }
}

/// A separable resize of `image` to `(width, height)`: the width pass, then the height pass, each
/// skipped where its axis keeps its size, with `taps(from, to)` the taps of an axis. The height
/// pass reads a few consecutive rows of the width pass for each output row: those are made once
/// each into a ring of rows that stays in cache, rather than into a whole image of lanes (four
/// times the bytes of the frame, written and read again).
fn separable<L: Lanes>(
    image: &RgbImage,
    (width, height): (usize, usize),
    taps: impl Fn(usize, usize) -> Taps<L>,
) -> RgbImage {
    if (image.width, image.height) == (width, height) {
        return image.clone();
    }
    if [image.width, image.height, width, height].contains(&0) {
        // No taps: every sum is empty.
        return RgbImage {
            width,
            height,
            data: vec![0; width * height * CHANNELS],
        };
    }
    let across = (image.width != width).then(|| taps(image.width, width));
    let src_row = image.width * CHANNELS;
    let mut widened = vec![L::splat(0.0); image.width];
    // One source row through the width pass into `out` (`width` pixels): its sums, or the source
    // pixels where the width is kept.
    let mut width_pass = |y: usize, out: &mut [L::Pixel]| {
        let (row, _) = image.data[y * src_row..(y + 1) * src_row].as_chunks::<CHANNELS>();
        match &across {
            None => {
                for (o, rgb) in out.iter_mut().zip(row) {
                    *o = L::widen(rgb);
                }
            }
            Some(across) => {
                for (w, rgb) in widened.iter_mut().zip(row) {
                    *w = L::widen(rgb);
                }
                for (x, o) in out.iter_mut().enumerate() {
                    let (start, weights) = across.of(x);
                    *o = tap_sum::<L>(
                        across.empty,
                        &widened[start..start + weights.len()],
                        weights,
                    );
                }
            }
        }
    };
    let across_shift = across.as_ref().map_or(0, |a| a.shift);
    let mut data = vec![0; width * height * CHANNELS];
    let out_rows = data.chunks_exact_mut(width * CHANNELS);
    if image.height == height {
        let mut row = vec![L::splat(0.0); width];
        for (y, out) in out_rows.enumerate() {
            width_pass(y, &mut row);
            store_rgb::<L>(&row, across_shift, out);
        }
        return RgbImage {
            width,
            height,
            data,
        };
    }
    let down = taps(image.height, height);
    let ring = down.ksize.max(1);
    let mut rows = vec![L::splat(0.0); ring * width];
    let mut held: Vec<Option<usize>> = vec![None; ring];
    let mut sums = vec![L::splat(0.0); width];
    for (y, out) in out_rows.enumerate() {
        let (start, weights) = down.of(y);
        for r in start..start + weights.len() {
            let slot = r % ring;
            if held[slot] != Some(r) {
                let row = &mut rows[slot * width..(slot + 1) * width];
                width_pass(r, row);
                if L::NARROWS_BETWEEN_PASSES && across.is_some() {
                    for p in row.iter_mut() {
                        *p = L::widen(&L::narrow(*p, across_shift));
                    }
                }
                held[slot] = Some(r);
            }
        }
        let taps: Vec<&[L::Pixel]> = (start..start + weights.len())
            .map(|r| &rows[(r % ring) * width..(r % ring + 1) * width])
            .collect();
        column_sums::<L>(down.empty, &taps, weights, &mut sums);
        store_rgb::<L>(&sums, down.shift, out);
    }
    RgbImage {
        width,
        height,
        data,
    }
}

/// `pixels` narrowed (see [`Lanes::narrow`]) and packed as RGB bytes into `out`.
fn store_rgb<L: Lanes>(pixels: &[L::Pixel], shift: u32, out: &mut [u8]) {
    let (out, _) = out.as_chunks_mut::<CHANNELS>();
    for (o, &p) in out.iter_mut().zip(pixels) {
        *o = L::narrow(p, shift);
    }
}

/// `empty` + Σ pixels[k] · weights[k], in order, for as many taps as `weights` has. Unrolled for
/// the tap counts of resizes by up to 2x: their loop's bookkeeping had cost more than its
/// multiply-adds.
#[inline]
fn tap_sum<L: Lanes>(empty: L::Pixel, pixels: &[L::Pixel], weights: &[L::Weight]) -> L::Pixel {
    fn unrolled<L: Lanes, const K: usize>(
        empty: L::Pixel,
        pixels: &[L::Pixel],
        weights: &[L::Weight],
    ) -> Option<L::Pixel> {
        let (pixels, weights) = (pixels.first_chunk::<K>()?, weights.first_chunk::<K>()?);
        let mut acc = empty;
        for k in 0..K {
            acc = L::add_scaled(acc, pixels[k], weights[k]);
        }
        Some(acc)
    }
    let sum = match weights.len() {
        4 => unrolled::<L, 4>(empty, pixels, weights),
        5 => unrolled::<L, 5>(empty, pixels, weights),
        6 => unrolled::<L, 6>(empty, pixels, weights),
        7 => unrolled::<L, 7>(empty, pixels, weights),
        8 => unrolled::<L, 8>(empty, pixels, weights),
        9 => unrolled::<L, 9>(empty, pixels, weights),
        _ => None,
    };
    sum.unwrap_or_else(|| {
        pixels
            .iter()
            .zip(weights)
            .fold(empty, |acc, (&p, &wk)| L::add_scaled(acc, p, wk))
    })
}

/// One output row of the height pass into `out`: for each column x, `empty` + Σ rows[k][x] ·
/// weights[k] in order (the rows as long as `out`, as many as `weights`). Unrolled as
/// [`tap_sum`] is.
fn column_sums<L: Lanes>(
    empty: L::Pixel,
    rows: &[&[L::Pixel]],
    weights: &[L::Weight],
    out: &mut [L::Pixel],
) {
    fn unrolled<L: Lanes, const K: usize>(
        empty: L::Pixel,
        rows: &[&[L::Pixel]],
        weights: &[L::Weight],
        out: &mut [L::Pixel],
    ) -> bool {
        let (Some(rows), Some(weights)) = (rows.first_chunk::<K>(), weights.first_chunk::<K>())
        else {
            return false;
        };
        let w = out.len();
        if rows.iter().any(|r| r.len() < w) {
            return false;
        }
        let rows: [&[L::Pixel]; K] = rows.map(|r| &r[..w]);
        for (x, o) in out.iter_mut().enumerate() {
            let mut acc = empty;
            for k in 0..K {
                acc = L::add_scaled(acc, rows[k][x], weights[k]);
            }
            *o = acc;
        }
        true
    }
    let done = match weights.len() {
        4 => unrolled::<L, 4>(empty, rows, weights, out),
        5 => unrolled::<L, 5>(empty, rows, weights, out),
        6 => unrolled::<L, 6>(empty, rows, weights, out),
        7 => unrolled::<L, 7>(empty, rows, weights, out),
        8 => unrolled::<L, 8>(empty, rows, weights, out),
        9 => unrolled::<L, 9>(empty, rows, weights, out),
        _ => false,
    };
    if !done {
        for (x, o) in out.iter_mut().enumerate() {
            *o = rows
                .iter()
                .zip(weights)
                .fold(empty, |acc, (row, &wk)| L::add_scaled(acc, row[x], wk));
        }
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
    #[cfg(test)]
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

    #[cfg(test)]
    fn taps(&self, i: usize) -> (usize, &[i32]) {
        let row = &self.weights[i * self.ksize..i * self.ksize + self.lens[i]];
        (self.starts[i], row)
    }

    /// One output value: the rounded fixed-point sum of the taps, clamped to u8.
    #[cfg(test)]
    fn sum(&self, taps: impl Iterator<Item = (i32, u8)>) -> u8 {
        let rounding = (1i32 << self.precision) >> 1;
        let acc = taps.fold(rounding, |acc, (w, p)| acc + w * i32::from(p));
        (acc >> self.precision).clamp(0, 255) as u8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The float resize as first written: three channels a tap, straight from the RGB bytes.
    fn reference(image: &RgbImage, width: usize, height: usize) -> RgbImage {
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

    /// The u8 resize as first written, a channel at a time.
    ///
    /// The u8 resize as first written: a channel at a time, each pass into a whole image.
    fn reference_uint8(image: &RgbImage, width: usize, height: usize) -> RgbImage {
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

    fn noise(width: usize, height: usize, seed: u32) -> RgbImage {
        let mut state = seed.wrapping_mul(2_654_435_761).max(1);
        let data = (0..width * height * CHANNELS)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                (state >> 24) as u8
            })
            .collect();
        RgbImage {
            width,
            height,
            data,
        }
    }

    #[test]
    fn both_resizes_are_their_references_byte_for_byte() {
        let cases = [
            ((854, 480), (840, 476)),
            ((640, 360), (644, 364)),
            ((97, 61), (28, 56)),
            ((30, 20), (112, 84)),
            ((57, 40), (57, 28)),
            ((40, 57), (28, 57)),
            ((1, 1), (3, 2)),
            ((64, 200), (60, 20)),
            ((300, 90), (70, 30)),
        ];
        for (seed, ((w, h), (width, height))) in cases.into_iter().enumerate() {
            let image = noise(w, h, seed as u32 + 1);
            let ours = resize_like_torchvision(&image, width, height);
            let expected = reference(&image, width, height);
            assert_eq!((ours.width, ours.height), (width, height));
            assert!(ours.data == expected.data, "{w}x{h} -> {width}x{height}");
            let ours = resize_like_torch_uint8(&image, width, height);
            let expected = reference_uint8(&image, width, height);
            assert_eq!((ours.width, ours.height), (width, height));
            assert!(ours.data == expected.data, "u8 {w}x{h} -> {width}x{height}");
        }
    }
}
