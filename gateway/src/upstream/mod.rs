//! Upstream pools: a model served by other OpenAI-compatible servers (vLLM, SGLang, another
//! mmgate). Pingora's load balancer picks a healthy server (round robin or consistent hashing) and
//! its health checks eject dead ones in the background; connections are kept alive between
//! requests ([`idle`]), over TLS for `https://` servers. A request goes out as it came (less the
//! hop-by-hop headers; `Host` names the server and `Authorization` follows the pool's key policy),
//! and the answer (SSE streams included) is passed back chunk by chunk as it arrives.
//!
//! The request body is read before a server is chosen (the model name is in it), so forwarding is
//! done here rather than by pingora's proxy service, which cannot replay a body it did not read
//! itself. Plain requests are relayed as bytes ([`relay`]: the passthrough lane); the others
//! ([`UpstreamPool::forward`]: rewritten bodies, requests pingora's session read) leave with header
//! and body in one write (pingora's client session flushes the header on its own, a second send per
//! request), and pingora's HTTP/1 client session reads the answer.

pub mod embeds;
pub mod forwarded;
mod health;
mod idle;
pub mod inline;
pub mod planned;
mod relay;

pub use forwarded::ClientHop;
pub(crate) use relay::send_within;
pub use relay::{ClientSide, Relayed};

use std::borrow::Cow;
use std::collections::BTreeSet;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};
use bytes::Bytes;
use http::StatusCode;
use pingora::connectors::{ConnectorOptions, TransportConnector};
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::lb::discovery::Static;
use pingora::lb::selection::{BackendIter, BackendSelection, Consistent, RoundRobin};
use pingora::lb::{Backend, Backends, LoadBalancer};
use pingora::protocols::Stream;
use pingora::protocols::http::ServerSession;
use pingora::protocols::http::v1::client::HttpSession as UpstreamSession;
use pingora::services::ServiceWithDependents;
use pingora::services::background::background_service;
use pingora::upstreams::peer::HttpPeer;
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tracing::Instrument as _;

use crate::access::CLIENT_CLOSED;
use crate::config::{Balance, ModelConfig, UpstreamAddr};
use crate::error::ApiError;
use crate::keylimits::TokenTally;
use crate::wire::http1::HopByHop;

/// How long connecting to an upstream server (TLS handshake included) may take before the next
/// one is tried.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// One configured upstream server, as its connections are made.
pub struct Target {
    /// Tells its idle connections apart from those made for another configured server at the same
    /// address (another TLS server name, another CA): those are never handed to it.
    id: usize,
    addr: UpstreamAddr,
    /// The `Host` header its requests carry.
    authority: String,
}

impl Target {
    fn new(addr: UpstreamAddr) -> Target {
        static NEXT_ID: AtomicUsize = AtomicUsize::new(0);
        Target {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            authority: addr.authority(),
            addr,
        }
    }

    /// A connection to this server at `socket` (one of the addresses its host resolved to). For
    /// TLS the host is the server name sent and checked against the certificate (an IP address
    /// too: pingora skips verification when no name is given).
    fn peer(&self, socket: SocketAddr) -> HttpPeer {
        let sni = if self.addr.tls {
            self.addr.host.clone()
        } else {
            String::new()
        };
        let mut peer = HttpPeer::new(socket, self.addr.tls, sni);
        peer.options.connection_timeout = Some(CONNECT_TIMEOUT);
        peer
    }
}

/// The resolved addresses of a pool's servers, each with the server it belongs to. Few per pool:
/// a list is the cheapest map.
pub struct Targets(Vec<(SocketAddr, Arc<Target>)>);

impl Targets {
    /// Resolves each configured server; an address two of them share is refused (the balancer
    /// could not tell them apart).
    fn resolve(model: &ModelConfig) -> anyhow::Result<Targets> {
        let mut resolved: Vec<(SocketAddr, Arc<Target>)> = Vec::new();
        for addr in &model.upstreams {
            let sockets: Vec<SocketAddr> = (addr.host.as_str(), addr.port)
                .to_socket_addrs()
                .with_context(|| format!("resolving {addr}"))?
                .collect();
            if sockets.is_empty() {
                bail!("{addr} resolves to no address");
            }
            let target = Arc::new(Target::new(addr.clone()));
            for socket in sockets {
                if let Some((_, other)) = resolved.iter().find(|(s, _)| *s == socket) {
                    bail!(
                        "{addr} and {} both resolve to {socket}: list the server once",
                        other.addr
                    );
                }
                resolved.push((socket, target.clone()));
            }
        }
        Ok(Targets(resolved))
    }

