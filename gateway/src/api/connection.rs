//! Each client connection (HTTP/1.1, over TCP or TLS): one request after another while the client
//! keeps it open.
//!
//! A plain chat completion for an upstream model (text, data URLs) is relayed as bytes: the
//! passthrough lane ([`crate::wire::http1`], [`crate::upstream::UpstreamPool::relay`]). It is most of an
//! inference proxy's traffic, and pingora's session types (a header map built and serialised again
//! on each side) cost more than the rest of such a request. Every other request, or one the lane
//! cannot be sure of, is served by pingora's HTTP/1 session, which starts from the bytes the lane
//! has read; the lane takes the connection back after it.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::BytesMut;
use http::StatusCode;
use pingora::apps::ServerApp;
use pingora::protocols::Stream;
use pingora::protocols::http::ServerSession;
use pingora::server::ShutdownWatch;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{Gateway, bearer_key};
use crate::access::{Access, UPSTREAM_FAILED_MID_ANSWER};
use crate::config::ConnectionsConfig;
use crate::deadline::Deadline;
use crate::error::ApiError;
use crate::upstream::{ClientSide, Relayed, send_within};
use crate::wire::http1::{self, Request, RequestCheck};

use super::replay::Replay;

/// A head the lane has not recognised within this many bytes goes to pingora (which allows more).
const MAX_LANE_HEAD: usize = 16 * 1024;

/// The most bytes read ahead that are handed to pingora as a pipelined prefix (its limit is 1 MiB).
const MAX_PIPELINED_PREFIX: usize = 256 * 1024;

/// What reads from the client ask room for.
const READ_SIZE: usize = 8 * 1024;

/// The application pingora runs for each connection.
pub struct App(pub Arc<Gateway>);

/// What the lane did with the request at the start of a connection's buffer.
enum Lane {
    /// Answered; the connection stays open when `keep_alive`.
    Served { keep_alive: bool },
    /// Not the lane's: pingora serves it from the buffered bytes.
    Pingora,
    /// The client closed the connection, went quiet, or failed.
    Closed,
}

/// What stays with a client connection from one of its relayed requests to the next.
struct ConnectionSide<'c> {
    /// The forwarding headers its requests carry upstream.
    forwarding: &'c [u8],
    /// The timer its upstream's answers are waited for by.
    answer_deadline: &'c mut Deadline,
}

#[async_trait]
impl ServerApp for App {
    async fn process_new(
        self: &Arc<Self>,
        mut stream: Stream,
        shutdown: &ShutdownWatch,
    ) -> Option<Stream> {
        let gateway = &self.0;
        let Some(_slot) = ConnectionSlot::take(gateway) else {
            gateway.refuse_busy(&mut stream).await;
            return None;
        };
        let mut buf = BytesMut::new();
        let mut clock = HeadClock::new_connection(&gateway.connections);
        // Who the client is does not change over a connection: the forwarding headers every
        // relayed request carries are made once (formatting them per request was a visible share
        // of a relayed request's time).
        let forwarding = gateway.forwarding_headers(&stream);
        let mut answer_deadline = Deadline::default();
        loop {
            let side = ConnectionSide {
                forwarding: &forwarding,
                answer_deadline: &mut answer_deadline,
            };
            match gateway
                .passthrough(&mut stream, &mut buf, &mut clock, side, shutdown)
                .await
            {
                Lane::Served { keep_alive: true } => {}
                Lane::Served { .. } | Lane::Closed => return None,
                Lane::Pingora => {
                    (stream, buf) = gateway.serve_one(stream, buf, shutdown).await?;
                }
            }
            clock.next_request();
        }
    }
}

/// The client's address on `stream`.
fn peer_ip(stream: &Stream) -> Option<std::net::IpAddr> {
    let digest = stream.get_socket_digest()?;
    digest.peer_addr()?.as_inet().map(|addr| addr.ip())
}

/// One of the `connections.max` client connections, given back when dropped.
struct ConnectionSlot<'g>(&'g AtomicUsize);

impl<'g> ConnectionSlot<'g> {
    fn take(gateway: &'g Gateway) -> Option<ConnectionSlot<'g>> {
        let open = &gateway.open_connections;
        let max = gateway.connections.max;
        open.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < max).then_some(n + 1)
        })
        .ok()
        .map(|_| ConnectionSlot(open))
    }
}

impl Drop for ConnectionSlot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// When the head of the request being read must have arrived: `head_timeout` from a new
/// connection's start, or from a kept-alive connection's first byte of its next request (which it
/// may wait `idle_timeout` for); and the connection's timer for reading requests.
struct HeadClock {
    deadline: Option<Instant>,
    head: Duration,
    idle: Duration,
    reads: Deadline,
}

