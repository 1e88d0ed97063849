//! One RGB pixel as four f32 lanes (the fourth unused), for torchvision's float resize
//! ([`super::resize_like_torchvision`]): a tap is one multiply and one add for all three channels.
//! Built for wasm with SIMD a pixel is an `f32x4` vector (the compiler leaves these float loops
//! scalar for wasm by itself, three channels a tap); elsewhere a plain array. Each lane's multiply
//! and add round as f32 arithmetic does on either, so both compute the same values.

#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
pub use portable::*;
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
pub use simd::*;

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
mod simd {
    use core::arch::wasm32::*;

    /// R, G, B and an unused lane.
    pub type Pixel = v128;

    #[inline]
    pub fn zero() -> Pixel {
        f32x4_splat(0.0)
    }

    #[inline]
    pub fn from_rgb(rgb: &[u8; 3]) -> Pixel {
        let word = u32::from_le_bytes([rgb[0], rgb[1], rgb[2], 0]);
        f32x4_convert_u32x4(u32x4_extend_low_u16x8(u16x8_extend_low_u8x16(u32x4_splat(
            word,
        ))))
    }

    /// A tap's weight, in every lane.
    pub type Weight = v128;

    #[inline]
    pub fn weight(w: f32) -> Weight {
        f32x4_splat(w)
    }

    /// `acc + p * weight`, lane by lane: the product rounded, then the sum.
    #[inline]
    pub fn add_scaled(acc: Pixel, p: Pixel, weight: Weight) -> Pixel {
        f32x4_add(acc, f32x4_mul(p, weight))
    }

    /// The channels clamped to 0..=255 and rounded half to even.
    #[inline]
    pub fn to_rgb(p: Pixel) -> [u8; 3] {
        let clamped = f32x4_min(f32x4_max(p, f32x4_splat(0.0)), f32x4_splat(255.0));
        let rounded = i32x4_trunc_sat_f32x4(f32x4_nearest(clamped));
        // Lanes within 0..=255 after the clamp.
        [
            i32x4_extract_lane::<0>(rounded) as u8,
            i32x4_extract_lane::<1>(rounded) as u8,
            i32x4_extract_lane::<2>(rounded) as u8,
        ]
    }
}

#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
mod portable {
    /// R, G, B and an unused lane.
    pub type Pixel = [f32; 4];

    #[inline]
    pub fn zero() -> Pixel {
        [0.0; 4]
    }

    #[inline]
    pub fn from_rgb(rgb: &[u8; 3]) -> Pixel {
        [f32::from(rgb[0]), f32::from(rgb[1]), f32::from(rgb[2]), 0.0]
    }

    /// A tap's weight.
    pub type Weight = f32;

    #[inline]
    pub fn weight(w: f32) -> Weight {
        w
    }

    /// `acc + p * weight`, lane by lane: the product rounded, then the sum.
    #[inline]
    pub fn add_scaled(mut acc: Pixel, p: Pixel, weight: Weight) -> Pixel {
        for (a, v) in acc.iter_mut().zip(p) {
            *a += v * weight;
        }
        acc
    }

    /// The channels clamped to 0..=255 and rounded half to even.
    #[inline]
    pub fn to_rgb(p: Pixel) -> [u8; 3] {
        [p[0], p[1], p[2]].map(|v| v.clamp(0.0, 255.0).round_ties_even() as u8)
    }
}