    fn get(&self, socket: &SocketAddr) -> Option<&Arc<Target>> {
        self.0.iter().find(|(s, _)| s == socket).map(|(_, t)| t)
    }

    fn backends(&self) -> Backends {
        let set: BTreeSet<Backend> = self
            .0
            .iter()
            .map(|&(socket, _)| Backend {
                addr: pingora::protocols::l4::socket::SocketAddr::Inet(socket),
                weight: 1,
                ext: http::Extensions::new(),
            })
            .collect();
        Backends::new(Static::new(set))
    }
}

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

    fn servers(&self) -> Vec<(SocketAddr, bool)> {
        fn list<S>(lb: &LoadBalancer<S>) -> Vec<(SocketAddr, bool)>
        where
            S: BackendSelection + 'static,
            S::Iter: BackendIter,
        {
            lb.backends()
                .get_backend()
                .iter()
                .filter_map(|b| Some((*b.addr.as_inet()?, lb.backends().ready(b))))
                .collect()
        }
        match self {
            Self::RoundRobin(lb) => list(lb),
            Self::Consistent(lb) => list(lb),
        }
    }
}

/// What the upstreams get as `Authorization`.
#[derive(Clone)]
enum UpstreamAuth {
    /// The client's header, as it came.
    PassThrough,
    /// None: the client's header held this gateway's key.
    Strip,
    /// The configured upstream key, in place of the client's.
    Key(http::HeaderValue),
}

pub struct UpstreamPool {
    pub model: String,
    /// Whether clients may send `image_embeds` parts for the model.
    pub accept_image_embeds: bool,
    /// The name the servers know the model by, when it is not [`Self::model`].
    pub upstream_model: Option<String>,
    /// How long a server may take to begin its answer, and then each next piece of it.
    answer_timeout: Duration,
    balancer: Balancer,
    /// How a request's key for the balancer is made.
    balance: Balance,
    targets: Arc<Targets>,
    connector: Arc<TransportConnector>,
    auth: UpstreamAuth,
}

