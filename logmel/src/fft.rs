//! The power spectrum of Whisper's 400-sample frames, four frames at a time.
//!
//! A general FFT library vectorises within one transform, which for 400 points means shuffling
//! lanes at every stage. Whisper transforms thousands of frames of one size, so here each SIMD
//! lane holds its own frame: four frames go through the same butterflies side by side, every
//! operation is a plain 4-lane one, and each bin's power comes out as four adjacent frames, which
//! is the layout the mel filters read. The transform: the 400 real samples as 200 complex ones
//! (even samples real, odd imaginary), a Stockham FFT of 200 = 4 · 2 · 5 · 5, then the split that
//! turns it into the 201 bins of the real FFT.

use std::f64::consts::PI;

/// Four lanes, one per frame.
type Lanes = [f32; 4];

#[inline(always)]
fn add(a: Lanes, b: Lanes) -> Lanes {
    [a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3]]
}

#[inline(always)]
fn sub(a: Lanes, b: Lanes) -> Lanes {
    [a[0] - b[0], a[1] - b[1], a[2] - b[2], a[3] - b[3]]
}

#[inline(always)]
fn scale(a: Lanes, k: f32) -> Lanes {
    [a[0] * k, a[1] * k, a[2] * k, a[3] * k]
}

#[inline(always)]
fn mul(a: Lanes, b: Lanes) -> Lanes {
    [a[0] * b[0], a[1] * b[1], a[2] * b[2], a[3] * b[3]]
}

/// A complex value per lane.
#[derive(Clone, Copy, Default)]
struct C4 {
    re: Lanes,
    im: Lanes,
}

impl C4 {
    #[inline(always)]
    fn add(self, o: C4) -> C4 {
        C4 {
            re: add(self.re, o.re),
            im: add(self.im, o.im),
        }
    }

    #[inline(always)]
    fn sub(self, o: C4) -> C4 {
        C4 {
            re: sub(self.re, o.re),
            im: sub(self.im, o.im),
        }
    }

    #[inline(always)]
    fn scale(self, k: f32) -> C4 {
        C4 {
            re: scale(self.re, k),
            im: scale(self.im, k),
        }
    }

    /// Times the same complex number in every lane.
    #[inline(always)]
    fn rotate(self, (c, s): (f32, f32)) -> C4 {
        C4 {
            re: sub(scale(self.re, c), scale(self.im, s)),
            im: add(scale(self.re, s), scale(self.im, c)),
        }
    }

    /// Times −i.
    #[inline(always)]
    fn minus_i(self) -> C4 {
        C4 {
            re: self.im,
            im: scale(self.re, -1.0),
        }
    }
}

/// Points of the complex FFT: half the frame.
const HALF: usize = 200;
/// The stages' radices, first to last; their product is `HALF`.
const RADICES: [usize; 4] = [4, 2, 5, 5];

/// One stage of the Stockham FFT: radix `radix` after stages whose radices multiply to `span`, and
/// for each output group position k in 0..span the twiddles e^{−2πi·k·r/(span·radix)}, r ≥ 1.
struct Stage {
    radix: usize,
    span: usize,
    twiddles: Vec<(f32, f32)>,
}

/// Forward power spectra of 400-point real frames, four at a time.
pub struct PowerSpectrum {
    stages: Vec<Stage>,
    /// e^{−2πik/400} for the real split, k in 0..=HALF.
    split: Vec<(f32, f32)>,
}

/// The two buffers the Stockham stages alternate between (one set per thread of work).
pub struct Scratch {
    a: Vec<C4>,
    b: Vec<C4>,
}

impl Default for PowerSpectrum {
    fn default() -> Self {
        Self::new()
    }
}

