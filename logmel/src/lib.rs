//! Whisper's log-mel spectrogram, computed exactly as transformers' `WhisperFeatureExtractor` does:
//! periodic Hann window, centred frames with reflect padding, power spectrum, Slaney-normalised mel
//! filters on the Slaney mel scale, `log10(max(x, 1e-10))`, the last frame dropped, a floor 8 below
//! the chunk's maximum, then `(x + 4) / 4`.
//!
//! The filters are built in f64 by the same formulas as transformers' `mel_filter_bank`; the
//! per-frame work (FFT, power, filters) runs in f32, whose rounding stays orders of magnitude under
//! the parity tolerance (the 8-decade floor keeps tiny, relatively imprecise powers out of reach).
//!
//! Built twice: into the audio plugin (natively, for its benchmark baseline and tests) and into the
//! host, which computes it for plugins through contract 0.5.1's `audio.whisper-log-mel`: natively
//! it runs about 1.8x faster than the same code compiled to WebAssembly.

mod fft;

use fft::PowerSpectrum;

/// Whisper's STFT constants (the feature extractor's defaults; every shipped config uses them).
pub const N_FFT: usize = 400;
pub const HOP_LENGTH: usize = 160;
pub const SAMPLE_RATE: u32 = 16_000;
const N_BINS: usize = N_FFT / 2 + 1;
/// The mel filters span 0 Hz to Nyquist at 16 kHz.
const MAX_FREQUENCY: f64 = 8_000.0;
/// `log10` clamp and the dynamic range kept below the maximum, in decades.
const MEL_FLOOR: f32 = 1e-10;
const DYNAMIC_RANGE: f32 = 8.0;

/// One mel filter as the contiguous run of FFT bins where its weight is non-zero (each triangular
/// filter covers a handful of bins, so the dense 201×n_mels product would be mostly zeros).
struct Filter {
    first_bin: usize,
    weights: Vec<f32>,
}

/// Frames transformed before their mel energies are computed and written out together: enough for
/// long vector loops, few enough for the block's powers (201 bins) to stay in L2.
const BLOCK_FRAMES: usize = 64;

/// A log-mel spectrogram computer for one mel-bin count; build once, use for every chunk.
pub struct LogMel {
    n_mels: usize,
    window: [f32; N_FFT],
    filters: Vec<Filter>,
    spectrum: PowerSpectrum,
}

impl LogMel {
    pub fn new(n_mels: usize) -> Self {
        // Periodic Hann (transformers' `window_function(400, "hann")`): cos over N, not N - 1.
        let window = std::array::from_fn(|n| {
            (0.5 - 0.5 * (2.0 * std::f64::consts::PI * n as f64 / N_FFT as f64).cos()) as f32
        });
        LogMel {
            n_mels,
            window,
            filters: slaney_filters(n_mels),
            spectrum: PowerSpectrum::new(),
        }
    }

