//! Parity of the built-in audio plugin with transformers' `WhisperFeatureExtractor`.
//!
//! The clips, configs and goldens are made by `tests/fixtures/audio/generate.py` (pinned
//! transformers and librosa; see its docstring for the reference pipeline). Every case runs through
//! the real host: probe, plan, preprocess. Shapes, chunk counts, token counts and attention masks
//! must be exact; features within the tolerance of their kind of input.

use crate::common;

use std::path::PathBuf;

use mmgate_host::{Budget, CallError, Dtype, LoadedPlugin, Media, PluginError, Tensor};
use safetensors::SafeTensors;
use serde::Deserialize;

/// 16 kHz lossless input (WAV, FLAC): the same samples go in on both sides, so only the
/// arithmetic differs (f32 FFT here, f64 in transformers' numpy path).
const LOSSLESS_TOLERANCE: f32 = 1e-4;
/// 16 kHz lossy input (MP3, Vorbis, AAC): symphonia's decoders against libsndfile's mpg123 and
/// libvorbis and FFmpeg's AAC decoder. They agree to ~1e-5 per sample (float arithmetic in
/// different orders), measured here at up to 7e-5 in the features.
const LOSSY_TOLERANCE: f32 = 1e-4;
/// Input at other rates: rubato's FFT resampler against librosa's soxr "HQ", on the mel bins below
/// 0.9 of the lower Nyquist frequency (the passband both filters leave alone): ≤ 8e-4 measured.
const RESAMPLED_PASSBAND_TOLERANCE: f32 = 2e-3;
/// The same on every bin. The top bins (7.3 to 8 kHz) sit in the filters' transition bands, where
/// the two resamplers attenuate differently; with the plugin's filter sized to soxr HQ's transition
/// width the difference there is ≤ 0.037 measured (0.45 with rubato's default, longer filter).
const RESAMPLED_TOLERANCE: f32 = 0.06;

#[derive(Debug, Deserialize)]
struct Fixtures {
    transformers: String,
    librosa: String,
    cases: Vec<Case>,
    budgets: Vec<BudgetCase>,
}

#[derive(Debug, Deserialize)]
struct Case {
    name: String,
    clip: String,
    config: String,
    sample_rate: u32,
    channels: u32,
    resampled: bool,
    /// Mel bins wholly below 0.9 of the lower Nyquist frequency.
    passband_bins: usize,
    samples: u64,
    chunks: u64,
    tokens: u32,
    golden: String,
}

#[derive(Debug, Deserialize)]
struct BudgetCase {
    clip: String,
    config: String,
    budget: u32,
    chunks: Option<u64>,
    tokens: Option<u32>,
    over_budget: Option<OverBudget>,
}

#[derive(Debug, Deserialize)]
struct OverBudget {
    needed: u32,
    budget: u32,
}

fn fixtures_dir() -> PathBuf {
    common::fixtures_dir("audio")
}

fn fixtures() -> Fixtures {
    serde_json::from_slice(&std::fs::read(fixtures_dir().join("cases.json")).unwrap()).unwrap()
}

fn media(path: &str) -> Media {
    Media {
        data: std::fs::read(fixtures_dir().join(path)).unwrap(),
        mime_type: None,
    }
}

fn config(path: &str) -> String {
    std::fs::read_to_string(fixtures_dir().join(path)).unwrap()
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

fn i64s(bytes: &[u8]) -> Vec<i64> {
    bytes
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

fn tensor<'a>(tensors: &'a [Tensor], name: &str) -> &'a Tensor {
    tensors.iter().find(|t| t.name == name).unwrap()
}

/// The largest |plugin − HF| feature difference: over every mel bin, and over the passband bins.
struct Diff {
    all: f32,
    passband: f32,
}