impl PowerSpectrum {
    pub fn new() -> Self {
        let unit = |angle: f64| (angle.cos() as f32, angle.sin() as f32);
        let mut span = 1;
        let mut stages = Vec::with_capacity(RADICES.len());
        for radix in RADICES {
            let mut twiddles = Vec::with_capacity(span * (radix - 1));
            for k in 0..span {
                for r in 1..radix {
                    twiddles.push(unit(-2.0 * PI * (k * r) as f64 / (span * radix) as f64));
                }
            }
            stages.push(Stage {
                radix,
                span,
                twiddles,
            });
            span *= radix;
        }
        PowerSpectrum {
            stages,
            split: (0..=HALF)
                .map(|k| unit(-2.0 * PI * k as f64 / (2 * HALF) as f64))
                .collect(),
        }
    }

    pub fn scratch(&self) -> Scratch {
        Scratch {
            a: vec![C4::default(); HALF],
            b: vec![C4::default(); HALF],
        }
    }

    /// `|X[k]|²` for k in 0..=200 of the four frames' real DFTs, as `power(k, [p0, p1, p2, p3])`.
    pub fn compute(
        &self,
        frames: [&[f32; 2 * HALF]; 4],
        scratch: &mut Scratch,
        mut power: impl FnMut(usize, Lanes),
    ) {
        // Four samples of each frame at a time (two complex points), transposed so that each
        // lane holds its frame: whole-vector loads and shuffles instead of a load per lane.
        for (q, pair) in scratch.a.chunks_exact_mut(2).enumerate() {
            let [a, b, c, d] = frames.map(|f| {
                let mut four = [0f32; 4];
                four.copy_from_slice(&f[4 * q..4 * q + 4]);
                four
            });
            pair[0] = C4 {
                re: [a[0], b[0], c[0], d[0]],
                im: [a[1], b[1], c[1], d[1]],
            };
            pair[1] = C4 {
                re: [a[2], b[2], c[2], d[2]],
                im: [a[3], b[3], c[3], d[3]],
            };
        }
        let (mut x, mut y) = (&mut scratch.a, &mut scratch.b);
        for stage in &self.stages {
            stockham(stage, x, y);
            std::mem::swap(&mut x, &mut y);
        }
        let z = x;
        // X[k] = E + e^{−2πik/400}·O, E = (Z[k] + conj Z[200−k]) / 2, O = (Z[k] − conj Z[200−k]) / 2i.
        for k in 0..=HALF {
            let zk = z[k % HALF];
            let zm = z[(HALF - k) % HALF];
            let conj = C4 {
                re: zm.re,
                im: scale(zm.im, -1.0),
            };
            let even = zk.add(conj).scale(0.5);
            let odd = zk.sub(conj).scale(0.5).minus_i();
            let x = even.add(odd.rotate(self.split[k]));
            power(k, add(mul(x.re, x.re), mul(x.im, x.im)));
        }
    }
}

/// One Stockham stage from `x` into `y` (Govindaraju et al.'s formulation: inputs `HALF / radix`
/// apart, outputs `span` apart, so no bit reversal is ever needed).
fn stockham(stage: &Stage, x: &[C4], y: &mut [C4]) {
    match stage.radix {
        2 => stockham_radix::<2>(stage, x, y, dft2),
        4 => stockham_radix::<4>(stage, x, y, dft4),
        _ => stockham_radix::<5>(stage, x, y, dft5),
    }
}

/// [`stockham`] for a radix known at compile time, so the loops over it unroll.
#[inline(always)]
fn stockham_radix<const R: usize>(stage: &Stage, x: &[C4], y: &mut [C4], dft: fn(&mut [C4; R])) {
    let span = stage.span;
    let stride = HALF / R;
    for j in 0..stride {
        let k = j % span;
        let twiddles = &stage.twiddles[k * (R - 1)..(k + 1) * (R - 1)];
        let mut v: [C4; R] = std::array::from_fn(|r| x[j + r * stride]);
        // The first stage's twiddles are all 1.
        if span > 1 {
            for (v, &t) in v[1..].iter_mut().zip(twiddles) {
                *v = v.rotate(t);
            }
        }
        dft(&mut v);
        let base = (j / span) * span * R + k;
        for (r, v) in v.into_iter().enumerate() {
            y[base + r * span] = v;
        }
    }
}

