//! Qwen3-VL against transformers (fixtures: tests/fixtures/models/qwen3-vl, made by qwen3_vl.py with
//! the pinned transformers): the vision tower (learned position embeddings resampled to each grid,
//! deepstack taps), the prompt positions, and the Qwen3 LLM (q/k norms, interleaved M-RoPE,
//! deepstack) fed the tower's outputs as transformers computed them; and the model as it is served:
//! loaded through the family registry, its tower an encoder device of the engine, which merges the
//! embeddings and adds the deepstack features (a video's temporal patches as separate runs of one
//! encoded input) and generates transformers' greedy tokens.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{
    GREEDY_TOKENS, Goldens, check_close, check_prefill_and_greedy_with, devices, family_dir, grids,
};
use std::sync::Arc;

use mmgate_inference::demo::{self, DemoFamily};
use mmgate_inference::devices::OpenDevice;
use mmgate_inference::engine::{
    DeviceSpec, EncoderPool, EngineConfig, Event, FeatureStore, GenerateRequest, InputPart,
    MediaItem, RequestHandle,
};
use mmgate_inference::families::{self, LoadedModel, MediaKind};
use mmgate_inference::item_tensors::{ItemTensors, NamedTensor, Values};
use mmgate_inference::models::Qwen2;
use mmgate_inference::models::config::ConfigFile;
use mmgate_inference::models::qwen2::Deepstack;
use mmgate_inference::models::qwen3_vl::Qwen3VisionTower;
use mmgate_inference::rope::{Grid, MediaSpan, mrope_positions};
use mmgate_inference::sampling::SamplingParams;
use mmgate_inference::text::TextProcessor;
use mmgate_inference::weights::Weights;
use mmgate_inference::{Backend, CpuBackend, Tensor};

const IMAGE_TOKEN: u32 = 500;
const VIDEO_TOKEN: u32 = 501;

/// The vision tower on transformers' pixel values: the merged output and both deepstack features
/// of two images in one call and of a two-frame video.
#[test]
fn the_vision_tower_and_its_deepstack_taps_match_transformers() {
    tower_matches_on(&devices().0);
}

fn tower_matches_on<B: Backend>(encoder: &B) {
    let tower = Qwen3VisionTower::load(&family_dir("qwen3-vl").join("model"), encoder).unwrap();
    let g = Goldens::load("qwen3-vl");
    for item in ["image", "video"] {
        let (shape, values) = g.f32(&format!("{item}.pixel_values"));
        let pixels = Tensor::from_host(encoder, values, shape).unwrap();
        let (merged, deepstack) = tower.encode(&pixels, &grids(&g, item)).unwrap();
        check_close(
            &format!("{item} embeddings"),
            &merged,
            g.f32(&format!("{item}.embeds")),
        );
        assert_eq!(deepstack.len(), 2);
        for (i, features) in deepstack.iter().enumerate() {
            check_close(
                &format!("{item} deepstack {i}"),
                features,
                g.f32(&format!("{item}.deepstack.{i}")),
            );
        }
    }
    // A grid that is not whole merged patches is an error, not a panic.
    let odd = Grid { t: 1, h: 2, w: 1 };
    let pixels = Tensor::zeros(encoder, &[2, tower.config().patch_len()]).unwrap();
    assert!(tower.encode(&pixels, &[odd]).is_err());
}

/// The media spans of `item` for M-RoPE: a video as one block per temporal patch.
fn spans(g: &Goldens, item: &str, token: u32) -> Vec<MediaSpan> {
    grids(g, item)
        .into_iter()
        .flat_map(|grid| {
            (0..grid.t).map(move |_| MediaSpan {
                token,
                grid: Grid { t: 1, ..grid },
                time_interval: 1.0,
                continues_at: None,
            })
        })
        .collect()
}

