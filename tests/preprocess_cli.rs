//! `mmgate preprocess`, run as a user runs it: the real binary on the image and audio parity
//! fixtures, its safetensors output read back and compared with what transformers wrote for the same
//! inputs.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Output;

use safetensors::SafeTensors;
use serde_json::Value;

use common::mmgate;

/// The parity fixtures of `modality` (`image`, `audio`).
fn fixtures_of(modality: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(modality)
}

fn fixtures() -> PathBuf {
    fixtures_of("image")
}

/// A model directory whose `preprocessor_config.json` is the image fixture config `name`.
fn model_dir(name: &str) -> tempfile::TempDir {
    model_dir_of("image", name)
}

fn model_dir_of(modality: &str, name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixtures_of(modality)
            .join("configs")
            .join(format!("{name}.json")),
        dir.path().join("preprocessor_config.json"),
    )
    .unwrap();
    dir
}

fn preprocess(model: &Path, image: &Path, out: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "preprocess",
        "--model",
        model.to_str().unwrap(),
        image.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    mmgate(&args)
}

/// `mmgate preprocess --explain` of fixture `image` with fixture config `config` (plus `extra`
/// flags), which must succeed: its `--explain` JSON and the safetensors file it wrote.
fn preprocess_ok(config: &str, image: &str, extra: &[&str]) -> (Value, Vec<u8>) {
    preprocess_fixture_ok("image", config, &format!("images/{image}"), extra)
}

/// The same for any modality's fixture `file` (relative to its fixture directory).
fn preprocess_fixture_ok(
    modality: &str,
    config: &str,
    file: &str,
    extra: &[&str],
) -> (Value, Vec<u8>) {
    let model = model_dir_of(modality, config);
    let out_dir = tempfile::tempdir().unwrap();
    let out = out_dir.path().join("out.safetensors");
    let mut flags = vec!["--explain"];
    flags.extend_from_slice(extra);
    let result = preprocess(
        model.path(),
        &fixtures_of(modality).join(file),
        &out,
        &flags,
    );
    assert!(result.status.success(), "{result:?}");
    let explain = serde_json::from_slice(&result.stdout).unwrap();
    (explain, std::fs::read(&out).unwrap())
}

fn f32_values(view: &safetensors::tensor::TensorView<'_>) -> Vec<f32> {
    match view.dtype() {
        safetensors::Dtype::F32 => view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect(),
        // The goldens are stored as f16: widen them.
        safetensors::Dtype::F16 => view
            .data()
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => panic!("unexpected dtype {other:?}"),
    }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn qwen2_vl_output_is_hf_layout_and_matches_the_golden() {
    let (explain, bytes) = preprocess_ok("qwen2-vl", "png-rgba.png", &[]);
    assert_eq!(explain["original_size"]["width"], 111);
    assert_eq!(explain["original_size"]["height"], 111);
    assert_eq!(explain["resized_size"]["width"], 112);
    assert_eq!(explain["resized_size"]["height"], 112);
    assert_eq!(explain["tokens"], 16);
    assert!(explain["time_ms"]["total"].as_f64().unwrap() > 0.0);

    let written = SafeTensors::deserialize(&bytes).unwrap();
    let golden_bytes =
        std::fs::read(fixtures().join("goldens/qwen2-vl--png-rgba.safetensors")).unwrap();
    let golden = SafeTensors::deserialize(&golden_bytes).unwrap();

    let pixel_values = written.tensor("pixel_values").unwrap();
    assert_eq!(pixel_values.dtype(), safetensors::Dtype::F32);
    assert_eq!(pixel_values.shape(), [64, 1176]);
    let expected = golden.tensor("pixel_values").unwrap();
    assert_eq!(pixel_values.shape(), expected.shape());
    let diff = max_abs_diff(&f32_values(&pixel_values), &f32_values(&expected));
    assert!(diff <= 0.05, "max |diff| {diff}");

    let grid = written.tensor("image_grid_thw").unwrap();
    assert_eq!(grid.dtype(), safetensors::Dtype::I64);
    assert_eq!(grid.shape(), [1, 3]);
    assert_eq!(grid.data(), golden.tensor("image_grid_thw").unwrap().data());
}

#[test]
fn fixed_size_output_is_nchw() {
    let (explain, bytes) = preprocess_ok("clip-vit-l-336", "png-rgb-wide.png", &[]);
    assert_eq!(explain["tokens"], 576);
    let written = SafeTensors::deserialize(&bytes).unwrap();
    let pixel_values = written.tensor("pixel_values").unwrap();
    assert_eq!(pixel_values.dtype(), safetensors::Dtype::F32);
    assert_eq!(pixel_values.shape(), [1, 3, 336, 336]);
    assert!(written.tensor("image_grid_thw").is_err());
}

#[test]
fn a_budget_shrinks_the_image_and_says_so() {
    let (explain, bytes) = preprocess_ok("qwen2-vl", "photo-640x480.jpg", &["--max-tokens", "40"]);
    assert_eq!(explain["tokens"], 35);
    assert_eq!(explain["reduced"], true);
    assert!(explain["reason"].as_str().unwrap().contains("budget of 40"));
    // 196x140: a 14x10 grid of patches, 35 merged tokens.
    let written = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(written.tensor("pixel_values").unwrap().shape(), [140, 1176]);
}

/// Bad input: a non-zero exit and exactly one line saying why, and no output file.
#[test]
fn bad_inputs_fail_with_one_line() {
    let model = model_dir("qwen2-vl");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("never.safetensors");
    let photo = std::fs::read(fixtures().join("images/photo-640x480.jpg")).unwrap();
    let truncated = dir.path().join("truncated.jpg");
    std::fs::write(&truncated, &photo[..100]).unwrap();
    let text = dir.path().join("notes.txt");
    std::fs::write(&text, "not an image at all").unwrap();
    let empty = dir.path().join("empty.png");
    std::fs::write(&empty, b"").unwrap();
    let unknown_model = tempfile::tempdir().unwrap();
    std::fs::write(
        unknown_model.path().join("preprocessor_config.json"),
        r#"{"image_processor_type": "BlipImageProcessor"}"#,
    )
    .unwrap();
    let no_config = tempfile::tempdir().unwrap();

    let cases: [(&Path, &Path, &str); 6] = [
        (model.path(), &truncated, "cannot read the jpeg header"),
        (model.path(), &text, "not a media file"),
        (model.path(), &empty, "not a media file"),
        (model.path(), &dir.path().join("missing.png"), "cannot read"),
        (
            unknown_model.path(),
            &fixtures().join("images/png-grey.png"),
            "not supported",
        ),
        (
            no_config.path(),
            &fixtures().join("images/png-grey.png"),
            "preprocessor_config.json",
        ),
    ];
    for (model, file, reason) in cases {
        let result = preprocess(model, file, &out, &[]);
        let stderr = String::from_utf8_lossy(&result.stderr);
        assert!(!result.status.success(), "{file:?} should fail");
        assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr:?}");
        assert!(stderr.starts_with("error: "), "{stderr}");
        assert!(stderr.contains(reason), "{file:?}: {stderr}");
        assert!(!out.exists());
    }
}

