//! A bounds-checked view API over the `gemm` crate, and the dot products of the half-precision
//! GEMV compiled for AVX2/FMA where the CPU has them: with the attention, activation and AMX
//! kernels' dispatch and the CUDA driver, the only unsafe code of the crate.
//!
//! `gemm::gemm` takes raw pointers and strides. The wrappers here take slices with explicit
//! row/column strides, check that every element the multiplication touches lies inside its slice,
//! and require a destination whose elements are distinct (unit column stride, row stride at least
//! the width), so no two writes of gemm's threads can alias. With those checks the call is sound.

#![allow(unsafe_code)]

#[cfg(target_arch = "x86_64")]
use super::cpu_features::has_avx2;
use crate::error::{Error, Result};

/// Whether a multiplication may use the current rayon pool.
#[derive(Debug, Clone, Copy)]
pub enum Threads {
    /// Single-threaded (the caller already runs many of these in parallel).
    One,
    /// Up to this many threads of the current rayon pool.
    Pool(usize),
}

/// A read-only strided matrix view.
#[derive(Debug, Clone, Copy)]
pub struct MatRef<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub row_stride: usize,
    pub col_stride: usize,
}

impl<'a> MatRef<'a> {
    /// A dense row-major matrix.
    pub fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Self {
            data,
            rows,
            cols,
            row_stride: cols,
            col_stride: 1,
        }
    }

    /// The transpose of this view (no data moves).
    pub fn t(self) -> Self {
        Self {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
        }
    }

    fn check(&self, what: &str) -> Result<()> {
        if self.rows == 0 || self.cols == 0 {
            return Ok(());
        }
        let last = (self.rows - 1).checked_mul(self.row_stride).and_then(|r| {
            (self.cols - 1)
                .checked_mul(self.col_stride)
                .and_then(|c| r.checked_add(c))
        });
        match last {
            Some(last) if last < self.data.len() => Ok(()),
            _ => Err(Error::shape(
                "matmul",
                format!(
                    "{what} view {}x{} (strides {}, {}) does not fit in {} elements",
                    self.rows,
                    self.cols,
                    self.row_stride,
                    self.col_stride,
                    self.data.len()
                ),
            )),
        }
    }
}

/// A writable row-major matrix view (unit column stride, so its elements are distinct).
#[derive(Debug)]
pub struct MatMut<'a> {
    pub data: &'a mut [f32],
    pub rows: usize,
    pub cols: usize,
    pub row_stride: usize,
}

impl<'a> MatMut<'a> {
    pub fn row_major(data: &'a mut [f32], rows: usize, cols: usize) -> Self {
        Self {
            data,
            rows,
            cols,
            row_stride: cols,
        }
    }

    /// Whether every element of the view lies in its slice, and no two share one (row stride at
    /// least the width).
    fn check(&self) -> Result<()> {
        if self.rows == 0 || self.cols == 0 {
            return Ok(());
        }
        let fits = self.row_stride >= self.cols
            && (self.rows - 1)
                .checked_mul(self.row_stride)
                .and_then(|r| r.checked_add(self.cols))
                .is_some_and(|end| end <= self.data.len());
        if fits {
            return Ok(());
        }
        Err(Error::shape(
            "matmul",
            format!(
                "destination {}x{} (row stride {}) does not fit in {} elements",
                self.rows,
                self.cols,
                self.row_stride,
                self.data.len()
            ),
        ))
    }
}

