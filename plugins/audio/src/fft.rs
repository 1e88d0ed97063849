//! Power spectra of Whisper's 400-sample frames, four frames at a time.
//!
//! A general FFT library transforms one frame per call, and in wasm (128-bit SIMD, no FMA, and
//! rustfft's generic index shuffling for 200 = 8 · 25 points) that was half of the plugin's time.
//! Here the four lanes of every vector are four consecutive frames, so every butterfly is a vector
//! operation with no shuffling at all, natively and in wasm alike, and the spectra come out in the
//! [bin][frame] order the mel filters read.
//!
//! The 400-point real FFT is a 200-point complex FFT of the even and odd samples (packed as real and
//! imaginary parts), split apart afterwards; the complex FFT is a Stockham autosort FFT with radices
//! 5, 5, 2, 2, 2 (no bit reversal: the output is in natural order).

use crate::mel::N_FFT;

/// Frames transformed together (one 128-bit vector of f32).
pub const LANES: usize = 4;
/// A value of each of the four frames.
pub type Lanes = [f32; LANES];
/// Bins of a real 400-point FFT: 0 to 200 inclusive.
pub const N_BINS: usize = N_FFT / 2 + 1;

/// The complex FFT's size.
const M: usize = N_FFT / 2;
const RADICES: [usize; 5] = [5, 5, 2, 2, 2];

#[inline(always)]
fn add(a: Lanes, b: Lanes) -> Lanes {
    std::array::from_fn(|l| a[l] + b[l])
}

#[inline(always)]
fn sub(a: Lanes, b: Lanes) -> Lanes {
    std::array::from_fn(|l| a[l] - b[l])
}

#[inline(always)]
fn scale(a: Lanes, s: f32) -> Lanes {
    std::array::from_fn(|l| a[l] * s)
}

/// Complex lanes: four complex values, real and imaginary parts apart.
#[derive(Clone, Copy, Default)]
struct C {
    re: Lanes,
    im: Lanes,
}

impl C {
    #[inline(always)]
    fn add(self, o: C) -> C {
        C {
            re: add(self.re, o.re),
            im: add(self.im, o.im),
        }
    }
    #[inline(always)]
    fn sub(self, o: C) -> C {
        C {
            re: sub(self.re, o.re),
            im: sub(self.im, o.im),
        }
    }
    #[inline(always)]
    fn scale(self, s: f32) -> C {
        C {
            re: scale(self.re, s),
            im: scale(self.im, s),
        }
    }
    /// Times the scalar complex `(c, s)` (the same twiddle for every lane).
    #[inline(always)]
    fn rotate(self, (c, s): (f32, f32)) -> C {
        C {
            re: sub(scale(self.re, c), scale(self.im, s)),
            im: add(scale(self.re, s), scale(self.im, c)),
        }
    }
    /// Times −i.
    #[inline(always)]
    fn times_minus_i(self) -> C {
        C {
            re: self.im,
            im: scale(self.re, -1.0),
        }
    }
}

/// One Stockham pass: `radix`-point butterflies after `span` points are already transformed.
struct Stage {
    radix: usize,
    span: usize,
    /// `e^{-2πi·q·k/(span·radix)}` at `k·radix + q`, for k < span, q < radix.
    twiddles: Vec<(f32, f32)>,
}

/// The 400-point real FFT over four frames at a time.
pub struct RealFft400 {
    stages: Vec<Stage>,
    /// `e^{-2πi·k/400}` for k = 0..=200: splits the packed transform into the real one.
    split: Vec<(f32, f32)>,
}

fn unit(angle: f64) -> (f32, f32) {
    (angle.cos() as f32, angle.sin() as f32)
}

impl RealFft400 {
    pub fn new() -> Self {
        let mut span = 1;
        let stages = RADICES
            .iter()
            .map(|&radix| {
                let twiddles = (0..span * radix)
                    .map(|i| {
                        let (k, q) = (i / radix, i % radix);
                        unit(-2.0 * std::f64::consts::PI * (q * k) as f64 / (span * radix) as f64)
                    })
                    .collect();
                let stage = Stage {
                    radix,
                    span,
                    twiddles,
                };
                span *= radix;
                stage
            })
            .collect();
        let split = (0..N_BINS)
            .map(|k| unit(-2.0 * std::f64::consts::PI * k as f64 / N_FFT as f64))
            .collect();
        RealFft400 { stages, split }
    }

