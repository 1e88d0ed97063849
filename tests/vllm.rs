//! mmgate in front of vLLM itself (its CPU build from PyPI, pinned in
//! tests/fixtures/engine/requirements.txt) serving tiny random checkpoints of families mmgate plans
//! media for but does not run (made by tests/fixtures/vllm/checkpoints.py in the engine venv), and
//! mmgate's own demo checkpoints of the Qwen families it also runs. For each family and each image
//! of several sizes and aspect ratios (and videos and audio where the family takes them), through
//! `media = "preprocess"`:
//! the prompt tokens mmgate promised (`x-mmgate-prompt-tokens`) are vLLM's `usage.prompt_tokens`;
//! under a tight context the plan cuts what the family's processor can cut and still keeps its
//! promise and fits; `forward` reaches vLLM unchanged; bad media are refused here with a 4xx.

use crate::common;
mod ec;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use base64::Engine as _;
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

/// The committed checkpoint script, run by the venv's Python.
/// tests/fixtures/vllm/checkpoints.py with `args`, forked from the binary's zygote (torch and
/// transformers imported once).
fn checkpoints_py(venv: &Path, args: &[&str]) {
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/vllm/checkpoints.py");
    common::engine::run_python_script(venv, &script, args);
}

/// `family`'s tiny checkpoint, made in `into` by the committed script.
fn checkpoint(venv: &Path, family: &str, into: &Path) -> PathBuf {
    checkpoints_py(venv, &[into.to_str().unwrap(), family]);
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

/// A PDF through `model` (planned here) and `forward`: its pages, each rendered at the size its
/// plan chose, are the tokens promised; forwarded, they go as PNG images vLLM counts itself.
fn documents_hold(gateway: &Server, model: &str, forward: &str) {
    let pdf = format!(
        "data:application/pdf;base64,{}",
        base64::engine::general_purpose::STANDARD
            .encode(common::fixture("documents/three-pages.pdf"))
    );
    let content = json!([{"type": "text", "text": "Summarise."},
                         {"type": "file", "file": {"filename": "r.pdf", "file_data": pdf}}]);
    let (promised, counted, media) = planned(gateway, model, &content, &json!({}));
    assert_eq!(promised, counted, "{model}, a PDF: {media}");
    assert_eq!(media[0]["kind"], "document", "{media}");
    assert_eq!(media[0]["pages_kept"], json!([1, 2, 3]), "{media}");
    let body = json!({"model": forward, "max_tokens": 2,
                      "messages": [{"role": "user", "content": content}]});
    let (status, none, reply) = post(gateway, &body);
    assert!(status.is_success(), "{forward}, a PDF: {reply}");
    assert_eq!(none, None, "forward promises nothing");
    assert!(
        reply["usage"]["prompt_tokens"].as_u64() > Some(3),
        "{reply}"
    );
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
    bad_media_is_refused_here(gateway, model);
    plans
}

/// Truncated images of each format and a part of a kind the model does not take are refused here
/// with a 4xx, before the engine sees them.
fn bad_media_is_refused_here(gateway: &Server, model: &str) {
    let truncated = |url: &str| json!([{"type": "image_url", "image_url": {"url": url}}]);
    for content in [
        truncated("data:image/jpeg;base64,/9j/4AAQ"),
        truncated("data:image/png;base64,iVBORw0KGgo="),
        truncated("data:image/gif;base64,R0lGODlh"),
        truncated("data:image/webp;base64,UklGRg=="),
        json!([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]),
    ] {
        let body = json!({"model": model, "max_tokens": 2,
                          "messages": [{"role": "user", "content": content}]});
        let (status, _, reply) = post(gateway, &body);
        assert!(status.is_client_error(), "{model}: {status}: {reply}");
        assert!(reply["error"]["message"].is_string(), "{reply}");
    }
}

/// A model served by vLLM (started with `args`) and a gateway in front of it, on the model's
/// weightless copy: planned here as `name` and, under `max_model_len = tight`, as `{name}-tight`
/// (both with the TOML `lines`), forwarded as `{name}-forward`, and `more` models (name, TOML lines
/// beyond the upstream; `{path}` is the weightless copy).
fn fronted(
    venv: &Path,
    model: &Path,
    args: &[&str],
    (name, tight, lines): (&str, usize, &str),
    more: &[(&str, &str)],
) -> (Vllm, Server) {
    front(
        Vllm::start(venv, model, 4096, args),
        model,
        (name, tight, lines),
        more,
    )
}

/// [`fronted`] in front of `vllm` (a server, or the render server's stand-in).
fn front(
    vllm: Vllm,
    model: &Path,
    (name, tight, lines): (&str, usize, &str),
    more: &[(&str, &str)],
) -> (Vllm, Server) {
    let weightless = weightless(model);
    let planned = format!("media = \"preprocess\"\npath = {{path}}\n{lines}");
    let tight_lines = format!("{planned}\nmax_model_len = {tight}");
    let (tight_name, forward) = (format!("{name}-tight"), format!("{name}-forward"));
    let mut models = vec![
        (name, planned.as_str()),
        (tight_name.as_str(), tight_lines.as_str()),
        (forward.as_str(), ""),
    ];
    models.extend_from_slice(more);
    let scratch = model.parent().unwrap();
    let config = scratch.join(format!("{name}.toml"));
    std::fs::write(
        &config,
        gateway_config(model, &vllm.addr, &weightless, &models),
    )
    .unwrap();
    let gateway = Server::start(&["--config", config.to_str().unwrap()]);
    (vllm, gateway)
}

/// `family`'s tiny checkpoint (checkpoints.py) behind vLLM's render server, as [`fronted`] with no
/// more models: every count is vLLM's own frontend's, rendered without an engine (the families
/// whose answers a test compares run a whole server).
fn family_fronted(venv: &Path, scratch: &Path, family: &str, tight: usize) -> (Vllm, Server) {
    let model = checkpoint(venv, family, scratch);
    front(
        Vllm::render(venv, &model, 4096, &[]),
        &model,
        (family, tight, ""),
        &[],
    )
}

/// One item (`part`) through `{model}-tight`, a context of `context` tokens too small for it as
/// it came: the plan cuts it (`reduced`), the promise holds, and the request fits. Its plan.
fn tight_holds(gateway: &Server, model: &str, part: Value, context: u64, extra: &Value) -> Value {
    let content = json!([part, {"type": "text", "text": "What?"}]);
    let tight = format!("{model}-tight");
    let (promised, counted, media) = planned(gateway, &tight, &content, extra);
    assert_eq!(promised, counted, "{tight}: {media}");
    assert!(
        promised + 2 <= context,
        "{promised} tokens in a context of {context}"
    );
    assert_eq!(media[0]["reduced"], true, "{media}");
    media[0].clone()
}

/// Distinct values of `plans`' tokens divided by `per`: the views, tiles or crops they chose.
fn units(plans: &[Value], per: u64) -> std::collections::BTreeSet<u64> {
    plans
        .iter()
        .map(|plan| plan["tokens"].as_u64().unwrap() / per)
        .collect()
}

#[test]
fn gemma3_in_front_of_vllm_keeps_its_promise_with_and_without_pan_and_scan() {
    let Some(venv) = vllm_venv() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let model = checkpoint(&venv, "gemma3", scratch.path());
    // Pan-and-scan is the processor's setting: vLLM takes it per request here (as an operator's
    // `--mm-processor-kwargs` sets it for all), mmgate from the model's `processor_kwargs`.
    // A whole server: vLLM 0.32's render server refuses Gemma 3's several images in one request
    // ("mm_placeholders must be globally non-overlapping and sorted"), which its engine serves.
    let (_vllm, gateway) = fronted(
        &venv,
        &model,
        &["--trust-request-mm-kwargs"],
        (
            "gemma3-pas",
            150,
            "processor_kwargs = { do_pan_and_scan = true }",
        ),
        &[("gemma3", "media = \"preprocess\"\npath = {path}")],
    );
    promises_hold(&gateway, "gemma3", "gemma3-pas-forward", &json!({}));
    documents_hold(&gateway, "gemma3", "gemma3-pas-forward");
    let pas = json!({"mm_processor_kwargs": {"do_pan_and_scan": true}});
    let plans = promises_hold(&gateway, "gemma3-pas", "gemma3-pas-forward", &pas);
    // 16 tokens a view: whole images and 2, 3 and 4 crops.
    let views: Vec<u64> = units(&plans, 16).into_iter().collect();
    assert_eq!(views, [1, 3, 4, 5], "views made");

    // A context too small for every crop: fewer crops.
    let plan = tight_holds(
        &gateway,
        "gemma3-pas",
        image_part("scene-1200x300.jpg"),
        150,
        &pas,
    );
    assert!(plan["tokens"].as_u64().unwrap() < 5 * 16, "{plan}");
}

#[test]
fn mistral3_in_front_of_vllm_keeps_its_promise_at_native_resolution() {
    let Some(venv) = vllm_venv() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let (_vllm, gateway) = family_fronted(&venv, scratch.path(), "mistral3", 80);
    let plans = promises_hold(&gateway, "mistral3", "mistral3-forward", &json!({}));
    // Within 336 px in 28 px tokens: 640x480 is 12x9 tokens and 9 breaks.
    assert_eq!(plans[0]["tokens"], 9 * 13, "{}", plans[0]);
    // A context too small for the image at its size: a lower longest edge.
    tight_holds(
        &gateway,
        "mistral3",
        image_part("scene-640x480.jpg"),
        80,
        &json!({}),
    );
}

/// mmgate's demo Qwen2-VL (random weights, run by vLLM too): images encoded here and sent as
/// `image_embeds` (vLLM's `--enable-mm-embeds`), and images planned here; both promise vLLM's
/// count, and the embeddings give vLLM's own greedy answer to the image sent as it came. The same
/// server answers the SDKs and joins the gateway's trace.
#[test]
fn qwen2_vl_embeddings_and_plans_from_here_keep_their_promise_in_vllm() {
    let Some(venv) = vllm_venv() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let model = common::engine::demo_checkpoint(scratch.path(), "demo", "qwen2-vl");
    let embed = format!("media = \"embed\"\npath = {model:?}");
    // vLLM exports its spans too: the trace check below shares this server.
    let receiver = common::traces::Receiver::start(&venv);
    let endpoint = format!("{}/v1/traces", receiver.endpoint);
    let vllm = Vllm::start_with_env(
        &venv,
        &model,
        4096,
        &["--enable-mm-embeds", "--otlp-traces-endpoint", &endpoint],
        &[
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"),
            ("OTEL_SERVICE_NAME", "vllm"),
        ],
    );
    let (_vllm, gateway) = front(
        vllm,
        &model,
        ("qwen2-vl", 200, ""),
        &[("qwen2-vl-embed", embed.as_str())],
    );
    promises_hold(&gateway, "qwen2-vl", "qwen2-vl-forward", &json!({}));
    documents_hold(&gateway, "qwen2-vl", "qwen2-vl-forward");
    // A photo of more than twice the pixels its plan keeps is sent at its planned size (a PNG),
    // not as it came, though the budget did not cut it: the promise holds all the same.
    let big = "scene-1280x960.jpg";
    let plans = promises_hold_on(&gateway, "qwen2-vl", "qwen2-vl-forward", &json!({}), &[big]);
    assert_eq!(plans[0]["reduced"], false, "{}", plans[0]);
    let explained = client()
        .post(format!("http://{}/v1/preprocess", gateway.addr))
        .json(&json!({"model": "qwen2-vl", "media": image_part(big)["image_url"]["url"]}))
        .send()
        .unwrap()
        .json::<Value>()
        .unwrap();
    assert_eq!(
        explained["files"][0]["mime_type"], "image/png",
        "{explained}"
    );
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
    // A video has no embeddings form: through the embed model it is planned here as `preprocess`
    // plans it (vLLM's frontend then reads only its chosen frames), and the promise holds.
    let content = json!([video_part("h264.mp4"), {"type": "text", "text": "What happens?"}]);
    let (promised, counted, media) = planned(&gateway, "qwen2-vl-embed", &content, &json!({}));
    assert_eq!(promised, counted, "{media}");
    assert_eq!(media[0]["kind"], "video", "{media}");
    tight_holds(
        &gateway,
        "qwen2-vl",
        image_part("scene-640x480.jpg"),
        200,
        &json!({}),
    );
    // OpenAI's SDK through the Responses API, translated to the chat completion vLLM serves.
    let kinds = ["text", "image", "file"];
    let lines = common::responses_sdk(&venv, &gateway.addr, "qwen2-vl", &kinds);
    assert!(lines.iter().any(|l| l["what"] == "follow-up"), "{lines:?}");
    // Anthropic's SDK through the Messages API: `count_tokens` is the count vLLM then charges.
    let kinds = ["text", "image", "document", "pdf", "errors"];
    let lines = common::messages_sdk(&venv, &gateway.addr, "qwen2-vl", &kinds);
    assert!(lines.iter().any(|l| l["what"] == "document"), "{lines:?}");
    assert!(lines.iter().any(|l| l["what"] == "pdf"), "{lines:?}");
    messages_mean_what_vllm_makes_of_them(&_vllm, &gateway, &model);
    an_upstream_request_is_one_trace_joined_by_vllms_own_spans(
        &receiver,
        &_vllm,
        &model,
        scratch.path(),
    );
}

/// A Messages request (a system prompt's blocks, turns, an image) through mmgate means the prompt
/// vLLM's own `/v1/messages` makes of it: the same input tokens and greedy text; and a model whose
/// media go as they came cannot count before sending.
fn messages_mean_what_vllm_makes_of_them(vllm: &Vllm, gateway: &Server, served: &Path) {
    let image = image_part("scene-640x480.jpg");
    let data = image["image_url"]["url"].as_str().unwrap();
    let (mime, payload) = data["data:".len()..].split_once(";base64,").unwrap();
    let body = |model: &str| {
        json!({"model": model, "max_tokens": 6, "temperature": 0,
               "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
               "messages": [
                   {"role": "user", "content": "Hello."},
                   {"role": "assistant", "content": [{"type": "text", "text": "Hi."}]},
                   {"role": "user", "content": [
                       {"type": "text", "text": "What is this?"},
                       {"type": "image", "source": {"type": "base64", "media_type": mime, "data": payload}}]}]})
    };
    let send = |addr: &str, path: &str, body: &Value| {
        let response = client()
            .post(format!("http://{addr}{path}"))
            .header("anthropic-version", "2023-06-01")
            .json(body)
            .send()
            .unwrap();
        (
            response.status().as_u16(),
            response.json::<Value>().unwrap(),
        )
    };
    let (status, own) = send(&vllm.addr, "/v1/messages", &body(served.to_str().unwrap()));
    assert_eq!(status, 200, "{own}");
    for model in ["qwen2-vl", "qwen2-vl-forward"] {
        let (status, ours) = send(&gateway.addr, "/v1/messages", &body(model));
        assert_eq!(status, 200, "{model}: {ours}");
        assert_eq!(
            ours["usage"]["input_tokens"], own["usage"]["input_tokens"],
            "{model}"
        );
        assert_eq!(
            ours["content"], own["content"],
            "{model}: the greedy answer"
        );
        assert_eq!(ours["stop_reason"], own["stop_reason"], "{model}");
    }
    let (status, counted) = send(
        &gateway.addr,
        "/v1/messages/count_tokens",
        &body("qwen2-vl"),
    );
    assert_eq!(
        (status, &counted["input_tokens"]),
        (200, &own["usage"]["input_tokens"])
    );
    let (status, error) = send(
        &gateway.addr,
        "/v1/messages/count_tokens",
        &body("qwen2-vl-forward"),
    );
    assert_eq!(
        (status, &error["error"]["type"]),
        (400, &json!("invalid_request_error"))
    );
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("forward"),
        "{error}"
    );
}

