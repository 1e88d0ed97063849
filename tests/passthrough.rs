//! The passthrough lane on the wire: plain chat completions for an upstream model are relayed as
//! bytes, everything else is served by pingora's HTTP/1 session, and one client connection moves
//! between the two in order (pipelined requests included). The upstream's response framings
//! (Content-Length, chunked with extensions and trailers, close-delimited, a 100 Continue first, a
//! body cut short, not HTTP at all) reach the client as the upstream sent them, or as a clear error.
//! The upstreams are a real mmgate and a scripted HTTP/1.1 server that answers each case exactly.

use crate::common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::server::Server;
use serde_json::{Value, json};

fn start(config: &str) -> (Server, tempfile::TempDir) {
    Server::with_config(config)
}

fn connect(server: &Server) -> BufReader<TcpStream> {
    let stream = TcpStream::connect(&server.addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    BufReader::new(stream)
}

fn chat_request(model: &str, extra_headers: &str) -> String {
    let body = json!({"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "seed": 1})
        .to_string();
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n{extra_headers}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// One response: status, lower-cased headers, and the body as it was framed on the wire (chunked
/// bodies are returned with their framing, close-delimited ones read to the end).
struct Response {
    status: u16,
    headers: Vec<(String, String)>,
    raw_body: Vec<u8>,
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        let body = if self.header("transfer-encoding") == Some("chunked") {
            dechunk(&self.raw_body)
        } else {
            self.raw_body.clone()
        };
        serde_json::from_slice(&body)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&body)))
    }
}

fn read_response(reader: &mut BufReader<TcpStream>) -> Response {
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    let status = line
        .split(' ')
        .nth(1)
        .unwrap_or_else(|| panic!("not a status line: {line:?}"))
        .parse()
        .unwrap();
    let mut headers = Vec::new();
    loop {
        line.clear();
        reader.read_line(&mut line).unwrap();
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        let (name, value) = line.split_once(':').unwrap();
        headers.push((name.to_ascii_lowercase(), value.trim().to_owned()));
    }
    let mut response = Response {
        status,
        headers,
        raw_body: Vec::new(),
    };
    if (100..200).contains(&status) || status == 204 || status == 304 {
        // No body (RFC 9112 6.3).
    } else if let Some(length) = response.header("content-length") {
        let mut body = vec![0; length.parse().unwrap()];
        reader.read_exact(&mut body).unwrap();
        response.raw_body = body;
    } else if response.header("transfer-encoding") == Some("chunked") {
        response.raw_body = read_chunked_raw(reader);
    } else {
        reader.read_to_end(&mut response.raw_body).unwrap();
    }
    response
}

/// A chunked body as it came, up to and including the blank line after the last chunk.
fn read_chunked_raw(reader: &mut BufReader<TcpStream>) -> Vec<u8> {
    let mut raw = Vec::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        raw.extend_from_slice(line.as_bytes());
        let size = usize::from_str_radix(line.trim_end().split(';').next().unwrap(), 16).unwrap();
        if size == 0 {
            loop {
                let mut trailer = String::new();
                reader.read_line(&mut trailer).unwrap();
                raw.extend_from_slice(trailer.as_bytes());
                if trailer == "\r\n" {
                    return raw;
                }
            }
        }
        let mut data = vec![0; size + 2];
        reader.read_exact(&mut data).unwrap();
        raw.extend_from_slice(&data);
    }
}

fn dechunk(raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut rest = raw;
    loop {
        let end = rest.windows(2).position(|w| w == b"\r\n").unwrap();
        let size_text = std::str::from_utf8(&rest[..end]).unwrap();
        let size = usize::from_str_radix(size_text.split(';').next().unwrap(), 16).unwrap();
        rest = &rest[end + 2..];
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&rest[..size]);
        rest = &rest[size + 2..];
    }
}

fn send(client: &mut BufReader<TcpStream>, text: &str) {
    client.get_mut().write_all(text.as_bytes()).unwrap();
}

fn assert_completion(response: &Response) {
    assert_eq!(response.status, 200);
    let body = response.json();
    assert_eq!(body["object"], "chat.completion", "{body}");
    assert_eq!(body["model"], "demo");
}

