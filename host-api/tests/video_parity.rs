//! The built-in video plugin under the real host (FFmpeg decoder included): parity with qwen-vl-utils
//! + transformers' `Qwen2VLVideoProcessor`, budget cuts, and hostile files.
//!
//! The clips are made by `tests/fixtures/video/make_clips.sh`, the goldens by `make_goldens.py`
//! (pinned versions in its requirements.txt; decord as qwen-vl-utils' reader). Frame indices, grids
//! and token counts must be exact; pixels within 0.05.

use crate::common;

use std::path::PathBuf;

use mmgate_host::{
    Budget, CallError, Dtype, LoadedPlugin, Media, PluginError, SandboxLimits, Tensor,
};
use safetensors::SafeTensors;
use serde::Deserialize;
use serde_json::json;

const PIXEL_TOLERANCE: f32 = 0.05;

#[derive(Debug, Deserialize)]
struct Case {
    name: String,
    clip: String,
    config: serde_json::Map<String, serde_json::Value>,
    total_frames: u64,
    video_fps: f64,
    frame_indices: Vec<i64>,
    second_per_grid_t: f64,
    height: u32,
    width: u32,
    video_grid_thw: Vec<i64>,
    tokens: u32,
    pixels: Option<String>,
}

fn fixtures_dir() -> PathBuf {
    common::fixtures_dir("video")
}

fn cases() -> Vec<Case> {
    serde_json::from_slice(&std::fs::read(fixtures_dir().join("cases.json")).unwrap()).unwrap()
}

fn clip(name: &str) -> Vec<u8> {
    std::fs::read(fixtures_dir().join("clips").join(name)).unwrap()
}

/// Qwen2-VL's preprocessor_config.json plus `extra`.
fn config(extra: &serde_json::Map<String, serde_json::Value>) -> String {
    let mut config = json!({
        "image_processor_type": "Qwen2VLImageProcessor",
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    });
    for (k, v) in extra {
        config[k] = v.clone();
    }
    config.to_string()
}

fn media(data: Vec<u8>) -> Media {
    Media {
        data,
        mime_type: None,
    }
}

fn run(
    plugin: &LoadedPlugin,
    data: Vec<u8>,
    config: &str,
    budget: u32,
) -> Result<(mmgate_host::TokenPlan, Vec<Tensor>), CallError> {
    let media = media(data);
    let info = plugin.probe(&media)?;
    let plan = plugin.plan(&info, Budget { max_tokens: budget }, config)?;
    let tensors = plugin.preprocess(&media, &plan, config)?;
    Ok((plan, tensors))
}

fn tensor<'a>(tensors: &'a [Tensor], name: &str) -> &'a Tensor {
    tensors.iter().find(|t| t.name == name).unwrap()
}