/// `dst = lhs · rhs`, or `dst += lhs · rhs` when `accumulate`.
pub fn matmul(
    dst: MatMut<'_>,
    lhs: MatRef<'_>,
    rhs: MatRef<'_>,
    accumulate: bool,
    threads: Threads,
) -> Result<()> {
    if lhs.rows != dst.rows || rhs.cols != dst.cols || lhs.cols != rhs.rows {
        return Err(Error::shape(
            "matmul",
            format!(
                "[{}x{}] · [{}x{}] into [{}x{}]",
                lhs.rows, lhs.cols, rhs.rows, rhs.cols, dst.rows, dst.cols
            ),
        ));
    }
    lhs.check("left")?;
    rhs.check("right")?;
    dst.check()?;
    if dst.rows == 0 || dst.cols == 0 {
        return Ok(());
    }
    if lhs.cols == 0 {
        if !accumulate {
            for r in 0..dst.rows {
                let start = r * dst.row_stride;
                dst.data[start..start + dst.cols].fill(0.0);
            }
        }
        return Ok(());
    }
    let rows = rows_summed_as_large_products(dst.cols);
    if (2..rows).contains(&dst.rows) {
        return matmul_padded(dst, lhs, rhs, accumulate, threads, rows);
    }
    let parallelism = match threads {
        Threads::One => gemm::Parallelism::None,
        Threads::Pool(n) if n > 1 => gemm::Parallelism::Rayon(n),
        Threads::Pool(_) => gemm::Parallelism::None,
    };
    // Strides fit in isize: each is at most the length of an allocated slice.
    let stride = |s: usize| s as isize;
    // SAFETY: every element index gemm computes, `r·row_stride + c·col_stride` for r < rows and
    // c < cols, was checked above to lie inside the corresponding slice; the destination is borrowed
    // mutably (no other reference to it exists) and its elements are pairwise distinct (unit column
    // stride, row stride ≥ cols), so gemm's threads write disjoint locations; the sources are only
    // read. With `read_dst == false` gemm does not read the destination.
    unsafe {
        gemm::gemm(
            dst.rows,
            dst.cols,
            lhs.cols,
            dst.data.as_mut_ptr(),
            1,
            stride(dst.row_stride),
            accumulate,
            lhs.data.as_ptr(),
            stride(lhs.col_stride),
            stride(lhs.row_stride),
            rhs.data.as_ptr(),
            stride(rhs.col_stride),
            stride(rhs.row_stride),
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
    Ok(())
}

/// gemm sums a product's inner dimension in runs it picks from the sizes (512 values for at most
/// 64 rows and columns, else from the cache sizes), and a product of at most 256 values with dot
/// products in another order, so the same row came out a few bits apart multiplied alone or among
/// many: the patch embedding of a 64-row video piece was off the same rows within the whole video.
/// Such products are made with zero rows added up to this many, which gemm multiplies as it does
/// large ones. (One row goes to gemm's vector kernels, as a decoding step's does: not padded.)
fn rows_summed_as_large_products(cols: usize) -> usize {
    if cols <= 64 { 65 } else { 256 / cols + 1 }
}

/// [`matmul`] of a product too small for gemm to sum as it sums large ones (see
/// [`rows_summed_as_large_products`]), through copies padded with zero rows.
fn matmul_padded(
    dst: MatMut<'_>,
    lhs: MatRef<'_>,
    rhs: MatRef<'_>,
    accumulate: bool,
    threads: Threads,
    rows: usize,
) -> Result<()> {
    let (m, k, n) = (dst.rows, lhs.cols, dst.cols);
    let mut padded_lhs = vec![0.0; rows * k];
    for (r, row) in padded_lhs.chunks_exact_mut(k).take(m).enumerate() {
        for (c, value) in row.iter_mut().enumerate() {
            *value = lhs.data[r * lhs.row_stride + c * lhs.col_stride];
        }
    }
    let mut padded_dst = vec![0.0; rows * n];
    if accumulate {
        for (r, row) in padded_dst.chunks_exact_mut(n).take(m).enumerate() {
            row.copy_from_slice(&dst.data[r * dst.row_stride..r * dst.row_stride + n]);
        }
    }
    matmul(
        MatMut::row_major(&mut padded_dst, rows, n),
        MatRef::row_major(&padded_lhs, rows, k),
        rhs,
        accumulate,
        threads,
    )?;
    for (r, row) in padded_dst.chunks_exact(n).take(m).enumerate() {
        dst.data[r * dst.row_stride..r * dst.row_stride + n].copy_from_slice(row);
    }
    Ok(())
}

/// `dst += lhs · wᵀ` for a weight `w` (`[dst.cols, lhs.cols]`, row-major) that exists only as
/// blocks of `block` rows at a time: `widen(rows, scratch)` writes the rows `rows` of `w` as f32
/// into `scratch` (`rows.len() · lhs.cols` values), and the blocks are multiplied in parallel on
/// the current rayon pool, each straight into its own columns of `dst`.
///
/// Each thread keeps one scratch for the blocks it takes, and no block's product goes through a
/// buffer of its own: a half-precision linear's blocks cost neither allocations nor a second pass
/// to add them in.
pub fn matmul_weight_blocks<W>(
    dst: MatMut<'_>,
    lhs: MatRef<'_>,
    block: usize,
    widen: W,
) -> Result<()>
where
    W: Fn(std::ops::Range<usize>, &mut [f32]) + Sync,
{
    use rayon::prelude::*;
    use std::cell::RefCell;

    thread_local! {
        static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    }
    let (m, k, n) = (dst.rows, lhs.cols, dst.cols);
    lhs.check("left")?;
    dst.check()?;
    if lhs.rows != m {
        return Err(Error::shape(
            "matmul",
            format!("[{}x{k}] weight blocks into [{m}x{n}]", lhs.rows),
        ));
    }
    if m == 0 || n == 0 || k == 0 {
        return Ok(());
    }
    let block = block.clamp(1, n);
    let row_stride = dst.row_stride;
    let dst = SharedDestination::new(dst.data);
    let block_product = |cols: std::ops::Range<usize>, scratch: &mut Vec<f32>| -> Result<()> {
        let nb = cols.len();
        if scratch.len() < nb * k {
            scratch.resize(nb * k, 0.0);
        }
        let wide = &mut scratch[..nb * k];
        widen(cols.clone(), wide);
        let rhs = MatRef::row_major(wide, nb, k).t();
        if (2..rows_summed_as_large_products(nb)).contains(&m) {
            // Too few rows for gemm to sum as it sums large products: through `matmul`'s
            // padding, then added in.
            let mut part = vec![0.0; m * nb];
            matmul(
                MatMut::row_major(&mut part, m, nb),
                lhs,
                rhs,
                false,
                Threads::One,
            )?;
            for (r, part_row) in part.chunks_exact(nb).enumerate() {
                for (c, value) in part_row.iter().enumerate() {
                    // SAFETY: (r, cols.start + c) lies in `dst` (checked above) and in this
                    // block's columns, which no other task writes.
                    unsafe { *dst.at(r * row_stride + cols.start + c) += value };
                }
            }
            return Ok(());
        }
        // SAFETY: `lhs` was checked to lie in its slice, `wide` is a dense `[nb, k]` slice; the
        // destination's rows `0..m` and columns `cols` lie inside `dst` (checked above), and the
        // blocks' column ranges are disjoint, so no two tasks write one element; `dst`'s slice is
        // borrowed mutably for the whole call, so nothing else reads it.
        unsafe {
            gemm::gemm(
                m,
                nb,
                k,
                dst.at(cols.start),
                1,
                row_stride as isize,
                true,
                lhs.data.as_ptr(),
                lhs.col_stride as isize,
                lhs.row_stride as isize,
                rhs.data.as_ptr(),
                rhs.col_stride as isize,
                rhs.row_stride as isize,
                1.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
        Ok(())
    };
    (0..n.div_ceil(block)).into_par_iter().try_for_each(|b| {
        let cols = b * block..((b + 1) * block).min(n);
        SCRATCH.with(|cell| match cell.try_borrow_mut() {
            Ok(mut scratch) => block_product(cols, &mut scratch),
            // This thread's scratch is in use: `widen` waited on rayon work and this thread took
            // another block meanwhile. That block gets a scratch of its own.
            Err(_) => block_product(cols, &mut Vec::new()),
        })
    })
}

/// The destination of [`matmul_weight_blocks`] (and of `bf16_gemm`'s linears), shared by tasks
/// that write disjoint columns.
#[derive(Clone, Copy)]
pub(super) struct SharedDestination(*mut f32);

// SAFETY: tasks write only their own columns (see `matmul_weight_blocks`).
unsafe impl Send for SharedDestination {}
unsafe impl Sync for SharedDestination {}

impl SharedDestination {
    /// `dst`, for tasks each writing elements no other task writes, while `dst` stays borrowed.
    pub(super) fn new(dst: &mut [f32]) -> Self {
        SharedDestination(dst.as_mut_ptr())
    }

    /// `dst`, not yet written: for tasks that write every element before any is read.
    pub(super) fn new_uninit(dst: &mut [std::mem::MaybeUninit<f32>]) -> Self {
        SharedDestination(dst.as_mut_ptr().cast())
    }

    /// SAFETY: `offset` must lie inside the destination's slice.
    pub(super) unsafe fn at(self, offset: usize) -> *mut f32 {
        unsafe { self.0.add(offset) }
    }
}

/// `Σ a[i] · b[i]` over equal-length slices (the shorter length otherwise), with eight
/// accumulators; AVX2 + FMA where the CPU has them (the baseline x86-64 build has SSE2 only).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has the features the function is compiled for.
        return unsafe { dot_avx2(a, b) };
    }
    dot_with(a, b, |_, y| y)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_fma(a, b, |x| x)
}

/// `out[r, j] = x[r] · w[j]` for the `rows` input rows of `x` (row-major, `k` wide) and the weight
/// rows of `w` (bf16, `k` wide, as many as `out`, `[rows, n]`, has columns): a few decoding
/// sequences against a block of weight rows as it streams from memory, read once at 2 bytes a
/// value and widened in registers.
///
/// Each output is [`CHAINS`] chains of eight lanes over `k`, added together and across their lanes
/// at the end, whatever tile computes it: a sequence decodes to the same values alone or in a
/// batch. The tiles are up to four input rows by one or two weight rows (at most eight outputs, so
/// sixteen accumulators never outgrow AVX2's registers).
pub fn dot_rows_bf16(x: &[f32], rows: usize, w: &[half::bf16], k: usize, out: &mut [f32]) {
    let n = out.len() / rows.max(1);
    assert!(
        x.len() == rows * k && w.len() == n * k && out.len() == rows * n,
        "dot_rows_bf16: x {} for {rows}x{k}, w {} for {n}x{k}, out {}",
        x.len(),
        w.len(),
        out.len()
    );
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // A block of weight rows at a time, read from memory by the first group of input rows
        // and from cache by the others.
        for j0 in (0..n).step_by(WEIGHT_BLOCK) {
            let j1 = (j0 + WEIGHT_BLOCK).min(n);
            let mut r0 = 0;
            while r0 < rows {
                let mr = (rows - r0).min(4);
                // SAFETY: the CPU has the features the kernels are compiled for, and the sizes
                // are the ones asserted above.
                unsafe {
                    match mr {
                        1 => rows_tiles_avx2::<1, 1>(x, r0, w, j0..j1, k, n, out),
                        2 => rows_tiles_avx2::<2, 2>(x, r0, w, j0..j1, k, n, out),
                        3 => rows_tiles_avx2::<3, 1>(x, r0, w, j0..j1, k, n, out),
                        _ => rows_tiles_avx2::<4, 1>(x, r0, w, j0..j1, k, n, out),
                    }
                }
                r0 += mr;
            }
        }
        return;
    }
    for r in 0..rows {
        for j in 0..n {
            out[r * n + j] = dot_with(&x[r * k..][..k], &w[j * k..][..k], |_, w| widen_bf16(w));
        }
    }
}

/// Accumulators of eight lanes per output, each taking every `CHAINS`-th eight values of the row:
/// a single row's multiply-adds then do not wait on each other's latency.
const CHAINS: usize = 2;
const STEP: usize = 8 * CHAINS;

/// Weight rows [`dot_rows_bf16`] takes through every group of input rows before the next: a
/// multiple of every tile's width, and in L2 at any model's width (8 rows of 8 960 are 140 KiB).
const WEIGHT_BLOCK: usize = 8;

fn widen_bf16(w: half::bf16) -> f32 {
    f32::from_bits(u32::from(w.to_bits()) << 16)
}

/// Input rows `r0..r0 + MR` of `x` against weight rows `js`, `NR` weight rows a tile (the last
/// few one at a time).
///
/// # Safety
/// The CPU must have AVX2 and FMA; `x` is `[rows, k]` with `r0 + MR <= rows`, `w` is `[n, k]`,
/// `out` is `[rows, n]`, and `js` lies within `0..n`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_tiles_avx2<const MR: usize, const NR: usize>(
    x: &[f32],
    r0: usize,
    w: &[half::bf16],
    js: std::ops::Range<usize>,
    k: usize,
    n: usize,
    out: &mut [f32],
) {
    let mut j = js.start;
    while j + NR <= js.end {
        // SAFETY: as the caller's.
        unsafe { tile_avx2::<MR, NR>(x, r0, w, j, k, n, out) };
        j += NR;
    }
    while j < js.end {
        // SAFETY: as the caller's.
        unsafe { tile_avx2::<MR, 1>(x, r0, w, j, k, n, out) };
        j += 1;
    }
}