/// GETs, lane chats, pipelined chats (two lane requests, then a lane request and a GET, in one
/// write each), a chunked request body (pingora's) and a `Connection: close` chat, all on one
/// connection, answered in order.
#[test]
fn one_connection_moves_between_the_lane_and_pingora_in_order() {
    let (back, _d1) = start("");
    let (front, _d2) = start(&format!(
        "models = [{{ name = \"demo\", upstreams = [\"{}\"] }}]\n",
        back.addr
    ));
    let mut client = connect(&front);
    let get = |path: &str| format!("GET {path} HTTP/1.1\r\nHost: gw\r\n\r\n");

    send(&mut client, &get("/v1/models"));
    let models = read_response(&mut client);
    assert_eq!(models.status, 200);
    assert_eq!(models.json()["data"][0]["id"], "demo");

    send(&mut client, &chat_request("demo", ""));
    let first = read_response(&mut client);
    assert_completion(&first);

    send(
        &mut client,
        &format!("{}{}", chat_request("demo", ""), chat_request("demo", "")),
    );
    for _ in 0..2 {
        let again = read_response(&mut client);
        assert_completion(&again);
        assert_eq!(
            again.json()["choices"],
            first.json()["choices"],
            "same seed"
        );
    }

    send(
        &mut client,
        &format!("{}{}", chat_request("demo", ""), get("/health")),
    );
    assert_completion(&read_response(&mut client));
    let health = read_response(&mut client);
    assert_eq!(
        (health.status, health.json()["status"].clone()),
        (200, json!("ok"))
    );
    // And the other way round: what pingora read past its request comes back to the lane.
    send(
        &mut client,
        &format!("{}{}", get("/health"), chat_request("demo", "")),
    );
    assert_eq!(read_response(&mut client).status, 200);
    assert_completion(&read_response(&mut client));

    // A chunked request body is pingora's to read; it forwards it all the same.
    let body = json!({"model": "demo", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "seed": 1})
        .to_string();
    let (a, b) = body.split_at(10);
    send(
        &mut client,
        &format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{a}\r\n{:x}\r\n{b}\r\n0\r\n\r\n",
            a.len(),
            b.len()
        ),
    );
    let chunked = read_response(&mut client);
    assert_completion(&chunked);
    assert_eq!(chunked.json()["choices"], first.json()["choices"]);

    // Malformed JSON for the lane's path: the lane leaves it to the full route, which says why.
    send(
        &mut client,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 5\r\n\r\n{oops",
    );
    let bad = read_response(&mut client);
    assert_eq!(bad.status, 400);
    assert_eq!(bad.json()["error"]["code"], "invalid_request");

    send(&mut client, &chat_request("demo", "Connection: close\r\n"));
    assert_completion(&read_response(&mut client));
    let mut rest = Vec::new();
    client.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty(), "the connection closed after the answer");
}

/// What the scripted upstream saw of one request.
#[derive(Clone, Debug)]
struct Seen {
    connection: usize,
    case: String,
    head: String,
    body: Vec<u8>,
}

/// An HTTP/1.1 server answering each request as its `x-case` header says (keeping connections
/// alive where the case allows), recording what it got.
fn scripted_upstream() -> (String, Arc<Mutex<Vec<Seen>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    std::thread::spawn(move || {
        let connections = AtomicUsize::new(0);
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            let connection = connections.fetch_add(1, Ordering::Relaxed);
            let log = log.clone();
            std::thread::spawn(move || serve_scripted(stream, connection, &log));
        }
    });
    (addr, seen)
}

const CHUNKS: [&str; 3] = [
    "7;ext=1\r\ndata: 1\r\n",
    "9\r\n\ndata: 2\n\r\n",
    "0\r\nx-trailer: t\r\n\r\n",
];
/// What the `flood` case sends at most, and what each flood came to: bytes written, and whether
/// the gateway dropped the connection before the end.
const FLOOD_BYTES: usize = 512 << 20;
static FLOODS: Mutex<Vec<(usize, bool)>> = Mutex::new(Vec::new());

const JSON_BODY: &str = r#"{"object":"chat.completion","model":"demo","choices":[]}"#;