fn i64s(t: &Tensor) -> Vec<i64> {
    assert_eq!(t.dtype, Dtype::I64);
    t.data
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

fn f32s(t: &Tensor) -> Vec<f32> {
    assert_eq!(t.dtype, Dtype::F32);
    t.data
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

#[test]
fn matches_qwen_vl_utils_and_transformers() {
    let plugin = common::builtin_plugin("video");
    let cases = cases();
    assert!(cases.len() >= 19, "the video fixtures are missing");
    common::check_all(
        &cases,
        |c| &c.name,
        |case| {
            let info = plugin
                .probe(&media(clip(&case.clip)))
                .map_err(|e| e.to_string())?;
            if info.frame_count != Some(case.total_frames) {
                return Err(format!(
                    "frames {:?} != {}",
                    info.frame_count, case.total_frames
                ));
            }
            if (info.fps.unwrap() - case.video_fps).abs() > 1e-6 {
                return Err(format!("fps {:?} != {}", info.fps, case.video_fps));
            }
            let (plan, tensors) = run(&plugin, clip(&case.clip), &config(&case.config), 100_000)
                .map_err(|e| e.to_string())?;
            assert_eq!(i64s(tensor(&tensors, "frame_indices")), case.frame_indices);
            assert_eq!(
                i64s(tensor(&tensors, "video_grid_thw")),
                case.video_grid_thw
            );
            assert_eq!(plan.tokens, case.tokens);
            assert!(!plan.reduced);
            let choices: serde_json::Value = serde_json::from_str(&plan.choices).unwrap();
            assert_eq!(choices["width"], case.width);
            assert_eq!(choices["height"], case.height);
            let per_grid = f32s(tensor(&tensors, "second_per_grid_ts"))[0];
            assert!((f64::from(per_grid) - case.second_per_grid_t).abs() < 1e-4);
            let timestamps = f32s(tensor(&tensors, "frame_timestamps"));
            assert_eq!(timestamps.len(), case.frame_indices.len());
            for (t, &i) in timestamps.iter().zip(&case.frame_indices) {
                let expected = i as f64 / case.video_fps;
                assert!(
                    (f64::from(*t) - expected).abs() < 0.02,
                    "timestamp {t} of frame {i}"
                );
            }
            let pixels = tensor(&tensors, "pixel_values_videos");
            let [t, h, w] = case.video_grid_thw[..] else {
                unreachable!()
            };
            assert_eq!(pixels.shape, vec![(t * h * w) as u64, 1176]);
            let Some(golden) = &case.pixels else {
                return Ok(());
            };
            let worst = worst_pixel_difference(&tensors, golden, [(t * h * w) as usize, 1176]);
            if worst > PIXEL_TOLERANCE {
                return Err(format!("pixels differ by up to {worst}"));
            }
            Ok(())
        },
    );
}

#[test]
fn over_budget_cuts_frames_first_then_resolution() {
    let plugin = common::builtin_plugin("video");
    // Small minimum pixels, so the 160x120 clip keeps its own size: 112x168, 24 tokens a frame pair,
    // 6 frames = 72 tokens.
    let mut small = serde_json::Map::new();
    small.insert("video_min_pixels".into(), json!(3136));
    let config = config(&small);
    let (plan, tensors) = run(&plugin, clip("h264.mp4"), &config, 100).unwrap();
    assert_eq!((plan.tokens, plan.reduced), (72, false));
    assert_eq!(i64s(tensor(&tensors, "video_grid_thw")), vec![3, 8, 12]);
    // Fewer frames at the same size.
    let (plan, tensors) = run(&plugin, clip("h264.mp4"), &config, 50).unwrap();
    assert!(plan.reduced, "{}", plan.reason);
    assert_eq!(plan.tokens, 48, "{}", plan.reason);
    assert_eq!(i64s(tensor(&tensors, "frame_indices")), vec![0, 30, 59, 89]);
    assert_eq!(i64s(tensor(&tensors, "video_grid_thw")), vec![2, 8, 12]);
    // The minimum 4 frames at a smaller size.
    let (plan, tensors) = run(&plugin, clip("h264.mp4"), &config, 30).unwrap();
    assert_eq!(plan.tokens, 24, "{}", plan.reason);
    assert!(plan.reason.contains("down from"), "{}", plan.reason);
    assert_eq!(i64s(tensor(&tensors, "video_grid_thw")), vec![2, 6, 8]);
    // Not even 4 frames at the minimum pixels: over budget, saying what it needs.
    match run(&plugin, clip("h264.mp4"), &config, 3) {
        Err(CallError::Plugin(PluginError::OverBudget(o))) => {
            assert_eq!((o.needed_tokens, o.budget_tokens), (4, 3), "{o:?}");
        }
        other => panic!("expected over-budget, got {other:?}"),
    }
    // With the default (128-token) minimum, 4 frames need 280 tokens.
    let default = config_default();
    match run(&plugin, clip("h264.mp4"), &default, 200) {
        Err(CallError::Plugin(PluginError::OverBudget(o))) => assert_eq!(o.needed_tokens, 280),
        other => panic!("expected over-budget, got {other:?}"),
    }
}

fn config_default() -> String {
    config(&serde_json::Map::new())
}

#[test]
fn uniform_and_keyframe_sampling() {
    let plugin = common::builtin_plugin("video");
    let mut uniform = serde_json::Map::new();
    uniform.insert("nframes".into(), json!(10));
    let (_, tensors) = run(&plugin, clip("h264.mp4"), &config(&uniform), 100_000).unwrap();
    assert_eq!(
        i64s(tensor(&tensors, "frame_indices")),
        vec![0, 10, 20, 30, 40, 49, 59, 69, 79, 89]
    );
    // h264.mp4 has a keyframe every 30 frames (make_clips.sh: -g 30), plus x264's scene cuts.
    let mut keyframes = serde_json::Map::new();
    keyframes.insert("video_sampling".into(), json!("keyframes"));
    let (plan, tensors) = run(&plugin, clip("h264.mp4"), &config(&keyframes), 100_000).unwrap();
    let indices = i64s(tensor(&tensors, "frame_indices"));
    assert!(
        indices.starts_with(&[0, 30, 60]),
        "{indices:?} ({})",
        plan.reason
    );
    assert_eq!(indices.len() % 2, 0);
    // MJPEG: every frame is a keyframe; 30 frames.
    let (_, tensors) = run(&plugin, clip("mjpeg.avi"), &config(&keyframes), 100_000).unwrap();
    assert_eq!(i64s(tensor(&tensors, "frame_indices")).len(), 30);
}

fn expect_error(result: Result<impl std::fmt::Debug, CallError>, what: &str) -> PluginError {
    match result {
        Err(CallError::Plugin(e)) => e,
        other => panic!("{what}: expected a plugin error, got {other:?}"),
    }
}

#[test]
fn bad_files_get_clear_errors() {
    let plugin = common::builtin_plugin("video");
    let config = config(&serde_json::Map::new());
    let probe = |data: Vec<u8>| plugin.probe(&media(data));

    let e = expect_error(probe(Vec::new()), "zero bytes");
    assert!(matches!(e, PluginError::InvalidMedia(_)), "{e:?}");
    let e = expect_error(probe(b"this is not a video at all".repeat(40)), "text");
    assert!(matches!(e, PluginError::InvalidMedia(_)), "{e:?}");

    // Mislabelled: a PNG and a WAV are not videos.
    let image = std::fs::read_dir(common::fixtures_dir("image").join("images"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "png"))
        .unwrap();
    let e = expect_error(probe(std::fs::read(image).unwrap()), "png");
    assert!(
        e.message().contains("still image") || matches!(e, PluginError::InvalidMedia(_)),
        "{e:?}"
    );
    let wav = std::fs::read_dir(common::fixtures_dir("audio").join("clips"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "wav"))
        .unwrap();
    let e = expect_error(probe(std::fs::read(wav).unwrap()), "wav");
    assert!(e.message().contains("no video stream"), "{e:?}");

    // Truncated: the header survives but most frames are gone. Either a clear error or a plan over
    // the frames that are there; never a trap.
    for keep in [100, 2_000, 20_000, 40_000] {
        let mut data = clip("h264.mp4");
        data.truncate(keep);
        match run(&plugin, data, &config, 100_000) {
            Ok((plan, _)) => assert!(plan.tokens > 0),
            Err(CallError::Plugin(_)) => {}
            Err(other) => panic!("truncated to {keep}: {other:?}"),
        }
    }

    // Huge resolution: 8192x8192 frames (67 MP; the default limit is 16.7 MP), refused from the
    // header, before any frame is decoded.
    let huge = std::fs::read(fixtures_dir().join("bad/huge.mp4")).unwrap();
    let e = expect_error(probe(huge), "huge resolution");
    assert!(
        matches!(&e, PluginError::LimitExceeded(m) if m.contains("8192x8192")),
        "{e:?}"
    );
}

#[test]
fn the_host_limits_bound_every_video() {
    let limited = |f: fn(&mut mmgate_host::SandboxLimits)| {
        let mut limits = SandboxLimits::default();
        f(&mut limits);
        common::builtin_plugin_with("video", limits)
    };
    let config = config(&serde_json::Map::new());
    type Setter = fn(&mut SandboxLimits);
    let cases: [(&str, Setter); 5] = [
        ("bytes", |l| l.video.max_bytes = 1_000),
        ("duration", |l| l.video.max_duration_seconds = 1.0),
        ("pixels", |l| l.video.max_frame_pixels = 100 * 100),
        ("indexed frames", |l| l.video.max_indexed_frames = 10),
        // An endless stream is bounded by the frames decoded: h264.mp4's frames between keyframes
        // add up past 20 before the last chosen one.
        ("decoded frames", |l| l.video.max_decoded_frames = 20),
    ];
    for (what, set) in cases {
        let plugin = limited(set);
        let e = expect_error(run(&plugin, clip("h264.mp4"), &config, 100_000), what);
        assert!(matches!(e, PluginError::LimitExceeded(_)), "{what}: {e:?}");
    }
    // Unlimited enough: the same clip goes through.
    let plugin = limited(|_| {});
    run(&plugin, clip("h264.mp4"), &config, 100_000).unwrap();
}

#[test]
fn mutated_clips_never_crash_the_host() {
    let plugin = common::builtin_plugin("video");
    let config = config(&serde_json::Map::new());
    let names = ["h264.mp4", "vp9.webm", "mjpeg.avi", "h264.mkv", "short.mp4"];
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let mut random = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state as usize
    };
    for i in 0..60 {
        let mut data = clip(names[i % names.len()]);
        for _ in 0..1 + random() % 30 {
            let at = random() % data.len();
            data[at] = random() as u8;
        }
        // A result or the plugin's typed error; a trap, a host error or a crash fails here.
        match run(&plugin, data, &config, 100_000) {
            Ok(_) | Err(CallError::Plugin(_)) => {}
            Err(other) => panic!("mutation {i}: {other:?}"),
        }
    }
}

/// The largest difference between the plugin's `pixel_values_videos` and a golden file's (float16,
/// of `shape`).
fn worst_pixel_difference(tensors: &[Tensor], golden: &str, shape: [usize; 2]) -> f32 {
    let bytes = std::fs::read(fixtures_dir().join(golden)).unwrap();
    let golden = SafeTensors::deserialize(&bytes).unwrap();
    let golden = golden.tensor("pixel_values_videos").unwrap();
    assert_eq!(golden.shape(), shape);
    let expected = golden
        .data()
        .chunks_exact(2)
        .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32());
    mmgate_host::f32_values(tensors, "pixel_values_videos")
        .unwrap()
        .iter()
        .zip(expected)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max)
}

