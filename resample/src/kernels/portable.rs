//! The kernels as plain loops (see the module docs of `kernels`).

use crate::fixed::{ROUNDING, clip8};

pub(crate) const BLOCK: usize = 16;

/// A source pixel widened for the horizontal pass: R, G, B and a lane that is never read back.
pub(crate) type Wide = [i32; 4];

pub(crate) const WIDE_ZERO: Wide = [0; 4];

#[inline]
pub(crate) fn widen_rgb(row: &[u8], out: &mut [Wide]) {
    for (wide, px) in out.iter_mut().zip(row.chunks_exact(3)) {
        *wide = [i32::from(px[0]), i32::from(px[1]), i32::from(px[2]), 0];
    }
}

#[inline]
pub(crate) fn horizontal(pixels: &[Wide], kk: &[i32]) -> [u8; 4] {
    let mut acc = [ROUNDING; 4];
    for (&k, px) in kk.iter().zip(pixels) {
        for (a, &p) in acc.iter_mut().zip(px) {
            *a += p * k;
        }
    }
    acc.map(clip8)
}

#[inline]
pub(crate) fn horizontal_fixed<const K: usize>(pixels: &[Wide; K], kk: &[i32; K]) -> [u8; 4] {
    horizontal(pixels, kk)
}

#[inline]
pub(crate) fn vertical(rows: &[&[u8]], x: usize, kk: &[i32], out: &mut [u8]) {
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
