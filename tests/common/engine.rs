//! The engine venv the end-to-end tests run real inference servers from: transformers' server and
//! vLLM's CPU build, pinned in tests/fixtures/engine/ and installed by `./dev test` outside the
//! clone.

use std::io::{BufRead as _, BufReader, Write as _};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The engine venv: `MMGATE_ENGINE_VENV` (set by `./dev test`), else the default place `./dev test`
/// installs it, holding `entry` (`bin/transformers`, or vLLM's package). `None` (the test says why
/// and passes) only outside CI: in CI a missing engine is a failure, never a skip.
pub fn engine_venv(entry: &str) -> Option<PathBuf> {
    let venv = std::env::var_os("MMGATE_ENGINE_VENV")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .map(|home| PathBuf::from(home).join(".cache/mmgate/engine-venv"))
        })?;
    if venv.join(entry).exists() {
        return Some(venv);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "the engine venv {} has no {entry}: ./dev test installs it",
        venv.display()
    );
    eprintln!(
        "skipping: no {entry} in the engine venv at {} (./dev test installs it)",
        venv.display()
    );
    None
}

/// A copy of `model` beside it without its weights: what `media = "preprocess"` needs of it.
pub fn weightless(model: &Path) -> PathBuf {
    let copy = model.with_extension("weightless");
    std::fs::create_dir_all(&copy).unwrap();
    for entry in std::fs::read_dir(model).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "safetensors") {
            std::fs::copy(&path, copy.join(path.file_name().unwrap())).unwrap();
        }
    }
    copy
}

/// A demo checkpoint (`spec`: `demo`, `demo-audio`; its directory's name holds `family`) as
/// transformers 5 lays one out: its processor reads the chat template from `chat_template.jinja`
/// (the demo keeps it in `tokenizer_config.json`, which mmgate reads too).
pub fn demo_checkpoint(into: &Path, spec: &str, family: &str) -> PathBuf {
    super::run_ok(
        super::mmgate_command()
            .args(["generate", "--model", spec, "--max-tokens", "1"])
            .args(["--prompt", "hi"]),
    );
    let demo = super::demo_model_dir(family);
    let model = into.join(format!("demo-{family}"));
    std::fs::create_dir_all(&model).unwrap();
    for entry in std::fs::read_dir(&demo).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), model.join(entry.file_name())).unwrap();
    }
    let tokenizer_config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(model.join("tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    std::fs::write(
        model.join("chat_template.jinja"),
        tokenizer_config["chat_template"].as_str().unwrap(),
    )
    .unwrap();
    model
}

/// Where vLLM's package lies in a venv (its CPU build installs it as `vllm`).
pub fn vllm_package(venv: &Path) -> Option<PathBuf> {
    let lib = std::fs::read_dir(venv.join("lib")).ok()?;
    lib.filter_map(|e| e.ok())
        .map(|e| e.path().join("site-packages/vllm"))
        .find(|p| p.is_dir())
}

/// vLLM's OpenAI-compatible server (its CPU build) on one model directory, forked by the binary's
/// [`Zygote`]; stopped with its process group when dropped; its log is shown if the test fails.
pub struct Vllm {
    pid: u32,
    pub addr: String,
    log: PathBuf,
}

impl Drop for Vllm {
    fn drop(&mut self) {
        // The server's process group: vLLM's engine, were it a process of its own, goes too.
        let group = format!("-{}", self.pid);
        let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
        // Gone before the next server starts: its memory and port are free again.
        let deadline = Instant::now() + Duration::from_secs(60);
        while running(self.pid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        if std::thread::panicking() {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(60).collect();
            eprintln!("vLLM's log, last lines:");
            for line in tail.into_iter().rev() {
                eprintln!("{line}");
            }
        }
    }
}

/// Whether process `pid` runs (not gone, not a zombie waiting to be reaped).
fn running(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // The state follows the command's name, which may hold anything but ends at the last ')'.
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.trim_start().chars().next());
    !matches!(state, None | Some('Z' | 'X'))
}

/// One Python process per test binary that has imported vLLM (about 13 s of a tiny server's 21 s
/// start here): servers and checkpoint scripts are forked from it
/// (tests/fixtures/vllm/zygote.py), each running as its own `python` would.
struct Zygote {
    _process: Child,
    requests: ChildStdin,
    answers: BufReader<ChildStdout>,
    log: PathBuf,
}

