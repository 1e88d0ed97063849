//! Three mmgate replicas sharing a real Redis, in front of two upstream servers (real mmgate
//! processes serving the demo model): an upload made through one replica is used through the
//! others (and by no other API key); an image encoded on one replica is a shared-cache hit on
//! another, and so is a long audio clip made and encoded there in pieces; a key's requests and tokens per minute and requests in flight hold in sum across the
//! replicas (tokens as the answers report them, native and relayed);
//! Redis killed mid-run gets requests that need it a 503 while the rest go on, and the replicas
//! recover when it returns; a replica sent SIGTERM under load drains (`/ready` 503, then the
//! listener closes) and no client request fails.

use crate::common;

use std::io::Write;
use std::net::TcpStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use common::fixture;
use common::redis::RedisServer;
use common::server::Server;
use serde_json::{Value, json};

const RPM: usize = 300;
const TPM: u64 = 12_000;
const IN_FLIGHT: usize = 4;

fn start(config: &str, dir: &Path, name: &str) -> Server {
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, config).unwrap();
    Server::start(&["--config", path.to_str().unwrap()])
}

fn replica_config(redis: &str, upstreams: [&str; 2]) -> String {
    format!(
        r#"api_keys = ["sk-alice", "sk-bob", "sk-carol", "sk-dave", "sk-erin"]
drain_seconds = 2
shutdown_grace_seconds = 2
models = [
  {{ name = "demo", path = "demo" }},
  {{ name = "demo-audio", path = "demo-audio" }},
  {{ name = "proxied", upstreams = ["{}", "{}"] }},
]
[store]
kind = "redis"
url = "{redis}"
timeout_ms = 500
startup_wait_seconds = 10
[plugins]
threads = 2
[key_limits]
requests_per_minute = {RPM}
tokens_per_minute = {TPM}
concurrent_requests = {IN_FLIGHT}
"#,
        upstreams[0], upstreams[1]
    )
}

fn client() -> reqwest::blocking::Client {
    // A connection per request: a replica that stops accepting is seen as connection refused.
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(120))
        .pool_max_idle_per_host(0)
        .build()
        .unwrap()
}

fn url(server: &Server, path: &str) -> String {
    format!("http://{}{path}", server.addr)
}

fn ready_at(addr: &str) -> Option<u16> {
    client()
        .get(format!("http://{addr}/ready"))
        .send()
        .ok()
        .map(|r| r.status().as_u16())
}

fn get(server: &Server, key: &str, path: &str) -> (u16, Value) {
    let response = client()
        .get(url(server, path))
        .bearer_auth(key)
        .send()
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().unwrap_or(Value::Null))
}

fn chat(server: &Server, key: &str, content: Value) -> (u16, Value) {
    chat_with(server, key, "demo", content)
}

fn chat_with(server: &Server, key: &str, model: &str, content: Value) -> (u16, Value) {
    let body = json!({
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "temperature": 0,
    });
    let response = client()
        .post(url(server, "/v1/chat/completions"))
        .bearer_auth(key)
        .json(&body)
        .send()
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().unwrap())
}

fn upload(server: &Server, key: &str, bytes: Vec<u8>) -> (u16, Value) {
    let form = reqwest::blocking::multipart::Form::new()
        .text("purpose", "vision")
        .part(
            "file",
            reqwest::blocking::multipart::Part::bytes(bytes).file_name("cat.png"),
        );
    let response = client()
        .post(url(server, "/v1/files"))
        .bearer_auth(key)
        .multipart(form)
        .send()
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().unwrap())
}

