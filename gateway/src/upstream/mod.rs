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

mod balance;
pub mod embeds;
mod exchange;
pub mod forwarded;
mod health;
mod idle;
pub mod inline;
pub mod planned;
mod relay;

use balance::Balancer;
pub use balance::{Target, Targets};
pub use exchange::Exchange;
use exchange::{Attempts, Connection, final_response};
pub use forwarded::ClientHop;
pub(crate) use relay::send_within;
pub use relay::{ClientSide, Relayed};

use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use http::StatusCode;
use pingora::connectors::{ConnectorOptions, TransportConnector};
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::lb::LoadBalancer;
use pingora::lb::selection::{Consistent, RoundRobin};
use pingora::protocols::Stream;
use pingora::protocols::http::ServerSession;
use pingora::protocols::http::v1::client::HttpSession as UpstreamSession;
use pingora::services::ServiceWithDependents;
use pingora::services::background::background_service;
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tracing::Instrument as _;

use crate::access::CLIENT_CLOSED;
use crate::config::{Balance, ModelConfig};
use crate::error::ApiError;
use crate::keylimits::TokenTally;
use crate::wire::http1::HopByHop;

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
    /// The answer began with this status and the upstream failed before its end (a stream
    /// of events then ends with an error event).
    BrokeOff(StatusCode),
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
                    return Forwarded::BrokeOff(status);
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
}