/// The demo checkpoint `spec` of `family` behind one vLLM, an EC consumer, for every media mode
/// (see [`ec::ec_fronted`]); the store of what is encoded here.
fn demo_fronted(
    venv: &Path,
    scratch: &Path,
    (spec, family): (&str, &str),
    tight: usize,
) -> (Vllm, Server, PathBuf) {
    let model = common::engine::demo_checkpoint(scratch, spec, family);
    let store = scratch.join("ec");
    let (vllm, gateway) = ec::ec_fronted(venv, &model, &store, (family, tight));
    (vllm, gateway, store)
}

/// The demo Qwen2.5-VL: images and videos (frames sent as vLLM's frame list, with Qwen2.5-VL's
/// seconds per temporal patch) planned here keep their promise, and a tight context cuts frames;
/// encoded here, vLLM answers as encoding them itself.
#[test]
fn qwen2_5_vl_images_and_videos_planned_or_encoded_here_keep_their_promise_in_vllm() {
    let Some(venv) = vllm_venv() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let spec = ("demo-qwen2.5-vl", "qwen2.5-vl");
    let (_vllm, gateway, store) = demo_fronted(&venv, scratch.path(), spec, 400);
    ec::qwen_vl_encoded_here_answers_as_vllm_itself(&gateway, "qwen2.5-vl", "qwen2.5-vl", &store);
    promises_hold(&gateway, "qwen2.5-vl", "qwen2.5-vl-forward", &json!({}));
    for clip in ["h264.mp4", "portrait.mp4", "vp9.webm"] {
        let content = json!([video_part(clip), {"type": "text", "text": "What happens?"}]);
        let (promised, counted, media) = planned(&gateway, "qwen2.5-vl", &content, &json!({}));
        assert_eq!(promised, counted, "{clip}: {media}");
    }
    tight_holds(
        &gateway,
        "qwen2.5-vl",
        video_part("h264.mp4"),
        400,
        &json!({}),
    );
    let lines = common::responses_sdk(&venv, &gateway.addr, "qwen2.5-vl", &["video"]);
    assert_eq!(lines[0]["media"][0]["kind"], "video", "{lines:?}");
}

