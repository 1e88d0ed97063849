//! Resampling to Whisper's 16 kHz with rubato's synchronous FFT resampler.
//!
//! Why this one: for a fixed rational ratio (44.1 kHz → 16 kHz is 441:160) it applies one long
//! windowed-sinc anti-aliasing filter (Blackman-Harris², cutoff just below the new Nyquist) by FFT
//! convolution: a band-limited resampler of the same family as librosa's default (soxr "HQ"),
//! exact in length (`ceil(n · 16000 / rate)` samples, as soxr gives) and several times faster
//! than an asynchronous sinc interpolator. How far its output is from librosa's is measured by the
//! parity tests on the resampled fixtures (tests/fixtures/audio/README.md has the numbers).

use mmgate_plugin_sdk::*;
use rubato::audioadapter_buffers::direct::SequentialSlice;
use rubato::{Fft, FixedSync, Resampler, WindowFunction};

/// Input frames per FFT block, at least this many.
const MIN_BLOCK_FRAMES: usize = 1024;

/// The FFT block: an even number of the ratio's smallest input blocks (441 frames for 44.1 → 16 kHz),
/// about [`MIN_BLOCK_FRAMES`] long. Even matters: rubato's filter is centred on sample
/// `block / 2`, so with an odd count the delay it trims is a whole number of output samples only
/// approximately, and the output would lag the input by a fraction of a sample (0.18 samples at
/// 44.1 kHz, a phase error soxr does not have).
fn block_frames(from_rate: u32, to_rate: u32) -> usize {
    let min_block = (from_rate / gcd(from_rate, to_rate)) as usize;
    let blocks = MIN_BLOCK_FRAMES.div_ceil(min_block).max(2);
    (blocks + blocks % 2) * min_block
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
    let mut resampler = Fft::<f32>::new_custom(
        from_rate as usize,
        to_rate as usize,
        block_frames(from_rate, to_rate),
        1,
        1,
        WindowFunction::BlackmanHarris2,
        FixedSync::Input,
    )
    .map_err(|e| failed(&e))?;
    let mut output = vec![0f32; resampler.process_all_needed_output_len(samples.len())];
    let input = SequentialSlice::new(&samples, 1, samples.len()).map_err(|e| failed(&e))?;
    let frames = output.len();
    let mut output_adapter =
        SequentialSlice::new_mut(&mut output, 1, frames).map_err(|e| failed(&e))?;
    let (_, written) = resampler
        .process_all_into_buffer(&input, &mut output_adapter, samples.len(), None)
        .map_err(|e| failed(&e))?;
    output.truncate(written);
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
        // 44.1 and 22.05 kHz have odd smallest blocks (441): the case the even block count is for.
        for rate in [8_000, 22_050, 44_100, 48_000, 96_000] {
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