/// What this gateway adds to an upstream's answer.
#[derive(Default)]
pub struct ReplyAdditions {
    pub headers: Vec<(&'static str, http::HeaderValue)>,
    /// Set as `usage.media` of a non-streamed JSON answer (the per-item media accounts).
    pub usage_media: Option<Value>,
    /// The request's items in the EC store: held until its answer is over, so that no item the
    /// upstream was promised leaves the store before it read it.
    pub held: Vec<crate::ec_store::Pin>,
}

/// The most bytes of a JSON answer read whole to add `usage.media`; a larger one passes through
/// as it comes, without it.
const MAX_EDITED_ANSWER_BYTES: usize = 16 << 20;

/// The outcome of forwarding.
pub enum Forwarded {
    /// The upstream's answer, with this status, went to the client (completely, or until the
    /// upstream failed), or [`CLIENT_CLOSED`] when the client left first.
    Answered(StatusCode),
    /// Nothing was sent to the client yet: answer with this error.
    Failed(ApiError),
}

impl UpstreamPool {
    /// The pool of `model` and the background service running its health checks (to be added to
    /// the pingora server). `gateway_keys`: whether this gateway checks clients' API keys (then a
    /// client's `Authorization` is never passed on).
    pub fn build(
        model: &ModelConfig,
        gateway_keys: bool,
    ) -> anyhow::Result<(Arc<UpstreamPool>, Box<dyn ServiceWithDependents>)> {
        let targets = Arc::new(
            Targets::resolve(model)
                .with_context(|| format!("model {}: its upstreams", model.name))?,
        );
        let mut options = ConnectorOptions::new(0);
        options.ca_file = match &model.upstream_ca_file {
            Some(path) => Some(
                path.to_str()
                    .with_context(|| format!("{} is not a UTF-8 path", path.display()))?
                    .to_owned(),
            ),
            None => None,
        };
        let connector = Arc::new(TransportConnector::new(Some(options)));
        let auth = match &model.upstream_api_key {
            Some(key) => UpstreamAuth::Key(
                http::HeaderValue::from_str(&format!("Bearer {key}"))
                    .with_context(|| format!("model {}: upstream_api_key", model.name))?,
            ),
            None if gateway_keys => UpstreamAuth::Strip,
            None => UpstreamAuth::PassThrough,
        };
        let check = health::ServerCheck::new(
            &model.health_check,
            targets.clone(),
            connector.clone(),
            auth.key(),
        );
        let name = format!("health checks of {}", model.name);
        let interval = Duration::from_millis(model.health_check.interval_ms);
        let (balancer, service): (Balancer, Box<dyn ServiceWithDependents>) = match model.balance {
            Balance::RoundRobin => {
                let mut lb = LoadBalancer::<RoundRobin>::from_backends(targets.backends());
                lb.set_health_check(Box::new(check));
                lb.health_check_frequency = Some(interval);
                let service = background_service(&name, lb);
                (Balancer::RoundRobin(service.task()), Box::new(service))
            }
            Balance::ConsistentHash | Balance::MediaHash => {
                let mut lb = LoadBalancer::<Consistent>::from_backends(targets.backends());
                lb.set_health_check(Box::new(check));
                lb.health_check_frequency = Some(interval);
                let service = background_service(&name, lb);
                (Balancer::Consistent(service.task()), Box::new(service))
            }
        };
        let pool = UpstreamPool {
            model: model.name.clone(),
            accept_image_embeds: model.accept_image_embeds,
            upstream_model: model.upstream_model.clone(),
            answer_timeout: Duration::from_millis(model.upstream_timeout_ms),
            balancer,
            balance: model.balance,
            targets,
            connector,
            auth,
        };
        Ok((Arc::new(pool), service))
    }

    /// Each server and whether it is in rotation.
    pub fn health_json(&self) -> Value {
        self.balancer
            .servers()
            .into_iter()
            .map(|(socket, healthy)| {
                let server = self.targets.get(&socket).map(|t| t.addr.to_string());
                json!({"server": server, "address": socket.to_string(), "healthy": healthy})
            })
            .collect()
    }

    /// Each server's address and whether it is in rotation.
    pub fn servers(&self) -> Vec<(String, bool)> {
        self.balancer
            .servers()
            .into_iter()
            .map(|(socket, healthy)| (socket.to_string(), healthy))
            .collect()
    }

    /// How long the upstream may take to begin an answer, and between its pieces.
    pub fn answer_timeout(&self) -> Duration {
        self.answer_timeout
    }

    /// What picks a server for a request (`body`, as it goes upstream, from `user`): under
    /// `media_hash` the content of its media when it has any; else the user, else the body. Round
    /// robin ignores it.
    pub fn balance_key<'b>(&self, body: &'b [u8], user: Option<&'b str>) -> Cow<'b, [u8]> {
        if self.balance == Balance::MediaHash
            && let Some(digest) = media_digest(body)
        {
            return Cow::Owned(digest);
        }
        Cow::Borrowed(user.map_or(body, str::as_bytes))
    }