impl Zygote {
    fn start(venv: &Path) -> Zygote {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/vllm/zygote.py");
        let log = std::env::temp_dir().join(format!("mmgate-zygote-{}.log", std::process::id()));
        let mut process = Command::new(venv.join("bin/python"))
            .arg(script)
            .env("VLLM_TARGET_DEVICE", "cpu")
            // GiB of KV cache: the tiny models need little.
            .env("VLLM_CPU_KVCACHE_SPACE", "1")
            .env("HF_HUB_OFFLINE", "1")
            .env("VLLM_NO_USAGE_STATS", "1")
            // The engine core in the server's own process: otherwise a second Python process
            // imports torch and vLLM again, a quarter of every start here.
            .env("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start the vLLM zygote");
        Zygote {
            requests: process.stdin.take().unwrap(),
            answers: BufReader::new(process.stdout.take().unwrap()),
            _process: process,
            log,
        }
    }

    /// Forks `request` (zygote.py's form): the new process's pid.
    fn fork(&mut self, request: &serde_json::Value) -> u32 {
        let mut answer = String::new();
        let asked = writeln!(self.requests, "{request}").and_then(|()| self.requests.flush());
        let read = asked.and_then(|()| self.answers.read_line(&mut answer));
        let pid = serde_json::from_str::<serde_json::Value>(&answer)
            .ok()
            .and_then(|a| a["pid"].as_u64());
        match (&read, pid) {
            (Ok(_), Some(pid)) => pid as u32,
            _ => panic!(
                "the vLLM zygote failed ({read:?}): {}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            ),
        }
    }
}

/// The binary's zygote, started on first use.
fn zygote(venv: &Path) -> std::sync::MutexGuard<'static, Zygote> {
    static ZYGOTE: OnceLock<Mutex<Zygote>> = OnceLock::new();
    let zygote = ZYGOTE.get_or_init(|| Mutex::new(Zygote::start(venv)));
    zygote
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Runs the Python `script` with `args` as `python script args...` would, forked from the
/// binary's zygote (torch and transformers already imported); panics with its output if it fails.
pub fn run_python_script(venv: &Path, script: &Path, args: &[&str]) {
    let log = tempfile::NamedTempFile::new().unwrap().into_temp_path();
    let request = serde_json::json!({
        "script": script, "argv": args, "log": log.to_str().unwrap(),
    });
    let pid = zygote(venv).fork(&request);
    let status_file = format!("{}.status", log.display());
    while running(pid) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = std::fs::read_to_string(&status_file).unwrap_or_default();
    let _ = std::fs::remove_file(&status_file);
    assert_eq!(
        status.trim(),
        "0",
        "{} {args:?} failed: {}",
        script.display(),
        std::fs::read_to_string(&log).unwrap_or_default()
    );
}

impl Vllm {
    /// Starts it with `args` beyond the model, its context and float32, and waits for its health.
    pub fn start(venv: &Path, model: &Path, max_model_len: usize, args: &[&str]) -> Vllm {
        Self::start_with_env(venv, model, max_model_len, args, &[])
    }

    /// vLLM's render server on `model` (tests/fixtures/vllm/render.py: its frontend with no engine
    /// and no weights, which renders a chat request into the token ids the engine would get) behind
    /// a stand-in engine at [`Vllm::addr`] that answers each chat completion with one word and
    /// vLLM's count of its prompt. For tests of a family's counts: a start is a fraction of a
    /// server's, and the count is vLLM's own code's.
    pub fn render(venv: &Path, model: &Path, max_model_len: usize, args: &[&str]) -> Vllm {
        let port = super::server::free_port();
        let log = model.with_extension("render.log");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/vllm/render.py");
        let mut argv: Vec<String> = ["--model", model.to_str().unwrap(), "--max-model-len"]
            .map(str::to_owned)
            .to_vec();
        argv.push(max_model_len.to_string());
        argv.extend(["--host", "127.0.0.1", "--port"].map(str::to_owned));
        argv.push(port.to_string());
        argv.extend(args.iter().map(|a| a.to_string()));
        let request = serde_json::json!({"script": script, "argv": argv, "log": log});
        let pid = zygote(venv).fork(&request);
        let render = format!("127.0.0.1:{port}");
        let vllm = Vllm {
            pid,
            addr: counting_engine(render.clone()),
            log,
        };
        vllm.wait_for_health(&render);
        vllm
    }

