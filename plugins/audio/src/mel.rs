//! Whisper's log-mel spectrogram, computed exactly as transformers' `WhisperFeatureExtractor` does:
//! periodic Hann window, centred frames with reflect padding, power spectrum, Slaney-normalised mel
//! filters on the Slaney mel scale, `log10(max(x, 1e-10))`, the last frame dropped, a floor 8 below
//! the chunk's maximum, then `(x + 4) / 4`.
//!
//! The filters are built in f64 by the same formulas as transformers' `mel_filter_bank`; the
//! per-frame work (FFT, power, filters) runs in f32, whose rounding stays orders of magnitude under
//! the parity tolerance (the 8-decade floor keeps tiny, relatively imprecise powers out of reach).

use std::sync::Arc;

use realfft::num_complex::Complex;
use realfft::{RealFftPlanner, RealToComplex};

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

/// A log-mel spectrogram computer for one mel-bin count; build once, use for every chunk.
pub struct LogMel {
    n_mels: usize,
    window: [f32; N_FFT],
    filters: Vec<Filter>,
    fft: Arc<dyn RealToComplex<f32>>,
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
            fft: RealFftPlanner::<f32>::new().plan_fft_forward(N_FFT),
        }
    }

    /// The `[n_mels, frames]` row-major log-mel features of `samples` (16 kHz mono, already padded
    /// to the chunk length), with `frames = samples.len() / HOP_LENGTH` (the STFT's final frame is
    /// dropped, as Whisper does). Only the first `audio_len` samples may be non-zero: frames that
    /// see nothing but the silence after them are not transformed (their power is exactly zero).
    pub fn compute(&self, samples: &[f32], audio_len: usize) -> Vec<f32> {
        let frames = samples.len() / HOP_LENGTH;
        let silent_value = MEL_FLOOR.log10();
        let mut mel = vec![silent_value; self.n_mels * frames];
        if frames == 0 {
            return mel;
        }
        // A frame covers samples [t·hop − n_fft/2, t·hop + n_fft/2); the reflection at the end
        // mirrors only the last n_fft/2 samples, silent too when the audio stops n_fft before it.
        let audible_frames = if audio_len + N_FFT <= samples.len() {
            (audio_len + N_FFT / 2).div_ceil(HOP_LENGTH).min(frames)
        } else {
            frames
        };
        let padded = reflect_pad(samples, N_FFT / 2);
        let mut input = self.fft.make_input_vec();
        let mut spectrum = self.fft.make_output_vec();
        let mut scratch = self.fft.make_scratch_vec();
        let mut power = [0f32; N_BINS];
        let mut max = if audible_frames < frames {
            silent_value
        } else {
            f32::NEG_INFINITY
        };
        for t in 0..audible_frames {
            let frame = &padded[t * HOP_LENGTH..t * HOP_LENGTH + N_FFT];
            for ((x, &s), &w) in input.iter_mut().zip(frame).zip(&self.window) {
                *x = s * w;
            }
            // Lengths come from the planner itself: this cannot fail.
            if self
                .fft
                .process_with_scratch(&mut input, &mut spectrum, &mut scratch)
                .is_err()
            {
                unreachable!("realfft buffers have the planned lengths");
            }
            for (p, c) in power.iter_mut().zip(&spectrum) {
                *p = norm_sqr(c);
            }
            for (m, filter) in self.filters.iter().enumerate() {
                let bins = &power[filter.first_bin..filter.first_bin + filter.weights.len()];
                let energy: f32 = bins.iter().zip(&filter.weights).map(|(p, w)| p * w).sum();
                let value = energy.max(MEL_FLOOR).log10();
                max = max.max(value);
                mel[m * frames + t] = value;
            }
        }
        let floor = max - DYNAMIC_RANGE;
        for value in &mut mel {
            *value = (value.max(floor) + 4.0) / 4.0;
        }
        mel
    }
}

fn norm_sqr(c: &Complex<f32>) -> f32 {
    c.re * c.re + c.im * c.im
}

/// `numpy.pad(samples, pad, mode="reflect")`: mirrored without repeating the edge sample. Samples
/// shorter than the pad mirror back and forth, as numpy does.
fn reflect_pad(samples: &[f32], pad: usize) -> Vec<f32> {
    let n = samples.len() as isize;
    let reflect = |mut i: isize| -> f32 {
        if n == 1 {
            return samples[0];
        }
        let period = 2 * (n - 1);
        i = i.rem_euclid(period);
        if i >= n {
            i = period - i;
        }
        samples[i as usize]
    };
    let mut out = Vec::with_capacity(samples.len() + 2 * pad);
    out.extend((-(pad as isize)..0).map(reflect));
    out.extend_from_slice(samples);
    out.extend((n..n + pad as isize).map(reflect));
    out
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
                    down.min(up).max(0.0) * enorm
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

    #[test]
    fn reflect_pad_mirrors_without_the_edge_sample() {
        assert_eq!(
            reflect_pad(&[1.0, 2.0, 3.0, 4.0], 2),
            [3.0, 2.0, 1.0, 2.0, 3.0, 4.0, 3.0, 2.0]
        );
        // Shorter than the pad: numpy keeps reflecting.
        assert_eq!(
            reflect_pad(&[1.0, 2.0], 3),
            [2.0, 1.0, 2.0, 1.0, 2.0, 1.0, 2.0, 1.0]
        );
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
        let mel = LogMel::new(80).compute(&vec![0.0; 16_000], 16_000);
        assert_eq!(mel.len(), 80 * 100);
        // log10(1e-10) = -10, max - 8 = -18 is below it, so everything is -10 → (-10 + 4) / 4.
        assert!(mel.iter().all(|&v| (v - (-1.5)).abs() < 1e-6));
    }

    #[test]
    fn skipping_silent_frames_changes_nothing() {
        let mut samples = vec![0f32; 48_000];
        for (i, s) in samples[..10_007].iter_mut().enumerate() {
            *s = ((i * 7919) % 2001) as f32 / 1000.0 - 1.0;
        }
        let logmel = LogMel::new(80);
        assert_eq!(
            logmel.compute(&samples, 10_007),
            logmel.compute(&samples, samples.len())
        );
    }

    #[test]
    fn a_tone_peaks_in_the_mel_bin_of_its_frequency() {
        let samples: Vec<f32> = (0..16_000)
            .map(|i| (2.0 * std::f32::consts::PI * 440.0 * i as f32 / 16_000.0).sin())
            .collect();
        let logmel = LogMel::new(80);
        let mel = logmel.compute(&samples, samples.len());
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