impl HeadClock {
    fn new_connection(config: &ConnectionsConfig) -> HeadClock {
        HeadClock {
            deadline: Some(Instant::now() + config.head_timeout()),
            head: config.head_timeout(),
            idle: config.idle_timeout(),
            reads: Deadline::default(),
        }
    }

    /// The connection is kept alive for another request: the clock starts at its first byte.
    fn next_request(&mut self) {
        self.deadline = None;
    }

    /// How long the next read of the head may wait, `buf` holding what has come of it.
    fn wait(&mut self, buf: &[u8]) -> Duration {
        if self.deadline.is_none() && buf.is_empty() {
            return self.idle;
        }
        let now = Instant::now();
        let head = self.head;
        self.deadline
            .get_or_insert_with(|| now + head)
            .saturating_duration_since(now)
    }
}

impl Gateway {
    /// Relays the request at the start of `buf` (reading more of it from `stream` as needed) if it
    /// is the lane's. Once the server is shutting down, the answer closes the connection.
    async fn passthrough(
        &self,
        stream: &mut Stream,
        buf: &mut BytesMut,
        clock: &mut HeadClock,
        side: ConnectionSide<'_>,
        shutdown: &ShutdownWatch,
    ) -> Lane {
        let passable = loop {
            match http1::parse_request(buf, self.limits.max_body_bytes) {
                Request::Passable(passable) => break passable,
                Request::Other => return self.check_framing(stream, buf, clock).await,
                Request::Partial if buf.len() > MAX_LANE_HEAD => {
                    return self.check_framing(stream, buf, clock).await;
                }
                Request::Partial => {}
            }
            if let Some(lane) = self.read_head(stream, buf, clock).await {
                return lane;
            }
        };
        let started = Instant::now();
        let mut access = Access::start("POST", peer_ip(stream));
        let authorization = passable.authorization.clone().map(|r| &buf[r]);
        if self.check_key(bearer_key(authorization)).is_err() {
            // Refused in pingora's session, as every other unauthenticated request is.
            return Lane::Pingora;
        }
        while buf.len() < passable.len() {
            if !self.read_body(stream, buf, clock).await {
                return Lane::Closed;
            }
        }
        let Some((pool, user)) = self.passthrough_pool(&buf[passable.head_len..passable.len()])
        else {
            return Lane::Pingora;
        };
        let request = buf.split_to(passable.len());
        let caller = self.caller_for(bearer_key(authorization_of(&request, &passable)));
        access.key = Some(caller.as_str().to_owned());
        access.model = Some(pool.model.clone());
        let permit = match self.key_limits.admit(&caller).await {
            Ok(permit) => permit,
            Err(error) => {
                let closing = *shutdown.borrow();
                let written = send_within(
                    stream,
                    &error_response(&error, closing),
                    self.connections.send_timeout(),
                )
                .await;
                self.metrics.request_done(
                    "/v1/chat/completions",
                    "none",
                    error.status,
                    started.elapsed(),
                );
                access.log(
                    "/v1/chat/completions",
                    "none",
                    error.status,
                    Some(error.code),
                );
                return Lane::Served {
                    keep_alive: written.is_ok() && !closing,
                };
            }
        };
        let body = &request[passable.head_len..];
        let key = pool.balance_key(body, user.as_deref());
        let closing = *shutdown.borrow();
        let tally = permit.tally();
        if let Some(tally) = tally {
            tally.request(passable.len() - passable.head_len);
        }
        let side = ClientSide {
            forwarding: side.forwarding,
            closing,
            tally,
            send_timeout: self.connections.send_timeout(),
            answer_deadline: side.answer_deadline,
        };
        let relayed = pool.relay(stream, &request, &passable, &key, side).await;
        let (status, code, keep_alive) = match relayed {
            Relayed::Answered { status, keep_alive } => (status, None, keep_alive),
            Relayed::BrokeOff(status) => {
                access.broke_off(UPSTREAM_FAILED_MID_ANSWER);
                (status, None, false)
            }
            Relayed::Failed(error) => {
                let written = send_within(
                    stream,
                    &error_response(&error, closing),
                    self.connections.send_timeout(),
                )
                .await;
                (error.status, Some(error.code), written.is_ok() && !closing)
            }
        };
        self.metrics.request_done(
            "/v1/chat/completions",
            "upstream",
            status,
            started.elapsed(),
        );
        access.log("/v1/chat/completions", "upstream", status, code);
        Lane::Served { keep_alive }
    }

