//! mmgate in front of vLLM itself (its CPU build from PyPI, pinned in
//! tests/fixtures/engine/requirements.txt) serving tiny random checkpoints of families mmgate plans
//! media for but does not run (made by tests/fixtures/vllm/checkpoints.py in the engine venv).
//! For each family and each image of several sizes and aspect ratios, through `media = "preprocess"`:
//! the prompt tokens mmgate promised (`x-mmgate-prompt-tokens`) are vLLM's `usage.prompt_tokens`;
//! under a tight context the plan cuts what the family's processor can cut and still keeps its
//! promise and fits; `forward` reaches vLLM unchanged; bad media are refused here with a 4xx.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};

use common::engine::{Vllm, engine_venv, vllm_package, weightless};
use common::server::Server;

/// The engine venv, if it holds vLLM (see [`engine_venv`] for when a missing one is a failure).
fn vllm_venv() -> Option<PathBuf> {
    let venv = engine_venv("bin/python")?;
    if vllm_package(&venv).is_some() {
        return Some(venv);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "the engine venv {} has no vLLM: ./dev test installs it",
        venv.display()
    );
    eprintln!("skipping: no vLLM in {}", venv.display());
    None
}

/// `family`'s tiny checkpoint, made in `into` by the committed script.
fn checkpoint(venv: &Path, family: &str, into: &Path) -> PathBuf {
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/vllm/checkpoints.py");
    common::run_ok(
        Command::new(venv.join("bin/python"))
            .arg(script)
            .arg(into)
            .arg(family),
    );
    into.join(family)
}

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .unwrap()
}

/// A chat completion's status, the tokens mmgate promised (if it did) and the JSON answer.
fn post(gateway: &Server, body: &Value) -> (reqwest::StatusCode, Option<u64>, Value) {
    let response = client()
        .post(format!("http://{}/v1/chat/completions", gateway.addr))
        .json(body)
        .send()
        .unwrap();
    let status = response.status();
    let promised = response
        .headers()
        .get("x-mmgate-prompt-tokens")
        .map(|v| v.to_str().unwrap().parse().unwrap());
    (status, promised, response.json().unwrap())
}

/// An image of tests/fixtures/vllm/images, else of the image plugin's fixtures.
fn image_part(name: &str) -> Value {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
    let folder = ["vllm/images", "image/images"]
        .into_iter()
        .find(|folder| root.join(folder).join(name).is_file())
        .unwrap_or_else(|| panic!("no image {name}"));
    common::image_url_part(&format!("{folder}/{name}"))
}

/// The request's media through `model` (planned here): the promise, vLLM's count and the plans.
fn planned(gateway: &Server, model: &str, content: &Value, extra: &Value) -> (u64, u64, Value) {
    let mut body = json!({"model": model, "max_tokens": 2, "temperature": 0,
                          "messages": [{"role": "user", "content": content}]});
    for (key, value) in extra.as_object().unwrap() {
        body[key] = value.clone();
    }
    let (status, promised, reply) = post(gateway, &body);
    assert!(status.is_success(), "{model}: {status}: {reply}");
    let promised = promised.unwrap_or_else(|| panic!("{model}: no promise: {reply}"));
    let counted = reply["usage"]["prompt_tokens"].as_u64().unwrap();
    (promised, counted, reply["usage"]["media"].clone())
}

const IMAGES: [&str; 9] = [
    "scene-640x480.jpg",
    "scene-1200x300.jpg",
    "scene-900x300.jpg",
    "scene-600x280.jpg",
    "scene-300x1000.jpg",
    "scene-1024x200.jpg",
    "scene-256x256.jpg",
    "png-rgb-wide.png",
    "tiny-upscaled.png",
];

/// A gateway config serving `served` (vLLM's name for the model) at `vllm`: each of `models` is
/// (name, TOML lines beyond the upstream; `path` given as `{path}`, the weightless copy).
fn gateway_config(served: &Path, vllm: &str, weightless: &Path, models: &[(&str, &str)]) -> String {
    let mut config = String::new();
    for (name, lines) in models {
        config.push_str(&format!(
            "[[models]]\nname = {name:?}\nupstream_model = {served:?}\nupstreams = [{vllm:?}]\n{}\n\n",
            lines.replace("{path}", &format!("{weightless:?}"))
        ));
    }
    config
}

