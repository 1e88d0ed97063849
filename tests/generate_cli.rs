//! `mmgate generate` as a user runs it: the real binary, the built-in plugins and the native core on
//! the demo models (written into the tests' shared cache on first use). The usage it reports
//! counts each media item at the tokens its plugin planned; greedy and seeded runs repeat exactly;
//! greedy tokens equal what transformers generates from the same preprocessed media
//! (tests/fixtures/generate, made by its make_expected.py); media a model does not take is refused
//! with a one-line reason.

use crate::common;

use std::path::Path;

use serde_json::Value;

use common::mmgate_command;

fn fixture(path: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(path)
        .display()
        .to_string()
}

fn generate(args: &[&str]) -> std::process::Output {
    mmgate_command()
        .arg("generate")
        .args(args)
        .output()
        .unwrap()
}

fn json(out: &std::process::Output) -> Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout.clone()).unwrap();
    assert_eq!(stdout.lines().count(), 1, "one JSON line: {stdout}");
    serde_json::from_str(&stdout).unwrap()
}

#[test]
fn generates_from_an_image_and_from_audio_on_the_demo_models() {
    let image = fixture("image/images/png-rgb-wide.png");
    let args = [
        "--model",
        "demo",
        "--image",
        &image,
        "--prompt",
        "What is in this image?",
        "--max-tokens",
        "6",
    ];
    let first = json(&generate(&args));
    let again = json(&generate(&args));
    assert_eq!(first, again, "greedy generation repeats");
    let tokens = first["token_ids"].as_array().unwrap().len();
    assert_eq!(first["usage"]["completion_tokens"], tokens);
    assert!(tokens == 6 || first["finish_reason"] == "stop");
    // 300x47 under Qwen2-VL's rules: 308x56 → 11x2 merged patches = 22 tokens.
    assert_eq!(first["usage"]["media"][0]["tokens"], 22);
    let prompt_tokens = first["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 22 + 10, "{first}");

    let audio = fixture("audio/clips/speech-16k-s16.wav");
    let args = [
        "--model",
        "demo-audio",
        "--audio",
        &audio,
        "--prompt",
        "Transcribe the audio.",
        "--max-tokens",
        "5",
        "--temperature",
        "0.9",
        "--seed",
        "42",
    ];
    let sampled = json(&generate(&args));
    assert_eq!(sampled, json(&generate(&args)), "a seed repeats");
    assert_eq!(sampled["usage"]["media"][0]["kind"], "audio");
}

#[test]
fn qwen2_5_vl_demo_takes_video_and_images_like_qwen2_vl_costs_them() {
    // Same tokenizer, template and processor config as `demo`: the same media cost the same tokens
    // and the prompt is the same length, while the window-attention tower and time-scaled video
    // positions make it a different model.
    let video = fixture("video/clips/short.mp4");
    let image = fixture("image/images/png-rgb-wide.png");
    let run = |model: &str| {
        json(&generate(&[
            "--model",
            model,
            "--video",
            &video,
            "--image",
            &image,
            "--prompt",
            "Describe the video.",
            "--max-tokens",
            "8",
        ]))
    };
    let qwen2_5 = run("demo-qwen2.5-vl");
    let qwen2 = run("demo");
    assert_eq!(qwen2_5["usage"]["media"], qwen2["usage"]["media"]);
    assert_eq!(
        qwen2_5["usage"]["prompt_tokens"],
        qwen2["usage"]["prompt_tokens"]
    );
    let kinds: Vec<&str> = qwen2_5["usage"]["media"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["image", "video"]);
    assert_ne!(qwen2_5["token_ids"], qwen2["token_ids"]);
    assert_eq!(qwen2_5, run("demo-qwen2.5-vl"), "greedy generation repeats");
}

#[test]
fn greedy_tokens_match_transformers_on_the_demo_models() {
    let expected: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("generate/expected.json")).unwrap())
            .unwrap();
    let max_tokens = expected["max_tokens"].to_string();
    for case in expected["cases"].as_array().unwrap() {
        let mut args = vec![
            "--model".to_owned(),
            case["model"].as_str().unwrap().to_owned(),
        ];
        for (flag, key) in [("--image", "images"), ("--video", "videos")] {
            for media in case[key].as_array().unwrap() {
                args.push(flag.to_owned());
                args.push(fixture(media.as_str().unwrap()));
            }
        }
        args.extend([
            "--prompt".to_owned(),
            expected["prompt"].as_str().unwrap().to_owned(),
            "--max-tokens".to_owned(),
            max_tokens.clone(),
        ]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let ours = json(&generate(&args));
        assert_eq!(
            ours["usage"]["prompt_tokens"], case["prompt_tokens"],
            "{case}"
        );
        // The demo models' logits are not scaled apart: compare up to the first step where HF's
        // top two were within 0.01 (float noise may pick either there, and all after it differs).
        let margins = case["margins"].as_array().unwrap();
        let clear = margins
            .iter()
            .take_while(|m| m.as_f64().unwrap() >= 0.01)
            .count();
        assert!(clear >= 3, "too few clear steps to compare: {case}");
        let want = &case["token_ids"].as_array().unwrap()[..clear];
        let got = &ours["token_ids"].as_array().unwrap()[..clear];
        assert_eq!(got, want, "{case}");
    }
}