/// The `[chunks, n_mels, frames]` values and mask of an audio output.
fn audio_output(bytes: &[u8]) -> (Vec<usize>, Vec<f32>, Vec<i64>) {
    let tensors = SafeTensors::deserialize(bytes).unwrap();
    let features = tensors.tensor("input_features").unwrap();
    assert_eq!(features.dtype(), safetensors::Dtype::F32);
    let mask = tensors.tensor("feature_attention_mask").unwrap();
    assert_eq!(mask.dtype(), safetensors::Dtype::I64);
    let mask = mask
        .data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
        .collect();
    (features.shape().to_vec(), f32_values(&features), mask)
}

#[test]
fn audio_output_is_hf_layout_and_matches_the_golden() {
    let (explain, bytes) =
        preprocess_fixture_ok("audio", "qwen2-audio", "clips/stereo-16k-s16.wav", &[]);
    assert_eq!(explain["plugin"]["name"], "audio");
    assert_eq!(explain["sample_rate"], 16_000);
    assert_eq!(explain["channels"], 2);
    assert!(explain["duration_seconds"].as_f64().unwrap() > 3.0);
    assert_eq!(explain["chunks"], 1);
    assert!(explain.get("original_size").is_none(), "{explain}");
    let (shape, features, mask) = audio_output(&bytes);
    assert_eq!(shape, [1, 128, 3000]);

    let golden_bytes = std::fs::read(
        fixtures_of("audio").join("goldens/stereo-16k-s16.wav--qwen2-audio.safetensors"),
    )
    .unwrap();
    let golden = SafeTensors::deserialize(&golden_bytes).unwrap();
    let golden_mask: Vec<i64> = golden
        .tensor("feature_attention_mask")
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(mask, golden_mask);
    let audible = mask.iter().sum::<i64>();
    // Qwen2-Audio's count from the mask, as its processor computes it.
    assert_eq!(explain["tokens"], ((audible - 1) / 2 + 1 - 2) / 2 + 1);
    let frames: Vec<usize> = golden
        .tensor("frames.0")
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as usize)
        .collect();
    let expected = f32_values(&golden.tensor("input_features.0").unwrap());
    let actual: Vec<f32> = (0..128)
        .flat_map(|mel| frames.iter().map(move |&f| (mel, f)))
        .map(|(mel, f)| features[mel * 3000 + f])
        .collect();
    assert!(max_abs_diff(&actual, &expected) <= 1e-4);
}

