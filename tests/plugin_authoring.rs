//! The plugin author's path end to end, with the real binary: `mmgate plugin new`, `mmgate plugin
//! build` into the plugin directory of a running gateway, the gateway picking it up and serving a
//! request with it; then a broken build dropped over it, rejected, while the old version keeps
//! serving; and SIGHUP reloading.

use crate::common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use base64::Engine as _;
use common::server::{Server, request};
use sha2::{Digest, Sha256};

/// A 3x2 RGB PNG (the same one the template's own test uses).
const PNG: &[u8] = &[
    137, 80, 78, 71, 13, 10, 26, 10, 0, 0, 0, 13, 73, 72, 68, 82, 0, 0, 0, 3, 0, 0, 0, 2, 8, 2, 0,
    0, 0, 18, 22, 241, 77, 0, 0, 0, 28, 73, 68, 65, 84, 120, 156, 99, 96, 96, 96, 8, 8, 8, 88, 176,
    96, 1, 131, 134, 134, 70, 69, 69, 197, 137, 19, 39, 0, 52, 28, 7, 9, 86, 152, 205, 200, 0, 0,
    0, 0, 73, 69, 78, 68, 174, 66, 96, 130,
];

fn preprocess_body(plugin: &str, data: &[u8]) -> String {
    let media = format!(
        "data:image/png;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(data)
    );
    serde_json::json!({
        "media": media,
        "plugin": plugin,
        "processor_config": {"size": 56, "patch_size": 14},
        "max_tokens": 100,
    })
    .to_string()
}

/// Polls `GET /v1/plugins` until `done` holds (plugin reloads happen in the background).
fn wait_for_plugins(
    server: &Server,
    what: &str,
    done: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, body) = request(&server.addr, "GET", "/v1/plugins", None);
        assert_eq!(status, 200);
        if done(&body) {
            return body;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}: {body:#}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn plugin_entry<'a>(plugins: &'a serde_json::Value, name: &str) -> Option<&'a serde_json::Value> {
    plugins["data"]
        .as_array()?
        .iter()
        .find(|p| p["name"] == name)
}

fn generation(plugins: &serde_json::Value) -> u64 {
    let generation = plugins["reload"]["generation"].as_u64().unwrap();
    // Every reload says when it ran (the console shows it); none yet, nothing.
    assert_eq!(
        generation > 0,
        plugins["reload"]["at"].is_u64(),
        "{plugins}"
    );
    generation
}

/// Nested cargo builds share one target directory beside this build's, so reruns are incremental.
fn plugin_target_dir() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .unwrap()
        .join("plugin-projects")
}

