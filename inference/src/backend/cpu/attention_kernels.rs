//! The inner loops of CPU attention, for one block of query rows against one block of keys: the
//! scores (queries × keys), the online softmax's row kernels (the maximum, then each score's
//! weight 2^(x − max) and their sum: the queries come scaled by the attention's scale and log2 e,
//! so a score is already in powers of two), and the weighted sum of the values. At long context these
//! are all of a prefill (every query meets every earlier key), so they are compiled three times —
//! for AVX-512, for AVX2 and for the baseline target (SSE2 on x86-64) — and the widest the CPU has
//! is picked at run time; the baseline build alone ran them four floats at a time, and the `gemm`
//! crate's AVX2 kernels, with their packing and dispatch per call, were much slower on blocks
//! this small (a head's 32 to 128 columns).
//!
//! Every version does the same float operations in the same order — a score or an output value
//! is one fused multiply-add per term, terms in key (or column) order, whatever tile it is in; the
//! softmax keeps LANES running maxima and sums; Rust never contracts `a * b + c` on its own — so
//! results are bit-identical whichever version runs and wherever a row sits in its block: a
//! prompt's answer depends neither on the CPU it was served on nor on how its prefill was cut.
//! (Without hardware FMA, as on x86-64 CPUs older than 2013, `mul_add` is a slow library call.)

#![allow(unsafe_code)]

#[cfg(target_arch = "x86_64")]
use super::cpu_features::{has_avx2, has_avx512};

/// Rows of a matrix `stride` floats apart in `data`.
#[derive(Clone, Copy)]
pub struct Strided<'a> {
    pub data: &'a [f32],
    pub stride: usize,
}

/// Fills `scores` (`nq × nb`, row-major) with `q · kᵀ`: `q` holds `nq` query rows of `hd` values;
/// `keys_t` the block's keys transposed (`hd` rows of `nb`: column `j` is key `j`).
pub fn scores(
    q: Strided<'_>,
    nq: usize,
    keys_t: Strided<'_>,
    nb: usize,
    hd: usize,
    scores: &mut [f32],
) {
    compute(&mut Scores {
        q,
        keys_t,
        scores,
        block: Block { nq, nb, hd },
    })
}

/// Adds `weights · values` to `out` (`nq × hd`, row-major): `weights` is `nq × nb` (a softmax's
/// unnormalised weights, zero where a key is hidden), `values` holds `nb` rows of `hd` values.
pub fn add_weighted_values(
    weights: &[f32],
    nq: usize,
    values: Strided<'_>,
    nb: usize,
    hd: usize,
    out: &mut [f32],
) {
    compute(&mut WeightedValues {
        weights,
        values,
        out,
        block: Block { nq, nb, hd },
    })
}

/// The two products of one block of keys in a task's attention (see `cpu::attend`): the task's
/// query rows by the block's keys, and the block's softmax weights by its values.
pub trait BlockProducts {
    /// Fills `scores` (`nq × nb`, row-major) with the queries by the block's keys (`keys_t`:
    /// the keys transposed, from the block's first).
    fn scores(&mut self, keys_t: Strided<'_>, nb: usize, scores: &mut [f32]);

    /// Adds `weights · values` to `out` (`nq × hd`): `weights` is `nq × nb`, `values` the
    /// block's `nb` rows of `hd`.
    fn add_weighted_values(
        &mut self,
        weights: &[f32],
        values: Strided<'_>,
        nb: usize,
        out: &mut [f32],
    );
}

/// The products in f32, by [`scores`] and [`add_weighted_values`]: every CPU's.
pub struct F32Products<'a> {
    /// `nq` rows of `hd`.
    pub queries: Strided<'a>,
    pub nq: usize,
    pub hd: usize,
}

impl BlockProducts for F32Products<'_> {
    fn scores(&mut self, keys_t: Strided<'_>, nb: usize, out: &mut [f32]) {
        scores(self.queries, self.nq, keys_t, nb, self.hd, out)
    }

    fn add_weighted_values(
        &mut self,
        weights: &[f32],
        values: Strided<'_>,
        nb: usize,
        out: &mut [f32],
    ) {
        add_weighted_values(weights, self.nq, values, nb, self.hd, out)
    }
}

/// Computes `product` with the widest tiles the CPU has registers for.
fn compute(product: &mut impl Tiles) {
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx512() {
            // SAFETY: the CPU has the features the function is compiled for.
            return unsafe { x86::every_tile_avx512(product) };
        }
        if has_avx2() {
            // SAFETY: as above.
            return unsafe { x86::every_tile_avx2(product) };
        }
    }
    every_tile::<4, 8>(product)
}