/// The demo Qwen3-VL: images planned here (16 px patches, transformers' pixel bounds) and videos
/// (each temporal patch after its timestamp, as vLLM writes it for frames sent as a list) keep
/// their promise; encoded here, vLLM answers as encoding them itself.
#[test]
fn qwen3_vl_images_and_videos_planned_or_encoded_here_keep_their_promise_in_vllm() {
    let Some(venv) = vllm_venv() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let spec = ("demo-qwen3-vl", "qwen3-vl");
    let (_vllm, gateway, store) = demo_fronted(&venv, scratch.path(), spec, 200);
    ec::qwen_vl_encoded_here_answers_as_vllm_itself(&gateway, "qwen3-vl", "qwen3-vl", &store);
    promises_hold(&gateway, "qwen3-vl", "qwen3-vl-forward", &json!({}));
    // 12 s: times of two digits, as vLLM numbers the frames (not as the source times them).
    for clip in ["h264.mp4", "portrait.mp4", "vp9.webm", "12s.mp4"] {
        let content = json!([video_part(clip), {"type": "text", "text": "What happens?"}]);
        let (promised, counted, media) = planned(&gateway, "qwen3-vl", &content, &json!({}));
        assert_eq!(promised, counted, "{clip}: {media}");
    }
    let two = json!([video_part("h264.mp4"), {"type": "text", "text": "and"},
                     video_part("vp9.webm")]);
    let (promised, counted, media) = planned(&gateway, "qwen3-vl", &two, &json!({}));
    assert_eq!(promised, counted, "two videos: {media}");
    tight_holds(
        &gateway,
        "qwen3-vl",
        image_part("scene-640x480.jpg"),
        200,
        &json!({}),
    );
}

