//! One RGB pixel as four lanes (the fourth unused), for torchvision's two resizes
//! ([`super::resize_like_torchvision`], [`super::resize_like_torch_uint8`]): a tap is one multiply
//! and one add for all three channels. [`Float`] sums in f32 (torch's float kernel), [`Fixed`] in
//! i32 fixed point (its u8 kernel). Built for wasm with SIMD a pixel is one 128-bit vector (the
//! compiler leaves these loops scalar for wasm by itself, three channels a tap); elsewhere a plain
//! array. Each lane's multiply and add are the same operations on either (f32 rounding each, or
//! exact integers), so both compute the same values.

/// A pixel's lanes and their arithmetic.
pub trait Lanes {
    /// A pixel, or a running sum of weighted pixels.
    type Pixel: Copy;
    /// A tap's weight, as a multiply takes it.
    type Weight: Copy;
    /// Whether a pass's sums are narrowed to u8 before the next pass reads them (torch's u8
    /// kernel), rather than read as they are (its float kernel).
    const NARROWS_BETWEEN_PASSES: bool;

    fn widen(rgb: &[u8; 3]) -> Self::Pixel;
    /// `value` in every lane: an empty sum (0, or the fixed point's rounding term).
    fn splat(value: f64) -> Self::Pixel;
    fn weight(value: f64) -> Self::Weight;
    /// `acc + p * weight`, lane by lane: the product, then the sum.
    fn add_scaled(acc: Self::Pixel, p: Self::Pixel, weight: Self::Weight) -> Self::Pixel;
    /// The channels as bytes: shifted right by `shift` bits (fixed point), clamped to 0..=255,
    /// rounded half to even (float).
    fn narrow(p: Self::Pixel, shift: u32) -> [u8; 3];
}

/// f32 lanes.
pub struct Float;

/// i32 lanes of fixed-point sums.
pub struct Fixed;

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
mod simd {
    use super::{Fixed, Float, Lanes};
    use core::arch::wasm32::*;

    /// The pixel's bytes in the low byte of each i32 lane (the fourth lane 0).
    #[inline]
    fn widened(rgb: &[u8; 3]) -> v128 {
        let word = u32::from_le_bytes([rgb[0], rgb[1], rgb[2], 0]);
        u32x4_extend_low_u16x8(u16x8_extend_low_u8x16(u32x4_splat(word)))
    }

    /// Lanes 0..3 of i32 lanes within 0..=255.
    #[inline]
    fn bytes(v: v128) -> [u8; 3] {
        [
            i32x4_extract_lane::<0>(v) as u8,
            i32x4_extract_lane::<1>(v) as u8,
            i32x4_extract_lane::<2>(v) as u8,
        ]
    }

    impl Lanes for Float {
        type Pixel = v128;
        type Weight = v128;
        const NARROWS_BETWEEN_PASSES: bool = false;

        #[inline]
        fn widen(rgb: &[u8; 3]) -> v128 {
            f32x4_convert_u32x4(widened(rgb))
        }

        #[inline]
        fn splat(value: f64) -> v128 {
            f32x4_splat(value as f32)
        }

        #[inline]
        fn weight(value: f64) -> v128 {
            f32x4_splat(value as f32)
        }

        #[inline]
        fn add_scaled(acc: v128, p: v128, weight: v128) -> v128 {
            f32x4_add(acc, f32x4_mul(p, weight))
        }

        #[inline]
        fn narrow(p: v128, _shift: u32) -> [u8; 3] {
            let clamped = f32x4_min(f32x4_max(p, f32x4_splat(0.0)), f32x4_splat(255.0));
            bytes(i32x4_trunc_sat_f32x4(f32x4_nearest(clamped)))
        }
    }

    impl Lanes for Fixed {
        type Pixel = v128;
        type Weight = v128;
        const NARROWS_BETWEEN_PASSES: bool = true;

        #[inline]
        fn widen(rgb: &[u8; 3]) -> v128 {
            widened(rgb)
        }

        #[inline]
        fn splat(value: f64) -> v128 {
            i32x4_splat(value as i32)
        }

        #[inline]
        fn weight(value: f64) -> v128 {
            i32x4_splat(value as i32)
        }

        #[inline]
        fn add_scaled(acc: v128, p: v128, weight: v128) -> v128 {
            i32x4_add(acc, i32x4_mul(p, weight))
        }

        #[inline]
        fn narrow(p: v128, shift: u32) -> [u8; 3] {
            let shifted = i32x4_shr(p, shift);
            bytes(i32x4_min(
                i32x4_max(shifted, i32x4_splat(0)),
                i32x4_splat(255),
            ))
        }
    }
}

#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
mod portable {
    use super::{Fixed, Float, Lanes};

    impl Lanes for Float {
        type Pixel = [f32; 4];
        type Weight = f32;
        const NARROWS_BETWEEN_PASSES: bool = false;

        #[inline]
        fn widen(rgb: &[u8; 3]) -> [f32; 4] {
            [f32::from(rgb[0]), f32::from(rgb[1]), f32::from(rgb[2]), 0.0]
        }

        #[inline]
        fn splat(value: f64) -> [f32; 4] {
            [value as f32; 4]
        }

        #[inline]
        fn weight(value: f64) -> f32 {
            value as f32
        }

        #[inline]
        fn add_scaled(mut acc: [f32; 4], p: [f32; 4], weight: f32) -> [f32; 4] {
            for (a, v) in acc.iter_mut().zip(p) {
                *a += v * weight;
            }
            acc
        }

        #[inline]
        fn narrow(p: [f32; 4], _shift: u32) -> [u8; 3] {
            [p[0], p[1], p[2]].map(|v| v.clamp(0.0, 255.0).round_ties_even() as u8)
        }
    }

    impl Lanes for Fixed {
        type Pixel = [i32; 4];
        type Weight = i32;
        const NARROWS_BETWEEN_PASSES: bool = true;

        #[inline]
        fn widen(rgb: &[u8; 3]) -> [i32; 4] {
            [i32::from(rgb[0]), i32::from(rgb[1]), i32::from(rgb[2]), 0]
        }

        #[inline]
        fn splat(value: f64) -> [i32; 4] {
            [value as i32; 4]
        }

        #[inline]
        fn weight(value: f64) -> i32 {
            value as i32
        }

        #[inline]
        fn add_scaled(mut acc: [i32; 4], p: [i32; 4], weight: i32) -> [i32; 4] {
            for (a, v) in acc.iter_mut().zip(p) {
                *a += v * weight;
            }
            acc
        }

        #[inline]
        fn narrow(p: [i32; 4], shift: u32) -> [u8; 3] {
            [p[0], p[1], p[2]].map(|v| (v >> shift).clamp(0, 255) as u8)
        }
    }
}