/// The Qwen3 LLM on the tower's outputs as transformers made them: each prompt's media tokens take
/// the merged embeddings, the deepstack features are added after the first two layers at those
/// rows; prefill logits and 32 greedy tokens as transformers'.
#[test]
fn the_llm_with_deepstack_matches_transformers_on_the_towers_outputs() {
    llm_matches_on(&devices().1);
}

fn llm_matches_on<B: Backend>(dev: &B) {
    let dir = family_dir("qwen3-vl").join("model");
    let text = ConfigFile::read(&dir).unwrap().text_config().unwrap();
    assert!(text.mrope_interleaved);
    let mut weights = Weights::load(&dir, str::to_owned).unwrap();
    let llm = Qwen2::load(text, &mut weights, "model.language_model.", dev).unwrap();
    let g = Goldens::load("qwen3-vl");
    for (prompt, item, token) in [
        ("image_prompt", "image", IMAGE_TOKEN),
        ("video_prompt", "video", VIDEO_TOKEN),
    ] {
        let ids = g.ids(&format!("{prompt}.input_ids"));
        let (positions, delta) = mrope_positions(&ids, &spans(&g, item, token), 2).unwrap();
        let rows: Vec<u32> = (0..ids.len() as u32)
            .filter(|&i| ids[i as usize] == token)
            .collect();
        let tensor = |name: &str| {
            let (shape, values) = g.f32(name);
            Tensor::from_host(dev, values, shape).unwrap()
        };
        let mut embeds = llm.embed(&ids).unwrap();
        embeds
            .scatter_rows(&rows, &tensor(&format!("{item}.embeds")))
            .unwrap();
        let features = [
            tensor(&format!("{item}.deepstack.0")),
            tensor(&format!("{item}.deepstack.1")),
        ];
        let deepstack = Deepstack {
            rows: &rows,
            features: &features,
        };
        check_prefill_and_greedy_with(&llm, &g, prompt, embeds, &positions, delta, Some(deepstack));
    }
}

/// A Qwen3-VL video is one block per temporal patch in the prompt, each after its timestamp text:
/// placed as that many one-frame items, its positions are transformers' (`get_rope_index`).
#[test]
fn prompt_positions_match_transformers_with_video_frames_as_blocks() {
    let g = Goldens::load("qwen3-vl");
    for (prompt, item, token) in [
        ("image_prompt", "image", IMAGE_TOKEN),
        ("video_prompt", "video", VIDEO_TOKEN),
    ] {
        let ids = g.ids(&format!("{prompt}.input_ids"));
        let (positions, delta) = mrope_positions(&ids, &spans(&g, item, token), 2).unwrap();
        let want = g.i64(&format!("{prompt}.position_ids"));
        let n = ids.len();
        for (i, p) in positions.iter().enumerate() {
            assert_eq!(
                *p,
                [want[i], want[n + i], want[2 * n + i]],
                "{prompt}: position of token {i}"
            );
        }
        assert_eq!(delta, g.i64(&format!("{prompt}.rope_delta"))[0], "{prompt}");
    }
}

/// Goldens' tensors for one item, as a plugin would hand them over.
struct GoldenItem {
    grid: Vec<i64>,
    pixels: Vec<f32>,
    frame_indices: Vec<i64>,
    fps: f64,
}

impl GoldenItem {
    /// The item's tensors, under both kinds' names (a family reads its kind's).
    fn tensors(self) -> ItemTensors {
        let ints = |name: &str, values: Vec<i64>| NamedTensor {
            name: name.into(),
            shape: vec![values.len() as u64],
            values: Values::Ints {
                dtype: "i64",
                values,
            },
        };
        let floats = |name: &str, values: Vec<f32>| NamedTensor {
            name: name.into(),
            shape: vec![values.len() as u64],
            values: Values::Floats {
                dtype: "f32",
                values,
            },
        };
        ItemTensors::new(vec![
            ints("image_grid_thw", self.grid.clone()),
            ints("video_grid_thw", self.grid),
            ints("frame_indices", self.frame_indices),
            ints("video_fps_f64_bits", vec![self.fps.to_bits() as i64]),
            floats("pixel_values", self.pixels.clone()),
            floats("pixel_values_videos", self.pixels),
        ])
    }
}