/// A tiny Qwen3.5 (Qwen3-VL's tower, processor and prompts before a hybrid LLM of linear and full
/// attention, which vLLM's CPU build runs in bf16): images and videos planned here as Qwen3-VL's
/// keep their promise, and a tight context shrinks an image.
#[test]
fn qwen3_5_images_and_videos_planned_here_keep_their_promise_in_vllm() {
    let Some(venv) = vllm_venv() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let model = checkpoint(&venv, "qwen3_5", scratch.path());
    let counts = Vllm::render(&venv, &model, 4096, &["--dtype", "bfloat16"]);
    let (_vllm, gateway) = front(counts, &model, ("qwen3_5", 200, ""), &[]);
    promises_hold(&gateway, "qwen3_5", "qwen3_5-forward", &json!({}));
    for clip in ["h264.mp4", "12s.mp4"] {
        let content = json!([video_part(clip), {"type": "text", "text": "What happens?"}]);
        let (promised, counted, media) = planned(&gateway, "qwen3_5", &content, &json!({}));
        assert_eq!(promised, counted, "{clip}: {media}");
    }
    tight_holds(
        &gateway,
        "qwen3_5",
        image_part("scene-640x480.jpg"),
        200,
        &json!({}),
    );
}

/// The demo Qwen2-Audio: audio of several encodings, rates and lengths (61 s: three 30 s chunks)
/// planned here and sent as 16 kHz WAV keeps its promise; encoded here, vLLM answers as encoding
/// it itself.
#[test]
fn qwen2_audio_planned_or_encoded_here_keeps_its_promise_in_vllm() {
    use base64::Engine as _;
    let Some(venv) = vllm_venv() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let model = common::engine::demo_checkpoint(scratch.path(), "demo-audio", "audio");
    // vLLM loads Qwen2-Audio only under the Hub's weight names (the demo has transformers 5's).
    checkpoints_py(&venv, &["--hub-names", model.to_str().unwrap()]);
    let store = scratch.path().join("ec");
    let (_vllm, gateway) = ec::ec_fronted(&venv, &model, &store, ("audio", 4096));
    ec::qwen2_audio_encoded_here_answers_as_vllm_itself(&gateway, "audio", &store);
    let clips = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/audio/clips");
    for name in [
        "speech-16k-s16.wav",
        "speech-44k1-stereo-s16.wav",
        "tone-8k-s16.wav",
        "speech-16k.mp3",
        "long-61s-16k.flac",
    ] {
        let data = base64::engine::general_purpose::STANDARD
            .encode(std::fs::read(clips.join(name)).unwrap());
        let format = name.rsplit('.').next().unwrap();
        let content = json!([{"type": "input_audio", "input_audio": {"data": data, "format": format}},
                             {"type": "text", "text": "What is said?"}]);
        let (promised, counted, media) = planned(&gateway, "audio", &content, &json!({}));
        assert_eq!(promised, counted, "{name}: {media}");
    }
    bad_media_is_refused_here(&gateway, "audio");
    let lines = common::responses_sdk(&venv, &gateway.addr, "audio", &["audio"]);
    assert_eq!(lines[0]["media"][0]["kind"], "audio", "{lines:?}");
}