fn serve_scripted(stream: TcpStream, connection: usize, log: &Mutex<Vec<Seen>>) {
    let mut reader = BufReader::new(stream);
    loop {
        let mut head = String::new();
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            head.push_str(&line);
            if line == "\r\n" {
                break;
            }
        }
        let header = |name: &str| {
            head.lines()
                .find_map(|l| {
                    let (n, v) = l.split_once(':')?;
                    n.eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
                })
                .unwrap_or_default()
        };
        let mut body = vec![0; header("content-length").parse().unwrap_or(0)];
        reader.read_exact(&mut body).unwrap();
        let case = header("x-case");
        log.lock().unwrap().push(Seen {
            connection,
            case: case.clone(),
            head: head.clone(),
            body,
        });
        let out = reader.get_mut();
        let keep_open = match case.as_str() {
            "length" => {
                write!(
                    out,
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nKeep-Alive: timeout=5\r\nContent-Length: {}\r\n\r\n{JSON_BODY}",
                    JSON_BODY.len()
                )
                .unwrap();
                true
            }
            "chunked" => {
                write!(out, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n").unwrap();
                for chunk in CHUNKS {
                    // Split across writes, and within a chunk.
                    let (a, b) = chunk.split_at(chunk.len() / 2);
                    for part in [a, b] {
                        out.write_all(part.as_bytes()).unwrap();
                        out.flush().unwrap();
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
                true
            }
            "continue" => {
                write!(out, "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: {}\r\n\r\n{JSON_BODY}", JSON_BODY.len()).unwrap();
                true
            }
            "hop" => {
                write!(
                    out,
                    "HTTP/1.1 200 OK\r\nConnection: keep-alive, X-Up-Hop\r\nX-Up-Hop: secret\r\nX-End: 1\r\nContent-Length: {}\r\n\r\n{JSON_BODY}",
                    JSON_BODY.len()
                )
                .unwrap();
                true
            }
            "both" => {
                write!(
                    out,
                    "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{JSON_BODY}\r\n0\r\n\r\n",
                    JSON_BODY.len()
                )
                .unwrap();
                true
            }
            // Takes the request and closes without a word: the request may have been acted on.
            "vanish" => return,
            "close" => {
                write!(
                    out,
                    "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n{JSON_BODY}"
                )
                .unwrap();
                false
            }
            "cut" => {
                write!(
                    out,
                    "HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n{JSON_BODY}"
                )
                .unwrap();
                false
            }
            // Takes the request and never answers (a wedged engine); the connection stays open.
            "silent" => {
                std::thread::sleep(Duration::from_secs(60));
                false
            }
            // A stream of events far larger than any buffer, sent as fast as it is taken; how much
            // went out, and whether the connection was dropped under it, go to FLOODS.
            "flood" => {
                write!(out, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n").unwrap();
                let event = format!("data: {}\n\n", "x".repeat(64 * 1024 - 8));
                let chunk = format!("{:x}\r\n{event}\r\n", event.len());
                let mut written = 0;
                let dropped = loop {
                    if written >= FLOOD_BYTES {
                        break false;
                    }
                    if out.write_all(chunk.as_bytes()).is_err() {
                        break true;
                    }
                    written += chunk.len();
                };
                FLOODS.lock().unwrap().push((written, dropped));
                return;
            }
            // A stream of events that dies after its first event (the engine killed mid-stream).
            "dies" => {
                write!(
                    out,
                    "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n{}",
                    CHUNKS[0]
                )
                .unwrap();
                false
            }
            _ => {
                write!(out, "SSH-2.0-not-http\r\n\r\n").unwrap();
                false
            }
        };
        out.flush().unwrap();
        if !keep_open {
            return;
        }
    }
}

#[test]
fn upstream_response_framings_reach_the_client_as_they_were_sent() {
    let (upstream, seen) = scripted_upstream();
    // One HTTP thread: kept-alive upstream connections are per thread, so reuse is deterministic.
    let (front, _d) = start(&format!(
        "http_threads = 1\nmodels = [{{ name = \"demo\", upstreams = [\"{upstream}\"], health_check = {{ path = \"\", interval_ms = 3600000 }} }}]\n"
    ));
    let case = |name: &str| format!("X-Case: {name}\r\nAuthorization: Bearer sk-client\r\n");
    let mut client = connect(&front);

    // Content-Length, three times on one client connection: one upstream connection carries all.
    for _ in 0..3 {
        send(&mut client, &chat_request("demo", &case("length")));
        let response = read_response(&mut client);
        assert_eq!(response.status, 200);
        assert_eq!(response.raw_body, JSON_BODY.as_bytes());
        assert_eq!(response.header("keep-alive"), None, "hop-by-hop dropped");
    }
    // Chunked, extensions and trailers included, byte for byte.
    send(&mut client, &chat_request("demo", &case("chunked")));
    let response = read_response(&mut client);
    assert_eq!(response.header("content-type"), Some("text/event-stream"));
    assert_eq!(response.raw_body, CHUNKS.concat().as_bytes());
    // A 100 Continue is the gateway's to drop; the final answer follows.
    send(&mut client, &chat_request("demo", &case("continue")));
    let response = read_response(&mut client);
    assert_eq!(response.status, 201);
    assert_eq!(response.raw_body, JSON_BODY.as_bytes());
    // A body that ends when the upstream closes ends the client's connection the same way.
    send(&mut client, &chat_request("demo", &case("close")));
    let response = read_response(&mut client);
    assert_eq!(response.header("connection"), Some("close"));
    assert_eq!(response.raw_body, JSON_BODY.as_bytes());

    {
        let seen = seen.lock().unwrap();
        let lengths: Vec<&Seen> = seen.iter().filter(|s| s.case == "length").collect();
        assert_eq!(lengths.len(), 3);
        assert!(
            lengths
                .iter()
                .all(|s| s.connection == lengths[0].connection),
            "{seen:?}"
        );
        let head = lengths[0].head.to_ascii_lowercase();
        assert!(head.starts_with("post /v1/chat/completions http/1.1\r\n"));
        assert!(head.contains(&format!("host: {upstream}\r\n")), "{head}");
        assert!(head.contains("authorization: bearer sk-client\r\n"));
        assert!(!head.contains("host: gw"));
    }

    // A body cut short: the client gets what came and the connection closes (there is no way to
    // say more on it); a response that is not HTTP is a 502; the gateway goes on serving.
    let mut client = connect(&front);
    send(&mut client, &chat_request("demo", &case("cut")));
    let mut cut = Vec::new();
    client.read_to_end(&mut cut).unwrap();
    let cut = String::from_utf8(cut).unwrap();
    assert!(cut.starts_with("HTTP/1.1 200 OK\r\n"), "{cut}");
    assert!(cut.ends_with(JSON_BODY), "{cut}");

    let mut client = connect(&front);
    send(&mut client, &chat_request("demo", &case("garbage")));
    let response = read_response(&mut client);
    assert_eq!(response.status, 502);
    assert_eq!(response.json()["error"]["code"], "upstream_failed");
    send(&mut client, &chat_request("demo", &case("length")));
    assert_eq!(read_response(&mut client).raw_body, JSON_BODY.as_bytes());
}

/// A gateway in front of the scripted upstream, one HTTP thread.
fn scripted_front() -> (Server, tempfile::TempDir, String, Arc<Mutex<Vec<Seen>>>) {
    scripted_front_with("")
}

/// The same with more top-level configuration.
fn scripted_front_with(extra: &str) -> (Server, tempfile::TempDir, String, Arc<Mutex<Vec<Seen>>>) {
    let (upstream, seen) = scripted_upstream();
    let (front, dir) = start(&format!(
        "{extra}http_threads = 1\nmodels = [{{ name = \"demo\", upstreams = [\"{upstream}\"], health_check = {{ path = \"\", interval_ms = 3600000 }} }}]\n"
    ));
    (front, dir, upstream, seen)
}

/// What a client got for `raw`: its response, and whether the connection then closed.
fn answer(front: &Server, raw: &[u8]) -> (Response, bool) {
    try_answer(front, raw).expect("a response")
}

/// The same; `None` when the connection closed with no response at all.
fn try_answer(front: &Server, raw: &[u8]) -> Option<(Response, bool)> {
    let mut client = connect(front);
    client.get_mut().write_all(raw).unwrap();
    if client.fill_buf().map_or(true, |b| b.is_empty()) {
        return None;
    }
    let response = read_response(&mut client);
    if response.header("content-length").is_none() && response.header("transfer-encoding").is_none()
    {
        return Some((response, true));
    }
    client
        .get_mut()
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let mut rest = [0u8; 1];
    let closed = matches!(client.read(&mut rest), Ok(0));
    Some((response, closed))
}

fn chat_body() -> String {
    json!({"model": "demo", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
        .to_string()
}

/// RFC 9112's framing rules at the proxy, each case as raw bytes: what the client gets, whether the
/// connection stays open, and what (if anything) the upstream got.
#[test]
fn requests_framed_ambiguously_are_refused_and_never_reach_the_upstream() {
    let (front, _d, _upstream, seen) = scripted_front();
    let body = chat_body();
    let inner = chat_request("demo", "X-Case: length\r\n");
    // CL.TE: the chunked body ends early; inside the Content-Length a second request hides.
    let smuggling_body = format!("0\r\n\r\n{inner}");
    let cases: Vec<(String, u16, &str)> = vec![
        (
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Case: length\r\nContent-Length: {}\r\nTransfer-Encoding: chunked\r\n\r\n{smuggling_body}",
                smuggling_body.len()
            ),
            400,
            "ambiguous_framing",
        ),
        (
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Case: length\r\nTransfer-Encoding: chunked\r\nContent-Length: {}\r\n\r\n{smuggling_body}",
                smuggling_body.len()
            ),
            400,
            "ambiguous_framing",
        ),
        // A bare LF inside a chunk extension: a front proxy ending lines at LF reads another body.
        (
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Case: length\r\nTransfer-Encoding: chunked\r\n\r\n{:x};a\nb\r\n{body}\r\n0\r\n\r\n",
                body.len()
            ),
            400,
            "bad_chunked_body",
        ),
        (
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Case: length\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\n{body}\r\n0\r\n\r\n",
                body.len()
            ),
            400,
            "bad_chunked_body",
        ),
        (
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Case: length\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{body}\r\n0\r\n\r\n"
            ),
            400,
            "bad_chunked_body",
        ),
        (
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Case: length\r\nContent-Length: {}\r\nContent-Length: {}\r\n\r\n{body}",
                body.len(),
                body.len() + 1
            ),
            400,
            "bad_content_length",
        ),
        (
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Case: length\r\nTransfer-Encoding: chunked, gzip\r\n\r\n{body}"
            ),
            400,
            "bad_transfer_encoding",
        ),
        (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Case: length\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n"
            .to_owned(),
            501,
            "unsupported_transfer_encoding",
        ),
        (
            "POST /v1/chat/completions HTTP/1.0\r\nHost: gw\r\nX-Case: length\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
            .to_owned(),
            400,
            "bad_transfer_encoding",
        ),
        // obs-fold, whitespace before the colon, a bare CR.
        (
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Case: length\r\n folded\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            ),
            400,
            "bad_request_head",
        ),
        (
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Case : length\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            ),
            400,
            "bad_request_head",
        ),
        (
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\rX-Case: length\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            ),
            400,
            "bad_request_head",
        ),
        (
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Case: length\r\nExpect: teapot\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            ),
            417,
            "expectation_failed",
        ),
    ];
    // Every case is tried and every miss reported, so a regression names all it breaks.
    let mut misses = Vec::new();
    for (raw, status, code) in &cases {
        let before = seen.lock().unwrap().len();
        let Some((response, closed)) = try_answer(&front, raw.as_bytes()) else {
            misses.push(format!("{raw:?}: the connection closed with no answer"));
            continue;
        };
        let code_got = if response.header("content-type") == Some("application/json") {
            response.json()["error"]["code"].as_str().map(str::to_owned)
        } else {
            None
        };
        let got = (
            response.status,
            code_got,
            response.header("connection").map(str::to_owned),
            closed,
            seen.lock().unwrap().len() - before,
        );
        let expected = (
            *status,
            Some((*code).to_owned()),
            Some("close".to_owned()),
            true,
            0,
        );
        if got != expected {
            misses.push(format!("{raw:?}: got {got:?}, expected {expected:?}"));
        }
    }
    assert!(misses.is_empty(), "{}", misses.join("\n"));
    // The gateway goes on serving.
    let (response, closed) = answer(
        &front,
        chat_request("demo", "X-Case: length\r\n").as_bytes(),
    );
    assert_eq!((response.status, closed), (200, false));
}

