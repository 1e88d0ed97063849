//! The inner loops of the two passes: Pillow's i32 sums of u8 × fixed-point weight products,
//! rounded and clamped. Three backends compute exactly the same bytes:
//! - [`wasm`]: Wasm SIMD128 (the plugins), four lanes at a time. The compiler leaves these loops
//!   scalar for Wasm by itself, so the SIMD is written out.
//! - [`x86`]: AVX2, chosen at run time (the host), eight lanes at a time: two output pixels of the
//!   horizontal pass, or 32 bytes of a row in the vertical one.
//! - [`portable`]: plain loops, elsewhere (and where AVX2 is missing).
//!
//! `lanes` is the Wasm or the portable one; the row functions in the crate root use it unless the
//! x86 one applies.

/// Pillow's fixed-point precision for 8-bit resampling (32 - 8 - 2).
pub(crate) const PRECISION_BITS: u32 = 22;

pub(crate) const ROUNDING: i32 = 1 << (PRECISION_BITS - 1);

// Accumulators are i32 as in Pillow: with weights normalised to 2^22, |sum| < 2^31 for u8 input.
#[inline]
pub(crate) fn clip8(acc: i32) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}

#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
pub(crate) mod portable;
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
pub(crate) mod wasm;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;

#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
pub(crate) use portable as lanes;
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
pub(crate) use wasm as lanes;