#[test]
fn refuses_media_the_model_does_not_take() {
    let audio = fixture("audio/clips/speech-16k-s16.wav");
    let out = generate(&["--model", "demo", "--audio", &audio, "--prompt", "x"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("does not take audio input"), "{stderr}");
    let truncated = fixture("image/bad/truncated.jpg");
    let out = generate(&["--model", "demo", "--image", &truncated, "--prompt", "x"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("truncated.jpg"), "{stderr}");
}

/// The `token_ids` of a `generate` result.
fn token_ids(result: &Value) -> Vec<u64> {
    result["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

/// Copies a directory's files (one level, as a model directory is).
fn copy_model_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
}

/// Every id `generation_config.json` lists ends a generation (real Qwen2-VL checkpoints list two),
/// and its sampling settings are the defaults of a run that names none.
#[test]
fn generation_config_eos_ids_end_a_generation() {
    let run = |model: &str| {
        json(&generate(&[
            "--model",
            model,
            "--prompt",
            "Tell me a story.",
            "--max-tokens",
            "8",
        ]))
    };
    let free = run("demo");
    let tokens = token_ids(&free);
    assert!(tokens.len() >= 2, "{free}");
    // The first token that did not come before it: listing it as an eos id must stop there.
    let stop_at = (1..tokens.len())
        .find(|&i| !tokens[..i].contains(&tokens[i]))
        .expect("a token not seen before");

    let demo_dir = common::demo_model_dir("demo-qwen2-vl");
    let scratch = tempfile::tempdir().unwrap();
    let model = scratch.path().join("two-eos");
    copy_model_dir(&demo_dir, &model);
    let mut generation: Value = serde_json::from_str(
        &std::fs::read_to_string(model.join("generation_config.json")).unwrap(),
    )
    .unwrap();
    let eos = generation["eos_token_id"][0].clone();
    generation["eos_token_id"] = serde_json::json!([eos, tokens[stop_at]]);
    std::fs::write(model.join("generation_config.json"), generation.to_string()).unwrap();

    let stopped = run(model.to_str().unwrap());
    assert_eq!(stopped["finish_reason"], "stop", "{stopped}");
    let got = token_ids(&stopped);
    assert!(
        got.len() <= stop_at + 1
            && got[..got.len().min(stop_at)] == tokens[..got.len().min(stop_at)],
        "stopped at the listed id: {got:?} vs {tokens:?}"
    );
    assert_eq!(stopped["usage"]["completion_tokens"], stop_at + 1);
}

/// Items made in several parts flow to the engine as each part is made; `mmgate generate` must
/// keep feeding them until the generation ends (it once dropped them, failing every video and
/// audio file of more than one part). Each answers exactly as the same item made whole does.
#[test]
fn media_made_in_parts_generate_as_the_whole_items_do() {
    let run = |model: &str, flag: &str, media: &str, whole: bool| {
        let mut args = vec![
            "--model",
            model,
            flag,
            media,
            "--prompt",
            "Describe it.",
            "--max-tokens",
            "4",
        ];
        if whole {
            args.push("--whole-media");
        }
        json(&generate(&args))
    };
    let mut cases: Vec<(&str, &str, String)> = std::fs::read_dir(fixture("video/clips"))
        .unwrap()
        .map(|e| ("demo", "--video", e.unwrap().path().display().to_string()))
        .collect();
    cases.sort();
    // Long enough (at its 12 fps) to be made in parts.
    let several_parts = fixture("video/clips/12fps.mp4");
    cases.push(("demo-qwen2.5-vl", "--video", several_parts.clone()));
    cases.push(("demo-qwen3-vl", "--video", several_parts));
    cases.push((
        "demo-audio",
        "--audio",
        fixture("audio/clips/long-61s-16k.flac"),
    ));
    let mut in_parts = std::collections::BTreeSet::new();
    for (model, flag, media) in &cases {
        let pieces = run(model, flag, media, false);
        let whole = run(model, flag, media, true);
        assert_eq!(pieces["token_ids"], whole["token_ids"], "{model} {media}");
        for count in ["prompt_tokens", "completion_tokens"] {
            assert_eq!(
                pieces["usage"][count], whole["usage"][count],
                "{model} {media}"
            );
        }
        let media_tokens = |r: &Value| r["usage"]["media"][0]["tokens"].clone();
        assert_eq!(
            media_tokens(&pieces),
            media_tokens(&whole),
            "{model} {media}"
        );
        if pieces["usage"]["media"][0]["parts"].as_u64().unwrap_or(1) > 1 {
            in_parts.insert(*model);
        }
    }
    // The clips cover what the regression was about: items of several parts, on every family.
    assert_eq!(
        in_parts.into_iter().collect::<Vec<_>>(),
        ["demo", "demo-audio", "demo-qwen2.5-vl", "demo-qwen3-vl"]
    );
}