/// A tiny Gemma 4: each image resized to at most 70 pooled cells, its tokens set by its aspect
/// ratio; a context whose text leaves less is refused here.
#[test]
fn gemma4_in_front_of_vllm_keeps_its_promise_on_its_soft_tokens() {
    let Some(venv) = vllm_venv() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let (_vllm, gateway) = family_fronted(&venv, scratch.path(), "gemma4", 40);
    let plans = promises_hold(&gateway, "gemma4", "gemma4-forward", &json!({}));
    // The aspect ratios make several counts, none past the 70 of max_soft_tokens.
    let counts = units(&plans, 1);
    assert!(
        counts.len() >= 3 && counts.iter().all(|&n| n <= 70),
        "{counts:?}"
    );
    let content = json!([image_part("scene-640x480.jpg"), {"type": "text", "text": "What?"}]);
    let body = json!({"model": "gemma4-tight", "max_tokens": 2,
                      "messages": [{"role": "user", "content": content}]});
    let (status, promised, reply) = post(&gateway, &body);
    assert_eq!((status.as_u16(), promised), (400, None), "{reply}");
    assert_eq!(reply["error"]["code"], "context_length_exceeded", "{reply}");
}

#[test]
fn llava_in_front_of_vllm_keeps_its_promise_on_its_one_view() {
    let Some(venv) = vllm_venv() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let (_vllm, gateway) = family_fronted(&venv, scratch.path(), "llava", 32);
    let plans = promises_hold(&gateway, "llava", "llava-forward", &json!({}));
    // One CLIP view of 4x4 patches, whatever the image: 16 tokens each.
    assert_eq!(units(&plans, 1), [16].into(), "{plans:?}");
    // A context whose text leaves less than that one view: nothing can be cut, so the request
    // is refused here with the view's cost, before vLLM sees it.
    let content = json!([image_part("scene-640x480.jpg"), {"type": "text", "text": "What?"}]);
    let body = json!({"model": "llava-tight", "max_tokens": 2,
                      "messages": [{"role": "user", "content": content}]});
    let (status, promised, reply) = post(&gateway, &body);
    assert_eq!((status.as_u16(), promised), (400, None), "{reply}");
    assert_eq!(reply["error"]["code"], "context_length_exceeded", "{reply}");
    let message = reply["error"]["message"].as_str().unwrap();
    assert!(message.contains("16 tokens"), "{message}");
}

