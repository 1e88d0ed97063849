//! Pillow's fixed-point arithmetic for 8-bit resampling, shared by the weights and every kernel.

/// Pillow's fixed-point precision for 8-bit resampling (32 - 8 - 2).
pub(crate) const PRECISION_BITS: u32 = 22;

pub(crate) const ROUNDING: i32 = 1 << (PRECISION_BITS - 1);

// Accumulators are i32 as in Pillow: with weights normalised to 2^22, |sum| < 2^31 for u8 input.
#[inline]
pub(crate) fn clip8(acc: i32) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}
