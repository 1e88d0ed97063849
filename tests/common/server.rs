//! A real `mmgate serve` process on a free loopback port, and one-shot HTTP/1.1 requests to it.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// Kills the server when the test ends, however it ends.
pub struct Server {
    pub child: Child,
    pub addr: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A loopback port nothing listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The cache (`XDG_CACHE_HOME`) the tests' servers and commands share: the demo models made once
/// and the plugins compiled once (compiling the built-in plugins is most of a first start's
/// time), kept between runs. Both are written whole or not at all, so concurrent starts share it.
pub fn demo_cache() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("shared-cache")
}

impl Server {
    /// `mmgate serve` with `config` (TOML, in a directory kept as long as the handle returned).
    pub fn with_config(config: &str) -> (Server, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mmgate.toml");
        std::fs::write(&path, config).unwrap();
        let server = Server::start(&["--config", path.to_str().unwrap()]);
        (server, dir)
    }

    /// `mmgate serve ARGS --listen <free port>`, once it accepts connections.
    pub fn start(args: &[&str]) -> Server {
        Server::start_with_env(args, &[])
    }

    /// The same, with extra environment variables.
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Server {
        Server::start_until(args, env, Stdio::inherit(), answers_health)
    }

    /// The same, its log (stderr) written to `log`.
    pub fn start_logging_to(args: &[&str], env: &[(&str, &str)], log: std::fs::File) -> Server {
        Server::start_until(args, env, Stdio::from(log), answers_health)
    }

    /// The same for a server whose config makes it serve HTTPS: ready once `GET /health` answers
    /// 200 over TLS, with `ca_pem` trusted and the server called `localhost`.
    pub fn start_tls_with_env(args: &[&str], env: &[(&str, &str)], ca_pem: &str) -> Server {
        let client = reqwest::blocking::Client::builder()
            .add_root_certificate(reqwest::Certificate::from_pem(ca_pem.as_bytes()).unwrap())
            .timeout(Duration::from_secs(5))
            .build()
            .unwrap();
        Server::start_until(args, env, Stdio::inherit(), |addr| {
            let port = addr.rsplit(':').next().unwrap_or_default();
            client
                .get(format!("https://localhost:{port}/health"))
                .send()
                .is_ok_and(|r| r.status() == 200)
        })
    }

    fn start_until(
        args: &[&str],
        env: &[(&str, &str)],
        stderr: Stdio,
        ready: impl Fn(&str) -> bool,
    ) -> Server {
        let addr = format!("127.0.0.1:{}", free_port());
        let child = super::mmgate_command()
            .envs(env.iter().copied())
            .arg("serve")
            .args(args)
            .args(["--listen", &addr])
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("start mmgate serve");
        let mut server = Server { child, addr };
        // Start-up may compile the built-in plugins; give it generous time, but notice if it died.
        let addr = server.addr.clone();
        wait_until_ready(
            &mut server.child,
            "mmgate serve",
            Duration::from_secs(120),
            || ready(&addr),
        );
        server
    }
}

/// Waits until `ready()` holds, failing the test if `child` (`what`) exits first or `limit`
/// passes.
pub fn wait_until_ready(child: &mut Child, what: &str, limit: Duration, ready: impl Fn() -> bool) {
    let deadline = Instant::now() + limit;
    while !ready() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("{what} exited during start-up: {status}");
        }
        assert!(
            Instant::now() < deadline,
            "{what} did not start in {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Whether `GET /health` gets an HTTP 200 back. An open port alone is not proof: while nothing
/// listens yet, a connect to a free ephemeral port can occasionally connect the socket to itself.
fn answers_health(addr: &str) -> bool {
    let Ok(mut stream) = TcpStream::connect(addr) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let sent = write!(
        stream,
        "GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    );
    let mut response = Vec::new();
    sent.is_ok()
        && stream.read_to_end(&mut response).is_ok()
        && response.starts_with(b"HTTP/1.1 200")
}

/// One HTTP/1.1 request with an optional JSON body; returns (status, JSON body).
pub fn request(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> (u16, serde_json::Value) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let body = body.unwrap_or("");
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
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
