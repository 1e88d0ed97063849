//! Plugins' real output placed in the prompt and run on the engine: items made in parts or bands
//! are exactly the items made whole.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::sync::{Arc, LazyLock};

use mmgate_host::{Dtype, PartPlan, Tensor};
use mmgate_inference::engine::{EncodeInput, InputPart, PixelValues};
use mmgate_inference::families::MediaKind;
use mmgate_inference::families::PlannedItem;
use mmgate_inference::prompt::{PlacedItem, expand_placeholders};
use mmgate_inference::text::{ChatMessage, ContentPart};

use crate::model::{Devices, ModelRuntime, RuntimeOptions, resolve_model_dir};
use crate::prepare::plugin_output::{item_tensors, part_layouts, place_parts};

/// `tensors` placed as a plugin's output for one whole item.
fn media_item(
    model: &ModelRuntime,
    kind: MediaKind,
    tokens: u32,
    tensors: &[Tensor],
) -> mmgate_inference::Result<PlacedItem> {
    model
        .prompt
        .media_item(kind, tokens as usize, item_tensors(tensors))
}

fn tensor(name: &str, dtype: Dtype, shape: &[u64], data: Vec<u8>) -> Tensor {
    Tensor::new(name, dtype, shape, data)
}

/// A video's preprocessed tensors: 3 temporal patches of 4x4, `second_per_grid_ts` if given.
fn video(seconds: Option<f32>) -> Vec<Tensor> {
    let grid: Vec<u8> = [3i64, 4, 4].iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut tensors = vec![
        tensor(
            "pixel_values_videos",
            Dtype::F32,
            &[48, 1176],
            vec![0; 48 * 1176 * 4],
        ),
        tensor("video_grid_thw", Dtype::I64, &[1, 3], grid),
    ];
    if let Some(s) = seconds {
        let data = s.to_le_bytes().to_vec();
        tensors.push(tensor("second_per_grid_ts", Dtype::F32, &[1], data));
    }
    tensors
}

fn runtime(spec: &str, cache: &Path) -> ModelRuntime {
    let dir = resolve_model_dir(Path::new(spec), cache).unwrap();
    let options = RuntimeOptions {
        devices: Devices::cpu(1, &[1]),
        ..RuntimeOptions::default()
    };
    ModelRuntime::load(spec, &dir, &options, None).unwrap()
}

#[test]
fn qwen2_5_vl_videos_take_their_time_step_from_the_plugin() {
    let cache = tempfile::tempdir().unwrap();
    let model = runtime("demo-qwen2.5-vl", cache.path());
    // The demo's 2 tokens per second × 0.75 s between temporal patches.
    let item = media_item(&model, MediaKind::Video, 12, &video(Some(0.75))).unwrap();
    assert_eq!(item.items[0].time_interval, 1.5);
    let err = media_item(&model, MediaKind::Video, 12, &video(None)).unwrap_err();
    assert!(err.to_string().contains("second_per_grid_ts"), "{err}");
    let err = media_item(&model, MediaKind::Video, 12, &video(Some(f32::NAN))).unwrap_err();
    assert!(err.to_string().contains("not a duration"), "{err}");

    // Qwen2-VL steps one position per temporal patch whatever the seconds.
    let model = runtime("demo", cache.path());
    let item = media_item(&model, MediaKind::Video, 12, &video(Some(0.75))).unwrap();
    assert_eq!(item.items[0].time_interval, 1.0);
}

