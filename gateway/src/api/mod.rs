//! The HTTP API: routing, authentication, and the handlers, on one pingora HTTP application.
//! Handlers write their own responses, so chat replies can stream and upstream answers pass through
//! as they arrive.

mod chat;
mod connection;
pub(crate) mod files;
mod io;
mod media_modes;
mod messages;
mod plan;
mod preprocess;
mod replay;
mod request;
mod responses;
mod steps;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Instant;

use http::StatusCode;
use mmgate_host::{CONTRACT_VERSION, PluginPool};
use pingora::protocols::http::ServerSession;
use serde_json::{Value, json};
use tracing::Instrument as _;

use crate::access::Access;
use crate::config::{ConnectionsConfig, RequestLimits};
use crate::draining::Draining;
use crate::error::ApiError;
use crate::keylimits::{KeyLimits, Permit};
use crate::media::fetch::Fetcher;
use crate::media::files::FileStore;
use crate::media::plugins::{LivePlugins, ReloadGuard};
use crate::metrics::{Metrics, ModelGauges, Snapshot};
use crate::model::LocalModel;
use crate::responses_store::ResponseStore;
use crate::store::{Caller, Redis};
use crate::upstream::{ClientHop, UpstreamPool};
use crate::wire::anthropic;
pub use connection::App;
use io::{write_error, write_json};
pub use media_modes::{EcMedia, UpstreamMedia};

/// How a model is served.
pub enum Route {
    Native(LocalModel),
    /// A pool of upstream servers runs the LLM; `media` says what they get of a request's media.
    Upstream {
        pool: Arc<UpstreamPool>,
        media: UpstreamMedia,
    },
}

/// What every request handler shares.
pub struct Gateway {
    pub plugins: Arc<LivePlugins>,
    pub pool: Arc<PluginPool>,
    pub models: BTreeMap<String, Route>,
    pub files: FileStore,
    /// Responses kept for `previous_response_id` (the Responses API's `store`).
    pub responses: ResponseStore,
    pub fetcher: Fetcher,
    pub limits: RequestLimits,
    /// How documents become pages.
    pub documents: crate::config::DocumentsConfig,
    /// How many client connections, and their timeouts.
    pub connections: ConnectionsConfig,
    /// Client connections open now (below `connections.max`).
    pub open_connections: AtomicUsize,
    pub api_keys: Vec<String>,
    /// Proxies whose forwarding headers are believed (see [`crate::upstream::forwarded`]).
    pub trusted_proxies: Vec<ipnet::IpNet>,
    /// Whether clients reach this gateway over TLS.
    pub https: bool,
    pub metrics: Metrics,
    /// The shared store, when replicas share one (its users hold it too; here for readiness).
    pub redis: Option<Arc<Redis>>,
    /// Requests and tokens per minute and requests in flight, per API key.
    pub key_limits: KeyLimits,
    /// Set on SIGTERM: `/ready` answers 503 so that load balancers stop sending traffic here.
    pub draining: Draining,
    /// Keeps the plugin directory watched while the gateway runs.
    pub _reload: ReloadGuard,
}

impl Gateway {
    /// Answers one request, in a span of its own: the root of its trace, or the continuation of
    /// the client's (`traceparent`).
    async fn handle(&self, session: &mut ServerSession) {
        let header = session.req_header();
        let (method, path) = (header.method.as_str(), header.uri.path());
        let route = route_label(path);
        let span = tracing::info_span!(
            "request",
            otel.name = %format_args!("{method} {route}"),
            otel.kind = "server",
            otel.status_code = tracing::field::Empty,
            http.request.method = method,
            http.route = route,
            http.response.status_code = tracing::field::Empty,
            gen_ai.request.model = tracing::field::Empty,
            mmgate.route = tracing::field::Empty,
            gen_ai.usage.input_tokens = tracing::field::Empty,
            gen_ai.usage.output_tokens = tracing::field::Empty,
            mmgate.media_tokens = tracing::field::Empty,
        );
        crate::telemetry::continue_trace(&span, &header.headers);
        self.handle_in_span(session).instrument(span).await;
    }