/// `mmgate plugin build PROJECT --out PLUGIN_DIR`, which must succeed.
fn build_into(project: &Path, plugin_dir: &Path) {
    let out = common::mmgate_command()
        .args(["plugin", "build", "--out"])
        .arg(plugin_dir)
        .arg(project)
        .env("CARGO_TARGET_DIR", plugin_target_dir())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_new_plugin_is_built_into_a_running_gateway_and_a_broken_build_never_replaces_it() {
    let work = tempfile::tempdir().unwrap();
    let project = work.path().join("e2e-resize");
    let plugin_dir = work.path().join("plugins");
    std::fs::create_dir(&plugin_dir).unwrap();
    let config = work.path().join("mmgate.toml");
    std::fs::write(&config, "plugin_dir = \"plugins\"\n").unwrap();

    let server = Server::start(&["--config", config.to_str().unwrap()]);
    let before = wait_for_plugins(&server, "start-up", |_| true);
    assert!(plugin_entry(&before, "e2e-resize").is_none());

    let out = common::mmgate(&[
        "plugin",
        "new",
        "e2e-resize",
        "--dir",
        project.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    build_into(&project, &plugin_dir);
    let component = plugin_dir.join("e2e-resize.wasm");
    let sha = hex::encode(Sha256::digest(std::fs::read(&component).unwrap()));

    let loaded = wait_for_plugins(&server, "the new plugin", |p| {
        plugin_entry(p, "e2e-resize").is_some()
    });
    let entry = plugin_entry(&loaded, "e2e-resize").unwrap();
    assert_eq!(entry["sha256"], sha.as_str());
    assert_eq!(entry["origin"], component.display().to_string());

    let body = preprocess_body("e2e-resize", PNG);
    let (status, served) = request(&server.addr, "POST", "/v1/preprocess", Some(&body));
    assert_eq!(status, 200, "{served:#}");
    assert_eq!(served["plugin"]["name"], "e2e-resize");
    assert_eq!(served["plugin"]["sha256"], sha.as_str());
    assert_eq!(served["tokens"], 16);
    assert_eq!(
        served["tensors"][0]["shape"],
        serde_json::json!([1, 3, 56, 56])
    );

    // A broken build (half a component, as an interrupted copy leaves it) with a manifest pinning it.
    let generation_before = generation(&loaded);
    let bytes = std::fs::read(&component).unwrap();
    let broken = &bytes[..bytes.len() / 2];
    std::fs::write(&component, broken).unwrap();
    let manifest = plugin_dir.join("e2e-resize.toml");
    let text = std::fs::read_to_string(&manifest).unwrap();
    let broken_sha = hex::encode(Sha256::digest(broken));
    std::fs::write(&manifest, text.replace(&sha, &broken_sha)).unwrap();

    let after = wait_for_plugins(&server, "the broken build to be rejected", |p| {
        generation(p) > generation_before
            && p["reload"]["rejected"]
                .as_array()
                .unwrap()
                .iter()
                .any(|r| r["manifest"] == manifest.display().to_string())
    });
    let rejected = &after["reload"]["rejected"][0];
    assert_eq!(rejected["kept_previous"], true);
    assert!(
        rejected["reason"]
            .as_str()
            .unwrap()
            .contains("not a valid WebAssembly component"),
        "{rejected:#}"
    );
    assert_eq!(
        plugin_entry(&after, "e2e-resize").unwrap()["sha256"],
        sha.as_str()
    );
    let (status, served) = request(&server.addr, "POST", "/v1/preprocess", Some(&body));
    assert_eq!(status, 200, "the old version keeps serving: {served:#}");
    assert_eq!(served["plugin"]["sha256"], sha.as_str());

    // SIGHUP reloads too (here: the same broken build, rejected again).
    let generation_before = generation(&after);
    let killed = std::process::Command::new("kill")
        .args(["-HUP", &server.child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    wait_for_plugins(&server, "the SIGHUP reload", |p| {
        generation(p) > generation_before
    });
    let (status, _) = request(&server.addr, "GET", "/health", None);
    assert_eq!(status, 200, "SIGHUP does not stop the gateway");
}

#[test]
fn preprocess_requests_are_validated_and_errors_leave_the_gateway_serving() {
    let server = Server::start(&[]);
    let cases = [
        ("not json", 400, "invalid_json"),
        (
            r#"{"media": "https://example.com/a.png"}"#,
            400,
            "invalid_media_url",
        ),
        (
            r#"{"media": "data:image/png;base64,%%%"}"#,
            400,
            "invalid_media_url",
        ),
        (
            r#"{"media": "data:image/png;base64,aGVsbG8=", "plugin": "nope"}"#,
            404,
            "plugin_not_found",
        ),
        (
            r#"{"media": "data:application/octet-stream;base64,aGVsbG8="}"#,
            415,
            "unsupported_media",
        ),
        (
            r#"{"media": "data:image/png;base64,aGVsbG8=", "plugin": "image"}"#,
            400,
            "invalid_media",
        ),
    ];
    for (body, status, code) in cases {
        let (got, answer) = request(&server.addr, "POST", "/v1/preprocess", Some(body));
        assert_eq!(
            (got, answer["error"]["code"].as_str()),
            (status, Some(code)),
            "{body}: {answer}"
        );
    }
    // A real image through the built-in image plugin, chosen by its type.
    let config = r#"{"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}"#;
    let body = format!(
        r#"{{"media": "data:image/png;base64,{}", "processor_config": {config}}}"#,
        base64::engine::general_purpose::STANDARD.encode(PNG)
    );
    let (status, answer) = request(&server.addr, "POST", "/v1/preprocess", Some(&body));
    assert_eq!(status, 200, "{answer:#}");
    assert_eq!(answer["plugin"]["name"], "image");
    // smart_resize lifts 3x2 to min_pixels: 56x84, a 4x6 grid of patches, 2x2 merged.
    assert_eq!(
        answer["resized_size"],
        serde_json::json!({"width": 84, "height": 56})
    );
    assert_eq!(answer["tokens"], 6);
}

#[test]
fn the_internvl_example_is_served_from_a_plugin_directory_with_its_planned_tokens() {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/plugins/internvl-tiles");
    let work = tempfile::tempdir().unwrap();
    let plugin_dir = work.path().join("plugins");
    build_into(&example, &plugin_dir);
    let config = work.path().join("mmgate.toml");
    std::fs::write(&config, "plugin_dir = \"plugins\"\n").unwrap();
    let server = Server::start(&["--config", config.to_str().unwrap()]);

    let fixtures = example.join("tests/fixtures");
    let cases: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixtures.join("cases.json")).unwrap()).unwrap();
    for name in ["photo-640x480--internvl3", "sliver-900x50--budget-12"] {
        let case = cases["cases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .unwrap();
        let image = std::fs::read(
            fixtures
                .join("images")
                .join(case["image"].as_str().unwrap()),
        )
        .unwrap();
        let config: serde_json::Value = serde_json::from_slice(
            &std::fs::read(
                fixtures
                    .join("configs")
                    .join(format!("{}.json", case["config"].as_str().unwrap())),
            )
            .unwrap(),
        )
        .unwrap();
        // No plugin named: the InternVL config's processor type picks the directory plugin.
        let body = serde_json::json!({
            "media": format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(&image)),
            "processor_config": config,
            "max_tokens": case.get("budget").cloned().unwrap_or(serde_json::json!(100_000)),
        });
        let (status, answer) = request(
            &server.addr,
            "POST",
            "/v1/preprocess",
            Some(&body.to_string()),
        );
        assert_eq!(status, 200, "{name}: {answer:#}");
        assert_eq!(answer["plugin"]["name"], "internvl-tiles");
        assert_eq!(answer["tokens"], case["tokens"], "{name}");
        assert_eq!(answer["reduced"], case["reduced"], "{name}");
        assert_eq!(
            answer["tensors"][0]["shape"], case["pixel_values_shape"],
            "{name}"
        );
    }

    // The demo model is Qwen2-VL: its images still go to the built-in image plugin, though the
    // directory plugin takes PNGs too (it serves InternVL's processors only).
    let image = std::fs::read(fixtures.join("images/grey-260x390.png")).unwrap();
    let chat = serde_json::json!({
        "model": "demo",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": format!(
                "data:image/png;base64,{}",
                base64::engine::general_purpose::STANDARD.encode(&image)
            )}},
        ]}],
    });
    let (status, answer) = request(
        &server.addr,
        "POST",
        "/v1/chat/completions",
        Some(&chat.to_string()),
    );
    assert_eq!(status, 200, "{answer:#}");
    assert_eq!(answer["usage"]["media"][0]["plugin"]["name"], "image");
}

