//! An OTLP trace receiver on loopback (tests/fixtures/traces/receiver.py, OpenTelemetry's own
//! protobuf definitions from the engine venv): what the gateway and vLLM export, span by span.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use serde_json::Value;

pub struct Receiver {
    child: Child,
    /// `http://127.0.0.1:PORT`: an `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub endpoint: String,
    spans: PathBuf,
    _dir: tempfile::TempDir,
}

impl Receiver {
    pub fn start(venv: &Path) -> Receiver {
        let dir = tempfile::tempdir().unwrap();
        let (port_file, spans) = (dir.path().join("port"), dir.path().join("spans.jsonl"));
        let script =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/traces/receiver.py");
        let mut child = Command::new(venv.join("bin/python"))
            .arg(script)
            .arg(&port_file)
            .arg(&spans)
            .spawn()
            .unwrap();
        let started = Instant::now();
        let port = loop {
            if let Ok(port) = std::fs::read_to_string(&port_file) {
                break port;
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!("the trace receiver exited: {status}");
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "the trace receiver did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        Receiver {
            child,
            endpoint: format!("http://127.0.0.1:{}", port.trim()),
            spans,
            _dir: dir,
        }
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.spans)
            .unwrap_or_default()
            .lines()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect()
    }

    /// The spans of trace `id` once `done` holds of them (export is batched: they come in their
    /// own time); a panic after a minute.
    pub fn trace(&self, id: &str, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
        let started = Instant::now();
        loop {
            let spans: Vec<Value> = self
                .spans()
                .into_iter()
                .filter(|s| s["trace_id"] == id)
                .collect();
            if done(&spans) {
                return spans;
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "trace {id} incomplete after a minute: {spans:#?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