#[test]
fn mel_png_draws_the_audible_frames() {
    let dir = tempfile::tempdir().unwrap();
    let png = dir.path().join("mel.png");
    let (explain, bytes) = preprocess_fixture_ok(
        "audio",
        "whisper-80",
        "clips/long-61s-16k.flac",
        &["--mel-png", png.to_str().unwrap()],
    );
    assert_eq!(explain["chunks"], 3);
    let (_, _, mask) = audio_output(&bytes);
    let png = std::fs::read(&png).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let width = u32::from_be_bytes(png[16..20].try_into().unwrap());
    let height = u32::from_be_bytes(png[20..24].try_into().unwrap());
    // One column per audible frame and a separator between chunks (a column per 400 frames),
    // averaged in groups to at most 6000 pixels; two rows per mel bin.
    let audible = mask.iter().sum::<i64>() as u32;
    let columns = audible + 2 * (audible / 400).max(1);
    let group = columns.div_ceil(6000);
    assert_eq!((width, height), (columns.div_ceil(group), 160));
}

#[test]
fn an_mp4_holding_only_audio_goes_to_the_audio_plugin() {
    // Sniffed as video/mp4 (brand isom), which no plugin lists: the audio plugin's probe takes it.
    let (explain, bytes) =
        preprocess_fixture_ok("audio", "whisper-80", "clips/speech-16k-aac.mp4", &[]);
    assert_eq!(explain["mime_type"], "video/mp4");
    assert_eq!(explain["plugin"]["name"], "audio");
    assert_eq!(explain["format"], "mp4/aac");
    let (shape, _, _) = audio_output(&bytes);
    assert_eq!(shape, [1, 80, 3000]);
}

#[test]
fn bad_audio_fails_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("never.safetensors");
    let audio = model_dir_of("audio", "whisper-80");
    let image = model_dir("qwen2-vl");
    let bad = |name: &str| fixtures_of("audio").join("bad").join(name);
    let clip = fixtures_of("audio").join("clips/speech-16k-s16.wav");
    let cases: [(&Path, PathBuf, &[&str], &str); 4] = [
        (
            audio.path(),
            bad("header-3h.wav"),
            &[],
            "more than the limit of 600 s",
        ),
        (
            audio.path(),
            bad("opus.ogg"),
            &[],
            "no loaded plugin accepts audio/opus",
        ),
        (
            audio.path(),
            clip.clone(),
            &["--max-tokens", "100"],
            "needs 1500 tokens, more than the 100 available",
        ),
        // An image model asked for a spectrogram: the image plugin makes no mel features.
        (
            image.path(),
            fixtures().join("images/png-grey.png"),
            &["--mel-png", "never.png"],
            "no input_features",
        ),
    ];
    for (model, file, flags, reason) in cases {
        let result = preprocess(model, &file, &out, flags);
        let stderr = String::from_utf8_lossy(&result.stderr);
        assert!(!result.status.success(), "{file:?} should fail");
        assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr:?}");
        assert!(stderr.contains(reason), "{file:?}: {stderr}");
        assert!(!out.exists(), "{file:?}: nothing is written on failure");
    }
}

#[test]
fn video_output_has_the_chosen_frames_and_a_contact_sheet() {
    // Qwen2-VL's config serves video too (the image fixture config).
    let model = model_dir("qwen2-vl");
    let out_dir = tempfile::tempdir().unwrap();
    let (out, sheet) = (
        out_dir.path().join("out.safetensors"),
        out_dir.path().join("sheet.png"),
    );
    let clip = fixtures_of("video").join("clips/h264.mp4");
    let result = preprocess(
        model.path(),
        &clip,
        &out,
        &["--explain", "--contact-sheet", sheet.to_str().unwrap()],
    );
    assert!(result.status.success(), "{result:?}");
    let explain: Value = serde_json::from_slice(&result.stdout).unwrap();
    assert_eq!(explain["plugin"]["name"], "video");
    assert_eq!(explain["tokens"], 420);
    let bytes = std::fs::read(&out).unwrap();
    let tensors = SafeTensors::deserialize(&bytes).unwrap();
    let indices = tensors.tensor("frame_indices").unwrap();
    assert_eq!(indices.dtype(), safetensors::Dtype::I64);
    assert_eq!(indices.shape(), [6]);
    assert_eq!(tensors.tensor("video_grid_thw").unwrap().shape(), [1, 3]);
    assert_eq!(
        tensors.tensor("pixel_values_videos").unwrap().shape(),
        [3 * 20 * 28, 1176]
    );
    // A PNG: 4 thumbnails to a row, 2 rows.
    let sheet = std::fs::read(&sheet).unwrap();
    assert!(sheet.starts_with(b"\x89PNG\r\n\x1a\n"));
    let width = u32::from_be_bytes(sheet[16..20].try_into().unwrap());
    assert!(width > 4 * 100, "{width}");

    // A truncated video: non-zero exit, one line, no files.
    let broken = out_dir.path().join("broken.mp4");
    std::fs::write(&broken, &std::fs::read(&clip).unwrap()[..2000]).unwrap();
    let out2 = out_dir.path().join("broken.safetensors");
    let result = preprocess(model.path(), &broken, &out2, &[]);
    assert!(!result.status.success());
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(!out2.exists());
}
