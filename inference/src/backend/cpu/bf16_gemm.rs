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
//! ([`super::CpuBackend::with_bf16_inputs`]), for every matrix of a bf16 checkpoint.
//!
//! **Layout.** A weight is packed once, when it is uploaded ([`Bf16Panels`]): panels of [`NR`]
//! weight rows (output columns), each stored so that one 64-byte load holds, for each of 16 lanes'
//! columns, the two weights of one pair of input positions (`vdpbf16ps`'s operand). Every input row
//! runs through every panel, [`MR`] rows a tile (`2·MR` accumulators, two weight vectors and a
//! broadcast input pair fill the 32 registers), a panel read from memory as one stream. An output
//! is one lane summing its pairs in input order, whatever tile or panel it is in: a row's result
//! does not depend on the rows beside it, so a sequence decodes to the same values alone or in a
//! batch. (Decoding with the weights as stored, each row against the inputs in place, loads both
//! operands of every instruction: a batch of eight ran at about a third of this kernel's rate.)

#![allow(unsafe_code)]

use half::bf16;
use rayon::prelude::*;

use super::gemm::SharedDestination;

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

/// A bf16 weight matrix (`rows` outputs of `cols` inputs) packed for [`linear`]: panel `p` holds
/// rows `p·NR..(p + 1)·NR`, pair `q` of its row `c` (the weights of inputs `2q` and `2q + 1`, the
/// first in the low half) at `(p·pairs + q)·NR + c`; rows past the last and an odd `cols`' last
/// pair's high half are zero.
#[derive(Debug, Clone, PartialEq)]
pub struct Bf16Panels {
    data: Vec<u32>,
    rows: usize,
    cols: usize,
}

