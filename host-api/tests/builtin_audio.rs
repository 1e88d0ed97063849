//! The built-in audio plugin through the real host with bad input: every file gets a typed error
//! (never a crash of the plugin, let alone the host), and a damaged file that still decodes keeps
//! the plan's promise. (Feature parity with transformers is `audio_parity.rs`.)

use crate::common;

use std::path::PathBuf;
use std::sync::Arc;

use mmgate_host::{Budget, CallError, LoadedPlugin, Media, MediaInfo, PluginError, Tensor};

fn fixtures_dir() -> PathBuf {
    common::fixtures_dir("audio")
}

fn audio_plugin() -> Arc<LoadedPlugin> {
    common::builtin_plugin("audio")
}

fn qwen2_audio() -> String {
    std::fs::read_to_string(fixtures_dir().join("configs/qwen2-audio.json")).unwrap()
}

fn media(data: Vec<u8>) -> Media {
    Media {
        data,
        mime_type: None,
    }
}

fn fixture(path: &str) -> Vec<u8> {
    std::fs::read(fixtures_dir().join(path)).unwrap()
}

/// Probe, plan with room for everything, preprocess: a request's whole path.
fn preprocess(plugin: &LoadedPlugin, media: &Media) -> Result<(u32, Vec<Tensor>), CallError> {
    let config = qwen2_audio();
    let info = plugin.probe(media)?;
    let plan = plugin.plan(
        &info,
        Budget {
            max_tokens: u32::MAX,
        },
        &config,
    )?;
    let tensors = plugin.preprocess(media, &plan, &config)?;
    Ok((plan.tokens, tensors))
}

/// Tokens the Qwen2-Audio rule gives the attention masks the plugin returned.
fn tokens_from_mask(tensors: &[Tensor]) -> u32 {
    let mask = tensors
        .iter()
        .find(|t| t.name == "feature_attention_mask")
        .unwrap();
    mask.data
        .chunks_exact(3000 * 8)
        .map(|row| {
            let frames = row
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
                .sum::<i64>();
            let after_conv = (frames - 1) / 2 + 1;
            ((after_conv - 2).div_euclid(2) + 1) as u32
        })
        .sum()
}

#[test]
fn hostile_audio_files_get_typed_errors() {
    let plugin = audio_plugin();
    type Check = fn(&PluginError) -> bool;
    let cases: &[(&str, Check)] = &[
        (
            "empty.wav",
            |e| matches!(e, PluginError::InvalidMedia(m) if m.contains("empty")),
        ),
        ("text.wav", |e| matches!(e, PluginError::Unsupported(_))),
        ("image.mp3", |e| matches!(e, PluginError::Unsupported(_))),
        ("truncated-header.wav", |e| {
            matches!(
                e,
                PluginError::InvalidMedia(_) | PluginError::Unsupported(_)
            )
        }),
        ("truncated-header.mp3", |e| {
            matches!(
                e,
                PluginError::InvalidMedia(_) | PluginError::Unsupported(_)
            )
        }),
        ("garbage.mp3", |e| {
            matches!(
                e,
                PluginError::InvalidMedia(_) | PluginError::Unsupported(_)
            )
        }),
        (
            "header-3h.wav",
            |e| matches!(e, PluginError::LimitExceeded(m) if m.contains("600")),
        ),
        (
            "channels-20.wav",
            |e| matches!(e, PluginError::LimitExceeded(m) if m.contains("20 audio channels")),
        ),
        (
            "opus.ogg",
            |e| matches!(e, PluginError::Unsupported(m) if m.contains("codec")),
        ),
    ];
    for (name, expected) in cases {
        let media = media(fixture(&format!("bad/{name}")));
        match preprocess(&plugin, &media) {
            Ok(_) => panic!("{name}: expected an error"),
            Err(CallError::Plugin(e)) => assert!(expected(&e), "{name}: {e:?}"),
            Err(other) => panic!("{name}: expected a typed plugin error, got {other:?}"),
        }
    }
}

