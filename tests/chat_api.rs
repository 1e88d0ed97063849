//! The OpenAI chat API end to end: the real `mmgate serve` on the demo models, real HTTP over
//! loopback, media as data URLs, uploads and http URLs from a local server; another real mmgate as
//! the upstream of a proxied model.

use crate::common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use base64::Engine as _;
use common::files_server::{Answer, FilesServer};
use common::fixture;
use common::server::Server;
use serde_json::{Value, json};

fn data_url(mime: &str, bytes: &[u8]) -> String {
    format!(
        "data:{mime};base64,{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

fn start(config: &str) -> (Server, tempfile::TempDir) {
    Server::with_config(config)
}

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap()
}

fn post(server: &Server, path: &str, body: &Value) -> (u16, Value) {
    let response = client()
        .post(format!("http://{}{path}", server.addr))
        .json(body)
        .send()
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().unwrap())
}

fn get(server: &Server, path: &str) -> (u16, Value) {
    let response = client()
        .get(format!("http://{}{path}", server.addr))
        .send()
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().unwrap())
}

/// The server's `/metrics` page.
fn metrics(server: &Server) -> String {
    client()
        .get(format!("http://{}/metrics", server.addr))
        .send()
        .unwrap()
        .text()
        .unwrap()
}

fn chat(model: &str, content: Value) -> Value {
    json!({
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 6,
        "temperature": 0,
    })
}

fn image_part(url: &str) -> Value {
    json!({"type": "image_url", "image_url": {"url": url}})
}

/// The plan `POST /v1/preprocess` makes for `media` with the demo model's processor config.
fn planned_tokens(server: &Server, media: &str, model_dir: &Path) -> u64 {
    let config: Value =
        serde_json::from_slice(&std::fs::read(model_dir.join("preprocessor_config.json")).unwrap())
            .unwrap();
    let (status, body) = post(
        server,
        "/v1/preprocess",
        &json!({"media": media, "processor_config": config}),
    );
    assert_eq!(status, 200, "{body}");
    body["tokens"].as_u64().unwrap()
}

/// A PNG and a WAV fixture, and the test media server's routes serving them as `/cat.png` and
/// `/speech.wav`.
fn media_routes() -> (Vec<u8>, Vec<u8>, HashMap<String, Answer>) {
    let png = fixture("image/images/png-rgb-wide.png");
    let wav = fixture("audio/clips/speech-16k-s16.wav");
    let mut routes = HashMap::new();
    for (path, content_type, data) in [
        ("/cat.png", "image/png", &png),
        ("/speech.wav", "audio/wav", &wav),
    ] {
        let data = data.clone();
        let content_type = content_type.into();
        routes.insert(path.to_owned(), Answer::Body { content_type, data });
    }
    (png, wav, routes)
}

/// `POST /v1/files` of `bytes` named `name`; the store's answer.
fn upload(server: &Server, name: &str, bytes: Vec<u8>) -> Value {
    let form = reqwest::blocking::multipart::Form::new()
        .text("purpose", "vision")
        .part(
            "file",
            reqwest::blocking::multipart::Part::bytes(bytes).file_name(name.to_owned()),
        );
    client()
        .post(format!("http://{}/v1/files", server.addr))
        .multipart(form)
        .send()
        .unwrap()
        .json()
        .unwrap()
}

#[test]
fn images_and_audio_by_data_url_upload_and_http_url_cost_what_their_plugins_planned() {
    let (png, wav, mut routes) = media_routes();
    routes.insert("/moved.png".to_owned(), Answer::Redirect("/cat.png".into()));
    let files = FilesServer::start(routes);
    let (server, _dir) = start("[fetch]\nallow = [\"127.0.0.1/32\"]\n");

    let image = data_url("image/png", &png);
    let planned = planned_tokens(&server, &image, &common::demo_model_dir("demo-qwen2-vl"));
    let mut usages = Vec::new();
    for source in [
        image.clone(),
        format!("{}/cat.png", files.base),
        format!("{}/moved.png", files.base),
    ] {
        let (status, body) = post(
            &server,
            "/v1/chat/completions",
            &chat(
                "demo",
                json!([image_part(&source), {"type": "text", "text": "What is it?"}]),
            ),
        );
        assert_eq!(status, 200, "{source}: {body}");
        assert_eq!(body["object"], "chat.completion");
        assert_eq!(body["choices"][0]["message"]["role"], "assistant");
        let media = &body["usage"]["media"][0];
        assert_eq!(media["kind"], "image");
        assert_eq!(media["tokens"].as_u64(), Some(planned), "{body}");
        usages.push(body["usage"]["prompt_tokens"].clone());
    }
    // The same image, however it came, makes the same prompt.
    assert!(usages.windows(2).all(|w| w[0] == w[1]), "{usages:?}");

    // An upload, referenced by file id.
    let uploaded = upload(&server, "cat.png", png.clone());
    let id = uploaded["id"].as_str().unwrap().to_owned();
    assert_eq!(uploaded["bytes"].as_u64(), Some(png.len() as u64));
    let by_file = chat(
        "demo",
        json!([{"type": "file", "file": {"file_id": id}}, {"type": "text", "text": "What is it?"}]),
    );
    let (status, body) = post(&server, "/v1/chat/completions", &by_file);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["media"][0]["tokens"].as_u64(), Some(planned));
    assert_eq!(body["usage"]["prompt_tokens"], usages[0]);
    let (status, listed) = get(&server, "/v1/files");
    assert_eq!(status, 200);
    assert_eq!(listed["data"][0]["id"].as_str(), Some(id.as_str()));
    let deleted: Value = client()
        .delete(format!("http://{}/v1/files/{id}", server.addr))
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(deleted["deleted"], true);
    let (status, body) = post(&server, "/v1/chat/completions", &by_file);
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (404, Some("file_not_found"))
    );

    // Audio: input_audio (base64) and audio_url (fetched) on the audio demo model.
    let wav_url = data_url("audio/wav", &wav);
    let planned = planned_tokens(
        &server,
        &wav_url,
        &common::demo_model_dir("demo-qwen2-audio"),
    );
    for part in [
        json!({"type": "input_audio", "input_audio": {"data": base64::engine::general_purpose::STANDARD.encode(&wav), "format": "wav"}}),
        json!({"type": "audio_url", "audio_url": {"url": format!("{}/speech.wav", files.base)}}),
    ] {
        let (status, body) = post(
            &server,
            "/v1/chat/completions",
            &chat(
                "demo-audio",
                json!([part, {"type": "text", "text": "What was said?"}]),
            ),
        );
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["usage"]["media"][0]["kind"], "audio");
        assert_eq!(
            body["usage"]["media"][0]["tokens"].as_u64(),
            Some(planned),
            "{body}"
        );
    }

    // The encoders' work is in the metrics: the same image four times was encoded once (the
    // feature cache served the rest), the same audio twice once.
    let metrics = metrics(&server);
    for (model, encoder) in [("demo", "vision"), ("demo-audio", "audio")] {
        let labels = format!("{{model=\"{model}\",device=\"{model}-enc0\",encoder=\"{encoder}\"}}");
        for (metric, value) in [
            ("mmgate_encoded_items_total", 1),
            ("mmgate_encode_failures_total", 0),
            ("mmgate_encode_duration_seconds_count", 1),
        ] {
            let line = format!("{metric}{labels} {value}");
            assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");
        }
    }
}

