//! A linear with bf16 weights as a bf16 GEMM, where the CPU has AVX-512 BF16 (`vdpbf16ps`: 32
//! bf16 products a vector instruction, summed in pairs into sixteen f32 lanes; Intel since Cooper
//! Lake, AMD since Zen 4): the input is rounded to bf16 as cuBLAS's bf16 GEMMs round it, the
//! products summed in f32. The f32 GEMM over widened weights (`gemm`) does half the products an
//! instruction; on a prefill's linears, all but a few rows' worth of its time, that is the gap to an
//! engine computing in bf16.
//!
//! **Precision.** A product of two bf16 values is exact in f32, so what differs from the f32 GEMM
//! over the same weights is the input's rounding (8 bits of mantissa, relative 2⁻⁹ per value):
//! the CUDA backend's bf16 linears, not the CPU's f32 ones. A CPU device uses this only when asked
//! ([`super::cpu::CpuBackend::with_bf16_inputs`]), for every linear with bf16 weights.
//!
//! **Layout.** Each task takes a panel of [`NR`] weight rows (output columns), repacks it so that
//! one 64-byte load holds, for each of its 16 lanes' columns, the two weights of one pair of input
//! positions (`vdpbf16ps`'s operand), and runs every input row through it, [`MR`] rows a tile
//! (`2·MR` accumulators, two weight vectors and a broadcast input pair fill the 32 registers). An
//! output is one lane summing its pairs in input order, whatever tile or panel it is in. A few
//! rows (decoding: memory-bound) instead meet each weight row in place, as it streams from memory
//! (its consecutive pairs are what `vdpbf16ps` takes), sixteen lanes an output summed across at
//! the end. Either way a row's result does not depend on the rows beside it.

#![allow(unsafe_code)]

use half::bf16;
use rayon::prelude::*;

use super::gemm::SharedDestination;

/// Input rows up to which a linear reads each weight row in place against every input row
/// (decoding: memory-bound, the weights read once and not repacked) instead of packing panels.
const ROWS_IN_PLACE: usize = 32;
/// Input rows a tile of the in-place kernel.
const ROWS_A_TILE: usize = 8;
/// Weight rows a tile of the in-place kernel: each input value loaded meets two of them (with
/// one, loading the inputs bounded a batch of eight: a 2B model decoded at 0.5x vLLM's rate).
const WEIGHT_ROWS_A_TILE: usize = 2;

/// Output columns a panel: two vectors of sixteen f32 lanes.
const NR: usize = 32;
/// Input rows a tile.
const MR: usize = 12;

