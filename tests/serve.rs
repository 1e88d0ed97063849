//! `mmgate serve` on its embedded default: the real binary, real pingora, real HTTP over loopback.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// Kills the server when the test ends, however it ends.
struct Server {
    child: Child,
    addr: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn start() -> Server {
    let addr = format!("127.0.0.1:{}", free_port());
    let child = common::mmgate_command()
        .args(["serve", "--listen", &addr])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start mmgate serve");
    let mut server = Server { child, addr };
    // Start-up compiles the built-in plugins; give it generous time, but notice if it died.
    let deadline = Instant::now() + Duration::from_secs(120);
    while TcpStream::connect(&server.addr).is_err() {
        if let Some(status) = server.child.try_wait().unwrap() {
            panic!("mmgate serve exited during start-up: {status}");
        }
        assert!(
            Instant::now() < deadline,
            "mmgate serve did not start listening"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    server
}

/// One HTTP/1.1 request; returns (status, body).
fn request(addr: &str, method: &str, path: &str) -> (u16, serde_json::Value) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
    )
    .unwrap();
    let mut response = Vec::new();
    stream.read_to_end(&mut response).unwrap();
    let text = String::from_utf8_lossy(&response);
    let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP response");
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/json"),
        "{head}"
    );
    (status, serde_json::from_str(body).expect(body))
}

#[test]
fn serves_health_plugins_and_openai_shaped_errors() {
    let server = start();
    let (status, body) = request(&server.addr, "GET", "/health");
    assert_eq!((status, body["status"].as_str()), (200, Some("ok")));

    let (status, body) = request(&server.addr, "GET", "/v1/plugins");
    assert_eq!(status, 200);
    assert_eq!(body["host_contract_version"], "0.1.0");
    assert!(
        body["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["name"] == "image"),
        "{body}"
    );

    let (status, body) = request(&server.addr, "GET", "/no/such/route");
    assert_eq!(status, 404);
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert_eq!(body["error"]["code"], "not_found");

    let (status, body) = request(&server.addr, "DELETE", "/health");
    assert_eq!(status, 405);
    assert_eq!(body["error"]["code"], "method_not_allowed");

    // Still serving after the errors.
    let (status, _) = request(&server.addr, "GET", "/health");
    assert_eq!(status, 200);
}