    /// Append the `[n_mels, frames]` row-major features of one chunk to `out`, as little-endian
    /// f32 bytes (the tensor's layout, so no conversion pass follows). The chunk is `audio` (16 kHz
    /// mono) followed by silence up to `chunk_len` samples, `frames = chunk_len / HOP_LENGTH` (the
    /// STFT's final frame is dropped, as Whisper does).
    pub fn compute_into(&self, audio: &[f32], chunk_len: usize, out: &mut Vec<[u8; 4]>) {
        let frames = chunk_len / HOP_LENGTH;
        let silent_value = MEL_FLOOR.log10();
        // log10 energies are written straight into the output, then floored and scaled in place.
        let base = out.len();
        out.resize(base + self.n_mels * frames, silent_value.to_le_bytes());
        let mel = &mut out[base..];
        if frames == 0 {
            return;
        }
        let audio = &audio[..audio.len().min(chunk_len)];
        // Frames that see nothing but the silence after the audio have power exactly zero (and
        // keep `silent_value`): not transformed. A frame covers samples [t·hop − n_fft/2,
        // t·hop + n_fft/2); the reflection at the chunk's end mirrors its last n_fft/2 samples,
        // silent too when the audio stops n_fft before the end.
        let audible_frames = if audio.len() + N_FFT <= chunk_len {
            (audio.len() + N_FFT / 2).div_ceil(HOP_LENGTH).min(frames)
        } else {
            frames
        };
        // Four frames at a time, one per SIMD lane (see `fft`); a last group short of four is
        // filled with silent frames whose powers are not kept.
        let mut inputs = [[0f32; N_FFT]; 4];
        let mut scratch = self.spectrum.scratch();
        // A block of frames as [bin][frame] powers and [mel][frame] energies: with the frame as
        // the innermost index, applying a filter and taking logarithms are vector loops over the
        // block, and each mel row goes to the output as one contiguous run.
        let mut power = vec![0f32; N_BINS * BLOCK_FRAMES];
        let mut energies = vec![0f32; self.n_mels * BLOCK_FRAMES];
        let mut max = if audible_frames < frames {
            silent_value
        } else {
            f32::NEG_INFINITY
        };
        for first in (0..audible_frames).step_by(BLOCK_FRAMES) {
            let count = BLOCK_FRAMES.min(audible_frames - first);
            for k in (0..count).step_by(4) {
                let lanes = 4.min(count - k);
                for (lane, input) in inputs.iter_mut().enumerate() {
                    if lane < lanes {
                        self.windowed_frame(audio, chunk_len, first + k + lane, input);
                    } else {
                        input.fill(0.0);
                    }
                }
                self.spectrum
                    .compute(inputs.each_ref(), &mut scratch, |bin, powers| {
                        let dst = &mut power[bin * BLOCK_FRAMES + k..];
                        // A whole group is one fixed-size move: a copy whose length is only
                        // known at run time is a `memory.copy` call out of the sandbox in wasm.
                        match dst.first_chunk_mut::<4>() {
                            Some(group) if lanes == 4 => *group = powers,
                            _ => dst[..lanes].copy_from_slice(&powers[..lanes]),
                        }
                    });
            }
            for (row, filter) in energies.chunks_exact_mut(BLOCK_FRAMES).zip(&self.filters) {
                let row = &mut row[..count];
                row.fill(0.0);
                for (bin, &weight) in (filter.first_bin..).zip(&filter.weights) {
                    let powers = &power[bin * BLOCK_FRAMES..][..count];
                    for (e, &p) in row.iter_mut().zip(powers) {
                        *e += weight * p;
                    }
                }
                for e in row.iter_mut() {
                    *e = larger(*e, MEL_FLOOR);
                }
                log10_in_place(row);
                max = larger(max, max_of(row));
            }
            for (m, row) in energies.chunks_exact(BLOCK_FRAMES).enumerate() {
                let out_row = &mut mel[m * frames + first..][..count];
                for (o, &value) in out_row.iter_mut().zip(&row[..count]) {
                    *o = value.to_le_bytes();
                }
            }
        }
        let floor = max - DYNAMIC_RANGE;
        for bytes in mel {
            *bytes = ((larger(f32::from_le_bytes(*bytes), floor) + 4.0) / 4.0).to_le_bytes();
        }
    }

    /// Frame `t` of the centred STFT, windowed, into `input`: samples [t·hop − n_fft/2,
    /// t·hop + n_fft/2) of the chunk (audio, then silence to `chunk_len`), reflected at its edges
    /// as `numpy.pad(mode="reflect")` does. Only frames at the edges take the slow path.
    fn windowed_frame(&self, audio: &[f32], chunk_len: usize, t: usize, input: &mut [f32]) {
        let start = (t * HOP_LENGTH) as isize - (N_FFT / 2) as isize;
        if start >= 0 && start as usize + N_FFT <= audio.len() {
            let frame = &audio[start as usize..start as usize + N_FFT];
            for ((x, &s), &w) in input.iter_mut().zip(frame).zip(&self.window) {
                *x = s * w;
            }
            return;
        }
        let n = chunk_len as isize;
        for (j, (x, &w)) in input.iter_mut().zip(&self.window).enumerate() {
            let i = reflect_index(start + j as isize, n);
            *x = audio.get(i).copied().unwrap_or(0.0) * w;
        }
    }
}

/// The larger of two values that are never NaN. `f32::max` (and `f64::max`) promise IEEE maxNum
/// semantics for NaN, which wasm's `max` instructions do not have, so in wasm each is a libm call
/// per value: in these loops that call alone cost more than the logarithm.
fn larger<T: PartialOrd>(a: T, b: T) -> T {
    if a > b { a } else { b }
}

/// The smaller of two values that are never NaN (see [`larger`]).
fn smaller<T: PartialOrd>(a: T, b: T) -> T {
    if a < b { a } else { b }
}

