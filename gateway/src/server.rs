//! The HTTP service on pingora. So far: health, the plugin inventory, and running one media item
//! through its plugin; the OpenAI chat API builds on this service.

use std::sync::Arc;

use anyhow::Context;
use async_trait::async_trait;
use base64::Engine as _;
use http::{Response, StatusCode};
use mmgate_host::{CONTRACT_VERSION, LoadedPlugin, Media, PluginPool, Sandbox};
use pingora::apps::http_app::{HttpServer, ServeHttp};
use pingora::protocols::http::ServerSession;
use pingora::server::Server;
use pingora::server::configuration::ServerConf;
use pingora::services::listening::Service;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::budget::BudgetError;
use crate::config::Config;
use crate::error::ApiError;
use crate::media::sniff_mime_type;
use crate::pipeline;
use crate::plugins::{LivePlugins, ReloadGuard};

/// Largest request body accepted on `POST /v1/preprocess` (base64 makes a 48 MiB item 64 MiB).
const MAX_BODY_BYTES: usize = 64 << 20;

/// What every request handler shares.
pub struct Gateway {
    plugins: Arc<LivePlugins>,
    pool: Arc<PluginPool>,
    _reload: ReloadGuard,
}

impl Gateway {
    pub fn new(config: &Config) -> anyhow::Result<Gateway> {
        let sandbox = Arc::new(Sandbox::new(config.sandbox.clone())?);
        let plugins = Arc::new(LivePlugins::load(sandbox, config.plugin_dir.as_deref())?);
        let reload = plugins.watch()?;
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
        let pool = PluginPool::new(threads, threads * 16).context("starting the plugin pool")?;
        Ok(Gateway {
            plugins,
            pool: Arc::new(pool),
            _reload: reload,
        })
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

    /// `POST /v1/preprocess`: media items through their plugins as a chat request runs them (several
    /// items share the budget); answers with the plans and the tensors' shapes (the account `mmgate
    /// preprocess --explain` prints).
    async fn preprocess(&self, session: &mut ServerSession) -> Result<Value, ApiError> {
        let body = read_body(session).await?;
        let request: PreprocessRequest = serde_json::from_slice(&body).map_err(|e| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_json",
                format!("the request body is not a valid preprocess request: {e}"),
            )
        })?;
        let (media, several) = match &request.media {
            OneOrMany::One(url) => (vec![media_of(url)?], false),
            OneOrMany::Many(urls) if urls.is_empty() => {
                return Err(ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_request",
                    "media is an empty list",
                ));
            }
            OneOrMany::Many(urls) => (
                urls.iter().map(|u| media_of(u)).collect::<Result<_, _>>()?,
                true,
            ),
        };
        // The snapshot this request runs on, whatever is reloaded meanwhile.
        let registry = self.plugins.registry();
        let named = match &request.plugin {
            Some(name) => Some(registry.get(name).cloned().ok_or_else(|| {
                ApiError::new(
                    StatusCode::NOT_FOUND,
                    "plugin_not_found",
                    format!("no plugin named {name:?} is loaded"),
                )
            })?),
            None => None,
        };
        let config = request.processor_config.to_string();
        let max_tokens = request.max_tokens.unwrap_or(u32::MAX);
        // Choosing may probe, so it runs on the plugin pool too, in the same job as the items.
        self.pool
            .run(move || {
                let mut items = Vec::with_capacity(media.len());
                for (index, media) in media.into_iter().enumerate() {
                    let chosen = named
                        .clone()
                        .or_else(|| pipeline::choose_plugin(&registry, &media).cloned());
                    match chosen {
                        Some(plugin) => items.push((plugin, media)),
                        None => return Ok(Err(unsupported(index, several, media.mime_type))),
                    }
                }
                Ok(Ok(run_items(&items, &config, max_tokens, several)))
            })
            .await
            .map_err(|e| ApiError::from(&e))?
            .and_then(|outcome| outcome)
    }
}

/// The account of the items as `POST /v1/preprocess` answers it: one item's report, or the list's.
fn run_items(
    items: &[(Arc<LoadedPlugin>, Media)],
    config: &str,
    max_tokens: u32,
    several: bool,
) -> Result<Value, ApiError> {
    let processed = pipeline::process_together(items, config, max_tokens).map_err(|e| match e {
        BudgetError::TooSmall { .. } => ApiError::new(
            StatusCode::BAD_REQUEST,
            "context_length_exceeded",
            e.to_string(),
        ),
        BudgetError::Plugin { item, error } => {
            let mut api = ApiError::from(&error);
            if several {
                api.message = format!("media item {item}: {}", api.message);
            }
            api
        }
    })?;
    let mut reports = items
        .iter()
        .zip(&processed)
        .map(|((plugin, _), processed)| {
            let mut report = serde_json::Map::new();
            report.insert("object".into(), json!("preprocess"));
            report.extend(pipeline::report(plugin, processed));
            Value::Object(report)
        })
        .collect::<Vec<_>>();
    if !several {
        return Ok(reports.pop().unwrap_or_default());
    }
    let tokens: u64 = processed.iter().map(|p| u64::from(p.plan.tokens)).sum();
    Ok(json!({ "object": "list", "tokens": tokens, "max_tokens": max_tokens, "data": reports }))
}

fn unsupported(index: usize, several: bool, mime_type: Option<String>) -> ApiError {
    let what = match mime_type {
        Some(mime) => format!("no loaded plugin accepts {mime}"),
        None => "no loaded plugin recognises this media".to_owned(),
    };
    let message = if several {
        format!("media item {index}: {what}")
    } else {
        what
    };
    ApiError::new(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported_media",
        message,
    )
}

