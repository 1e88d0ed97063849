//! Upstream pools: a model served by other OpenAI-compatible servers (vLLM, SGLang, another
//! mmgate). Pingora's load balancer picks a healthy server (round robin or consistent hashing) and
//! its health checks eject dead ones in the background; connections are kept alive between
//! requests ([`idle`]). A request goes out as it came (less the hop-by-hop headers), and the answer
//! (SSE streams included) is passed back chunk by chunk as it arrives.
//!
//! The request body is read before a server is chosen (the model name is in it), so forwarding is
//! done here rather than by pingora's proxy service, which cannot replay a body it did not read
//! itself: header and body leave in one write (pingora's client session flushes the header on its
//! own, a second send per request), and pingora's HTTP/1 client session reads the answer.

pub mod embeds;
mod idle;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use http::StatusCode;
use pingora::connectors::TransportConnector;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::lb::health_check::{HttpHealthCheck, TcpHealthCheck};
use pingora::lb::selection::{BackendIter, BackendSelection, Consistent, RoundRobin};
use pingora::lb::{Backend, LoadBalancer};
use pingora::protocols::Stream;
use pingora::protocols::http::ServerSession;
use pingora::protocols::http::v1::client::HttpSession as UpstreamSession;
use pingora::services::ServiceWithDependents;
use pingora::services::background::background_service;
use pingora::upstreams::peer::HttpPeer;
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;

use crate::config::{Balance, HealthCheck, ModelConfig};
use crate::error::ApiError;

/// Headers that describe one connection, not the message: never forwarded.
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "upgrade",
];

/// How long connecting to an upstream server may take before the next one is tried.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

enum Balancer {
    RoundRobin(Arc<LoadBalancer<RoundRobin>>),
    Consistent(Arc<LoadBalancer<Consistent>>),
}

impl Balancer {
    /// The first server the selection offers that is healthy and not yet tried.
    fn select(&self, key: &[u8], tried: &[SocketAddr]) -> Option<Backend> {
        fn pick<S>(lb: &LoadBalancer<S>, key: &[u8], tried: &[SocketAddr]) -> Option<Backend>
        where
            S: BackendSelection + 'static,
            S::Iter: BackendIter,
        {
            lb.select_with(key, 256, |b, healthy| {
                healthy && b.addr.as_inet().is_some_and(|a| !tried.contains(a))
            })
        }
        match self {
            Self::RoundRobin(lb) => pick(lb, key, tried),
            Self::Consistent(lb) => pick(lb, key, tried),
        }
    }

    fn servers(&self) -> Vec<(String, bool)> {
        fn list<S>(lb: &LoadBalancer<S>) -> Vec<(String, bool)>
        where
            S: BackendSelection + 'static,
            S::Iter: BackendIter,
        {
            lb.backends()
                .get_backend()
                .iter()
                .map(|b| (b.addr.to_string(), lb.backends().ready(b)))
                .collect()
        }
        match self {
            Self::RoundRobin(lb) => list(lb),
            Self::Consistent(lb) => list(lb),
        }
    }
}

pub struct UpstreamPool {
    pub model: String,
    balancer: Balancer,
    connector: TransportConnector,
    servers: usize,
}

/// The outcome of forwarding.
pub enum Forwarded {
    /// The upstream's answer went to the client (completely, or until one side failed).
    Answered,
    /// Nothing was sent to the client yet: answer with this error.
    Failed(ApiError),
}

impl UpstreamPool {
    /// The pool of `model` and the background service running its health checks (to be added to
    /// the pingora server).
    pub fn build(
        model: &ModelConfig,
    ) -> anyhow::Result<(Arc<UpstreamPool>, Box<dyn ServiceWithDependents>)> {
        let name = format!("health checks of {}", model.name);
        let interval = Duration::from_millis(model.health_check.interval_ms);
        let (balancer, service): (Balancer, Box<dyn ServiceWithDependents>) = match model.balance {
            Balance::RoundRobin => {
                let mut lb = LoadBalancer::<RoundRobin>::try_from_iter(&model.upstreams)
                    .with_context(|| format!("model {}: resolving its upstreams", model.name))?;
                lb.set_health_check(health_check(&model.health_check));
                lb.health_check_frequency = Some(interval);
                let service = background_service(&name, lb);
                (Balancer::RoundRobin(service.task()), Box::new(service))
            }
            Balance::ConsistentHash => {
                let mut lb = LoadBalancer::<Consistent>::try_from_iter(&model.upstreams)
                    .with_context(|| format!("model {}: resolving its upstreams", model.name))?;
                lb.set_health_check(health_check(&model.health_check));
                lb.health_check_frequency = Some(interval);
                let service = background_service(&name, lb);
                (Balancer::Consistent(service.task()), Box::new(service))
            }
        };
        let pool = UpstreamPool {
            model: model.name.clone(),
            balancer,
            connector: TransportConnector::new(None),
            servers: model.upstreams.len().max(1),
        };
        Ok((Arc::new(pool), service))
    }