    /// Sends the request (`downstream`'s header with `body`) to a healthy server and streams its
    /// answer back, with `extra` headers added to it; servers are tried as [`Attempts`] says.
    pub async fn forward(
        &self,
        downstream: &mut ServerSession,
        body: Bytes,
        key: &[u8],
        additions: &ReplyAdditions,
        client: &ClientHop,
        tally: Option<&TokenTally>,
    ) -> Forwarded {
        if !valid_target(origin_form(downstream.req_header())) {
            return Forwarded::Failed(bad_gateway(
                &self.model,
                "the request target cannot be forwarded",
            ));
        }
        let mut exchange = match self
            .exchange(downstream.req_header(), &body, key, client)
            .await
        {
            Ok(exchange) => exchange,
            Err(error) => return Forwarded::Failed(error),
        };
        let server = exchange.idle_key.0;
        let Some(header) = exchange.upstream.resp_header() else {
            return Forwarded::Failed(bad_gateway(&self.model, "no response header"));
        };
        let status = header.status;
        let mut response = downstream_response(header);
        let _ = crate::telemetry::with_trace_id(&mut response);
        for (name, value) in &additions.headers {
            let _ = response.insert_header(*name, value.clone());
        }
        if let Some(media) = &additions.usage_media
            && has_content_type(&response, "application/json")
        {
            return self
                .answer_with_usage_media(downstream, exchange, response, media, tally)
                .await;
        }
        let event_stream = has_content_type(&response, "text/event-stream");
        if let Err(e) = downstream.write_response_header(Box::new(response)).await {
            tracing::debug!(error = %e, "client went away before the answer");
            return Forwarded::Answered(CLIENT_CLOSED);
        }
        loop {
            let read =
                tokio::time::timeout(self.answer_timeout, exchange.upstream.read_body_bytes())
                    .await
                    .unwrap_or_else(|_| {
                        Err(pingora::Error::explain(
                            pingora::ErrorType::ReadTimedout,
                            "no more of the answer within upstream_timeout_ms",
                        ))
                    });
            match read {
                Ok(Some(chunk)) => {
                    if let Some(tally) = tally {
                        tally.answer(&chunk);
                    }
                    if let Err(e) = downstream.write_response_body(chunk, false).await {
                        // The client left: the upstream connection is dropped, not reused.
                        tracing::debug!(error = %e, "client went away mid-answer");
                        return Forwarded::Answered(CLIENT_CLOSED);
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(upstream = %server, error = %e, "upstream failed mid-answer");
                    // A stream of events ends with an error event, and properly: the client
                    // learns why rather than seeing the connection drop.
                    if event_stream {
                        let event = mid_stream_error_event(&self.model, &e);
                        if downstream
                            .write_response_body(event.into(), true)
                            .await
                            .is_ok()
                        {
                            let _ = downstream.finish_body().await;
                        }
                    }
                    return Forwarded::Answered(status);
                }
            }
        }
        if let Err(e) = downstream.finish_body().await {
            tracing::debug!(error = %e, "finishing the answer to the client");
        }
        exchange.done().await;
        Forwarded::Answered(status)
    }

    /// Sends `header` with `body` to a healthy server (picked by `key`, tried as [`Attempts`]
    /// says) and reads its answer's head: the session to read the rest of it from.
    pub async fn exchange(
        &self,
        header: &RequestHeader,
        body: &[u8],
        key: &[u8],
        client: &ClientHop,
    ) -> Result<Exchange, ApiError> {
        let span = tracing::info_span!(
            "upstream",
            otel.kind = "client",
            gen_ai.request.model = %self.model,
            server.address = tracing::field::Empty,
            http.request.method = header.method.as_str(),
            url.path = header.uri.path(),
            http.response.status_code = tracing::field::Empty,
            mmgate.body_bytes = crate::access::as_attribute(body.len()),
        );
        self.exchange_in(&span, header, body, key, client)
            .instrument(span.clone())
            .await
    }

    async fn exchange_in(
        &self,
        span: &tracing::Span,
        header: &RequestHeader,
        body: &[u8],
        key: &[u8],
        client: &ClientHop,
    ) -> Result<Exchange, ApiError> {
        // The engine continues this request's trace (vLLM does, given `traceparent`).
        let trace = crate::telemetry::propagation_headers();
        let mut attempts = Attempts::new(self, key);
        while let Some(Connection {
            server,
            target,
            mut stream,
            reused,
        }) = attempts.connect().await
        {
            span.record("server.address", tracing::field::display(server));
            let wire = request_wire(header, body, &target.authority, &self.auth, client, &trace);
            let written = async {
                stream.write_all(&wire).await?;
                stream.flush().await
            }
            .await;
            // A request that could not even be written to a kept-alive connection never reached
            // the server: it goes to the next. Once written, it may have been acted on (a POST is
            // not idempotent: a second send could run the completion twice), so a failure to
            // answer is a 502, never a retry.
            if let Err(e) = written {
                match attempts.unsent(server, &e, reused) {
                    None => continue,
                    Some(error) => return Err(error),
                }
            }
            let mut upstream = UpstreamSession::new(stream);
            return match tokio::time::timeout(self.answer_timeout, final_response(&mut upstream))
                .await
            {
                Ok(Ok(())) => {
                    if let Some(answer) = upstream.resp_header() {
                        span.record(
                            "http.response.status_code",
                            i64::from(answer.status.as_u16()),
                        );
                    }
                    Ok(Exchange {
                        idle_key: (server, target.id),
                        upstream,
                    })
                }
                Ok(Err(e)) => Err(attempts.failed(server, &e)),
                Err(_) => Err(self.timed_out(server)),
            };
        }
        Err(attempts.exhausted())
    }

    /// Answers with the upstream's JSON `response` read whole, `media` set as its `usage.media`
    /// (a body that is not a JSON object with `usage`, or too large, goes as it came).
    async fn answer_with_usage_media(
        &self,
        downstream: &mut ServerSession,
        mut exchange: Exchange,
        mut response: ResponseHeader,
        media: &Value,
        tally: Option<&TokenTally>,
    ) -> Forwarded {
        let server = exchange.idle_key.0;
        let status = response.status;
        let body = match exchange.read_whole(self.answer_timeout).await {
            Ok(body) => body,
            Err(error) => {
                tracing::warn!(upstream = %server, %error, "upstream failed mid-answer");
                return Forwarded::Failed(bad_gateway(&self.model, &error));
            }
        };
        let body = with_usage_media(body, media);
        if let Some(tally) = tally {
            tally.answer(&body);
        }
        let _ = response.remove_header(&http::header::TRANSFER_ENCODING);
        let _ = response.insert_header(http::header::CONTENT_LENGTH, body.len());
        if let Err(e) = downstream.write_response_header(Box::new(response)).await {
            tracing::debug!(error = %e, "client went away before the answer");
            return Forwarded::Answered(CLIENT_CLOSED);
        }
        if let Err(e) = downstream.write_response_body(body.into(), true).await {
            tracing::debug!(error = %e, "client went away mid-answer");
            return Forwarded::Answered(CLIENT_CLOSED);
        }
        if let Err(e) = downstream.finish_body().await {
            tracing::debug!(error = %e, "finishing the answer to the client");
        }
        exchange.done().await;
        Forwarded::Answered(status)
    }

    /// The answer to a request `server` took and did not begin to answer in time (it is not sent
    /// again: it may be running).
    fn timed_out(&self, server: SocketAddr) -> ApiError {
        tracing::warn!(model = %self.model, upstream = %server, "upstream did not answer in time");
        ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "upstream_timeout",
            format!(
                "the upstream of model {} did not answer within {} ms",
                self.model,
                self.answer_timeout.as_millis()
            ),
        )
    }