#[test]
fn well_framed_requests_reach_the_upstream_in_one_plain_form() {
    let (front, _d, upstream, seen) = scripted_front();
    let body = chat_body();
    let last_seen = || seen.lock().unwrap().last().cloned().unwrap();

    // The same Content-Length twice, and as a list: one Content-Length goes on.
    for lengths in [
        format!("Content-Length: {0}\r\nContent-Length: {0}\r\n", body.len()),
        format!("Content-Length: {0}, {0}\r\n", body.len()),
    ] {
        let raw = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Case: length\r\n{lengths}\r\n{body}"
        );
        let (response, closed) = answer(&front, raw.as_bytes());
        assert_eq!((response.status, closed), (200, false), "{raw:?}");
        let got = last_seen();
        assert_eq!(got.body, body.as_bytes());
        let head = got.head.to_ascii_lowercase();
        assert_eq!(head.matches("content-length:").count(), 1, "{}", got.head);
        assert!(head.contains(&format!("content-length: {}\r\n", body.len())));
    }

    // Header lines ending in a bare LF are lines; they go on ending in CRLF.
    let raw = format!(
        "POST /v1/chat/completions HTTP/1.1\nHost: gw\nX-Case: length\nContent-Length: {}\n\n{body}",
        body.len()
    );
    let (response, _) = answer(&front, raw.as_bytes());
    assert_eq!(response.status, 200);
    let got = last_seen();
    assert!(
        !got.head.replace("\r\n", "").contains('\n'),
        "{:?}",
        got.head
    );

    // An absolute-form target is served by its path and forwarded in origin form.
    let raw = format!(
        "POST http://gw/v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Case: length\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let (response, _) = answer(&front, raw.as_bytes());
    assert_eq!(response.status, 200);
    let got = last_seen();
    assert!(
        got.head
            .starts_with("POST /v1/chat/completions HTTP/1.1\r\n"),
        "{:?}",
        got.head
    );
    assert!(
        got.head
            .to_ascii_lowercase()
            .contains(&format!("host: {upstream}\r\n"))
    );

    // A chunked body goes on whole, framed by its length.
    let (a, b) = body.split_at(7);
    let raw = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Case: length\r\nTransfer-Encoding: chunked\r\n\r\n{:x};name=value\r\n{a}\r\n{:x}\r\n{b}\r\n0\r\nX-Trailer: 1\r\n\r\n",
        a.len(),
        b.len()
    );
    let (response, closed) = answer(&front, raw.as_bytes());
    assert_eq!((response.status, closed), (200, false));
    let got = last_seen();
    assert_eq!(got.body, body.as_bytes());
    assert!(!got.head.to_ascii_lowercase().contains("transfer-encoding"));
}