    /// Holds a request the lane leaves to pingora to RFC 9112's framing rules (the table on
    /// [`http1::RequestCheck`]) before pingora reads it: a request framed ambiguously is refused
    /// and the connection closed, a chunked body is followed to its end (refused if malformed), and
    /// a client that waits for `100 Continue` gets it.
    async fn check_framing(
        &self,
        stream: &mut Stream,
        buf: &mut BytesMut,
        clock: &mut HeadClock,
    ) -> Lane {
        let head = loop {
            match http1::check_request(buf) {
                RequestCheck::Pass(head) => break head,
                RequestCheck::Refuse {
                    status,
                    code,
                    message,
                } => return self.refuse(stream, status, code, message).await,
                RequestCheck::Partial => {}
            }
            if let Some(lane) = self.read_head(stream, buf, clock).await {
                return lane;
            }
        };
        let max_body = self.limits.max_body_bytes;
        // A body over the limit, or a key this gateway refuses, is answered from the head alone:
        // the client is not asked for the body (RFC 9110 10.1.1).
        let answered_from_head = head.content_length.is_some_and(|n| n > max_body)
            || self
                .check_key(bearer_key(head.authorization.map(|r| &buf[r])))
                .is_err();
        if head.expects_continue && !answered_from_head && buf.len() == head.head_len {
            let written = send_within(
                stream,
                b"HTTP/1.1 100 Continue\r\n\r\n",
                self.connections.send_timeout(),
            )
            .await;
            if written.is_err() {
                return Lane::Closed;
            }
        }
        if head.chunked && !answered_from_head {
            let mut body = http1::Chunked::default();
            let mut at = head.head_len;
            loop {
                match body.advance(&buf[at..]) {
                    Ok(progress) if progress.done => break,
                    Ok(progress) => at += progress.body,
                    Err(_) => {
                        let message = "the chunked body is malformed (RFC 9112 7.1: every chunk \
                                       line ends in CRLF)";
                        return self
                            .refuse(stream, StatusCode::BAD_REQUEST, "bad_chunked_body", message)
                            .await;
                    }
                }
                // Past the limit the route refuses it as too large; nothing more is held here.
                if at - head.head_len > max_body {
                    break;
                }
                if !self.read_body(stream, buf, clock).await {
                    return Lane::Closed;
                }
            }
        }
        Lane::Pingora
    }

    /// Answers a request the framing rules refuse, and closes the connection: what follows its
    /// head cannot be told apart from a next request.
    async fn refuse(
        &self,
        stream: &mut Stream,
        status: StatusCode,
        code: &'static str,
        message: &str,
    ) -> Lane {
        let error = ApiError::new(status, code, message);
        Access::start("-", peer_ip(stream)).log("other", "none", status, Some(code));
        let written = send_within(
            stream,
            &error_response(&error, true),
            self.connections.send_timeout(),
        )
        .await;
        if let Err(e) = written {
            tracing::debug!(error = %e, "answering a refused request");
        }
        self.metrics
            .request_done("other", "none", status, Duration::ZERO);
        Lane::Served { keep_alive: false }
    }

    /// Reads more of a request's head as `clock` allows. `None` to go on; else the connection's
    /// end: closed, or a head that did not arrive in time answered 408 (a connection that sent
    /// nothing of it is closed without a word, as an idle one is).
    async fn read_head(
        &self,
        stream: &mut Stream,
        buf: &mut BytesMut,
        clock: &mut HeadClock,
    ) -> Option<Lane> {
        let wait = clock.wait(buf);
        match read_more(stream, buf, wait, &mut clock.reads).await {
            Read::More => None,
            Read::Closed => Some(Lane::Closed),
            Read::TimedOut if buf.is_empty() => Some(Lane::Closed),
            Read::TimedOut => {
                let message = format!(
                    "the request head did not arrive within {} ms",
                    self.connections.head_timeout_ms
                );
                let status = StatusCode::REQUEST_TIMEOUT;
                Some(
                    self.refuse(stream, status, "request_timeout", &message)
                        .await,
                )
            }
        }
    }

    /// Reads more of a request's body; false when the client closed, failed or went quiet for
    /// `idle_timeout`.
    async fn read_body(
        &self,
        stream: &mut Stream,
        buf: &mut BytesMut,
        clock: &mut HeadClock,
    ) -> bool {
        let wait = self.connections.idle_timeout();
        matches!(
            read_more(stream, buf, wait, &mut clock.reads).await,
            Read::More
        )
    }