/// A block's dimensions: query rows, keys, head dimension.
#[derive(Clone, Copy)]
struct Block {
    nq: usize,
    nb: usize,
    hd: usize,
}

/// A product computed a tile at a time: `tile::<R, W>(i0, c0)` computes its rows `i0..i0 + R`,
/// columns `c0..c0 + W`, with `R × W` accumulators held in registers.
trait Tiles {
    /// The product's rows and columns.
    fn shape(&self) -> (usize, usize);
    fn tile<const R: usize, const W: usize>(&mut self, i0: usize, c0: usize);
}

/// Computes all of `product`: tiles of `R` rows × `W` columns, the rows past the last of them in
/// tiles of 4 (when `R` is larger), then single rows; the columns past the last `W`-wide tile in
/// tiles of 16 (when `W` is wider) and 8, then one at a time.
#[inline(always)]
fn every_tile<const R: usize, const W: usize>(product: &mut impl Tiles) {
    let (rows, cols) = product.shape();
    let full_rows = rows / R * R;
    for i0 in (0..full_rows).step_by(R) {
        tiles_of_rows::<R, W>(product, i0, cols);
    }
    let fours = if R > 4 {
        full_rows + (rows - full_rows) / 4 * 4
    } else {
        full_rows
    };
    for i0 in (full_rows..fours).step_by(4) {
        tiles_of_rows::<4, W>(product, i0, cols);
    }
    for i0 in fours..rows {
        tiles_of_rows::<1, W>(product, i0, cols);
    }
}

/// Every tile of rows `i0..i0 + R`.
#[inline(always)]
fn tiles_of_rows<const R: usize, const W: usize>(product: &mut impl Tiles, i0: usize, cols: usize) {
    let wide = cols / W * W;
    let sixteen = if W > 16 {
        wide + (cols - wide) / 16 * 16
    } else {
        wide
    };
    let eight = sixteen + (cols - sixteen) / 8 * 8;
    for c0 in (0..wide).step_by(W) {
        product.tile::<R, W>(i0, c0);
    }
    for c0 in (wide..sixteen).step_by(16) {
        product.tile::<R, 16>(i0, c0);
    }
    for c0 in (sixteen..eight).step_by(8) {
        product.tile::<R, 8>(i0, c0);
    }
    for c0 in eight..cols {
        product.tile::<R, 1>(i0, c0);
    }
}

/// `scores`' product: every score accumulated over `d` in order from zero, whatever tile computes
/// it.
struct Scores<'a> {
    q: Strided<'a>,
    keys_t: Strided<'a>,
    scores: &'a mut [f32],
    block: Block,
}

impl Tiles for Scores<'_> {
    fn shape(&self) -> (usize, usize) {
        (self.block.nq, self.block.nb)
    }

    #[inline(always)]
    fn tile<const R: usize, const W: usize>(&mut self, i0: usize, j0: usize) {
        let Block { nb, hd, .. } = self.block;
        let (q, keys_t) = (self.q, self.keys_t);
        let mut acc = [[0.0f32; W]; R];
        for d in 0..hd {
            let k = &keys_t.data[d * keys_t.stride + j0..][..W];
            for (r, acc) in acc.iter_mut().enumerate() {
                let qv = q.data[(i0 + r) * q.stride + d];
                for (a, &kv) in acc.iter_mut().zip(k) {
                    *a = qv.mul_add(kv, *a);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            self.scores[(i0 + r) * nb + j0..][..W].copy_from_slice(acc);
        }
    }
}

/// `add_weighted_values`' product: every output value accumulates its terms in key order,
/// whatever tile computes it.
struct WeightedValues<'a> {
    weights: &'a [f32],
    values: Strided<'a>,
    out: &'a mut [f32],
    block: Block,
}