/// Plain requests of one image each, and several images in one message, through `model` and
/// through `forward`: every promise is vLLM's count, and what was not cut is counted alike
/// forwarded. Returns each image's usage.media entry.
fn promises_hold(gateway: &Server, model: &str, forward: &str, extra: &Value) -> Vec<Value> {
    promises_hold_on(gateway, model, forward, extra, &IMAGES)
}

/// [`promises_hold`] on `images`.
fn promises_hold_on(
    gateway: &Server,
    model: &str,
    forward: &str,
    extra: &Value,
    images: &[&str],
) -> Vec<Value> {
    let mut plans = Vec::new();
    for &image in images {
        let content = json!([image_part(image), {"type": "text", "text": "What is this?"}]);
        let (promised, counted, media) = planned(gateway, model, &content, extra);
        assert_eq!(promised, counted, "{model}, {image}: {media}");
        let mut body = json!({"model": forward, "max_tokens": 2,
                              "messages": [{"role": "user", "content": content}]});
        for (key, value) in extra.as_object().unwrap() {
            body[key] = value.clone();
        }
        let (status, none, reply) = post(gateway, &body);
        assert!(status.is_success(), "{reply}");
        assert_eq!(none, None, "forward promises nothing");
        if media[0]["reduced"] == false {
            assert_eq!(
                reply["usage"]["prompt_tokens"], counted,
                "forwarded {image}"
            );
        }
        plans.push(media[0].clone());
    }
    let content = json!([image_part("scene-640x480.jpg"), image_part("scene-900x300.jpg"),
                         {"type": "text", "text": "and"}, image_part("scene-256x256.jpg")]);
    let (promised, counted, media) = planned(gateway, model, &content, extra);
    assert_eq!(promised, counted, "{model}, three images: {media}");
    plans
}

