//! The built-in audio plugin.
//!
//! Decodes WAV, MP3, FLAC, Ogg Vorbis and AAC (MP4/M4A) with symphonia, mixes to mono, resamples to
//! 16 kHz, and computes Whisper's log-mel features in 30 s chunks exactly as transformers'
//! `WhisperFeatureExtractor` does → `input_features` [chunks, n_mels, 3000] f32 and
//! `feature_attention_mask` [chunks, 3000] i64. Token counts follow the model family: the Whisper
//! encoder's 1500 per chunk, or Qwen2-Audio's count over the frames that hold audio.

mod decode;
mod mp4;
mod processor;
mod resample;

use mmgate_plugin_sdk::*;

use mmgate_logmel::SAMPLE_RATE;
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
        let in_parts = info
            .extra
            .iter()
            .any(|(k, v)| k == "codec" && decode::decodes_packets_alone(v));
        processor.plan(samples, budget.max_tokens, in_parts.then_some(rate))
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

    /// Runs of `CHUNKS_PER_PART` 30 s chunks when the codec is PCM or FLAC (see
    /// `Choices::parts_source_rate`): the Whisper encoder attends within a chunk, so each part is
    /// encoded on its own.
    fn parts(plan: TokenPlan, _config: ProcessorConfig) -> PluginResult<u32> {
        let choices: Choices = plan.choices()?;
        u32::try_from(Processor::parts(&choices)).map_err(|_| PluginError::limit("too many chunks"))
    }

    /// Each part's tokens, from the plan's per-chunk counts: an audio model places its tokens by
    /// count alone (one run, plain positions), so nothing else is needed beforehand.
    fn part_plans(plan: TokenPlan, config: ProcessorConfig) -> PluginResult<Vec<PartPlan>> {
        let processor = Processor::from_config(&config)?;
        let choices: Choices = plan.choices()?;
        if choices.parts_source_rate.is_none() {
            return Ok(vec![PartPlan {
                tokens: plan.tokens,
                placing: Vec::new(),
            }]);
        }
        (0..Processor::parts(&choices))
            .map(|index| {
                let (_, chunks) = processor.part(&choices, index)?;
                let tokens = choices
                    .chunk_tokens
                    .get(chunks)
                    .ok_or_else(|| PluginError::internal("the plan has no such chunks"))?
                    .iter()
                    .sum();
                Ok(PartPlan {
                    tokens,
                    placing: Vec::new(),
                })
            })
            .collect()
    }

    /// A part's chunks, bit for bit as `preprocess` makes them: the file decoded up to the part's
    /// end, only the samples its resampling needs mixed, then its chunks' features.
    fn preprocess_part(
        media: Media,
        plan: TokenPlan,
        config: ProcessorConfig,
        index: u32,
    ) -> PluginResult<Vec<Tensor>> {
        let processor = Processor::from_config(&config)?;
        let choices: Choices = plan.choices()?;
        let Some(rate) = choices.parts_source_rate else {
            // Made whole: its one part is the item.
            return match index {
                0 => Self::preprocess(media, plan, config),
                _ => Err(PluginError::internal(format!(
                    "part {index} of an audio item made whole"
                ))),
            };
        };
        let (samples, chunks) = processor.part(&choices, index as usize)?;
        let resampling = resample::Resampling::new(rate, SAMPLE_RATE);
        let audio =
            decode::decode_mono_range(&media.data, resampling.source_range(samples.clone()))?;
        if audio.sample_rate != rate {
            return Err(PluginError::internal(format!(
                "the plan was made for audio at {rate} Hz; this file is at {} Hz",
                audio.sample_rate
            )));
        }
        let samples = resampling.range(&audio.samples, audio.offset, audio.clip_len, samples)?;
        processor.chunks(&samples, &choices, chunks)
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

#[cfg(test)]
mod tests {
    use super::*;

    const QWEN2_AUDIO: &str = r#"{"feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": 128, "processor_class": "Qwen2AudioProcessor"}"#;

    /// A 16-bit PCM WAV of `seconds` of a chirp under noise, `channels` interleaved.
    fn pcm_wav(rate: u32, channels: u16, seconds: f64) -> Vec<u8> {
        let frames = (seconds * f64::from(rate)) as u32;
        let bytes = frames * u32::from(channels) * 2;
        let mut wav = Vec::with_capacity(44 + bytes as usize);
        wav.extend(b"RIFF");
        wav.extend((36 + bytes).to_le_bytes());
        wav.extend(b"WAVEfmt ");
        wav.extend(16u32.to_le_bytes());
        wav.extend(1u16.to_le_bytes());
        wav.extend(channels.to_le_bytes());
        wav.extend(rate.to_le_bytes());
        wav.extend((rate * u32::from(channels) * 2).to_le_bytes());
        wav.extend((channels * 2).to_le_bytes());
        wav.extend(16u16.to_le_bytes());
        wav.extend(b"data");
        wav.extend(bytes.to_le_bytes());
        let mut noise = 0x2545_f491u32;
        for i in 0..frames {
            let t = f64::from(i) / f64::from(rate);
            let tone = 0.3 * (2.0 * std::f64::consts::PI * (200.0 * t + 15.0 * t * t)).sin();
            for _ in 0..channels {
                noise ^= noise << 13;
                noise ^= noise >> 17;
                noise ^= noise << 5;
                let sample = tone + 0.05 * (f64::from(noise) / f64::from(u32::MAX) - 0.5);
                wav.extend(((sample * 32_767.0) as i16).to_le_bytes());
            }
        }
        wav
    }

    fn media(data: &[u8]) -> Media {
        Media {
            data: data.to_vec(),
            mime_type: None,
        }
    }

    fn whole_and_parts(data: &[u8], budget: u32) -> (Vec<Tensor>, Vec<Vec<Tensor>>) {
        let info = AudioPlugin::probe(media(data)).unwrap();
        let plan =
            AudioPlugin::plan(info, Budget { max_tokens: budget }, QWEN2_AUDIO.to_owned()).unwrap();
        let whole =
            AudioPlugin::preprocess(media(data), plan.clone(), QWEN2_AUDIO.to_owned()).unwrap();
        let parts = (0..AudioPlugin::parts(plan.clone(), QWEN2_AUDIO.to_owned()).unwrap())
            .map(|i| {
                AudioPlugin::preprocess_part(media(data), plan.clone(), QWEN2_AUDIO.to_owned(), i)
                    .unwrap()
            })
            .collect();
        (whole, parts)
    }

    /// The parts' tensors, chunk after chunk, are the whole item's bytes.
    fn assert_parts_are_the_whole(whole: &[Tensor], parts: &[Vec<Tensor>], what: &str) {
        for (t, tensor) in whole.iter().enumerate() {
            let joined: Vec<u8> = parts.iter().flat_map(|p| p[t].data.clone()).collect();
            let chunks: u64 = parts.iter().map(|p| p[t].shape[0]).sum();
            assert_eq!(chunks, tensor.shape[0], "{what}: {}", tensor.name);
            assert!(joined == tensor.data, "{what}: {} differs", tensor.name);
        }
    }

    #[test]
    fn pcm_audio_in_parts_is_the_whole_bit_for_bit() {
        // Resampled (44.1 kHz stereo) and not (16 kHz mono); 65 s: two full chunks and 5 s, in
        // parts of two chunks and of one.
        for (rate, channels) in [(44_100, 2), (16_000, 1), (22_050, 1)] {
            let wav = pcm_wav(rate, channels, 65.0);
            let (whole, parts) = whole_and_parts(&wav, u32::MAX);
            assert_eq!(parts.len(), 2, "{rate} Hz");
            assert_parts_are_the_whole(&whole, &parts, &format!("{rate} Hz"));
        }
        // 125 s cut to its first three chunks by the budget: the second part ends at the cut.
        let wav = pcm_wav(48_000, 1, 125.0);
        let (whole, parts) = whole_and_parts(&wav, 2400);
        assert_eq!((whole[0].shape[0], parts.len()), (3, 2usize));
        assert_parts_are_the_whole(&whole, &parts, "48 kHz, cut");
    }

    #[test]
    fn flac_in_parts_is_the_whole_and_lossy_codecs_are_made_whole() {
        let clip = |name: &str| {
            std::fs::read(format!(
                "{}/../../tests/fixtures/audio/clips/{name}",
                env!("CARGO_MANIFEST_DIR")
            ))
            .unwrap()
        };
        // 61 s: three chunks, two parts.
        let (whole, parts) = whole_and_parts(&clip("long-61s-16k.flac"), u32::MAX);
        assert_eq!(parts.len(), 2);
        assert_parts_are_the_whole(&whole, &parts, "flac");
        for lossy in ["speech-16k.mp3", "speech-16k.ogg", "speech-16k.m4a"] {
            let (whole, parts) = whole_and_parts(&clip(lossy), u32::MAX);
            assert_eq!(parts.len(), 1, "{lossy}");
            assert_parts_are_the_whole(&whole, &parts, lossy);
        }
    }
}
