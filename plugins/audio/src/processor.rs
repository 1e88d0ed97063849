//! The Whisper feature extractor's configuration, the token plan, and chunked feature extraction.
//!
//! Audio longer than one chunk (30 s) is split into consecutive chunks, each one encoder input,
//! each processed exactly as `WhisperFeatureExtractor` processes a clip of that length: padded with
//! silence to 30 s, its own log-mel with its own 8-decade floor, and an attention mask over the
//! frames that hold audio.

use mmgate_plugin_sdk::*;
use serde::{Deserialize, Serialize};

use mmgate_logmel::{HOP_LENGTH, N_FFT, SAMPLE_RATE};

pub const SUPPORTED: &[&str] = &["WhisperFeatureExtractor"];

/// Chunks per part when an item is made in parts: one minute of audio. Each part costs work beyond
/// its chunks' (its own sandbox call, the file copied in, decoding to its start), a sizeable share
/// of one chunk's: two chunks a part make a long file sooner on two cores than one chunk a part
/// (measured by `bench/parts.py`).
pub const CHUNKS_PER_PART: usize = 2;

/// How a model turns one chunk's mel frames into LLM tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TokenRule {
    /// The Whisper encoder: a fixed 1500 positions per 30 s chunk, padding included.
    Whisper,
    /// Qwen2-Audio and Qwen2.5-Omni: the encoder's stride-2 convolution then a stride-2 pooling
    /// over the frames that hold audio: `((L - 1) // 2 + 1 - 2) // 2 + 1`.
    Qwen2Audio,
}

impl TokenRule {
    /// The rule the model's processor implies (`processor_class` in `preprocessor_config.json`).
    fn for_processor_class(class: Option<&str>) -> Self {
        match class {
            Some(c) if c.starts_with("Qwen2Audio") || c.contains("Omni") => TokenRule::Qwen2Audio,
            _ => TokenRule::Whisper,
        }
    }

    /// Tokens for a chunk whose audio covers `frames` of its `max_frames` mel frames.
    fn tokens(self, frames: u64, max_frames: u64) -> u64 {
        match self {
            TokenRule::Whisper => max_frames / 2,
            TokenRule::Qwen2Audio => {
                let after_conv = (frames.saturating_sub(1)) / 2 + 1;
                // Python's floor division: (1 - 2) // 2 + 1 = 0 tokens.
                if after_conv < 2 {
                    0
                } else {
                    (after_conv - 2) / 2 + 1
                }
            }
        }
    }
}

#[derive(Deserialize)]
struct RawConfig {
    feature_extractor_type: Option<String>,
    processor_class: Option<String>,
    feature_size: Option<usize>,
    sampling_rate: Option<u32>,
    hop_length: Option<usize>,
    n_fft: Option<usize>,
    chunk_length: Option<u64>,
    #[serde(default)]
    dither: f64,
    #[serde(default)]
    do_normalize: bool,
    /// mmgate's override for models whose processor class does not say (`whisper`, `qwen2-audio`).
    audio_token_rule: Option<TokenRule>,
    /// Set by the host when the item goes to a model server that runs its own processor
    /// (`media = "preprocess"`): plan what that processor makes of it.
    #[serde(default)]
    mmgate_server_processor: bool,
}

/// A validated Whisper feature extractor configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Processor {
    pub n_mels: usize,
    /// 16 kHz samples per chunk (`chunk_length · sampling_rate`).
    pub chunk_samples: u64,
    pub rule: TokenRule,
    /// The most chunks an item may keep. HF's Whisper and Qwen2-Audio processors truncate to one
    /// (`chunk_length`, 30 s), so a model server running them counts no more; natively this
    /// gateway encodes every chunk.
    pub max_chunks: usize,
}

/// What `plan` decided; handed back to `preprocess` through the plan's `choices`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Choices {
    pub token_rule: TokenRule,
    pub n_mels: usize,
    /// 16 kHz samples the whole clip resamples to.
    pub samples: u64,
    /// Of those, the samples the kept chunks cover.
    pub kept_samples: u64,
    pub chunk_samples: u64,
    pub chunks: usize,
    pub total_chunks: usize,
    pub chunk_tokens: Vec<u32>,
    /// Mel frames holding audio, per kept chunk (the attention mask's ones).
    pub chunk_frames: Vec<u64>,
    /// When the chunks may be made in parts, [`CHUNKS_PER_PART`] each (contract 0.4): the file's
    /// own sample rate, which every part resamples from. Only when the file's codec decodes each
    /// packet alone (PCM, FLAC), so a part skips the packets before its chunks and costs little
    /// beyond their resampling and features. A lossy codec carries state from packet to packet:
    /// every part would decode from the first, costing more than the parts win, so such a file is
    /// made whole (`None`).
    #[serde(default)]
    pub parts_source_rate: Option<u32>,
}

