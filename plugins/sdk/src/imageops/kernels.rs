//! The inner loops of the two resize passes (Pillow's i32 sums of u8 × fixed-point weight products,
//! rounded and clamped) and of the patch layout (splitting RGB rows into channels, moving runs).
//! Built for wasm with SIMD, each sum runs four (horizontal: R, G, B and a pad byte) or sixteen
//! (vertical: adjacent bytes of a row) lanes at a time; elsewhere they are plain loops. The compiler
//! does not vectorise these by itself for wasm (it leaves them scalar), so the SIMD is written out.
//! Both compute exactly the same results.

#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
pub use portable::*;
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
pub use simd::*;

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
mod simd {
    use super::super::resample::{PRECISION_BITS, ROUNDING};
    use core::arch::wasm32::*;

    /// Output bytes one call of [`vertical`] produces.
    pub const BLOCK: usize = 16;

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
    pub type Wide = v128;

    /// A zero [`Wide`], to size buffers with.
    pub const WIDE_ZERO: Wide = u32x4(0, 0, 0, 0);

    /// Widens the packed RGB pixels of `row` into `out`, once per source row: every output pixel
    /// under a pixel's taps (about four each) then reads it widened already.
    #[inline]
    pub fn widen_rgb(row: &[u8], out: &mut [Wide]) {
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
    pub fn horizontal(pixels: &[Wide], kk: &[i32]) -> [u8; 4] {
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
    pub fn horizontal_fixed<const K: usize>(pixels: &[Wide; K], kk: &[i32; K]) -> [u8; 4] {
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
    pub fn vertical(rows: &[&[u8]], x: usize, kk: &[i32], out: &mut [u8]) {
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

    /// Splits packed RGB `row` into its three channel rows, 16 pixels (three loads, six shuffles)
    /// at a time.
    pub fn deinterleave_rgb(row: &[u8], [r, g, b]: [&mut [u8]; 3]) {
        let pixels = row.len() / 3;
        let whole = pixels - pixels % BLOCK;
        for x in (0..whole).step_by(BLOCK) {
            let at = 3 * x;
            let (p0, p1, p2) = (
                load16(&row[at..]),
                load16(&row[at + 16..]),
                load16(&row[at + 32..]),
            );
            let red = i8x16_shuffle::<0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 17, 20, 23, 26, 29>(
                i8x16_shuffle::<0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 0, 0, 0, 0, 0>(p0, p1),
                p2,
            );
            let green = i8x16_shuffle::<0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 18, 21, 24, 27, 30>(
                i8x16_shuffle::<1, 4, 7, 10, 13, 16, 19, 22, 25, 28, 31, 0, 0, 0, 0, 0>(p0, p1),
                p2,
            );
            let blue = i8x16_shuffle::<0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 19, 22, 25, 28, 31>(
                i8x16_shuffle::<2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 0, 0, 0, 0, 0, 0>(p0, p1),
                p2,
            );
            store16(red, &mut r[x..x + BLOCK]);
            store16(green, &mut g[x..x + BLOCK]);
            store16(blue, &mut b[x..x + BLOCK]);
        }
        for (x, px) in row.chunks_exact(3).enumerate().skip(whole) {
            (r[x], g[x], b[x]) = (px[0], px[1], px[2]);
        }
    }

    /// `dst[..len] = run[..len]`, with one 16-byte move when that may spill past `len` (wasm's
    /// `memory.copy` is a call out of the sandbox: too dear for runs of 14 bytes), else with two
    /// overlapping 8-byte ones for 8 <= len <= 16.
    #[inline]
    pub fn copy_run(run: &[u8], len: usize, dst: &mut [u8], may_spill: bool) {
        if len <= BLOCK && run.len() >= BLOCK && dst.len() >= BLOCK && may_spill {
            store16(load16(run), dst);
        } else if (8..=BLOCK).contains(&len) {
            let tail = len - 8;
            let (head, end) = (load8(&run[..8]), load8(&run[tail..len]));
            dst[..8].copy_from_slice(&head);
            dst[tail..len].copy_from_slice(&end);
        } else {
            dst[..len].copy_from_slice(&run[..len]);
        }
    }

    #[inline]
    fn load8(bytes: &[u8]) -> [u8; 8] {
        let mut word = [0u8; 8];
        word.copy_from_slice(&bytes[..8]);
        word
    }

    #[inline]
    fn store16(v: v128, out: &mut [u8]) {
        out[..8].copy_from_slice(&u64x2_extract_lane::<0>(v).to_le_bytes());
        out[8..16].copy_from_slice(&u64x2_extract_lane::<1>(v).to_le_bytes());
    }
}

#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
mod portable {
    use super::super::resample::{ROUNDING, clip8};

    pub const BLOCK: usize = 16;

    pub type Wide = [i32; 4];

    pub const WIDE_ZERO: Wide = [0; 4];

    #[inline]
    pub fn widen_rgb(row: &[u8], out: &mut [Wide]) {
        for (wide, px) in out.iter_mut().zip(row.chunks_exact(3)) {
            *wide = [i32::from(px[0]), i32::from(px[1]), i32::from(px[2]), 0];
        }
    }

    #[inline]
    pub fn horizontal(pixels: &[Wide], kk: &[i32]) -> [u8; 4] {
        let mut acc = [ROUNDING; 4];
        for (&k, px) in kk.iter().zip(pixels) {
            for (a, &p) in acc.iter_mut().zip(px) {
                *a += p * k;
            }
        }
        acc.map(clip8)
    }

    #[inline]
    pub fn horizontal_fixed<const K: usize>(pixels: &[Wide; K], kk: &[i32; K]) -> [u8; 4] {
        horizontal(pixels, kk)
    }

    #[inline]
    pub fn vertical(rows: &[&[u8]], x: usize, kk: &[i32], out: &mut [u8]) {
        let mut acc = [ROUNDING; BLOCK];
        for (&k, row) in kk.iter().zip(rows) {
            for (a, &p) in acc.iter_mut().zip(&row[x..x + BLOCK]) {
                *a += i32::from(p) * k;
            }
        }
        for (o, a) in out.iter_mut().zip(acc) {
            *o = clip8(a);
        }
    }

    #[inline]
    pub fn copy_run(run: &[u8], len: usize, dst: &mut [u8], _may_spill: bool) {
        dst[..len].copy_from_slice(&run[..len]);
    }

    pub fn deinterleave_rgb(row: &[u8], [r, g, b]: [&mut [u8]; 3]) {
        for (((px, r), g), b) in row.chunks_exact(3).zip(r).zip(g).zip(b) {
            (*r, *g, *b) = (px[0], px[1], px[2]);
        }
    }
}