#[derive(Debug, Deserialize)]
struct Qwen3Case {
    name: String,
    clip: String,
    config: serde_json::Map<String, serde_json::Value>,
    total_frames: u64,
    video_fps: f64,
    frame_indices: Vec<i64>,
    height: u32,
    width: u32,
    video_grid_thw: Vec<i64>,
    tokens: u32,
    pixels: Option<String>,
}

/// Under Qwen3-VL's video processor (its `video_preprocessor_config.json`, which the host hands
/// over inside the processor config): transformers' frames (an odd count padded with the last),
/// sizes over all the frames, grids, token counts and pixels; the source's frame rate exactly, as
/// the prompt's timestamps are computed from it (`make_goldens_qwen3.py`; the timestamps' text is
/// checked against the same cases by the Qwen3-VL family's tests). Frames resize as PyTorch's u8
/// kernel does, so pixels match to the goldens' float16 storage.
#[test]
fn matches_transformers_qwen3_vl_video_processor() {
    let plugin = common::builtin_plugin("video");
    let cases: Vec<Qwen3Case> =
        serde_json::from_slice(&std::fs::read(fixtures_dir().join("cases-qwen3-vl.json")).unwrap())
            .unwrap();
    assert!(cases.len() >= 19, "the Qwen3-VL video fixtures are missing");
    common::check_all(
        &cases,
        |c| &c.name,
        |case| {
            // Qwen3-VL's preprocessor_config.json (its image processor) with the video's.
            let config = json!({
                "image_processor_type": "Qwen2VLImageProcessorFast",
                "size": {"longest_edge": 16777216, "shortest_edge": 65536},
                "patch_size": 16,
                "temporal_patch_size": 2,
                "merge_size": 2,
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
                "video_preprocessor_config": case.config,
            })
            .to_string();
            let (plan, tensors) =
                run(&plugin, clip(&case.clip), &config, 100_000).map_err(|e| e.to_string())?;
            let info = plugin.probe(&media(clip(&case.clip))).unwrap();
            assert_eq!(info.frame_count, Some(case.total_frames));
            assert_eq!(i64s(tensor(&tensors, "frame_indices")), case.frame_indices);
            assert_eq!(
                i64s(tensor(&tensors, "video_grid_thw")),
                case.video_grid_thw
            );
            assert_eq!(plan.tokens, case.tokens);
            assert!(!plan.reduced);
            let choices: serde_json::Value = serde_json::from_str(&plan.choices).unwrap();
            assert_eq!(choices["width"], case.width);
            assert_eq!(choices["height"], case.height);
            let fps = f64::from_bits(i64s(tensor(&tensors, "video_fps_f64_bits"))[0] as u64);
            if (fps - case.video_fps).abs() > 1e-9 {
                return Err(format!("fps {fps} != {}", case.video_fps));
            }
            let [t, h, w] = case.video_grid_thw[..] else {
                unreachable!()
            };
            let pixels = tensor(&tensors, "pixel_values_videos");
            assert_eq!(pixels.shape, vec![(t * h * w) as u64, 1536]);
            let Some(golden) = &case.pixels else {
                return Ok(());
            };
            let worst = worst_pixel_difference(&tensors, golden, [(t * h * w) as usize, 1536]);
            // Half an ulp of float16 at 1.0, the largest |value| (mean and std 0.5).
            if worst > 5e-4 {
                return Err(format!("pixels differ by up to {worst}"));
            }
            Ok(())
        },
    );
}