impl Processor {
    pub fn from_config(config: &str) -> PluginResult<Self> {
        let raw: RawConfig = parse_config(config)?;
        match raw.feature_extractor_type.as_deref() {
            Some("WhisperFeatureExtractor") => {}
            Some(other) => {
                return Err(PluginError::unsupported(format!(
                    "feature extractor {other:?} is not supported (supported: {})",
                    SUPPORTED.join(", ")
                )));
            }
            None => {
                return Err(PluginError::unsupported(
                    "processor config has no feature_extractor_type (an audio model's \
                     preprocessor_config.json names WhisperFeatureExtractor)",
                ));
            }
        }
        let fixed = |name: &str, value: Option<usize>, expected: usize| match value {
            None => Ok(()),
            Some(v) if v == expected => Ok(()),
            Some(v) => Err(PluginError::unsupported(format!(
                "processor config: {name} {v} is not supported (Whisper's {expected} is)"
            ))),
        };
        fixed(
            "sampling_rate",
            raw.sampling_rate.map(|r| r as usize),
            SAMPLE_RATE as usize,
        )?;
        fixed("n_fft", raw.n_fft, N_FFT)?;
        fixed("hop_length", raw.hop_length, HOP_LENGTH)?;
        let n_mels = raw.feature_size.unwrap_or(80);
        if !(1..=256).contains(&n_mels) {
            return Err(PluginError::unsupported(format!(
                "processor config: feature_size {n_mels} is not a mel bin count (1..=256)"
            )));
        }
        let chunk_length = raw.chunk_length.unwrap_or(30);
        if !(1..=600).contains(&chunk_length) {
            return Err(PluginError::unsupported(format!(
                "processor config: chunk_length {chunk_length} s is not supported (1..=600)"
            )));
        }
        if raw.dither != 0.0 {
            return Err(PluginError::unsupported(
                "processor config: dither adds random noise, so the features would not be \
                 reproducible; set it to 0",
            ));
        }
        if raw.do_normalize {
            return Err(PluginError::unsupported(
                "processor config: do_normalize (zero-mean unit-variance waveforms) is not supported",
            ));
        }
        Ok(Processor {
            n_mels,
            chunk_samples: chunk_length * u64::from(SAMPLE_RATE),
            rule: raw
                .audio_token_rule
                .unwrap_or_else(|| TokenRule::for_processor_class(raw.processor_class.as_deref())),
            max_chunks: if raw.mmgate_server_processor {
                1
            } else {
                usize::MAX
            },
        })
    }

    fn max_frames(&self) -> u64 {
        self.chunk_samples / HOP_LENGTH as u64
    }

