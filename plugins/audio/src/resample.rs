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

/// A resampler from one rate to another, applied to the whole clip or to a range of its output.
///
/// rubato's FFT resampler works on fixed blocks of `block` input samples; each block's output is
/// its own convolution plus the tail its predecessor left (overlap-add), and that tail depends on
/// the predecessor's input alone. So any range of the output is computed exactly, bit for bit as
/// the whole clip gives it, from the blocks that make it plus the one block before them: what
/// lets the plugin make a long clip's chunks in parts, each from its own stretch of samples.
pub struct Resampling {
    from_rate: u32,
    to_rate: u32,
    block: usize,
    block_out: usize,
    /// Silence before the input (see [`delay_alignment`]).
    pad: usize,
    /// Output samples before the clip's first: rubato's start-up delay (half an output block)
    /// plus the alignment's own.
    delay: usize,
}

impl Resampling {
    pub fn new(from_rate: u32, to_rate: u32) -> Self {
        let block = block_frames(from_rate, to_rate);
        let (pad, drop) = delay_alignment(block, from_rate, to_rate);
        let block_out = block / (from_rate / gcd(from_rate, to_rate)) as usize
            * (to_rate / gcd(from_rate, to_rate)) as usize;
        Resampling {
            from_rate,
            to_rate,
            block,
            block_out,
            pad,
            delay: block_out / 2 + drop,
        }
    }

    fn is_identity(&self) -> bool {
        self.from_rate == self.to_rate
    }

    /// The blocks whose output holds `out`, the one before them included when there is one (its
    /// tail is the first's overlap).
    fn blocks(&self, out: &std::ops::Range<u64>) -> std::ops::Range<u64> {
        let (delay, block_out) = (self.delay as u64, self.block_out as u64);
        let first = (out.start + delay) / block_out;
        first.saturating_sub(1)..(out.end + delay).div_ceil(block_out)
    }

    /// The input samples output range `out` is made from: the samples a part decodes.
    pub fn source_range(&self, out: std::ops::Range<u64>) -> std::ops::Range<u64> {
        if self.is_identity() {
            return out;
        }
        let blocks = self.blocks(&out);
        let (block, pad) = (self.block as u64, self.pad as u64);
        let end = (blocks.end * block).saturating_sub(pad);
        // Enough input that the clip's resampled length reaches `out.end` (so a decode that stops
        // there knows the clip does not end inside the range).
        let end = end.max(
            (u128::from(out.end) * u128::from(self.from_rate)).div_ceil(u128::from(self.to_rate))
                as u64,
        );
        (blocks.start * block).saturating_sub(pad)..end
    }

    /// Output samples `out` of the clip, given its input samples from `offset` on (`input` must
    /// hold every sample of [`Self::source_range`] the clip has) and the clip's length when the
    /// input reaches its end. Beyond the resampled length of the clip the output is silence, as
    /// for the whole clip.
    pub fn range(
        &self,
        input: &[f32],
        offset: u64,
        clip_len: Option<u64>,
        out: std::ops::Range<u64>,
    ) -> PluginResult<Vec<f32>> {
        let failed = |e: &dyn std::fmt::Display| PluginError::internal(format!("resampling: {e}"));
        let known = clip_len.map(|n| resampled_len(n, self.from_rate, self.to_rate));
        let audible = out.start..known.map_or(out.end, |k| k.clamp(out.start, out.end));
        let mut output = Vec::with_capacity((out.end - out.start) as usize);
        if self.is_identity() {
            let at = |i: u64| i.saturating_sub(offset).min(input.len() as u64) as usize;
            output.extend_from_slice(&input[at(audible.start)..at(audible.end)]);
            output.resize((out.end - out.start) as usize, 0.0);
            return Ok(output);
        }
        let mut resampler = Fft::<f32>::new_custom(
            self.from_rate as usize,
            self.to_rate as usize,
            self.block,
            1,
            1,
            WindowFunction::BlackmanHarris2,
            FixedSync::Input,
        )
        .map_err(|e| failed(&e))?;
        let blocks = self.blocks(&audible);
        let (block, block_out, pad) = (self.block as u64, self.block_out as u64, self.pad as u64);
        let mut block_in = vec![0f32; self.block];
        let mut block_output = vec![0f32; self.block_out];
        let wanted = audible.start + self.delay as u64..audible.end + self.delay as u64;
        for b in blocks {
            // The padded stream's samples [b·block, (b + 1)·block): silence before the clip (the
            // alignment pad) and after its end.
            block_in.fill(0.0);
            // Input index of the block's first sample (negative within the pad).
            let first = (b * block) as i64 - pad as i64 - offset as i64;
            let from = first.max(0) as usize;
            let to = (first + block as i64).clamp(0, input.len() as i64) as usize;
            if from < to {
                let at = (from as i64 - first) as usize;
                block_in[at..at + (to - from)].copy_from_slice(&input[from..to]);
            }
            let input = SequentialSlice::new(&block_in, 1, self.block).map_err(|e| failed(&e))?;
            let mut output_adapter = SequentialSlice::new_mut(&mut block_output, 1, self.block_out)
                .map_err(|e| failed(&e))?;
            resampler
                .process_into_buffer(&input, &mut output_adapter, None)
                .map_err(|e| failed(&e))?;
            let made = b * block_out..(b + 1) * block_out;
            let keep = made.start.max(wanted.start)..made.end.min(wanted.end);
            if keep.start < keep.end {
                output.extend_from_slice(
                    &block_output
                        [(keep.start - made.start) as usize..(keep.end - made.start) as usize],
                );
            }
        }
        output.resize((out.end - out.start) as usize, 0.0);
        Ok(output)
    }
}

