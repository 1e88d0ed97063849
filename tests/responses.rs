//! The APIs that mean a chat completion without being one, end to end on the native demo models:
//! OpenAI's Responses API through OpenAI's own Python SDK (tests/fixtures/responses/sdk.py, from
//! the engine venv) for every kind of input, streamed and not, follow-ups, retrieval and deletion;
//! Anthropic's Messages API through Anthropic's SDK (tests/fixtures/messages/sdk.py), with
//! `count_tokens`; and the errors of each, in its own shape, over raw HTTP. The same scripts run
//! against vLLM behind mmgate in tests/vllm.rs.

use crate::common;

use std::path::Path;
use std::time::Duration;

use common::engine::engine_venv;
use common::server::Server;
use serde_json::{Value, json};

fn start(config: &str) -> (Server, tempfile::TempDir) {
    Server::with_config(config)
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
            "no image, video, audio or PDF",
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

#[test]
fn the_anthropic_sdk_runs_messages_and_counts_their_tokens_on_native_models() {
    let Some(venv) = engine_venv("bin/python") else {
        return;
    };
    let (server, _dir) = start("");
    let kinds = ["text", "image", "document", "pdf", "errors"];
    let lines = common::messages_sdk(&venv, &server.addr, "demo", &kinds);
    let line = |what: &str| lines.iter().find(|l| l["what"] == what).unwrap().clone();
    // The document whose bytes are a JPEG is that image, and the text beside it costs tokens.
    let (image, document) = (line("image"), line("document"));
    assert_eq!(document["media"][0]["kind"], "image", "{document}");
    assert!(document["counted"].as_u64() > Some(0), "{document}");
    assert_eq!(image["counted"], image["input_tokens"], "{image}");
    // A PDF is its three pages, counted before it is sent.
    let pdf = line("pdf");
    assert_eq!(pdf["counted"], pdf["input_tokens"], "{pdf}");
    assert_eq!(pdf["media"][0]["pages"], 3, "{pdf}");
    // Greedy, the answer's own words as a stop sequence end it there.
    assert!(
        lines.iter().any(|l| l["what"] == "stop_sequence"),
        "{lines:?}"
    );
    // The SDK's exception types came with Anthropic's error types.
    let refused: Vec<&Value> = lines.iter().filter(|l| l["what"] == "refused").collect();
    assert_eq!(refused[0]["type"], "not_found_error", "{refused:?}");
    assert!(
        refused[1..]
            .iter()
            .all(|l| l["type"] == "invalid_request_error"),
        "{refused:?}"
    );
}

/// A Messages request over raw HTTP: its status and JSON answer.
fn post_messages(
    server: &Server,
    path: &str,
    headers: &[(&str, &str)],
    body: &Value,
) -> (u16, Value) {
    let client = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap();
    let mut builder = client
        .post(format!("http://{}{path}", server.addr))
        .json(body);
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    let response = builder.send().unwrap();
    (
        response.status().as_u16(),
        response.json().unwrap_or(Value::Null),
    )
}

#[test]
fn messages_take_anthropic_keys_and_refuse_in_anthropic_shape() {
    let (server, _dir) = start("api_keys = [\"alice\"]\n");
    let hi =
        json!({"model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
    let anthropic = [("x-api-key", "alice"), ("anthropic-version", "2023-06-01")];
    let (status, message) = post_messages(&server, "/v1/messages", &anthropic, &hi);
    assert_eq!(status, 200, "{message}");
    assert_eq!(
        (message["type"].clone(), message["role"].clone()),
        (json!("message"), json!("assistant"))
    );
    assert!(
        message["usage"]["input_tokens"].as_u64() > Some(0),
        "{message}"
    );
    let (status, counted) = post_messages(&server, "/v1/messages/count_tokens", &anthropic, &hi);
    assert_eq!(
        (status, counted["input_tokens"].clone()),
        (200, message["usage"]["input_tokens"].clone())
    );
    // A Bearer key is as good; a wrong or missing one is Anthropic's authentication error.
    let bearer = [("authorization", "Bearer alice")];
    assert_eq!(post_messages(&server, "/v1/messages", &bearer, &hi).0, 200);
    for headers in [&[("x-api-key", "mallory")][..], &[][..]] {
        let (status, error) = post_messages(&server, "/v1/messages", headers, &hi);
        assert_eq!(status, 401, "{error}");
        assert_eq!(error["type"], "error");
        assert_eq!(error["error"]["type"], "authentication_error", "{error}");
    }
    let pdf = base64::Engine::encode(
        &base64::engine::general_purpose::STANDARD,
        b"%PDF-1.7\n1 0 obj\n",
    );
    let zip = base64::Engine::encode(
        &base64::engine::general_purpose::STANDARD,
        b"PK\x03\x04\x14\0\0\0\x08\0",
    );
    let user = |content: Value| json!({"model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": content}]});
    for (body, want, kind, said) in [
        (
            json!({"model": "demo", "messages": [{"role": "user", "content": "hi"}]}),
            400,
            "invalid_request_error",
            "max_tokens",
        ),
        (
            json!({"model": "nope", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
            404,
            "not_found_error",
            "nope",
        ),
        (
            json!({"model": "demo", "max_tokens": 2}),
            400,
            "invalid_request_error",
            "messages",
        ),
        (
            user(
                json!([{"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": pdf}}]),
            ),
            400,
            "invalid_request_error",
            "PDF",
        ),
        (
            user(
                json!([{"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": zip}}]),
            ),
            415,
            "invalid_request_error",
            "application/zip",
        ),
        (
            user(json!([{"type": "thinking", "thinking": "hm"}])),
            400,
            "invalid_request_error",
            "thinking",
        ),
        (
            user(
                json!([{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]),
            ),
            400,
            "invalid_request_error",
            "",
        ),
        (
            json!({"model": "demo-audio", "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "data:image/png;base64,AAAA"}}]}]}),
            415,
            "invalid_request_error",
            "does not take image",
        ),
    ] {
        let (status, error) = post_messages(&server, "/v1/messages", &anthropic, &body);
        assert_eq!(
            (status, error["type"].clone()),
            (want, json!("error")),
            "{body}: {error}"
        );
        assert_eq!(error["error"]["type"], kind, "{error}");
        assert!(
            error["error"]["message"].as_str().unwrap().contains(said),
            "{error}"
        );
    }
    // An unknown path under the API is its 404; other routes keep OpenAI's shape.
    let (status, error) = post_messages(&server, "/v1/messages/batches", &anthropic, &hi);
    assert_eq!(
        (status, error["error"]["type"].clone()),
        (404, json!("not_found_error"))
    );
    let (status, error) = post_messages(&server, "/v1/chat/completions", &[], &hi);
    assert_eq!(
        (status, error["error"]["code"].clone()),
        (401, json!("missing_api_key"))
    );
    // The model list says which APIs each model answers.
    let (_, models) = request(&server, "GET", "/v1/models", "alice", None);
    let apis = models["data"][0]["apis"].as_array().unwrap().clone();
    assert!(
        apis.contains(&json!("/v1/messages")) && apis.contains(&json!("/v1/messages/count_tokens"))
    );
    // Nothing above cost the server anything.
    assert_eq!(
        post_messages(&server, "/v1/messages", &anthropic, &hi).0,
        200
    );
    // Counted as chat is, under the route's own label.
    let metrics = reqwest::blocking::get(format!("http://{}/metrics", server.addr))
        .unwrap()
        .text()
        .unwrap();
    for series in [
        "mmgate_requests_total{path=\"/v1/messages\",route=\"native\",status=\"200\"}",
        "mmgate_requests_total{path=\"/v1/messages\",route=\"none\",status=\"415\"} 1",
        "mmgate_requests_total{path=\"/v1/messages/count_tokens\",route=\"none\",status=\"200\"} 1",
    ] {
        assert!(metrics.contains(series), "{series} in {metrics}");
    }
}
