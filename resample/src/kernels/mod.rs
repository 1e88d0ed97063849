//! The inner loops of the two passes: Pillow's i32 sums of u8 × fixed-point weight products,
//! rounded and clamped. Three backends compute exactly the same bytes:
//! - [`wasm`]: Wasm SIMD128 (the plugins), four lanes at a time. The compiler leaves these loops
//!   scalar for Wasm by itself, so the SIMD is written out.
//! - [`x86`]: AVX2, chosen at run time (the host), eight lanes at a time: two output pixels of the
//!   horizontal pass, or 32 bytes of a row in the vertical one.
//! - [`portable`]: plain loops, elsewhere (and where AVX2 is missing).
//!
//! `lanes` is the Wasm or the portable one; [`Kernels`] says which runs a resize's rows.

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

use crate::CHANNELS;
use crate::fixed::{ROUNDING, clip8};
use crate::weights::AxisWeights;

/// Which kernels run the passes' rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kernels {
    /// `lanes`: Wasm SIMD128 in the plugins, plain loops elsewhere.
    Lanes,
    /// `x86`, on a CPU with AVX2.
    #[cfg(target_arch = "x86_64")]
    Avx2(x86::Avx2),
}

impl Kernels {
    /// `horizontal` with what these kernels read of it besides the weights.
    pub(crate) fn prepared(self, horizontal: AxisWeights) -> AxisWeights {
        match self {
            Kernels::Lanes => horizontal,
            #[cfg(target_arch = "x86_64")]
            Kernels::Avx2(_) => AxisWeights {
                paired: x86::paired_weights(&horizontal.weights, horizontal.ksize),
                ..horizontal
            },
        }
    }

    /// One source row resampled horizontally into `out`.
    pub(crate) fn horizontal_row(
        self,
        src: &[u8],
        axis: &AxisWeights,
        padded: &mut [lanes::Wide],
        out: &mut [u8],
    ) {
        match self {
            Kernels::Lanes => horizontal_row(src, axis, padded, out),
            #[cfg(target_arch = "x86_64")]
            Kernels::Avx2(avx2) => {
                let weights = (axis.starts.as_slice(), axis.paired.as_slice(), axis.ksize);
                avx2.horizontal_row(src, padded, weights, out)
            }
        }
    }

    /// One output row of the vertical pass: `out` = Σ_j kk[j] · rows[j], bytewise.
    pub(crate) fn vertical_row(self, rows: &[&[u8]], kk: &[i32], out: &mut [u8]) {
        match self {
            Kernels::Lanes => vertical_row(rows, kk, out),
            #[cfg(target_arch = "x86_64")]
            Kernels::Avx2(avx2) => avx2.vertical_row(rows, kk, out),
        }
    }

    /// The fastest this CPU runs.
    pub(crate) fn detect() -> Kernels {
        #[cfg(target_arch = "x86_64")]
        if let Some(avx2) = x86::Avx2::detect() {
            return Kernels::Avx2(avx2);
        }
        Kernels::Lanes
    }
}

/// One source row resampled horizontally into `out`, with `kernels::lanes`.
fn horizontal_row(src: &[u8], axis: &AxisWeights, padded: &mut [lanes::Wide], out: &mut [u8]) {
    lanes::widen_rgb(src, padded);
    // Every output pixel's taps as one fixed-size kernel (weights past its count are zero, and so
    // are the pixels past the row's end): the loop unrolls for the sizes that occur most
    // (bicubic: 5 when enlarging, 7 and 9 when shrinking by up to 1.5 and 2).
    match axis.ksize {
        5 => horizontal_row_fixed::<5>(padded, axis, out),
        7 => horizontal_row_fixed::<7>(padded, axis, out),
        9 => horizontal_row_fixed::<9>(padded, axis, out),
        _ => {
            for (xx, out) in out.chunks_exact_mut(CHANNELS).enumerate() {
                let (start, kk) = axis.taps(xx);
                let pixel = lanes::horizontal(&padded[start..], kk);
                out.copy_from_slice(&pixel[..CHANNELS]);
            }
        }
    }
}

fn horizontal_row_fixed<const K: usize>(
    padded: &[lanes::Wide],
    axis: &AxisWeights,
    out: &mut [u8],
) {
    let taps = axis.starts.iter().zip(axis.weights.chunks_exact(K));
    for (out, (&start, weights)) in out.chunks_exact_mut(CHANNELS).zip(taps) {
        // `padded` holds K zero pixels past the row, so a window never runs off it.
        let (Some(pixels), Ok(weights)) = (
            padded
                .get(start..start + K)
                .and_then(|p| <&[_; K]>::try_from(p).ok()),
            <&[i32; K]>::try_from(weights),
        ) else {
            continue;
        };
        let pixel = lanes::horizontal_fixed(pixels, weights);
        out.copy_from_slice(&pixel[..CHANNELS]);
    }
}

/// One output row of the vertical pass, with `kernels::lanes`.
fn vertical_row(rows: &[&[u8]], kk: &[i32], out: &mut [u8]) {
    // Column blocks with their sums in registers: each tap row is read once per block and no
    // accumulator row goes through memory.
    let x = out.len() - out.len() % lanes::BLOCK;
    let (whole, tail) = out.split_at_mut(x);
    for (block, out) in whole.chunks_exact_mut(lanes::BLOCK).enumerate() {
        lanes::vertical(rows, block * lanes::BLOCK, kk, out);
    }
    for (i, o) in tail.iter_mut().enumerate() {
        let mut acc = ROUNDING;
        for (&k, row) in kk.iter().zip(rows) {
            acc += i32::from(row[x + i]) * k;
        }
        *o = clip8(acc);
    }
}