/// The text of an SSE chat stream, its usage chunk, and whether it ended with `[DONE]`.
#[test]
fn a_video_by_data_url_and_by_http_url_costs_what_its_plugin_planned() {
    let mp4 = fixture("video/clips/h264.mp4");
    let mut routes = HashMap::new();
    routes.insert(
        "/clip.mp4".to_owned(),
        Answer::Body {
            content_type: "video/mp4".into(),
            data: mp4.clone(),
        },
    );
    let files = FilesServer::start(routes);
    let (server, _dir) = start("[fetch]\nallow = [\"127.0.0.1/32\"]\n");
    let video = data_url("video/mp4", &mp4);
    let planned = planned_tokens(&server, &video, &common::demo_model_dir("demo-qwen2-vl"));
    for source in [video.clone(), format!("{}/clip.mp4", files.base)] {
        let (status, body) = post(
            &server,
            "/v1/chat/completions",
            &chat(
                "demo",
                json!([
                    {"type": "video_url", "video_url": {"url": source}},
                    {"type": "text", "text": "Describe the video."}
                ]),
            ),
        );
        assert_eq!(status, 200, "{body}");
        let media = &body["usage"]["media"][0];
        assert_eq!(media["kind"], "video", "{body}");
        assert_eq!(media["plugin"]["name"], "video", "{body}");
        assert_eq!(media["tokens"].as_u64(), Some(planned), "{body}");
        assert!(body["usage"]["prompt_tokens"].as_u64().unwrap() > planned);
    }
    // A video to the audio model, and a corrupt one: clear 4xx, and the server goes on.
    let (status, body) = post(
        &server,
        "/v1/chat/completions",
        &chat(
            "demo-audio",
            json!([{"type": "video_url", "video_url": {"url": video}}]),
        ),
    );
    assert!((400..500).contains(&status), "{status} {body}");
    let mut broken = mp4.clone();
    broken.truncate(3_000);
    let (status, body) = post(
        &server,
        "/v1/chat/completions",
        &chat(
            "demo",
            json!([{"type": "video_url", "video_url": {"url": data_url("video/mp4", &broken)}}]),
        ),
    );
    assert!((400..500).contains(&status), "{status} {body}");
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    let (status, _) = post(
        &server,
        "/v1/chat/completions",
        &chat("demo", json!([{"type": "text", "text": "still there?"}])),
    );
    assert_eq!(status, 200);
}

