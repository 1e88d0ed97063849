//! The row kernels of attention's online softmax: scale a block of scores and take its maximum,
//! then replace each score by its weight e^(x − max) and sum them. At long context these are a
//! third of a prefill (every query meets every earlier key), so they are compiled three times —
//! for AVX-512, for AVX2 and for the baseline x86-64 (SSE2) — and the widest the CPU has is picked
//! at run time; the baseline build alone ran them four floats at a time.
//!
//! Every version does the same float operations in the same order (LANES running maxima and sums,
//! no fused multiply-adds: Rust never contracts `a * b + c`), so the weights are bit-identical
//! whichever one runs, and a prompt's answer does not depend on the CPU it was served on.

#![allow(unsafe_code)]

/// Running maxima and sums kept apart, so that the loops compile to SIMD (a float sum or maximum
/// in one accumulator is a chain the compiler may not reorder): one AVX-512 register.
const LANES: usize = 16;

/// Multiplies `row` by `scale` in place; returns its largest value.
pub fn scale_and_max(row: &mut [f32], scale: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has the feature the function is compiled for.
            return unsafe { x86::scale_and_max_avx512(row, scale) };
        }
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: as above.
            return unsafe { x86::scale_and_max_avx2(row, scale) };
        }
    }
    scale_and_max_portable(row, scale)
}

/// Replaces each `x` of `row` by e^(x − max) (`max` at least every `x`); returns their sum.
pub fn exp_and_sum(row: &mut [f32], max: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has the feature the function is compiled for.
            return unsafe { x86::exp_and_sum_avx512(row, max) };
        }
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: as above.
            return unsafe { x86::exp_and_sum_avx2(row, max) };
        }
    }
    exp_and_sum_portable(row, max)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    #[target_feature(enable = "avx512f")]
    pub fn scale_and_max_avx512(row: &mut [f32], scale: f32) -> f32 {
        super::scale_and_max_portable(row, scale)
    }

    #[target_feature(enable = "avx2")]
    pub fn scale_and_max_avx2(row: &mut [f32], scale: f32) -> f32 {
        super::scale_and_max_portable(row, scale)
    }

    #[target_feature(enable = "avx512f")]
    pub fn exp_and_sum_avx512(row: &mut [f32], max: f32) -> f32 {
        super::exp_and_sum_portable(row, max)
    }

    #[target_feature(enable = "avx2")]
    pub fn exp_and_sum_avx2(row: &mut [f32], max: f32) -> f32 {
        super::exp_and_sum_portable(row, max)
    }
}

/// The loop every version compiles (inlined into the feature-enabled functions above).
#[inline(always)]
fn scale_and_max_portable(row: &mut [f32], scale: f32) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = row.chunks_exact_mut(LANES);
    for chunk in &mut chunks {
        for (x, max) in chunk.iter_mut().zip(&mut lanes) {
            *x *= scale;
            if *x > *max {
                *max = *x;
            }
        }
    }
    let mut max = lanes.into_iter().fold(f32::NEG_INFINITY, f32::max);
    for x in chunks.into_remainder() {
        *x *= scale;
        max = max.max(*x);
    }
    max
}

#[inline(always)]
fn exp_and_sum_portable(row: &mut [f32], max: f32) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let mut chunks = row.chunks_exact_mut(LANES);
    for chunk in &mut chunks {
        for (x, sum) in chunk.iter_mut().zip(&mut lanes) {
            *x = exp_nonpositive(*x - max);
            *sum += *x;
        }
    }
    let mut sum: f32 = lanes.iter().sum();
    for x in chunks.into_remainder() {
        *x = exp_nonpositive(*x - max);
        sum += *x;
    }
    sum
}

/// e^x for x ≤ 0, within 2 ulp of `f32::exp` (Cephes' `expf`: x = n·ln 2 + r with |r| ≤ ln 2 / 2,
/// a degree-7 polynomial for e^r, 2^n put into the exponent bits), in straight-line float and
/// integer arithmetic that the softmax loop vectorizes; `f32::exp` is a libm call per element,
/// which was most of a long prefill's time. Below −87.3 (where e^x leaves the normal floats) it
/// gives 2^−126 × e^r ≈ 1e−38, a weight that no sum of ones can see.
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split so that n · LN2_HI is exact for the n that occur.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 · 2^23: adding it rounds to an integer, held in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let x = x.max(-87.0);
    let shifted = x * LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e_r = p * r * r + r + 1.0;
    // n's bits as an integer: the low bits of `shifted` (|n| ≤ 126 here).
    let n = shifted.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
    e_r * f32::from_bits(((n + 127) as u32) << 23)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_softmax_exp_is_within_two_ulp_of_libm() {
        let ulps = |a: f32, b: f32| (a.to_bits() as i64 - b.to_bits() as i64).abs();
        let mut worst = 0;
        for i in 0..=870_000 {
            let x = -(i as f32) * 1e-4;
            worst = worst.max(ulps(exp_nonpositive(x), x.exp()));
        }
        assert!(worst <= 2, "{worst} ulp");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert!(exp_nonpositive(-1e30) < 1e-37);
    }

    #[test]
    fn every_compiled_version_gives_the_same_bits() {
        // Rows with and without a remainder past the lanes; scores spread over [-40, 40).
        for len in [1, 15, 16, 100, 256] {
            let row: Vec<f32> = (0..len)
                .map(|i| ((i as u32).wrapping_mul(2_654_435_761) >> 8) as f32 / 209_715.2 - 40.0)
                .collect();
            let run = |scale_max: fn(&mut [f32], f32) -> f32,
                       exp_sum: fn(&mut [f32], f32) -> f32| {
                let mut r = row.clone();
                let max = scale_max(&mut r, 0.37);
                let sum = exp_sum(&mut r, max);
                (
                    r.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    max.to_bits(),
                    sum.to_bits(),
                )
            };
            let portable = run(scale_and_max_portable, exp_and_sum_portable);
            assert_eq!(run(scale_and_max, exp_and_sum), portable, "len {len}");
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2.
                let avx2 = run(
                    |r, s| unsafe { x86::scale_and_max_avx2(r, s) },
                    |r, m| unsafe { x86::exp_and_sum_avx2(r, m) },
                );
                assert_eq!(avx2, portable, "len {len}");
            }
        }
    }
}