    /// A kept-alive connection to `target` at `server`, or a new one; and whether it was kept
    /// alive.
    async fn connect(
        &self,
        server: SocketAddr,
        target: &Target,
    ) -> pingora::Result<(Stream, bool)> {
        if let Some(stream) = idle::take((server, target.id)) {
            return Ok((stream, true));
        }
        let stream = self.connector.new_stream(&target.peer(server)).await?;
        Ok((stream, false))
    }
}

/// Reads the upstream's response head, past any interim (1xx) ones: the client's request was
/// answered `100 Continue` here if it asked, and an upstream's interim answers are not relayed.
async fn final_response(upstream: &mut UpstreamSession) -> Result<(), String> {
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
    idle_key: idle::Key,
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

struct Connection {
    server: SocketAddr,
    target: Arc<Target>,
    stream: Stream,
    /// Whether it was kept alive from an earlier request (the server may have closed it since).
    reused: bool,
}

/// One request's way through a pool's servers, shared by [`UpstreamPool::forward`] and
/// [`UpstreamPool::relay`]: a server that cannot be reached is skipped for the next, as is a
/// kept-alive connection the server had closed before the request could be written to it; once
/// the request is written, it is not sent again (RFC 9110 9.2.2: a POST is not idempotent).
struct Attempts<'p> {
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
    fn new(pool: &'p UpstreamPool, key: &'p [u8]) -> Attempts<'p> {
        Attempts {
            pool,
            key,
            tried: Vec::new(),
            left: pool.targets.0.len() * 2,
            last_error: String::from("no server is healthy"),
        }
    }