    /// Plan `samples` (16 kHz) within `budget` tokens: every chunk if they fit, else the leading
    /// chunks that do.
    pub fn plan(
        &self,
        samples: u64,
        budget: u32,
        parts_source_rate: Option<u32>,
    ) -> PluginResult<TokenPlan> {
        if samples == 0 {
            return Err(PluginError::invalid("the audio holds no samples"));
        }
        let total_chunks = samples.div_ceil(self.chunk_samples) as usize;
        let max_frames = self.max_frames();
        let mut chunk_frames = Vec::with_capacity(total_chunks);
        let mut chunk_tokens = Vec::with_capacity(total_chunks);
        for i in 0..total_chunks as u64 {
            let len = (samples - i * self.chunk_samples).min(self.chunk_samples);
            let frames = len.div_ceil(HOP_LENGTH as u64);
            chunk_frames.push(frames);
            chunk_tokens.push(self.rule.tokens(frames, max_frames) as u32);
        }
        if chunk_tokens[0] == 0 {
            return Err(PluginError::invalid(format!(
                "the audio is too short ({samples} samples at 16 kHz, {:.1} ms): the encoder \
                 makes no token from it",
                samples as f64 / 16.0
            )));
        }
        let total_tokens: u64 = chunk_tokens.iter().map(|&t| u64::from(t)).sum();
        let mut kept = 0usize;
        let mut kept_tokens = 0u64;
        for &tokens in &chunk_tokens {
            if kept_tokens + u64::from(tokens) > u64::from(budget) || kept == self.max_chunks {
                break;
            }
            kept_tokens += u64::from(tokens);
            kept += 1;
        }
        if kept == 0 {
            return Err(PluginError::over_budget(
                chunk_tokens[0],
                budget,
                format!(
                    "the first {} s chunk of the audio needs {} tokens, more than the {budget} \
                     available",
                    self.chunk_samples / u64::from(SAMPLE_RATE),
                    chunk_tokens[0]
                ),
            ));
        }
        let kept_samples = samples.min(kept as u64 * self.chunk_samples);
        let seconds = |s: u64| s as f64 / f64::from(SAMPLE_RATE);
        let chunk_seconds = self.chunk_samples / u64::from(SAMPLE_RATE);
        let plural = |n: u64| if n == 1 { "" } else { "s" };
        let reason = if kept == total_chunks {
            format!(
                "{:.2} s of audio in {total_chunks} chunk{} of {chunk_seconds} s: {total_tokens} \
                 token{}",
                seconds(samples),
                plural(total_chunks as u64),
                plural(total_tokens)
            )
        } else if kept == self.max_chunks {
            format!(
                "kept the first {kept} of {total_chunks} chunks of {chunk_seconds} s ({:.2} s of \
                 {:.2} s): the model server's processor takes no more",
                seconds(kept_samples),
                seconds(samples)
            )
        } else {
            format!(
                "kept the first {kept} of {total_chunks} chunks of {chunk_seconds} s ({:.2} s of \
                 {:.2} s): all of it needs {total_tokens} tokens, the budget is {budget}",
                seconds(kept_samples),
                seconds(samples)
            )
        };
        chunk_tokens.truncate(kept);
        chunk_frames.truncate(kept);
        let choices = Choices {
            token_rule: self.rule,
            n_mels: self.n_mels,
            samples,
            kept_samples,
            chunk_samples: self.chunk_samples,
            chunks: kept,
            total_chunks,
            chunk_tokens,
            chunk_frames,
            parts_source_rate,
        };
        TokenPlan::new(kept_tokens as u32, kept < total_chunks, reason, &choices)
    }

    /// The 16 kHz `samples` the plan keeps: cut or padded to the planned length (decoders disagree
    /// with container headers by a few ms of codec delay at most), so the token count is exactly
    /// the planned one.
    pub fn planned_samples(
        &self,
        mut samples: Vec<f32>,
        choices: &Choices,
    ) -> PluginResult<Vec<f32>> {
        if choices.n_mels != self.n_mels
            || choices.chunk_samples != self.chunk_samples
            || choices.chunk_frames.len() != choices.chunks
        {
            return Err(PluginError::internal(
                "the plan was made for a different processor config",
            ));
        }
        samples.resize(choices.kept_samples as usize, 0.0);
        Ok(samples)
    }

    /// `input_features` [chunks, n_mels, frames] f32 and `feature_attention_mask` [chunks, frames]
    /// i64 for 16 kHz `samples`, as the plan chose ([`Self::planned_samples`]).
    pub fn preprocess(&self, samples: Vec<f32>, choices: &Choices) -> PluginResult<Vec<Tensor>> {
        let samples = self.planned_samples(samples, choices)?;
        self.chunks(&samples, choices, 0..choices.chunks)
    }

    /// The parts a plan makes: runs of [`CHUNKS_PER_PART`] kept chunks when the plan allows parts,
    /// else one.
    pub fn parts(choices: &Choices) -> usize {
        match choices.parts_source_rate {
            Some(_) => choices.chunks.div_ceil(CHUNKS_PER_PART).max(1),
            None => 1,
        }
    }

    /// The 16 kHz samples part `index` of a plan made in parts covers, and its chunks.
    pub fn part(
        &self,
        choices: &Choices,
        index: usize,
    ) -> PluginResult<(std::ops::Range<u64>, std::ops::Range<usize>)> {
        self.planned_samples(Vec::new(), choices)?;
        let parts = Self::parts(choices);
        if index >= parts {
            return Err(PluginError::internal(format!(
                "part {index} of an audio item made in {parts}"
            )));
        }
        let first = index * CHUNKS_PER_PART;
        let chunks = first..(first + CHUNKS_PER_PART).min(choices.chunks);
        let start = chunks.start as u64 * self.chunk_samples;
        let end = (chunks.end as u64 * self.chunk_samples).min(choices.kept_samples);
        Ok((start..end, chunks))
    }