/// A data URL's media, typed by its bytes when they are recognised, else by the URL's MIME type.
fn media_of(url: &str) -> Result<Media, ApiError> {
    let (declared_mime, data) = decode_data_url(url)?;
    let mime_type = sniff_mime_type(&data).map(str::to_owned).or(declared_mime);
    Ok(Media { data, mime_type })
}

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PreprocessRequest {
    /// A data URL (`data:<mime>;base64,<bytes>`), or a list of them planned together: the items of
    /// one request share `max_tokens`.
    media: OneOrMany,
    /// A plugin by name (default: chosen by the media's type).
    #[serde(default)]
    plugin: Option<String>,
    /// The model's `preprocessor_config.json`.
    #[serde(default = "empty_object")]
    processor_config: Value,
    /// The token budget of the item, or of all items together (default: unlimited, native sizes).
    #[serde(default)]
    max_tokens: Option<u32>,
}

fn empty_object() -> Value {
    json!({})
}

/// `data:[<mime>][;base64],<data>` → (mime, bytes). Only base64 payloads carry binary media.
fn decode_data_url(url: &str) -> Result<(Option<String>, Vec<u8>), ApiError> {
    let invalid = |message: &str| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_media_url",
            message.to_owned(),
        )
    };
    let rest = url
        .strip_prefix("data:")
        .ok_or_else(|| invalid("media must be a data URL (data:<mime>;base64,<bytes>)"))?;
    let (header, payload) = rest
        .split_once(',')
        .ok_or_else(|| invalid("the data URL has no ',' before its payload"))?;
    let mime = header
        .strip_suffix(";base64")
        .ok_or_else(|| invalid("the data URL is not base64 (data:<mime>;base64,<bytes>)"))?;
    let data = base64::engine::general_purpose::STANDARD
        .decode(payload.trim())
        .map_err(|e| invalid(&format!("the data URL's base64 does not decode: {e}")))?;
    let mime = (!mime.is_empty()).then(|| mime.to_ascii_lowercase());
    Ok((mime, data))
}

/// The request body, refused past [`MAX_BODY_BYTES`] (by Content-Length before reading, else while
/// reading).
async fn read_body(session: &mut ServerSession) -> Result<Vec<u8>, ApiError> {
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "request_too_large",
            format!("the request body is over {MAX_BODY_BYTES} bytes"),
        )
    };
    let declared = session
        .req_header()
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > MAX_BODY_BYTES) {
        return Err(too_large());
    }
    let mut body = Vec::with_capacity(declared.unwrap_or(0));
    loop {
        let chunk = session.read_request_body().await.map_err(|e| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_request_body",
                format!("cannot read the request body: {e}"),
            )
        })?;
        let Some(chunk) = chunk else { break };
        if body.len() + chunk.len() > MAX_BODY_BYTES {
            return Err(too_large());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

#[async_trait]
impl ServeHttp for Gateway {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        let request = session.req_header();
        let method = request.method.as_str().to_owned();
        let path = request.uri.path().to_owned();
        let result = match (method.as_str(), path.as_str()) {
            ("GET", "/health") => Ok(json!({ "status": "ok" })),
            ("GET", "/v1/plugins") => Ok(self.plugins_json()),
            ("POST", "/v1/preprocess") => self.preprocess(session).await,
            (_, "/health" | "/v1/plugins" | "/v1/preprocess") => {
                Err(ApiError::method_not_allowed(&method, &path))
            }
            _ => Err(ApiError::not_found(&path)),
        };
        match result {
            Ok(body) => json_response(StatusCode::OK, body.to_string().into_bytes()),
            Err(error) => json_response(error.status, error.body()),
        }
    }
}

fn json_response(status: StatusCode, body: Vec<u8>) -> Response<Vec<u8>> {
    let length = body.len();
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .header("content-length", length)
        .body(body)
        .unwrap_or_else(|_| Response::new(Vec::new()))
}

pub fn serve(config: Config) -> anyhow::Result<()> {
    let gateway = Gateway::new(&config)?;
    tracing::info!(
        listen = %config.listen,
        plugins = gateway.plugins.registry().len(),
        plugin_dir = ?config.plugin_dir,
        "mmgate is serving"
    );
    let mut conf = ServerConf::new().context("creating the pingora configuration")?;
    conf.threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    // On SIGTERM pingora keeps serving for a grace period meant for handing listeners to an upgraded
    // process (5 minutes by default); mmgate does not upgrade in place, so in-flight requests get
    // `shutdown_grace_seconds` to finish and then it exits. SIGINT stops at once.
    conf.grace_period_seconds = Some(config.shutdown_grace_seconds);
    conf.graceful_shutdown_timeout_seconds = Some(1);
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();
    let mut service = Service::new("mmgate http".to_owned(), HttpServer::new_app(gateway));
    service.add_tcp(&config.listen.to_string());
    server.add_service(service);
    server.run_forever()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_urls_decode_and_bad_ones_are_client_errors() {
        let (mime, data) = decode_data_url("data:image/PNG;base64,aGVsbG8=").unwrap_or_default();
        assert_eq!(
            (mime.as_deref(), data.as_slice()),
            (Some("image/png"), &b"hello"[..])
        );
        for bad in [
            "https://example.com/cat.png",
            "data:image/png;base64",
            "data:text/plain,hello",
            "data:image/png;base64,@@@",
        ] {
            let error = decode_data_url(bad).err();
            assert_eq!(
                error.map(|e| e.status),
                Some(StatusCode::BAD_REQUEST),
                "{bad}"
            );
        }
    }
}