#[test]
fn qwen3_vl_videos_are_a_block_per_temporal_patch_after_its_timestamp() {
    let cache = tempfile::tempdir().unwrap();
    let model = runtime("demo-qwen3-vl", cache.path());
    let ints = |v: &[i64]| v.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
    let video = vec![
        tensor(
            "pixel_values_videos",
            Dtype::F32,
            &[32, 1536],
            vec![0; 32 * 1536 * 4],
        ),
        tensor("video_grid_thw", Dtype::I64, &[1, 3], ints(&[2, 4, 4])),
        // Frames 0, 15 and 30, 45 of a 30 fps video: temporal patches at 0.25 s and 1.25 s.
        tensor("frame_indices", Dtype::I64, &[4], ints(&[0, 15, 30, 45])),
        tensor(
            "video_fps_f64_bits",
            Dtype::I64,
            &[1],
            ints(&[30f64.to_bits() as i64]),
        ),
    ];
    let placed = media_item(&model, MediaKind::Video, 8, &video).unwrap();
    let parts: Vec<_> = placed.items.iter().map(|i| (i.tokens, i.part)).collect();
    let frame = mmgate_inference::rope::Grid { t: 1, h: 4, w: 4 };
    assert_eq!(
        parts,
        [
            (
                4,
                Some(InputPart {
                    first_token: 0,
                    grid: frame,
                    at: Some(0.25),
                })
            ),
            (
                4,
                Some(InputPart {
                    first_token: 4,
                    grid: frame,
                    at: Some(1.25),
                })
            ),
        ]
    );
    assert!(Arc::ptr_eq(&placed.items[0].input, &placed.items[1].input));
    let text = model.prompt.text.decode(&placed.ids, false).unwrap();
    let pads = "<|video_pad|>".repeat(4);
    assert_eq!(
        text,
        format!(
            "<0.2 seconds><|vision_start|>{pads}<|vision_end|><1.2 seconds><|vision_start|>{pads}<|vision_end|>"
        )
    );
    // Without the frame rate there are no timestamps to write.
    let err = media_item(&model, MediaKind::Video, 8, &video[..3]).unwrap_err();
    assert!(err.to_string().contains("video_fps_f64_bits"), "{err}");

    // Planned for an engine that runs the processor, the same frames and frame rate (from the
    // plan's choices) count the same prompt as placed here.
    let messages = [ChatMessage {
        role: "user".into(),
        content: vec![
            ContentPart::Video,
            ContentPart::Text("What happens?".into()),
        ],
    }];
    let ids = crate::prepare::prompt_text::prompt_ids(&model.prompt, &messages).unwrap();
    let planned = |choices: serde_json::Value| PlannedItem {
        kind: MediaKind::Video,
        tokens: 8,
        choices,
    };
    let choices = serde_json::json!({"frame_indices": [0, 15, 30, 45],
                                     "source_fps_bits": 30f64.to_bits()});
    let counted = model
        .prompt
        .planned_prompt_tokens(&messages, &ids, &[planned(choices)])
        .unwrap();
    let expanded = expand_placeholders(&ids, &[placed]).unwrap();
    assert_eq!(counted, expanded.len());
    // A plan that does not say when its frames are is refused, not counted without timestamps.
    let err = model
        .prompt
        .planned_prompt_tokens(&messages, &ids, &[planned(serde_json::Value::Null)])
        .unwrap_err();
    assert!(err.to_string().contains("frame_indices"), "{err}");
}

/// A built-in plugin's output for an item.
struct Made {
    plan: mmgate_host::TokenPlan,
    /// By `preprocess`.
    whole: Vec<Tensor>,
    /// By `preprocess-part`, in order.
    parts: Vec<Vec<Tensor>>,
    /// What `part-plans` said of the parts beforehand, if it places them.
    part_plans: Option<Vec<PartPlan>>,
}

/// The built-in plugins, compiled once for every test here (compiling them is most of what these
/// tests would otherwise spend).
static BUILTINS: LazyLock<mmgate_host::PluginRegistry> = LazyLock::new(|| {
    let sandbox =
        Arc::new(mmgate_host::Sandbox::new(mmgate_host::SandboxLimits::default()).unwrap());
    mmgate_host::PluginRegistry::builtin(&sandbox).unwrap()
});

/// A built-in plugin's output for `media` under `model`'s processor config (`config` adjusts
/// it): whole (`preprocess`) and in its parts.
fn whole_and_parts(
    model: &ModelRuntime,
    modality: &str,
    media: &[u8],
    config: impl FnOnce(&mut serde_json::Value),
) -> Made {
    let plugin = BUILTINS.for_modality(modality).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&model.prompt.processor_config).unwrap();
    config(&mut json);
    let config = json.to_string();
    let media = mmgate_host::Media {
        data: media.to_vec(),
        mime_type: None,
    };
    let info = plugin.probe(&media).unwrap();
    let plan = plugin
        .plan(
            &info,
            mmgate_host::Budget {
                max_tokens: 1 << 20,
            },
            &config,
        )
        .unwrap();
    let whole = plugin.preprocess(&media, &plan, &config).unwrap();
    let count = plugin.parts(&plan, &config).unwrap();
    let parts = (0..count)
        .map(|i| plugin.preprocess_part(&media, &plan, &config, i).unwrap())
        .collect::<Vec<_>>();
    let part_plans = plugin.part_plans(&plan, &config, count).unwrap();
    Made {
        plan,
        whole,
        parts,
        part_plans,
    }
}