/// Cut every container at several points, and overwrite a stretch in the middle with noise: each
/// result is either a typed error or features whose mask matches the planned token count.
#[test]
fn damaged_files_decode_what_is_there_or_fail_cleanly() {
    let plugin = audio_plugin();
    let clips = [
        "speech-16k-s16.wav",
        "speech-16k.flac",
        "speech-16k.mp3",
        "speech-16k.ogg",
        "speech-16k.m4a",
        "speech-22k05.mp3",
    ];
    let mut outcomes = (0, 0);
    for clip in clips {
        let data = fixture(&format!("clips/{clip}"));
        let mut variants: Vec<(String, Vec<u8>)> = [0.1, 0.35, 0.6, 0.9]
            .iter()
            .map(|f| {
                let cut = (data.len() as f64 * f) as usize;
                (format!("{clip} cut at {cut}"), data[..cut].to_vec())
            })
            .collect();
        let mut noisy = data.clone();
        let (start, end) = (data.len() / 3, data.len() / 3 + data.len() / 10);
        let mut state = 0x2545_f491_u32;
        for byte in &mut noisy[start..end] {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            *byte = state as u8;
        }
        variants.push((format!("{clip} with noise in {start}..{end}"), noisy));
        for (what, data) in variants {
            match preprocess(&plugin, &media(data)) {
                Ok((tokens, tensors)) => {
                    assert_eq!(tokens_from_mask(&tensors), tokens, "{what}");
                    outcomes.0 += 1;
                }
                Err(CallError::Plugin(_)) => outcomes.1 += 1,
                Err(other) => panic!("{what}: expected a typed plugin error, got {other:?}"),
            }
        }
    }
    println!(
        "{} damaged files decoded, {} refused with a typed error",
        outcomes.0, outcomes.1
    );
    // Truncation at 35 % or later leaves decodable audio in every format.
    assert!(outcomes.0 >= clips.len() * 2, "{outcomes:?}");
}

/// A 16 kHz mono 16-bit WAV of `samples` samples of a quiet tone, written by hand.
fn wav_16k(samples: usize) -> Vec<u8> {
    let data_len = (samples * 2) as u32;
    let mut out = Vec::with_capacity(44 + samples * 2);
    out.extend_from_slice(b"RIFF");
    out.extend_from_slice(&(36 + data_len).to_le_bytes());
    out.extend_from_slice(b"WAVEfmt ");
    out.extend_from_slice(&16u32.to_le_bytes());
    out.extend_from_slice(&1u16.to_le_bytes()); // PCM
    out.extend_from_slice(&1u16.to_le_bytes()); // mono
    out.extend_from_slice(&16_000u32.to_le_bytes());
    out.extend_from_slice(&32_000u32.to_le_bytes());
    out.extend_from_slice(&2u16.to_le_bytes());
    out.extend_from_slice(&16u16.to_le_bytes());
    out.extend_from_slice(b"data");
    out.extend_from_slice(&data_len.to_le_bytes());
    out.extend((0..samples).flat_map(|i| (((i % 64) as i16 - 32) * 64).to_le_bytes()));
    out
}

#[test]
fn ten_minutes_is_the_limit() {
    let plugin = audio_plugin();
    let (tokens, tensors) = preprocess(&plugin, &media(wav_16k(600 * 16_000))).unwrap();
    assert_eq!(tokens, 20 * 750);
    assert_eq!(tensors[0].shape, [20, 128, 3000]);
    assert_eq!(tokens_from_mask(&tensors), tokens);
    // One sample more is refused from the header, before anything is decoded.
    let error = plugin.probe(&media(wav_16k(600 * 16_000 + 1))).unwrap_err();
    assert!(
        matches!(&error, CallError::Plugin(PluginError::LimitExceeded(m)) if m.contains("600")),
        "{error:?}"
    );
}

#[test]
fn the_declared_mime_type_is_only_a_hint() {
    let plugin = audio_plugin();
    let media = Media {
        data: fixture("clips/speech-16k.mp3"),
        mime_type: Some("audio/wav".into()),
    };
    let info = plugin.probe(&media).unwrap();
    assert_eq!(info.format, "mp3/mp3");
    assert!(preprocess(&plugin, &media).is_ok());
}

#[test]
fn plan_refuses_media_info_it_did_not_probe() {
    let plugin = audio_plugin();
    let mut info = MediaInfo {
        modality: "audio".into(),
        format: "wav/pcm".into(),
        width: None,
        height: None,
        frame_count: None,
        fps: None,
        duration_seconds: None,
        sample_rate: None,
        channels: None,
        extra: Vec::new(),
    };
    let budget = Budget { max_tokens: 10_000 };
    let error = plugin.plan(&info, budget, &qwen2_audio()).unwrap_err();
    assert!(
        matches!(&error, CallError::Plugin(PluginError::InvalidMedia(_))),
        "{error:?}"
    );
    // An info that claims more than the duration limit is refused even if it did not come from
    // this plugin's probe.
    info.sample_rate = Some(16_000);
    info.duration_seconds = Some(3600.0);
    let error = plugin.plan(&info, budget, &qwen2_audio()).unwrap_err();
    assert!(
        matches!(&error, CallError::Plugin(PluginError::LimitExceeded(_))),
        "{error:?}"
    );
}

#[test]
fn describe_lists_the_audio_mime_types_and_extractor() {
    let plugin = audio_plugin();
    let descriptor = plugin.descriptor();
    assert_eq!(descriptor.modalities, ["audio"]);
    for mime in [
        "audio/wav",
        "audio/mpeg",
        "audio/flac",
        "audio/ogg",
        "audio/mp4",
    ] {
        assert!(
            descriptor.mime_types.iter().any(|m| m == mime),
            "{mime} missing"
        );
    }
    assert_eq!(descriptor.processor_types, ["WhisperFeatureExtractor"]);
}