/// Headers named in `Connection` stay on their hop, both ways, on the lane and on pingora's path.
#[test]
fn connection_listed_headers_cross_neither_way() {
    let (front, _d, _upstream, seen) = scripted_front();
    for connection in ["keep-alive, X-Foo", "close, X-Foo", "X-Foo"] {
        for case in ["length", "hop"] {
            let raw = chat_request(
                "demo",
                &format!(
                    "X-Case: {case}\r\nConnection: {connection}\r\nX-Foo: secret\r\nX-Kept: 1\r\n"
                ),
            );
            let (response, closed) = answer(&front, raw.as_bytes());
            assert_eq!(response.status, 200, "{raw:?}");
            assert_eq!(closed, connection.starts_with("close"), "{raw:?}");
            let got = seen.lock().unwrap().last().cloned().unwrap();
            let head = got.head.to_ascii_lowercase();
            assert!(!head.contains("x-foo"), "{connection}: {}", got.head);
            assert!(head.contains("x-kept: 1\r\n"), "{}", got.head);
            assert_eq!(response.header("x-up-hop"), None, "{connection} {case}");
            if case == "hop" {
                assert_eq!(response.header("x-end"), Some("1"));
            }
        }
    }
    // On the lane too: a plain keep-alive request is relayed as bytes.
    let (response, _) = answer(&front, chat_request("demo", "X-Case: hop\r\n").as_bytes());
    assert_eq!(response.status, 200);
    assert_eq!(response.header("x-up-hop"), None);
    assert_eq!(response.header("x-end"), Some("1"));
    assert_eq!(response.raw_body, JSON_BODY.as_bytes());

    // An upstream answer framed both ways is read as chunked, without its Content-Length.
    let (response, _) = answer(&front, chat_request("demo", "X-Case: both\r\n").as_bytes());
    assert_eq!(response.header("content-length"), None);
    assert_eq!(dechunk(&response.raw_body), JSON_BODY.as_bytes());
}

/// `Expect: 100-continue` gets `100 Continue` from the gateway, then the final answer (an
/// upstream's own interim answer is not relayed), and a request pipelined behind it is served.
#[test]
fn expect_100_continue_gets_its_final_answer() {
    let (front, _d, _upstream, seen) = scripted_front();
    let body = chat_body();
    let mut client = connect(&front);
    for case in ["length", "continue"] {
        send(
            &mut client,
            &format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Case: {case}\r\nExpect: 100-continue\r\nContent-Length: {}\r\n\r\n",
                body.len()
            ),
        );
        let interim = read_response(&mut client);
        assert_eq!(interim.status, 100);
        send(&mut client, &body);
        let last = read_response(&mut client);
        assert_eq!(last.status, if case == "continue" { 201 } else { 200 });
        assert_eq!(last.raw_body, JSON_BODY.as_bytes());
        let got = seen.lock().unwrap().last().cloned().unwrap();
        assert!(
            !got.head.to_ascii_lowercase().contains("expect"),
            "{}",
            got.head
        );
    }
    // Pipelined behind a 100-continue request, with its body sent at once.
    send(
        &mut client,
        &format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Case: continue\r\nExpect: 100-continue\r\nContent-Length: {}\r\n\r\n{body}{}",
            body.len(),
            chat_request("demo", "X-Case: length\r\n")
        ),
    );
    let mut first = read_response(&mut client);
    if first.status == 100 {
        first = read_response(&mut client);
    }
    assert_eq!(first.status, 201);
    assert_eq!(read_response(&mut client).status, 200);
}

