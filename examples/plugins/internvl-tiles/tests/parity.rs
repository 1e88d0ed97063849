//! Parity with transformers' InternVL image processor, through the real mmgate host: every case of
//! `fixtures/cases.json` (made by `fixtures/generate.py`) runs the built component in the production
//! sandbox. Tiles, tokens, shapes and `num_patches` exact; pixel values within 0.05 (the goldens are
//! float16; decoding, resampling and normalising are the same arithmetic as Pillow's, so the measured
//! difference is the float16 rounding alone).

use std::path::{Path, PathBuf};

use mmgate_plugin_sdk::harness::{CallError, Dtype, Harness, PluginError, Tensor};
use safetensors::SafeTensors;
use serde_json::Value;

const TOLERANCE: f32 = 0.05;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn plugin() -> std::sync::Arc<Harness> {
    Harness::build(env!("CARGO_MANIFEST_DIR")).unwrap_or_else(|e| panic!("build: {e}"))
}

fn tensor<'a>(tensors: &'a [Tensor], name: &str) -> &'a Tensor {
    tensors
        .iter()
        .find(|t| t.name == name)
        .unwrap_or_else(|| panic!("no tensor {name}"))
}

fn f32s(tensor: &Tensor) -> Vec<f32> {
    assert_eq!(tensor.dtype, Dtype::F32);
    tensor
        .data
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// Max |plugin − golden| over the pixel values.
fn pixel_difference(name: &str, ours: &Tensor) -> f32 {
    let bytes = read(
        &fixtures()
            .join("goldens")
            .join(format!("{name}.safetensors")),
    );
    let golden = SafeTensors::deserialize(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
    let expected = golden
        .tensor("pixel_values")
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let expected: Vec<f32> = expected
        .data()
        .chunks_exact(2)
        .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect();
    let ours = f32s(ours);
    assert_eq!(ours.len(), expected.len(), "{name}: element count");
    ours.iter()
        .zip(&expected)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
}

#[test]
fn every_case_matches_transformers() {
    let plugin = plugin();
    let cases: Value = serde_json::from_slice(&read(&fixtures().join("cases.json")))
        .unwrap_or_else(|e| panic!("cases.json: {e}"));
    let cases = cases["cases"]
        .as_array()
        .unwrap_or_else(|| panic!("no cases"));
    assert!(cases.len() >= 40);
    let mut worst = 0f32;
    for case in cases {
        let name = case["name"].as_str().unwrap_or_default();
        let image = read(
            &fixtures()
                .join("images")
                .join(case["image"].as_str().unwrap_or_default()),
        );
        let config_file = format!("{}.json", case["config"].as_str().unwrap_or_default());
        let config = String::from_utf8(read(&fixtures().join("configs").join(config_file)))
            .unwrap_or_else(|e| panic!("{e}"));
        let budget = case["budget"].as_u64().map_or(u32::MAX, |b| b as u32);
        let outcome = plugin.run(&image, &config, budget);

        if let Some(expected) = case["expect_error"].as_str() {
            assert_eq!(expected, "over-budget");
            match outcome {
                Err(CallError::Plugin(PluginError::OverBudget(o))) => {
                    assert_eq!(
                        Value::from(o.needed_tokens),
                        case["needed_tokens"],
                        "{name}"
                    );
                }
                other => panic!(
                    "{name}: expected over-budget, got {:?}",
                    other.map(|(p, _)| p)
                ),
            }
            continue;
        }
        let (plan, tensors) = outcome.unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(Value::from(plan.tokens), case["tokens"], "{name}: tokens");
        assert_eq!(
            Value::from(plan.reduced),
            case["reduced"],
            "{name}: reduced"
        );
        let choices: Value = serde_json::from_str(&plan.choices).unwrap_or_default();
        let grid = [&choices["grid"]["columns"], &choices["grid"]["rows"]];
        assert_eq!(
            Value::from(grid.map(Clone::clone).to_vec()),
            case["grid"],
            "{name}: grid"
        );

        let pixels = tensor(&tensors, "pixel_values");
        assert_eq!(
            Value::from(pixels.shape.clone()),
            case["pixel_values_shape"],
            "{name}: shape"
        );
        let num_patches = tensor(&tensors, "num_patches");
        assert_eq!(num_patches.dtype, Dtype::I64);
        assert_eq!(
            Value::from(i64::from_le_bytes(
                num_patches.data[..8].try_into().unwrap_or_default()
            )),
            case["tiles"],
            "{name}: num_patches"
        );
        if case["pixels"] == true {
            let difference = pixel_difference(name, pixels);
            assert!(difference <= TOLERANCE, "{name}: max |diff| {difference}");
            worst = worst.max(difference);
        }
    }
    println!("worst pixel difference over all cases: {worst}");
}

#[test]
fn hostile_inputs_are_typed_errors() {
    let plugin = plugin();
    for (bytes, what) in [
        (&b""[..], "empty"),
        (&b"GIF89a"[..], "truncated header"),
        (&b"plain text"[..], "not an image"),
    ] {
        let error = plugin.run(bytes, "{}", u32::MAX).err();
        assert!(
            matches!(error, Some(CallError::Plugin(PluginError::InvalidMedia(_)))),
            "{what}: {error:?}"
        );
    }
    let png = read(&fixtures().join("images/square-200.png"));
    let error = plugin
        .run(
            &png,
            r#"{"image_processor_type": "Qwen2VLImageProcessor"}"#,
            u32::MAX,
        )
        .err();
    assert!(
        matches!(error, Some(CallError::Plugin(PluginError::Unsupported(_)))),
        "{error:?}"
    );
}