/// Pixtral in LLaVA's layout (`mistral-community/pixtral-12b`: `model_type` llava, a Pixtral
/// tower): read as the LLaVA family, its images counted by the Pixtral processor its config names
/// (rows of `[IMG]` and their breaks); a tight context lowers the longest edge.
#[test]
fn pixtral_in_llavas_layout_keeps_its_promise_in_vllm() {
    let Some(venv) = vllm_venv() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let (_vllm, gateway) = family_fronted(&venv, scratch.path(), "llava_pixtral", 200);
    promises_hold(
        &gateway,
        "llava_pixtral",
        "llava_pixtral-forward",
        &json!({}),
    );
    tight_holds(
        &gateway,
        "llava_pixtral",
        image_part("scene-640x480.jpg"),
        200,
        &json!({}),
    );
}

#[test]
fn llava_next_in_front_of_vllm_keeps_its_promise_on_anyres_tiles() {
    let Some(venv) = vllm_venv() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let (_vllm, gateway) = family_fronted(&venv, scratch.path(), "llava_next", 80);
    let plans = promises_hold(&gateway, "llava_next", "llava_next-forward", &json!({}));
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
    // A context too small for the image at its size: a smaller image.
    tight_holds(
        &gateway,
        "llava_next",
        image_part("scene-640x480.jpg"),
        80,
        &json!({}),
    );
}

