//! The web console: served by the real `mmgate serve`, driven in headless Chromium (Debian's
//! `chromium` and `chromium-driver`, through Selenium from the console venv that `./dev test`
//! installs) by tests/fixtures/console/console.py, which checks what the page shows against the
//! API; and the plan route it draws from, over raw HTTP.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::server::Server;
use serde_json::{Value, json};

const KEY: &str = "console-test-key";

fn start(config: &str) -> (Server, tempfile::TempDir) {
    Server::with_config(config)
}

/// The console venv's Python, with Chromium and its driver beside it; `None` (the test says why
/// and passes) only outside CI: in CI a missing browser is a failure, never a skip.
fn browser() -> Option<PathBuf> {
    let venv = std::env::var_os("MMGATE_CONSOLE_VENV")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .map(|home| PathBuf::from(home).join(".cache/mmgate/console-venv"))
        })?;
    let python = venv.join("bin/python");
    let present = [
        python.as_path(),
        Path::new("/usr/bin/chromium"),
        Path::new("/usr/bin/chromedriver"),
    ];
    if let Some(missing) = present.iter().find(|p| !p.exists()) {
        assert!(
            std::env::var_os("CI").is_none(),
            "{} is missing: ./dev test installs it",
            missing.display()
        );
        eprintln!(
            "skipping: {} is missing (./dev test installs it)",
            missing.display()
        );
        return None;
    }
    Some(python)
}

#[test]
fn the_console_shows_what_the_api_says_in_a_real_browser() {
    let Some(python) = browser() else {
        return;
    };
    let (server, _dir) = start(&format!("api_keys = [\"{KEY}\"]\n"));
    // Chromium takes uploads by canonical paths only.
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .unwrap();
    let shots = Path::new(env!("CARGO_TARGET_TMPDIR")).join("console-screenshots");
    std::fs::create_dir_all(&shots).unwrap();
    let output = common::run_ok(
        Command::new(python)
            .arg(root.join("tests/fixtures/console/console.py"))
            .arg(format!("http://{}", server.addr))
            .arg(KEY)
            .arg(root.join("tests/fixtures"))
            .arg(&shots),
    );
    let lines: Vec<Value> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{line}: {e}")))
        .collect();
    // Every check ran and held (the script stops at the first that fails).
    let checks = lines.iter().filter(|l| l["ok"] == true).count();
    assert!(checks >= 20, "{lines:#?}");
    for page in ["try", "audio", "document", "models", "plugins", "live"] {
        let shot = shots.join(format!("console-{page}.png"));
        assert!(
            std::fs::metadata(&shot).unwrap().len() > 10_000,
            "{}",
            shot.display()
        );
    }
    eprintln!("screenshots in {}", shots.display());
}

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(120))
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

fn plan(server: &Server, body: &Value) -> (u16, Value) {
    let response = client()
        .post(format!("http://{}/v1/preprocess", server.addr))
        .json(body)
        .send()
        .unwrap();
    (response.status().as_u16(), response.json().unwrap())
}

#[test]
fn the_console_is_served_locked_down_and_the_plan_route_refuses_what_it_cannot_plan() {
    // An upstream whose media are planned here (Llama 4's processor, no server needed to plan) and
    // one that gets them as they came.
    let counts = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/vllm/counts");
    let (server, _dir) = start(&format!(
        "[[models]]\nname = \"llama4\"\nupstreams = [\"127.0.0.1:9\"]\nmedia = \"preprocess\"\n\
         path = {:?}\n\n[[models]]\nname = \"elsewhere\"\nupstreams = [\"127.0.0.1:9\"]\n\n\
         [[models]]\nname = \"demo\"\npath = \"demo\"\n\n\
         [[models]]\nname = \"demo-audio\"\npath = \"demo-audio\"\n",
        counts.join("llama4")
    ));
    let base = format!("http://{}", server.addr);
    let home = client().get(format!("{base}/")).send().unwrap();
    assert_eq!(home.status(), 302);
    assert_eq!(home.headers()["location"], "/console");
    let page = client().get(format!("{base}/console")).send().unwrap();
    assert_eq!(page.status(), 200);
    let policy = page.headers()["content-security-policy"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(policy.contains("script-src 'self'") && policy.contains("frame-ancestors 'none'"));
    assert!(page.text().unwrap().contains("/console/console.js"));
    let missing = client()
        .get(format!("{base}/console/nothing.js"))
        .send()
        .unwrap();
    assert_eq!(missing.status(), 404);

    // The plan of a chat request: the image at its planned size, the text's share, the budget.
    let image = common::image_url_part("image/images/photo-640x480.jpg");
    let messages = json!([{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]);
    let (status, planned) = plan(
        &server,
        &json!({"model": "demo", "messages": messages, "max_tokens": 8, "pictures": true}),
    );
    assert_eq!(status, 200, "{planned}");
    assert_eq!(planned["object"], "chat.plan");
    let item = &planned["media"][0];
    let picture = item["picture"]["image"].as_str().unwrap();
    assert!(picture.starts_with("data:image/png;base64,"));
    let tokens = item["tokens"].as_u64().unwrap();
    assert_eq!(
        planned["text_tokens"].as_u64().unwrap() + tokens,
        planned["prompt_tokens"].as_u64().unwrap()
    );
    // A model whose server plans nothing itself: the same, the picture the file it is sent.
    let (status, upstream) = plan(
        &server,
        &json!({"model": "llama4", "messages": messages, "max_tokens": 8, "pictures": true}),
    );
    assert_eq!(status, 200, "{upstream}");
    let picture = upstream["media"][0]["picture"]["image"].as_str().unwrap();
    assert!(picture.starts_with("data:image/"), "{upstream}");
    // Without `pictures`, no pictures.
    let (_, bare) = plan(&server, &json!({"model": "demo", "messages": messages}));
    assert!(bare["media"][0].get("picture").is_none(), "{bare}");

    // What cannot be planned is refused with the reason, and the server serves on.
    let (status, error) = plan(&server, &json!({"messages": messages}));
    assert_eq!(
        (status, error["error"]["code"].as_str()),
        (400, Some("invalid_request"))
    );
    let (status, error) = plan(&server, &json!({"model": "nobody", "messages": messages}));
    assert_eq!(
        (status, error["error"]["code"].as_str()),
        (404, Some("model_not_found"))
    );
    let (status, error) = plan(
        &server,
        &json!({"model": "elsewhere", "messages": messages}),
    );
    assert_eq!(status, 400, "{error}");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("forwards media")
    );
    let audio = json!([{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,UklGRg=="}}]}]);
    let (status, error) = plan(
        &server,
        &json!({"model": "demo-audio", "messages": audio, "pictures": true}),
    );
    assert_eq!(status, 415, "{error}");
    let (status, _) = plan(&server, &json!({"model": "demo", "messages": messages}));
    assert_eq!(status, 200);
}
