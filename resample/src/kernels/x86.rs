//! The two passes' row loops in AVX2, for the host (see the module docs of `kernels`). Each is
//! the portable loop's arithmetic, in the same order: the bytes are the same.
//!
//! They need AVX2: an [`Avx2`] is the proof that this CPU has it, and the only way in.

#![allow(unsafe_code)]

use std::arch::x86_64::*;

use crate::fixed::{PRECISION_BITS, ROUNDING, clip8};

/// This CPU has AVX2: the kernels behind it may run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Avx2(());

impl Avx2 {
    /// `Some` on a CPU with AVX2 (the standard library caches the answer).
    pub(crate) fn detect() -> Option<Avx2> {
        is_x86_feature_detected!("avx2").then_some(Avx2(()))
    }

    /// One source row resampled horizontally into `out`: see [`horizontal_row`]. `padded` holds
    /// `ksize` zero pixels past the row's widened pixels.
    pub(crate) fn horizontal_row(
        self,
        src: &[u8],
        padded: &mut [[i32; 4]],
        (starts, weights, ksize): (&[usize], &[[i32; 8]], usize),
        out: &mut [u8],
    ) {
        let pairs = ksize.div_ceil(2);
        // SAFETY (each call): `self` exists only on a CPU with AVX2.
        unsafe {
            widen_rgb(src, padded);
            match pairs {
                3 => horizontal_row::<3>(padded, starts, weights, pairs, out),
                4 => horizontal_row::<4>(padded, starts, weights, pairs, out),
                5 => horizontal_row::<5>(padded, starts, weights, pairs, out),
                _ => horizontal_row::<0>(padded, starts, weights, pairs, out),
            }
        }
    }

    /// One output row of the vertical pass: see [`vertical_row`].
    pub(crate) fn vertical_row(self, rows: &[&[u8]], kk: &[i32], out: &mut [u8]) {
        // SAFETY: `self` exists only on a CPU with AVX2.
        unsafe { vertical_row(rows, kk, out) }
    }
}

/// Each output pixel's weights for [`horizontal_row`]: its taps in pairs, each pair one 256-bit
/// vector (the first tap's weight in the low four lanes, the second's in the high four; a missing
/// second tap weighs zero).
pub(crate) fn paired_weights(weights: &[i32], ksize: usize) -> Vec<[i32; 8]> {
    let pairs = ksize.div_ceil(2);
    let mut out = Vec::with_capacity(weights.len() / ksize.max(1) * pairs);
    for pixel in weights.chunks_exact(ksize.max(1)) {
        for pair in 0..pairs {
            let low = pixel[2 * pair];
            let high = pixel.get(2 * pair + 1).copied().unwrap_or(0);
            out.push([low, low, low, low, high, high, high, high]);
        }
    }
    out
}

/// `out` (packed RGB) = the source row widened in `padded` (one `[i32; 4]` a pixel, at least
/// `2 * PAIRS` zero pixels past its end) resampled: pixel `x` starts at `starts[x]` and has the
/// weights `weights[x * PAIRS..][..PAIRS]` ([`paired_weights`]). Each step multiplies two
/// adjacent source pixels (one 32-byte load) by their pair of weights. `PAIRS` is known at
/// compile time where the caller can (the loop then unrolls), else 0 and `pairs` says.
///
/// # Safety
/// The CPU has AVX2 ([`Avx2`]).
#[target_feature(enable = "avx2")]
unsafe fn horizontal_row<const PAIRS: usize>(
    padded: &[[i32; 4]],
    starts: &[usize],
    weights: &[[i32; 8]],
    pairs: usize,
    out: &mut [u8],
) {
    let pairs = if PAIRS == 0 { pairs } else { PAIRS };
    if pairs == 0 {
        return;
    }
    let pixels = (out.len() / 3).min(starts.len()).min(weights.len() / pairs);
    let padded_end = padded.len().saturating_sub(2 * pairs);
    for (x, (&start, kk)) in starts[..pixels]
        .iter()
        .zip(weights.chunks_exact(pairs))
        .enumerate()
    {
        if start > padded_end {
            continue;
        }
        // SAFETY: taps start..start + 2 * pairs are within `padded` (checked above).
        let first = unsafe { padded.as_ptr().add(start) };
        let mut acc = _mm256_setzero_si256();
        for (pair, k) in kk.iter().enumerate() {
            // SAFETY: tap 2 * pair and the next are two `[i32; 4]`, 32 contiguous readable
            // bytes within `padded`, and `k` is 32 bytes; unaligned loads.
            let (p, k) = unsafe {
                (
                    _mm256_loadu_si256(first.add(2 * pair).cast()),
                    _mm256_loadu_si256(k.as_ptr().cast()),
                )
            };
            acc = _mm256_add_epi32(acc, _mm256_mullo_epi32(p, k));
        }
        let sum = _mm_add_epi32(
            _mm_add_epi32(
                _mm256_castsi256_si128(acc),
                _mm256_extracti128_si256::<1>(acc),
            ),
            _mm_set1_epi32(ROUNDING),
        );
        let sum = _mm_srai_epi32::<{ PRECISION_BITS as i32 }>(sum);
        // i32 → i16 → u8 with saturation (Pillow's clip); the pixel in bytes 0..3.
        let rgbx =
            _mm_cvtsi128_si32(_mm_packus_epi16(_mm_packs_epi32(sum, sum), sum)).to_le_bytes();
        // Four bytes where the row has them (the fourth is the next pixel's, written after).
        match out.get_mut(3 * x..3 * x + 4) {
            Some(dst) => dst.copy_from_slice(&rgbx),
            None => out[3 * x..3 * x + 3].copy_from_slice(&rgbx[..3]),
        }
    }
}