    async fn handle_in_span(&self, session: &mut ServerSession) {
        let started = Instant::now();
        let method = session.req_header().method.as_str().to_owned();
        let path = session.req_header().uri.path().to_owned();
        let client = session
            .client_addr()
            .and_then(|a| a.as_inet())
            .map(|a| a.ip());
        let mut access = Access::start(&method, client);
        if method == "OPTIONS" {
            // What a path takes, asked before anything of it runs (a CORS preflight carries no key).
            let (status, code) = match allowed_methods(&path) {
                Some(allow) => {
                    io::write_no_content(session, &[("allow", allow)]).await;
                    (StatusCode::NO_CONTENT, None)
                }
                None => {
                    let error = ApiError::not_found(&path);
                    write_error(session, &error).await;
                    (error.status, Some(error.code))
                }
            };
            let label = route_label(&path);
            self.metrics
                .request_done(label, "none", status, started.elapsed());
            access.log(label, "none", status, code);
            return;
        }
        // HEAD is GET without the body (RFC 9110 9.3.2): routed as GET; the writers leave the body
        // out.
        let routed = if method == "HEAD" {
            "GET"
        } else {
            method.as_str()
        };
        let mut _permit = None;
        if path.starts_with("/v1/") {
            let admitted = match self.authenticate(session) {
                Ok(()) => {
                    let caller = self.caller(session);
                    access.key = Some(caller.as_str().to_owned());
                    self.key_limits
                        .admit(&caller)
                        .await
                        .map_err(|e| ("limited", e))
                }
                Err(e) => Err(("unauthenticated", e)),
            };
            match admitted {
                // Held until the answer is written: a concurrent slot is freed when it is done.
                Ok(permit) => _permit = Some(permit),
                Err((label, error)) => {
                    write_error(session, &error).await;
                    self.metrics
                        .request_done(label, "none", error.status, started.elapsed());
                    access.log(route_label(&path), "none", error.status, Some(error.code));
                    return;
                }
            }
        }
        let result: Result<Value, ApiError> = match (routed, path.as_str()) {
            ("POST", "/v1/chat/completions") => {
                // Writes its own response (it may stream) and records its own metrics.
                let tally = _permit.as_ref().and_then(Permit::tally);
                return self.chat_completions(session, tally, access).await;
            }
            ("POST", "/v1/responses") => {
                let tally = _permit.as_ref().and_then(Permit::tally);
                return self.responses(session, tally, access).await;
            }
            ("POST", anthropic::MESSAGES) => {
                let tally = _permit.as_ref().and_then(Permit::tally);
                return self.messages(session, tally, access).await;
            }
            ("POST", anthropic::COUNT_TOKENS) => {
                let tally = _permit.as_ref().and_then(Permit::tally);
                let result = self.count_message_tokens(session, tally).await;
                chat::refused_if_client_error(result.as_ref().err(), tally);
                result
            }
            ("GET", "/metrics") => {
                let text = self.metrics.render(self.snapshot());
                io::write_text(session, "text/plain; version=0.0.4", text).await;
                self.metrics
                    .request_done("/metrics", "none", StatusCode::OK, started.elapsed());
                return;
            }
            ("GET", "/") => {
                io::write_redirect(session, crate::console::PATH).await;
                self.metrics
                    .request_done("/", "none", StatusCode::FOUND, started.elapsed());
                access.log("/", "none", StatusCode::FOUND, None);
                return;
            }
            ("GET", p) if crate::console::owns(p) => {
                let status = match crate::console::asset(p) {
                    Some(asset) => {
                        let headers = crate::console::HEADERS;
                        io::write_static(session, asset.content_type, asset.body, &headers).await;
                        StatusCode::OK
                    }
                    None => {
                        write_error(session, &ApiError::not_found(p)).await;
                        StatusCode::NOT_FOUND
                    }
                };
                self.metrics
                    .request_done("/console", "none", status, started.elapsed());
                access.log("/console", "none", status, None);
                return;
            }
            ("GET", "/health") => Ok(json!({ "status": "ok" })),
            ("GET", "/ready") => self.readiness().await,
            ("GET", "/v1/models") => Ok(self.models_json()),
            ("GET", "/v1/plugins") => Ok(self.plugins_json()),
            ("POST", "/v1/preprocess") => {
                let tally = _permit.as_ref().and_then(Permit::tally);
                let result = self.preprocess(session, tally).await;
                chat::refused_if_client_error(result.as_ref().err(), tally);
                result
            }
            ("POST", "/v1/files") => self.upload(session).await,
            ("GET", "/v1/files") => self.list_files(&self.caller(session)).await,
            (m, p) if p.starts_with("/v1/files/") => {
                let id = &p["/v1/files/".len()..];
                let caller = self.caller(session);
                match m {
                    "GET" => self.file_json(&caller, id).await,
                    "DELETE" => self.delete_file(&caller, id).await,
                    _ => Err(ApiError::method_not_allowed(&method, p, ITEM_METHODS)),
                }
            }
            (m, p) if p.starts_with("/v1/responses/") => {
                let id = &p["/v1/responses/".len()..];
                let caller = self.caller(session);
                match m {
                    "GET" => self.response_json(&caller, id).await,
                    "DELETE" => self.delete_response(&caller, id).await,
                    _ => Err(ApiError::method_not_allowed(&method, p, ITEM_METHODS)),
                }
            }
            (_, p) => match allowed_methods(p) {
                Some(allow) => Err(ApiError::method_not_allowed(&method, p, allow)),
                None => Err(ApiError::not_found(p)),
            },
        };
        let (status, code) = match &result {
            Ok(body) => {
                write_json(session, StatusCode::OK, body).await;
                (StatusCode::OK, None)
            }
            Err(error) => {
                access.failed_with(error);
                write_error(session, error).await;
                (error.status, Some(error.code))
            }
        };
        let label = route_label(&path);
        self.metrics
            .request_done(label, "none", status, started.elapsed());
        // The probes answer every few seconds: their lines would drown the rest.
        if !matches!(label, "/health" | "/ready" | "/metrics") || status != StatusCode::OK {
            access.log(label, "none", status, code);
        }
    }

