//! The inner loops of the patch layout (splitting RGB rows into channels, moving runs). Built for
//! wasm with SIMD, they move sixteen bytes at a time; elsewhere they are plain loops. The compiler
//! does not vectorise these by itself for wasm (it leaves them scalar), so the SIMD is written out.
//! Both compute exactly the same results. (The resize's kernels are `mmgate-resample`'s.)

#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
pub use portable::*;
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
pub use simd::*;

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
mod simd {
    use core::arch::wasm32::*;
    use core::mem::MaybeUninit;

    /// Bytes one SIMD move carries.
    pub const BLOCK: usize = 16;

    /// The first 16 bytes of `bytes` (which holds at least that many).
    #[inline]
    fn load16(bytes: &[u8]) -> v128 {
        let first = &bytes[..BLOCK];
        // SAFETY: `first` is 16 readable bytes; wasm loads need no alignment.
        unsafe { v128_load(first.as_ptr().cast()) }
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
    use core::mem::MaybeUninit;

    pub const BLOCK: usize = 16;

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
