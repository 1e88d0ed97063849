//! `mmgate preprocess`, run as a user runs it: the real binary on the image parity fixtures, its
//! safetensors output read back and compared with what transformers wrote for the same inputs.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use safetensors::SafeTensors;
use serde_json::Value;

use common::mmgate;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/image")
}

/// A model directory whose `preprocessor_config.json` is the fixture config `name`.
fn model_dir(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixtures().join("configs").join(format!("{name}.json")),
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
    let model = model_dir(config);
    let out_dir = tempfile::tempdir().unwrap();
    let out = out_dir.path().join("out.safetensors");
    let mut flags = vec!["--explain"];
    flags.extend_from_slice(extra);
    let result = preprocess(
        model.path(),
        &fixtures().join("images").join(image),
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
        r#"{"image_processor_type": "LlavaNextImageProcessor"}"#,
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
