//! The inner loops of the two resize passes (Pillow's i32 sums of u8 × fixed-point weight products,
//! rounded and clamped) and of the patch layout (splitting RGB rows into channels, moving runs).
//! Built for wasm with SIMD, each sum runs four (horizontal: R, G, B and a pad byte) or sixteen
//! (vertical: adjacent bytes of a row) lanes at a time; elsewhere they are plain loops. The compiler
//! does not vectorise these by itself for wasm (it leaves them scalar), so the SIMD is written out.
//! Both compute exactly the same results.

// Pillow's fixed-point arithmetic, shared by these kernels and `resample`'s scalar code: it lives
// here so that `resample` builds on the kernels and nothing here reaches back up.

/// Pillow's fixed-point precision for 8-bit resampling (32 - 8 - 2).
pub(super) const PRECISION_BITS: u32 = 22;

// Accumulators are i32 as in Pillow: with weights normalised to 2^22, |sum| < 2^31 for u8 input.
#[inline]
pub(super) fn clip8(acc: i32) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}

pub(super) const ROUNDING: i32 = 1 << (PRECISION_BITS - 1);

#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
pub use portable::*;
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
pub use simd::*;

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
mod simd {
    use super::{PRECISION_BITS, ROUNDING};
    use core::arch::wasm32::*;
    use core::mem::MaybeUninit;

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

    /// The 16 packed RGB pixels of three consecutive vectors split into their channels (six
    /// shuffles).
    #[inline]
    fn split(p0: v128, p1: v128, p2: v128) -> [v128; 3] {
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
        [red, green, blue]
    }

    /// The first 16 packed RGB pixels of `px` (48 bytes or more) split into their channels.
    #[inline]
    pub fn split_rgb16(px: &[u8]) -> [[u8; BLOCK]; 3] {
        let channels = split(load16(px), load16(&px[16..]), load16(&px[32..]));
        channels.map(|v| {
            let mut out = [0u8; BLOCK];
            store16(v, &mut out);
            out
        })
    }

    /// Writes one patch row of Qwen2-VL's layout to the first `3 * frames.len() * patch * patch`
    /// bytes of `dst` (every one of them): for each channel, for each temporal slot t, the `patch`
    /// rows of `patch` pixels that start at `frames[t]` (packed RGB rows `stride` bytes apart).
    /// Each row of a patch is three loads, six shuffles and three stores straight into `dst`: a
    /// store spills past its row onto the next row of the same channel
    /// slot, which is written after it; a slot's last row is stored exactly. (Safe slices cost
    /// much more here: a bounds check on every move, and the row staged twice.)
    /// `false`, with nothing written, where this path does not apply: `patch` outside 8..=16, a
    /// frame without 16 pixels readable from its last row's start (the rightmost patch of a
    /// band's last row) or a short `dst`; the caller then lays the row out itself.
    pub fn write_patch_row(
        frames: &[&[u8]],
        stride: usize,
        patch: usize,
        dst: &mut [MaybeUninit<u8>],
    ) -> bool {
        if !(8..=BLOCK).contains(&patch) {
            return false;
        }
        let readable = (patch - 1) * stride + 3 * BLOCK;
        if frames.iter().any(|frame| frame.len() < readable) {
            return false;
        }
        let area = patch * patch;
        let slots = frames.len();
        let row_len = 3 * slots * area;
        if dst.len() < row_len {
            return false;
        }
        let base = dst.as_mut_ptr().cast::<u8>();
        // The last row's bytes patch-8..patch moved down to the first eight lanes.
        let tail = patch as u8 - 8;
        let tail_lanes = u8x16(
            tail,
            tail + 1,
            tail + 2,
            tail + 3,
            tail + 4,
            tail + 5,
            tail + 6,
            tail + 7,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
        );
        for (t, frame) in frames.iter().enumerate() {
            for y in 0..patch {
                // SAFETY: `frame` holds at least `readable` bytes, so the 48 from row y's start
                // (y < patch) are within it; wasm loads need no alignment.
                let channels = unsafe {
                    let row = frame.as_ptr().add(y * stride);
                    split(
                        v128_load(row.cast()),
                        v128_load(row.add(BLOCK).cast()),
                        v128_load(row.add(2 * BLOCK).cast()),
                    )
                };
                for (c, v) in channels.into_iter().enumerate() {
                    let at = (c * slots + t) * area + y * patch;
                    // SAFETY: `dst` holds at least `row_len` bytes from `base`. Rows before
                    // the last store 16 bytes from `at`, at most (patch - 2) * patch + 16 <= area
                    // (patch >= 8) bytes into the slot, so within it; the last row stores bytes
                    // 0..8 and patch-8..patch of its own row. Every byte of the slot is written.
                    unsafe {
                        let dst = base.add(at);
                        if y + 1 < patch {
                            v128_store(dst.cast(), v);
                        } else {
                            v128_store64_lane::<0>(v, dst.cast());
                            v128_store64_lane::<0>(
                                i8x16_swizzle(v, tail_lanes),
                                dst.add(usize::from(tail)).cast(),
                            );
                        }
                    }
                }
            }
        }
        true
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
    use super::{ROUNDING, clip8};
    use core::mem::MaybeUninit;

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

    /// Natively the caller's own loops lay every patch row out.
    pub fn write_patch_row(
        _frames: &[&[u8]],
        _stride: usize,
        _patch: usize,
        _dst: &mut [MaybeUninit<u8>],
    ) -> bool {
        false
    }

    #[inline]
    pub fn split_rgb16(px: &[u8]) -> [[u8; BLOCK]; 3] {
        let mut out = [[0u8; BLOCK]; 3];
        for (x, px) in px.chunks_exact(3).take(BLOCK).enumerate() {
            (out[0][x], out[1][x], out[2][x]) = (px[0], px[1], px[2]);
        }
        out
    }
}