/// `samples` at `from_rate` Hz, resampled to `to_rate` Hz (returned as is when the rates agree).
pub fn resample(samples: Vec<f32>, from_rate: u32, to_rate: u32) -> PluginResult<Vec<f32>> {
    if from_rate == to_rate || samples.is_empty() {
        return Ok(samples);
    }
    let n = samples.len() as u64;
    Resampling::new(from_rate, to_rate).range(
        &samples,
        0,
        Some(n),
        0..resampled_len(n, from_rate, to_rate),
    )
}

/// Length of `frames` samples at `from_rate` after resampling to `to_rate`: `ceil(n · to / from)`,
/// what both this resampler and soxr produce.
pub fn resampled_len(frames: u64, from_rate: u32, to_rate: u32) -> u64 {
    (u128::from(frames) * u128::from(to_rate)).div_ceil(u128::from(from_rate)) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `resample` was before it worked block by block: rubato's whole-clip call.
    fn whole_clip_with_rubato(samples: &[f32], from_rate: u32, to_rate: u32) -> Vec<f32> {
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
        .unwrap();
        let (pad, drop) = delay_alignment(block, from_rate, to_rate);
        let mut padded = vec![0f32; pad + samples.len()];
        padded[pad..].copy_from_slice(samples);
        let mut output = vec![0f32; resampler.process_all_needed_output_len(padded.len())];
        let input = SequentialSlice::new(&padded, 1, padded.len()).unwrap();
        let frames = output.len();
        let mut adapter = SequentialSlice::new_mut(&mut output, 1, frames).unwrap();
        let (_, written) = resampler
            .process_all_into_buffer(&input, &mut adapter, padded.len(), None)
            .unwrap();
        output.truncate(written);
        output.drain(..drop.min(output.len()));
        output.resize(
            resampled_len(samples.len() as u64, from_rate, to_rate) as usize,
            0.0,
        );
        output
    }

    fn noise(n: usize, seed: u32) -> Vec<f32> {
        let mut state = seed.wrapping_mul(2_654_435_761).max(1);
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                (state as f32 / u32::MAX as f32) - 0.5
            })
            .collect()
    }

    #[test]
    fn block_by_block_is_rubatos_whole_clip_call() {
        for (rate, n) in [
            (44_100, 100_000),
            (22_050, 33_333),
            (48_000, 7_000),
            (8_000, 9_001),
        ] {
            let samples = noise(n, rate);
            let ours = resample(samples.clone(), rate, 16_000).unwrap();
            let theirs = whole_clip_with_rubato(&samples, rate, 16_000);
            let differ = ours.iter().zip(&theirs).filter(|(a, b)| a != b).count();
            // rubato pads its final block with silence where the clip's length leaves a sample
            // or two short of the ceiling; the rest is the same computation.
            assert!(differ <= 2, "{rate} Hz: {differ} samples differ");
            assert_eq!(ours.len(), theirs.len());
        }
    }

    #[test]
    fn any_output_range_is_the_whole_clips_bit_for_bit() {
        for rate in [16_000, 8_000, 11_025, 22_050, 44_100, 48_000] {
            let n = 5 * rate as usize + 77;
            let samples = noise(n, rate);
            let whole = resample(samples.clone(), rate, 16_000).unwrap();
            let resampling = Resampling::new(rate, 16_000);
            let len = whole.len() as u64;
            for out in [
                0..1000,
                1000..16_000,
                16_000..len,
                0..len,
                33_000..len + 500,
            ] {
                let source = resampling.source_range(out.clone());
                let end = source.end.min(n as u64) as usize;
                let input = &samples[source.start as usize..end];
                let clip_len = (end == n).then_some(n as u64);
                let part = resampling
                    .range(input, source.start, clip_len, out.clone())
                    .unwrap();
                let expected: Vec<f32> = (out.start..out.end)
                    .map(|i| whole.get(i as usize).copied().unwrap_or(0.0))
                    .collect();
                assert!(part == expected, "{rate} Hz, {out:?}");
            }
        }
    }

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
