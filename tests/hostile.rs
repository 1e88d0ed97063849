//! Hostile and invalid requests against a running gateway while a well-behaved client keeps
//! using it: every bad request gets its OpenAI-shaped 4xx (the validation table below is what
//! OpenAI's API accepts and refuses), the normal client's requests all succeed, `/health` answers
//! every probe, and each request leaves one line in the access log saying how it ended, without
//! the prompt. (Behaviour only: how fast a refusal comes is measured by `bench/hostile.py`.)

use crate::common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use base64::Engine as _;
use common::fixture;
use common::server::Server;
use serde_json::{Value, json};

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .unwrap()
}

fn data_url(mime: &str, bytes: &[u8]) -> String {
    format!(
        "data:{mime};base64,{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

/// A one-message chat for the demo model.
fn chat(content: Value) -> Value {
    json!({"model": "demo", "messages": [{"role": "user", "content": content}], "max_tokens": 2})
}

fn with(mut body: Value, field: &str, value: Value) -> Value {
    body[field] = value;
    body
}

/// Status and error code of a chat completion with `body`.
fn send(server: &Server, body: &[u8]) -> (u16, String) {
    let response = client()
        .post(format!("http://{}/v1/chat/completions", server.addr))
        .header("content-type", "application/json")
        .body(body.to_vec())
        .send()
        .unwrap();
    let status = response.status().as_u16();
    let body: Value = response.json().unwrap_or(Value::Null);
    (status, body["error"]["code"].as_str().unwrap_or("").into())
}

/// `mmgate serve` with `config` (TOML) after `log_format = "json"`, its log written to
/// `mmgate.log` in the directory returned (kept as long as it is).
fn serve_logging(config: &str) -> (Server, tempfile::TempDir) {
    let work = tempfile::tempdir().unwrap();
    let path = work.path().join("mmgate.toml");
    std::fs::write(&path, format!("log_format = \"json\"\n{config}")).unwrap();
    let server = Server::start_logging_to(
        &["--config", path.to_str().unwrap()],
        &[("RUST_LOG", "warn,mmgate::access=info")],
        std::fs::File::create(work.path().join("mmgate.log")).unwrap(),
    );
    (server, work)
}

/// The access log's lines of a JSON log.
fn access_lines(log: &str) -> Vec<Value> {
    log.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|l| l["target"] == "mmgate::access")
        .collect()
}

/// The log at `path` once `complete` holds for it, or as it is after a minute. A request's line is
/// written once its answer has gone out, so a client can hold its answer before the line is there:
/// a test reads the log only through this, before it stops the server.
fn log_once(path: &Path, complete: impl Fn(&str) -> bool) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let log = std::fs::read_to_string(path).unwrap();
        if complete(&log) || std::time::Instant::now() >= deadline {
            return log;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The most requests the normal client sends, however long the hostile ones take.
const MAX_NORMAL_REQUESTS: usize = 20_000;

/// What the text of a prompt that must never reach the log is made of.
const SECRET_TEXT: &str = "zebra-quartz-prompt ";

#[test]
fn hostile_requests_are_refused_while_a_normal_client_is_served() {
    let (server, work) = serve_logging("");
    let log_path = work.path().join("mmgate.log");

    let photo = fixture("image/images/photo-640x480.jpg");
    let wav = fixture("audio/clips/speech-16k-s16.wav");
    let text_upload: Value = client()
        .post(format!("http://{}/v1/files", server.addr))
        .multipart(
            reqwest::blocking::multipart::Form::new()
                .text("purpose", "vision")
                .part(
                    "file",
                    reqwest::blocking::multipart::Part::bytes(b"plain words, no medium".to_vec())
                        .file_name("notes.txt"),
                ),
        )
        .send()
        .unwrap()
        .json()
        .unwrap();
    let text_file = text_upload["id"].as_str().unwrap().to_owned();

    let user = |content: Value| json!({"role": "user", "content": content});
    let messages = |list: Value| json!({"model": "demo", "messages": list, "max_tokens": 2});
    let audio_part = |format: &str| {
        json!([{"type": "input_audio", "input_audio": {
            "data": base64::engine::general_purpose::STANDARD.encode(&wav), "format": format}},
            {"type": "text", "text": "What is said?"}])
    };
    let huge = SECRET_TEXT.repeat((20 << 20) / SECRET_TEXT.len());
    let long = SECRET_TEXT.repeat((1 << 20) / SECRET_TEXT.len());
    // (what, body, status, code): OpenAI's validation, case by case, then hostile bodies.
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        ("an unknown role", messages(json!([{"role": "wizard", "content": "hi"}])), 400, "invalid_request"),
        ("a user message without content", messages(json!([{"role": "user", "content": null}])), 400, "invalid_request"),
        ("a system message without content", messages(json!([{"role": "system"}, user(json!("hi"))])), 400, "invalid_request"),
        ("an image in a system message", messages(json!([{"role": "system", "content": [{"type": "image_url", "image_url": {"url": data_url("image/jpeg", &photo)}}]}, user(json!("hi"))])), 400, "invalid_request"),
        ("an assistant message without content", messages(json!([user(json!("hi")), {"role": "assistant", "content": null}, user(json!("and?"))])), 200, ""),
        ("a developer message", messages(json!([{"role": "developer", "content": "Be brief."}, user(json!("hi"))])), 200, ""),
        ("an unknown audio format", with(chat(audio_part("xyz")), "model", json!("demo-audio")), 400, "invalid_request"),
        ("a known audio format", with(chat(audio_part("wav")), "model", json!("demo-audio")), 200, ""),
        ("stream_options without stream", with(chat(json!("hi")), "stream_options", json!({"include_usage": true})), 400, "invalid_request"),
        ("a negative seed", with(chat(json!("hi")), "seed", json!(-1)), 200, ""),
        ("a data URL that is not base64", chat(json!([{"type": "image_url", "image_url": {"url": "data:image/png,%89PNG%0D%0A"}}])), 400, "invalid_media_url"),
        ("text sent as an image", chat(json!([{"type": "image_url", "image_url": {"url": data_url("text/plain", b"plain words")}}])), 415, "unsupported_media"),
        ("text uploaded as a file", chat(json!([{"type": "file", "file": {"file_id": text_file}}])), 415, "unsupported_media"),
        ("a truncated JPEG", chat(json!([{"type": "image_url", "image_url": {"url": data_url("image/jpeg", &fixture("image/bad/truncated.jpg"))}}])), 400, "invalid_media"),
        ("a decompression bomb", chat(json!([{"type": "image_url", "image_url": {"url": data_url("image/png", &fixture("image/bad/header-30000x30000.png"))}}])), 413, "media_too_large"),
        ("text past the text limit", chat(json!(huge)), 413, "text_too_large"),
        ("text that cannot fit the context", chat(json!(long)), 400, "context_length_exceeded"),
        ("multi-byte text that cannot fit the context", chat(json!("✓漢".repeat(200_000))), 400, "context_length_exceeded"),
    ]
    .into_iter()
    .map(|(what, body, status, code)| (what, body.to_string().into_bytes(), status, code))
    .chain([
        ("malformed JSON", b"{\"model\": \"demo\", \"messages\": [".to_vec(), 400, "invalid_request"),
        ("JSON that is not an object", b"[1, 2, 3]".to_vec(), 400, "invalid_request"),
    ])
    .collect();

    let stop = AtomicBool::new(false);
    let (served, probes) = std::thread::scope(|s| {
        // The normal client stops when the hostile one is done, or fails.
        let _stop = common::StopOnDrop(&stop);
        let normal = s.spawn(|| {
            let mut served = 0;
            let mut probes = 0;
            while (!stop.load(Ordering::Relaxed) || served == 0) && served < MAX_NORMAL_REQUESTS {
                let (status, code) = send(&server, chat(json!("Say hi.")).to_string().as_bytes());
                assert_eq!(
                    (status, code.as_str()),
                    (200, ""),
                    "the normal client was refused"
                );
                served += 1;
                let health = client()
                    .get(format!("http://{}/health", server.addr))
                    .send()
                    .unwrap();
                assert_eq!(health.status().as_u16(), 200, "a /health probe failed");
                probes += 1;
            }
            (served, probes)
        });
        for (what, body, status, code) in &cases {
            assert_eq!(send(&server, body), (*status, code.to_string()), "{what}");
        }
        // Framing tricks: both a length and chunked (request smuggling), a length that lies, and
        // request lines too long for any head (one that fits in a read, one that does not).
        let long_line =
            |n: usize| format!("GET /health?{} HTTP/1.1\r\nHost: x\r\n\r\n", "a".repeat(n));
        for (raw, status) in [
            ("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n".to_owned(), "HTTP/1.1 4"),
            ("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999\r\n\r\n{}".to_owned(), "HTTP/1.1 4"),
            (long_line(70_000), "HTTP/1.1 431"),
            (long_line(200_000), "HTTP/1.1 431"),
        ] {
            let mut stream = TcpStream::connect(&server.addr).unwrap();
            stream
                .set_read_timeout(Some(Duration::from_secs(60)))
                .unwrap();
            let _ = stream.write_all(raw.as_bytes());
            let mut answer = Vec::new();
            let _ = stream.read_to_end(&mut answer);
            let head = String::from_utf8_lossy(&answer);
            assert!(head.starts_with(status), "{:?}: {head}", &raw[..80]);
        }
        stop.store(true, Ordering::Relaxed);
        normal.join().unwrap()
    });
    assert!(served > 0 && probes > 0);

    // One access line per chat request, each with its status and code; no prompt text.
    let chat_lines = |log: &str| {
        access_lines(log)
            .iter()
            .filter(|l| l["fields"]["path"] == "/v1/chat/completions")
            .count()
    };
    let log = log_once(&log_path, |log| chat_lines(log) >= cases.len() + served);
    drop(server);
    assert!(
        !log.contains(SECRET_TEXT.trim()),
        "the prompt reached the log"
    );
    let lines = access_lines(&log);
    let chats = chat_lines(&log);
    assert!(chats >= cases.len() + served, "{chats} chat lines: {log}");
    for (what, _, status, code) in &cases {
        let found = lines.iter().any(|l| {
            l["fields"]["status"] == *status
                && (code.is_empty() || l["fields"]["code"] == *code)
                && l["fields"]["client"] == "127.0.0.1"
        });
        assert!(found, "no access line for {what} ({status} {code}): {log}");
    }
    assert!(
        lines
            .iter()
            .any(|l| l["fields"]["model"] == "demo"
                && l["fields"]["prompt_tokens"].as_u64() > Some(0)),
        "a served request's line has its model and tokens: {log}"
    );
}

/// A request of `method` to `path` with the test key, `body` as JSON when given.
fn call(
    server: &Server,
    method: &str,
    path: &str,
    body: Option<Vec<u8>>,
) -> reqwest::blocking::Response {
    let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
    let mut request = client()
        .request(method, format!("http://{}{path}", server.addr))
        .bearer_auth("sk-a");
    if let Some(body) = body {
        request = request
            .header("content-type", "application/json")
            .body(body);
    }
    request.send().unwrap()
}

/// Status, error code and message of an answer.
fn outcome(response: reqwest::blocking::Response) -> (u16, String, String) {
    let status = response.status().as_u16();
    let body: Value = response.json().unwrap_or(Value::Null);
    let text = |field: &str| body["error"][field].as_str().unwrap_or("").to_owned();
    (status, text("code"), text("message"))
}

/// Requests small on the wire that would cost the server gigabytes or minutes: each is refused
/// before the work, by the limit that names it, and charges its key nothing.
#[test]
fn small_requests_that_would_cost_gigabytes_or_minutes_are_bounded() {
    let (server, work) = serve_logging(
        "api_keys = [\"sk-a\"]\n\
         [limits]\nmax_body_bytes = 4194304\nmax_media_items = 2\nmax_image_bytes = 100000\n\
         max_messages = 6\nmax_content_parts = 1000\n\
         [key_limits]\ntokens_per_minute = 3000\n",
    );
    let log_path = work.path().join("mmgate.log");
    let post = |path: &str, body: &Value| {
        outcome(call(
            &server,
            "POST",
            path,
            Some(body.to_string().into_bytes()),
        ))
    };

    // Parts and messages past their limits, refused as they are counted.
    let empty_part = json!({"type": "text", "text": ""});
    let parts = chat(Value::Array(vec![empty_part.clone(); 100_000]));
    let (status, code, message) = post("/v1/chat/completions", &parts);
    assert_eq!(
        (status, code.as_str()),
        (400, "too_many_content_parts"),
        "{message}"
    );
    assert!(message.contains("limits.max_content_parts"), "{message}");
    let messages =
        json!({"model": "demo", "messages": vec![json!({"role": "user", "content": ""}); 10_000]});
    assert_eq!(
        post("/v1/chat/completions", &messages).1,
        "too_many_messages"
    );
    let input = json!({"model": "demo", "input": [{"role": "user", "content":
        vec![json!({"type": "input_text", "text": ""}); 100_000]}]});
    assert_eq!(post("/v1/responses", &input).1, "too_many_content_parts");

    // A stored conversation grows one turn per follow-up, and no further than one request may.
    let mut previous: Option<String> = None;
    let mut ids = Vec::new();
    let refused = loop {
        let mut turn = json!({"model": "demo", "input": "Say hi.", "max_output_tokens": 2});
        if let Some(id) = &previous {
            turn["previous_response_id"] = json!(id);
        }
        let response = call(
            &server,
            "POST",
            "/v1/responses",
            Some(turn.to_string().into_bytes()),
        );
        if response.status() != 200 {
            break outcome(response);
        }
        let id = response.json::<Value>().unwrap()["id"]
            .as_str()
            .unwrap()
            .to_owned();
        ids.push(id.clone());
        previous = Some(id);
        assert!(ids.len() < 10, "follow-ups were never refused");
    };
    assert_eq!(
        (refused.0, refused.1.as_str()),
        (400, "too_many_messages"),
        "{}",
        refused.2
    );
    // Kept turns: the root's user and assistant messages, then two per follow-up, up to 6.
    assert_eq!(ids.len(), 3);
    for id in &ids {
        let suffix = id.strip_prefix("resp_").unwrap();
        assert!(
            suffix.len() == 32 && suffix.bytes().all(|b| b.is_ascii_hexdigit()),
            "{id}"
        );
    }
    assert_ne!(ids[0][..13], ids[1][..13], "ids share a prefix: {ids:?}");
    let long_id = "r".repeat(100_000);
    let (status, _, message) = post(
        "/v1/responses",
        &json!({"model": "demo", "input": "hi", "previous_response_id": long_id}),
    );
    assert_eq!(status, 404);
    assert!(
        message.len() < 300,
        "the id is echoed whole: {} bytes",
        message.len()
    );

    // `/v1/preprocess` under the same limits as chat.
    let small = data_url("image/png", &fixture("image/images/png-rgba.png"));
    let photo = data_url("image/jpeg", &fixture("image/images/photo-640x480.jpg"));
    let qwen2_vl = json!({"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 3136,
        "max_pixels": 12845056, "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2});
    let preprocess = |media: Value| {
        post(
            "/v1/preprocess",
            &json!({"media": media, "processor_config": qwen2_vl}),
        )
    };
    assert_eq!(preprocess(json!([small, small])).0, 200);
    assert_eq!(
        preprocess(json!([small, small, small])).1,
        "too_many_media_items"
    );
    assert_eq!(preprocess(json!(photo)).1, "media_too_large");
    // A body over the limit is refused from its Content-Length, before it is read. The client goes
    // on writing it, as clients without `Expect: 100-continue` do before they read: the answer
    // still reaches it.
    let mut stream = TcpStream::connect(&server.addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let head = format!(
        "POST /v1/preprocess HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-a\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        5 << 20
    );
    stream.write_all(head.as_bytes()).unwrap();
    let _ = stream.write_all(&vec![b' '; 3 << 20]);
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.starts_with("HTTP/1.1 413") && answer.contains("request_too_large"),
        "{answer}"
    );
    // A client's processor settings out of bounds: the client's error, named, not a plugin trap.
    let (status, code, message) = post(
        "/v1/preprocess",
        &json!({"media": small, "processor_config": {"image_processor_type": "Qwen2VLImageProcessor",
            "min_pixels": 1e9, "max_pixels": 2e9, "patch_size": 14, "merge_size": 2}}),
    );
    assert_eq!(
        (status, code.as_str()),
        (400, "invalid_request"),
        "{message}"
    );
    assert!(message.contains("processor_config.min_pixels"), "{message}");

    // Refused requests are charged nothing: after a 413 of a large body the key still has tokens
    // for a small chat (a charge by the body's size would have used up the minute's 3000).
    let large = chat(json!([{"type": "image_url", "image_url": {"url": photo}}]));
    assert_eq!(post("/v1/chat/completions", &large).1, "media_too_large");
    let (status, code, message) = post("/v1/chat/completions", &chat(json!("Say hi.")));
    assert_eq!((status, code.as_str()), (200, ""), "{message}");

    // HEAD wherever GET works, OPTIONS says what a path takes, a 405 says it too.
    for path in [
        "/console",
        "/health",
        "/v1/models",
        "/metrics",
        "/console/console.js",
        "/health?x",
    ] {
        let head = call(&server, "HEAD", path, None);
        assert_eq!(head.status().as_u16(), 200, "HEAD {path}");
        let length: usize = head.headers()["content-length"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!(length > 0, "HEAD {path}: the GET answer's length");
        assert!(head.bytes().unwrap().is_empty(), "HEAD {path} has a body");
    }
    let options = call(&server, "OPTIONS", "/v1/chat/completions", None);
    assert_eq!(options.status().as_u16(), 204);
    assert_eq!(options.headers()["allow"], "POST, OPTIONS");
    let not_allowed = call(&server, "POST", "/health", Some(b"{}".to_vec()));
    assert_eq!(not_allowed.status().as_u16(), 405);
    assert_eq!(not_allowed.headers()["allow"], "GET, HEAD, OPTIONS");
    assert_eq!(
        call(&server, "OPTIONS", "/nowhere", None).status().as_u16(),
        404
    );
    assert_eq!(
        call(&server, "GET", "/console", None).status().as_u16(),
        200
    );

    // The console's page and the refusals each leave an access line.
    let expected = [
        ("/console", 200),
        ("/v1/preprocess", 413),
        ("/v1/chat/completions", 400),
        ("/v1/responses", 404),
    ];
    let logged = |log: &str, (path, status): (&str, u16)| {
        access_lines(log)
            .iter()
            .any(|l| l["fields"]["path"] == path && l["fields"]["status"] == status)
    };
    let log = log_once(&log_path, |log| expected.iter().all(|e| logged(log, *e)));
    drop(server);
    for (path, status) in expected {
        assert!(
            logged(&log, (path, status)),
            "no access line for {path} {status}: {log}"
        );
    }
}

/// An upstream that answers every chat completion with a stream of events that never ends, until
/// the gateway stops reading it.
fn endless_stream_upstream() -> String {
    stream_upstream(None)
}

/// A scripted upstream answering every request with a stream of chat chunks: endless, or
/// `Some(n)` chunks and then the connection closed mid-body (an upstream that broke down).
fn stream_upstream(events: Option<usize>) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            std::thread::spawn(move || {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).unwrap_or(0) == 1 {
                    head.push(byte[0]);
                }
                let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map_or(0, |v| v.trim().parse().unwrap());
                let mut body = vec![0u8; length];
                let _ = stream.read_exact(&mut body);
                let mut out = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                    transfer-encoding: chunked\r\n\r\n"
                    .to_vec();
                for _ in 0..events.unwrap_or(usize::MAX) {
                    let event = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":0,\
                        \"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"},\
                        \"finish_reason\":null}]}\n\n";
                    out.extend_from_slice(format!("{:x}\r\n{event}\r\n", event.len()).as_bytes());
                    if stream.write_all(&out).is_err() {
                        return;
                    }
                    out.clear();
                    std::thread::sleep(Duration::from_millis(20));
                }
                // The connection closes without the last chunk: the answer broke off.
            });
        }
    });
    addr
}

