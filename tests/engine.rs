//! mmgate in front of a real inference engine that this project did not write: transformers'
//! OpenAI-compatible server (`transformers serve`, CPU torch; the versions are pinned in
//! tests/fixtures/engine/requirements.txt and `./dev test` installs them into a venv outside the
//! clone). Two engines serve the tiny Qwen2-VL and Qwen2-Audio demo checkpoints that mmgate also
//! serves natively, so one gateway holds each both ways: native, and the engine's model, forwarded
//! as it came and with its media planned here (`media = "preprocess"`, from a copy of the checkpoint
//! without its weights). Checked: the engine's `usage.prompt_tokens` equals mmgate's own count for
//! text, for images of several sizes and aspect ratios and for audio of several lengths, rates and
//! channel counts, sent as they came and as planned (budget-cut images included);
//! greedy runs give the same answer (text, completion tokens, finish reason); a request that cannot fit, or holds
//! corrupt media, is refused here before any upstream sees it; a streamed answer passes through as
//! SSE.

use crate::common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};

use common::server::Server;

/// `transformers serve` on one model directory, killed when dropped.
struct Engine {
    child: Child,
    addr: String,
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Engine {
    fn start(venv: &Path, model: &Path) -> Engine {
        let port = common::server::free_port();
        let child = Command::new(venv.join("bin/transformers"))
            .args(["serve", model.to_str().unwrap(), "--device", "cpu"])
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .env("HF_HUB_OFFLINE", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start transformers serve");
        let mut engine = Engine {
            child,
            addr: format!("127.0.0.1:{port}"),
        };
        let client = client();
        let health = format!("http://{}/health", engine.addr);
        common::server::wait_until_ready(
            &mut engine.child,
            "transformers serve",
            Duration::from_secs(300),
            || {
                client
                    .get(&health)
                    .send()
                    .is_ok_and(|r| r.status().is_success())
            },
        );
        engine
    }
}

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .unwrap()
}

fn chat(gateway: &Server, body: &Value) -> Value {
    let (status, _, reply) = post(gateway, body);
    assert!(status.is_success(), "{status}: {reply}");
    reply
}

/// A chat completion's status, headers and JSON answer.
fn post(
    gateway: &Server,
    body: &Value,
) -> (reqwest::StatusCode, reqwest::header::HeaderMap, Value) {
    let response = client()
        .post(format!("http://{}/v1/chat/completions", gateway.addr))
        .json(body)
        .send()
        .unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    (status, headers, response.json().unwrap())
}

fn image_part(name: &str) -> Value {
    common::image_url_part(&format!("image/images/{name}"))
}

#[test]
fn the_engine_counts_and_answers_as_mmgate_does() {
    let Some(venv) = common::engine::engine_venv("bin/transformers") else {
        return;
    };
    let scratch = tempfile::tempdir().unwrap();
    let model = common::engine::demo_checkpoint(scratch.path(), "demo", "qwen2-vl");
    let audio_model = common::engine::demo_checkpoint(scratch.path(), "demo-audio", "qwen2-audio");
    let engine = Engine::start(&venv, &model);
    let audio_engine = Engine::start(&venv, &audio_model);
    // The engine serves one forced model whatever the request names; the gateway forwards requests
    // for that name to it.
    let engine_model = model.to_str().unwrap();
    // What preprocess mode needs of a model: its directory without the weights.
    let weightless_model = common::engine::weightless(&model);
    let weightless_audio = common::engine::weightless(&audio_model);
    // transformers' server takes no video: a video planned here is checked in its wire form.
    let recorder = Recorder::start();
    // Nothing listens there: a model whose requests are refused before they go upstream.
    let nowhere = format!("127.0.0.1:{}", common::server::free_port());
    let config = scratch.path().join("mmgate.toml");
    std::fs::write(
        &config,
        format!(
            r#"[[models]]
name = "demo"
path = {engine_model:?}

[[models]]
name = {engine_model:?}
upstreams = ["{engine}"]

[[models]]
name = "planned"
upstream_model = {engine_model:?}
upstreams = ["{engine}"]
media = "preprocess"
path = {weightless_model:?}

[[models]]
name = "planned-small"
upstream_model = {engine_model:?}
upstreams = ["{engine}"]
media = "preprocess"
path = {weightless_model:?}
max_model_len = 200

[[models]]
name = "demo-audio"
path = {audio_model:?}

[[models]]
name = {audio_model:?}
upstreams = ["{audio_engine}"]

[[models]]
name = "planned-audio"
upstream_model = {audio_model:?}
upstreams = ["{audio_engine}"]
media = "preprocess"
path = {weightless_audio:?}

[[models]]
name = "planned-video"
upstreams = ["{recorder}"]
media = "preprocess"
path = {weightless_model:?}

[[models]]
name = "planned-nowhere"
upstream_model = {engine_model:?}
upstreams = ["{nowhere}"]
media = "preprocess"
path = {weightless_model:?}
max_model_len = 200
"#,
            engine = engine.addr,
            audio_engine = audio_engine.addr,
            recorder = recorder.addr,
        ),
    )
    .unwrap();
    let gateway = Server::start(&["--config", config.to_str().unwrap()]);

    let special = special_tokens(&model);
    let mut contents = vec![json!("Hello there"), json!("Tell me about the sea.")];
    // Wide, tall, small and large, PNG and JPEG: each makes a different grid.
    for image in [
        "png-rgb-wide.png",
        "sliver-3x500.png",
        "photo-640x480.jpg",
        "tiny-upscaled.png",
    ] {
        contents.push(json!([image_part(image), {"type": "text", "text": "What is this?"}]));
    }
    for content in &contents {
        let request = |model: &str| {
            json!({"model": model, "max_tokens": 6, "temperature": 0,
                   "messages": [{"role": "user", "content": content}]})
        };
        let native = chat(&gateway, &request("demo"));
        let engine_reply = chat(&gateway, &request(engine_model));
        let label = content.to_string().chars().take(80).collect::<String>();
        assert_eq!(
            engine_reply["usage"]["prompt_tokens"], native["usage"]["prompt_tokens"],
            "prompt tokens of {label}"
        );
        // The same greedy tokens, seen through their text: the engine's replies carry no token
        // ids (nor logprobs), and it decodes the same tokens to other text than mmgate does, so
        // both are brought to what they share (see `decoded_alike`).
        assert_eq!(
            decoded_alike(&native, &special),
            decoded_alike(&engine_reply, &special),
            "the greedy answer to {label}"
        );
        assert_eq!(
            engine_reply["usage"]["completion_tokens"], native["usage"]["completion_tokens"],
            "completion tokens of {label}"
        );
        assert_eq!(
            engine_reply["choices"][0]["finish_reason"], native["choices"][0]["finish_reason"],
            "finish reason of {label}"
        );
    }

    media_planned_here_cost_the_engine_what_the_plan_said(&gateway, engine_model);
    a_planned_video_is_read_as_vllm_reads_a_frame_list(&gateway, &recorder, &venv);
    audio_costs_and_answers_alike(
        &gateway,
        audio_model.to_str().unwrap(),
        &special_tokens(&audio_model),
    );

    // A streamed answer passes through as server-sent events.
    let response = client()
        .post(format!("http://{}/v1/chat/completions", gateway.addr))
        .json(
            &json!({"model": engine_model, "max_tokens": 4, "stream": true,
                      "messages": [{"role": "user", "content": "Hello"}]}),
        )
        .send()
        .unwrap();
    assert!(response.status().is_success());
    let content_type = response.headers()["content-type"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(
        content_type.starts_with("text/event-stream"),
        "{content_type}"
    );
    let body = response.text().unwrap();
    // Every event as the engine sent it, the last one carrying the finish reason (this engine
    // sends no `data: [DONE]` after it).
    let events: Vec<Value> = body
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter(|data| *data != "[DONE]")
        .map(|data| serde_json::from_str(data).unwrap())
        .collect();
    assert!(events.len() >= 2, "{body}");
    assert_eq!(
        events.last().unwrap()["choices"][0]["finish_reason"],
        "length",
        "{body}"
    );
}

/// The special tokens of a model's tokenizer (`added_tokens` marked special in tokenizer.json).
fn special_tokens(model: &Path) -> Vec<String> {
    let tokenizer: Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("tokenizer.json")).unwrap())
            .unwrap();
    tokenizer["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["special"] == true)
        .map(|t| t["content"].as_str().unwrap().to_owned())
        .collect()
}

/// An answer's text as both servers decode the same tokens: mmgate skips special tokens (as vLLM
/// does) and keeps surrounding whitespace; transformers' server keeps special tokens, strips the
/// text, and ends it with U+FFFD for a character the last tokens left incomplete, which mmgate
/// holds back (as vLLM's incremental detokenizer does). What is left of both is the same.
fn decoded_alike(answer: &Value, special: &[String]) -> String {
    let mut text = answer["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    for token in special {
        text = text.replace(token.as_str(), "");
    }
    // Python's `str.strip` (the engine's) takes U+001C..U+001F for whitespace too.
    let space = |c: char| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c);
    text.trim_matches(space)
        .trim_end_matches('\u{fffd}')
        .trim_end_matches(space)
        .to_owned()
}