fn read_stream(server: &Server, body: &Value) -> (String, Value, bool) {
    let response = client()
        .post(format!("http://{}/v1/chat/completions", server.addr))
        .json(body)
        .send()
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    assert!(
        response.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let text = response.text().unwrap();
    let (mut content, mut usage, mut done) = (String::new(), Value::Null, false);
    for event in text.split("\n\n").filter(|e| !e.is_empty()) {
        let data = event.strip_prefix("data: ").expect(event);
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let chunk: Value = serde_json::from_str(data).unwrap();
        assert_eq!(chunk["object"], "chat.completion.chunk", "{chunk}");
        if let Some(delta) = chunk["choices"][0]["delta"]["content"].as_str() {
            content.push_str(delta);
        }
        if !chunk["usage"].is_null() {
            usage = chunk["usage"].clone();
        }
    }
    (content, usage, done)
}

#[test]
fn streaming_and_non_streaming_agree_under_a_seed() {
    let (server, _dir) = start("");
    let png = fixture("image/images/png-rgb-wide.png");
    let mut request = json!({
        "model": "demo",
        "messages": [
            {"role": "system", "content": "You describe pictures."},
            {"role": "user", "content": [image_part(&data_url("image/png", &png)), {"type": "text", "text": "Describe it."}]},
        ],
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 1234,
    });
    let (status, whole) = post(&server, "/v1/chat/completions", &request);
    assert_eq!(status, 200, "{whole}");
    request["stream"] = json!(true);
    request["stream_options"] = json!({"include_usage": true});
    let (streamed, usage, done) = read_stream(&server, &request);
    assert!(done);
    assert_eq!(
        whole["choices"][0]["message"]["content"].as_str(),
        Some(streamed.as_str())
    );
    // Everything but the plugin's time agrees.
    let without_time = |usage: &Value| {
        let mut usage = usage.clone();
        for item in usage["media"].as_array_mut().unwrap() {
            item.as_object_mut().unwrap().remove("plugin_ms");
        }
        usage
    };
    assert_eq!(without_time(&whole["usage"]), without_time(&usage));

    // Another seed samples something else (12 tokens from a near-uniform demo model).
    request["seed"] = json!(99);
    let (other, _, _) = read_stream(&server, &request);
    assert_ne!(other, streamed);
}

#[test]
fn bad_requests_get_clear_4xx_errors_and_the_server_keeps_serving() {
    let config = "\
api_keys = [\"sk-test\"]
[limits]
max_image_bytes = 100000
[fetch]
allow = []
";
    let (server, _dir) = start(config);
    let url = format!("http://{}/v1/chat/completions", server.addr);
    let send = |body: &str, key: Option<&str>| {
        let mut request = client().post(&url).body(body.to_owned());
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        let response = request.send().unwrap();
        let status = response.status().as_u16();
        let body: Value = response.json().unwrap();
        (
            status,
            body["error"]["code"].as_str().unwrap_or("").to_owned(),
        )
    };
    let ok = chat("demo", json!("Hello")).to_string();
    assert_eq!(send(&ok, None), (401, "missing_api_key".into()));
    assert_eq!(send(&ok, Some("sk-wrong")), (401, "invalid_api_key".into()));

    let big_png = fixture("image/images/photo-640x480.jpg");
    assert!(big_png.len() > 100_000);
    let truncated = fixture("image/bad/truncated.jpg");
    let cases: Vec<(String, u16, &str)> = vec![
        ("{\"model\": \"demo\", \"messages\": [".into(), 400, "invalid_request"),
        (chat("no-such-model", json!("hi")).to_string(), 404, "model_not_found"),
        (chat("demo", json!([{"type": "hologram", "hologram": {}}])).to_string(), 400, "invalid_request"),
        (chat("demo", json!([image_part(&data_url("image/jpeg", &big_png))])).to_string(), 413, "media_too_large"),
        (chat("demo", json!([image_part(&data_url("image/jpeg", &truncated))])).to_string(), 400, "invalid_media"),
        (chat("demo", json!([image_part("data:image/png;base64,@@@@")])).to_string(), 400, "invalid_media_url"),
        (chat("demo", json!([image_part(&data_url("text/plain", b"just text, no image"))])).to_string(), 415, "unsupported_media"),
        (chat("demo-audio", json!([image_part(&data_url("image/png", &fixture("image/images/bmp-palette.bmp")))])).to_string(), 415, "unsupported_media"),
        (json!({"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000000}).to_string(), 400, "context_length_exceeded"),
        (json!({"model": "demo", "messages": [{"role": "user", "content": "hi"}], "temperature": 7}).to_string(), 400, "invalid_request"),
    ];
    for (body, status, code) in &cases {
        assert_eq!(
            send(body, Some("sk-test")),
            (*status, code.to_string()),
            "{}",
            &body[..body.len().min(200)]
        );
    }
    // The SSRF guard: loopback, private, link-local, unspecified and mapped forms are never fetched.
    for target in [
        "http://127.0.0.1:9/x.png",
        "http://localhost:9/x.png",
        "http://10.0.0.1/x.png",
        "http://192.168.0.1/x.png",
        "http://169.254.169.254/latest/meta-data",
        "http://0.0.0.0/x.png",
        "http://[::1]/x.png",
        "http://[::ffff:127.0.0.1]/x.png",
        "http://[fe80::1]/x.png",
        "file:///etc/passwd",
    ] {
        let (status, code) = send(
            &chat("demo", json!([image_part(target)])).to_string(),
            Some("sk-test"),
        );
        assert_eq!(status, 400, "{target}");
        assert!(
            code == "media_url_forbidden" || code == "media_fetch_failed",
            "{target}: {code}"
        );
        if !target.starts_with("file:") {
            assert_eq!(code, "media_url_forbidden", "{target}");
        }
    }
    // Still serving, and serving well.
    let (status, _) = send(&ok, Some("sk-test"));
    assert_eq!(status, 200);
    let metrics = metrics(&server);
    assert!(
        metrics.contains(
            "mmgate_requests_total{path=\"/v1/chat/completions\",route=\"native\",status=\"413\"} 1"
        ),
        "{metrics}"
    );
}

#[test]
fn a_redirect_to_a_private_address_is_refused() {
    let mut routes = HashMap::new();
    routes.insert(
        "/r".to_owned(),
        Answer::Redirect("http://10.1.2.3/x.png".into()),
    );
    routes.insert(
        "/l".to_owned(),
        Answer::Redirect("http://localhost:1/x.png".into()),
    );
    let files = FilesServer::start(routes);
    let (server, _dir) = start("[fetch]\nallow = [\"127.0.0.1/32\"]\n");
    for path in ["/r", "/l"] {
        let (status, body) = post(
            &server,
            "/v1/chat/completions",
            &chat(
                "demo",
                json!([image_part(&format!("{}{path}", files.base))]),
            ),
        );
        // localhost resolves to 127.0.0.1 (allowed) and ::1 (not); port 1 refuses either way.
        let code = body["error"]["code"].as_str().unwrap_or("");
        assert_eq!(status, 400, "{body}");
        if path == "/r" {
            assert_eq!(code, "media_url_forbidden", "{body}");
        }
    }
}

fn chat_requests_served(server: &Server) -> u64 {
    let text = metrics(server);
    text.lines()
        .filter(|l| l.starts_with("mmgate_requests_total{path=\"/v1/chat/completions\",route=\"native\",status=\"200\"}"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

#[test]
fn an_upstream_pool_balances_passes_streams_through_and_ejects_a_dead_server() {
    let (mut first, _d1) = start("");
    let (second, _d2) = start("");
    let config = format!(
        "models = [{{ name = \"demo\", upstreams = [\"{}\", \"{}\"], health_check = {{ path = \"/health\", interval_ms = 200 }} }}]\n",
        first.addr, second.addr
    );
    let (front, _d3) = start(&config);
    let (status, models) = get(&front, "/v1/models");
    assert_eq!(status, 200);
    assert_eq!(models["data"][0]["served_by"], "upstream");

    let request = chat("demo", json!("Hello"));
    for _ in 0..4 {
        let (status, body) = post(&front, "/v1/chat/completions", &request);
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["model"], "demo");
    }
    assert_eq!(
        (chat_requests_served(&first), chat_requests_served(&second)),
        (2, 2)
    );

    // Streams pass through unchanged, [DONE] included.
    let mut streaming = request.clone();
    streaming["stream"] = json!(true);
    let (_, _, done) = read_stream(&front, &streaming);
    assert!(done);

    // The first upstream dies: the health check takes it out of rotation, the survivor serves all.
    first.child.kill().unwrap();
    first.child.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, models) = get(&front, "/v1/models");
        let servers = models["data"][0]["upstreams"].as_array().unwrap().clone();
        if servers
            .iter()
            .any(|s| s["address"] == first.addr.as_str() && s["healthy"] == false)
        {
            break;
        }
        assert!(Instant::now() < deadline, "never ejected: {servers:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let before = chat_requests_served(&second);
    for _ in 0..4 {
        let (status, body) = post(&front, "/v1/chat/completions", &request);
        assert_eq!(status, 200, "{body}");
    }
    assert_eq!(chat_requests_served(&second), before + 4);
}

/// Media a request to an upstream model points at are fetched and read by the front, through its
/// SSRF guard and limits, and go upstream as data URLs: the upstream (with fetching off) answers an
/// image URL and an upload exactly as it answers the image itself; a URL the front's guard refuses
/// never reaches the upstream; an upload that is not media is refused.
#[test]
fn urls_and_uploads_for_an_upstream_model_are_fetched_here_and_sent_as_data() {
    let (png, wav, routes) = media_routes();
    let files = FilesServer::start(routes);
    // The upstream fetches nothing itself.
    let (back, _d1) = start("[fetch]\nenabled = false\n");
    let (front, _d2) = start(&format!(
        "models = [{{ name = \"demo\", upstreams = [\"{0}\"] }}, {{ name = \"demo-audio\", upstreams = [\"{0}\"] }}]\n\
         [fetch]\nallow = [\"127.0.0.1/32\"]\n",
        back.addr
    ));
    let (guarded, _d3) = start(&format!(
        "models = [{{ name = \"demo\", upstreams = [\"{}\"] }}]\n",
        back.addr
    ));
    let ask = |server: &Server, model: &str, part: Value| {
        post(
            server,
            "/v1/chat/completions",
            &chat(
                model,
                json!([part, {"type": "text", "text": "What is it?"}]),
            ),
        )
    };

    // The usage of a request, less the one figure that is a timing.
    let usage = |body: &Value| {
        let mut usage = body["usage"].clone();
        for item in usage["media"].as_array_mut().unwrap() {
            item.as_object_mut().unwrap().remove("plugin_ms");
        }
        usage
    };
    let (status, direct) = ask(&back, "demo", image_part(&data_url("image/png", &png)));
    assert_eq!(status, 200, "{direct}");
    let upload = |server: &Server, name: &str, bytes: Vec<u8>| -> String {
        upload(server, name, bytes)["id"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let png_id = upload(&front, "cat.png", png.clone());
    // A file given inline, as OpenAI's SDK sends one (a data URL, or bare base64 under a name that
    // says nothing of it), is what its bytes are, natively and through the front alike.
    let png_b64 = base64::engine::general_purpose::STANDARD.encode(&png);
    let inline_files = [
        json!({"type": "file", "file": {"file_data": data_url("image/png", &png), "filename": "cat.png"}}),
        json!({"type": "file", "file": {"file_data": png_b64, "filename": "cat.bin"}}),
    ];
    for part in &inline_files {
        let (status, body) = ask(&back, "demo", part.clone());
        assert_eq!(status, 200, "{body}");
        assert_eq!(usage(&body), usage(&direct), "natively: {part}");
    }
    for part in [
        image_part(&format!("{}/cat.png", files.base)),
        json!({"type": "file", "file": {"file_id": png_id}}),
        inline_files[0].clone(),
        inline_files[1].clone(),
    ] {
        let (status, body) = ask(&front, "demo", part.clone());
        assert_eq!(status, 200, "{part}: {body}");
        assert_eq!(usage(&body), usage(&direct), "{part}");
        assert_eq!(
            body["choices"][0]["message"],
            direct["choices"][0]["message"]
        );
    }
    // Audio too: an audio_url and an uploaded clip, against the clip sent as input_audio.
    let input_audio = json!({"type": "input_audio", "input_audio": {
        "data": base64::engine::general_purpose::STANDARD.encode(&wav), "format": "wav"}});
    let (status, direct) = ask(&back, "demo-audio", input_audio);
    assert_eq!(status, 200, "{direct}");
    let wav_id = upload(&front, "speech.wav", wav.clone());
    for part in [
        json!({"type": "audio_url", "audio_url": {"url": format!("{}/speech.wav", files.base)}}),
        json!({"type": "file", "file": {"file_id": wav_id}}),
    ] {
        let (status, body) = ask(&front, "demo-audio", part.clone());
        assert_eq!(status, 200, "{part}: {body}");
        assert_eq!(usage(&body), usage(&direct), "{part}");
    }

    // The front's SSRF guard (loopback is not allow-listed there) stands before the upstream.
    let before = chat_requests_served(&back);
    let (status, body) = ask(
        &guarded,
        "demo",
        image_part(&format!("{}/cat.png", files.base)),
    );
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (400, Some("media_url_forbidden")),
        "{body}"
    );
    let (status, body) = ask(
        &guarded,
        "demo",
        json!({"type": "file", "file": {"file_id": "file-nope"}}),
    );
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (404, Some("file_not_found"))
    );
    let (status, body) = ask(
        &guarded,
        "demo",
        json!({"type": "image_embeds", "image_embeds": "UEsDBA=="}),
    );
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (400, Some("image_embeds_not_accepted")),
        "{body}"
    );
    // A file part needs its file, once; a broken PDF is what its plugin says it is.
    for (file, want, code) in [
        (json!({"filename": "a.png"}), 400, "invalid_request"),
        (
            json!({"file_id": "file-1", "file_data": png_b64}),
            400,
            "invalid_request",
        ),
        (
            json!({"file_data": base64::engine::general_purpose::STANDARD.encode(b"%PDF-1.7\n%\xe2\xe3\n")}),
            400,
            "invalid_media",
        ),
    ] {
        for (server, model) in [(&guarded, "demo"), (&back, "demo")] {
            let (status, body) = ask(server, model, json!({"type": "file", "file": file}));
            assert_eq!(
                (status, body["error"]["code"].as_str()),
                (want, Some(code)),
                "{file}: {body}"
            );
        }
    }
    let text_id = upload(&guarded, "notes.txt", b"plain text, not media".to_vec());
    let (status, body) = ask(
        &guarded,
        "demo",
        json!({"type": "file", "file": {"file_id": text_id}}),
    );
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (415, Some("unsupported_media")),
        "{body}"
    );
    assert_eq!(
        chat_requests_served(&back),
        before,
        "a refused request went upstream"
    );
}

/// A test CA and a server certificate it signed for `localhost`, written into `dir`:
/// (ca.pem's text, cert.pem, key.pem).
fn test_ca(dir: &Path) -> (String, PathBuf, PathBuf) {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "mmgate test CA");
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["localhost".to_owned()])
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    let (cert_path, key_path) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert_path, cert.pem()).unwrap();
    std::fs::write(&key_path, key.serialize_pem()).unwrap();
    std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
    (ca.pem(), cert_path, key_path)
}

/// An upstream reached over HTTPS: a real mmgate serving TLS with a certificate from a private CA
/// and an API key of its own. The front verifies the certificate against the configured CA and the
/// server's name (a wrong name, or the system's roots alone, fail the handshake and the health check
/// ejects the server), sends the upstream's key in place of the client's, and never passes on a key
/// meant for itself. Answers and streams come through as the upstream gives them.
#[test]
fn an_https_upstream_is_verified_and_gets_its_own_key_never_the_gateways() {
    let certs = tempfile::tempdir().unwrap();
    let (ca_pem, cert, key) = test_ca(certs.path());
    let ca = certs.path().join("ca.pem");
    let back_config = format!(
        "api_keys = [\"sk-upstream\"]\n[tls]\ncert = {:?}\nkey = {:?}\n",
        cert.to_str().unwrap(),
        key.to_str().unwrap()
    );
    let back_dir = tempfile::tempdir().unwrap();
    let back_path = back_dir.path().join("mmgate.toml");
    std::fs::write(&back_path, back_config).unwrap();
    let back = Server::start_tls_with_env(&["--config", back_path.to_str().unwrap()], &[], &ca_pem);
    let port = back.addr.rsplit(':').next().unwrap();
    let check = "health_check = { path = \"/health\", interval_ms = 200 }";
    let ca = ca.to_str().unwrap();
    let front_config = format!(
        "api_keys = [\"sk-front\"]\nmodels = [\n\
         {{ name = \"demo\", upstreams = [\"https://localhost:{port}\"], upstream_api_key = \"sk-upstream\", upstream_ca_file = {ca:?}, {check} }},\n\
         {{ name = \"no-upstream-key\", upstreams = [\"https://localhost:{port}\"], upstream_ca_file = {ca:?}, {check} }},\n\
         {{ name = \"wrong-name\", upstreams = [\"https://127.0.0.1:{port}\"], upstream_ca_file = {ca:?}, {check} }},\n\
         {{ name = \"system-roots\", upstreams = [\"https://localhost:{port}\"], {check} }},\n]\n"
    );
    let (front, _d) = start(&front_config);
    let send = |model: &str, stream: bool| {
        let mut body = chat(model, json!("Hello"));
        body["stream"] = json!(stream);
        let response = client()
            .post(format!("http://{}/v1/chat/completions", front.addr))
            .bearer_auth("sk-front")
            .json(&body)
            .send()
            .unwrap();
        (response.status().as_u16(), response.text().unwrap())
    };

    // The answer over TLS is the upstream's own (asked directly, with its key).
    let direct = reqwest::blocking::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(ca_pem.as_bytes()).unwrap())
        .build()
        .unwrap()
        .post(format!("https://localhost:{port}/v1/chat/completions"))
        .bearer_auth("sk-upstream")
        .json(&chat("demo", json!("Hello")))
        .send()
        .unwrap();
    assert_eq!(direct.status().as_u16(), 200);
    let direct: Value = direct.json().unwrap();
    let (status, body) = send("demo", false);
    assert_eq!(status, 200, "{body}");
    let proxied: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        proxied["choices"][0]["message"],
        direct["choices"][0]["message"]
    );
    let (status, body) = send("demo", true);
    assert_eq!(status, 200, "{body}");
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");

    // The client's key was for this gateway: the upstream gets none and refuses.
    let (status, body) = send("no-upstream-key", false);
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("missing_api_key"), "{body}");

    // Certificates that do not verify: no request reaches the upstream, and the checks eject it.
    for model in ["wrong-name", "system-roots"] {
        let (status, body) = send(model, false);
        assert_eq!(status, 502, "{model}: {body}");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let models: Value = client()
                .get(format!("http://{}/v1/models", front.addr))
                .bearer_auth("sk-front")
                .send()
                .unwrap()
                .json()
                .unwrap();
            let entry = models["data"]
                .as_array()
                .unwrap()
                .iter()
                .find(|m| m["id"] == model)
                .unwrap()
                .clone();
            if entry["upstreams"][0]["healthy"] == false {
                break;
            }
            assert!(Instant::now() < deadline, "never ejected: {entry}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    // The verified model is still in rotation and serving.
    let (status, body) = send("demo", false);
    assert_eq!(status, 200, "{body}");
}

/// A model whose LLM runs upstream while its images are encoded here: the front mmgate (given the
/// model's directory) preprocesses, budgets and encodes the image and sends vLLM-style `image_embeds`;
/// the upstream (another mmgate) merges them without a plugin or an encoder. The answer is the one
/// the upstream gives the image itself, token for token.
#[test]
fn images_encoded_in_front_and_sent_upstream_as_embeddings_answer_as_the_image_does() {
    // The upstream takes embeddings from its front (clients' are refused by default).
    let (back, _d1) =
        start("models = [{ name = \"demo\", path = \"demo\", accept_image_embeds = true }]\n");
    let config = format!(
        "models = [{{ name = \"demo\", path = \"demo\", upstreams = [\"{}\"] }}]\n",
        back.addr
    );
    let (front, _d2) = start(&config);
    let (_, models) = get(&front, "/v1/models");
    assert_eq!(models["data"][0]["served_by"], "upstream");
    assert_eq!(models["data"][0]["images_encoded_here"], true);
    // Its encoder devices' queue is a gauge like a native model's.
    let metrics = metrics(&front);
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("mmgate_encoder_queue{model=\"demo\"} ")),
        "{metrics}"
    );

    let png = fixture("image/images/png-rgb-wide.png");
    let mut request = chat(
        "demo",
        json!([
            {"type": "text", "text": "What is in this picture?"},
            image_part(&data_url("image/png", &png)),
        ]),
    );
    // Sampled under a seed, many tokens: the draws follow the whole distribution, so embeddings
    // that differ at all show (greedy tokens of the small demo model can hide a change).
    request["temperature"] = json!(1.0);
    request["seed"] = json!(7);
    request["max_tokens"] = json!(32);
    let (status, direct) = post(&back, "/v1/chat/completions", &request);
    assert_eq!(status, 200, "{direct}");
    let response = client()
        .post(format!("http://{}/v1/chat/completions", front.addr))
        .json(&request)
        .send()
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    // The front's own account of the image (what its plugin chose) comes in a header.
    let accounts: Value =
        serde_json::from_str(response.headers()["x-mmgate-media"].to_str().unwrap()).unwrap();
    // And the prompt it promised the upstream, as in `preprocess` mode.
    let promised: u64 = response.headers()["x-mmgate-prompt-tokens"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let fronted: Value = response.json().unwrap();
    assert_eq!(fronted["usage"]["prompt_tokens"], promised, "{fronted}");
    let text = |body: &Value| body["choices"][0]["message"]["content"].clone();
    assert_eq!(text(&fronted), text(&direct));
    assert_eq!(
        fronted["usage"]["prompt_tokens"],
        direct["usage"]["prompt_tokens"]
    );
    let (direct_item, fronted_item) = (&direct["usage"]["media"][0], &fronted["usage"]["media"][0]);
    assert_eq!(fronted_item["source"], "image_embeds", "{fronted}");
    assert!(fronted_item.get("plugin").is_none());
    assert_eq!(fronted_item["tokens"], direct_item["tokens"]);
    for field in ["tokens", "original_size", "resized_size", "plugin"] {
        assert_eq!(
            accounts[0][field], direct_item[field],
            "{field}: {accounts}"
        );
    }

    // Streams go through the front the same way.
    let mut streaming = request.clone();
    streaming["stream"] = json!(true);
    let (streamed, _, done) = read_stream(&front, &streaming);
    assert!(done);
    assert_eq!(json!(streamed), text(&direct));

    // Text-only requests still go upstream untouched.
    let (status, body) = post(
        &front,
        "/v1/chat/completions",
        &chat("demo", json!("Hello")),
    );
    assert_eq!(status, 200, "{body}");

    // Embeddings that do not fit the model are the client's error, and the server goes on.
    let b64 = |bytes: &[u8]| base64::engine::general_purpose::STANDARD.encode(bytes);
    let narrow = b64(&fixture("torch/torch_f32_2x3.pt"));
    let grid = b64(&fixture("torch/torch_i64_grid.pt"));
    for (part, says) in [
        (
            json!({"type": "image_embeds", "image_embeds": {"image_embeds": narrow, "image_grid_thw": grid}}),
            "wide",
        ),
        (
            json!({"type": "image_embeds", "image_embeds": narrow}),
            "image_grid_thw",
        ),
        (
            json!({"type": "image_embeds", "image_embeds": {"image_embeds": "aGk=", "image_grid_thw": grid}}),
            "torch.save",
        ),
    ] {
        let (status, body) = post(&back, "/v1/chat/completions", &chat("demo", json!([part])));
        assert_eq!(status, 400, "{body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{message}");
    }
    let (status, body) = post(&back, "/v1/chat/completions", &request);
    assert_eq!((status, text(&body)), (200, text(&direct)));

    // The front does not take a client's embeddings: that is the upstream's setting, not its own.
    let part = json!({"type": "image_embeds", "image_embeds": {"image_embeds": narrow, "image_grid_thw": grid}});
    let (status, body) = post(&front, "/v1/chat/completions", &chat("demo", json!([part])));
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (400, Some("image_embeds_not_accepted")),
        "{body}"
    );
}