/// The largest of `values` (never NaN), in eight independent lanes so the loop vectorises (a single
/// running maximum is a chain of dependent comparisons).
fn max_of(values: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let chunks = values.chunks_exact(8);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane = larger(*lane, v);
        }
    }
    rest.iter()
        .chain(&lanes)
        .copied()
        .fold(f32::NEG_INFINITY, larger)
}

/// The index `numpy.pad(mode="reflect")` reads for position `i` of a signal of length `n`:
/// mirrored at both ends without repeating the edge sample, back and forth if need be.
fn reflect_index(i: isize, n: isize) -> usize {
    if n == 1 {
        return 0;
    }
    let period = 2 * (n - 1);
    let i = i.rem_euclid(period);
    (if i >= n { period - i } else { i }) as usize
}

/// `log10` of each value (all positive and normal: they are clamped to 1e-10 first), to within
/// 2e-6 (tested from 1e-10 to 1e12). Written without branches so it runs as a vector loop (SIMD natively and in wasm), where
/// libm's `log10f` is a scalar call per value, and in wasm a slow software one.
fn log10_in_place(values: &mut [f32]) {
    const LOG10_2: f32 = std::f32::consts::LOG10_2;
    const LOG10_E: f32 = std::f32::consts::LOG10_E;
    for v in values {
        let bits = v.to_bits();
        // x = m · 2^e with m in [√½, √2): the series below converges fastest around 1.
        let mut e = ((bits >> 23) & 0xff) as i32 - 127;
        let mut m = f32::from_bits((bits & 0x007f_ffff) | 0x3f80_0000);
        let big = m > std::f32::consts::SQRT_2;
        m = if big { m * 0.5 } else { m };
        e += i32::from(big);
        // ln m = 2·atanh(r), r = (m − 1)/(m + 1), |r| ≤ 0.172: five odd terms reach 1e-9.
        let r = (m - 1.0) / (m + 1.0);
        let r2 = r * r;
        let series =
            1.0 + r2 * (1.0 / 3.0 + r2 * (1.0 / 5.0 + r2 * (1.0 / 7.0 + r2 * (1.0 / 9.0))));
        *v = e as f32 * LOG10_2 + 2.0 * r * series * LOG10_E;
    }
}

/// Slaney mel scale (librosa's default, `mel_scale="slaney"`): linear below 1 kHz, logarithmic above.
fn hertz_to_mel(hz: f64) -> f64 {
    const MIN_LOG_HERTZ: f64 = 1000.0;
    const MIN_LOG_MEL: f64 = 15.0;
    let logstep = 27.0 / 6.4f64.ln();
    if hz >= MIN_LOG_HERTZ {
        MIN_LOG_MEL + (hz / MIN_LOG_HERTZ).ln() * logstep
    } else {
        3.0 * hz / 200.0
    }
}

fn mel_to_hertz(mel: f64) -> f64 {
    const MIN_LOG_HERTZ: f64 = 1000.0;
    const MIN_LOG_MEL: f64 = 15.0;
    let logstep = 6.4f64.ln() / 27.0;
    if mel >= MIN_LOG_MEL {
        MIN_LOG_HERTZ * (logstep * (mel - MIN_LOG_MEL)).exp()
    } else {
        200.0 * mel / 3.0
    }
}

/// `numpy.linspace(start, stop, n)`, including numpy's exact end point.
fn linspace(start: f64, stop: f64, n: usize) -> Vec<f64> {
    let step = (stop - start) / (n - 1) as f64;
    (0..n)
        .map(|i| {
            if i == n - 1 {
                stop
            } else {
                start + i as f64 * step
            }
        })
        .collect()
}

