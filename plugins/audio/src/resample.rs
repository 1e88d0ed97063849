//! Resampling to Whisper's 16 kHz with rubato's synchronous FFT resampler.
//!
//! Why this one: for a fixed rational ratio (44.1 kHz → 16 kHz is 441:160) it applies one
//! windowed-sinc anti-aliasing filter (Blackman-Harris²) by FFT convolution: a band-limited
//! resampler of the same family as librosa's default (soxr "HQ"), exact in length
//! (`ceil(n · 16000 / rate)` samples, as soxr gives). Used as is it differs from soxr in two ways
//! this module corrects: a fractional-sample delay and a narrower transition band (see
//! `delay_alignment` and `block_frames`). How far its output is from librosa's is measured by the
//! parity tests on the resampled fixtures (tests/fixtures/audio/README.md has the numbers).

use mmgate_plugin_sdk::*;
use rubato::audioadapter_buffers::direct::SequentialSlice;
use rubato::{Fft, FixedSync, Resampler, WindowFunction};

/// Width of the transition band of rubato's Blackman-Harris² windowed sinc, in units of (sample
/// rate / filter length): about 14, so an 882-tap filter at 44.1 kHz (20 ms) rolls off over the
/// ~700 Hz soxr HQ does at 16 kHz. Chosen on the parity fixtures (8 to 48 kHz): the top mel bins
/// agree with librosa's best around it.
const TRANSITION_WIDTH: f64 = 14.0;
/// soxr "HQ" (librosa's default) rolls off from 0.913 of the lower Nyquist frequency to 1.0.
const SOXR_HQ_TRANSITION: f64 = 1.0 - 0.913;

/// The FFT block, which is also the anti-aliasing filter's length in input samples (rubato builds
/// a sinc as long as the block), a whole number of the ratio's smallest input blocks (441 frames for
/// 44.1 → 16 kHz). Sized so the filter's transition band is as wide as soxr HQ's: a longer filter
/// keeps more of the band just below the new Nyquist frequency than librosa does, which shows in
/// the top mel bins (0.27 against 0.04 at 44.1 kHz).
fn block_frames(from_rate: u32, to_rate: u32) -> usize {
    let min_block = (from_rate / gcd(from_rate, to_rate)) as usize;
    let lower_nyquist = f64::from(from_rate.min(to_rate)) / 2.0;
    let filter_len = TRANSITION_WIDTH * f64::from(from_rate) / (SOXR_HQ_TRANSITION * lower_nyquist);
    ((filter_len / min_block as f64).round() as usize).max(1) * min_block
}

/// Silence to put before the input so the filter's delay is a whole number of output samples.
/// rubato's filter is centred on input sample `block / 2`, a delay of `block / 2 · to / from` output
/// samples, and it trims `block_out / 2` of them: when those differ by a fraction (an odd number
/// of smallest blocks), the output would lead the input by that fraction of a sample (0.18 at
/// 44.1 kHz), a phase error soxr does not have. With `pad` samples in front the delay is
/// `(block / 2 + pad) · to / from`, whole when `block / 2 + pad` is a multiple of the smallest
/// input block. Returns (pad, output samples to drop beyond what rubato trims).
fn delay_alignment(block: usize, from_rate: u32, to_rate: u32) -> (usize, usize) {
    let g = gcd(from_rate, to_rate) as usize;
    let (min_in, min_out) = (from_rate as usize / g, to_rate as usize / g);
    let center = block / 2;
    let pad = (min_in - center % min_in) % min_in;
    let delay = (center + pad) / min_in * min_out;
    let trimmed = block / min_in * min_out / 2;
    (pad, delay.saturating_sub(trimmed))
}

fn gcd(mut a: u32, mut b: u32) -> u32 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// `samples` at `from_rate` Hz, resampled to `to_rate` Hz (returned as is when the rates agree).
pub fn resample(samples: Vec<f32>, from_rate: u32, to_rate: u32) -> PluginResult<Vec<f32>> {
    if from_rate == to_rate || samples.is_empty() {
        return Ok(samples);
    }
    let failed = |e: &dyn std::fmt::Display| PluginError::internal(format!("resampling: {e}"));
    let block = block_frames(from_rate, to_rate);
    let mut resampler = Fft::<f32>::new_custom(
        from_rate as usize,
        to_rate as usize,
        block,
        1,
        1,
        WindowFunction::BlackmanHarris2,
        FixedSync::Input,
    )
    .map_err(|e| failed(&e))?;
    let (pad, drop) = delay_alignment(block, from_rate, to_rate);
    let expected = resampled_len(samples.len() as u64, from_rate, to_rate) as usize;
    let samples = if pad == 0 {
        samples
    } else {
        let mut padded = vec![0f32; pad + samples.len()];
        padded[pad..].copy_from_slice(&samples);
        padded
    };
    let mut output = vec![0f32; resampler.process_all_needed_output_len(samples.len())];
    let input = SequentialSlice::new(&samples, 1, samples.len()).map_err(|e| failed(&e))?;
    let frames = output.len();
    let mut output_adapter =
        SequentialSlice::new_mut(&mut output, 1, frames).map_err(|e| failed(&e))?;
    let (_, written) = resampler
        .process_all_into_buffer(&input, &mut output_adapter, samples.len(), None)
        .map_err(|e| failed(&e))?;
    output.truncate(written);
    output.drain(..drop.min(output.len()));
    output.resize(expected, 0.0);
    Ok(output)
}

/// Length of `frames` samples at `from_rate` after resampling to `to_rate`: `ceil(n · to / from)`,
/// what both this resampler and soxr produce.
pub fn resampled_len(frames: u64, from_rate: u32, to_rate: u32) -> u64 {
    (u128::from(frames) * u128::from(to_rate)).div_ceil(u128::from(from_rate)) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn length_is_the_ceiling_of_the_ratio() {
        for (n, rate) in [
            (44_100u64, 44_100u32),
            (1, 44_100),
            (12_345, 22_050),
            (480_001, 48_000),
        ] {
            let samples = vec![0.25f32; n as usize];
            let out = resample(samples, rate, 16_000).unwrap();
            assert_eq!(
                out.len() as u64,
                resampled_len(n, rate, 16_000),
                "{n} at {rate}"
            );
        }
    }

    #[test]
    fn a_tone_keeps_its_frequency_level_and_phase() {
        let tone = |rate: u32, n: usize| -> Vec<f32> {
            (0..n)
                .map(|i| {
                    (2.0 * std::f64::consts::PI * 1000.0 * i as f64 / f64::from(rate)).sin() as f32
                })
                .collect()
        };
        let expected = tone(16_000, 16_000);
        // 22.05 and 24 kHz get an odd number of smallest blocks: the case delay_alignment is for.
        for rate in [
            8_000, 11_025, 22_050, 24_000, 32_000, 44_100, 48_000, 96_000,
        ] {
            let out = resample(tone(rate, rate as usize), rate, 16_000).unwrap();
            // Away from the edges (the filter's ramp-in), the resampled tone is the tone at 16 kHz,
            // sample for sample: no gain change, no fractional delay.
            let worst = out[1000..15_000]
                .iter()
                .zip(&expected[1000..15_000])
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(worst < 1e-4, "{rate} Hz: worst {worst}");
        }
    }
}