/// A plugin directory holding the test plugin, which serves `image` parts sent as
/// `application/x-mmgate-test` (nothing else takes that type).
fn testing_plugin_dir(parent: &Path) -> PathBuf {
    use sha2::{Digest, Sha256};
    let dir = parent.join("plugins");
    std::fs::create_dir_all(&dir).unwrap();
    let component =
        std::fs::read(mmgate_host::builtin::artifact_dir().join("testing.wasm")).unwrap();
    std::fs::write(dir.join("testing.wasm"), &component).unwrap();
    std::fs::write(
        dir.join("testing.toml"),
        format!(
            "name = \"testing\"\nversion = \"0.1.0\"\nmodalities = [\"test\", \"image\"]\nsha256 = \"{}\"\n",
            hex::encode(Sha256::digest(&component))
        ),
    )
    .unwrap();
    dir
}

#[test]
fn an_item_the_model_cannot_encode_is_dropped_or_fails_the_request_as_the_model_is_configured() {
    let work = tempfile::tempdir().unwrap();
    let plugins = testing_plugin_dir(work.path());
    // The same demo model twice: one drops what fails to encode, one fails the request.
    let (server, _dir) = start(&format!(
        "plugin_dir = {plugins:?}\nmodels = [\
         {{ name = \"drops\", path = \"demo\", on_encode_error = \"drop\" }}, \
         {{ name = \"fails\", path = \"demo\", on_encode_error = \"error\" }}]\n"
    ));
    // The plugin plans 3 tokens for a 1x3x4 patch grid, which the model's 2x2 merge cannot take.
    let content = |model: &str| {
        chat(
            model,
            json!([
                {"type": "text", "text": "Describe this."},
                image_part(&data_url("application/x-mmgate-test", b"odd-grid")),
            ]),
        )
    };

    let (status, body) = post(&server, "/v1/chat/completions", &content("drops"));
    assert_eq!(status, 200, "{body}");
    let item = &body["usage"]["media"][0];
    assert_eq!(item["plugin"]["name"], "testing", "{body}");
    assert_eq!(item["dropped"], true, "{body}");
    assert_eq!(item["tokens"], 0, "{body}");
    let reason = item["reason"].as_str().unwrap();
    assert!(
        reason.starts_with("encoding failed:") && reason.contains("merge"),
        "{reason}"
    );
    // Answered text-only: the prompt is what the text alone makes.
    let (_, text_only) = post(
        &server,
        "/v1/chat/completions",
        &chat("drops", json!([{"type": "text", "text": "Describe this."}])),
    );
    assert_eq!(
        body["usage"]["prompt_tokens"], text_only["usage"]["prompt_tokens"],
        "{body}"
    );
    assert_eq!(
        body["choices"][0]["message"]["content"],
        text_only["choices"][0]["message"]["content"]
    );

    let (status, body) = post(&server, "/v1/chat/completions", &content("fails"));
    assert_eq!(status, 500, "{body}");
    assert_eq!(body["error"]["code"], "plugin_output_mismatch", "{body}");
    assert!(
        body["error"]["message"].as_str().unwrap().contains("merge"),
        "{body}"
    );

    // Neither took the gateway or its encoders down.
    let (status, body) = post(
        &server,
        "/v1/chat/completions",
        &chat("fails", json!("Hello")),
    );
    assert_eq!(status, 200, "{body}");
}

