//! The kernels in Wasm SIMD128 (see the module docs of `kernels`): each sum runs four lanes
//! (horizontal: R, G, B and a pad byte) or sixteen (vertical: adjacent bytes of a row) at a time.

use crate::fixed::{PRECISION_BITS, ROUNDING};
use core::arch::wasm32::*;

/// Output bytes one call of [`vertical`] produces.
pub(crate) const BLOCK: usize = 16;

/// Lanes 0..4 of `v`, clamped to u8 after the fixed-point shift (the saturating narrows are
/// Pillow's clip to 0..=255).
#[inline]
fn narrow(a: v128, b: v128, c: v128, d: v128) -> v128 {
    let shift = |v| i32x4_shr(v, PRECISION_BITS);
    u8x16_narrow_i16x8(
        i16x8_narrow_i32x4(shift(a), shift(b)),
        i16x8_narrow_i32x4(shift(c), shift(d)),
    )
}

/// A source pixel widened for the horizontal pass: R, G, B and a fourth lane that is never
/// read back, one i32 lane each, so that a tap is one multiply-add.
pub(crate) type Wide = v128;

/// A zero [`Wide`], to size buffers with.
pub(crate) const WIDE_ZERO: Wide = u32x4(0, 0, 0, 0);

/// Widens the packed RGB pixels of `row` into `out`, once per source row: every output pixel
/// under a pixel's taps (about four each) then reads it widened already.
#[inline]
pub(crate) fn widen_rgb(row: &[u8], out: &mut [Wide]) {
    let pixels = (row.len() / 3).min(out.len());
    // Four bytes from each pixel (its RGB and the next one's red, which lands in the unread
    // lane); the last pixel has no next one and is read alone.
    let whole = pixels.saturating_sub(1);
    for (x, wide) in out[..whole].iter_mut().enumerate() {
        let mut word = [0u8; 4];
        word.copy_from_slice(&row[3 * x..3 * x + 4]);
        let bytes = u32x4_splat(u32::from_le_bytes(word));
        *wide = u32x4_extend_low_u16x8(u16x8_extend_low_u8x16(bytes));
    }
    if let (Some(last), Some(px)) = (out[..pixels].last_mut(), row.chunks_exact(3).nth(whole)) {
        *last = u32x4(u32::from(px[0]), u32::from(px[1]), u32::from(px[2]), 0);
    }
}

/// One output pixel: Σ_j kk[j] · pixels[j], per channel (lanes 0..3 of the result).
#[inline]
pub(crate) fn horizontal(pixels: &[Wide], kk: &[i32]) -> [u8; 4] {
    let mut acc = i32x4_splat(ROUNDING);
    for (&k, &px) in kk.iter().zip(pixels) {
        acc = i32x4_add(acc, i32x4_mul(px, i32x4_splat(k)));
    }
    let packed = narrow(acc, acc, acc, acc);
    u32x4_extract_lane::<0>(packed).to_le_bytes()
}

/// [`horizontal`] with exactly `K` taps (the weights zero past the pixel's own count), so the
/// loop unrolls: most output pixels of a row have the axis' full kernel size.
#[inline]
pub(crate) fn horizontal_fixed<const K: usize>(pixels: &[Wide; K], kk: &[i32; K]) -> [u8; 4] {
    let mut even = i32x4_splat(ROUNDING);
    let mut odd = i32x4_splat(0);
    for j in 0..K {
        let product = i32x4_mul(pixels[j], i32x4_splat(kk[j]));
        if j % 2 == 0 {
            even = i32x4_add(even, product);
        } else {
            odd = i32x4_add(odd, product);
        }
    }
    let acc = i32x4_add(even, odd);
    let packed = narrow(acc, acc, acc, acc);
    u32x4_extract_lane::<0>(packed).to_le_bytes()
}

#[inline]
fn load16(bytes: &[u8]) -> v128 {
    let half = |i: usize| {
        let mut word = [0u8; 8];
        word.copy_from_slice(&bytes[i..i + 8]);
        u64::from_le_bytes(word)
    };
    u64x2(half(0), half(8))
}

/// `out` (16 bytes) = Σ_j kk[j] · rows[j][x..x + 16].
#[inline]
pub(crate) fn vertical(rows: &[&[u8]], x: usize, kk: &[i32], out: &mut [u8]) {
    let mut acc = [i32x4_splat(ROUNDING); 4];
    for (&k, row) in kk.iter().zip(rows) {
        let bytes = load16(&row[x..x + BLOCK]);
        let (low, high) = (
            u16x8_extend_low_u8x16(bytes),
            u16x8_extend_high_u8x16(bytes),
        );
        let k = i32x4_splat(k);
        let lanes = [
            u32x4_extend_low_u16x8(low),
            u32x4_extend_high_u16x8(low),
            u32x4_extend_low_u16x8(high),
            u32x4_extend_high_u16x8(high),
        ];
        for (a, v) in acc.iter_mut().zip(lanes) {
            *a = i32x4_add(*a, i32x4_mul(v, k));
        }
    }
    store16(narrow(acc[0], acc[1], acc[2], acc[3]), out);
}

#[inline]
fn store16(v: v128, out: &mut [u8]) {
    out[..8].copy_from_slice(&u64x2_extract_lane::<0>(v).to_le_bytes());
    out[8..16].copy_from_slice(&u64x2_extract_lane::<1>(v).to_le_bytes());
}