#[test]
fn several_items_share_one_budget_and_a_budget_too_small_says_what_it_needs() {
    let server = Server::start(&[]);
    let images = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/image");
    let config = std::fs::read_to_string(images.join("configs/qwen2-vl.json")).unwrap();
    let urls: Vec<String> = ["png-rgb-wide.png", "png-grey.png", "png-rgba.png"]
        .iter()
        .map(|f| {
            let data = std::fs::read(images.join("images").join(f)).unwrap();
            format!(
                "data:image/png;base64,{}",
                base64::engine::general_purpose::STANDARD.encode(data)
            )
        })
        .collect();
    let media = serde_json::json!(urls);
    let all_within = |max_tokens: u32| {
        let body = format!(
            r#"{{"media": {media}, "processor_config": {config}, "max_tokens": {max_tokens}}}"#
        );
        request(&server.addr, "POST", "/v1/preprocess", Some(&body))
    };

    // Natively 22 + 14 + 16 = 52 tokens: all fit in 52, none is cut.
    let (status, all) = all_within(52);
    assert_eq!(status, 200, "{all:#}");
    assert_eq!(all["tokens"], 52);
    assert!(
        all["data"]
            .as_array()
            .unwrap()
            .iter()
            .all(|item| item["reduced"] == false)
    );

    // In 30 tokens they share: the total fits, something is cut, each item is preprocessed as planned.
    let (status, shared) = all_within(30);
    assert_eq!(status, 200, "{shared:#}");
    let items = shared["data"].as_array().unwrap();
    let total: u64 = items.iter().map(|i| i["tokens"].as_u64().unwrap()).sum();
    assert_eq!(shared["tokens"], total);
    assert!(total <= 30, "{shared:#}");
    assert!(
        items.iter().any(|item| item["reduced"] == true),
        "{shared:#}"
    );
    for item in items {
        // What was preprocessed is what was planned: Qwen2-VL merges 4 patches into one token.
        let patches = item["tensors"][0]["shape"][0].as_u64().unwrap();
        assert_eq!(patches, 4 * item["tokens"].as_u64().unwrap(), "{item:#}");
    }

    // Below the cheapest plans of all three: refused, with what the media needs.
    let (status, refused) = all_within(5);
    assert_eq!(status, 400);
    assert_eq!(refused["error"]["code"], "context_length_exceeded");
    assert!(
        refused["error"]["message"]
            .as_str()
            .unwrap()
            .contains("needs at least"),
        "{refused:#}"
    );
    let (status, _) = request(&server.addr, "GET", "/health", None);
    assert_eq!(status, 200);
}
