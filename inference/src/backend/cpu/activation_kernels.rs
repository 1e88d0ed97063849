//! The CPU's activations, in place over a slice: `act(x)`, or `act(gate) · up` for a gated MLP.
//! SiLU and QuickGELU are `x · σ(c·x)`, and σ comes from the softmax's 2^x (which needs its
//! argument ≤ 0, as `2^(−|x|·log2 e)` is) in straight-line float arithmetic: the loops vectorize,
//! where libm's `expf` was a call per value (a 512 x 8960 gated SiLU, one thread: 15.5–17.8 ms
//! with `expf`, 2.5–3.8 ms here). They are compiled for AVX2 + FMA too and picked at run time, as
//! the attention kernels are; every version does the same operations (fused multiply-adds
//! included), so the bits do not depend on the CPU. GELU's `erf` and the tanh approximation stay
//! on libm.

#![allow(unsafe_code)]

use super::Activation;
use super::attention_kernels::exp2_nonpositive;
#[cfg(target_arch = "x86_64")]
use super::cpu_features::has_avx2;

/// `values[i] = act(values[i])`.
pub fn activate(values: &mut [f32], act: Activation) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has the features the function is compiled for.
        return unsafe { x86::activate_avx2(values, act) };
    }
    activate_portable(values, act)
}

/// `gate[i] = act(gate[i]) · up[i]` over the shorter of the two.
pub fn gated(gate: &mut [f32], up: &[f32], act: Activation) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: as above.
        return unsafe { x86::gated_avx2(gate, up, act) };
    }
    gated_portable(gate, up, act)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::Activation;

    #[target_feature(enable = "avx2,fma")]
    pub fn activate_avx2(values: &mut [f32], act: Activation) {
        super::activate_portable(values, act)
    }

    #[target_feature(enable = "avx2,fma")]
    pub fn gated_avx2(gate: &mut [f32], up: &[f32], act: Activation) {
        super::gated_portable(gate, up, act)
    }
}

/// The loops every version compiles, one per activation so that each vectorizes on its own.
#[inline(always)]
fn activate_portable(values: &mut [f32], act: Activation) {
    match act {
        Activation::Silu => values.iter_mut().for_each(|x| *x = silu(*x)),
        Activation::QuickGelu => values.iter_mut().for_each(|x| *x = quick_gelu(*x)),
        Activation::Gelu | Activation::GeluTanh => values
            .iter_mut()
            .for_each(|x| *x = libm_activation(*x, act)),
    }
}

#[inline(always)]
fn gated_portable(gate: &mut [f32], up: &[f32], act: Activation) {
    let pairs = gate.iter_mut().zip(up);
    match act {
        Activation::Silu => pairs.for_each(|(g, u)| *g = silu(*g) * u),
        Activation::QuickGelu => pairs.for_each(|(g, u)| *g = quick_gelu(*g) * u),
        Activation::Gelu | Activation::GeluTanh => {
            pairs.for_each(|(g, u)| *g = libm_activation(*g, act) * u)
        }
    }
}

#[inline(always)]
fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// CLIP's GELU approximation, `x · σ(1.702 x)`.
#[inline(always)]
fn quick_gelu(x: f32) -> f32 {
    x * sigmoid(1.702 * x)
}

/// σ(x) = 1 / (1 + e^−x) from t = e^−|x| ≤ 1 (never overflowing): 1 / (1 + t) for x ≥ 0, and
/// t / (1 + t) below (σ(x) = 1 − σ(−x) without the cancellation).
#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    let t = exp2_nonpositive(-x.abs() * std::f32::consts::LOG2_E);
    let s = 1.0 / (1.0 + t);
    if x >= 0.0 { s } else { t * s }
}

fn libm_activation(x: f32, act: Activation) -> f32 {
    match act {
        Activation::Gelu => 0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2)),
        Activation::GeluTanh => {
            let inner = 0.797_884_6 * (x + 0.044715 * x * x * x);
            0.5 * x * (1.0 + inner.tanh())
        }
        Activation::Silu => silu(x),
        Activation::QuickGelu => quick_gelu(x),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(x: f64, act: Activation) -> f64 {
        let sigmoid = |x: f64| 1.0 / (1.0 + (-x).exp());
        match act {
            Activation::Silu => x * sigmoid(x),
            Activation::QuickGelu => x * sigmoid(1.702 * x),
            _ => unreachable!(),
        }
    }

    /// Within a few parts in 10^7 of the f64 definition (where σ is e^(c·x), the roundings of
    /// `c·x` and of `|c·x|·log2 e` add up to 2·10^−7 per unit of `|c·x|`), or `|x|·2^−126` where
    /// e^(c·x) leaves the normal floats (the weight stops there); the same bits on every compiled
    /// version.
    #[test]
    fn silu_and_quick_gelu_match_their_definition_on_every_path() {
        let xs: Vec<f32> = (-400_000..=400_000)
            .map(|i| i as f32 * 2.5e-4)
            .chain([0.0, -0.0, 1e-30, -1e-30, 200.0, -200.0, f32::MAX, f32::MIN])
            .collect();
        for (act, c) in [(Activation::Silu, 1.0), (Activation::QuickGelu, 1.702)] {
            let mut got = xs.clone();
            activate(&mut got, act);
            for (&x, &y) in xs.iter().zip(&got) {
                let want = reference(f64::from(x), act);
                let err = (f64::from(y) - want).abs();
                let x64 = f64::from(x.abs());
                let bound =
                    (3e-7 + 2e-7 * c * x64) * want.abs() + 2.0 * x64 * f64::from(f32::MIN_POSITIVE);
                assert!(err <= bound, "{act:?}({x}) = {y}, want {want}");
            }
            let mut portable = xs.clone();
            activate_portable(&mut portable, act);
            assert!(
                portable
                    .iter()
                    .zip(&got)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
            );
            let ups: Vec<f32> = xs.iter().map(|x| 1.5 - x * 0.1).collect();
            let mut gated_values = xs.clone();
            gated(&mut gated_values, &ups, act);
            for ((g, a), u) in gated_values.iter().zip(&got).zip(&ups) {
                assert_eq!(g.to_bits(), (a * u).to_bits());
            }
        }
        let mut nan = [f32::NAN];
        activate(&mut nan, Activation::Silu);
        assert!(nan[0].is_nan());
    }
}