/// Gauge `name`'s value in the server's metrics.
fn gauge(server: &Server, name: &str) -> Option<f64> {
    metrics(server)
        .lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

/// A text-only question needs no plugin: it is answered while the only plugin worker is held by
/// another request's media (a plugin looping until its deadline), not after.
#[test]
fn a_text_question_is_answered_while_every_plugin_worker_is_busy() {
    let work = tempfile::tempdir().unwrap();
    let plugins = testing_plugin_dir(work.path());
    let (server, _dir) = start(&format!(
        "plugin_dir = {plugins:?}\nmodels = [{{ name = \"demo\", path = \"demo\" }}]\n\
         [plugins]\nthreads = 1\n[sandbox]\ndeadline_ms = 15000\n"
    ));
    let spinning = chat(
        "demo",
        json!([image_part(&data_url("application/x-mmgate-test", b"spin")),
               {"type": "text", "text": "Describe this."}]),
    );
    std::thread::scope(|s| {
        let spin = s.spawn(|| post(&server, "/v1/chat/completions", &spinning));
        // The worker has taken the call (its probe and plan are over in a moment; the loop runs
        // to the deadline).
        while gauge(&server, "mmgate_plugin_running") != Some(1.0) {
            assert!(!spin.is_finished(), "the spinning request ended early");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let (status, body) = post(
            &server,
            "/v1/chat/completions",
            &chat("demo", json!("Say something.")),
        );
        assert_eq!(status, 200, "{body}");
        assert!(
            !spin.is_finished(),
            "the text question was answered only after the plugin call ended"
        );
        // Stopped at its deadline: the server's failure (a stuck plugin), not the client's.
        let (status, body) = spin.join().unwrap();
        assert_eq!(status, 503, "{body}");
        assert_eq!(body["error"]["code"], "server_busy", "{body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("testing") && message.contains("preprocess"),
            "which plugin and call: {message}"
        );
        let metrics = metrics(&server);
        assert!(
            metrics.contains("mmgate_plugin_deadlines_total{plugin=\"testing\"} 1"),
            "{metrics}"
        );
    });
}

/// A plugin that traps or runs out of its memory in the middle of a request fails that request
/// only: an error in OpenAI's shape, while a request with a good image beside it is answered and the
/// gateway serves on (the sandbox's instance is discarded, not reused).
#[test]
fn a_plugin_trapping_or_out_of_memory_mid_request_fails_that_request_only() {
    let work = tempfile::tempdir().unwrap();
    let plugins = testing_plugin_dir(work.path());
    let (server, _dir) = start(&format!(
        "plugin_dir = {plugins:?}\nmodels = [{{ name = \"demo\", path = \"demo\" }}]\n\
         [sandbox]\nmemory_bytes = 67108864\n"
    ));
    let png = common::fixture("image/images/png-rgba.png");
    let good = chat(
        "demo",
        json!([image_part(&data_url("image/png", &png)), {"type": "text", "text": "What is it?"}]),
    );
    // A trap is the plugin's fault (500); media that need more memory than a plugin may have are
    // the client's (413, as a decompression bomb is).
    for (command, expected) in [(&b"trap"[..], 500), (b"grow", 413)] {
        let hostile = chat(
            "demo",
            json!([image_part(&data_url("application/x-mmgate-test", command)),
                   {"type": "text", "text": "Describe this."}]),
        );
        let (bad, fine) = std::thread::scope(|s| {
            let bad = s.spawn(|| post(&server, "/v1/chat/completions", &hostile));
            let fine = s.spawn(|| post(&server, "/v1/chat/completions", &good));
            (bad.join().unwrap(), fine.join().unwrap())
        });
        let (status, body) = bad;
        let what = String::from_utf8_lossy(command);
        assert_eq!(status, expected, "{what}: {body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("media item 0")),
            "{what}: {body}"
        );
        assert_eq!(fine.0, 200, "{what}: the request beside it: {}", fine.1);
    }
    // Still serving, the plugin included.
    let (status, body) = post(&server, "/v1/chat/completions", &good);
    assert_eq!(status, 200, "{body}");
}

/// `max_model_len` serves a context below the checkpoint's: `/v1/models` says it, and every budget
/// uses it (a request that fits the checkpoint but not it is refused before anything runs).
#[test]
fn max_model_len_caps_the_context_every_budget_uses() {
    let (full, _d1) = start("");
    let (_, models) = get(&full, "/v1/models");
    let checkpoint = models["data"][0]["context_length"].as_u64().unwrap();
    let capped_len = 256;
    assert!(checkpoint > capped_len * 2, "{models}");
    let (capped, _d2) = start(&format!(
        "[[models]]\nname = \"demo\"\npath = \"demo\"\nmax_model_len = {capped_len}\n"
    ));
    let (_, models) = get(&capped, "/v1/models");
    assert_eq!(models["data"][0]["context_length"], capped_len);
    let request = json!({"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": capped_len});
    let (status, body) = post(&capped, "/v1/chat/completions", &request);
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (400, Some("context_length_exceeded")),
        "{body}"
    );
    let fits = json!({"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 4});
    let (status, body) = post(&capped, "/v1/chat/completions", &fits);
    assert_eq!(status, 200, "{body}");
}

/// Qwen3-VL served through the registry like the others: an image and a video in one request cost
/// what their plugins planned under its processors (the video's from its
/// `video_preprocessor_config.json`), and the video sits in the prompt as a block per temporal
/// patch after its timestamp.
#[test]
fn qwen3_vl_takes_images_and_videos() {
    let (server, _dir) = start("[[models]]\nname = \"demo-qwen3-vl\"\npath = \"demo-qwen3-vl\"\n");
    let image = data_url("image/png", &fixture("image/images/png-rgb-wide.png"));
    let video = data_url("video/mp4", &fixture("video/clips/h264.mp4"));
    let dir = common::demo_model_dir("demo-qwen3-vl");
    let read = |name: &str| -> Value {
        serde_json::from_slice(&std::fs::read(dir.join(name)).unwrap()).unwrap()
    };
    let mut config = read("preprocessor_config.json");
    config["video_preprocessor_config"] = read("video_preprocessor_config.json");
    let plan = |media: &str| {
        let (status, body) = post(
            &server,
            "/v1/preprocess",
            &json!({"media": media, "processor_config": config}),
        );
        assert_eq!(status, 200, "{body}");
        body["tokens"].as_u64().unwrap()
    };
    let (image_tokens, video_tokens) = (plan(&image), plan(&video));
    let request = chat(
        "demo-qwen3-vl",
        json!([
            image_part(&image),
            {"type": "video_url", "video_url": {"url": video}},
            {"type": "text", "text": "What happens?"}
        ]),
    );
    let (status, body) = post(&server, "/v1/chat/completions", &request);
    assert_eq!(status, 200, "{body}");
    let media = body["usage"]["media"].as_array().unwrap();
    assert_eq!(media[0]["tokens"].as_u64(), Some(image_tokens), "{body}");
    assert_eq!(media[1]["tokens"].as_u64(), Some(video_tokens), "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 6, "{body}");
    let prompt = body["usage"]["prompt_tokens"].as_u64().unwrap();
    // Without the video the prompt loses its tokens, the template's `<|vision_start|>` and
    // `<|vision_end|>` around it, and per temporal patch a `<t seconds>` text (at least one token)
    // with its own start and end.
    let (status, image_only) = post(
        &server,
        "/v1/chat/completions",
        &chat(
            "demo-qwen3-vl",
            json!([image_part(&image), {"type": "text", "text": "What happens?"}]),
        ),
    );
    assert_eq!(status, 200, "{image_only}");
    let without = image_only["usage"]["prompt_tokens"].as_u64().unwrap();
    let patches = media[1]["frames"].as_u64().unwrap() / 2;
    assert!(patches >= 2, "{body}");
    let around_video = prompt - without - video_tokens;
    assert!(around_video >= 2 + 3 * patches, "{around_video} {body}");
}

/// A long lossless clip is made in its plugin's parts, placed before they are made and handed to
/// the engine one by one (contract 0.5), flowing through it in pieces: the same answer and prompt
/// as the same model taking it whole (`media_parts = false`), and the engine counts the pieced item. (Two plugin threads, whatever the machine: an item is made in parts only
/// while at least two are idle.)
#[test]
fn a_long_audio_clip_in_pieces_answers_as_it_does_whole() {
    let (server, _dir) = start(
        "[plugins]\nthreads = 2\n\n\
         [[models]]\nname = \"pieces\"\npath = \"demo-audio\"\n\n\
         [[models]]\nname = \"whole\"\npath = \"demo-audio\"\nmedia_parts = false\n",
    );
    // 61 s of FLAC: three 30 s chunks, made in two parts.
    let clip = data_url("audio/flac", &fixture("audio/clips/long-61s-16k.flac"));
    let content = json!([
        {"type": "audio_url", "audio_url": {"url": clip}},
        {"type": "text", "text": "What is said?"},
    ]);
    let (status, pieces) = post(
        &server,
        "/v1/chat/completions",
        &chat("pieces", content.clone()),
    );
    assert_eq!(status, 200, "{pieces}");
    let (status, whole) = post(&server, "/v1/chat/completions", &chat("whole", content));
    assert_eq!(status, 200, "{whole}");
    for count in ["prompt_tokens", "completion_tokens"] {
        assert_eq!(pieces["usage"][count], whole["usage"][count], "{count}");
    }
    // The usage's account says how each was made.
    assert_eq!(pieces["usage"]["media"][0]["parts"], 2, "{pieces}");
    assert_eq!(
        pieces["usage"]["media"][0]["parts_streamed"], true,
        "{pieces}"
    );
    assert!(whole["usage"]["media"][0].get("parts").is_none(), "{whole}");
    assert_eq!(
        pieces["choices"][0]["message"]["content"],
        whole["choices"][0]["message"]["content"]
    );
    // The engine publishes its counters as it runs: wait for them (bounded) rather than assume.
    let expected = [
        "mmgate_engine_pieced_items{model=\"pieces\"} 1",
        "mmgate_engine_pieced_items{model=\"whole\"} 0",
    ];
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let metrics = metrics(&server);
        let missing: Vec<_> = expected
            .iter()
            .filter(|line| !metrics.lines().any(|l| l == **line))
            .collect();
        if missing.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "{missing:?} in\n{metrics}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A valid video is not refused because the machine is busy. A plugin call's deadline is the
/// plugin's own CPU time (not wall-clock time), and the host's decoding for it is not counted:
/// here the deadline is far below the wall time each call takes with more videos than plugin
/// threads and more busy threads than cores (each call waits for a core most of the time), and
/// every request is answered. (With a wall-clock deadline they were refused, as their media's
/// fault.)
#[test]
fn valid_videos_are_served_on_a_busy_machine_under_a_tight_deadline() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let (server, _dir) =
        start("[plugins]\nthreads = 2\n[sandbox]\ndeadline_ms = 150\nwall_deadline_ms = 600000\n");
    let video = data_url("video/mp4", &fixture("video/clips/h264.mp4"));
    let request = chat(
        "demo",
        json!([{"type": "video_url", "video_url": {"url": video}},
               {"type": "text", "text": "Describe the video."}]),
    );
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        // Stops the busy threads however the scope ends (a failed request's panic included).
        let _stop = common::StopOnDrop(&stop);
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        for _ in 0..cores * 2 {
            s.spawn(|| {
                let mut x = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    x = std::hint::black_box(x.wrapping_add(1));
                }
            });
        }
        let requests: Vec<_> = (0..6)
            .map(|_| s.spawn(|| post(&server, "/v1/chat/completions", &request)))
            .collect();
        for request in requests {
            let (status, body) = request.join().unwrap();
            assert_eq!(status, 200, "{body}");
        }
        stop.store(true, Ordering::Relaxed);
    });
}

/// `POST /v1/preprocess` with a served model plans as that model does: an upstream-only family's
/// (Llama 4's tiles, from its checkpoint configs; no engine is needed to plan) comes back with its
/// tile grid and the files its engine would be sent, a native model's with tensors; a model that
/// forwards media, an unknown model and a model beside a processor config are refused.
#[test]
fn preprocess_explains_a_served_models_plan() {
    let counts = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/vllm/counts");
    let config = format!(
        "[[models]]\nname = \"llama4\"\nupstreams = [\"127.0.0.1:9\"]\nmedia = \"preprocess\"\n\
         path = {:?}\n\n[[models]]\nname = \"llama4-forward\"\nupstreams = [\"127.0.0.1:9\"]\n\n\
         [[models]]\nname = \"demo\"\npath = \"demo\"\n",
        counts.join("llama4")
    );
    let (server, _dir) = start(&config);
    let image = data_url("image/jpeg", &fixture("image/images/photo-640x480.jpg"));
    let (status, body) = post(
        &server,
        "/v1/preprocess",
        &json!({"media": image, "model": "llama4"}),
    );
    assert_eq!(status, 200, "{body}");
    // 640x480 on 56 px tiles of 4 tokens: a 3x4 canvas and the global view.
    assert_eq!(body["tokens"], 13 * 4, "{body}");
    assert_eq!(body["choices"]["tile_grid"], json!([3, 4]), "{body}");
    assert!(body["files"][0]["bytes"].as_u64().unwrap() > 0, "{body}");
    assert!(body.get("tensors").is_none(), "{body}");
    let (status, body) = post(
        &server,
        "/v1/preprocess",
        &json!({"media": image, "model": "llama4", "max_tokens": 30}),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["reduced"], true, "{body}");
    assert!(body["tokens"].as_u64().unwrap() <= 30, "{body}");

    let (status, body) = post(
        &server,
        "/v1/preprocess",
        &json!({"media": image, "model": "demo"}),
    );
    assert_eq!(status, 200, "{body}");
    assert!(
        body["tensors"].as_array().is_some_and(|t| !t.is_empty()),
        "{body}"
    );

    for (request, expected) in [
        (json!({"media": image, "model": "llama4-forward"}), 400),
        (json!({"media": image, "model": "nope"}), 404),
        (
            json!({"media": image, "model": "llama4", "processor_config": {}}),
            400,
        ),
    ] {
        let (status, body) = post(&server, "/v1/preprocess", &request);
        assert_eq!(status, expected, "{request}: {body}");
        assert!(body["error"]["message"].is_string(), "{body}");
    }
}