/// curl sends `Expect: 100-continue` for a body over 1 MiB: it gets its answer.
#[test]
fn curl_with_a_large_body_gets_its_answer() {
    let (front, dir, _upstream, seen) = scripted_front();
    let padding = "x".repeat(1_500_000);
    let body = json!({"model": "demo", "messages": [{"role": "user", "content": padding}], "max_tokens": 4})
        .to_string();
    let file = dir.path().join("big.json");
    std::fs::write(&file, &body).unwrap();
    let output = std::process::Command::new("curl")
        .args([
            "-sS",
            "-v",
            "--max-time",
            "60",
            "-H",
            "Content-Type: application/json",
        ])
        .args(["-H", "X-Case: length", "--data-binary"])
        .arg(format!("@{}", file.display()))
        .arg(format!("http://{}/v1/chat/completions", front.addr))
        .output()
        .expect("curl");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(
        stderr.contains("Expect: 100-continue"),
        "curl asked: {stderr}"
    );
    assert!(stderr.contains("HTTP/1.1 100 Continue"), "{stderr}");
    assert!(stderr.contains("HTTP/1.1 200"), "{stderr}");
    assert_eq!(output.stdout, JSON_BODY.as_bytes());
    assert_eq!(seen.lock().unwrap().last().unwrap().body, body.as_bytes());
}

/// A request that reached an upstream is never sent again: an upstream that takes it on a
/// kept-alive connection and closes without answering gets it once, and the client a 502 — on the
/// lane and on pingora's path.
#[test]
fn a_request_the_upstream_took_is_not_sent_twice() {
    let (front, _d, _upstream, seen) = scripted_front();
    for pingora_path in [false, true] {
        let extra = if pingora_path {
            "Connection: keep-alive, X-Foo\r\n"
        } else {
            ""
        };
        let mut client = connect(&front);
        // A first answer leaves the upstream connection kept alive for the next request.
        send(
            &mut client,
            &chat_request("demo", &format!("X-Case: length\r\n{extra}")),
        );
        assert_eq!(read_response(&mut client).status, 200);
        let before = seen.lock().unwrap().len();
        send(
            &mut client,
            &chat_request("demo", &format!("X-Case: vanish\r\n{extra}")),
        );
        let response = read_response(&mut client);
        assert_eq!(response.status, 502, "pingora path: {pingora_path}");
        let after: Vec<Seen> = seen.lock().unwrap()[before..].to_vec();
        assert_eq!(
            after.len(),
            1,
            "sent once (pingora path: {pingora_path}): {after:?}"
        );
        assert_eq!(after[0].case, "vanish");
    }
}

/// The upstream learns who the client is; a client's own forwarding headers are believed only from
/// a trusted proxy (here, with `trusted_proxies` naming loopback, every test client is one).
#[test]
fn the_upstream_is_told_who_the_client_is_and_spoofed_forwarding_headers_are_replaced() {
    let spoofed = "X-Forwarded-For: 1.2.3.4\r\nForwarded: for=1.2.3.4\r\n";
    let lines = |seen: &Arc<Mutex<Vec<Seen>>>| {
        let head = seen
            .lock()
            .unwrap()
            .last()
            .unwrap()
            .head
            .to_ascii_lowercase();
        let mut lines: Vec<String> = head
            .lines()
            .filter(|l| l.starts_with("x-forwarded") || l.starts_with("forwarded"))
            .map(str::to_owned)
            .collect();
        lines.sort();
        lines
    };
    let (front, _d, _upstream, seen) = scripted_front();
    let own = [
        "forwarded: for=127.0.0.1;proto=http",
        "x-forwarded-for: 127.0.0.1",
        "x-forwarded-proto: http",
    ];
    // The lane, then pingora's path (a client's own forwarding headers take it there).
    for extra in ["", spoofed] {
        let raw = chat_request("demo", &format!("X-Case: length\r\n{extra}"));
        assert_eq!(answer(&front, raw.as_bytes()).0.status, 200);
        assert_eq!(lines(&seen), own, "{extra:?}");
    }
    let (front, _d, _upstream, seen) = scripted_front_with("trusted_proxies = [\"127.0.0.0/8\"]\n");
    let raw = chat_request("demo", &format!("X-Case: length\r\n{spoofed}"));
    assert_eq!(answer(&front, raw.as_bytes()).0.status, 200);
    assert_eq!(
        lines(&seen),
        [
            "forwarded: for=1.2.3.4, for=127.0.0.1;proto=http",
            "x-forwarded-for: 1.2.3.4, 127.0.0.1",
            "x-forwarded-proto: http",
        ]
    );
}