    /// A connection to the next healthy server that takes one; `None` when none is left.
    async fn connect(&mut self) -> Option<Connection> {
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
    fn unsent(
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
    fn failed(&mut self, server: SocketAddr, error: &dyn std::fmt::Display) -> ApiError {
        self.last_error = format!("{server}: {error}");
        tracing::warn!(model = %self.pool.model, upstream = %server, error = %error, "upstream failed");
        bad_gateway(&self.pool.model, &self.last_error)
    }

    /// The error once no server could take the request.
    fn exhausted(self) -> ApiError {
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

impl UpstreamAuth {
    /// The `Authorization` value this gateway sends of its own, if any.
    fn key(&self) -> Option<http::HeaderValue> {
        match self {
            UpstreamAuth::Key(value) => Some(value.clone()),
            UpstreamAuth::PassThrough | UpstreamAuth::Strip => None,
        }
    }
}

/// A digest of every data URL in a request body (by the time a request goes upstream, its media
/// are data URLs: fetched and uploaded ones are inlined first), in order; `None` without media.
/// The base64 text is hashed as it is: the same file sent the same way hashes the same.
fn media_digest(body: &[u8]) -> Option<Vec<u8>> {
    use std::hash::{DefaultHasher, Hasher};
    // 64 bits pick a server well enough; nothing here needs a cryptographic hash.
    let mut hasher = DefaultHasher::new();
    let mut found = false;
    for start in memchr::memmem::find_iter(body, b"\"data:") {
        let url = &body[start + 1..];
        let end = memchr::memchr(b'"', url).unwrap_or(url.len());
        hasher.write(&url[..end]);
        hasher.write_u8(0);
        found = true;
    }
    found.then(|| hasher.finish().to_le_bytes().to_vec())
}

/// The server-sent event that ends a stream whose upstream failed mid-answer: the OpenAI-shaped
/// error (502 `upstream_failed`) as an event's data, as vLLM reports errors mid-stream.
pub(crate) fn mid_stream_error_event(model: &str, why: &dyn std::fmt::Display) -> Vec<u8> {
    let error = ApiError::new(
        StatusCode::BAD_GATEWAY,
        "upstream_failed",
        format!("the upstream of model {model} failed mid-answer: {why}"),
    );
    let mut event = b"data: ".to_vec();
    event.extend_from_slice(&error.body());
    event.extend_from_slice(b"\n\n");
    event
}

/// Whether an answer's `Content-Type` is `media_type` (parameters aside).
fn has_content_type(response: &ResponseHeader, media_type: &str) -> bool {
    response
        .headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.trim_start().starts_with(media_type))
}

/// `body` with `media` as its `usage.media`, when it is a JSON object with a `usage` object;
/// else as it came.
fn with_usage_media(body: Vec<u8>, media: &Value) -> Vec<u8> {
    let Ok(mut answer) = serde_json::from_slice::<Value>(&body) else {
        return body;
    };
    match answer.get_mut("usage").and_then(Value::as_object_mut) {
        Some(usage) => {
            usage.insert("media".into(), media.clone());
            serde_json::to_vec(&answer).unwrap_or(body)
        }
        None => body,
    }
}

/// The request target in origin form (`/path?query`): as the client sent it, or, for an
/// absolute-form target (`http://host/path`, RFC 9112 3.2.2), its path and query.
fn origin_form(request: &RequestHeader) -> &[u8] {
    let raw = request.raw_path();
    if raw.starts_with(b"/") {
        return raw;
    }
    request
        .uri
        .path_and_query()
        .map_or(b"/".as_slice(), |p| p.as_str().as_bytes())
}

/// Whether a request target can go on the wire as it is (pingora's parser does not let such a
/// one in; this does not trust that).
fn valid_target(target: &[u8]) -> bool {
    !target.iter().any(|b| matches!(b, b' ' | b'\r' | b'\n' | 0))
}

/// The request as the upstream gets it, in one buffer: the client's request line and headers less
/// the hop-by-hop ones, who the client is ([`ClientHop`]), `Host` naming the upstream (as a reverse proxy sends it: a virtual-hosted
/// or TLS server routes on it), `Authorization` as `auth` says, the body's real length, then the
/// body.
fn request_wire(
    downstream: &RequestHeader,
    body: &[u8],
    authority: &str,
    auth: &UpstreamAuth,
    client: &ClientHop,
    trace: &[(String, String)],
) -> Vec<u8> {
    let mut wire = Vec::with_capacity(512 + body.len());
    wire.extend_from_slice(downstream.method.as_str().as_bytes());
    wire.push(b' ');
    wire.extend_from_slice(origin_form(downstream));
    wire.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    wire.extend_from_slice(authority.as_bytes());
    wire.extend_from_slice(b"\r\n");
    let mut header = |name: &[u8], value: &[u8]| {
        wire.extend_from_slice(name);
        wire.extend_from_slice(b": ");
        wire.extend_from_slice(value);
        wire.extend_from_slice(b"\r\n");
    };
    if let UpstreamAuth::Key(value) = auth {
        header(b"authorization", value.as_bytes());
    }
    let hop = hop_by_hop(&downstream.headers);
    for (name, value) in &downstream.headers {
        let replaced = name == http::header::HOST
            || (name == http::header::AUTHORIZATION && !matches!(auth, UpstreamAuth::PassThrough));
        // The body is whole by now and framed by its length below; an `Expect` was answered here.
        if replaced
            || name == http::header::CONTENT_LENGTH
            || name == http::header::TRANSFER_ENCODING
            || name == http::header::EXPECT
            || hop.drops(name.as_str())
            || crate::wire::http1::is_forwarding_header(name.as_str())
            || trace.iter().any(|(traced, _)| name.as_str() == traced)
        {
            continue;
        }
        header(name.as_str().as_bytes(), value.as_bytes());
    }
    for (name, value) in trace {
        header(name.as_bytes(), value.as_bytes());
    }
    wire.extend_from_slice(&client.headers(|name| {
        let values: Vec<&str> = downstream
            .headers
            .get_all(name)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect();
        (!values.is_empty()).then(|| values.join(", "))
    }));
    wire.extend_from_slice(format!("content-length: {}\r\n\r\n", body.len()).as_bytes());
    wire.extend_from_slice(body);
    wire
}

/// The upstream's response header for the client, hop-by-hop headers (and those its `Connection`
/// names) dropped.
fn downstream_response(upstream: &ResponseHeader) -> ResponseHeader {
    let mut response = upstream.clone();
    let hop = hop_by_hop(&upstream.headers);
    let dropped: Vec<http::HeaderName> = upstream
        .headers
        .keys()
        .filter(|name| hop.drops(name.as_str()))
        .cloned()
        .collect();
    for name in dropped {
        response.remove_header(&name);
    }
    response
}

/// The headers of a message that stay on this hop, from its `Connection` headers.
fn hop_by_hop(headers: &http::HeaderMap) -> HopByHop<'_> {
    HopByHop::new(
        headers
            .get_all(http::header::CONNECTION)
            .iter()
            .map(http::HeaderValue::as_bytes),
    )
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

    use pingora::upstreams::peer::Peer;

    use super::*;

    fn client_request() -> RequestHeader {
        let mut request = RequestHeader::build("POST", b"/v1/chat/completions?x=1", None).unwrap();
        for (name, value) in [
            ("Host", "gateway"),
            ("Connection", "keep-alive"),
            ("Keep-Alive", "timeout=5"),
            ("Transfer-Encoding", "chunked"),
            ("Content-Length", "999"),
            ("Content-Type", "application/json"),
            ("Authorization", "Bearer sk-client"),
            // Not from a trusted proxy: replaced by what this gateway knows of the client.
            ("X-Forwarded-For", "1.2.3.4"),
        ] {
            request.append_header(name, value).unwrap();
        }
        request
    }

    #[test]
    fn the_requests_own_trace_context_replaces_the_clients() {
        let mut request = client_request();
        request
            .insert_header(
                "traceparent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            )
            .unwrap();
        let ours = "00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01";
        let (_, headers, _) = split(request_wire(
            &request,
            b"",
            "h:1",
            &UpstreamAuth::PassThrough,
            &ClientHop::new(None, false, &[]),
            &[("traceparent".to_owned(), ours.to_owned())],
        ));
        let sent: Vec<_> = headers
            .iter()
            .filter(|h| h.starts_with("traceparent"))
            .collect();
        assert_eq!(sent, [&format!("traceparent: {ours}")]);
    }

    /// (request line, sorted header lines, body) of a wire request.
    fn split(wire: Vec<u8>) -> (String, Vec<String>, String) {
        let text = String::from_utf8(wire).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        let mut lines = head.split("\r\n").map(str::to_owned);
        let first = lines.next().unwrap();
        let mut headers: Vec<String> = lines.collect();
        headers.sort_unstable();
        (first, headers, body.to_owned())
    }

    #[test]
    fn the_forwarded_request_names_the_upstream_drops_hop_by_hop_headers_and_carries_the_real_length()
     {
        let wire = request_wire(
            &client_request(),
            b"{}",
            "vllm:8000",
            &UpstreamAuth::PassThrough,
            &ClientHop::new(Some([192, 0, 2, 1].into()), false, &[]),
            &[],
        );
        let (first, headers, body) = split(wire);
        assert_eq!(first, "POST /v1/chat/completions?x=1 HTTP/1.1");
        assert_eq!(
            headers,
            [
                "authorization: Bearer sk-client",
                "content-length: 2",
                "content-type: application/json",
                "forwarded: for=192.0.2.1;proto=http",
                "host: vllm:8000",
                "x-forwarded-for: 192.0.2.1",
                "x-forwarded-proto: http",
            ]
        );
        assert_eq!(body, "{}");
    }

    #[test]
    fn the_client_key_is_replaced_by_the_upstream_key_or_dropped_when_it_was_this_gateways() {
        let key = UpstreamAuth::Key(http::HeaderValue::from_static("Bearer sk-upstream"));
        let (_, headers, _) = split(request_wire(
            &client_request(),
            b"",
            "h:1",
            &key,
            &ClientHop::new(None, false, &[]),
            &[],
        ));
        let auth: Vec<_> = headers
            .iter()
            .filter(|h| h.starts_with("authorization"))
            .collect();
        assert_eq!(auth, ["authorization: Bearer sk-upstream"]);

        let (_, headers, _) = split(request_wire(
            &client_request(),
            b"",
            "h:1",
            &UpstreamAuth::Strip,
            &ClientHop::new(None, false, &[]),
            &[],
        ));
        assert!(
            !headers.iter().any(|h| h.starts_with("authorization")),
            "{headers:?}"
        );
    }

    #[test]
    fn media_accounts_join_the_usage_of_a_json_answer_only() {
        let media = json!([{"index": 0, "tokens": 12}]);
        let answer = br#"{"id":"x","usage":{"prompt_tokens":20}}"#.to_vec();
        let edited: Value = serde_json::from_slice(&with_usage_media(answer, &media)).unwrap();
        assert_eq!(edited["usage"]["media"], media);
        assert_eq!(edited["usage"]["prompt_tokens"], 20);
        for other in [&b"not json"[..], br#"{"error":{"message":"x"}}"#, b"[1]"] {
            assert_eq!(with_usage_media(other.to_vec(), &media), other);
        }
    }

    #[test]
    fn a_target_that_cannot_go_on_the_wire_is_refused() {
        assert!(valid_target(b"/v1/chat/completions?a=b"));
        for bad in [&b"/a b"[..], b"/a\r\nx: y", b"/a\n", b"/a\0"] {
            assert!(!valid_target(bad), "{bad:?}");
        }
    }

    #[test]
    fn a_tls_peer_always_names_its_server_so_the_certificate_is_checked() {
        let socket: SocketAddr = "127.0.0.1:8443".parse().unwrap();
        let named =
            Target::new(UpstreamAddr::try_from("https://localhost:8443".to_owned()).unwrap());
        let peer = named.peer(socket);
        assert!(peer.is_tls());
        assert_eq!(peer.sni(), "localhost");
        let by_ip =
            Target::new(UpstreamAddr::try_from("https://127.0.0.1:8443".to_owned()).unwrap());
        assert_eq!(by_ip.peer(socket).sni(), "127.0.0.1");
        let plain = Target::new(UpstreamAddr::try_from("127.0.0.1:8000".to_owned()).unwrap());
        assert!(!plain.peer(socket).is_tls());
        assert_ne!(
            named.id, by_ip.id,
            "two configured servers never share idle connections"
        );
    }
}