    /// Who the client at `peer` (the connection's remote address) is, as upstreams are told.
    fn client_hop(&self, peer: Option<&pingora::protocols::l4::socket::SocketAddr>) -> ClientHop {
        let ip = peer.and_then(|addr| addr.as_inet()).map(|addr| addr.ip());
        ClientHop::new(ip, self.https, &self.trusted_proxies)
    }

    /// The forwarding headers of the lane's requests over `stream`: the lane takes no request that
    /// carries such headers of its own, so there is nothing of the client's to keep.
    fn forwarding_headers(&self, stream: &pingora::protocols::Stream) -> Vec<u8> {
        let digest = stream.get_socket_digest();
        self.client_hop(digest.as_deref().and_then(|d| d.peer_addr()))
            .headers(|_| None)
    }

    /// With `api_keys` configured, `/v1/*` needs one of them: `Authorization: Bearer <key>`, or
    /// `x-api-key: <key>` as Anthropic's clients send it.
    fn authenticate(&self, session: &ServerSession) -> Result<(), ApiError> {
        self.check_key(presented_key(session))
    }

    /// Whose request this is (after [`Self::authenticate`] let it in).
    fn caller(&self, session: &ServerSession) -> Caller {
        self.caller_for(presented_key(session))
    }

    /// Whose request this is, from the key it presented (if any).
    fn caller_for(&self, presented: Option<&str>) -> Caller {
        match presented {
            Some(key) if !self.api_keys.is_empty() => Caller::for_key(key),
            _ => Caller::public(),
        }
    }

    /// `/ready`: whether this replica should get traffic: not while it drains, nor while its
    /// shared store is unreachable. (Models and plugins are loaded before the listener opens.)
    async fn readiness(&self) -> Result<Value, ApiError> {
        if self.draining.is_draining() {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "draining",
                "this replica is shutting down",
            ));
        }
        if let Some(redis) = &self.redis {
            redis.ping().await?;
        }
        Ok(json!({ "status": "ready" }))
    }

    /// Whether the key a request presented (if any) lets it in.
    fn check_key(&self, presented: Option<&str>) -> Result<(), ApiError> {
        if self.api_keys.is_empty() {
            return Ok(());
        }
        match presented {
            Some(key) if self.api_keys.iter().any(|k| constant_time_eq(k, key)) => Ok(()),
            Some(_) => Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "invalid_api_key",
                "the API key is not valid",
            )),
            None => Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "missing_api_key",
                "this gateway needs an API key: Authorization: Bearer <key> (or x-api-key: <key>)",
            )),
        }
    }

    fn plugins_json(&self) -> Value {
        let registry = self.plugins.registry();
        let plugins: Vec<_> = registry
            .iter()
            .map(|p| {
                let d = p.descriptor();
                json!({
                    "name": d.name,
                    "version": d.version,
                    "contract_version": p.contract_version().to_string(),
                    "modalities": d.modalities,
                    "mime_types": d.mime_types,
                    "origin": p.origin().to_string(),
                    "sha256": p.sha256(),
                })
            })
            .collect();
        json!({
            "object": "list",
            "host_contract_version": CONTRACT_VERSION.to_string(),
            "data": plugins,
            "reload": self.plugins.status(),
        })
    }

    fn snapshot(&self) -> Snapshot {
        let mut models = Vec::new();
        let mut upstreams = Vec::new();
        let mut encoder_queues = Vec::new();
        for (name, route) in &self.models {
            let encoders = match route {
                Route::Native(model) => Some(model),
                Route::Upstream { media, .. } => media.encoders(),
            };
            if let Some(model) = encoders {
                let loads = model.runtime.encoders.loads();
                encoder_queues.push((name.clone(), loads.iter().map(|l| l.queued).sum()));
            }
            match route {
                Route::Native(model) => {
                    let Ok(engine) = model.runtime.engine() else {
                        continue;
                    };
                    let store = engine.feature_store().stats();
                    let engine = engine.stats();
                    models.push(ModelGauges {
                        model: name.clone(),
                        running: engine.running,
                        queued: engine.queued,
                        waiting_for_encoder: engine.waiting_for_encoder,
                        kv_bytes: engine.kv_bytes,
                        feature_pinned_bytes: store.pinned_bytes,
                        feature_cached_bytes: store.cached_bytes,
                        pieces_in_flight: engine.pieces_in_flight,
                        pieced_items: engine.pieced_items,
                        first_piece_ms: (engine.first_piece_seconds * 1e3) as u64,
                        last_piece_ms: (engine.last_piece_seconds * 1e3) as u64,
                    });
                }
                Route::Upstream { pool, .. } => {
                    for (addr, healthy) in pool.servers() {
                        upstreams.push((name.clone(), addr, healthy));
                    }
                }
            }
        }
        Snapshot {
            models,
            encoder_queues,
            upstreams,
            plugin_queue: self.pool.queued(),
            plugin_running: self.pool.running(),
            plugin_deadlines: (self.plugins.registry().iter())
                .map(|p| (p.name().to_owned(), p.deadlines_passed()))
                .collect(),
            file_bytes: self.files.local_bytes(),
        }
    }
}