fn audio_part(clip: &str) -> Value {
    use base64::Engine as _;
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/audio/clips")
        .join(clip);
    let data = base64::engine::general_purpose::STANDARD.encode(std::fs::read(&path).unwrap());
    let format = path.extension().unwrap().to_str().unwrap();
    json!({"type": "input_audio", "input_audio": {"data": data, "format": format}})
}

/// The demo Qwen2-Audio served natively, by the engine with its audio sent as it came, and by the
/// engine with its audio planned here (a 16 kHz mono WAV cut to the plan): the same prompt tokens
/// all three ways, and the same greedy answer natively and from the engine.
fn audio_costs_and_answers_alike(gateway: &Server, engine_model: &str, special: &[String]) {
    for clip in [
        "speech-16k-s16.wav",
        "speech-44k1-stereo-s16.wav",
        "tone-8k-s16.wav",
        "speech-48k.flac",
    ] {
        let content = json!([audio_part(clip), {"type": "text", "text": "What is this?"}]);
        let request = |model: &str| {
            json!({"model": model, "max_tokens": 6, "temperature": 0,
                   "messages": [{"role": "user", "content": content}]})
        };
        let native = chat(gateway, &request("demo-audio"));
        let engine_reply = chat(gateway, &request(engine_model));
        assert_eq!(
            engine_reply["usage"]["prompt_tokens"], native["usage"]["prompt_tokens"],
            "prompt tokens of {clip}"
        );
        assert_eq!(
            decoded_alike(&native, special),
            decoded_alike(&engine_reply, special),
            "the greedy answer to {clip}"
        );
        assert_eq!(
            engine_reply["choices"][0]["finish_reason"], native["choices"][0]["finish_reason"],
            "finish reason of {clip}"
        );
        let (status, headers, planned) = post(gateway, &request("planned-audio"));
        assert!(status.is_success(), "{clip}: {status}: {planned}");
        assert_eq!(
            planned["usage"]["prompt_tokens"],
            headers["x-mmgate-prompt-tokens"]
                .to_str()
                .unwrap()
                .parse::<u64>()
                .unwrap(),
            "the engine's prompt tokens for {clip} as planned"
        );
        assert_eq!(
            planned["usage"]["prompt_tokens"], native["usage"]["prompt_tokens"],
            "{clip}"
        );
    }

    // Over 30 s, HF's audio processors (the engine's) keep the first 30 s chunk only, where
    // natively mmgate encodes every chunk: planned for the engine, the plan keeps what the engine
    // counts, says so, and sends no more.
    let content =
        json!([audio_part("long-61s-16k.flac"), {"type": "text", "text": "What is this?"}]);
    let request = |model: &str| {
        json!({"model": model, "max_tokens": 6, "temperature": 0,
               "messages": [{"role": "user", "content": content}]})
    };
    let (status, headers, planned) = post(gateway, &request("planned-audio"));
    assert!(status.is_success(), "{status}: {planned}");
    let as_it_came = chat(gateway, &request(engine_model));
    let native = chat(gateway, &request("demo-audio"));
    let planned_tokens: u64 = headers["x-mmgate-prompt-tokens"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(planned["usage"]["prompt_tokens"], planned_tokens);
    assert_eq!(as_it_came["usage"]["prompt_tokens"], planned_tokens);
    let account = &planned["usage"]["media"][0];
    assert_eq!(
        (&account["chunks"], &account["reduced"]),
        (&json!(1), &json!(true)),
        "{account}"
    );
    assert!(native["usage"]["prompt_tokens"].as_u64().unwrap() > planned_tokens);
}

/// `media = "preprocess"`: every image is planned here and reaches the engine as planned (as it came
/// when the plan keeps the processor's own size, else a PNG at its planned size); the engine's
/// processor must count exactly the tokens of the plan.
fn media_planned_here_cost_the_engine_what_the_plan_said(gateway: &Server, engine_model: &str) {
    let request = |model: &str, content: &Value, max_tokens: u32| {
        json!({"model": model, "max_tokens": max_tokens, "temperature": 0,
               "messages": [{"role": "user", "content": content}]})
    };
    let question = json!({"type": "text", "text": "What is this?"});
    let mut cut = 0;
    for (model, images) in [
        (
            "planned",
            vec![
                "png-rgb-wide.png",
                "sliver-3x500.png",
                "photo-640x480.jpg",
                "tiny-upscaled.png",
                "jpeg-progressive.jpg",
                "webp-lossy.webp",
            ],
        ),
        // A context of 200 tokens: large images are cut to fit, and two share what is left.
        (
            "planned-small",
            vec!["photo-640x480.jpg", "jpeg-baseline-420.jpg"],
        ),
        (
            "planned-small",
            vec!["photo-640x480.jpg", "png-rgb-wide.png"],
        ),
    ] {
        for content in images
            .iter()
            .map(|image| json!([image_part(image), question]))
            .chain((model == "planned-small").then(|| {
                let mut parts: Vec<Value> = images.iter().map(|i| image_part(i)).collect();
                parts.push(question.clone());
                Value::Array(parts)
            }))
        {
            let label = format!(
                "{model}: {}",
                content.to_string().chars().take(60).collect::<String>()
            );
            let (status, headers, reply) = post(gateway, &request(model, &content, 6));
            assert!(status.is_success(), "{label}: {status}: {reply}");
            let planned: u64 = headers["x-mmgate-prompt-tokens"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap();
            assert_eq!(
                reply["usage"]["prompt_tokens"], planned,
                "the engine's prompt tokens for {label}"
            );
            let accounts = reply["usage"]["media"].as_array().expect("usage.media");
            assert_eq!(
                accounts.len(),
                content.as_array().unwrap().len() - 1,
                "{label}"
            );
            cut += accounts.iter().filter(|a| a["reduced"] == true).count();
            assert!(headers.contains_key("x-mmgate-media"), "{label}");
        }
    }
    assert!(cut >= 3, "the small context cut images: {cut}");

    // An image whose plan keeps its size reaches the engine as it came: the same greedy answer.
    let content = json!([image_part("photo-640x480.jpg"), question]);
    let planned = chat(gateway, &request("planned", &content, 8));
    let direct = chat(gateway, &request(engine_model, &content, 8));
    assert_eq!(planned["usage"]["media"][0]["reduced"], false);
    assert_eq!(
        planned["choices"][0]["message"]["content"],
        direct["choices"][0]["message"]["content"]
    );
    assert_eq!(
        planned["usage"]["prompt_tokens"],
        direct["usage"]["prompt_tokens"]
    );

    // Refused here, before any upstream: nothing listens behind `planned-nowhere`, so a request
    // that reached for it would be a 502.
    let too_long = json!([image_part("photo-640x480.jpg"), question]);
    let (status, _, reply) = post(gateway, &request("planned-nowhere", &too_long, 190));
    assert_eq!(status, 400, "{reply}");
    assert_eq!(reply["error"]["code"], "context_length_exceeded", "{reply}");
    use base64::Engine as _;
    let corrupt = base64::engine::general_purpose::STANDARD.encode(b"\x89PNG\r\n\x1a\nnot really");
    let corrupt = json!([{"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{corrupt}")}}, question]);
    // A URL inside the network (the SSRF guard), more items than a request may carry: the same
    // answer as a native model's.
    let internal =
        json!([{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/a.png"}}, question]);
    let too_many = Value::Array(
        std::iter::repeat_n(image_part("tiny-upscaled.png"), 33)
            .chain([question.clone()])
            .collect(),
    );
    for (content, expected) in [
        (&corrupt, Some("invalid_media")),
        (&internal, None),
        (&too_many, Some("too_many_media_items")),
    ] {
        let (native_status, _, native) = post(gateway, &request("demo", content, 6));
        let (status, _, reply) = post(gateway, &request("planned-nowhere", content, 6));
        assert!(native_status.is_client_error(), "{native}");
        assert_eq!(
            (status, &reply["error"]["code"]),
            (native_status, &native["error"]["code"]),
            "{reply}"
        );
        if let Some(code) = expected {
            assert_eq!(reply["error"]["code"], code, "{reply}");
        }
    }
}

/// An upstream that records the bodies of the requests it gets and answers each with a small
/// chat completion, one request a connection: where no engine here takes what mmgate sends, what it sends is checked.
struct Recorder {
    addr: String,
    bodies: std::sync::Arc<std::sync::Mutex<Vec<Vec<u8>>>>,
}

impl Recorder {
    fn start() -> Recorder {
        use std::io::{BufRead, BufReader, Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let bodies = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = bodies.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let mut reader = BufReader::new(stream);
                let mut length = 0usize;
                let mut line = String::new();
                while reader.read_line(&mut line).unwrap_or(0) > 0 && line != "\r\n" {
                    if let Some((name, value)) = line.split_once(':')
                        && name.eq_ignore_ascii_case("content-length")
                    {
                        length = value.trim().parse().unwrap_or(0);
                    }
                    line.clear();
                }
                let mut body = vec![0; length];
                if reader.read_exact(&mut body).is_err() {
                    continue;
                }
                // Health checks (GET, no body) are answered and not recorded.
                if length > 0 {
                    seen.lock().unwrap().push(body);
                }
                let answer =
                    r#"{"object":"chat.completion","choices":[],"usage":{"prompt_tokens":0}}"#;
                let _ = write!(
                    reader.get_mut(),
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{answer}",
                    answer.len()
                );
            }
        });
        Recorder { addr, bodies }
    }
}

/// A video planned here goes as vLLM's frame list (`video/jpeg`: the chosen frames' base64,
/// comma-separated), which vLLM's `VideoMediaIO.load_base64` splits and opens with PIL one frame
/// each, then stacks. Those lines of vLLM run here on what mmgate sent (numpy and PIL from the
/// engine venv): the frames are the plan's, at the plan's size, and Qwen2-VL counts the planned
/// tokens of them.
fn a_planned_video_is_read_as_vllm_reads_a_frame_list(
    gateway: &Server,
    recorder: &Recorder,
    venv: &Path,
) {
    use base64::Engine as _;
    let clip = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/video/clips/h264.mp4");
    let data = base64::engine::general_purpose::STANDARD.encode(std::fs::read(clip).unwrap());
    let content = json!([{"type": "video_url", "video_url": {"url": format!("data:video/mp4;base64,{data}")}},
                         {"type": "text", "text": "What happens?"}]);
    let (status, _, reply) = post(
        gateway,
        &json!({"model": "planned-video", "max_tokens": 6, "messages": [{"role": "user", "content": content}]}),
    );
    assert!(status.is_success(), "{status}: {reply}");
    let account = &reply["usage"]["media"][0];
    let frames = account["frames"].as_u64().unwrap();
    let (width, height) = (
        account["resized_size"]["width"].as_u64().unwrap(),
        account["resized_size"]["height"].as_u64().unwrap(),
    );
    assert_eq!(
        account["tokens"].as_u64().unwrap(),
        frames / 2 * (width / 28) * (height / 28),
        "{account}"
    );
    let sent: Value =
        serde_json::from_slice(recorder.bodies.lock().unwrap().last().unwrap()).unwrap();
    let parts = sent["messages"][0]["content"].as_array().unwrap();
    let url = parts[0]["video_url"]["url"].as_str().unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let url_file = scratch.path().join("url");
    std::fs::write(&url_file, url).unwrap();
    let script = r#"
import base64, json, sys
from io import BytesIO
import numpy as np
from PIL import Image
url = open(sys.argv[1]).read()
media_type, data = url[len("data:"):].split(";base64,", 1)
assert media_type.lower() == "video/jpeg", media_type
# vllm/multimodal/media/video.py, VideoMediaIO.load_base64 for "video/jpeg": each comma-separated
# frame through ImageMediaIO (PIL, converted to RGB), stacked.
frames = np.stack([np.asarray(Image.open(BytesIO(base64.b64decode(f))).convert("RGB")) for f in data.split(",")])
print(json.dumps(list(frames.shape)))
"#;
    let out = Command::new(venv.join("bin/python"))
        .args(["-c", script, url_file.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let shape: Vec<u64> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(shape, [frames, height, width, 3]);
}