    /// Each server and whether it is in rotation.
    pub fn health_json(&self) -> Value {
        self.balancer
            .servers()
            .into_iter()
            .map(|(addr, healthy)| json!({"address": addr, "healthy": healthy}))
            .collect()
    }

    /// Whether any server is in rotation.
    pub fn servers(&self) -> Vec<(String, bool)> {
        self.balancer.servers()
    }

    /// Sends the request (`downstream`'s header with `body`) to a healthy server and streams its
    /// answer back, with `extra` headers added to it. A server that cannot be reached is skipped for
    /// the next one, as is a kept-alive connection the server had closed; once a server has the
    /// request, it is not sent again.
    pub async fn forward(
        &self,
        downstream: &mut ServerSession,
        body: Bytes,
        key: &[u8],
        extra: Option<(&'static str, http::HeaderValue)>,
    ) -> Forwarded {
        let Some(wire) = request_wire(downstream.req_header(), &body) else {
            return Forwarded::Failed(bad_gateway(
                &self.model,
                "the request target cannot be forwarded",
            ));
        };
        // Few servers per pool: a list is the cheapest set.
        let mut tried = Vec::new();
        let mut last_error = String::from("no server is healthy");
        for _ in 0..self.servers * 2 {
            let Some(backend) = self.balancer.select(key, &tried) else {
                break;
            };
            let Some(&server) = backend.addr.as_inet() else {
                // Configured upstreams are resolved host:port addresses.
                continue;
            };
            let (mut stream, reused) = match self.connect(server).await {
                Ok(connection) => connection,
                Err(e) => {
                    tracing::warn!(model = %self.model, upstream = %server, error = %e, "upstream unreachable; trying the next");
                    last_error = format!("{server}: {e}");
                    tried.push(server);
                    continue;
                }
            };
            let written = async {
                stream.write_all(&wire).await?;
                stream.flush().await
            }
            .await;
            let mut upstream = UpstreamSession::new(stream);
            let sent = match written {
                Ok(()) => upstream
                    .read_response()
                    .await
                    .map(drop)
                    .map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            if let Err(e) = sent {
                last_error = format!("{server}: {e}");
                if reused {
                    // The server closed a kept-alive connection: the request never reached it.
                    tracing::debug!(upstream = %server, error = %e, "stale upstream connection; retrying");
                    continue;
                }
                tracing::warn!(model = %self.model, upstream = %server, error = %e, "upstream failed");
                return Forwarded::Failed(bad_gateway(&self.model, &last_error));
            }
            let Some(header) = upstream.resp_header() else {
                return Forwarded::Failed(bad_gateway(&self.model, "no response header"));
            };
            let mut response = downstream_response(header);
            if let Some((name, value)) = extra.clone() {
                let _ = response.insert_header(name, value);
            }
            if let Err(e) = downstream.write_response_header(Box::new(response)).await {
                tracing::debug!(error = %e, "client went away before the answer");
                return Forwarded::Answered;
            }
            loop {
                match upstream.read_body_bytes().await {
                    Ok(Some(chunk)) => {
                        if let Err(e) = downstream.write_response_body(chunk, false).await {
                            // The client left: the upstream connection is dropped, not reused.
                            tracing::debug!(error = %e, "client went away mid-answer");
                            return Forwarded::Answered;
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(upstream = %server, error = %e, "upstream failed mid-answer");
                        return Forwarded::Answered;
                    }
                }
            }
            if let Err(e) = downstream.finish_body().await {
                tracing::debug!(error = %e, "finishing the answer to the client");
            }
            if upstream.is_body_done() {
                upstream.respect_keepalive();
                if let Some(stream) = upstream.reuse().await {
                    idle::put(server, stream);
                }
            }
            return Forwarded::Answered;
        }
        Forwarded::Failed(ApiError::new(
            StatusCode::BAD_GATEWAY,
            "upstream_unavailable",
            format!(
                "no upstream of model {} could take the request ({last_error})",
                self.model
            ),
        ))
    }

    /// A kept-alive connection to `server`, or a new one; and whether it was kept alive.
    async fn connect(&self, server: SocketAddr) -> pingora::Result<(Stream, bool)> {
        if let Some(stream) = idle::take(server) {
            return Ok((stream, true));
        }
        let mut peer = HttpPeer::new(server, false, String::new());
        peer.options.connection_timeout = Some(CONNECT_TIMEOUT);
        Ok((self.connector.new_stream(&peer).await?, false))
    }
}

fn health_check(
    config: &HealthCheck,
) -> Box<dyn pingora::lb::health_check::HealthCheck + Send + Sync> {
    if config.path.is_empty() {
        let mut check = TcpHealthCheck::new();
        check.consecutive_failure = config.failures.max(1);
        check.consecutive_success = config.successes.max(1);
        return check;
    }
    let mut check = HttpHealthCheck::new("localhost", false);
    if let Ok(mut request) = RequestHeader::build("GET", config.path.as_bytes(), None) {
        let _ = request.append_header("Host", "localhost");
        check.req = request;
    }
    check.consecutive_failure = config.failures.max(1);
    check.consecutive_success = config.successes.max(1);
    Box::new(check)
}

/// The request as the upstream gets it, in one buffer: the client's request line and headers less
/// the hop-by-hop ones, the body's real length, then the body. `None` for a request target that
/// cannot go on the wire (pingora's parser does not let one in; this does not trust that).
fn request_wire(downstream: &RequestHeader, body: &[u8]) -> Option<Vec<u8>> {
    let target = downstream.raw_path();
    if target.iter().any(|b| matches!(b, b' ' | b'\r' | b'\n' | 0)) {
        return None;
    }
    let mut wire = Vec::with_capacity(512 + body.len());
    wire.extend_from_slice(downstream.method.as_str().as_bytes());
    wire.push(b' ');
    wire.extend_from_slice(target);
    wire.extend_from_slice(b" HTTP/1.1\r\n");
    for (name, value) in &downstream.headers {
        if name == http::header::CONTENT_LENGTH
            || name == http::header::TRANSFER_ENCODING
            || HOP_BY_HOP.contains(&name.as_str())
        {
            continue;
        }
        wire.extend_from_slice(name.as_str().as_bytes());
        wire.extend_from_slice(b": ");
        wire.extend_from_slice(value.as_bytes());
        wire.extend_from_slice(b"\r\n");
    }
    wire.extend_from_slice(format!("content-length: {}\r\n\r\n", body.len()).as_bytes());
    wire.extend_from_slice(body);
    Some(wire)
}

/// The upstream's response header for the client, hop-by-hop headers dropped.
fn downstream_response(upstream: &ResponseHeader) -> ResponseHeader {
    let mut response = upstream.clone();
    for name in HOP_BY_HOP {
        response.remove_header(name);
    }
    response
}

fn bad_gateway(model: &str, detail: &str) -> ApiError {
    ApiError::new(
        StatusCode::BAD_GATEWAY,
        "upstream_failed",
        format!("the upstream of model {model} failed: {detail}"),
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn the_forwarded_request_drops_hop_by_hop_headers_and_carries_the_real_length() {
        let mut request = RequestHeader::build("POST", b"/v1/chat/completions?x=1", None).unwrap();
        for (name, value) in [
            ("Host", "gateway"),
            ("Connection", "keep-alive"),
            ("Keep-Alive", "timeout=5"),
            ("Transfer-Encoding", "chunked"),
            ("Content-Length", "999"),
            ("Content-Type", "application/json"),
            ("Authorization", "Bearer sk"),
        ] {
            request.append_header(name, value).unwrap();
        }
        let wire = request_wire(&request, b"{}").unwrap();
        let text = String::from_utf8(wire).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        let mut lines = head.split("\r\n");
        assert_eq!(lines.next(), Some("POST /v1/chat/completions?x=1 HTTP/1.1"));
        let mut headers: Vec<&str> = lines.collect();
        headers.sort_unstable();
        assert_eq!(
            headers,
            [
                "authorization: Bearer sk",
                "content-length: 2",
                "content-type: application/json",
                "host: gateway",
            ]
        );
        assert_eq!(body, "{}");
    }
}