/// The sum of the series starting with `series` in a replica's `/metrics` (0 when absent).
fn metric(server: &Server, series: &str) -> f64 {
    let text = client()
        .get(url(server, "/metrics"))
        .send()
        .unwrap()
        .text()
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with(series))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn data_url(bytes: &[u8]) -> String {
    format!(
        "data:image/png;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

fn ready(server: &Server) -> Option<u16> {
    ready_at(&server.addr)
}

struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

#[test]
fn replicas_share_uploads_features_and_limits_drain_under_load_and_outlive_redis() {
    let mut redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let upstream = "models = [{ name = \"proxied\", path = \"demo\" }]\n";
    let up1 = start(upstream, dir.path(), "up1");
    let up2 = start(upstream, dir.path(), "up2");
    let config = replica_config(&redis.url(), [&up1.addr, &up2.addr]);
    let mut replicas: Vec<Server> = ["a", "b", "c"]
        .iter()
        .map(|name| start(&config, dir.path(), name))
        .collect();
    let (a, b, c) = (&replicas[0], &replicas[1], &replicas[2]);
    for r in [a, b, c] {
        assert_eq!(ready(r), Some(200));
    }

    // (Before any request of bob's: the limits below count from his first.) A long clip made in
    // parts on A, each handed to its encoder as it was made and its output
    // stored piece by piece, is a hit on B piece by piece: the same prompt and answer, nothing
    // preprocessed or encoded there. (Two plugin threads: an item is made in parts only while two
    // are idle.)
    let clip =
        base64::engine::general_purpose::STANDARD.encode(fixture("audio/clips/long-61s-16k.flac"));
    let long = json!([
        {"type": "input_audio", "input_audio": {"data": clip, "format": "flac"}},
        {"type": "text", "text": "what is said?"},
    ]);
    let (status, made) = chat_with(a, "sk-carol", "demo-audio", long.clone());
    assert_eq!(status, 200, "{made}");
    assert_eq!(
        made["usage"]["media"][0]["parts_streamed"],
        json!(true),
        "{made}"
    );
    let (status, found) = chat_with(b, "sk-carol", "demo-audio", long);
    assert_eq!(status, 200, "{found}");
    let account = &found["usage"]["media"][0];
    assert_eq!(account["shared_encoding"], json!(true), "{found}");
    assert_eq!(
        account["parts"], made["usage"]["media"][0]["parts"],
        "{found}"
    );
    assert_eq!(
        metric(b, "mmgate_encoded_items_total{model=\"demo-audio\""),
        0.0,
        "B encoded what A had shared"
    );
    assert_eq!(
        found["usage"]["prompt_tokens"],
        made["usage"]["prompt_tokens"]
    );
    assert_eq!(
        found["choices"][0]["message"]["content"],
        made["choices"][0]["message"]["content"]
    );

    // An upload through A is alice's everywhere, and nobody else's.
    let png = fixture("image/images/png-rgb-wide.png");
    let (status, file) = upload(a, "sk-alice", png.clone());
    assert_eq!(status, 200, "{file}");
    let id = file["id"].as_str().unwrap().to_owned();
    let (status, seen) = get(b, "sk-alice", &format!("/v1/files/{id}"));
    assert_eq!((status, &seen["bytes"]), (200, &json!(png.len())), "{seen}");
    let (status, listed) = get(c, "sk-alice", "/v1/files");
    assert_eq!(status, 200);
    assert_eq!(listed["data"][0]["id"], json!(id), "{listed}");
    assert_eq!(get(b, "sk-bob", &format!("/v1/files/{id}")).0, 404);
    assert_eq!(get(b, "sk-bob", "/v1/files").1["data"], json!([]));

    // A response stored through A is continued through B (its conversation is in Redis), and
    // is alice's alone.
    let ask = |server: &Server, body: Value| {
        let response = client()
            .post(url(server, "/v1/responses"))
            .bearer_auth("sk-alice")
            .json(&body)
            .send()
            .unwrap();
        (
            response.status().as_u16(),
            response.json::<Value>().unwrap(),
        )
    };
    let (status, first) = ask(
        a,
        json!({"model": "demo", "input": "hi", "max_output_tokens": 2}),
    );
    assert_eq!(status, 200, "{first}");
    let follow = json!({"model": "demo", "input": "and?", "max_output_tokens": 2,
                        "previous_response_id": first["id"]});
    let (status, second) = ask(b, follow);
    assert_eq!(status, 200, "{second}");
    assert!(
        second["usage"]["input_tokens"].as_u64() > first["usage"]["input_tokens"].as_u64(),
        "{first} then {second}"
    );
    let kept = format!("/v1/responses/{}", second["id"].as_str().unwrap());
    assert_eq!(get(c, "sk-alice", &kept).1["id"], second["id"]);
    assert_eq!(get(c, "sk-bob", &kept).0, 404);
    let by_id = json!([
        {"type": "file", "file": {"file_id": id}},
        {"type": "text", "text": "what is this?"},
    ]);
    let (status, answer) = chat(c, "sk-alice", by_id.clone());
    assert_eq!(status, 200, "{answer}");
    let (status, refused) = chat(c, "sk-bob", by_id);
    assert_eq!(
        (status, &refused["error"]["code"]),
        (404, &json!("file_not_found"))
    );

    // C encoded that image; the same image through B is a hit in the shared cache: neither B's
    // plugin nor its encoder runs, and the answer is the one C gave.
    let encoded = "mmgate_encoded_items_total{model=\"demo\"";
    assert!(metric(c, encoded) >= 1.0);
    let hits = "mmgate_shared_feature_cache_lookups_total{outcome=\"hit\"}";
    let inline = json!([
        {"type": "image_url", "image_url": {"url": data_url(&png)}},
        {"type": "text", "text": "what is this?"},
    ]);
    let hits_before = metric(b, hits);
    let (status, from_b) = chat(b, "sk-alice", inline);
    assert_eq!(status, 200, "{from_b}");
    assert_eq!(metric(b, hits) - hits_before, 1.0);
    assert_eq!(metric(b, encoded), 0.0, "B encoded what C had shared");
    // Found by the media and its plan: B's plugin did not preprocess it either.
    assert_eq!(
        from_b["usage"]["media"][0]["shared_encoding"],
        json!(true),
        "{from_b}"
    );
    assert_eq!(
        from_b["choices"][0]["message"]["content"],
        answer["choices"][0]["message"]["content"]
    );

    // Bob's requests per minute hold in sum: three clients, one per replica, at once.
    let started = Instant::now();
    let all = [a, b, c];
    let counts: Vec<(usize, usize)> = std::thread::scope(|s| {
        let handles: Vec<_> = all
            .iter()
            .map(|&r| {
                s.spawn(move || {
                    let (mut ok, mut limited) = (0, 0);
                    for _ in 0..RPM / 2 {
                        let response = client()
                            .get(url(r, "/v1/models"))
                            .bearer_auth("sk-bob")
                            .send()
                            .unwrap();
                        match response.status().as_u16() {
                            200 => ok += 1,
                            429 => {
                                assert!(response.headers().contains_key("retry-after"));
                                limited += 1;
                            }
                            other => panic!("status {other}"),
                        }
                    }
                    (ok, limited)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let elapsed = started.elapsed().as_secs_f64();
    // Bob's three requests above count too.
    let accepted: usize = 3 + counts.iter().map(|c| c.0).sum::<usize>();
    // A minute's worth at once, then one more per 60/RPM seconds.
    let allowed = RPM + (elapsed * RPM as f64 / 60.0).ceil() as usize + 1;
    assert!(
        (RPM..=allowed).contains(&accepted),
        "{accepted} of {} accepted in {elapsed:.1} s; the limit allows {RPM}..={allowed}",
        3 + 3 * (RPM / 2)
    );
    // Alice's allowance is her own.
    assert_eq!(get(a, "sk-alice", "/v1/models").0, 200);

    // Erin's tokens per minute hold in sum: long prompts, in turn through A, B and C, to the
    // native model and to the one relayed upstream, until one is refused.
    let long = "tell me about the weather today ".repeat(250);
    let started = Instant::now();
    let mut used = Vec::new();
    let refused = loop {
        assert!(used.len() < 30, "erin was never limited: {used:?}");
        let replica = [a, b, c][used.len() % 3];
        let model = ["demo", "proxied"][used.len() % 2];
        let response = client()
            .post(url(replica, "/v1/chat/completions"))
            .bearer_auth("sk-erin")
            .json(&json!({
                "model": model,
                "messages": [{"role": "user", "content": long}],
                "max_tokens": 4,
            }))
            .send()
            .unwrap();
        let status = response.status().as_u16();
        let retry_after = response.headers().get("retry-after").cloned();
        let body: Value = response.json().unwrap();
        match status {
            200 => used.push(body["usage"]["total_tokens"].as_u64().unwrap()),
            429 => {
                assert!(retry_after.is_some());
                break body;
            }
            other => panic!("status {other}: {body}"),
        }
    };
    assert_eq!(refused["error"]["code"], json!("rate_limit_exceeded"));
    assert!(
        refused["error"]["message"]
            .as_str()
            .unwrap()
            .contains("tokens per minute"),
        "{refused}"
    );
    let total: u64 = used.iter().sum();
    let refill = (started.elapsed().as_secs_f64() * TPM as f64 / 60.0).ceil() as u64;
    assert!(total >= TPM, "refused after {total} tokens: {used:?}");
    // Let in only while under the limit. A request's tokens are charged as its answer ends, so
    // the next one may overtake the charge of the one before it: the last two are left out.
    let before_last_two: u64 = used[..used.len().saturating_sub(2)].iter().sum();
    assert!(
        before_last_two < TPM + refill,
        "let in after {before_last_two} tokens: {used:?}"
    );
    // Her tokens are her own.
    assert_eq!(get(a, "sk-alice", "/v1/models").0, 200);

    // Dave's requests in flight hold in sum: uploads whose bodies never finish arriving hold his
    // slots on A, B and C; one more request anywhere is refused until one of them ends.
    let hold = |i: usize| {
        let replica = [a, b, c][i % 3];
        let mut stream = TcpStream::connect(&replica.addr).unwrap();
        write!(
            stream,
            "POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-dave\r\n\
             Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 1000\r\n\r\n--b"
        )
        .unwrap();
        stream.set_nonblocking(true).unwrap();
        stream
    };
    let mut held: Vec<TcpStream> = (0..IN_FLIGHT).map(hold).collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    let refused = loop {
        let (status, body) = get(b, "sk-dave", "/v1/models");
        if status == 429 {
            break body;
        }
        assert!(
            Instant::now() < deadline,
            "dave was never limited: {status}"
        );
        // A probe that came first takes the slot a held request was to have: that one is refused
        // (and answered); hold another in its place.
        for (i, stream) in held.iter_mut().enumerate() {
            if stream.peek(&mut [0u8; 1]).is_ok() {
                *stream = hold(i);
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(
        refused["error"]["code"],
        json!("too_many_concurrent_requests")
    );
    drop(held.pop());
    let deadline = Instant::now() + Duration::from_secs(10);
    while get(c, "sk-dave", "/v1/models").0 != 200 {
        assert!(Instant::now() < deadline, "dave's slot never came back");
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(held);

    // Redis dies: what needs it is refused with 503, the rest goes on.
    redis.kill();
    let (status, refused) = upload(a, "sk-alice", png.clone());
    assert_eq!(
        (status, &refused["error"]["code"]),
        (503, &json!("store_unavailable")),
        "{refused}"
    );
    assert_eq!(ready(a), Some(503));
    let text = json!([{"type": "text", "text": "still there?"}]);
    assert_eq!(chat(b, "sk-alice", text.clone()).0, 200);
    let other = fixture("image/images/png-rgba.png");
    let image = json!([
        {"type": "image_url", "image_url": {"url": data_url(&other)}},
        {"type": "text", "text": "and this?"},
    ]);
    assert_eq!(chat(b, "sk-alice", image).0, 200);
    // Redis returns (empty: nothing was persisted): the replicas find it again by themselves.
    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, body) = upload(a, "sk-alice", png.clone());
        if status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "no recovery: {status} {body}");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(ready(a), Some(200));

    // A drains under load. Clients send streamed chat completions (relayed to the upstreams) to
    // the replicas a poller of `/ready` says are ready, as a load balancer does, and retry only
    // on connection refused.
    let ready_now: Arc<Vec<AtomicBool>> = Arc::new((0..3).map(|_| AtomicBool::new(true)).collect());
    let saw_draining = AtomicBool::new(false);
    let stop = AtomicBool::new(false);
    let served = AtomicUsize::new(0);
    let failures = Mutex::new(Vec::<String>::new());
    let a_pid = replicas[0].child.id();
    let addrs: Vec<String> = replicas.iter().map(|r| r.addr.clone()).collect();
    let replicas_a = &mut replicas[0].child;
    let exited = std::thread::scope(|s| {
        let addrs = &addrs;
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                for (i, addr) in addrs.iter().enumerate() {
                    let status = ready_at(addr);
                    if i == 0 && status == Some(503) {
                        saw_draining.store(true, Ordering::Relaxed);
                    }
                    ready_now[i].store(status == Some(200), Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let clients: Vec<_> = (0..3)
            .map(|t| {
                let (ready_now, stop, served, failures) = (&ready_now, &stop, &served, &failures);
                s.spawn(move || {
                    let body = json!({
                        "model": "proxied",
                        "stream": true,
                        "max_tokens": 8,
                        "messages": [{"role": "user", "content": "count to eight"}],
                    });
                    let mut next = t;
                    while !stop.load(Ordering::Relaxed) {
                        next = (next + 1) % 3;
                        if !ready_now[next].load(Ordering::Relaxed) {
                            std::thread::sleep(Duration::from_millis(5));
                            continue;
                        }
                        let sent = client()
                            .post(format!("http://{}/v1/chat/completions", addrs[next]))
                            .bearer_auth("sk-carol")
                            .json(&body)
                            .send();
                        let outcome = match sent {
                            Err(e) if e.is_connect() => continue,
                            Err(e) => Err(format!("request: {e}")),
                            Ok(r) if r.status() != 200 => Err(format!("status {}", r.status())),
                            Ok(r) => match r.text() {
                                Ok(t) if t.trim_end().ends_with("data: [DONE]") => Ok(()),
                                Ok(t) => Err(format!("incomplete stream: {t}")),
                                Err(e) => Err(format!("the answer broke off: {e}")),
                            },
                        };
                        match outcome {
                            // Carol's pace stays well inside her requests per minute.
                            Ok(()) => {
                                std::thread::sleep(Duration::from_millis(100));
                                served.fetch_add(1, Ordering::Relaxed)
                            }
                            Err(e) => {
                                failures
                                    .lock()
                                    .unwrap()
                                    .push(format!("replica {next}: {e}"));
                                0
                            }
                        };
                    }
                })
            })
            .collect();
        // However this thread ends (a failed assertion too), the clients and the poller stop.
        let _stop = StopOnDrop(&stop);
        let wait_for = |what: &str, done: &dyn Fn() -> bool| {
            let deadline = Instant::now() + Duration::from_secs(60);
            while !done() {
                assert!(Instant::now() < deadline, "timed out waiting for {what}");
                std::thread::sleep(Duration::from_millis(20));
            }
        };
        // Some load first, then SIGTERM to A, then load until A is gone and a little after.
        wait_for("the first answers", &|| {
            served.load(Ordering::Relaxed) >= 10
        });
        let term = std::process::Command::new("kill")
            .args(["-TERM", &a_pid.to_string()])
            .status()
            .unwrap();
        assert!(term.success());
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(status) = replicas_a.try_wait().ok().flatten() {
                break status;
            }
            assert!(Instant::now() < deadline, "A did not exit after SIGTERM");
            std::thread::sleep(Duration::from_millis(50));
        };
        let after = served.load(Ordering::Relaxed);
        wait_for("answers after A left", &|| {
            served.load(Ordering::Relaxed) >= after + 5
        });
        stop.store(true, Ordering::Relaxed);
        for c in clients {
            c.join().unwrap();
        }
        status
    });
    let failures = failures.into_inner().unwrap();
    assert!(
        failures.is_empty(),
        "{} requests failed, the first: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    drop(replicas.remove(0));
    assert!(exited.success(), "A exited with {exited}");
    assert!(
        saw_draining.load(Ordering::Relaxed),
        "A's /ready never said 503"
    );
}