/// The built-in video plugin's output for a 48-frame clip sampled at 12 fps under `model`'s
/// processor config: whole and in parts (runs of 2, 6, 6, 5 and 5 of its 24 temporal patches).
fn video_whole_and_parts(model: &ModelRuntime) -> Made {
    let clip = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/video/clips/12fps.mp4"),
    )
    .unwrap();
    // Every frame, at the model's smallest size: 24 temporal patches.
    let made = whole_and_parts(model, "video", &clip, |config| {
        config["fps"] = 12.into();
        if let Some(video) = config.get_mut("video_preprocessor_config") {
            video["fps"] = 12.into();
        }
    });
    assert_eq!(made.parts.len(), 5);
    made
}

/// Each piece of `pieces` encoded as the engine's pool encodes it, their features in order,
/// and how many inputs they were.
fn piece_features(model: &ModelRuntime, pieces: &PlacedItem) -> (Vec<f32>, usize) {
    let mut features = Vec::new();
    let mut inputs: Vec<&Arc<EncodeInput>> = Vec::new();
    for item in &pieces.items {
        if !inputs.iter().any(|i| Arc::ptr_eq(i, &item.input)) {
            inputs.push(&item.input);
            features.extend(encode(model, &item.input).iter().copied());
        }
    }
    (features, inputs.len())
}

fn encode(model: &ModelRuntime, input: &Arc<EncodeInput>) -> Arc<Vec<f32>> {
    let (tx, rx) = std::sync::mpsc::channel();
    model
        .encoders
        .submit(input.clone(), move |r| {
            let _ = tx.send(r);
        })
        .unwrap();
    rx.recv().unwrap().unwrap()
}

/// Greedy tokens of a prompt holding `placed`, and the prompt's length.
fn generate(model: &ModelRuntime, placed: &PlacedItem) -> (Vec<u32>, usize) {
    let (events, prompt) = submit(model, placed);
    match run(events) {
        Ok(ids) => (ids, prompt),
        Err(failure) => panic!("{failure:?}"),
    }
}

/// Submits a prompt holding `placed`: its events, and the prompt's length.
fn submit(
    model: &ModelRuntime,
    placed: &PlacedItem,
) -> (
    tokio::sync::mpsc::UnboundedReceiver<mmgate_inference::engine::Event>,
    usize,
) {
    let text = &model.prompt.text;
    let mut prompt = text.encode("<|im_start|>user\nDescribe.").unwrap();
    prompt.extend(&placed.ids);
    prompt.extend(text.encode("<|im_end|>\n<|im_start|>assistant\n").unwrap());
    let handle = model
        .engine()
        .unwrap()
        .submit(mmgate_inference::engine::GenerateRequest {
            prompt: prompt.clone(),
            media: placed.items.clone(),
            sampling: mmgate_inference::sampling::SamplingParams::greedy(),
            max_tokens: 12,
            stop: Vec::new(),
        })
        .unwrap();
    (handle.events, prompt.len())
}

/// A request's greedy tokens, or how it failed.
fn run(
    mut events: tokio::sync::mpsc::UnboundedReceiver<mmgate_inference::engine::Event>,
) -> Result<Vec<u32>, mmgate_inference::engine::Failure> {
    let mut ids = Vec::new();
    loop {
        match events.blocking_recv() {
            Some(mmgate_inference::engine::Event::Token { id, .. }) => ids.push(id),
            Some(mmgate_inference::engine::Event::Done { .. }) => return Ok(ids),
            Some(mmgate_inference::engine::Event::Failed(failure)) => return Err(failure),
            None => panic!("the engine stopped"),
        }
    }
}