    /// The tensors of `chunks` of the plan, from their 16 kHz `samples` (the planned samples from
    /// the first chunk's start on: shorter only where the clip ends).
    pub fn chunks(
        &self,
        samples: &[f32],
        choices: &Choices,
        chunks: std::ops::Range<usize>,
    ) -> PluginResult<Vec<Tensor>> {
        let chunk = self.chunk_samples as usize;
        let frames = self.max_frames() as usize;
        let count = chunks.len();
        let frames_with_audio = choices.chunk_frames.get(chunks).ok_or_else(|| {
            PluginError::internal("the plan was made for a different processor config")
        })?;
        let logmel = LogMelSource::new(self.n_mels);
        let mut features = Vec::new();
        let mut mask = Vec::with_capacity(count * frames);
        for (n, &audio_frames) in frames_with_audio.iter().enumerate() {
            let audio = samples.get(n * chunk..).unwrap_or_default();
            logmel.append(&audio[..audio.len().min(chunk)], chunk, &mut features)?;
            mask.extend((0..frames as u64).map(|f| i64::from(f < audio_frames)));
        }
        Ok(vec![
            Tensor::from_f32_bytes("input_features", &[count, self.n_mels, frames], features)?,
            Tensor::from_i64("feature_attention_mask", &[count, frames], &mask)?,
        ])
    }
}

/// Where a chunk's log-mel spectrogram is computed: by the host (contract 0.5.1's
/// `audio.whisper-log-mel`, the same code natively, about twice as fast as in Wasm), or here when
/// this code runs natively itself (the benchmark's baseline, the unit tests).
struct LogMelSource {
    #[cfg(not(target_arch = "wasm32"))]
    local: mmgate_logmel::LogMel,
    #[cfg(target_arch = "wasm32")]
    n_mels: usize,
}

impl LogMelSource {
    fn new(n_mels: usize) -> Self {
        LogMelSource {
            #[cfg(not(target_arch = "wasm32"))]
            local: mmgate_logmel::LogMel::new(n_mels),
            #[cfg(target_arch = "wasm32")]
            n_mels,
        }
    }

    /// Appends the `[n_mels, chunk / 160]` features of `audio` followed by silence up to `chunk`
    /// samples to `out`, as little-endian f32 bytes.
    #[cfg(target_arch = "wasm32")]
    fn append(&self, audio: &[f32], chunk: usize, out: &mut Vec<u8>) -> PluginResult<()> {
        use mmgate_plugin_sdk::bindings::mmgate::modality::audio::whisper_log_mel;
        let (Ok(chunk), Ok(n_mels)) = (u32::try_from(chunk), u32::try_from(self.n_mels)) else {
            return Err(PluginError::internal("a chunk or mel count past u32"));
        };
        let features = whisper_log_mel(audio, chunk, n_mels).map_err(PluginError::internal)?;
        if out.is_empty() {
            *out = features;
        } else {
            out.extend_from_slice(&features);
        }
        Ok(())
    }

    #[cfg(not(target_arch = "wasm32"))]
    fn append(&self, audio: &[f32], chunk: usize, out: &mut Vec<u8>) -> PluginResult<()> {
        let mut features = Vec::new();
        self.local.compute_into(audio, chunk, &mut features);
        out.extend_from_slice(features.as_flattened());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const QWEN2_AUDIO: &str = r#"{"feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": 128, "processor_class": "Qwen2AudioProcessor", "chunk_length": 30,
        "hop_length": 160, "n_fft": 400, "sampling_rate": 16000}"#;
    const WHISPER: &str = r#"{"feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": 80, "processor_class": "WhisperProcessor"}"#;

    fn plan(config: &str, samples: u64, budget: u32) -> PluginResult<(TokenPlan, Choices)> {
        let plan = Processor::from_config(config)?.plan(samples, budget, None)?;
        let choices = plan.choices()?;
        Ok((plan, choices))
    }