/// Whether this CPU runs [`linear`] (AVX-512 with BF16, not turned off by
/// [`super::cpu_features::NO_AVX512_VAR`]).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::cpu_features::has_avx512()
            && std::is_x86_feature_detected!("avx512bf16")
            && std::is_x86_feature_detected!("avx512bw")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `out[m, n] += bf16(x[m, k]) · w[n, k]ᵀ` on the current rayon pool, `x` rounded to bf16 (to
/// nearest even) and the products summed in f32. The CPU must have what [`available`] checks.
pub fn linear(out: &mut [f32], x: &[f32], w: &[bf16], [m, k, n]: [usize; 3]) {
    assert!(
        available() && x.len() == m * k && w.len() == n * k && out.len() == m * n,
        "bf16_gemm::linear: x {} for {m}x{k}, w {} for {n}x{k}, out {}",
        x.len(),
        w.len(),
        out.len()
    );
    if m == 0 || n == 0 || k == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        // Pairs of input positions a row: an odd `k` gets a zero beside its last value.
        let pairs = k.div_ceil(2);
        let mut inputs = vec![0u32; m * pairs];
        inputs
            .par_chunks_mut(pairs)
            .zip(x.par_chunks(k))
            // SAFETY: `available` said the CPU has AVX-512 BF16.
            .for_each(|(pairs, row)| unsafe { x86::round_row(row, pairs) });
        let dst = SharedDestination::new(out);
        if m <= ROWS_IN_PLACE {
            // Blocks of weight rows, a few per thread; each row read once, in order.
            let block = n.div_ceil(4 * rayon::current_num_threads()).max(1);
            // A lone row's weights are read as one stream: two rows at once, as two short ones,
            // took 1.5x the time (every output sums the same way either way).
            let weight_rows_a_tile = if m == 1 { 1 } else { WEIGHT_ROWS_A_TILE };
            (0..n.div_ceil(block)).into_par_iter().for_each(|b| {
                let end = ((b + 1) * block).min(n);
                let mut j = b * block;
                while j < end {
                    let weight_rows = weight_rows_a_tile.min(end - j);
                    let mut r0 = 0;
                    while r0 < m {
                        let rows = ROWS_A_TILE.min(m - r0);
                        // SAFETY: the CPU has AVX-512 BF16 (`available`); weight rows `j..j +
                        // weight_rows` have `k` values each, input rows `r0..r0 + rows` `pairs`
                        // pairs each; outputs `(r, j..)` lie in `out` and only this task writes
                        // these columns.
                        unsafe {
                            x86::in_place(
                                &inputs[r0 * pairs..(r0 + rows) * pairs],
                                rows,
                                &w[j * k..(j + weight_rows) * k],
                                weight_rows,
                                dst,
                                r0 * n + j,
                                n,
                            )
                        };
                        r0 += rows;
                    }
                    j += weight_rows;
                }
            });
            return;
        }
        (0..n.div_ceil(NR))
            .into_par_iter()
            .for_each_init(Vec::new, |panel: &mut Vec<u32>, p| {
                let j0 = p * NR;
                let cols = NR.min(n - j0);
                pack_panel(&w[j0 * k..(j0 + cols) * k], k, pairs, panel);
                let mut r0 = 0;
                while r0 < m {
                    let rows = MR.min(m - r0);
                    let tile = x86::Tile {
                        inputs: &inputs[r0 * pairs..(r0 + rows) * pairs],
                        pairs,
                        panel,
                        cols,
                    };
                    // SAFETY: the CPU has AVX-512 BF16 (`available`); the tile's rows `r0..r0 +
                    // rows` and columns `j0..j0 + cols` lie in `out` ([m, n], asserted above), and
                    // no other task writes these columns (one task a panel).
                    unsafe { tile.add_into(dst, r0 * n + j0, n, rows) };
                    r0 += rows;
                }
            });
    }
}

