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
    let out = Command::new(venv.join("bin/python"))
        .arg(script)
        .arg(into)
        .arg(family)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
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

fn image_part(name: &str) -> Value {
    use base64::Engine as _;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
    let path = [
        root.join("vllm/images").join(name),
        root.join("image/images").join(name),
    ]
    .into_iter()
    .find(|p| p.is_file())
    .unwrap_or_else(|| panic!("no image {name}"));
    let data = base64::engine::general_purpose::STANDARD.encode(std::fs::read(&path).unwrap());
    let mime = if name.ends_with(".png") {
        "image/png"
    } else {
        "image/jpeg"
    };
    json!({"type": "image_url", "image_url": {"url": format!("data:{mime};base64,{data}")}})
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

#[test]
fn gemma3_in_front_of_vllm_keeps_its_promise_with_and_without_pan_and_scan() {
    let Some(venv) = vllm_venv() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let model = checkpoint(&venv, "gemma3", scratch.path());
    let weightless = weightless(&model);
    // Pan-and-scan is the processor's setting: vLLM takes it per request here (as an operator's
    // `--mm-processor-kwargs` sets it for all), mmgate from the model's `processor_kwargs`.
    let vllm = Vllm::start(&venv, &model, 4096, &["--trust-request-mm-kwargs"]);
    let served = model.to_str().unwrap();
    let config = scratch.path().join("mmgate.toml");
    std::fs::write(
        &config,
        format!(
            r#"[[models]]
name = "gemma3"
upstream_model = {served:?}
upstreams = ["{vllm}"]
media = "preprocess"
path = {weightless:?}

[[models]]
name = "gemma3-pas"
upstream_model = {served:?}
upstreams = ["{vllm}"]
media = "preprocess"
path = {weightless:?}
processor_kwargs = {{ do_pan_and_scan = true }}

[[models]]
name = "gemma3-pas-tight"
upstream_model = {served:?}
upstreams = ["{vllm}"]
media = "preprocess"
path = {weightless:?}
processor_kwargs = {{ do_pan_and_scan = true }}
max_model_len = 150

[[models]]
name = "gemma3-forward"
upstream_model = {served:?}
upstreams = ["{vllm}"]
"#,
            vllm = vllm.addr,
        ),
    )
    .unwrap();
    let gateway = Server::start(&["--config", config.to_str().unwrap()]);
    let pas = json!({"mm_processor_kwargs": {"do_pan_and_scan": true}});
    let mut crops_seen = std::collections::BTreeSet::new();
    for image in IMAGES {
        let content = json!([image_part(image), {"type": "text", "text": "What is this?"}]);
        let (promised, counted, _) = planned(&gateway, "gemma3", &content, &json!({}));
        assert_eq!(promised, counted, "gemma3, {image}");
        let (promised_pas, counted_pas, media) = planned(&gateway, "gemma3-pas", &content, &pas);
        assert_eq!(
            promised_pas, counted_pas,
            "gemma3 with pan-and-scan, {image}: {media}"
        );
        let views = media[0]["tokens"].as_u64().unwrap() / 16;
        crops_seen.insert(views - 1);
        // Forwarded as it came: vLLM's own count, which the plan here equals.
        let body = json!({"model": "gemma3-forward", "max_tokens": 2,
                          "messages": [{"role": "user", "content": content}]});
        let (status, none, reply) = post(&gateway, &body);
        assert!(status.is_success(), "{reply}");
        assert_eq!(none, None, "forward promises nothing");
        assert_eq!(
            reply["usage"]["prompt_tokens"], counted,
            "forwarded {image}"
        );
    }
    // The images make whole images and 2, 3 and 4 crops.
    assert_eq!(
        crops_seen.into_iter().collect::<Vec<_>>(),
        [0, 2, 3, 4],
        "crops made"
    );

    // Several images in one message: the blank lines around adjacent images merge.
    let content = json!([image_part("scene-640x480.jpg"), image_part("scene-900x300.jpg"),
                         {"type": "text", "text": "and"}, image_part("scene-256x256.jpg")]);
    for (model, extra) in [("gemma3", json!({})), ("gemma3-pas", pas.clone())] {
        let (promised, counted, media) = planned(&gateway, model, &content, &extra);
        assert_eq!(promised, counted, "{model}, three images: {media}");
    }

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