/// transformers' `mel_filter_bank(1 + n_fft // 2, n_mels, 0, 8000, 16000, norm="slaney",
/// mel_scale="slaney")`, one sparse row per mel bin.
fn slaney_filters(n_mels: usize) -> Vec<Filter> {
    let fft_freqs = linspace(0.0, f64::from(SAMPLE_RATE / 2), N_BINS);
    let mel_freqs = linspace(hertz_to_mel(0.0), hertz_to_mel(MAX_FREQUENCY), n_mels + 2);
    let filter_freqs: Vec<f64> = mel_freqs.into_iter().map(mel_to_hertz).collect();
    (0..n_mels)
        .map(|m| {
            let (lower, center, upper) =
                (filter_freqs[m], filter_freqs[m + 1], filter_freqs[m + 2]);
            let enorm = 2.0 / (upper - lower);
            let weights: Vec<f64> = fft_freqs
                .iter()
                .map(|&f| {
                    let down = (f - lower) / (center - lower);
                    let up = (upper - f) / (upper - center);
                    // Not `f64::min`/`max`: libm calls in wasm (see `larger`), and the filters are
                    // built on every call.
                    larger(smaller(down, up), 0.0) * enorm
                })
                .collect();
            let first = weights.iter().position(|&w| w > 0.0).unwrap_or(0);
            let last = weights.iter().rposition(|&w| w > 0.0).unwrap_or(first);
            Filter {
                first_bin: first,
                weights: weights[first..=last].iter().map(|&w| w as f32).collect(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compute(logmel: &LogMel, audio: &[f32], chunk_len: usize) -> Vec<f32> {
        let mut out = Vec::new();
        logmel.compute_into(audio, chunk_len, &mut out);
        out.into_iter().map(f32::from_le_bytes).collect()
    }

    #[test]
    fn reflect_index_mirrors_without_the_edge_sample() {
        // numpy.pad([1, 2, 3, 4], 2, mode="reflect") = [3, 2, 1, 2, 3, 4, 3, 2]
        let padded: Vec<usize> = (-2..6).map(|i| reflect_index(i, 4)).collect();
        assert_eq!(padded, [2, 1, 0, 1, 2, 3, 2, 1]);
        // Shorter than the pad: numpy keeps reflecting ([1, 2] padded by 3).
        let padded: Vec<usize> = (-3..5).map(|i| reflect_index(i, 2)).collect();
        assert_eq!(padded, [1, 0, 1, 0, 1, 0, 1, 0]);
    }

    #[test]
    fn log10_is_accurate_over_the_whole_range() {
        let mut worst = 0f64;
        let mut x = 1e-10f32;
        while x < 1e12 {
            let mut v = [x];
            log10_in_place(&mut v);
            worst = worst.max((f64::from(v[0]) - f64::from(x).log10()).abs());
            x *= 1.0137;
        }
        assert!(worst < 2e-6, "worst {worst}");
    }

    #[test]
    fn mel_scale_round_trips_and_is_continuous_at_1_khz() {
        for hz in [0.0, 200.0, 999.0, 1000.0, 4000.0, 8000.0] {
            assert!((mel_to_hertz(hertz_to_mel(hz)) - hz).abs() < 1e-9);
        }
        assert!((hertz_to_mel(1000.0) - 15.0).abs() < 1e-12);
    }

    #[test]
    fn filters_cover_the_spectrum_with_slaney_area_normalisation() {
        for n_mels in [80, 128] {
            let filters = slaney_filters(n_mels);
            assert_eq!(filters.len(), n_mels);
            for f in &filters {
                assert!(!f.weights.is_empty());
                assert!(f.first_bin + f.weights.len() <= N_BINS);
            }
        }
    }

    #[test]
    fn silence_is_the_floor_everywhere() {
        let mel = compute(&LogMel::new(80), &vec![0.0; 16_000], 16_000);
        assert_eq!(mel.len(), 80 * 100);
        // log10(1e-10) = -10, max - 8 = -18 is below it, so everything is -10 → (-10 + 4) / 4.
        assert!(mel.iter().all(|&v| (v - (-1.5)).abs() < 1e-6));
    }

    #[test]
    fn implied_silence_equals_explicit_zeros() {
        let audio: Vec<f32> = (0..10_007)
            .map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        let mut padded = audio.clone();
        padded.resize(48_000, 0.0);
        let logmel = LogMel::new(80);
        // The skipped silent frames, the reflected edges and the block boundaries change nothing.
        assert_eq!(
            compute(&logmel, &audio, 48_000),
            compute(&logmel, &padded, 48_000)
        );
    }

    #[test]
    fn a_tone_peaks_in_the_mel_bin_of_its_frequency() {
        let samples: Vec<f32> = (0..16_000)
            .map(|i| (2.0 * std::f32::consts::PI * 440.0 * i as f32 / 16_000.0).sin())
            .collect();
        let logmel = LogMel::new(80);
        let mel = compute(&logmel, &samples, samples.len());
        let frames = 100;
        let t = 50;
        let peak = (0..80)
            .max_by(|&a, &b| mel[a * frames + t].total_cmp(&mel[b * frames + t]))
            .unwrap();
        let center = |m: usize| {
            let f = &logmel.filters[m];
            (f.first_bin as f32 + (f.weights.len() - 1) as f32 / 2.0) * 40.0
        };
        assert!(
            (center(peak) - 440.0).abs() < 60.0,
            "peak at {}",
            center(peak)
        );
    }
}
