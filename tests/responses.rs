//! OpenAI's Responses API end to end on the native demo models: the real `mmgate serve`, OpenAI's
//! own Python SDK (tests/fixtures/responses/sdk.py, from the engine venv) for every kind of input,
//! streamed and not, follow-ups, retrieval and deletion; and the errors, in the Responses shape,
//! over raw HTTP. The same script runs against vLLM behind mmgate in tests/vllm.rs.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::time::Duration;

use common::engine::engine_venv;
use common::server::Server;
use serde_json::{Value, json};

fn start(config: &str) -> (Server, tempfile::TempDir) {
    Server::with_config(config, &common::server::demo_cache())
}

fn request(
    server: &Server,
    method: &str,
    path: &str,
    key: &str,
    body: Option<&Value>,
) -> (u16, Value) {
    let client = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap();
    let url = format!("http://{}{path}", server.addr);
    let mut builder = match method {
        "POST" => client.post(url),
        "DELETE" => client.delete(url),
        _ => client.get(url),
    }
    .bearer_auth(key);
    if let Some(body) = body {
        builder = builder.json(body);
    }
    let response = builder.send().unwrap();
    (
        response.status().as_u16(),
        response.json().unwrap_or(Value::Null),
    )
}

#[test]
fn the_openai_sdk_runs_responses_with_every_medium_on_native_models() {
    let Some(venv) = engine_venv("bin/python") else {
        return;
    };
    let (server, _dir) = start("");
    let lines = common::responses_sdk(
        &venv,
        &server.addr,
        "demo",
        &["text", "image", "file", "video"],
    );
    assert!(lines.iter().any(|l| l["what"] == "video file"), "{lines:?}");
    let audio = common::responses_sdk(&venv, &server.addr, "demo-audio", &["audio"]);
    assert_eq!(audio[0]["media"][0]["kind"], "audio");
    // The image sent by data URL and by upload is one image: the same tokens either way.
    let tokens =
        |what: &str| lines.iter().find(|l| l["what"] == what).unwrap()["input_tokens"].clone();
    assert_eq!(tokens("image"), tokens("image by file_id"));
}

#[test]
fn responses_are_each_keys_own_and_bad_input_gets_a_clear_4xx() {
    let (server, _dir) = start("api_keys = [\"alice\", \"bob\"]\n");
    let ask = json!({"model": "demo", "input": "hi", "max_output_tokens": 2});
    let (status, answer) = request(&server, "POST", "/v1/responses", "alice", Some(&ask));
    assert_eq!(status, 200, "{answer}");
    let id = answer["id"].as_str().unwrap();
    let path = format!("/v1/responses/{id}");
    assert_eq!(request(&server, "GET", &path, "alice", None).0, 200);
    // Bob sees neither the response nor the conversation behind it.
    assert_eq!(request(&server, "GET", &path, "bob", None).0, 404);
    assert_eq!(request(&server, "DELETE", &path, "bob", None).0, 404);
    let follow = json!({"model": "demo", "input": "more", "previous_response_id": id});
    let (status, error) = request(&server, "POST", "/v1/responses", "bob", Some(&follow));
    assert_eq!(
        (status, error["error"]["param"].clone()),
        (404, json!("previous_response_id"))
    );

    let png = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/image/images/png-rgb-wide.png"),
    )
    .unwrap();
    let text_file = base64::Engine::encode(
        &base64::engine::general_purpose::STANDARD,
        b"just some text, no medium",
    );
    let truncated = base64::Engine::encode(&base64::engine::general_purpose::STANDARD, &png[..64]);
    let part =
        |part: Value| json!({"model": "demo", "input": [{"role": "user", "content": [part]}]});
    for (body, want, said) in [
        (json!({"model": "demo"}), 400, "input"),
        (
            json!({"model": "nope", "input": "hi"}),
            404,
            "does not exist",
        ),
        (
            part(json!({"type": "input_video"})),
            400,
            "input_text, input_image",
        ),
        (
            part(json!({"type": "input_file", "file_data": text_file})),
            400,
            "no image, video or audio",
        ),
        (
            part(
                json!({"type": "input_file", "file_data": format!("data:image/png;base64,{truncated}")}),
            ),
            400,
            "",
        ),
        (
            part(json!({"type": "input_image", "file_id": "file-missing"})),
            404,
            "",
        ),
        (
            json!({"model": "demo-audio", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}),
            415,
            "does not take image",
        ),
        (
            json!({"model": "demo", "input": [{"type": "function_call", "name": "f"}]}),
            400,
            "only messages",
        ),
    ] {
        let (status, error) = request(&server, "POST", "/v1/responses", "alice", Some(&body));
        assert_eq!(status, want, "{body}: {error}");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains(said), "{message}");
        assert_ne!(error["error"]["param"], "messages", "{error}");
    }
    // Nothing above cost the server anything: it answers, and the kept response is still there.
    assert_eq!(
        request(&server, "POST", "/v1/responses", "alice", Some(&ask)).0,
        200
    );
    assert_eq!(request(&server, "DELETE", &path, "alice", None).0, 200);
    assert_eq!(request(&server, "GET", &path, "alice", None).0, 404);
    let (_, models) = request(&server, "GET", "/v1/models", "alice", None);
    assert_eq!(models["data"][0]["responses"], "native");
}
