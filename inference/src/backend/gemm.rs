//! A bounds-checked view API over the `gemm` crate, the only unsafe code of the crate.
//!
//! `gemm::gemm` takes raw pointers and strides. The wrappers here take slices with explicit
//! row/column strides, check that every element the multiplication touches lies inside its slice,
//! and require a destination whose elements are distinct (unit column stride, row stride at least
//! the width), so no two writes of gemm's threads can alias. With those checks the call is sound.

#![allow(unsafe_code)]

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
    if dst.rows == 0 || dst.cols == 0 {
        return Ok(());
    }
    let dst_fits = dst.row_stride >= dst.cols
        && (dst.rows - 1)
            .checked_mul(dst.row_stride)
            .and_then(|r| r.checked_add(dst.cols))
            .is_some_and(|end| end <= dst.data.len());
    if !dst_fits {
        return Err(Error::shape(
            "matmul",
            format!(
                "destination {}x{} (row stride {}) does not fit in {} elements",
                dst.rows,
                dst.cols,
                dst.row_stride,
                dst.data.len()
            ),
        ));
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

#[cfg(test)]
mod tests {
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