/// Runs one case through the host; returns the largest feature differences.
fn run(plugin: &LoadedPlugin, case: &Case) -> Diff {
    let media = media(&case.clip);
    let config = config(&case.config);
    let info = plugin.probe(&media).unwrap();
    assert_eq!(info.modality, "audio");
    assert_eq!(info.sample_rate, Some(case.sample_rate), "sample rate");
    assert_eq!(info.channels, Some(case.channels), "channels");
    let plan = plugin
        .plan(
            &info,
            Budget {
                max_tokens: u32::MAX,
            },
            &config,
        )
        .unwrap();
    assert_eq!(plan.tokens, case.tokens, "tokens");
    assert!(!plan.reduced);
    let choices: serde_json::Value = serde_json::from_str(&plan.choices).unwrap();
    assert_eq!(choices["samples"], case.samples, "16 kHz samples");
    assert_eq!(choices["chunks"], case.chunks, "chunks");

    let tensors = plugin.preprocess(&media, &plan, &config).unwrap();
    let golden_bytes = std::fs::read(fixtures_dir().join(&case.golden)).unwrap();
    let golden = SafeTensors::deserialize(&golden_bytes).unwrap();

    let mask = tensor(&tensors, "feature_attention_mask");
    assert_eq!(mask.dtype, Dtype::I64);
    let golden_mask = golden.tensor("feature_attention_mask").unwrap();
    assert_eq!(mask.shape, [case.chunks, 3000]);
    assert_eq!(i64s(&mask.data), i64s(golden_mask.data()), "attention mask");

    let features = tensor(&tensors, "input_features");
    assert_eq!(features.dtype, Dtype::F32);
    let n_mels = features.shape[1] as usize;
    assert_eq!(features.shape, [case.chunks, n_mels as u64, 3000]);
    let actual = f32s(&features.data);
    // NaN must fail, so a NaN difference counts as infinite.
    let mut diff = Diff {
        all: 0.0,
        passband: 0.0,
    };
    for chunk in 0..case.chunks as usize {
        let frames = i64s(golden.tensor(&format!("frames.{chunk}")).unwrap().data());
        let expected = f32s(
            golden
                .tensor(&format!("input_features.{chunk}"))
                .unwrap()
                .data(),
        );
        assert_eq!(expected.len(), n_mels * frames.len());
        for mel in 0..n_mels {
            for (k, &frame) in frames.iter().enumerate() {
                let a = actual[(chunk * n_mels + mel) * 3000 + frame as usize];
                let e = expected[mel * frames.len() + k];
                let d = (a - e).abs();
                let d = if d.is_nan() { f32::INFINITY } else { d };
                diff.all = diff.all.max(d);
                if mel < case.passband_bins {
                    diff.passband = diff.passband.max(d);
                }
            }
        }
    }
    diff
}

/// Tolerances on (every bin, the passband bins).
fn tolerance(case: &Case) -> (f32, f32) {
    if case.resampled {
        (RESAMPLED_TOLERANCE, RESAMPLED_PASSBAND_TOLERANCE)
    } else if [".mp3", ".ogg", ".m4a", ".mp4"]
        .iter()
        .any(|e| case.clip.ends_with(e))
    {
        (LOSSY_TOLERANCE, LOSSY_TOLERANCE)
    } else {
        (LOSSLESS_TOLERANCE, LOSSLESS_TOLERANCE)
    }
}

#[test]
fn audio_plugin_matches_whisper_feature_extractor() {
    let fixtures = fixtures();
    assert!(fixtures.cases.len() >= 25, "the fixture set is incomplete");
    println!(
        "audio parity against transformers {} (librosa {} for loading and resampling)",
        fixtures.transformers, fixtures.librosa
    );
    let plugin = common::builtin_plugin("audio");
    common::check_all(
        &fixtures.cases,
        |case| &case.name,
        |case| {
            let diff = run(&plugin, case);
            let (all, passband) = tolerance(case);
            println!(
                "{:<44} max |diff| {:.6} (≤ {all}), below 0.9·Nyquist {:.6} (≤ {passband})",
                case.name, diff.all, diff.passband
            );
            if diff.all > all || diff.passband > passband {
                return Err(format!(
                    "max |diff| {} (passband {}) > {all} ({passband})",
                    diff.all, diff.passband
                ));
            }
            Ok(())
        },
    );
}

#[test]
fn budgets_keep_leading_chunks_or_refuse() {
    let plugin = common::builtin_plugin("audio");
    for case in fixtures().budgets {
        let media = media(&case.clip);
        let config = config(&case.config);
        let info = plugin.probe(&media).unwrap();
        let planned = plugin.plan(
            &info,
            Budget {
                max_tokens: case.budget,
            },
            &config,
        );
        match case.over_budget {
            Some(expected) => match planned {
                Err(CallError::Plugin(PluginError::OverBudget(over))) => {
                    assert_eq!(over.needed_tokens, expected.needed);
                    assert_eq!(over.budget_tokens, expected.budget);
                }
                other => panic!(
                    "budget {}: expected over-budget, got {other:?}",
                    case.budget
                ),
            },
            None => {
                let plan = planned.unwrap();
                assert_eq!(Some(plan.tokens), case.tokens);
                assert!(plan.reduced);
                let tensors = plugin.preprocess(&media, &plan, &config).unwrap();
                let chunks = case.chunks.unwrap();
                assert_eq!(tensor(&tensors, "input_features").shape[0], chunks);
                assert_eq!(
                    tensor(&tensors, "feature_attention_mask").shape,
                    [chunks, 3000]
                );
            }
        }
    }
}