/// Widens the packed RGB pixels of `row` into `out`, one `[i32; 4]` each (the fourth lane is
/// never read back).
///
/// # Safety
/// The CPU has AVX2 ([`Avx2`]).
#[target_feature(enable = "avx2")]
unsafe fn widen_rgb(row: &[u8], out: &mut [[i32; 4]]) {
    let pixels = (row.len() / 3).min(out.len());
    // Four bytes from each pixel (its RGB and the next one's red); the last pixel alone.
    let whole = pixels.saturating_sub(1);
    for (x, wide) in out[..whole].iter_mut().enumerate() {
        let mut word = [0u8; 4];
        word.copy_from_slice(&row[3 * x..3 * x + 4]);
        let lanes = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(i32::from_le_bytes(word)));
        // SAFETY: `wide` is 16 writable bytes; unaligned store.
        unsafe { _mm_storeu_si128(wide.as_mut_ptr().cast(), lanes) };
    }
    if let (Some(last), Some(px)) = (out[..pixels].last_mut(), row.chunks_exact(3).nth(whole)) {
        *last = [i32::from(px[0]), i32::from(px[1]), i32::from(px[2]), 0];
    }
}

/// Bytes one step of [`vertical_row`] makes.
const BLOCK: usize = 32;

/// `out` = Σ_j kk[j] · rows[j], bytewise, 32 bytes a step with their sums in registers.
///
/// # Safety
/// The CPU has AVX2 ([`Avx2`]).
#[target_feature(enable = "avx2")]
unsafe fn vertical_row(rows: &[&[u8]], kk: &[i32], out: &mut [u8]) {
    let len = out.len();
    if rows.len() < kk.len() || rows.iter().any(|row| row.len() < len) {
        return;
    }
    let whole = len - len % BLOCK;
    // Bytes 0..4 of each 32-bit lane of the two packs, back in order.
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for x in (0..whole).step_by(BLOCK) {
        let mut acc = [_mm256_set1_epi32(ROUNDING); 4];
        for (&k, row) in kk.iter().zip(rows) {
            let k = _mm256_set1_epi32(k);
            for (i, a) in acc.iter_mut().enumerate() {
                // SAFETY: x + 8 * i + 8 <= whole <= row.len(); unaligned 8-byte load.
                let bytes = unsafe { _mm_loadl_epi64(row.as_ptr().add(x + 8 * i).cast()) };
                *a = _mm256_add_epi32(*a, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(bytes), k));
            }
        }
        let shift = |v| _mm256_srai_epi32::<{ PRECISION_BITS as i32 }>(v);
        let low = _mm256_packs_epi32(shift(acc[0]), shift(acc[1]));
        let high = _mm256_packs_epi32(shift(acc[2]), shift(acc[3]));
        let bytes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(low, high), order);
        // SAFETY: x + 32 <= whole <= out.len(); unaligned store.
        unsafe { _mm256_storeu_si256(out.as_mut_ptr().add(x).cast(), bytes) };
    }
    for x in whole..len {
        let mut acc = ROUNDING;
        for (&k, row) in kk.iter().zip(rows) {
            acc += i32::from(row[x]) * k;
        }
        out[x] = clip8(acc);
    }
}