    #[test]
    fn for_a_model_server_only_the_chunk_its_processor_keeps_is_planned() {
        let config = QWEN2_AUDIO.replace('{', r#"{"mmgate_server_processor": true, "#);
        let (plan, choices) = plan(&config, 61 * 16_000, u32::MAX).unwrap();
        assert_eq!((choices.chunks, choices.total_chunks), (1, 3));
        assert_eq!((plan.tokens, plan.reduced), (750, true));
        assert!(
            plan.reason.contains("server's processor"),
            "{}",
            plan.reason
        );
        let (native, choices) = plan_native(61 * 16_000);
        assert_eq!((choices.chunks, native.reduced), (3, false));
    }

    fn plan_native(samples: u64) -> (TokenPlan, Choices) {
        plan(QWEN2_AUDIO, samples, u32::MAX).unwrap()
    }

    #[test]
    fn qwen2_audio_counts_tokens_on_the_unpadded_length() {
        // A full chunk: 3000 frames → 1500 → 750.
        assert_eq!(plan(QWEN2_AUDIO, 480_000, u32::MAX).unwrap().0.tokens, 750);
        // 10 s: 1000 frames → 500 → 250.
        assert_eq!(plan(QWEN2_AUDIO, 160_000, u32::MAX).unwrap().0.tokens, 250);
        // 1 s + 1 sample: ceil(16001 / 160) = 101 frames → 51 → 25.
        assert_eq!(plan(QWEN2_AUDIO, 16_001, u32::MAX).unwrap().0.tokens, 25);
        // 65 s: 750 + 750 + (500 frames → 250 → 125).
        let (p, c) = plan(QWEN2_AUDIO, 65 * 16_000, u32::MAX).unwrap();
        assert_eq!(
            (p.tokens, c.chunks, &c.chunk_tokens[..]),
            (1625, 3, &[750, 750, 125][..])
        );
        assert!(!p.reduced);
    }

    #[test]
    fn the_reason_counts_in_words_that_agree() {
        // 4 frames -> 2 -> 1 token.
        let (p, _) = plan(QWEN2_AUDIO, 640, u32::MAX).unwrap();
        assert!(
            p.reason.ends_with("1 chunk of 30 s: 1 token"),
            "{}",
            p.reason
        );
        let (p, _) = plan(QWEN2_AUDIO, 65 * 16_000, u32::MAX).unwrap();
        assert!(
            p.reason.ends_with("3 chunks of 30 s: 1625 tokens"),
            "{}",
            p.reason
        );
    }

    #[test]
    fn whisper_costs_1500_per_chunk_whatever_its_length() {
        assert_eq!(plan(WHISPER, 16_000, u32::MAX).unwrap().0.tokens, 1500);
        assert_eq!(plan(WHISPER, 480_001, u32::MAX).unwrap().0.tokens, 3000);
    }

    #[test]
    fn over_budget_keeps_leading_chunks_or_refuses() {
        let (p, c) = plan(QWEN2_AUDIO, 65 * 16_000, 1600).unwrap();
        assert_eq!((p.tokens, c.chunks, c.total_chunks), (1500, 2, 3));
        assert_eq!(c.kept_samples, 960_000);
        assert!(p.reduced);
        assert!(p.reason.contains("first 2 of 3"), "{}", p.reason);
        match plan(QWEN2_AUDIO, 65 * 16_000, 700) {
            Err(PluginError::OverBudget(o)) => {
                assert_eq!((o.needed_tokens, o.budget_tokens), (750, 700))
            }
            other => panic!("expected over-budget, got {other:?}"),
        }
    }

    #[test]
    fn audio_too_short_for_a_token_is_invalid() {
        // 320 samples: 2 frames → 1 → 0 tokens.
        assert!(matches!(
            plan(QWEN2_AUDIO, 320, u32::MAX),
            Err(PluginError::InvalidMedia(_))
        ));
        assert_eq!(plan(QWEN2_AUDIO, 321, u32::MAX).unwrap().0.tokens, 1);
    }

    #[test]
    fn configs_that_would_change_the_features_are_refused() {
        for bad in [
            r#"{"feature_extractor_type": "Wav2Vec2FeatureExtractor"}"#,
            r#"{"feature_size": 80}"#,
            r#"{"feature_extractor_type": "WhisperFeatureExtractor", "sampling_rate": 24000}"#,
            r#"{"feature_extractor_type": "WhisperFeatureExtractor", "dither": 0.0001}"#,
            r#"{"feature_extractor_type": "WhisperFeatureExtractor", "do_normalize": true}"#,
        ] {
            assert!(
                matches!(
                    Processor::from_config(bad),
                    Err(PluginError::Unsupported(_))
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_token_rule_can_be_overridden() {
        let config = r#"{"feature_extractor_type": "WhisperFeatureExtractor",
            "audio_token_rule": "qwen2-audio"}"#;
        assert_eq!(
            Processor::from_config(config).unwrap().rule,
            TokenRule::Qwen2Audio
        );
    }

    #[test]
    fn preprocess_emits_planned_shapes_and_mask() {
        let processor = Processor::from_config(QWEN2_AUDIO).unwrap();
        let (_, choices) = plan(QWEN2_AUDIO, 500_000, u32::MAX).unwrap();
        let tensors = processor.preprocess(vec![0.1; 499_990], &choices).unwrap();
        assert_eq!(tensors[0].name, "input_features");
        assert_eq!(tensors[0].shape, [2, 128, 3000]);
        assert_eq!(tensors[1].shape, [2, 3000]);
        let mask: Vec<i64> = tensors[1]
            .data
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(mask[..3000].iter().sum::<i64>(), 3000);
        // 20 000 samples in the second chunk: 125 frames.
        assert_eq!(mask[3000..].iter().sum::<i64>(), 125);
    }
}