#[test]
fn gemma3_in_front_of_vllm_keeps_its_promise_with_and_without_pan_and_scan() {
    let Some(venv) = vllm_venv() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let model = checkpoint(&venv, "gemma3", scratch.path());
    let weightless = weightless(&model);
    // Pan-and-scan is the processor's setting: vLLM takes it per request here (as an operator's
    // `--mm-processor-kwargs` sets it for all), mmgate from the model's `processor_kwargs`.
    let vllm = Vllm::start(&venv, &model, 4096, &["--trust-request-mm-kwargs"]);
    let config = scratch.path().join("mmgate.toml");
    let models = [
        ("gemma3", "media = \"preprocess\"\npath = {path}"),
        (
            "gemma3-pas",
            "media = \"preprocess\"\npath = {path}\nprocessor_kwargs = { do_pan_and_scan = true }",
        ),
        (
            "gemma3-pas-tight",
            "media = \"preprocess\"\npath = {path}\nprocessor_kwargs = { do_pan_and_scan = true }\n\
             max_model_len = 150",
        ),
        ("gemma3-forward", ""),
    ];
    std::fs::write(
        &config,
        gateway_config(&model, &vllm.addr, &weightless, &models),
    )
    .unwrap();
    let gateway = Server::start(&["--config", config.to_str().unwrap()]);
    promises_hold(&gateway, "gemma3", "gemma3-forward", &json!({}));
    let pas = json!({"mm_processor_kwargs": {"do_pan_and_scan": true}});
    let plans = promises_hold(&gateway, "gemma3-pas", "gemma3-forward", &pas);
    // The images make whole images and 2, 3 and 4 crops.
    let crops: std::collections::BTreeSet<u64> = plans
        .iter()
        .map(|plan| plan["tokens"].as_u64().unwrap() / 16 - 1)
        .collect();
    assert_eq!(
        crops.into_iter().collect::<Vec<_>>(),
        [0, 2, 3, 4],
        "crops made"
    );

    // A context too small for every crop: the plan keeps fewer, the promise holds, and it fits.
    let content = json!([image_part("scene-1200x300.jpg"), {"type": "text", "text": "What?"}]);
    let (promised, counted, media) = planned(&gateway, "gemma3-pas-tight", &content, &pas);
    assert_eq!(promised, counted, "tight: {media}");
    assert!(promised + 2 <= 150, "{promised} tokens in a context of 150");
    assert_eq!(media[0]["reduced"], true, "{media}");
    let tokens = media[0]["tokens"].as_u64().unwrap();
    assert!(tokens < 5 * 16, "{media}");

    // Bad media are refused here, before vLLM sees them.
    let broken =
        json!([{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,/9j/4AAQ"}}]);
    let body = json!({"model": "gemma3", "max_tokens": 2,
                      "messages": [{"role": "user", "content": broken}]});
    let (status, _, reply) = post(&gateway, &body);
    assert!(status.is_client_error(), "{status}: {reply}");
    assert!(reply["error"]["message"].is_string(), "{reply}");
    // Audio is not Gemma 3's.
    let body = json!({"model": "gemma3", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]});
    let (status, _, reply) = post(&gateway, &body);
    assert_eq!(status, 400, "{reply}");
}

#[test]
fn mistral3_in_front_of_vllm_keeps_its_promise_at_native_resolution() {
    let Some(venv) = vllm_venv() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let model = checkpoint(&venv, "mistral3", scratch.path());
    let weightless = weightless(&model);
    let vllm = Vllm::start(&venv, &model, 4096, &[]);
    let config = scratch.path().join("mmgate.toml");
    let models = [
        ("mistral3", "media = \"preprocess\"\npath = {path}"),
        (
            "mistral3-tight",
            "media = \"preprocess\"\npath = {path}\nmax_model_len = 80",
        ),
        ("mistral3-forward", ""),
    ];
    std::fs::write(
        &config,
        gateway_config(&model, &vllm.addr, &weightless, &models),
    )
    .unwrap();
    let gateway = Server::start(&["--config", config.to_str().unwrap()]);
    let plans = promises_hold(&gateway, "mistral3", "mistral3-forward", &json!({}));
    // Within 336 px in 28 px tokens: 640x480 is 12x9 tokens and 9 breaks.
    assert_eq!(plans[0]["tokens"], 9 * 13, "{}", plans[0]);

    // A context too small for the image at its size: a lower longest edge, and the promise holds.
    let content = json!([image_part("scene-640x480.jpg"), {"type": "text", "text": "What?"}]);
    let (promised, counted, media) = planned(&gateway, "mistral3-tight", &content, &json!({}));
    assert_eq!(promised, counted, "tight: {media}");
    assert!(promised + 2 <= 80, "{promised} tokens in a context of 80");
    assert_eq!(media[0]["reduced"], true, "{media}");

    // Bad media are refused here, before vLLM sees them.
    let broken =
        json!([{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]);
    let body = json!({"model": "mistral3", "max_tokens": 2,
                      "messages": [{"role": "user", "content": broken}]});
    let (status, _, reply) = post(&gateway, &body);
    assert!(status.is_client_error(), "{status}: {reply}");
}

/// mmgate's demo Qwen2-VL (random weights, run by vLLM too): images encoded here and sent as
/// `image_embeds` (vLLM's `--enable-mm-embeds`), and images planned here; both promise vLLM's
/// count, and the embeddings give vLLM's own greedy answer to the image sent as it came.
#[test]
fn qwen2_vl_embeddings_and_plans_from_here_keep_their_promise_in_vllm() {
    let Some(venv) = vllm_venv() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let cache = scratch.path().join("cache");
    let model = common::engine::demo_checkpoint(&cache, scratch.path(), "demo", "qwen2-vl");
    let weightless = weightless(&model);
    let vllm = Vllm::start(&venv, &model, 4096, &["--enable-mm-embeds"]);
    let config = scratch.path().join("mmgate.toml");
    let embed = format!("media = \"embed\"\npath = {model:?}");
    let models = [
        ("qwen2-vl-embed", embed.as_str()),
        ("qwen2-vl-planned", "media = \"preprocess\"\npath = {path}"),
        ("qwen2-vl-forward", ""),
    ];
    std::fs::write(
        &config,
        gateway_config(&model, &vllm.addr, &weightless, &models),
    )
    .unwrap();
    let gateway = Server::start_with_env(
        &["--config", config.to_str().unwrap()],
        &[("XDG_CACHE_HOME", cache.to_str().unwrap())],
    );
    promises_hold(&gateway, "qwen2-vl-planned", "qwen2-vl-forward", &json!({}));
    for image in [
        "scene-640x480.jpg",
        "scene-300x1000.jpg",
        "png-rgb-wide.png",
    ] {
        let content = json!([image_part(image), {"type": "text", "text": "What is this?"}]);
        let request = |model: &str| {
            json!({"model": model, "max_tokens": 8, "temperature": 0,
                   "messages": [{"role": "user", "content": content}]})
        };
        let (status, promised, embedded) = post(&gateway, &request("qwen2-vl-embed"));
        assert!(status.is_success(), "{status}: {embedded}");
        assert_eq!(
            promised,
            embedded["usage"]["prompt_tokens"].as_u64(),
            "embedded {image}"
        );
        let (status, _, forwarded) = post(&gateway, &request("qwen2-vl-forward"));
        assert!(status.is_success(), "{status}: {forwarded}");
        assert_eq!(
            embedded["usage"]["prompt_tokens"], forwarded["usage"]["prompt_tokens"],
            "{image}"
        );
        assert_eq!(
            embedded["choices"][0]["message"]["content"],
            forwarded["choices"][0]["message"]["content"],
            "the greedy answer to {image}"
        );
    }
}

#[test]
fn llava_next_in_front_of_vllm_keeps_its_promise_on_anyres_tiles() {
    let Some(venv) = vllm_venv() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let model = checkpoint(&venv, "llava_next", scratch.path());
    let weightless = weightless(&model);
    let vllm = Vllm::start(&venv, &model, 4096, &[]);
    let config = scratch.path().join("mmgate.toml");
    let models = [
        ("llava-next", "media = \"preprocess\"\npath = {path}"),
        (
            "llava-next-tight",
            "media = \"preprocess\"\npath = {path}\nmax_model_len = 80",
        ),
        ("llava-next-forward", ""),
    ];
    std::fs::write(
        &config,
        gateway_config(&model, &vllm.addr, &weightless, &models),
    )
    .unwrap();
    let gateway = Server::start(&["--config", config.to_str().unwrap()]);
    let plans = promises_hold(&gateway, "llava-next", "llava-next-forward", &json!({}));
    // Fitted into 2x2, 1x2, 2x1, 1x3 and 3x1 tiles, as their aspect ratios ask.
    let tiles: std::collections::BTreeSet<String> = plans
        .iter()
        .map(|plan| {
            plan["reason"]
                .as_str()
                .unwrap()
                .split(':')
                .nth(1)
                .unwrap()
                .to_owned()
        })
        .collect();
    assert!(tiles.len() >= 3, "{tiles:?}");

    // A context too small for the image at its size: a smaller image, and the promise holds.
    let content = json!([image_part("scene-640x480.jpg"), {"type": "text", "text": "What?"}]);
    let (promised, counted, media) = planned(&gateway, "llava-next-tight", &content, &json!({}));
    assert_eq!(promised, counted, "tight: {media}");
    assert!(promised + 2 <= 80, "{promised} tokens in a context of 80");
    assert_eq!(media[0]["reduced"], true, "{media}");
}

#[test]
fn internvl_in_front_of_vllm_keeps_its_promise_on_its_tiles() {
    let Some(venv) = vllm_venv() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let model = checkpoint(&venv, "internvl", scratch.path());
    let weightless = weightless(&model);
    let vllm = Vllm::start(&venv, &model, 4096, &[]);
    let config = scratch.path().join("mmgate.toml");
    let models = [
        ("internvl", "media = \"preprocess\"\npath = {path}"),
        (
            "internvl-tight",
            "media = \"preprocess\"\npath = {path}\nmax_model_len = 40",
        ),
        ("internvl-forward", ""),
    ];
    std::fs::write(
        &config,
        gateway_config(&model, &vllm.addr, &weightless, &models),
    )
    .unwrap();
    let gateway = Server::start(&["--config", config.to_str().unwrap()]);
    let plans = promises_hold(&gateway, "internvl", "internvl-forward", &json!({}));
    // 4 tokens a tile: one tile, and grids of 3, 4, 9 and 12 tiles with their thumbnails.
    let tiles: std::collections::BTreeSet<u64> = plans
        .iter()
        .map(|plan| plan["tokens"].as_u64().unwrap() / 4)
        .collect();
    assert!(tiles.len() >= 4 && tiles.contains(&13), "{tiles:?}");

    // A context too small for 4x3 tiles: a smaller grid of the squashed image, and the promise holds.
    for image in ["scene-640x480.jpg", "scene-300x1000.jpg"] {
        let content = json!([image_part(image), {"type": "text", "text": "What?"}]);
        let (promised, counted, media) = planned(&gateway, "internvl-tight", &content, &json!({}));
        assert_eq!(promised, counted, "tight {image}: {media}");
        assert!(promised + 2 <= 40, "{promised} tokens in a context of 40");
        assert_eq!(media[0]["reduced"], true, "{media}");
    }

    // Bad media are refused here, before vLLM sees them.
    let broken =
        json!([{"type": "image_url", "image_url": {"url": "data:image/gif;base64,R0lGODlh"}}]);
    let body = json!({"model": "internvl", "max_tokens": 2,
                      "messages": [{"role": "user", "content": broken}]});
    let (status, _, reply) = post(&gateway, &body);
    assert!(status.is_client_error(), "{status}: {reply}");
}

#[test]
fn glm4v_in_front_of_vllm_keeps_its_promise_on_its_own_sizing() {
    let Some(venv) = vllm_venv() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let model = checkpoint(&venv, "glm4v", scratch.path());
    let weightless = weightless(&model);
    let vllm = Vllm::start(&venv, &model, 4096, &[]);
    let config = scratch.path().join("mmgate.toml");
    let models = [
        ("glm4v", "media = \"preprocess\"\npath = {path}"),
        (
            "glm4v-tight",
            "media = \"preprocess\"\npath = {path}\nmax_model_len = 40",
        ),
        ("glm4v-forward", ""),
    ];
    std::fs::write(
        &config,
        gateway_config(&model, &vllm.addr, &weightless, &models),
    )
    .unwrap();
    let gateway = Server::start(&["--config", config.to_str().unwrap()]);
    let plans = promises_hold(&gateway, "glm4v", "glm4v-forward", &json!({}));
    // 20x30 is under a token's 28 px: scaled up first, as GLM's processor does.
    assert!(
        plans
            .iter()
            .all(|plan| plan["tokens"].as_u64().unwrap() <= 64)
    );

    // A context too small for 640x480's 54 tokens: a smaller size, and the promise holds.
    let content = json!([image_part("scene-640x480.jpg"), {"type": "text", "text": "What?"}]);
    let (promised, counted, media) = planned(&gateway, "glm4v-tight", &content, &json!({}));
    assert_eq!(promised, counted, "tight: {media}");
    assert!(promised + 2 <= 40, "{promised} tokens in a context of 40");
    assert_eq!(media[0]["reduced"], true, "{media}");

    let broken =
        json!([{"type": "image_url", "image_url": {"url": "data:image/webp;base64,UklGRg=="}}]);
    let body = json!({"model": "glm4v", "max_tokens": 2,
                      "messages": [{"role": "user", "content": broken}]});
    let (status, _, reply) = post(&gateway, &body);
    assert!(status.is_client_error(), "{status}: {reply}");
}

#[test]
fn llava_onevision_in_front_of_vllm_keeps_its_promise_on_pooled_tiles_and_videos() {
    let Some(venv) = vllm_venv() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let model = checkpoint(&venv, "llava_onevision", scratch.path());
    let weightless = weightless(&model);
    let vllm = Vllm::start(&venv, &model, 4096, &[]);
    let config = scratch.path().join("mmgate.toml");
    let models = [
        ("onevision", "media = \"preprocess\"\npath = {path}"),
        (
            "onevision-tight",
            "media = \"preprocess\"\npath = {path}\nmax_model_len = 80",
        ),
        ("onevision-forward", ""),
    ];
    std::fs::write(
        &config,
        gateway_config(&model, &vllm.addr, &weightless, &models),
    )
    .unwrap();
    let gateway = Server::start(&["--config", config.to_str().unwrap()]);
    let plans = promises_hold(&gateway, "onevision", "onevision-forward", &json!({}));
    // 256x256 fills 4x4 tiles, whose 16x16 features pool to 12x12 (past nine views' worth).
    let square = &plans[IMAGES
        .iter()
        .position(|i| *i == "scene-256x256.jpg")
        .unwrap()];
    assert_eq!(square["tokens"], 16 + 12 * 12 + 12, "{square}");

    // A context too small for the image at its size: a smaller image, and the promise holds.
    let content = json!([image_part("scene-640x480.jpg"), {"type": "text", "text": "What?"}]);
    let (promised, counted, media) = planned(&gateway, "onevision-tight", &content, &json!({}));
    assert_eq!(promised, counted, "tight: {media}");
    assert!(promised + 2 <= 80, "{promised} tokens in a context of 80");
    assert_eq!(media[0]["reduced"], true, "{media}");

    // Videos: 32 frames evenly (all of a shorter one's), each 4 pooled tokens, and a newline;
    // sent as vLLM's frame list at the tower's size. Under the tight context, fewer frames.
    for (clip, frames) in [("h264.mp4", 32), ("portrait.mp4", 32), ("short.mp4", 5)] {
        let content = json!([video_part(clip), {"type": "text", "text": "What happens?"}]);
        let (promised, counted, media) = planned(&gateway, "onevision", &content, &json!({}));
        assert_eq!(promised, counted, "{clip}: {media}");
        assert_eq!(media[0]["tokens"], frames * 4 + 1, "{clip}: {media}");
    }
    let content = json!([video_part("vp9.webm"), {"type": "text", "text": "What?"}]);
    let (promised, counted, media) = planned(&gateway, "onevision-tight", &content, &json!({}));
    assert_eq!(promised, counted, "tight video: {media}");
    assert!(promised + 2 <= 80, "{promised} tokens in a context of 80");
    assert_eq!(media[0]["reduced"], true, "{media}");
}

/// A clip of tests/fixtures/video/clips as a `video_url` data URL.
fn video_part(name: &str) -> Value {
    use base64::Engine as _;
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/video/clips")
        .join(name);
    let data = base64::engine::general_purpose::STANDARD.encode(std::fs::read(path).unwrap());
    let mime = if name.ends_with(".webm") {
        "video/webm"
    } else {
        "video/mp4"
    };
    json!({"type": "video_url", "video_url": {"url": format!("data:{mime};base64,{data}")}})
}

#[test]
fn idefics3_in_front_of_vllm_keeps_its_promise_on_its_tile_grid() {
    let Some(venv) = vllm_venv() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let model = checkpoint(&venv, "idefics3", scratch.path());
    let weightless = weightless(&model);
    let vllm = Vllm::start(&venv, &model, 4096, &[]);
    let config = scratch.path().join("mmgate.toml");
    let models = [
        ("idefics3", "media = \"preprocess\"\npath = {path}"),
        (
            "idefics3-tight",
            "media = \"preprocess\"\npath = {path}\nmax_model_len = 60",
        ),
        ("idefics3-forward", ""),
    ];
    std::fs::write(
        &config,
        gateway_config(&model, &vllm.addr, &weightless, &models),
    )
    .unwrap();
    let gateway = Server::start(&["--config", config.to_str().unwrap()]);
    let plans = promises_hold(&gateway, "idefics3", "idefics3-forward", &json!({}));
    // Four tiles along the long side, one to four along the short: 5 to 17 views of 4 tokens.
    let views: std::collections::BTreeSet<u64> = plans
        .iter()
        .map(|plan| plan["tokens"].as_u64().unwrap() / 4)
        .collect();
    assert!(views.contains(&5) && views.contains(&17), "{views:?}");

    // A context too small for 640x480's 3x4 tiles: fewer rows of a squashed image, and the
    // promise holds, landscape and portrait.
    for image in ["scene-640x480.jpg", "scene-300x1000.jpg"] {
        let content = json!([image_part(image), {"type": "text", "text": "What?"}]);
        let (promised, counted, media) = planned(&gateway, "idefics3-tight", &content, &json!({}));
        assert_eq!(promised, counted, "tight {image}: {media}");
        assert!(promised + 2 <= 60, "{promised} tokens in a context of 60");
        assert_eq!(media[0]["reduced"], true, "{media}");
    }
}

#[test]
fn llama4_in_front_of_vllm_keeps_its_promise_on_its_canvas_of_tiles() {
    let Some(venv) = vllm_venv() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let model = checkpoint(&venv, "llama4", scratch.path());
    let weightless = weightless(&model);
    let vllm = Vllm::start(&venv, &model, 4096, &[]);
    let config = scratch.path().join("mmgate.toml");
    let models = [
        ("llama4", "media = \"preprocess\"\npath = {path}"),
        (
            "llama4-tight",
            "media = \"preprocess\"\npath = {path}\nmax_model_len = 60",
        ),
        ("llama4-forward", ""),
    ];
    std::fs::write(
        &config,
        gateway_config(&model, &vllm.addr, &weightless, &models),
    )
    .unwrap();
    let gateway = Server::start(&["--config", config.to_str().unwrap()]);
    // Not the 20x30 image: it fits one tile, on which vLLM 0.32's CPU build crashes its engine
    // (its `onednn_mm` wants a contiguous tensor), however the image comes.
    let images: Vec<&str> = IMAGES
        .into_iter()
        .filter(|image| *image != "tiny-upscaled.png")
        .collect();
    let plans = promises_hold_on(&gateway, "llama4", "llama4-forward", &json!({}), &images);
    // Canvases of 12, 14, 15 and 16 tiles and their global views, 4 tokens each.
    let views: std::collections::BTreeSet<u64> = plans
        .iter()
        .map(|plan| plan["tokens"].as_u64().unwrap() / 4)
        .collect();
    assert!(views.len() >= 3 && views.contains(&17), "{views:?}");

    // A context too small for a 4x4 canvas: a canvas of fewer tiles, the image squashed to it,
    // and the promise holds.
    for image in ["scene-640x480.jpg", "scene-1200x300.jpg"] {
        let content = json!([image_part(image), {"type": "text", "text": "What?"}]);
        let (promised, counted, media) = planned(&gateway, "llama4-tight", &content, &json!({}));
        assert_eq!(promised, counted, "tight {image}: {media}");
        assert!(promised + 2 <= 60, "{promised} tokens in a context of 60");
        assert_eq!(media[0]["reduced"], true, "{media}");
    }

    // The engine's own failure (the one-tile crash) comes back as a server error that says so,
    // and the gateway serves on.
    let content = json!([image_part("tiny-upscaled.png"), {"type": "text", "text": "What?"}]);
    let body = json!({"model": "llama4", "max_tokens": 2,
                      "messages": [{"role": "user", "content": content}]});
    let (status, _, reply) = post(&gateway, &body);
    assert!(status.is_server_error(), "{status}: {reply}");
    assert!(
        reply["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{reply}"
    );
    let models = client()
        .get(format!("http://{}/v1/models", gateway.addr))
        .send()
        .unwrap();
    assert!(models.status().is_success());
}
