//! `mmgate serve` on its embedded default: the real binary, real pingora, real HTTP over loopback.

use crate::common;

use common::server::{Server, request};

#[test]
fn serves_health_plugins_and_openai_shaped_errors() {
    let server = Server::start(&[]);
    let (status, body) = request(&server.addr, "GET", "/health", None);
    assert_eq!((status, body["status"].as_str()), (200, Some("ok")));

    let (status, body) = request(&server.addr, "GET", "/v1/plugins", None);
    assert_eq!(status, 200);
    assert_eq!(body["host_contract_version"], "0.5.1");
    assert!(
        body["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["name"] == "image"),
        "{body}"
    );

    let (status, body) = request(&server.addr, "GET", "/no/such/route", None);
    assert_eq!(status, 404);
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert_eq!(body["error"]["code"], "not_found");

    let (status, body) = request(&server.addr, "DELETE", "/health", None);
    assert_eq!(status, 405);
    assert_eq!(body["error"]["code"], "method_not_allowed");

    // Still serving after the errors.
    let (status, _) = request(&server.addr, "GET", "/health", None);
    assert_eq!(status, 200);
}

/// Started under a low soft limit on open files (as many systems set 1 024), the gateway raises it
/// to what `connections.max` needs (twice it, plus room), as far as the hard limit allows.
#[test]
fn the_open_files_limit_is_raised_for_the_connections_allowed() {
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap();
    let hard: u64 = open_files(&limits).1;
    let addr = format!("127.0.0.1:{}", common::server::free_port());
    let child = std::process::Command::new("prlimit")
        .arg(format!("--nofile=256:{hard}"))
        .arg(env!("CARGO_BIN_EXE_mmgate"))
        .env("RUST_LOG", "warn")
        .args(["serve", "--listen", &addr])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("prlimit (util-linux)");
    let mut server = common::server::Server { child, addr };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while request_status(&server.addr) != Some(200) {
        assert!(
            std::time::Instant::now() < deadline,
            "the gateway did not start"
        );
        assert!(
            server.child.try_wait().unwrap().is_none(),
            "the gateway exited"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let theirs = std::fs::read_to_string(format!("/proc/{}/limits", server.child.id())).unwrap();
    let wanted = 4096 * 2 + 256;
    assert_eq!(open_files(&theirs).0, wanted.min(hard), "{theirs}");
    drop(server);
}

/// The (soft, hard) "Max open files" of a /proc/PID/limits text.
fn open_files(limits: &str) -> (u64, u64) {
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    let numbers: Vec<u64> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    (numbers[0], numbers[1])
}

/// The status of `GET /health`, or `None` while the gateway cannot answer it yet (not listening,
/// or a connection reset while it starts).
fn request_status(addr: &str) -> Option<u16> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).ok()?;
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(60)))
        .ok()?;
    write!(
        stream,
        "GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).ok()?;
    let head = String::from_utf8_lossy(&response);
    head.split(' ').nth(1)?.parse().ok()
}

/// A model placed on a GPU (`cuda:N`) on a machine without the NVIDIA driver (as CI's): the gateway
/// refuses to start, saying in one line which device of which model needs what. The same config
/// on a GPU machine loads the encoder on GPU 1 and the LLM on GPU 0 (`./dev gpu-check`).
#[test]
fn a_gpu_device_without_a_driver_fails_at_start_with_one_clear_line() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("mmgate.toml");
    std::fs::write(
        &config,
        format!(
            "listen = \"127.0.0.1:{}\"\n\
             [[models]]\nname = \"demo\"\npath = \"demo\"\nllm_device = \"cuda:0\"\n\
             encoder_devices = [{{ device = \"cuda:1\" }}]\n",
            common::server::free_port()
        ),
    )
    .unwrap();
    let out = common::mmgate(&["serve", "--config", config.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started without a GPU: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line, got: {stderr}");
    for part in ["demo", "encoder device 0", "cuda:1", "cannot be loaded"] {
        assert!(lines[0].contains(part), "{part:?} missing from: {stderr}");
    }

    // A device name that is neither is a config error before anything loads.
    std::fs::write(
        &config,
        "[[models]]\nname = \"demo\"\npath = \"demo\"\nencoder_devices = [{ device = \"gpu1\" }]\n",
    )
    .unwrap();
    let out = common::mmgate(&["serve", "--config", config.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("device \"gpu1\": expected \"cpu\" or \"cuda:N\""),
        "{stderr}"
    );
}