impl Tiles for WeightedValues<'_> {
    fn shape(&self) -> (usize, usize) {
        (self.block.nq, self.block.hd)
    }

    #[inline(always)]
    fn tile<const R: usize, const W: usize>(&mut self, i0: usize, c0: usize) {
        let Block { nb, hd, .. } = self.block;
        let values = self.values;
        let mut acc = [[0.0f32; W]; R];
        for (r, acc) in acc.iter_mut().enumerate() {
            acc.copy_from_slice(&self.out[(i0 + r) * hd + c0..][..W]);
        }
        for j in 0..nb {
            let v = &values.data[j * values.stride + c0..][..W];
            for (r, acc) in acc.iter_mut().enumerate() {
                let w = self.weights[(i0 + r) * nb + j];
                for (a, &vv) in acc.iter_mut().zip(v) {
                    *a = w.mul_add(vv, *a);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            self.out[(i0 + r) * hd + c0..][..W].copy_from_slice(acc);
        }
    }
}

/// Running maxima and sums kept apart, so that the loops compile to SIMD (a float sum or maximum
/// in one accumulator is a chain the compiler may not reorder): one AVX-512 register.
const LANES: usize = 16;

/// The largest value of `row`.
pub fn row_max(row: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx512() {
            // SAFETY: the CPU has the features the function is compiled for.
            return unsafe { x86::row_max_avx512(row) };
        }
        if has_avx2() {
            // SAFETY: as above.
            return unsafe { x86::row_max_avx2(row) };
        }
    }
    row_max_portable(row)
}

/// Replaces each `x` of `row` by 2^(x − max) (`max` at least every `x`); returns their sum.
pub fn exp2_and_sum(row: &mut [f32], max: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx512() {
            // SAFETY: the CPU has the features the function is compiled for.
            return unsafe { x86::exp2_and_sum_avx512(row, max) };
        }
        if has_avx2() {
            // SAFETY: as above.
            return unsafe { x86::exp2_and_sum_avx2(row, max) };
        }
    }
    exp2_and_sum_portable(row, max)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Tiles, every_tile};

    // Tiles: 8 rows × 32 floats is 16 of AVX-512's 32 registers; 6 × 16 is 12 of AVX2's 16 (the
    // other four hold a row of the right operand and a broadcast), enough independent sums to
    // keep both FMA units busy through their latency.

    #[target_feature(enable = "avx512f,fma")]
    pub fn every_tile_avx512(product: &mut impl Tiles) {
        every_tile::<8, 32>(product)
    }

    #[target_feature(enable = "avx2,fma")]
    pub fn every_tile_avx2(product: &mut impl Tiles) {
        every_tile::<6, 16>(product)
    }

    #[target_feature(enable = "avx512f,fma")]
    pub fn row_max_avx512(row: &[f32]) -> f32 {
        super::row_max_portable(row)
    }

    #[target_feature(enable = "avx2,fma")]
    pub fn row_max_avx2(row: &[f32]) -> f32 {
        super::row_max_portable(row)
    }

    #[target_feature(enable = "avx512f,fma")]
    pub fn exp2_and_sum_avx512(row: &mut [f32], max: f32) -> f32 {
        super::exp2_and_sum_portable(row, max)
    }

    #[target_feature(enable = "avx2,fma")]
    pub fn exp2_and_sum_avx2(row: &mut [f32], max: f32) -> f32 {
        super::exp2_and_sum_portable(row, max)
    }
}

/// The loop every version compiles (inlined into the feature-enabled functions above).
#[inline(always)]
fn row_max_portable(row: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for chunk in &mut chunks {
        for (&x, max) in chunk.iter().zip(&mut lanes) {
            if x > *max {
                *max = x;
            }
        }
    }
    let max = lanes.into_iter().fold(f32::NEG_INFINITY, f32::max);
    chunks.remainder().iter().fold(max, |max, &x| max.max(x))
}

#[inline(always)]
fn exp2_and_sum_portable(row: &mut [f32], max: f32) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let mut chunks = row.chunks_exact_mut(LANES);
    for chunk in &mut chunks {
        for (x, sum) in chunk.iter_mut().zip(&mut lanes) {
            *x = exp2_nonpositive(*x - max);
            *sum += *x;
        }
    }
    let mut sum: f32 = lanes.iter().sum();
    for x in chunks.into_remainder() {
        *x = exp2_nonpositive(*x - max);
        sum += *x;
    }
    sum
}