/// A client that leaves a stream mid-answer is logged as having closed it (499, `client_closed`),
/// not as served: on the relayed chat and on the Responses API's own stream.
#[test]
fn a_stream_the_client_leaves_is_logged_as_closed() {
    let upstream = endless_stream_upstream();
    let (server, work) = serve_logging(&format!(
        "models = [{{ name = \"far\", upstreams = [\"{upstream}\"], \
         health_check = {{ path = \"\", interval_ms = 3600000 }} }}]\n"
    ));
    let requests = [
        (
            "/v1/chat/completions",
            json!({"model": "far", "stream": true, "messages": [{"role": "user", "content": "hi"}]}),
        ),
        (
            "/v1/responses",
            json!({"model": "far", "stream": true, "input": "hi"}),
        ),
    ];
    for (path, body) in &requests {
        let body = serde_json::to_vec(body).unwrap();
        let mut stream = TcpStream::connect(&server.addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        write!(
            stream,
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n",
            body.len()
        )
        .unwrap();
        stream.write_all(&body).unwrap();
        // The answer's head and its first events, then the client is gone.
        let mut first = [0u8; 512];
        let read = stream.read(&mut first).unwrap();
        assert!(
            String::from_utf8_lossy(&first[..read]).starts_with("HTTP/1.1 200"),
            "{path}: {}",
            String::from_utf8_lossy(&first[..read])
        );
        drop(stream);
    }
    // The gateway notices at its next writes; each request then has its line.
    let log_path = work.path().join("mmgate.log");
    let closed = |log: &str| {
        requests.iter().all(|(path, _)| {
            access_lines(log).iter().any(|l| {
                l["fields"]["path"] == *path
                    && l["fields"]["status"] == 499
                    && l["fields"]["code"] == "client_closed"
            })
        })
    };
    let log = log_once(&log_path, closed);
    assert!(closed(&log), "each left stream logged as closed: {log}");
    assert!(
        !access_lines(&log)
            .iter()
            .any(|l| l["fields"]["status"] == 200),
        "a left stream logged as served: {log}"
    );
}

/// An answer whose upstream breaks down mid-stream is logged with the status that went out and
/// the reason it broke off, not as served: on the relayed chat, a chat the gateway forwards
/// (its body chunked, so read by the gateway first) and the Responses API's stream.
#[test]
fn a_stream_whose_upstream_breaks_off_is_logged_so() {
    let upstream = stream_upstream(Some(2));
    let (server, work) = serve_logging(&format!(
        "models = [{{ name = \"far\", upstreams = [\"{upstream}\"], \
         health_check = {{ path = \"\", interval_ms = 3600000 }} }}]\n"
    ));
    let chat = serde_json::to_vec(
        &json!({"model": "far", "stream": true, "messages": [{"role": "user", "content": "hi"}]}),
    )
    .unwrap();
    let responses =
        serde_json::to_vec(&json!({"model": "far", "stream": true, "input": "hi"})).unwrap();
    let framed = |path: &str, body: &[u8], chunked: bool| {
        let mut request = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
        );
        if chunked {
            request += &format!("Transfer-Encoding: chunked\r\n\r\n{:x}\r\n", body.len());
        } else {
            request += &format!("Content-Length: {}\r\n\r\n", body.len());
        }
        let mut request = request.into_bytes();
        request.extend_from_slice(body);
        if chunked {
            request.extend_from_slice(b"\r\n0\r\n\r\n");
        }
        request
    };
    let cases = [
        (
            "/v1/chat/completions",
            framed("/v1/chat/completions", &chat, false),
            "upstream_failed_mid_answer",
        ),
        (
            "/v1/chat/completions",
            framed("/v1/chat/completions", &chat, true),
            "upstream_failed_mid_answer",
        ),
        (
            "/v1/responses",
            framed("/v1/responses", &responses, false),
            "upstream_error",
        ),
    ];
    for (path, request, _) in &cases {
        let mut stream = TcpStream::connect(&server.addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        stream.write_all(request).unwrap();
        // Asked to close, the gateway ends the connection once the answer has ended.
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).unwrap();
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 200"), "{path}: {answer}");
        assert!(answer.contains("error"), "{path}: no error event: {answer}");
    }
    let logged = |log: &str, path: &str, code: &str| {
        access_lines(log)
            .iter()
            .filter(|l| l["fields"]["path"] == path && l["fields"]["status"] == 200)
            .filter(|l| l["fields"]["code"] == code)
            .count()
    };
    let expected = |path: &str| cases.iter().filter(|(p, _, _)| *p == path).count();
    let log = log_once(&work.path().join("mmgate.log"), |log| {
        cases
            .iter()
            .all(|(path, _, code)| logged(log, path, code) >= expected(path))
    });
    drop(server);
    for (path, _, code) in &cases {
        assert_eq!(
            logged(&log, path, code),
            expected(path),
            "{path} logged {code}: {log}"
        );
    }
}