/// `balance = "media_hash"`: requests carrying the same image reach the same upstream whatever
/// their text; different images spread over the servers.
#[test]
fn media_hash_balancing_sends_the_same_image_to_the_same_upstream() {
    let (first, seen_first) = scripted_upstream();
    let (second, seen_second) = scripted_upstream();
    let (front, _d) = start(&format!(
        "models = [{{ name = \"demo\", upstreams = [\"{first}\", \"{second}\"], balance = \"media_hash\", health_check = {{ path = \"\", interval_ms = 3600000 }} }}]\n"
    ));
    let request = |image: &str, text: &str| {
        let body =
            json!({"model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{image}")}},
            {"type": "text", "text": text}]}]})
            .to_string();
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Case: length\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    let mut client = connect(&front);
    let mut ask = |raw: String| {
        send(&mut client, &raw);
        assert_eq!(read_response(&mut client).status, 200);
    };
    let counts = || {
        (
            seen_first.lock().unwrap().len(),
            seen_second.lock().unwrap().len(),
        )
    };
    for i in 0..8 {
        ask(request("aGVsbG8=", &format!("question {i}")));
    }
    let (a, b) = counts();
    assert!(
        (a, b) == (8, 0) || (a, b) == (0, 8),
        "one image, one server: {a} {b}"
    );
    for i in 0..32 {
        let image = format!("aW1hZ2U{i:04}");
        ask(request(&image, "same question"));
    }
    let (c, d) = counts();
    assert!(
        c > a && d > b,
        "different images reach both servers: {c} {d}"
    );
}

/// A request the lane reads whole before leaving it to pingora (a native model's, here) with a body
/// over pingora's 1 MiB limit on read-ahead bytes, sized and chunked: answered, and the connection
/// stays usable. (pingora takes read-ahead bytes as header bytes and refused such requests
/// unanswered.)
#[test]
fn requests_read_ahead_past_a_mebibyte_are_answered() {
    let (native, _dir) = start("");
    let mut client = connect(&native);
    let padding = "x".repeat(1_500_000);
    let body = json!({"model": "demo", "messages": [{"role": "user", "content": "Hello"}],
                      "max_tokens": 2, "user": padding})
    .to_string();
    let sized = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut chunked = String::from(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n",
    );
    for piece in body.as_bytes().chunks(100_000) {
        chunked.push_str(&format!(
            "{:x}\r\n{}\r\n",
            piece.len(),
            std::str::from_utf8(piece).unwrap()
        ));
    }
    chunked.push_str("0\r\n\r\n");
    for request in [&sized, &chunked, &sized] {
        client.get_mut().write_all(request.as_bytes()).unwrap();
        assert_completion(&read_response(&mut client));
    }
    client
        .get_mut()
        .write_all(chat_request("demo", "").as_bytes())
        .unwrap();
    assert_completion(&read_response(&mut client));
}

/// An upstream killed mid-stream: the client's stream of events ends with an error event and is
/// properly terminated (its last chunk), through the lane and through pingora's session alike,
/// rather than the connection dropping mid-chunk.
#[test]
fn a_stream_whose_upstream_dies_ends_with_an_error_event() {
    let (upstream, _seen) = scripted_upstream();
    let (front, _d) = start(&format!(
        "models = [{{ name = \"demo\", upstreams = [\"{upstream}\"], health_check = {{ path = \"\", interval_ms = 3600000 }} }}]\n"
    ));
    // The lane relays a plain request; `Connection: close` sends one through pingora's session.
    for extra in ["", "Connection: close\r\n"] {
        let mut client = connect(&front);
        send(
            &mut client,
            &chat_request("demo", &format!("X-Case: dies\r\n{extra}")),
        );
        let response = read_response(&mut client);
        assert_eq!(response.status, 200);
        let body = String::from_utf8(dechunk(&response.raw_body)).unwrap();
        assert!(body.starts_with("data: 1"), "{extra:?}: {body:?}");
        let last = body.rsplit("data: ").next().unwrap().trim_end();
        let error: Value = serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {body:?}"));
        assert_eq!(
            error["error"]["code"], "upstream_failed",
            "{extra:?}: {body}"
        );
    }
}

/// An upstream that takes the request and never answers: after `upstream_timeout_ms` the client
/// gets 504 `upstream_timeout`, through the lane and through pingora's session alike.
#[test]
fn an_upstream_that_never_answers_times_out() {
    let (upstream, _seen) = scripted_upstream();
    let (front, _d) = start(&format!(
        "models = [{{ name = \"demo\", upstreams = [\"{upstream}\"], upstream_timeout_ms = 300, health_check = {{ path = \"\", interval_ms = 3600000 }} }}]\n"
    ));
    for extra in ["", "Connection: close\r\n"] {
        let mut client = connect(&front);
        send(
            &mut client,
            &chat_request("demo", &format!("X-Case: silent\r\n{extra}")),
        );
        let response = read_response(&mut client);
        assert_eq!(response.status, 504, "{extra:?}");
        assert_eq!(
            response.json()["error"]["code"],
            "upstream_timeout",
            "{extra:?}"
        );
    }
}

