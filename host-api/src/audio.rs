//! The `audio` host capability (since contract 0.5.1): Whisper's log-mel spectrogram through
//! `mmgate-logmel`, natively, charged to the call as host work and not begun once the call's
//! deadline has passed.
//!
//! The capability works on an `AudioView`: the call's clock, which the call's state lends it when
//! the linker calls in (see [`crate::sandbox`]). It holds nothing of its own between calls.

use std::time::Instant;

use mmgate_logmel::{HOP_LENGTH, LogMel};
use wasmtime::component::HasData;

use crate::call_clock::CallClock;
use crate::contract::mmgate::modality::audio::Host;

/// Most mel bins a call may ask for (Whisper-family configs use 80 or 128).
const MAX_MELS: u32 = 256;
/// Longest chunk a call may ask for, in samples: ten minutes at 16 kHz (Whisper's is 30 s).
const MAX_CHUNK_SAMPLES: u32 = 600 * 16_000;

/// What the linker hands the `audio` interface of a call: an [`AudioView`] of its state.
pub(crate) struct HasAudio;

impl HasData for HasAudio {
    type Data<'a> = AudioView<'a>;
}

/// What this capability works on in one call: the call's clock, which its work is charged to.
pub(crate) struct AudioView<'a> {
    pub(crate) clock: &'a mut CallClock,
}

/// Why the arguments of one log-mel call are refused, if they are.
fn check(samples: usize, chunk_samples: u32, n_mels: u32) -> Result<(), String> {
    if !(1..=MAX_MELS).contains(&n_mels) {
        return Err(format!("n-mels is {n_mels}: it must be 1 to {MAX_MELS}"));
    }
    if !(HOP_LENGTH as u32..=MAX_CHUNK_SAMPLES).contains(&chunk_samples) {
        return Err(format!(
            "chunk-samples is {chunk_samples}: it must be {HOP_LENGTH} to {MAX_CHUNK_SAMPLES}"
        ));
    }
    if samples > chunk_samples as usize {
        return Err(format!(
            "{samples} samples do not fit a chunk of {chunk_samples}"
        ));
    }
    Ok(())
}

impl Host for AudioView<'_> {
    fn whisper_log_mel(
        &mut self,
        samples: Vec<f32>,
        chunk_samples: u32,
        n_mels: u32,
    ) -> Result<Vec<u8>, String> {
        if Instant::now() >= self.clock.wall_deadline() {
            self.clock.host_ran_out();
            return Err("the call's deadline passed before the log-mel was computed".into());
        }
        check(samples.len(), chunk_samples, n_mels)?;
        Ok(self.clock.host_work(|| {
            let mut features = Vec::new();
            LogMel::new(n_mels as usize).compute_into(
                &samples,
                chunk_samples as usize,
                &mut features,
            );
            features.into_flattened()
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_out_of_range_are_refused() {
        assert!(check(100, 480_000, 128).is_ok());
        assert!(check(480_000, 480_000, 80).is_ok());
        assert!(
            check(480_001, 480_000, 128)
                .unwrap_err()
                .contains("do not fit")
        );
        assert!(check(0, 480_000, 0).unwrap_err().contains("n-mels"));
        assert!(check(0, 480_000, 257).unwrap_err().contains("n-mels"));
        assert!(check(0, 159, 128).unwrap_err().contains("chunk-samples"));
        assert!(
            check(0, MAX_CHUNK_SAMPLES + 1, 128)
                .unwrap_err()
                .contains("chunk-samples")
        );
    }
}