#[test]
fn internvl_in_front_of_vllm_keeps_its_promise_on_its_tiles() {
    let Some(venv) = vllm_venv() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let (_vllm, gateway) = family_fronted(&venv, scratch.path(), "internvl", 40);
    let plans = promises_hold(&gateway, "internvl", "internvl-forward", &json!({}));
    // 4 tokens a tile: one tile, and grids of 3, 4, 9 and 12 tiles with their thumbnails.
    let tiles = units(&plans, 4);
    assert!(tiles.len() >= 4 && tiles.contains(&13), "{tiles:?}");
    // A context too small for 4x3 tiles: a smaller grid of the squashed image.
    for image in ["scene-640x480.jpg", "scene-300x1000.jpg"] {
        tight_holds(&gateway, "internvl", image_part(image), 40, &json!({}));
    }
}

#[test]
fn glm4v_in_front_of_vllm_keeps_its_promise_on_its_own_sizing() {
    glm_keeps_its_promise("glm4v");
}

/// GLM-4.5V: GLM-4.1V's processor and prompts before a mixture of experts.
#[test]
fn glm4v_moe_in_front_of_vllm_keeps_its_promise_on_its_own_sizing() {
    glm_keeps_its_promise("glm4v_moe");
}

/// `family`'s tiny checkpoint (GLM-4.1V's layout) behind vLLM: images keep their promise and a
/// tight context shrinks one.
fn glm_keeps_its_promise(family: &str) {
    let Some(venv) = vllm_venv() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let (_vllm, gateway) = family_fronted(&venv, scratch.path(), family, 40);
    let forward = format!("{family}-forward");
    let plans = promises_hold(&gateway, family, &forward, &json!({}));
    // 20x30 is under a token's 28 px: scaled up first, as GLM's processor does.
    assert!(
        plans
            .iter()
            .all(|plan| plan["tokens"].as_u64().unwrap() <= 64)
    );
    // A context too small for 640x480's 54 tokens: a smaller size.
    tight_holds(
        &gateway,
        family,
        image_part("scene-640x480.jpg"),
        40,
        &json!({}),
    );
}

/// PaddleOCR-VL: Qwen2-VL's patches sized by PaddleOCR's rule (a side under a token's raised
/// first); a tight context shrinks an image.
#[test]
fn paddleocr_vl_in_front_of_vllm_keeps_its_promise_on_its_own_sizing() {
    let Some(venv) = vllm_venv() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let (_vllm, gateway) = family_fronted(&venv, scratch.path(), "paddleocr_vl", 40);
    let plans = promises_hold(&gateway, "paddleocr_vl", "paddleocr_vl-forward", &json!({}));
    assert!(
        plans
            .iter()
            .all(|plan| (4..=64).contains(&plan["tokens"].as_u64().unwrap())),
        "{plans:?}"
    );
    tight_holds(
        &gateway,
        "paddleocr_vl",
        image_part("scene-640x480.jpg"),
        40,
        &json!({}),
    );
}

#[test]
fn llava_onevision_in_front_of_vllm_keeps_its_promise_on_pooled_tiles_and_videos() {
    let Some(venv) = vllm_venv() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let (_vllm, gateway) = family_fronted(&venv, scratch.path(), "llava_onevision", 80);
    let model = "llava_onevision";
    let plans = promises_hold(&gateway, model, "llava_onevision-forward", &json!({}));
    // 256x256 fills 4x4 tiles, whose 16x16 features pool to 12x12 (past nine views' worth).
    let square = &plans[IMAGES
        .iter()
        .position(|i| *i == "scene-256x256.jpg")
        .unwrap()];
    assert_eq!(square["tokens"], 16 + 12 * 12 + 12, "{square}");
    tight_holds(
        &gateway,
        model,
        image_part("scene-640x480.jpg"),
        80,
        &json!({}),
    );

    // Videos: 32 frames evenly (all of a shorter one's), each 4 pooled tokens, and a newline;
    // sent as vLLM's frame list at the tower's size. Under the tight context, fewer frames.
    for (clip, frames) in [("h264.mp4", 32), ("portrait.mp4", 32), ("short.mp4", 5)] {
        let content = json!([video_part(clip), {"type": "text", "text": "What happens?"}]);
        let (promised, counted, media) = planned(&gateway, model, &content, &json!({}));
        assert_eq!(promised, counted, "{clip}: {media}");
        assert_eq!(media[0]["tokens"], frames * 4 + 1, "{clip}: {media}");
    }
    tight_holds(&gateway, model, video_part("vp9.webm"), 80, &json!({}));
}