/// A request path's label in metrics and the access log. Labels come from the routes, never from
/// the client's path: ids and unknown paths would make a new series each, without bound.
fn route_label(path: &str) -> &'static str {
    match path {
        "/health" => "/health",
        "/ready" => "/ready",
        "/metrics" => "/metrics",
        "/v1/models" => "/v1/models",
        "/v1/plugins" => "/v1/plugins",
        "/v1/preprocess" => "/v1/preprocess",
        "/v1/files" => "/v1/files",
        "/v1/chat/completions" => "/v1/chat/completions",
        "/v1/responses" => "/v1/responses",
        anthropic::MESSAGES => anthropic::MESSAGES,
        anthropic::COUNT_TOKENS => anthropic::COUNT_TOKENS,
        p if p.starts_with("/v1/files/") => "/v1/files/{id}",
        "/" => "/",
        p if crate::console::owns(p) => "/console",
        p if p.starts_with("/v1/responses/") => "/v1/responses/{id}",
        _ => "other",
    }
}

/// What `/v1/files/{id}` and `/v1/responses/{id}` take.
const ITEM_METHODS: &str = "GET, HEAD, DELETE, OPTIONS";

/// The methods a path takes (its `Allow`), or `None` for a path with no route.
fn allowed_methods(path: &str) -> Option<&'static str> {
    const READ: &str = "GET, HEAD, OPTIONS";
    const WRITE: &str = "POST, OPTIONS";
    Some(match route_label(path) {
        "/health" | "/ready" | "/metrics" | "/v1/models" | "/v1/plugins" | "/" | "/console" => READ,
        "/v1/preprocess" | "/v1/chat/completions" | "/v1/responses" => WRITE,
        anthropic::MESSAGES | anthropic::COUNT_TOKENS => WRITE,
        "/v1/files" => "GET, HEAD, POST, OPTIONS",
        "/v1/files/{id}" | "/v1/responses/{id}" => ITEM_METHODS,
        _ => return None,
    })
}

/// The key a request presents: `Authorization: Bearer <key>`, else `x-api-key: <key>`.
fn presented_key(session: &ServerSession) -> Option<&str> {
    let headers = &session.req_header().headers;
    let bearer = headers
        .get(http::header::AUTHORIZATION)
        .map(http::HeaderValue::as_bytes);
    bearer_key(bearer).or_else(|| {
        let key = headers.get("x-api-key")?.to_str().ok()?.trim();
        (!key.is_empty()).then_some(key)
    })
}

/// The key of an `Authorization` header value, if it is `Bearer <key>`.
fn bearer_key(authorization: Option<&[u8]>) -> Option<&str> {
    authorization
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
}

/// Comparing keys without leaking through timing how much of a guess was right.
fn constant_time_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_compare_equal_only_when_identical() {
        assert!(constant_time_eq("sk-abc", "sk-abc"));
        assert!(!constant_time_eq("sk-abc", "sk-abd"));
        assert!(!constant_time_eq("sk-abc", "sk-ab"));
    }
}