    /// `power[k] = |X[k]|²` for each lane's frame, where `frames[n]` holds sample n of the four
    /// (already windowed) frames.
    pub fn power(&self, frames: &[Lanes; N_FFT], power: &mut [Lanes; N_BINS]) {
        let mut a = [C::default(); M];
        let mut b = [C::default(); M];
        for (z, pair) in a.iter_mut().zip(frames.chunks_exact(2)) {
            *z = C {
                re: pair[0],
                im: pair[1],
            };
        }
        let (mut src, mut dst) = (&mut a, &mut b);
        for stage in &self.stages {
            match stage.radix {
                2 => pass2(stage, src, dst),
                _ => pass5(stage, src, dst),
            }
            std::mem::swap(&mut src, &mut dst);
        }
        let z = src;
        // X[k] = E[k] + e^{-2πik/400}·O[k], with E and O the transforms of the even and odd
        // samples: E = (Z[k] + conj Z[M−k]) / 2, O = −i (Z[k] − conj Z[M−k]) / 2.
        for (k, (p, &twiddle)) in power.iter_mut().zip(&self.split).enumerate() {
            let zk = z[k % M];
            let zc = z[(M - k) % M];
            let zc = C {
                re: zc.re,
                im: scale(zc.im, -1.0),
            };
            let even = zk.add(zc).scale(0.5);
            let odd = zk.sub(zc).scale(0.5).times_minus_i();
            let x = even.add(odd.rotate(twiddle));
            *p = std::array::from_fn(|l| x.re[l] * x.re[l] + x.im[l] * x.im[l]);
        }
    }
}

/// Where butterfly `j`'s outputs go: Stockham's autosort index.
#[inline(always)]
fn destination(j: usize, span: usize, radix: usize) -> usize {
    (j / span) * span * radix + j % span
}

fn pass2(stage: &Stage, src: &[C; M], dst: &mut [C; M]) {
    let stride = M / 2;
    for j in 0..stride {
        let k = j % stage.span;
        let v0 = src[j];
        let v1 = src[j + stride].rotate(stage.twiddles[k * 2 + 1]);
        let d = destination(j, stage.span, 2);
        dst[d] = v0.add(v1);
        dst[d + stage.span] = v0.sub(v1);
    }
}

fn pass5(stage: &Stage, src: &[C; M], dst: &mut [C; M]) {
    // cos and sin of 2π/5 and 4π/5.
    let (c1, s1) = unit(2.0 * std::f64::consts::PI / 5.0);
    let (c2, s2) = unit(4.0 * std::f64::consts::PI / 5.0);
    let stride = M / 5;
    for j in 0..stride {
        let k = j % stage.span;
        let tw = &stage.twiddles[k * 5..k * 5 + 5];
        let v0 = src[j];
        let v1 = src[j + stride].rotate(tw[1]);
        let v2 = src[j + 2 * stride].rotate(tw[2]);
        let v3 = src[j + 3 * stride].rotate(tw[3]);
        let v4 = src[j + 4 * stride].rotate(tw[4]);
        // The 5-point DFT through its two symmetric pairs.
        let (t1, t2) = (v1.add(v4), v2.add(v3));
        let (t3, t4) = (v1.sub(v4), v2.sub(v3));
        let a1 = v0.add(t1.scale(c1)).add(t2.scale(c2));
        let a2 = v0.add(t1.scale(c2)).add(t2.scale(c1));
        let b1 = t3.scale(s1).add(t4.scale(s2));
        let b2 = t3.scale(s2).sub(t4.scale(s1));
        let d = destination(j, stage.span, 5);
        let span = stage.span;
        dst[d] = v0.add(t1).add(t2);
        // X1 = a1 − i·b1, X4 = a1 + i·b1 (and likewise X2, X3 with a2, b2).
        dst[d + span] = a1.add(b1.times_minus_i());
        dst[d + 4 * span] = a1.sub(b1.times_minus_i());
        dst[d + 2 * span] = a2.add(b2.times_minus_i());
        dst[d + 3 * span] = a2.sub(b2.times_minus_i());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The power spectrum by the definition, in f64.
    fn dft_power(x: &[f32]) -> Vec<f64> {
        (0..N_BINS)
            .map(|k| {
                let (mut re, mut im) = (0f64, 0f64);
                for (n, &v) in x.iter().enumerate() {
                    let angle = -2.0 * std::f64::consts::PI * (k * n) as f64 / N_FFT as f64;
                    re += f64::from(v) * angle.cos();
                    im += f64::from(v) * angle.sin();
                }
                re * re + im * im
            })
            .collect()
    }

    #[test]
    fn matches_the_dft_in_every_lane() {
        let mut state = 0x9e37_79b9_u32;
        let mut frames = [[0f32; LANES]; N_FFT];
        for sample in frames.iter_mut() {
            for value in sample.iter_mut() {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                *value = (state % 2001) as f32 / 1000.0 - 1.0;
            }
        }
        // Lane 3: a pure tone on bin 37, so a sharp spectrum is checked too.
        for (n, sample) in frames.iter_mut().enumerate() {
            sample[3] = (2.0 * std::f64::consts::PI * 37.0 * n as f64 / N_FFT as f64).cos() as f32;
        }
        let mut power = [[0f32; LANES]; N_BINS];
        RealFft400::new().power(&frames, &mut power);
        for lane in 0..LANES {
            let x: Vec<f32> = frames.iter().map(|s| s[lane]).collect();
            let expected = dft_power(&x);
            let peak = expected.iter().copied().fold(0f64, f64::max);
            for (k, e) in expected.iter().enumerate() {
                let got = f64::from(power[k][lane]);
                assert!(
                    (got - e).abs() <= 1e-5 * peak,
                    "lane {lane} bin {k}: {got} vs {e}"
                );
            }
        }
    }
}
