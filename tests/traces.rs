//! OpenTelemetry traces end to end: the real `mmgate serve` exporting OTLP/HTTP to a receiver on
//! loopback that decodes them with OpenTelemetry's own protobuf definitions
//! (tests/common/traces.rs). Each request is one trace, continued from the client's
//! `traceparent`, its spans nested under the request's and within its time, named in the response;
//! the upstream case (vLLM's spans joining the trace) is in tests/vllm.rs.

use crate::common;

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use base64::Engine as _;
use common::engine::engine_venv;
use common::server::Server;
use common::traces::Receiver;
use serde_json::{Value, json};

/// The client's trace: its id and the id of the span the request is made in.
const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

fn data_url(mime: &str, path: &str) -> String {
    let bytes = common::fixture(path);
    format!(
        "data:{mime};base64,{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

/// A chat with `url` as a `part` part; the trace id the answer names.
fn chat(server: &Server, part: &str, url: String, traceparent: Option<String>) -> String {
    let body = json!({"model": "demo", "max_tokens": 3, "messages": [{"role": "user", "content": [
        {"type": part, part: {"url": url}}, {"type": "text", "text": "What is this?"}]}]});
    let client = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap();
    let mut request = client.post(format!("http://{}/v1/chat/completions", server.addr));
    if let Some(traceparent) = traceparent {
        request = request.header("traceparent", traceparent);
    }
    let response = request.json(&body).send().unwrap();
    assert_eq!(response.status(), 200);
    let id = response.headers()["x-mmgate-trace-id"]
        .to_str()
        .unwrap()
        .to_owned();
    let _: Value = response.json().unwrap();
    id
}

/// The trace's spans once its request span (the root here) has arrived with everything under it,
/// checked to nest: one root, every other span's parent in the trace and within its parent's time.
fn nested(receiver: &Receiver, id: &str, names: &[&str]) -> Vec<Value> {
    let spans = receiver.trace(id, |spans| {
        let have: HashSet<&str> = spans.iter().filter_map(|s| s["name"].as_str()).collect();
        names.iter().all(|n| have.contains(n))
    });
    let by_id: std::collections::HashMap<&str, &Value> = spans
        .iter()
        .map(|s| (s["span_id"].as_str().unwrap(), s))
        .collect();
    let roots: Vec<&Value> = spans
        .iter()
        .filter(|s| !by_id.contains_key(s["parent_span_id"].as_str().unwrap()))
        .collect();
    assert_eq!(roots.len(), 1, "one root: {roots:#?}");
    // Within its parent's time, but for the parts of an item handed to the engine as each is
    // made: they run on after the call that started them returned.
    let root = roots[0];
    let within = |span: &Value, outer: &Value| {
        outer["start"].as_u64().unwrap() <= span["start"].as_u64().unwrap()
            && span["end"].as_u64().unwrap() <= outer["end"].as_u64().unwrap()
    };
    for span in &spans {
        assert!(within(span, root), "{} outside the request", span["name"]);
        if let Some(parent) = by_id.get(span["parent_span_id"].as_str().unwrap())
            && !(span["name"] == "plugin.run" && parent["name"] == "plugin.preprocess")
        {
            assert!(within(span, parent), "{span} outside {parent}");
        }
    }
    spans
}

fn named<'s>(spans: &'s [Value], name: &str) -> Vec<&'s Value> {
    spans.iter().filter(|s| s["name"] == name).collect()
}

#[test]
fn each_request_is_one_trace_with_a_span_per_stage_continued_from_the_client() {
    let Some(venv) = engine_venv("bin/python") else {
        return;
    };
    let receiver = Receiver::start(&venv);
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("mmgate.toml");
    // Enough plugin workers idle for a video to be made in its parts.
    std::fs::write(&config, "[plugins]\nthreads = 4\n").unwrap();
    let server = Server::start_with_env(
        &["--config", config.to_str().unwrap()],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &receiver.endpoint),
            ("OTEL_SERVICE_NAME", "mmgate-under-test"),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
    );

    // An image chat, in the client's trace.
    let traceparent = format!("00-{TRACE}-{CLIENT_SPAN}-01");
    let image = data_url("image/png", "image/images/png-rgb-wide.png");
    assert_eq!(chat(&server, "image_url", image, Some(traceparent)), TRACE);
    let stages = [
        "POST /v1/chat/completions",
        "media.read",
        "plugin.choose",
        "plugin.probe",
        "plugin.plan",
        "plugin.preprocess",
        "plugin.run",
        "generate",
        "prefill",
        "encode",
        "decode",
    ];
    let spans = nested(&receiver, TRACE, &stages);
    let root = named(&spans, "POST /v1/chat/completions")[0];
    assert_eq!(
        root["parent_span_id"], CLIENT_SPAN,
        "the client's trace is continued"
    );
    assert_eq!(root["service"], "mmgate-under-test");
    let attributes = &root["attributes"];
    assert_eq!(attributes["http.response.status_code"], 200);
    assert_eq!(attributes["gen_ai.request.model"], "demo");
    assert!(
        attributes["mmgate.media_tokens"].as_i64().unwrap() > 0,
        "{attributes}"
    );
    let preprocess = &named(&spans, "plugin.preprocess")[0]["attributes"];
    assert_eq!(preprocess["mmgate.mime_type"], "image/png");
    assert!(
        preprocess["mmgate.tokens"].as_i64().unwrap() > 0,
        "{preprocess}"
    );
    // The encoder's work is the request's, under its prefill.
    let prefill = named(&spans, "prefill")[0]["span_id"].clone();
    assert!(
        named(&spans, "encode")
            .iter()
            .all(|e| e["parent_span_id"] == prefill)
    );
    // What the client sent is never in a trace.
    assert!(
        !serde_json::to_string(&spans)
            .unwrap()
            .contains("What is this?")
    );

    // A video in parts: a trace of its own, a plugin run per part under its preprocessing.
    let clip = dir.path().join("long.avi");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/traces/clip.py");
    common::run_ok(
        std::process::Command::new(venv.join("bin/python"))
            .arg(script)
            .arg(&clip),
    );
    let video = format!(
        "data:video/x-msvideo;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(std::fs::read(&clip).unwrap())
    );
    let id = chat(&server, "video_url", video, None);
    assert_ne!(id, TRACE);
    let spans = nested(&receiver, &id, &stages);
    let preprocess = named(&spans, "plugin.preprocess")[0]["span_id"].clone();
    let runs = spans
        .iter()
        .filter(|s| s["name"] == "plugin.run" && s["parent_span_id"] == preprocess)
        .count();
    assert!(
        runs >= 3,
        "one to ask for the parts, then one per part: {runs}"
    );
    let generate = &named(&spans, "generate")[0]["attributes"];
    assert!(
        generate["mmgate.pieces_fed"].as_i64().unwrap() >= 1,
        "parts handed to the engine as they were made: {generate}"
    );
}