/// A video made in parts is encoded piece by piece, each merged as it is ready: the same
/// encoder features, bit for bit, and the same greedy tokens as the video made whole, on
/// Qwen2-VL, Qwen2.5-VL (time-scaled positions continued across pieces) and Qwen3-VL (each
/// piece's frames after their timestamps).
#[test]
fn a_video_in_pieces_is_exactly_the_video_whole() {
    let cache = tempfile::tempdir().unwrap();
    for spec in ["demo", "demo-qwen2.5-vl", "demo-qwen3-vl"] {
        let model = runtime(spec, cache.path());
        let made = video_whole_and_parts(&model);
        assert_pieces_are_the_whole(&model, MediaKind::Video, &made, spec);
    }
}

/// The same for a 65 s PCM audio file at 22.05 kHz (resampled) on Qwen2-Audio: a piece of two
/// 30 s chunks and one of the last 5 s.
#[test]
fn an_audio_file_in_pieces_is_exactly_the_file_whole() {
    let cache = tempfile::tempdir().unwrap();
    let model = runtime("demo-audio", cache.path());
    let made = whole_and_parts(&model, "audio", &long_pcm_wav(), |_| {});
    assert_eq!(made.parts.len(), 2);
    assert_pieces_are_the_whole(&model, MediaKind::Audio, &made, "demo-audio");
}

/// A large image made in bands of rows is joined back and placed whole (the vision tower
/// attends across the image): the same prompt, one engine item that is not a piece, and the
/// whole's encoder input value for value, on Qwen2-VL and Qwen3-VL (its 16-pixel patches).
#[test]
fn an_image_in_bands_is_placed_as_the_image_whole() {
    let cache = tempfile::tempdir().unwrap();
    let photo = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/image/images/photo-640x480.jpg"),
    )
    .unwrap();
    for spec in ["demo", "demo-qwen3-vl"] {
        let model = runtime(spec, cache.path());
        let Made {
            plan,
            whole,
            parts,
            part_plans,
        } = whole_and_parts(&model, "image", &photo, |config| {
            config["min_pixels"] = 10_000_000.into();
            config["max_pixels"] = 12_000_000.into();
        });
        // Bands are joined before encoding: the image plugin does not place them ahead.
        assert!(part_plans.is_none(), "{spec}");
        assert!(parts.len() > 1, "{spec}: {} parts", parts.len());
        let kind = MediaKind::Image;
        let bands = place_parts(&model.prompt, kind, plan.tokens as usize, &parts, 0).unwrap();
        let whole = media_item(&model, kind, plan.tokens, &whole).unwrap();
        assert_eq!(bands.ids, whole.ids, "{spec}");
        let ([band], [one]) = (&bands.items[..], &whole.items[..]) else {
            panic!(
                "{spec}: {} and {} items",
                bands.items.len(),
                whole.items.len()
            );
        };
        assert!(band.piece.is_none() && band.tokens == one.tokens, "{spec}");
        let values = |input: &EncodeInput| match input {
            EncodeInput::Vision {
                pixel_values: PixelValues::Source(source),
                grid,
            } => {
                let mut values = Vec::new();
                source.extend_f32(&mut values);
                (values, *grid)
            }
            other => panic!("{spec}: {other:?}"),
        };
        assert!(values(&band.input) == values(&one.input), "{spec}");
    }
}

/// 65 s of a 16-bit mono WAV at 22.05 kHz: a chirp under a little noise.
fn long_pcm_wav() -> Vec<u8> {
    let (rate, frames) = (22_050u32, 65 * 22_050u32);
    let mut wav = Vec::with_capacity(44 + 2 * frames as usize);
    for chunk in [
        &b"RIFF"[..],
        &(36 + 2 * frames).to_le_bytes(),
        b"WAVEfmt ",
        &16u32.to_le_bytes(),
        &1u16.to_le_bytes(),
        &1u16.to_le_bytes(),
        &rate.to_le_bytes(),
        &(2 * rate).to_le_bytes(),
        &2u16.to_le_bytes(),
        &16u16.to_le_bytes(),
        b"data",
        &(2 * frames).to_le_bytes(),
    ] {
        wav.extend_from_slice(chunk);
    }
    for i in 0..frames {
        let t = f64::from(i) / f64::from(rate);
        let chirp = 0.3 * (std::f64::consts::TAU * (200.0 + 15.0 * t) * t).sin();
        let noise = 0.02 * ((f64::from(i) * 12.9898).sin() * 43_758.545).fract();
        wav.extend_from_slice(&(((chirp + noise) * 32_767.0) as i16).to_le_bytes());
    }
    wav
}