/// One tile: input rows `r0..r0 + MR` against weight rows `j0..j0 + NR`.
///
/// # Safety
/// As [`rows_tiles_avx2`], with `j0 + NR <= n`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn tile_avx2<const MR: usize, const NR: usize>(
    x: &[f32],
    r0: usize,
    w: &[half::bf16],
    j0: usize,
    k: usize,
    n: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    debug_assert!((r0 + MR) * k <= x.len() && (j0 + NR) * k <= w.len());
    let full = k / STEP * STEP;
    let (x_ptr, w_ptr) = (x.as_ptr(), w.as_ptr().cast::<u16>());
    let mut acc = [[[_mm256_setzero_ps(); CHAINS]; NR]; MR];
    let mut i = 0;
    while i < full {
        for chain in 0..CHAINS {
            let at = i + 8 * chain;
            let mut wide = [_mm256_setzero_ps(); NR];
            for (c, wide) in wide.iter_mut().enumerate() {
                // SAFETY: `at + 8 <= k` and weight row `j0 + c` has `k` values.
                let half = unsafe { _mm_loadu_si128(w_ptr.add((j0 + c) * k + at).cast()) };
                *wide = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                // SAFETY: `at + 8 <= k` and input row `r0 + r` has `k` values.
                let xv = unsafe { _mm256_loadu_ps(x_ptr.add((r0 + r) * k + at)) };
                for (acc, &wide) in acc.iter_mut().zip(&wide) {
                    acc[chain] = _mm256_fmadd_ps(xv, wide, acc[chain]);
                }
            }
        }
        i += STEP;
    }
    for (r, acc) in acc.iter().enumerate() {
        let row = &x[(r0 + r) * k..][..k];
        for (c, chains) in acc.iter().enumerate() {
            let sum = chains[1..]
                .iter()
                .fold(chains[0], |a, &b| _mm256_add_ps(a, b));
            let mut lanes = [0f32; 8];
            // SAFETY: `lanes` holds eight f32.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), sum) };
            let weights = &w[(j0 + c) * k..][..k];
            let tail: f32 = row[full..]
                .iter()
                .zip(&weights[full..])
                .map(|(&x, &w)| x * widen_bf16(w))
                .sum();
            out[(r0 + r) * n + j0 + c] = lanes.iter().sum::<f32>() + tail;
        }
    }
}

