//! `mmgate serve` on its embedded default: the real binary, real pingora, real HTTP over loopback.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::server::{Server, request};

#[test]
fn serves_health_plugins_and_openai_shaped_errors() {
    let server = Server::start(&[]);
    let (status, body) = request(&server.addr, "GET", "/health", None);
    assert_eq!((status, body["status"].as_str()), (200, Some("ok")));

    let (status, body) = request(&server.addr, "GET", "/v1/plugins", None);
    assert_eq!(status, 200);
    assert_eq!(body["host_contract_version"], "0.3.0");
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