/// The item made in parts, placed once all are made and placed beforehand with each part
/// handed over after the request was submitted (last part first, so the engine holds the
/// earlier pieces back until theirs arrive): the same prompt, the same encoder features bit
/// for bit, the same greedy tokens as the item made whole.
fn assert_pieces_are_the_whole(model: &ModelRuntime, kind: MediaKind, made: &Made, spec: &str) {
    let tokens = made.plan.tokens;
    let whole = media_item(model, kind, tokens, &made.whole).unwrap();
    let pieces = place_parts(&model.prompt, kind, tokens as usize, &made.parts, 0).unwrap();
    assert_eq!(pieces.ids, whole.ids, "{spec}: the same prompt");
    let whole_features = encode(model, &whole.items[0].input);
    let (features, inputs) = piece_features(model, &pieces);
    assert_eq!(inputs, made.parts.len(), "{spec}");
    assert!(
        features == *whole_features,
        "{spec}: the pieces' features are the whole's"
    );
    let (whole_tokens, prompt_len) = generate(model, &whole);
    let (piece_tokens, _) = generate(model, &pieces);
    assert_eq!(
        piece_tokens, whole_tokens,
        "{spec}: {prompt_len} prompt tokens"
    );

    let plans = made
        .part_plans
        .as_ref()
        .expect("the plugin places its parts");
    let (coming, makers) = model
        .prompt
        .coming_parts(kind, tokens as usize, part_layouts(plans), &[], 0)
        .unwrap()
        .unwrap();
    assert_eq!(
        coming.ids, whole.ids,
        "{spec}: placed beforehand, the same prompt"
    );
    let placed = |p: &PlacedItem| -> Vec<_> {
        p.items
            .iter()
            .map(|i| (i.tokens, i.part, i.piece, i.time_interval))
            .collect()
    };
    assert_eq!(placed(&coming), placed(&pieces), "{spec}");
    let (events, _) = submit(model, &coming);
    for (maker, part) in makers.into_iter().zip(&made.parts).rev() {
        maker.deliver(Ok(item_tensors(part)));
    }
    assert_eq!(
        run(events).unwrap(),
        whole_tokens,
        "{spec}: pieces handed over after submission"
    );
}

/// A piece that fails to be made, or is made unlike its part plan, fails its request as an
/// encode error of its item; the engine goes on with the next request.
#[test]
fn a_piece_made_wrong_or_not_at_all_fails_its_item() {
    let cache = tempfile::tempdir().unwrap();
    let model = runtime("demo", cache.path());
    let made = video_whole_and_parts(&model);
    let plans = made.part_plans.unwrap();
    let kind = MediaKind::Video;
    let tokens = made.plan.tokens;
    // What goes wrong with part 1 (the others are made right), and what the failure says.
    enum Fault {
        PluginFailed,
        /// The whole video's tensors where one part was placed.
        UnlikeItsPlan,
        MakerGone,
    }
    for (fault, expected) in [
        (Fault::PluginFailed, "the plugin failed"),
        (Fault::UnlikeItsPlan, "part plan"),
        // Which part of which item was never made (item 3 below).
        (Fault::MakerGone, "media item 3 part 1 was never made"),
    ] {
        let (coming, makers) = model
            .prompt
            .coming_parts(kind, tokens as usize, part_layouts(&plans), &[], 3)
            .unwrap()
            .unwrap();
        let (events, _) = submit(&model, &coming);
        for (n, maker) in makers.into_iter().enumerate() {
            match (n, &fault) {
                (1, Fault::PluginFailed) => maker.deliver(Err("the plugin failed".into())),
                (1, Fault::UnlikeItsPlan) => maker.deliver(Ok(item_tensors(&made.whole))),
                (1, Fault::MakerGone) => drop(maker),
                _ => maker.deliver(Ok(item_tensors(&made.parts[n]))),
            }
        }
        match run(events) {
            Err(mmgate_inference::engine::Failure::Encode { message, .. }) => {
                assert!(message.contains(expected), "{expected}: {message}")
            }
            other => panic!("{expected}: {other:?}"),
        }
    }
    let whole = media_item(&model, kind, tokens, &made.whole).unwrap();
    let (ids, _) = generate(&model, &whole);
    assert!(!ids.is_empty());
}