/// The served model: the registry loads the checkpoint onto an encoder device and an LLM device,
/// the engine encodes the goldens' pixel values and generates. Both images of the image prompt
/// and the video's two temporal patches (two runs of one input, encoded once) give
/// transformers' 32 greedy tokens; the video's runs carry the processor's timestamps.
#[test]
fn the_served_model_generates_transformers_tokens() {
    let fixture = family_dir("qwen3-vl").join("model");
    // The engine streams text: the fixture has no tokenizer, so the demo's stands in (the
    // fixture's ids are all within its vocabulary; only ids are compared).
    let dir = tempfile::tempdir().unwrap();
    let demo = tempfile::tempdir().unwrap();
    demo::write(demo.path(), DemoFamily::Qwen2Vl, 1).unwrap();
    for (from, name) in [
        (&fixture, "config.json"),
        (&fixture, "model.safetensors"),
        (&fixture, "generation_config.json"),
        (&demo.path().to_owned(), "tokenizer.json"),
        (&demo.path().to_owned(), "tokenizer_config.json"),
    ] {
        std::fs::copy(from.join(name), dir.path().join(name)).unwrap();
    }
    let model = families::read(dir.path()).unwrap();
    let family = model.native().unwrap();
    assert_eq!(family.deepstack_levels(), 2);
    assert_eq!(
        family.embedding_width(),
        3 * family.text_config().hidden_size
    );
    let encoder = OpenDevice::Cpu(CpuBackend::new("enc", 1).unwrap());
    let llm = OpenDevice::Cpu(CpuBackend::new("llm", 1).unwrap());
    let LoadedModel { encoders, llm } = family.load(dir.path(), &[encoder], Some(&llm)).unwrap();
    let specs = vec![DeviceSpec {
        name: "enc0".into(),
        encoders,
    }];
    let pool = Arc::new(EncoderPool::with_observer(specs, 4, None).unwrap());
    let config = EngineConfig {
        model_name: "qwen3-vl".into(),
        positions: family.positions(),
        max_running: 4,
        prefill_chunk: 16,
        kv_budget_tokens: 4096,
        eos_token_ids: Vec::new(),
        deepstack_levels: family.deepstack_levels(),
    };
    let text = Arc::new(TextProcessor::load(dir.path()).unwrap());
    let store = Arc::new(FeatureStore::new(64 << 20));
    let engine = llm.unwrap().start(config, text, pool, store).unwrap();

    let g = Goldens::load("qwen3-vl");
    let cases: serde_json::Value =
        serde_json::from_slice(&std::fs::read(family_dir("qwen3-vl").join("cases.json")).unwrap())
            .unwrap();
    for (prompt, item, kind) in [
        ("image_prompt", "image", MediaKind::Image),
        ("video_prompt", "video", MediaKind::Video),
    ] {
        let (_, pixels) = g.f32(&format!("{item}.pixel_values"));
        let patch_len = 3 * 2 * 16 * 16;
        let mut media = Vec::new();
        let mut first_row = 0;
        for grid in grids(&g, item) {
            let rows = grid.patches();
            let golden = GoldenItem {
                grid: vec![grid.t as i64, grid.h as i64, grid.w as i64],
                pixels: pixels[first_row * patch_len..(first_row + rows) * patch_len].to_vec(),
                frame_indices: (0..2 * grid.t as i64).map(|i| 3 * i).collect(),
                fps: 6.0,
            };
            first_row += rows;
            let planned = family.plan_input(kind, &mut golden.tensors()).unwrap();
            let input = Arc::new(planned.input);
            let placeholder = family.placeholder(kind).unwrap();
            let item = |tokens, part| MediaItem {
                input: input.clone(),
                placeholder,
                tokens,
                processor_config: "{}".into(),
                time_interval: planned.time_interval,
                share_key: None,
                part,
                piece: None,
            };
            if planned.runs.is_empty() {
                media.push(item(planned.tokens, None));
                continue;
            }
            // Frames 0, 3 and 6, 9 at 6 fps: temporal patches at 0.25 s and 1.25 s.
            let texts: Vec<&str> = planned.runs.iter().map(|r| r.before.as_str()).collect();
            assert_eq!(
                texts,
                [
                    "<0.2 seconds><|vision_start|>",
                    "<1.2 seconds><|vision_start|>"
                ]
            );
            let mut first_token = 0;
            for run in &planned.runs {
                let part = InputPart {
                    first_token,
                    grid: run.grid,
                    at: run.at,
                };
                media.push(item(run.tokens, Some(part)));
                first_token += run.tokens;
            }
        }
        let handle = engine
            .submit(GenerateRequest {
                prompt: g.ids(&format!("{prompt}.input_ids")),
                media,
                sampling: SamplingParams::greedy(),
                max_tokens: GREEDY_TOKENS,
                stop: Vec::new(),
            })
            .unwrap();
        let generated = collect_ids(handle);
        let want: Vec<u32> = cases["cases"][format!("qwen3-vl/{prompt}")]["generated"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(generated, want, "{prompt}");
    }
}

fn collect_ids(mut handle: RequestHandle) -> Vec<u32> {
    let mut ids = Vec::new();
    loop {
        match handle.events.blocking_recv() {
            Some(Event::Token { id, .. }) => ids.push(id),
            Some(Event::Done { .. }) => return ids,
            Some(Event::Failed(failure)) => panic!("{failure:?}"),
            None => panic!("the engine stopped"),
        }
    }
}

/// A video's runs carry the timestamps transformers' `Qwen3VLProcessor` writes into the prompt,
/// from the frames and frame rate the video plugin reports (tests/fixtures/video/
/// cases-qwen3-vl.json, made by make_goldens_qwen3.py; the plugin's side is checked against the
/// same cases in host-api's video parity test).
#[test]
fn video_runs_carry_transformers_timestamps() {
    let model = families::read(&family_dir("qwen3-vl").join("model")).unwrap();
    let family = model.native().unwrap();
    let cases: Vec<serde_json::Value> = serde_json::from_slice(
        &std::fs::read(family_dir("../video").join("cases-qwen3-vl.json")).unwrap(),
    )
    .unwrap();
    assert!(cases.len() >= 19);
    let ints = |v: &serde_json::Value| -> Vec<i64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_i64().unwrap())
            .collect()
    };
    for case in &cases {
        let grid = ints(&case["video_grid_thw"]);
        let patches = (grid[0] * grid[1] * grid[2]) as usize;
        let golden = GoldenItem {
            grid: grid.clone(),
            pixels: vec![0.0; patches * 3 * 2 * 16 * 16],
            frame_indices: ints(&case["frame_indices"]),
            fps: case["video_fps"].as_f64().unwrap(),
        };
        let planned = family
            .plan_input(MediaKind::Video, &mut golden.tensors())
            .unwrap();
        let want: Vec<String> = case["timestamps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| format!("{}<|vision_start|>", t.as_str().unwrap()))
            .collect();
        let got: Vec<&str> = planned.runs.iter().map(|r| r.before.as_str()).collect();
        assert_eq!(got, want, "{}", case["name"]);
        let per_frame = (grid[1] * grid[2] / 4) as usize;
        for run in &planned.runs {
            assert_eq!(run.tokens, per_frame);
            assert_eq!(run.after, "<|vision_end|>");
        }
    }
}

/// On a real GPU (the GPU bundle's `run.sh`; never run in this project's CI, which has none): the
/// tower with its deepstack taps and the LLM with deepstack, on CUDA, as on the CPU.
#[test]
#[ignore = "needs an NVIDIA GPU: the GPU bundle's run.sh"]
fn on_real_gpus_matches_transformers() {
    let (encoder, llm) = common::real_gpus();
    tower_matches_on(&encoder);
    llm_matches_on(&llm);
}