    /// Answers a connection past `connections.max` with 503 and closes it. What the client sent
    /// is read first (a little, briefly): closing on unread bytes would reset the connection, and
    /// the client would see that instead of the answer.
    async fn refuse_busy(&self, stream: &mut Stream) {
        const BRIEFLY: Duration = Duration::from_secs(1);
        let mut error = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_busy",
            format!(
                "this gateway has {} connections open, its most; retry shortly",
                self.connections.max
            ),
        );
        error.retry_after = Some(1);
        let mut buf = BytesMut::new();
        let mut reads = Deadline::default();
        if matches!(
            read_more(stream, &mut buf, BRIEFLY, &mut reads).await,
            Read::Closed
        ) {
            return;
        }
        if send_within(stream, &error_response(&error, true), BRIEFLY)
            .await
            .is_ok()
        {
            let _ = stream.shutdown().await;
            while buf.len() < MAX_LANE_HEAD
                && matches!(
                    read_more(stream, &mut buf, BRIEFLY, &mut reads).await,
                    Read::More
                )
            {}
        }
        self.metrics
            .request_done("other", "none", error.status, Duration::ZERO);
        Access::start("-", peer_ip(stream)).log("other", "none", error.status, Some(error.code));
    }

    /// Serves the request at the start of `buf` (and of what follows on `stream`) in a pingora
    /// session; the connection and what was read past the request come back if it stays open.
    async fn serve_one(
        &self,
        stream: Stream,
        buf: BytesMut,
        shutdown: &ShutdownWatch,
    ) -> Option<(Stream, BytesMut)> {
        // pingora refuses a pipelined prefix over its header limit (1 MiB) unparsed: a request
        // whose body the lane read that far is replayed from the stream instead.
        let mut session = if buf.len() > MAX_PIPELINED_PREFIX {
            ServerSession::new_http1(Replay::stream(buf, stream))
        } else {
            let mut session = ServerSession::new_http1(stream);
            if !buf.is_empty() {
                session.set_pipelined_prefix(buf);
            }
            session
        };
        // Pipelined requests are served in turn (bytes read past this request come back below).
        session.set_pipelining_enabled(true);
        session.set_read_timeout(Some(self.connections.idle_timeout()));
        session.set_write_timeout(Some(self.connections.send_timeout()));
        match session.read_request().await {
            Ok(true) => {}
            Ok(false) => return None,
            Err(e) => {
                tracing::debug!(error = %e, "reading a request");
                return None;
            }
        }
        // pingora has decided from the request whether the connection may stay open (not after
        // `Connection: close`, HTTP/1.0 without keep-alive, or a request framed two ways); this
        // only sets how long, and closes every connection once the server is shutting down.
        if *shutdown.borrow() {
            session.set_keepalive(None);
        } else if session.get_keepalive().is_some() {
            session.set_keepalive(Some(self.connections.idle_timeout().as_secs().max(1)));
        }
        self.handle(&mut session).await;
        match session.finish().await {
            Ok(Some(reusable)) => {
                let (stream, prefix) = reusable.into_parts();
                Some((Replay::unwrap(stream), prefix.unwrap_or_default()))
            }
            Ok(None) => None,
            Err(e) => {
                tracing::debug!(error = %e, "finishing a request");
                None
            }
        }
    }
}

/// How a read from the client went.
enum Read {
    More,
    Closed,
    TimedOut,
}

/// Reads more of a request into `buf`, waiting at most `wait` (kept by `deadline`).
async fn read_more(
    stream: &mut Stream,
    buf: &mut BytesMut,
    wait: Duration,
    deadline: &mut Deadline,
) -> Read {
    buf.reserve(READ_SIZE);
    match deadline.within(wait, stream.read_buf(buf)).await {
        Ok(Ok(0)) => Read::Closed,
        Ok(Ok(_)) => Read::More,
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "reading a request");
            Read::Closed
        }
        Err(_) => Read::TimedOut,
    }
}

/// The `Authorization` header's value in a request the lane parsed.
fn authorization_of<'a>(request: &'a [u8], passable: &http1::Passable) -> Option<&'a [u8]> {
    passable.authorization.clone().and_then(|r| request.get(r))
}

/// An error answer as the lane writes it: the JSON body every route answers errors with.
fn error_response(error: &ApiError, closing: bool) -> Vec<u8> {
    let body = error.body();
    let status = error.status;
    let retry_after = error
        .retry_after
        .map(|s| format!("retry-after: {s}\r\n"))
        .unwrap_or_default();
    let mut wire = format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{retry_after}{}\r\n",
        status.as_u16(),
        status.canonical_reason().unwrap_or(""),
        body.len(),
        if closing { "connection: close\r\n" } else { "" },
    )
    .into_bytes();
    wire.extend_from_slice(&body);
    wire
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_lane_error_is_a_complete_json_response() {
        let error = ApiError::new(StatusCode::BAD_GATEWAY, "upstream_failed", "gone");
        assert!(
            String::from_utf8(error_response(&error, true))
                .unwrap()
                .contains("\r\nconnection: close\r\n\r\n")
        );
        let wire = String::from_utf8(error_response(&error, false)).unwrap();
        let (head, body) = wire.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 502 Bad Gateway\r\n"), "{head}");
        assert!(head.contains(&format!("content-length: {}", body.len())));
        let body: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(body["error"]["code"], "upstream_failed");
    }
}