/// A clip of tests/fixtures/video/clips (or long/) as a `video_url` data URL.
fn video_part(name: &str) -> Value {
    use base64::Engine as _;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/video");
    let path = ["clips", "long"]
        .into_iter()
        .map(|folder| root.join(folder).join(name))
        .find(|path| path.is_file())
        .unwrap_or_else(|| panic!("no clip {name}"));
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
    let (_vllm, gateway) = family_fronted(&venv, scratch.path(), "idefics3", 60);
    let plans = promises_hold(&gateway, "idefics3", "idefics3-forward", &json!({}));
    // Four tiles along the long side, one to four along the short: 5 to 17 views of 4 tokens.
    let views = units(&plans, 4);
    assert!(views.contains(&5) && views.contains(&17), "{views:?}");
    // A context too small for 640x480's 3x4 tiles: fewer rows of a squashed image, landscape
    // and portrait.
    for image in ["scene-640x480.jpg", "scene-300x1000.jpg"] {
        tight_holds(&gateway, "idefics3", image_part(image), 60, &json!({}));
    }
}

#[test]
fn llama4_in_front_of_vllm_keeps_its_promise_on_its_canvas_of_tiles() {
    let Some(venv) = vllm_venv() else { return };
    let scratch = tempfile::tempdir().unwrap();
    // A whole server: the test sees the engine's own failure below.
    let model = checkpoint(&venv, "llama4", scratch.path());
    let (_vllm, gateway) = fronted(&venv, &model, &[], ("llama4", 60, ""), &[]);
    // Not the 20x30 image: it fits one tile, on which vLLM 0.32's CPU build crashes its engine
    // (its `onednn_mm` wants a contiguous tensor), however the image comes.
    let images: Vec<&str> = IMAGES
        .into_iter()
        .filter(|image| *image != "tiny-upscaled.png")
        .collect();
    let plans = promises_hold_on(&gateway, "llama4", "llama4-forward", &json!({}), &images);
    // Canvases of 12, 14, 15 and 16 tiles and their global views, 4 tokens each.
    let views = units(&plans, 4);
    assert!(views.len() >= 3 && views.contains(&17), "{views:?}");
    // A context too small for a 4x4 canvas: a canvas of fewer tiles, the image squashed to it.
    for image in ["scene-640x480.jpg", "scene-1200x300.jpg"] {
        tight_holds(&gateway, "llama4", image_part(image), 60, &json!({}));
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

/// A request planned here and answered by `vllm` (exporting its spans to `receiver`) is one
/// trace: the gateway's spans (continued from the client's `traceparent`), its call upstream, and
/// under that vLLM's own span, which vLLM exported itself to the same receiver.
fn an_upstream_request_is_one_trace_joined_by_vllms_own_spans(
    receiver: &common::traces::Receiver,
    vllm: &Vllm,
    model: &Path,
    scratch: &Path,
) {
    let config = scratch.join("traced.toml");
    let planned = "media = \"preprocess\"\npath = {path}";
    std::fs::write(
        &config,
        gateway_config(
            model,
            &vllm.addr,
            &weightless(model),
            &[("qwen2-vl", planned)],
        ),
    )
    .unwrap();
    let gateway = Server::start_with_env(
        &["--config", config.to_str().unwrap()],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &receiver.endpoint),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
    );
    let trace = "0af7651916cd43dd8448eb211c80319c";
    let body = json!({"model": "qwen2-vl", "max_tokens": 2, "messages": [{"role": "user",
        "content": [image_part("scene-640x480.jpg"), {"type": "text", "text": "What?"}]}]});
    let answer = client()
        .post(format!("http://{}/v1/chat/completions", gateway.addr))
        .header("traceparent", format!("00-{trace}-b7ad6b7169203331-01"))
        .json(&body)
        .send()
        .unwrap();
    assert!(answer.status().is_success());
    assert_eq!(answer.headers()["x-mmgate-trace-id"], trace);
    let spans = receiver.trace(trace, |spans| {
        spans.iter().any(|s| s["service"] == "vllm")
            && spans
                .iter()
                .any(|s| s["name"] == "POST /v1/chat/completions")
    });
    let upstream = spans.iter().find(|s| s["name"] == "upstream").unwrap();
    assert_eq!(upstream["attributes"]["server.address"], vllm.addr);
    assert_eq!(upstream["attributes"]["http.response.status_code"], 200);
    let engine: Vec<&Value> = spans.iter().filter(|s| s["service"] == "vllm").collect();
    assert!(
        engine
            .iter()
            .any(|s| s["parent_span_id"] == upstream["span_id"]),
        "vLLM's span continues the gateway's call upstream: {engine:#?}"
    );
    assert!(spans.iter().any(|s| s["name"] == "plugin.preprocess"));
}