#[inline(always)]
fn dft2(v: &mut [C4; 2]) {
    let (a, b) = (v[0], v[1]);
    v[0] = a.add(b);
    v[1] = a.sub(b);
}

#[inline(always)]
fn dft4(v: &mut [C4; 4]) {
    let (t0, t1) = (v[0].add(v[2]), v[0].sub(v[2]));
    let (t2, t3) = (v[1].add(v[3]), v[1].sub(v[3]).minus_i());
    v[0] = t0.add(t2);
    v[1] = t1.add(t3);
    v[2] = t0.sub(t2);
    v[3] = t1.sub(t3);
}

/// cos and sin of 2π/5 and 4π/5, written out: in wasm a `cos` call is a software routine.
const C1: f32 = 0.309_017;
const C2: f32 = -0.809_017;
const S1: f32 = 0.951_056_5;
const S2: f32 = 0.587_785_24;

#[inline(always)]
fn dft5(v: &mut [C4; 5]) {
    let (c1, c2, s1, s2) = (C1, C2, S1, S2);
    let (t1, t3) = (v[1].add(v[4]), v[1].sub(v[4]));
    let (t2, t4) = (v[2].add(v[3]), v[2].sub(v[3]));
    let a1 = v[0].add(t1.scale(c1)).add(t2.scale(c2));
    let a2 = v[0].add(t1.scale(c2)).add(t2.scale(c1));
    let b1 = t3.scale(s1).add(t4.scale(s2)).minus_i();
    let b2 = t3.scale(s2).sub(t4.scale(s1)).minus_i();
    v[0] = v[0].add(t1).add(t2);
    v[1] = a1.add(b1);
    v[4] = a1.sub(b1);
    v[2] = a2.add(b2);
    v[3] = a2.sub(b2);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_radix_5_constants_are_the_angles() {
        let close = |a: f32, b: f64| (f64::from(a) - b).abs() < 1e-7;
        assert!(close(C1, (2.0 * PI / 5.0).cos()) && close(C2, (4.0 * PI / 5.0).cos()));
        assert!(close(S1, (2.0 * PI / 5.0).sin()) && close(S2, (4.0 * PI / 5.0).sin()));
    }

    /// The power spectra of four different frames, against a direct DFT in f64.
    #[test]
    fn power_spectra_are_the_dfts() {
        let frames: Vec<[f32; 400]> = (0..4)
            .map(|f| {
                std::array::from_fn(|n| {
                    let t = n as f64 / 16_000.0;
                    ((2.0 * PI * (300.0 + 700.0 * f as f64) * t).sin()
                        + 0.3 * ((n * 7919 + f * 31) % 97) as f64 / 97.0) as f32
                })
            })
            .collect();
        let spectrum = PowerSpectrum::new();
        let mut got = vec![[0f32; 4]; 201];
        spectrum.compute(
            [&frames[0], &frames[1], &frames[2], &frames[3]],
            &mut spectrum.scratch(),
            |k, p| got[k] = p,
        );
        for (f, frame) in frames.iter().enumerate() {
            for (k, row) in got.iter().enumerate() {
                let (mut re, mut im) = (0f64, 0f64);
                for (n, &s) in frame.iter().enumerate() {
                    let angle = -2.0 * PI * (k * n) as f64 / 400.0;
                    re += f64::from(s) * angle.cos();
                    im += f64::from(s) * angle.sin();
                }
                let expected = re * re + im * im;
                let error = (f64::from(row[f]) - expected).abs();
                assert!(
                    error <= 1e-4 * expected.max(1.0),
                    "frame {f} bin {k}: {} vs {expected}",
                    row[f]
                );
            }
        }
    }
}