/// The portable loop: `widen(a[i], b[i])` is `b[i]` as f32.
#[inline(always)]
fn dot_with<T: Copy>(a: &[f32], b: &[T], widen: impl Fn(f32, T) -> f32) -> f32 {
    let mut acc = [0.0f32; 8];
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = a8
        .remainder()
        .iter()
        .zip(b8.remainder())
        .map(|(&x, &y)| x * widen(x, y))
        .sum();
    for (x, y) in a8.zip(b8) {
        for i in 0..8 {
            acc[i] += x[i] * widen(x[i], y[i]);
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// The same with fused multiply-adds (inlined into the AVX2 + FMA functions above).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn dot_fma<T: Copy>(a: &[f32], b: &[T], widen: impl Fn(T) -> f32) -> f32 {
    let mut acc = [0.0f32; 16];
    let (a16, b16) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = a16
        .remainder()
        .iter()
        .zip(b16.remainder())
        .map(|(&x, &y)| x * widen(y))
        .sum();
    for (x, y) in a16.zip(b16) {
        for i in 0..16 {
            acc[i] = x[i].mul_add(widen(y[i]), acc[i]);
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {

    #[test]
    fn dot_products_match_a_plain_sum_on_every_path() {
        for n in [0usize, 1, 7, 8, 15, 16, 17, 100, 1536] {
            let a: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.01)
                .collect();
            let b: Vec<f32> = (0..n)
                .map(|i| ((i * 11 % 53) as f32 - 26.0) * 0.02)
                .collect();
            let w: Vec<half::bf16> = b.iter().map(|&v| half::bf16::from_f32(v)).collect();
            let plain: f64 = a.iter().zip(&b).map(|(&x, &y)| f64::from(x * y)).sum();
            let plain_bf16: f64 = a
                .iter()
                .zip(&w)
                .map(|(&x, &y)| f64::from(x * y.to_f32()))
                .sum();
            let close =
                |got: f32, want: f64| (f64::from(got) - want).abs() <= 1e-4 * (1.0 + want.abs());
            // Whatever this CPU dispatches to, and the portable loops.
            assert!(close(dot(&a, &b), plain), "dot, {n}");
            assert!(
                close(dot_with(&a, &b, |_, y| y), plain),
                "portable dot, {n}"
            );
            // One to seven input rows (the kernels take up to four at a time), each its own
            // multiple of `a`, against eleven weight rows (tiles and the last ones alone), each `w`
            // times its own power of two (exact in bf16); and each output the same however many
            // rows come with it.
            let weights: Vec<half::bf16> = (0..11)
                .flat_map(|j| {
                    w.iter()
                        .map(move |&v| v * half::bf16::from_f32((1 << j) as f32))
                })
                .collect();
            for rows in 1..=7 {
                let x: Vec<f32> = (1..=rows)
                    .flat_map(|r| a.iter().map(move |&v| v * r as f32))
                    .collect();
                let mut got = vec![0.0; rows * 11];
                dot_rows_bf16(&x, rows, &weights, n, &mut got);
                for (i, &got) in got.iter().enumerate() {
                    let (r, j) = (i / 11, i % 11);
                    let want = plain_bf16 * ((r + 1) << j) as f64;
                    assert!(
                        close(got, want),
                        "dot_rows_bf16, {n}, row {r} of {rows}, column {j}"
                    );
                    let mut alone = [0.0];
                    let weight = &weights[j * n..(j + 1) * n];
                    dot_rows_bf16(&x[r * n..(r + 1) * n], 1, weight, n, &mut alone);
                    assert_eq!(
                        got.to_bits(),
                        alone[0].to_bits(),
                        "row {r} of {rows}, {j}, {n}"
                    );
                }
            }
            let widen = |_, y: half::bf16| f32::from_bits(u32::from(y.to_bits()) << 16);
            assert!(
                close(dot_with(&a, &w, widen), plain_bf16),
                "portable dot_bf16, {n}"
            );
        }
    }

    use super::*;

    fn naive(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut out = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
            }
        }
        out
    }

    #[test]
    fn matches_naive_product_including_transposed_views() {
        let (m, k, n) = (7, 5, 3);
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).cos()).collect();
        let want = naive(&a, &b, m, k, n);
        let mut got = vec![0.0; m * n];
        matmul(
            MatMut::row_major(&mut got, m, n),
            MatRef::row_major(&a, m, k),
            MatRef::row_major(&b, k, n),
            false,
            Threads::One,
        )
        .unwrap();
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() < 1e-5);
        }
        // b stored transposed ([n, k], as nn.Linear stores weights) and viewed back.
        let bt: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
        let mut got_t = vec![1.0; m * n];
        matmul(
            MatMut::row_major(&mut got_t, m, n),
            MatRef::row_major(&a, m, k),
            MatRef::row_major(&bt, n, k).t(),
            false,
            Threads::Pool(2),
        )
        .unwrap();
        for (g, w) in got_t.iter().zip(&want) {
            assert!((g - w).abs() < 1e-5);
        }
    }

    /// A row's product is the same bits however many rows (two or more) come with it: a video's
    /// piece is encoded to exactly its rows of the whole video's features. (Multiplied as they
    /// came, 64 rows or fewer of a 1 536-deep patch embedding into 64 columns were off.)
    #[test]
    fn a_rows_product_does_not_depend_on_the_rows_beside_it() {
        for (k, n) in [(1536, 64), (700, 100)] {
            let a: Vec<f32> = (0..200 * k).map(|i| (i as f32 * 0.37).sin()).collect();
            let w: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.11).cos() * 0.05).collect();
            let product = |m: usize, threads, accumulate: bool| {
                let mut out: Vec<f32> = (0..m * n).map(|i| i as f32 * 0.5).collect();
                matmul(
                    MatMut::row_major(&mut out, m, n),
                    MatRef::row_major(&a[..m * k], m, k),
                    MatRef::row_major(&w, n, k).t(),
                    accumulate,
                    threads,
                )
                .unwrap();
                out
            };
            for accumulate in [false, true] {
                let all = product(200, Threads::Pool(2), accumulate);
                for m in [2, 3, 16, 63, 64, 65, 128] {
                    for threads in [Threads::One, Threads::Pool(2)] {
                        assert!(
                            product(m, threads, accumulate) == all[..m * n],
                            "{m} rows of {k}x{n}, {threads:?}, accumulate {accumulate}"
                        );
                    }
                }
            }
        }
    }

    /// Blocks of widened weight rows add their products into their own columns of a strided
    /// destination, on gemm's path and through the padding for few rows; the columns past the
    /// destination's width are left alone, and a thread's scratch is reused at every block width
    /// (or left to the block that has it, when `widen` waits on rayon work).
    #[test]
    fn weight_blocks_add_their_products_into_their_columns() {
        let (k, n, stride) = (300, 200, 203);
        let w: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.11).cos() * 0.05).collect();
        for block in [200, 48, 24, 7, 1] {
            for m in [1, 2, 5, 40, 70] {
                let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
                let start: Vec<f32> = (0..m * stride).map(|i| i as f32 * 0.5).collect();
                let mut got = start.clone();
                let widened_rows = std::sync::atomic::AtomicUsize::new(0);
                matmul_weight_blocks(
                    MatMut {
                        data: &mut got,
                        rows: m,
                        cols: n,
                        row_stride: stride,
                    },
                    MatRef::row_major(&a, m, k),
                    block,
                    |rows, wide| {
                        assert_eq!(wide.len(), rows.len() * k);
                        // Widened on rayon itself, as a caller may: a thread waiting here can take
                        // another block while its scratch is in use.
                        use rayon::prelude::*;
                        wide.par_chunks_mut(k)
                            .zip(w[rows.start * k..rows.end * k].par_chunks(k))
                            .for_each(|(to, from)| to.copy_from_slice(from));
                        widened_rows.fetch_add(rows.len(), std::sync::atomic::Ordering::Relaxed);
                    },
                )
                .unwrap();
                assert_eq!(widened_rows.into_inner(), n, "each weight row widened once");
                for r in 0..m {
                    for c in 0..stride {
                        let (got, start) = (got[r * stride + c], start[r * stride + c]);
                        if c >= n {
                            assert_eq!(got, start, "column {c} past the width");
                            continue;
                        }
                        let want: f64 = f64::from(start)
                            + (0..k)
                                .map(|p| f64::from(a[r * k + p]) * f64::from(w[c * k + p]))
                                .sum::<f64>();
                        assert!(
                            (f64::from(got) - want).abs() <= 1e-4 * (1.0 + want.abs()),
                            "block {block}, {m} rows: [{r}, {c}] {got} vs {want}"
                        );
                    }
                }
            }
        }
        let mut small = vec![0.0; 4];
        let a = vec![0.0; 6];
        let overrun = matmul_weight_blocks(
            MatMut::row_major(&mut small, 2, 3),
            MatRef::row_major(&a, 2, 3),
            2,
            |_, wide| wide.fill(0.0),
        );
        assert!(overrun.is_err());
    }

    #[test]
    fn refuses_views_that_overrun_their_slices() {
        let a = vec![0.0; 6];
        let mut d = vec![0.0; 4];
        let err = matmul(
            MatMut::row_major(&mut d, 2, 2),
            MatRef::row_major(&a, 2, 4),
            MatRef::row_major(&a, 4, 2),
            false,
            Threads::One,
        );
        assert!(err.is_err());
    }
}