    /// [`Self::start`] with `env` set besides.
    pub fn start_with_env(
        venv: &Path,
        model: &Path,
        max_model_len: usize,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Vllm {
        let port = super::server::free_port();
        let log = model.with_extension("vllm.log");
        let mut argv: Vec<String> = vec![
            "--model".into(),
            model.to_str().unwrap().into(),
            "--dtype".into(),
            "float32".into(),
            "--max-model-len".into(),
            max_model_len.to_string(),
            "--host".into(),
            "127.0.0.1".into(),
            "--port".into(),
            port.to_string(),
            // Eager, as vLLM's own CPU CI runs: on CPU the default compiles the model with
            // TorchInductor at every start (C++ built by the system compiler), which doubled a
            // start of a tiny checkpoint here and changes no count or answer these tests compare.
            "--enforce-eager".into(),
        ];
        argv.extend(args.iter().map(|a| a.to_string()));
        let env: serde_json::Map<String, serde_json::Value> = env
            .iter()
            .map(|(k, v)| (k.to_string(), (*v).into()))
            .collect();
        let request = serde_json::json!({"argv": argv, "env": env, "log": log});
        let pid = zygote(venv).fork(&request);
        let vllm = Vllm {
            pid,
            addr: format!("127.0.0.1:{port}"),
            log,
        };
        vllm.wait_for_health(&vllm.addr);
        vllm
    }

    /// Waits until the server at `addr` answers its `/health`.
    fn wait_for_health(&self, addr: &str) {
        let client = reqwest::blocking::Client::new();
        let health = format!("http://{addr}/health");
        let deadline = Instant::now() + Duration::from_secs(600);
        while !client
            .get(&health)
            .send()
            .is_ok_and(|r| r.status().is_success())
        {
            assert!(running(self.pid), "vLLM exited during start-up");
            assert!(Instant::now() < deadline, "vLLM did not start in 600 s");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A stand-in engine on loopback in front of vLLM's render server at `render`: each chat
/// completion POSTed to it is rendered there and answered with one word and the rendered prompt's
/// length as `usage.prompt_tokens` (streamed when asked); a refusal of the render server's is
/// relayed as it came. Any other request (health checks) is answered `{}`. Its address.
fn counting_engine(render: String) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let render = render.clone();
            std::thread::spawn(move || answer_with_counts(stream, &render));
        }
    });
    addr
}

/// [`counting_engine`]'s answers on one connection, until it closes.
fn answer_with_counts(stream: TcpStream, render: &str) {
    let client = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .unwrap();
    let Ok(read_half) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(read_half);
    let mut stream = stream;
    while let Some((request_line, body)) = super::read_request(&mut reader) {
        let (status, content_type, answer) = if request_line.starts_with("POST") {
            counted_answer(&client, render, body)
        } else {
            (200, "application/json", "{}".to_owned())
        };
        let head = format!(
            "HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n\r\n",
            answer.len()
        );
        if stream.write_all(head.as_bytes()).is_err()
            || stream.write_all(answer.as_bytes()).is_err()
        {
            return;
        }
    }
}

/// The chat completion `body` rendered by vLLM at `render`, as an engine's answer would count it:
/// (status, content type, body).
fn counted_answer(
    client: &reqwest::blocking::Client,
    render: &str,
    body: Vec<u8>,
) -> (u16, &'static str, String) {
    let request: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let rendered = client
        .post(format!("http://{render}/v1/chat/completions/render"))
        .header("content-type", "application/json")
        .body(body)
        .send();
    let rendered = match rendered {
        Ok(r) if r.status().is_success() => r.json::<serde_json::Value>().unwrap_or_default(),
        Ok(r) => {
            return (
                r.status().as_u16(),
                "application/json",
                r.text().unwrap_or_default(),
            );
        }
        Err(e) => return (502, "text/plain", e.to_string()),
    };
    let prompt = rendered["token_ids"].as_array().map_or(0, Vec::len);
    let usage = serde_json::json!({
        "prompt_tokens": prompt, "completion_tokens": 1, "total_tokens": prompt + 1,
    });
    let model = request["model"].clone();
    if request["stream"] == true {
        let chunk = serde_json::json!({"id": "render", "object": "chat.completion.chunk",
            "created": 0, "model": model, "choices": [{"index": 0,
            "delta": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}]});
        let last = serde_json::json!({"id": "render", "object": "chat.completion.chunk",
            "created": 0, "model": model, "choices": [], "usage": usage});
        let events = format!("data: {chunk}\n\ndata: {last}\n\ndata: [DONE]\n\n");
        return (200, "text/event-stream", events);
    }
    let completion = serde_json::json!({"id": "render", "object": "chat.completion", "created": 0,
        "model": model, "choices": [{"index": 0, "finish_reason": "length",
        "message": {"role": "assistant", "content": "ok"}}], "usage": usage});
    (200, "application/json", completion.to_string())
}