impl Bf16Panels {
    /// Packs `w` (`[rows, cols]`, row-major) on the current rayon pool.
    pub fn pack(w: &[bf16], rows: usize, cols: usize) -> Self {
        assert_eq!(w.len(), rows * cols, "Bf16Panels::pack: {rows}x{cols}");
        let pairs = cols.div_ceil(2);
        let mut data = vec![0u32; rows.div_ceil(NR) * pairs * NR];
        if pairs > 0 {
            data.par_chunks_mut(pairs * NR)
                .enumerate()
                .for_each(|(p, panel)| {
                    let first = p * NR;
                    let last = (first + NR).min(rows);
                    pack_panel(&w[first * cols..last * cols], cols, panel);
                });
        }
        Bf16Panels { data, rows, cols }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Weights held (`rows · cols`).
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held (with the last panel's padding).
    pub fn bytes(&self) -> usize {
        4 * self.data.len()
    }

    fn pairs(&self) -> usize {
        self.cols.div_ceil(2)
    }

    /// Row `j` (an embedding table's row) widened to f32 into `out` (`cols` values).
    pub fn row_to_f32(&self, j: usize, out: &mut [f32]) {
        let base = j / NR * self.pairs() * NR + j % NR;
        for (c, out) in out.iter_mut().enumerate().take(self.cols) {
            let pair = self.data[base + c / 2 * NR];
            let bits = (pair >> (16 * (c % 2))) as u16;
            *out = bf16::from_bits(bits).to_f32();
        }
    }

    /// The matrix widened to f32, row-major.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.len()];
        if self.cols > 0 {
            for (j, row) in out.chunks_exact_mut(self.cols).enumerate() {
                self.row_to_f32(j, row);
            }
        }
        out
    }
}

/// `bf16(x[m, k]) · w[n, k]ᵀ (+ bias[n])` on the current rayon pool, `x` rounded to bf16 (to
/// nearest even) and the products summed in f32: a new `[m, n]` output, each value written once
/// (no pass zeroing it first, none reading it back). The CPU must have what [`available`] checks.
pub fn linear(x: &[f32], w: &Bf16Panels, m: usize, bias: Option<&[f32]>) -> Vec<f32> {
    let (n, k) = (w.rows, w.cols);
    assert!(
        available() && x.len() == m * k && bias.is_none_or(|b| b.len() == n),
        "bf16_gemm::linear: x {} for {m}x{k}, w {n}x{k}, bias {:?}",
        x.len(),
        bias.map(<[f32]>::len)
    );
    if m == 0 || n == 0 || k == 0 {
        return match bias {
            Some(b) if k == 0 => b.repeat(m),
            _ => vec![0.0; m * n],
        };
    }
    let mut out = Vec::with_capacity(m * n);
    #[cfg(target_arch = "x86_64")]
    {
        // Pairs of input positions a row: an odd `k` gets a zero beside its last value.
        let pairs = w.pairs();
        let mut inputs = vec![0u32; m * pairs];
        inputs
            .par_chunks_mut(pairs)
            .zip(x.par_chunks(k))
            // SAFETY: `available` said the CPU has AVX-512 BF16.
            .for_each(|(pairs, row)| unsafe { x86::round_row(row, pairs) });
        let dst = SharedDestination::new_uninit(&mut out.spare_capacity_mut()[..m * n]);
        w.data
            .par_chunks(pairs * NR)
            .enumerate()
            .for_each(|(p, panel)| {
                let j0 = p * NR;
                let cols = NR.min(n - j0);
                let write = x86::Write::Set(bias.map(|b| &b[j0..j0 + cols]));
                // SAFETY: the CPU has AVX-512 BF16 (`available`); rows `0..m`, columns `j0..j0 +
                // cols` lie in `out`'s `m · n` values, and no other task writes these columns
                // (one task a panel); `Set` writes without reading.
                unsafe {
                    x86::column_of_tiles(
                        (&inputs, m, pairs),
                        (panel, NR, cols),
                        (dst, j0, n),
                        write,
                    )
                };
            });
        // SAFETY: the panels' tiles wrote every row's every column: all `m · n` values.
        unsafe { out.set_len(m * n) };
    }
    out
}

/// `out[r·out_stride + c] = Σ_q inputs[r·pairs + q] · b[q·b_stride + c]` for rows `r < rows` and
/// columns `c < cols` (added to what `out` holds when `accumulate`), on the calling thread: the
/// products of CPU attention's blocks in bf16 (queries by keys, softmax weights by values), as
/// pairs of bf16 (two inputs' values, the first in the low half) summed in f32 as [`linear`]
/// sums them. `b` must hold `cols` rounded up to [`NR`] columns a row (what a row holds past
/// `cols` is read, and only changes outputs that are not written). The CPU must have what
/// [`available`] checks.
pub fn pair_product(
    (inputs, rows, pairs): (&[u32], usize, usize),
    (b, b_stride): (&[u32], usize),
    cols: usize,
    (out, out_stride): (&mut [f32], usize),
    accumulate: bool,
) {
    if rows == 0 || cols == 0 {
        return;
    }
    let padded = cols.div_ceil(NR) * NR;
    assert!(
        available()
            && inputs.len() >= rows * pairs
            && b_stride >= padded
            && (pairs == 0 || b.len() >= (pairs - 1) * b_stride + padded)
            && out.len() >= (rows - 1) * out_stride + cols
            && out_stride >= cols,
        "bf16_gemm::pair_product: {rows}x{pairs} pairs by {cols} columns {b_stride} apart"
    );
    #[cfg(target_arch = "x86_64")]
    {
        let dst = SharedDestination::new(out);
        let write = match accumulate {
            true => x86::Write::Add,
            false => x86::Write::Set(None),
        };
        for c0 in (0..cols).step_by(NR) {
            let b = (&b[c0..], b_stride, NR.min(cols - c0));
            // SAFETY: the CPU has AVX-512 BF16 (`available`); the tiles read `NR` columns of
            // `pairs` rows of `b` from `c0` (in `b`, asserted above) and write rows `0..rows`,
            // columns `c0..c0 + NR.min(cols - c0)` of `out` (asserted above), which only this
            // thread holds.
            unsafe { x86::column_of_tiles((inputs, rows, pairs), b, (dst, c0, out_stride), write) };
        }
    }
}

/// `row` rounded to bf16 (to nearest even) as pairs (see [`pair_product`]), a zero after an odd
/// row's last value. The CPU must have what [`available`] checks.
pub fn round_to_pairs(row: &[f32], pairs: &mut [u32]) {
    assert!(
        available() && pairs.len() == row.len().div_ceil(2),
        "bf16_gemm::round_to_pairs: {} values into {} pairs",
        row.len(),
        pairs.len()
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `available` said the CPU has AVX-512 BF16; the lengths are checked above.
    unsafe {
        x86::round_row(row, pairs)
    }
}

/// `out[i]` = the pair of `first[i]` and `second[i]` rounded to bf16 (to nearest even; `first` in
/// the low half): two rows of an operand whose pairs run down its columns (an attention block's
/// transposed keys, two head dimensions; its values, two keys). The CPU must have what
/// [`available`] checks.
pub fn interleave_to_pairs(first: &[f32], second: &[f32], out: &mut [u32]) {
    assert!(
        available() && first.len() == out.len() && second.len() == out.len(),
        "bf16_gemm::interleave_to_pairs: {} and {} values into {} pairs",
        first.len(),
        second.len(),
        out.len()
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `available` said the CPU has AVX-512 BF16; the lengths are checked above.
    unsafe {
        x86::interleave(first, second, out)
    }
}

/// Packs weight rows (up to `NR` of them, `k` wide, row-major) into `panel` (zeros, `pairs · NR`
/// values): pair `q` of row `c` at `q·NR + c`.
fn pack_panel(rows: &[bf16], k: usize, panel: &mut [u32]) {
    for (c, row) in rows.chunks_exact(k).enumerate() {
        let (whole, last) = row.as_chunks::<2>();
        for (q, pair) in whole.iter().enumerate() {
            panel[q * NR + c] = u32::from(pair[0].to_bits()) | u32::from(pair[1].to_bits()) << 16;
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

    /// See [`super::interleave_to_pairs`].
    ///
    /// # Safety
    /// The CPU must have AVX-512 BF16; the three slices are as long.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn interleave(first: &[f32], second: &[f32], out: &mut [u32]) {
        debug_assert!(first.len() == out.len() && second.len() == out.len());
        let whole = out.len() / 16 * 16;
        for i in (0..whole).step_by(16) {
            // SAFETY: `i + 16 <= whole`, within all three slices.
            unsafe {
                let low: __m256i =
                    std::mem::transmute(_mm512_cvtneps_pbh(_mm512_loadu_ps(first.as_ptr().add(i))));
                let high: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(_mm512_loadu_ps(
                    second.as_ptr().add(i),
                )));
                let pairs = _mm512_or_si512(
                    _mm512_cvtepu16_epi32(low),
                    _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(high)),
                );
                _mm512_storeu_si512(out.as_mut_ptr().add(i).cast(), pairs);
            }
        }
        for i in whole..out.len() {
            let bits = |v: f32| u32::from(half::bf16::from_f32(v).to_bits());
            out[i] = bits(first[i]) | bits(second[i]) << 16;
        }
    }

    /// The products of all `rows` input rows (`pairs` each, row after row) with one panel's
    /// `cols` columns (`pairs` rows of at least `NR`, `panel_stride` apart), [`MR`] rows a tile,
    /// written at `at + r·stride + c` as `write` says.
    ///
    /// # Safety
    /// As [`Tile::write_into`], for every row and column.
    pub unsafe fn column_of_tiles(
        (inputs, rows, pairs): (&[u32], usize, usize),
        (panel, panel_stride, cols): (&[u32], usize, usize),
        (dst, at, stride): (SharedDestination, usize, usize),
        write: Write<'_>,
    ) {
        let mut r0 = 0;
        while r0 < rows {
            let tile_rows = MR.min(rows - r0);
            let tile = Tile {
                inputs: &inputs[r0 * pairs..(r0 + tile_rows) * pairs],
                pairs,
                panel,
                panel_stride,
                cols,
            };
            // SAFETY: the caller's promises, for these rows.
            unsafe { tile.write_into(dst, at + r0 * stride, stride, tile_rows, write) };
            r0 += tile_rows;
        }
    }

    /// What a tile does with its sums.
    #[derive(Clone, Copy)]
    pub enum Write<'a> {
        /// Adds them to the values there.
        Add,
        /// Stores them (plus, in each row, these values: a bias from the tile's first column),
        /// reading nothing there.
        Set(Option<&'a [f32]>),
    }

    /// Up to [`MR`] input rows, as bf16 pairs, against [`NR`] columns of pairs.
    pub struct Tile<'a> {
        /// `rows · pairs` input pairs.
        pub inputs: &'a [u32],
        pub pairs: usize,
        /// `pairs` rows of at least `NR` pairs, `panel_stride` apart (a packed weight's panel,
        /// see `pack_panel`, or a block of an attention's keys or values).
        pub panel: &'a [u32],
        pub panel_stride: usize,
        /// The columns written (the rest are read and dropped).
        pub cols: usize,
    }

    impl Tile<'_> {
        /// Writes the tile's `rows × cols` products into the destination at `at + r·stride + c`
        /// as `write` says.
        ///
        /// # Safety
        /// The CPU must have AVX-512 BF16; every such position lies in the destination (and
        /// holds a value, to [`Write::Add`] to), and no other thread touches them meanwhile.
        #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
        pub unsafe fn write_into(
            &self,
            dst: SharedDestination,
            at: usize,
            stride: usize,
            rows: usize,
            write: Write<'_>,
        ) {
            let to = (dst, at, stride, write);
            // SAFETY: the caller's promises.
            unsafe {
                match rows {
                    1 => self.rows::<1>(to),
                    2 => self.rows::<2>(to),
                    3 => self.rows::<3>(to),
                    4 => self.rows::<4>(to),
                    5 => self.rows::<5>(to),
                    6 => self.rows::<6>(to),
                    7 => self.rows::<7>(to),
                    8 => self.rows::<8>(to),
                    9 => self.rows::<9>(to),
                    10 => self.rows::<10>(to),
                    11 => self.rows::<11>(to),
                    _ => self.rows::<MR>(to),
                }
            }
        }

        /// # Safety
        /// As [`Tile::write_into`], with `R` rows in `inputs`.
        #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
        #[inline]
        unsafe fn rows<const R: usize>(
            &self,
            (dst, at, stride, write): (SharedDestination, usize, usize, Write<'_>),
        ) {
            debug_assert!(
                self.inputs.len() == R * self.pairs
                    && (self.pairs == 0
                        || self.panel.len() >= (self.pairs - 1) * self.panel_stride + NR)
            );
            let (inputs, panel) = (self.inputs.as_ptr(), self.panel.as_ptr());
            let mut acc = [[_mm512_setzero_ps(); 2]; R];
            for p in 0..self.pairs {
                // SAFETY: pair `p` of every row and the panel's row `p` lie in their slices.
                unsafe {
                    let row = panel.add(p * self.panel_stride);
                    let w0: __m512bh = std::mem::transmute(_mm512_loadu_si512(row.cast()));
                    let w1: __m512bh = std::mem::transmute(_mm512_loadu_si512(row.add(16).cast()));
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
                        let value = match write {
                            Write::Add => _mm512_add_ps(_mm512_maskz_loadu_ps(mask, out), sum),
                            Write::Set(None) => sum,
                            Write::Set(Some(bias)) => _mm512_add_ps(
                                sum,
                                _mm512_maskz_loadu_ps(mask, bias.as_ptr().add(first)),
                            ),
                        };
                        _mm512_mask_storeu_ps(out, mask, value);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The product with the input rounded to bf16, in f64; each row the same bits alone or among
    /// others; widths and depths that leave partial panels, tiles and pairs.
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
            let panels = Bf16Panels::pack(&w, n, k);
            for m in [1, 2, 11, 12, 13, 40] {
                let x: Vec<f32> = (0..m * k)
                    .map(|i| ((i * 17 % 43) as f32 - 21.0) * 0.0517)
                    .collect();
                // With a bias and without (every value written once, nothing read).
                let bias: Vec<f32> = (0..n).map(|j| (j % 7) as f32 * 0.25).collect();
                let bias = (m % 2 == 1).then_some(&bias[..]);
                let out = linear(&x, &panels, m, bias);
                assert_eq!(out.len(), m * n);
                for (i, &got) in out.iter().enumerate() {
                    let (r, j) = (i / n, i % n);
                    let want: f64 = f64::from(bias.map_or(0.0, |b| b[j]))
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
                for r in 0..m {
                    let alone = linear(&x[r * k..(r + 1) * k], &panels, 1, bias);
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

    /// Packed weights read back as they were: whole, and a row at a time (an embedding's lookup).
    #[test]
    fn packed_weights_read_back_exactly() {
        for (rows, cols) in [(0, 3), (1, 1), (5, 7), (33, 64), (70, 301)] {
            let w: Vec<bf16> = (0..rows * cols)
                .map(|i| bf16::from_f32(((i * 13 % 97) as f32 - 48.0) * 0.021))
                .collect();
            let panels = Bf16Panels::pack(&w, rows, cols);
            let widened: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
            assert_eq!(panels.to_f32(), widened, "{rows}x{cols}");
            assert_eq!(panels.len(), rows * cols);
            for j in 0..rows {
                let mut row = vec![0.0; cols];
                panels.row_to_f32(j, &mut row);
                assert_eq!(
                    row,
                    widened[j * cols..(j + 1) * cols],
                    "row {j} of {rows}x{cols}"
                );
            }
        }
    }
}