/// 2^x for x ≤ 0, within 2 ulp of `f32::exp2`: x = n + r with n the nearest integer (|r| ≤ 1/2,
/// exact), a degree-6 polynomial for 2^r (fitted for relative error on [−1/2, 1/2]), 2^n put into
/// the exponent bits, in straight-line float and integer arithmetic that the softmax loop
/// vectorizes. With the scores in powers of two, the range reduction is one subtraction where
/// e^x's took two fused multiply-adds and a product, and no pass multiplies the scores by the
/// scale (the softmax had been a large share of a long prefill's time; measured against e^x by
/// `benches/long_prefill.rs`). Below −126 (where 2^x leaves the normal floats) it gives
/// 2^−126 × 2^r ≈ 1e−38, a weight no sum of ones can see.
#[inline(always)]
pub(super) fn exp2_nonpositive(x: f32) -> f32 {
    // 1.5 · 2^23: adding it rounds to an integer, held in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let x = x.max(-126.0);
    let shifted = x + ROUND;
    let r = x - (shifted - ROUND);
    let mut p = 1.535_335e-4_f32;
    p = p.mul_add(r, 1.339_887_5e-3);
    p = p.mul_add(r, 9.618_438e-3);
    p = p.mul_add(r, 5.550_332_4e-2);
    p = p.mul_add(r, 2.402_264_8e-1);
    p = p.mul_add(r, 6.931_472e-1);
    p = p.mul_add(r, 1.0);
    // n's bits as an integer: the low bits of `shifted` (|n| ≤ 126 here).
    let n = shifted.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
    p * f32::from_bits(((n + 127) as u32) << 23)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_softmax_exp2_is_within_two_ulp_of_libm() {
        let ulps = |a: f32, b: f32| (a.to_bits() as i64 - b.to_bits() as i64).abs();
        let mut worst = 0;
        for i in 0..=1_260_000 {
            let x = -(i as f32) * 1e-4;
            worst = worst.max(ulps(exp2_nonpositive(x), x.exp2()));
        }
        assert!(worst <= 2, "{worst} ulp");
        assert_eq!(exp2_nonpositive(0.0), 1.0);
        assert_eq!(exp2_nonpositive(-3.0), 0.125);
        assert!(exp2_nonpositive(-1e30) < 1e-37);
    }

    #[test]
    fn every_compiled_version_gives_the_same_bits() {
        // Rows with and without a remainder past the lanes; scores spread over [-40, 40).
        for len in [1, 15, 16, 100, 256] {
            let row: Vec<f32> = (0..len)
                .map(|i| ((i as u32).wrapping_mul(2_654_435_761) >> 8) as f32 / 209_715.2 - 40.0)
                .collect();
            let run = |max_of: fn(&[f32]) -> f32, exp2_sum: fn(&mut [f32], f32) -> f32| {
                let mut r = row.clone();
                let max = max_of(&r);
                let sum = exp2_sum(&mut r, max);
                (
                    r.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    max.to_bits(),
                    sum.to_bits(),
                )
            };
            let portable = run(row_max_portable, exp2_and_sum_portable);
            assert_eq!(run(row_max, exp2_and_sum), portable, "len {len}");
            #[cfg(target_arch = "x86_64")]
            if has_avx2() {
                // SAFETY: the CPU has AVX2.
                let avx2 = run(
                    |r| unsafe { x86::row_max_avx2(r) },
                    |r, m| unsafe { x86::exp2_and_sum_avx2(r, m) },
                );
                assert_eq!(avx2, portable, "len {len}");
            }
        }
    }

    #[test]
    fn scores_and_weighted_values_have_the_same_bits_in_every_tile() {
        // Sizes off every tile's width and height; each value compared with the one-at-a-time
        // version's (every tile edge is crossed).
        for (nq, nb, hd) in [(13, 37, 24), (9, 64, 16), (17, 45, 40), (8, 32, 32)] {
            let data = |n: usize, seed: u32| -> Vec<f32> {
                (0..n)
                    .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / 4e9 - 0.5)
                    .collect()
            };
            let (q, keys_t, values) = (data(nq * hd, 1), data(hd * nb, 2), data(nb * hd, 3));
            let q = Strided {
                data: &q,
                stride: hd,
            };
            let keys_t = Strided {
                data: &keys_t,
                stride: nb,
            };
            let values = Strided {
                data: &values,
                stride: hd,
            };
            let block = Block { nq, nb, hd };
            let mut want = vec![0.0; nq * nb];
            every_tile::<1, 1>(&mut Scores {
                q,
                keys_t,
                scores: &mut want,
                block,
            });
            let mut got = vec![0.0; nq * nb];
            scores(q, nq, keys_t, nb, hd, &mut got);
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(g, w)| g.to_bits() == w.to_bits())
            );
            let mut want_out = data(nq * hd, 4);
            let mut got_out = want_out.clone();
            every_tile::<1, 1>(&mut WeightedValues {
                weights: &want,
                values,
                out: &mut want_out,
                block,
            });
            add_weighted_values(&want, nq, values, nb, hd, &mut got_out);
            assert!(
                got_out
                    .iter()
                    .zip(&want_out)
                    .all(|(g, w)| g.to_bits() == w.to_bits())
            );
        }
    }
}
