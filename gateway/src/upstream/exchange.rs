//! One request's way to a server: the attempts over a pool's servers (a server that cannot be
//! reached or a stale kept-alive connection is skipped, a request once written is not sent again),
//! and the exchange whose answer is read.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use pingora::protocols::Stream;
use pingora::protocols::http::v1::client::HttpSession as UpstreamSession;

use super::balance::Target;
use super::{MAX_EDITED_ANSWER_BYTES, UpstreamPool, bad_gateway, idle};
use crate::error::ApiError;

/// Reads the upstream's response head, past any interim (1xx) ones: the client's request was
/// answered `100 Continue` here if it asked, and an upstream's interim answers are not relayed.
pub(super) async fn final_response(upstream: &mut UpstreamSession) -> Result<(), String> {
    loop {
        upstream.read_response().await.map_err(|e| e.to_string())?;
        let interim = upstream.resp_header().is_some_and(|h| {
            h.status.is_informational() && h.status != StatusCode::SWITCHING_PROTOCOLS
        });
        if !interim {
            return Ok(());
        }
    }
}

/// A connection to one of a pool's servers, for one request.
/// A request sent and its answer's head read ([`UpstreamPool::exchange`]).
pub struct Exchange {
    /// The server that answers, and its target: where the connection goes back when it is done.
    pub(super) idle_key: idle::Key,
    pub upstream: UpstreamSession,
}

impl Exchange {
    /// The rest of the answer, read whole (at most [`MAX_EDITED_ANSWER_BYTES`], each read within
    /// `timeout`), or why not.
    pub async fn read_whole(&mut self, timeout: Duration) -> Result<Vec<u8>, String> {
        let mut body = Vec::new();
        loop {
            match tokio::time::timeout(timeout, self.upstream.read_body_bytes()).await {
                Ok(Ok(Some(chunk))) if body.len() + chunk.len() <= MAX_EDITED_ANSWER_BYTES => {
                    body.extend_from_slice(&chunk);
                }
                Ok(Ok(Some(_))) => {
                    return Err(format!(
                        "the answer is over {MAX_EDITED_ANSWER_BYTES} bytes"
                    ));
                }
                Ok(Ok(None)) => return Ok(body),
                Ok(Err(e)) => return Err(e.to_string()),
                Err(_) => return Err("no more of the answer within upstream_timeout_ms".into()),
            }
        }
    }

    /// Puts the connection back for the next request to the same server, if the answer was read
    /// whole and the server keeps it alive.
    pub async fn done(mut self) {
        if self.upstream.is_body_done() {
            self.upstream.respect_keepalive();
            if let Some(stream) = self.upstream.reuse().await {
                idle::put(self.idle_key, stream);
            }
        }
    }
}

pub(super) struct Connection {
    pub(super) server: SocketAddr,
    pub(super) target: Arc<Target>,
    pub(super) stream: Stream,
    /// Whether it was kept alive from an earlier request (the server may have closed it since).
    pub(super) reused: bool,
}

/// One request's way through a pool's servers, shared by [`UpstreamPool::forward`] and
/// [`UpstreamPool::relay`]: a server that cannot be reached is skipped for the next, as is a
/// kept-alive connection the server had closed before the request could be written to it; once
/// the request is written, it is not sent again (RFC 9110 9.2.2: a POST is not idempotent).
pub(super) struct Attempts<'p> {
    pool: &'p UpstreamPool,
    /// What consistent hashing picks a server by.
    key: &'p [u8],
    /// Few servers per pool: a list is the cheapest set.
    tried: Vec<SocketAddr>,
    /// Each server once, and once more after a kept-alive connection it had closed.
    left: usize,
    last_error: String,
}

impl<'p> Attempts<'p> {
    pub(super) fn new(pool: &'p UpstreamPool, key: &'p [u8]) -> Attempts<'p> {
        Attempts {
            pool,
            key,
            tried: Vec::new(),
            left: pool.targets.len() * 2,
            last_error: String::from("no server is healthy"),
        }
    }

    /// A connection to the next healthy server that takes one; `None` when none is left.
    pub(super) async fn connect(&mut self) -> Option<Connection> {
        while self.left > 0 {
            self.left -= 1;
            let backend = self.pool.balancer.select(self.key, &self.tried)?;
            // Every backend is one of the pool's resolved addresses.
            let Some(server) = backend.addr.as_inet().copied() else {
                continue;
            };
            let Some(target) = self.pool.targets.get(&server).cloned() else {
                continue;
            };
            match self.pool.connect(server, &target).await {
                Ok((stream, reused)) => {
                    return Some(Connection {
                        server,
                        target,
                        stream,
                        reused,
                    });
                }
                Err(e) => {
                    tracing::warn!(model = %self.pool.model, upstream = %server, error = %e, "upstream unreachable; trying the next");
                    self.last_error = format!("{server}: {e}");
                    self.tried.push(server);
                }
            }
        }
        None
    }

    /// The request could not be written to `server`: `None` to try again when the connection was
    /// a kept-alive one the server had closed (`reused`: the request never reached it), else the
    /// error to answer with.
    pub(super) fn unsent(
        &mut self,
        server: SocketAddr,
        error: &dyn std::fmt::Display,
        reused: bool,
    ) -> Option<ApiError> {
        if !reused {
            return Some(self.failed(server, error));
        }
        self.last_error = format!("{server}: {error}");
        tracing::debug!(upstream = %server, error = %error, "stale upstream connection; retrying");
        None
    }

    /// `server` took the request and failed before answering: the error to answer with (the
    /// request is not sent again).
    pub(super) fn failed(&mut self, server: SocketAddr, error: &dyn std::fmt::Display) -> ApiError {
        self.last_error = format!("{server}: {error}");
        tracing::warn!(model = %self.pool.model, upstream = %server, error = %error, "upstream failed");
        bad_gateway(&self.pool.model, &self.last_error)
    }

    /// The error once no server could take the request.
    pub(super) fn exhausted(self) -> ApiError {
        ApiError::new(
            StatusCode::BAD_GATEWAY,
            "upstream_unavailable",
            format!(
                "no upstream of model {} could take the request ({})",
                self.pool.model, self.last_error
            ),
        )
    }
}