/// Packs weight rows (`cols` of them, `k` wide, row-major) into `panel`: pair `p` of column `c`
/// (its weights at input positions `2p` and `2p + 1`, the low half first) at `p·NR + c`, columns
/// past `cols` zero.
fn pack_panel(rows: &[bf16], k: usize, pairs: usize, panel: &mut Vec<u32>) {
    panel.clear();
    panel.resize(pairs * NR, 0);
    for (c, row) in rows.chunks_exact(k).enumerate() {
        let (whole, last) = row.as_chunks::<2>();
        for (p, pair) in whole.iter().enumerate() {
            panel[p * NR + c] = u32::from(pair[0].to_bits()) | u32::from(pair[1].to_bits()) << 16;
        }
        if let [value] = last {
            panel[whole.len() * NR + c] = u32::from(value.to_bits());
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{MR, NR, SharedDestination};

    /// Rounds `row` to bf16 (nearest even) into `pairs`, two values a pair, the first in the low
    /// half (a zero after an odd row's last value).
    ///
    /// # Safety
    /// The CPU must have AVX-512 BF16; `pairs.len() == row.len().div_ceil(2)`.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn round_row(row: &[f32], pairs: &mut [u32]) {
        debug_assert_eq!(pairs.len(), row.len().div_ceil(2));
        let (whole, rest) = row.as_chunks::<32>();
        for (values, out) in whole.iter().zip(pairs.chunks_exact_mut(16)) {
            // SAFETY: `values` holds 32 f32, `out` 16 u32 (64 bytes).
            unsafe {
                let lo = _mm512_loadu_ps(values.as_ptr());
                let hi = _mm512_loadu_ps(values.as_ptr().add(16));
                // The second operand's values go to the low half.
                let rounded: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
                _mm512_storeu_si512(out.as_mut_ptr().cast(), rounded);
            }
        }
        let done = whole.len() * 16;
        for (i, pair) in pairs[done..].iter_mut().enumerate() {
            let at = |j: usize| {
                rest.get(2 * i + j)
                    .map_or(0, |&v| u32::from(half::bf16::from_f32(v).to_bits()))
            };
            *pair = at(0) | at(1) << 16;
        }
    }

    /// Adds `inputs` (`rows` rows of bf16 pairs) times the `weight_rows` rows of `w` (in place:
    /// their pairs are what `vdpbf16ps` takes) into the destination at `at + r·stride + c`: each
    /// output sixteen lanes taking 32 values a step, the last step masked, then summed across.
    ///
    /// # Safety
    /// The CPU must have AVX-512 BF16; `w` holds `weight_rows` rows (1 or
    /// [`WEIGHT_ROWS_A_TILE`](super::WEIGHT_ROWS_A_TILE)) of `k` values, `inputs` `rows` (at most
    /// [`ROWS_A_TILE`](super::ROWS_A_TILE)) rows of `k.div_ceil(2)` pairs, and the outputs lie in
    /// the destination, written by no other thread meanwhile.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn in_place(
        inputs: &[u32],
        rows: usize,
        w: &[half::bf16],
        weight_rows: usize,
        dst: SharedDestination,
        at: usize,
        stride: usize,
    ) {
        let k = w.len() / weight_rows.max(1);
        macro_rules! tiles {
            ($nw:literal) => {
                // SAFETY: the caller's promises.
                unsafe {
                    match rows {
                        1 => in_place_tile::<1, $nw>(inputs, w, k, dst, at, stride),
                        2 => in_place_tile::<2, $nw>(inputs, w, k, dst, at, stride),
                        3 => in_place_tile::<3, $nw>(inputs, w, k, dst, at, stride),
                        4 => in_place_tile::<4, $nw>(inputs, w, k, dst, at, stride),
                        5 => in_place_tile::<5, $nw>(inputs, w, k, dst, at, stride),
                        6 => in_place_tile::<6, $nw>(inputs, w, k, dst, at, stride),
                        7 => in_place_tile::<7, $nw>(inputs, w, k, dst, at, stride),
                        _ => in_place_tile::<8, $nw>(inputs, w, k, dst, at, stride),
                    }
                }
            };
        }
        const { assert!(super::ROWS_A_TILE == 8 && super::WEIGHT_ROWS_A_TILE == 2) };
        if weight_rows == 1 {
            tiles!(1)
        } else {
            tiles!(2)
        }
    }

    /// # Safety
    /// As [`in_place`], with `R` input rows and `NW` weight rows.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[inline]
    unsafe fn in_place_tile<const R: usize, const NW: usize>(
        inputs: &[u32],
        w: &[half::bf16],
        k: usize,
        dst: SharedDestination,
        at: usize,
        stride: usize,
    ) {
        let pairs = k.div_ceil(2);
        debug_assert!(inputs.len() == R * pairs && w.len() == NW * k);
        // Input rows are bf16 values `pairs · 2` apart (an odd `k`'s padding zero between rows).
        let (x, wp) = (inputs.as_ptr().cast::<u16>(), w.as_ptr().cast::<u16>());
        let row_values = 2 * pairs;
        let mut acc = [[_mm512_setzero_ps(); NW]; R];
        let mut i = 0;
        while i < k {
            let left = k - i;
            let mask: __mmask32 = if left >= 32 { !0 } else { (1 << left) - 1 };
            // SAFETY: the masked lanes `i..i + left.min(32)` lie in every weight row and every
            // input row; masked-off lanes are not read (and read as zero).
            unsafe {
                let mut weights =
                    [std::mem::transmute::<__m512i, __m512bh>(_mm512_setzero_si512()); NW];
                for (c, weights) in weights.iter_mut().enumerate() {
                    *weights = std::mem::transmute::<__m512i, __m512bh>(_mm512_maskz_loadu_epi16(
                        mask,
                        wp.add(c * k + i).cast(),
                    ));
                }
                for (r, acc) in acc.iter_mut().enumerate() {
                    let xs: __m512bh = std::mem::transmute(_mm512_maskz_loadu_epi16(
                        mask,
                        x.add(r * row_values + i).cast(),
                    ));
                    for (acc, &weights) in acc.iter_mut().zip(&weights) {
                        *acc = _mm512_dpbf16_ps(*acc, xs, weights);
                    }
                }
            }
            i += 32;
        }
        for (r, acc) in acc.iter().enumerate() {
            for (c, &acc) in acc.iter().enumerate() {
                let sum = _mm512_reduce_add_ps(acc);
                // SAFETY: the caller's promise: the output lies in the destination.
                unsafe { *dst.at(at + r * stride + c) += sum };
            }
        }
    }

    /// Up to [`MR`] input rows, as bf16 pairs, against one packed panel.
    pub struct Tile<'a> {
        /// `rows · pairs` input pairs.
        pub inputs: &'a [u32],
        pub pairs: usize,
        /// `pairs · NR` weight pairs (see `pack_panel`).
        pub panel: &'a [u32],
        /// The panel's real columns (the rest are zero).
        pub cols: usize,
    }

    impl Tile<'_> {
        /// Adds the tile's `rows × cols` products into the destination at `at + r·stride + c`.
        ///
        /// # Safety
        /// The CPU must have AVX-512 BF16; every such position lies in the destination, and no
        /// other thread touches them meanwhile.
        #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
        pub unsafe fn add_into(
            &self,
            dst: SharedDestination,
            at: usize,
            stride: usize,
            rows: usize,
        ) {
            // SAFETY: the caller's promises.
            unsafe {
                match rows {
                    1 => self.rows::<1>(dst, at, stride),
                    2 => self.rows::<2>(dst, at, stride),
                    3 => self.rows::<3>(dst, at, stride),
                    4 => self.rows::<4>(dst, at, stride),
                    5 => self.rows::<5>(dst, at, stride),
                    6 => self.rows::<6>(dst, at, stride),
                    7 => self.rows::<7>(dst, at, stride),
                    8 => self.rows::<8>(dst, at, stride),
                    9 => self.rows::<9>(dst, at, stride),
                    10 => self.rows::<10>(dst, at, stride),
                    11 => self.rows::<11>(dst, at, stride),
                    _ => self.rows::<MR>(dst, at, stride),
                }
            }
        }

        /// # Safety
        /// As [`Tile::add_into`], with `R` rows in `inputs`.
        #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
        #[inline]
        unsafe fn rows<const R: usize>(&self, dst: SharedDestination, at: usize, stride: usize) {
            debug_assert!(
                self.inputs.len() == R * self.pairs && self.panel.len() == self.pairs * NR
            );
            let (inputs, panel) = (self.inputs.as_ptr(), self.panel.as_ptr());
            let mut acc = [[_mm512_setzero_ps(); 2]; R];
            for p in 0..self.pairs {
                // SAFETY: pair `p` of every row and the panel's row `p` lie in their slices.
                unsafe {
                    let w0: __m512bh =
                        std::mem::transmute(_mm512_loadu_si512(panel.add(p * NR).cast()));
                    let w1: __m512bh =
                        std::mem::transmute(_mm512_loadu_si512(panel.add(p * NR + 16).cast()));
                    for (r, acc) in acc.iter_mut().enumerate() {
                        let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(
                            *inputs.add(r * self.pairs + p) as i32,
                        ));
                        acc[0] = _mm512_dpbf16_ps(acc[0], x, w0);
                        acc[1] = _mm512_dpbf16_ps(acc[1], x, w1);
                    }
                }
            }
            for (r, acc) in acc.iter().enumerate() {
                for (half, &sum) in acc.iter().enumerate() {
                    let first = 16 * half;
                    if first >= self.cols {
                        break;
                    }
                    let lanes = (self.cols - first).min(16);
                    let mask: __mmask16 = if lanes == 16 { !0 } else { (1 << lanes) - 1 };
                    // SAFETY: the destination holds these `lanes` values (the caller's promise);
                    // masked lanes are neither read nor written.
                    unsafe {
                        let out = dst.at(at + r * stride + first);
                        let old = _mm512_maskz_loadu_ps(mask, out);
                        _mm512_mask_storeu_ps(out, mask, _mm512_add_ps(old, sum));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The product with the input rounded to bf16, in f64, in place (up to `ROWS_IN_PLACE` rows)
    /// and through panels (more); each row the same bits whatever rows come with it on either;
    /// widths and depths that leave partial panels, tiles, pairs and steps.
    #[test]
    fn matches_the_product_of_the_rounded_input_and_each_row_alone() {
        if !available() {
            eprintln!("no AVX-512 BF16 here: the bf16 GEMM is not run");
            return;
        }
        for (k, n) in [(1, 1), (7, 33), (64, 32), (301, 70), (96, 5)] {
            let w: Vec<bf16> = (0..n * k)
                .map(|i| bf16::from_f32(((i * 29 % 71) as f32 - 35.0) * 0.013))
                .collect();
            for m in [1, 2, 8, 9, 11, 12, 13, ROWS_IN_PLACE, ROWS_IN_PLACE + 1, 40] {
                let x: Vec<f32> = (0..m * k)
                    .map(|i| ((i * 17 % 43) as f32 - 21.0) * 0.0517)
                    .collect();
                let bias: Vec<f32> = (0..m * n).map(|i| (i % 7) as f32 * 0.25).collect();
                let mut out = bias.clone();
                linear(&mut out, &x, &w, [m, k, n]);
                for (i, &got) in out.iter().enumerate() {
                    let (r, j) = (i / n, i % n);
                    let want: f64 = f64::from(bias[i])
                        + (0..k)
                            .map(|p| {
                                f64::from(bf16::from_f32(x[r * k + p]).to_f32())
                                    * f64::from(w[j * k + p].to_f32())
                            })
                            .sum::<f64>();
                    assert!(
                        (f64::from(got) - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "{m}x{k} by {n}: [{r}, {j}] {got} vs {want}"
                    );
                }
                // Alone (in place), or beside as many rows as there are (through panels).
                let beside = m.max(ROWS_IN_PLACE + 1);
                for r in 0..m {
                    let mut alone = bias[r * n..(r + 1) * n].to_vec();
                    linear(&mut alone, &x[r * k..(r + 1) * k], &w, [1, k, n]);
                    if m > ROWS_IN_PLACE {
                        let mut many = vec![0.0; beside * n];
                        many[..n].copy_from_slice(&bias[r * n..(r + 1) * n]);
                        let mut xs = x[r * k..(r + 1) * k].to_vec();
                        xs.resize(beside * k, 0.5);
                        linear(&mut many, &xs, &w, [beside, k, n]);
                        alone = many[..n].to_vec();
                    }
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&alone),
                        bits(&out[r * n..(r + 1) * n]),
                        "row {r} of {m}, {k}x{n}"
                    );
                }
            }
        }
    }
}
