//! The built-in audio plugin.
//!
//! Decodes WAV, MP3, FLAC, Ogg Vorbis and AAC (MP4/M4A) with symphonia, mixes to mono, resamples to
//! 16 kHz, and computes Whisper's log-mel features in 30 s chunks exactly as transformers'
//! `WhisperFeatureExtractor` does → `input_features` [chunks, n_mels, 3000] f32 and
//! `feature_attention_mask` [chunks, 3000] i64. Token counts follow the model family: the Whisper
//! encoder's 1500 per chunk, or Qwen2-Audio's count over the frames that hold audio.

mod decode;
mod mel;
mod mp4;
mod processor;
mod resample;

use mmgate_plugin_sdk::*;

use mel::SAMPLE_RATE;
use processor::{Choices, Processor};

/// The plugin; public so its code can also run natively (`mmgate_plugin_sdk::run_natively`).
pub struct AudioPlugin;

impl Plugin for AudioPlugin {
    fn describe() -> Descriptor {
        Descriptor::new(
            "audio",
            env!("CARGO_PKG_VERSION"),
            "decode audio, resample to 16 kHz, Whisper log-mel in 30 s chunks",
            &["audio"],
            decode::MIME_TYPES,
            processor::SUPPORTED,
        )
    }

    fn probe(media: Media) -> PluginResult<MediaInfo> {
        let header = decode::probe(&media.data)?;
        let mut info = MediaInfo::new("audio", header.format.clone());
        info.sample_rate = Some(header.sample_rate);
        info.channels = Some(header.channels);
        info.duration_seconds = Some(header.duration_seconds());
        info.extra = vec![
            ("codec".into(), header.codec),
            // The exact length: the plan's token count depends on it to the sample.
            ("frames".into(), header.frames.to_string()),
        ];
        Ok(info)
    }

    fn plan(info: MediaInfo, budget: Budget, config: ProcessorConfig) -> PluginResult<TokenPlan> {
        let processor = Processor::from_config(&config)?;
        let Some(rate @ 1..) = info.sample_rate else {
            return Err(PluginError::invalid(
                "the media info has no sample rate (was it probed by this plugin?)",
            ));
        };
        let frames = match info.extra.iter().find(|(k, _)| k == "frames") {
            Some((_, v)) => v.parse::<u64>().map_err(|_| {
                PluginError::invalid(format!("media info frames {v:?} is not a count"))
            })?,
            None => {
                let seconds = info.duration_seconds.ok_or_else(|| {
                    PluginError::invalid(
                        "the media info has no duration (was it probed by this plugin?)",
                    )
                })?;
                (seconds * f64::from(rate)).round() as u64
            }
        };
        // The limit probe applied, again: `info` comes back from the host, not from our probe.
        decode::check_duration(frames as f64 / f64::from(rate))?;
        let samples = resample::resampled_len(frames, rate, SAMPLE_RATE);
        processor.plan(samples, budget.max_tokens)
    }

    fn preprocess(
        media: Media,
        plan: TokenPlan,
        config: ProcessorConfig,
    ) -> PluginResult<Vec<Tensor>> {
        let processor = Processor::from_config(&config)?;
        let choices: Choices = plan.choices()?;
        let audio = decode::decode_mono(&media.data)?;
        let samples = resample::resample(audio.samples, audio.sample_rate, SAMPLE_RATE)?;
        processor.preprocess(samples, &choices)
    }

    /// The clip as planned: mono, resampled to 16 kHz, cut to the kept chunks, as a float WAV (the
    /// samples the features were planned from, unrounded).
    fn reduce(media: Media, plan: TokenPlan, config: ProcessorConfig) -> PluginResult<ReducedItem> {
        let processor = Processor::from_config(&config)?;
        let choices: Choices = plan.choices()?;
        let audio = decode::decode_mono(&media.data)?;
        let samples = resample::resample(audio.samples, audio.sample_rate, SAMPLE_RATE)?;
        let samples = processor.planned_samples(samples, &choices)?;
        Ok(ReducedItem::single(files::wav(&samples, SAMPLE_RATE)?))
    }
}

// Natively (the benchmark's baseline) there is no component to export, and the linker would choke
// on the component-model symbol names.
#[cfg(target_arch = "wasm32")]
mmgate_plugin_sdk::export_plugin!(AudioPlugin);
