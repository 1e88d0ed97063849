//! Upstream pools: a model served by other OpenAI-compatible servers (vLLM, SGLang, another
//! mmgate). Pingora's load balancer picks a healthy server (round robin or consistent hashing) and
//! its health checks eject dead ones in the background; pingora's connector keeps connections
//! alive between requests. A request goes out byte for byte as it came, and the answer (SSE
//! streams included) is passed back chunk by chunk as it arrives.
//!
//! The request body is read before a server is chosen (the model name is in it), so forwarding is
//! done here with pingora's client session rather than its proxy service, which cannot replay a
//! body it did not read itself.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use http::StatusCode;
use pingora::connectors::http::Connector;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::lb::health_check::{HttpHealthCheck, TcpHealthCheck};
use pingora::lb::selection::{BackendIter, BackendSelection, Consistent, RoundRobin};
use pingora::lb::{Backend, LoadBalancer};
use pingora::protocols::http::ServerSession;
use pingora::services::ServiceWithDependents;
use pingora::services::background::background_service;
use pingora::upstreams::peer::HttpPeer;
use serde_json::{Value, json};

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

/// How long an idle upstream connection is kept for the next request.
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

enum Balancer {
    RoundRobin(Arc<LoadBalancer<RoundRobin>>),
    Consistent(Arc<LoadBalancer<Consistent>>),
}

impl Balancer {
    /// The first server the selection offers that is healthy and not yet tried.
    fn select(&self, key: &[u8], tried: &HashSet<String>) -> Option<Backend> {
        fn pick<S>(lb: &LoadBalancer<S>, key: &[u8], tried: &HashSet<String>) -> Option<Backend>
        where
            S: BackendSelection + 'static,
            S::Iter: BackendIter,
        {
            lb.select_with(key, 256, |b, healthy| {
                healthy && !tried.contains(&b.addr.to_string())
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
    connector: Connector,
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
            connector: Connector::new(None),
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
    /// answer back. A server that cannot be reached is skipped for the next one, as is a kept-alive
    /// connection the server had closed; once a server has the request, it is not sent again.
    pub async fn forward(
        &self,
        downstream: &mut ServerSession,
        body: Bytes,
        key: &[u8],
    ) -> Forwarded {
        let mut tried = HashSet::new();
        let mut last_error = String::from("no server is healthy");
        for _ in 0..self.servers * 2 {
            let Some(backend) = self.balancer.select(key, &tried) else {
                break;
            };
            let addr = backend.addr.to_string();
            let mut peer = HttpPeer::new(addr.as_str(), false, String::new());
            peer.options.connection_timeout = Some(Duration::from_secs(2));
            let (mut upstream, reused) = match self.connector.get_http_session(&peer).await {
                Ok(session) => session,
                Err(e) => {
                    tracing::warn!(model = %self.model, upstream = %addr, error = %e, "upstream unreachable; trying the next");
                    last_error = format!("{addr}: {e}");
                    tried.insert(addr);
                    continue;
                }
            };
            let request = upstream_request(downstream.req_header(), body.len());
            let sent = async {
                upstream.write_request_header(Box::new(request)).await?;
                upstream.write_request_body(body.clone(), true).await?;
                upstream.finish_request_body().await?;
                upstream.read_response_header().await
            }
            .await;
            if let Err(e) = sent {
                last_error = format!("{addr}: {e}");
                if reused {
                    // The server closed a kept-alive connection: the request never reached it.
                    tracing::debug!(upstream = %addr, error = %e, "stale upstream connection; retrying");
                    continue;
                }
                tracing::warn!(model = %self.model, upstream = %addr, error = %e, "upstream failed");
                return Forwarded::Failed(bad_gateway(&self.model, &last_error));
            }
            let Some(header) = upstream.response_header() else {
                return Forwarded::Failed(bad_gateway(&self.model, "no response header"));
            };
            let response = downstream_response(header);
            if let Err(e) = downstream.write_response_header(Box::new(response)).await {
                tracing::debug!(error = %e, "client went away before the answer");
                return Forwarded::Answered;
            }
            loop {
                match upstream.read_response_body().await {
                    Ok(Some(chunk)) => {
                        if let Err(e) = downstream.write_response_body(chunk, false).await {
                            // The client left: the upstream connection is dropped, not reused.
                            tracing::debug!(error = %e, "client went away mid-answer");
                            return Forwarded::Answered;
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(upstream = %addr, error = %e, "upstream failed mid-answer");
                        return Forwarded::Answered;
                    }
                }
            }
            if let Err(e) = downstream.finish_body().await {
                tracing::debug!(error = %e, "finishing the answer to the client");
            }
            if upstream.response_done() {
                self.connector
                    .release_http_session(upstream, &peer, Some(IDLE_TIMEOUT))
                    .await;
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

/// The client's request header for the upstream: hop-by-hop headers dropped, the body's real length.
fn upstream_request(downstream: &RequestHeader, body_len: usize) -> RequestHeader {
    let mut request = downstream.clone();
    for name in HOP_BY_HOP
        .iter()
        .chain(&["transfer-encoding", "content-length"])
    {
        request.remove_header(*name);
    }
    let _ = request.insert_header("content-length", body_len.to_string());
    request
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
