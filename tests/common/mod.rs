//! What the end-to-end tests share: running the real `mmgate` binary.

pub mod engine;
pub mod files_server;
pub mod redis;
pub mod server;
pub mod traces;

use std::process::{Command, Output};

/// The built `mmgate` binary, with logs quiet enough that stderr carries only what a test checks,
/// caching in the tests' shared cache ([`server::demo_cache`]) unless a test sets its own.
pub fn mmgate_command() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_mmgate"));
    command
        .env("RUST_LOG", "warn")
        .env("XDG_CACHE_HOME", server::demo_cache());
    command
}

/// The newest demo model whose name holds `family` in the shared cache (once a command or server
/// made it): not another process's half-written one (a hidden directory), nor one of an older
/// demo version kept from an earlier run.
pub fn demo_model_dir(family: &str) -> std::path::PathBuf {
    let version = |path: &std::path::Path| {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let number = name
            .rsplit_once("-v")
            .and_then(|(_, v)| v.parse::<u32>().ok());
        (!name.starts_with('.') && name.contains(family))
            .then_some(number)
            .flatten()
    };
    std::fs::read_dir(server::demo_cache().join("mmgate/models"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter_map(|path| version(&path).map(|v| (v, path)))
        .max()
        .map(|(_, path)| path)
        .unwrap_or_else(|| panic!("the demo {family} directory"))
}

/// The bytes of `tests/fixtures/<path>`.
pub fn fixture(path: &str) -> Vec<u8> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
    std::fs::read(root.join(path)).unwrap_or_else(|e| panic!("fixture {path}: {e}"))
}

/// A chat `image_url` part holding `tests/fixtures/<path>` as a data URL.
pub fn image_url_part(path: &str) -> serde_json::Value {
    use base64::Engine as _;
    let data = base64::engine::general_purpose::STANDARD.encode(fixture(path));
    let mime = if path.ends_with(".png") {
        "image/png"
    } else {
        "image/jpeg"
    };
    serde_json::json!({"type": "image_url", "image_url": {"url": format!("data:{mime};base64,{data}")}})
}

/// Runs `command` to completion and checks it succeeded (its stderr says why not).
pub fn run_ok(command: &mut Command) -> Output {
    let out = command.output().expect("run the command");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Runs `mmgate ARGS...` to completion.
pub fn mmgate(args: &[&str]) -> Output {
    mmgate_command().args(args).output().expect("run mmgate")
}

/// Sets its flag when dropped, a panic's unwinding included: threads a test started to load the
/// machine stop however the test ends.
pub struct StopOnDrop<'a>(pub &'a std::sync::atomic::AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// OpenAI's Python SDK (the venv's) through the Responses API of the gateway at `addr`, on `model`
/// for each of `kinds` (tests/fixtures/responses/sdk.py, which checks each answer): the JSON
/// lines it printed, one per request.
pub fn responses_sdk(
    venv: &std::path::Path,
    addr: &str,
    model: &str,
    kinds: &[&str],
) -> Vec<serde_json::Value> {
    sdk_script(
        venv,
        "responses/sdk.py",
        &format!("http://{addr}/v1"),
        model,
        kinds,
    )
}

/// Anthropic's Python SDK (the venv's) through the Messages API of the gateway at `addr`, on
/// `model` for each of `kinds` (tests/fixtures/messages/sdk.py, which checks each answer and its
/// `count_tokens`): the JSON lines it printed, one per request.
pub fn messages_sdk(
    venv: &std::path::Path,
    addr: &str,
    model: &str,
    kinds: &[&str],
) -> Vec<serde_json::Value> {
    sdk_script(
        venv,
        "messages/sdk.py",
        &format!("http://{addr}"),
        model,
        kinds,
    )
}

/// An SDK script of tests/fixtures (`script`) run with the venv's Python on `base_url`, `model`
/// and `kinds`: the JSON lines it printed.
fn sdk_script(
    venv: &std::path::Path,
    script: &str,
    base_url: &str,
    model: &str,
    kinds: &[&str],
) -> Vec<serde_json::Value> {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(script);
    let output = run_ok(
        Command::new(venv.join("bin/python"))
            .arg(script)
            .arg(base_url)
            .arg(model)
            .args(kinds),
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{line}: {e}")))
        .collect()
}

/// One HTTP/1 request read from a connection a stand-in server holds: its request line and its
/// body (by its `content-length`); `None` once the connection ends.
pub fn read_request(reader: &mut impl std::io::BufRead) -> Option<(String, Vec<u8>)> {
    let mut request_line = String::new();
    if reader.read_line(&mut request_line).ok()? == 0 {
        return None;
    }
    let mut length = 0;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).ok()? == 0 {
            return None;
        }
        if let Some(value) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            length = value.trim().parse().ok()?;
        }
        if line == "\r\n" {
            break;
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).ok()?;
    Some((request_line, body))
}