/// A video in parts (contract 0.4): runs of 2, then up to 8 temporal patches, each part its own frames
/// with its own grid; the parts' tensors in order hold exactly the whole's bytes.
#[test]
fn parts_hold_exactly_the_whole_videos_tensors() {
    let plugin = common::builtin_plugin("video");
    let mut every_frame = serde_json::Map::new();
    every_frame.insert("fps".into(), json!(12));
    every_frame.insert("video_min_pixels".into(), json!(4 * 784));
    every_frame.insert("video_max_pixels".into(), json!(8 * 784));
    let config = config(&every_frame);
    let media = media(clip("12fps.mp4"));
    let info = plugin.probe(&media).unwrap();
    let plan = plugin
        .plan(
            &info,
            Budget {
                max_tokens: 100_000,
            },
            &config,
        )
        .unwrap();
    let whole = plugin.preprocess(&media, &plan, &config).unwrap();
    let whole_grid = i64s(tensor(&whole, "video_grid_thw"));
    assert_eq!(whole_grid[0], 24, "48 frames: 24 temporal patches");
    let parts = plugin.parts(&plan, &config).unwrap();
    assert_eq!(parts, 5);
    let parts: Vec<Vec<Tensor>> = (0..parts)
        .map(|i| plugin.preprocess_part(&media, &plan, &config, i).unwrap())
        .collect();
    for (part, pairs) in parts.iter().zip([2, 6, 6, 5, 5]) {
        let grid = i64s(tensor(part, "video_grid_thw"));
        assert_eq!(grid, [pairs, whole_grid[1], whole_grid[2]]);
    }
    for name in ["pixel_values_videos", "frame_indices", "frame_timestamps"] {
        let joined: Vec<u8> = parts
            .iter()
            .flat_map(|p| tensor(p, name).data.clone())
            .collect();
        assert!(joined == tensor(&whole, name).data, "{name}");
    }
    for name in [
        "pixel_values_videos_table",
        "second_per_grid_ts",
        "video_fps_f64_bits",
    ] {
        for part in &parts {
            assert_eq!(tensor(part, name).data, tensor(&whole, name).data, "{name}");
        }
    }
    assert!(plugin.preprocess_part(&media, &plan, &config, 5).is_err());
}