/// A kept-alive connection's waits are timed anew each time (the lane keeps one timer per
/// connection for the client's requests and one for the upstream's answers, re-armed per wait):
/// after answers that came in time and a pause longer than `upstream_timeout_ms`, a request the
/// upstream never answers still gets its 504 after `upstream_timeout_ms`, and the connection, idle
/// after it, is closed after `idle_timeout_ms`.
#[test]
fn a_kept_alive_connections_waits_are_each_timed_anew() {
    let (upstream, _seen) = scripted_upstream();
    let (front, _d) = start(&format!(
        "models = [{{ name = \"demo\", upstreams = [\"{upstream}\"], upstream_timeout_ms = 300, health_check = {{ path = \"\", interval_ms = 3600000 }} }}]\n\
         [connections]\nidle_timeout_ms = 2000\n"
    ));
    let mut client = connect(&front);
    for _ in 0..2 {
        send(&mut client, &chat_request("demo", "X-Case: length\r\n"));
        assert_eq!(read_response(&mut client).status, 200);
    }
    std::thread::sleep(Duration::from_millis(400));
    let sent = std::time::Instant::now();
    send(&mut client, &chat_request("demo", "X-Case: silent\r\n"));
    let response = read_response(&mut client);
    assert_eq!(response.status, 504);
    assert_eq!(response.json()["error"]["code"], "upstream_timeout");
    // Not at once, as a timer left at an earlier wait's deadline (long past) would have it.
    assert!(
        sent.elapsed() >= Duration::from_millis(300),
        "{:?}",
        sent.elapsed()
    );
    // Idle now: the gateway closes it (the read sees the end, not its own 120 s timeout).
    let mut byte = [0u8; 1];
    assert_eq!(
        client.read(&mut byte).unwrap(),
        0,
        "the idle connection was kept"
    );
}

/// A client that reads none of its answer holds no more of it than the sockets' buffers: after
/// `send_timeout_ms` the gateway drops it, and the upstream connection with it (nothing is kept
/// for it in memory meanwhile) — through the lane and through pingora's session.
#[test]
fn a_client_that_reads_nothing_is_dropped_and_its_answer_is_not_buffered() {
    let (upstream, _seen) = scripted_upstream();
    let (front, _d) = start(&format!(
        "models = [{{ name = \"demo\", upstreams = [\"{upstream}\"], health_check = {{ path = \"\", interval_ms = 3600000 }} }}]\n\
         [connections]\nsend_timeout_ms = 500\n"
    ));
    for (n, extra) in ["", "Connection: close\r\n"].into_iter().enumerate() {
        let mut client = connect(&front);
        send(
            &mut client,
            &chat_request("demo", &format!("X-Case: flood\r\n{extra}")),
        );
        // The client reads nothing until the upstream's flood has ended.
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let (written, dropped) = loop {
            if let Some(&flood) = FLOODS.lock().unwrap().get(n) {
                break flood;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{extra:?}: the gateway kept reading for a client that reads nothing"
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        assert!(dropped, "{extra:?}: all {written} bytes were taken");
        // The sockets' buffers on the way (a few MiB each on loopback), not the flood.
        assert!(written < 64 << 20, "{extra:?}: {written} bytes taken");
        let mut received = Vec::new();
        let _ = client.read_to_end(&mut received);
        assert!(received.len() <= written + 4096, "{extra:?}");
    }
    // The gateway serves on.
    let (response, _) = answer(&front, b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n");
    assert_eq!(response.status, 200);
}

/// Slowloris: a head sent a byte at a time gets 408 `request_timeout` once `head_timeout_ms` has
/// passed, however often its bytes come, and the connection is closed; a new connection that sends
/// nothing is closed too.
#[test]
fn a_head_sent_a_byte_at_a_time_is_cut_off() {
    let (front, _d, _, _) = scripted_front_with("connections = { head_timeout_ms = 800 }\n");
    let mut client = connect(&front);
    let mut writer = client.get_ref().try_clone().unwrap();
    let trickle = std::thread::spawn(move || {
        let head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Slow: ";
        writer.write_all(head).unwrap();
        // A byte every 100 ms, for at most a minute: far within any per-read timeout.
        for _ in 0..600 {
            if writer.write_all(b"a").is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    let response = read_response(&mut client);
    assert_eq!(response.status, 408);
    assert_eq!(response.json()["error"]["code"], "request_timeout");
    let mut rest = Vec::new();
    let _ = client.read_to_end(&mut rest);
    trickle.join().unwrap();

    let mut silent = connect(&front);
    let mut nothing = Vec::new();
    assert_eq!(silent.read_to_end(&mut nothing).ok(), Some(0));
}

/// Past `connections.max` open connections a new one is answered 503 `server_busy` with
/// `Retry-After`; when one closes, its slot comes back.
#[test]
fn connections_past_the_cap_are_refused_until_one_closes() {
    let (front, _d, _, _) = scripted_front_with("connections = { max = 3 }\n");
    let health = b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n";
    // Three kept-alive connections, each with a request served (so each is surely open).
    let mut held: Vec<BufReader<TcpStream>> = (0..3)
        .map(|_| {
            let mut client = connect(&front);
            client.get_mut().write_all(health).unwrap();
            assert_eq!(read_response(&mut client).status, 200);
            client
        })
        .collect();
    let (refused, closed) = answer(&front, health);
    assert_eq!(refused.status, 503);
    assert_eq!(refused.json()["error"]["code"], "server_busy");
    assert!(refused.header("retry-after").is_some());
    assert!(closed);
    // The held connections still work.
    held[0].get_mut().write_all(health).unwrap();
    assert_eq!(read_response(&mut held[0]).status, 200);
    drop(held.pop());
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (response, _) = answer(&front, health);
        if response.status == 200 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the slot never came back"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
