//! `POST /v1/preprocess`: media items through their plugins as a chat request runs them (several
//! items share the budget); answers with the plans and the tensors' shapes (the account `mmgate
//! preprocess --explain` prints). With `model`, as that served model plans them: its processor
//! config, and for a model planned here for an engine (`media = "preprocess"`) the files the
//! engine would be sent instead of tensors. With `messages`, a whole chat request is planned instead
//! ([`super::plan`]).

use std::sync::Arc;

use http::StatusCode;
use mmgate_host::{LoadedPlugin, Media};
use pingora::protocols::http::ServerSession;
use serde::Deserialize;
use serde_json::{Value, json};

use super::Gateway;
use super::io::read_body;
use super::request::off_thread_if_large;
use crate::error::ApiError;
use crate::keylimits::TokenTally;
use crate::media::budget::BudgetError;
use crate::media::pipeline;
use crate::media::processor_settings;
use crate::media::sniff::sniff_mime_type;
use crate::prepare::media::MediaTally;
use crate::upstream::inline::kind_of;
use crate::wire::openai::{ByteSource, PayloadError, decode_payload};

impl Gateway {
    /// Media items run under the same limits as a chat request's (the body, the item count, each
    /// item's bytes by kind, all images' bytes) and through the same pipeline: each item's calls
    /// are jobs of their own on the plugin pool, so one request's items wait their turn beside
    /// other requests' instead of holding a worker for all of them. What the plan costs is
    /// charged to the caller's tokens per minute (`tally`).
    pub(super) async fn preprocess(
        &self,
        session: &mut ServerSession,
        tally: Option<&TokenTally>,
    ) -> Result<Value, ApiError> {
        let body = read_body(session, self.limits.max_body_bytes).await?;
        if let Some(tally) = tally {
            tally.request(body.len());
        }
        let form: Form = off_thread_if_large(&body, |body| {
            Ok(serde_json::from_slice(&body).unwrap_or_default())
        })
        .await?;
        if form.messages.is_some() {
            let Some(model) = form.model else {
                return Err(ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_request",
                    "a chat request to plan (messages) needs its model",
                ));
            };
            return self
                .plan_chat(session, body, &model, form.pictures, tally)
                .await;
        }
        let request: PreprocessRequest = off_thread_if_large(&body, |body| {
            serde_json::from_slice(&body).map_err(|e| {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_json",
                    format!("the request body is not a valid preprocess request: {e}"),
                )
            })
        })
        .await?;
        let (urls, several) = match &request.media {
            OneOrMany::One(url) => (vec![url.as_str()], false),
            OneOrMany::Many(urls) if urls.is_empty() => {
                return Err(ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_request",
                    "media is an empty list",
                ));
            }
            OneOrMany::Many(urls) => (urls.iter().map(String::as_str).collect(), true),
        };
        let (config, produce) = self.processor_of(&request)?;
        let mut sizes = MediaTally::new(&self.limits, urls.len())?;
        let mut media = Vec::with_capacity(urls.len());
        for (index, url) in urls.into_iter().enumerate() {
            let item = media_of(url, sizes.limit(None)).map_err(|mut e| {
                if several {
                    e.message = format!("media item {index}: {}", e.message);
                }
                e
            })?;
            if let Some(kind) = kind_of(item.mime_type.as_deref()) {
                sizes.add(index, kind, item.data.len())?;
            }
            media.push(Arc::new(item));
        }
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
        let config: Arc<str> = Arc::from(config);
        // Choosing may probe: a short call, ahead of the queued preprocessing.
        let (chosen_config, chosen_media) = (config.clone(), media.clone());
        let chosen = self
            .pool
            .run_ahead(move || {
                Ok(chosen_media
                    .iter()
                    .map(|media| {
                        named.clone().or_else(|| {
                            pipeline::choose_plugin(&registry, media, None, &chosen_config).cloned()
                        })
                    })
                    .collect::<Vec<_>>())
            })
            .await
            .map_err(|e| ApiError::from(&e))?;
        let mut items = Vec::with_capacity(media.len());
        for (index, (plugin, media)) in chosen.into_iter().zip(media).enumerate() {
            match plugin {
                Some(plugin) => items.push((plugin, media)),
                None => return Err(unsupported(index, several, media.mime_type.clone())),
            }
        }
        let max_tokens = request.max_tokens.unwrap_or(u32::MAX);
        let processed =
            pipeline::process_concurrently(&self.pool, &items, config, max_tokens, produce, None)
                .await
                .map_err(|e| budget_error(e, several))?;
        let tokens: u64 = processed.iter().map(|p| u64::from(p.plan.tokens)).sum();
        if let Some(tally) = tally {
            tally.used(tokens);
        }
        Ok(report_items(
            &items, &processed, tokens, max_tokens, several,
        ))
    }
}

impl Gateway {
    /// The processor config a request's items are planned with, and what is made of them: the
    /// request's own config and tensors, or those of the served model it names.
    fn processor_of(
        &self,
        request: &PreprocessRequest,
    ) -> Result<(String, pipeline::Produce), ApiError> {
        let whole = pipeline::Produce::Tensors {
            parts: pipeline::Parts::Whole,
        };
        let invalid =
            |message: String| ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", message);
        let Some(name) = &request.model else {
            let config = request
                .processor_config
                .clone()
                .unwrap_or_else(|| json!({}));
            processor_settings::check(&config).map_err(|e| {
                let mut api = invalid(e.to_string());
                api.param = Some("processor_config");
                api
            })?;
            return Ok((config.to_string(), whole));
        };
        if request.processor_config.is_some() {
            return Err(invalid(
                "give a model or a processor_config, not both: a model plans with its own".into(),
            ));
        }
        let side = self.planning_side(name)?;
        let produce = if side.server_processes {
            pipeline::Produce::Files
        } else {
            whole
        };
        Ok((side.prompt.processor_config.clone(), produce))
    }
}

/// A budget that failed, as the answer says it.
fn budget_error(error: BudgetError, several: bool) -> ApiError {
    match error {
        BudgetError::TooSmall { .. } => ApiError::new(
            StatusCode::BAD_REQUEST,
            "context_length_exceeded",
            error.to_string(),
        ),
        BudgetError::Plugin { item, error } => {
            let mut api = ApiError::from(&error);
            if several {
                api.message = format!("media item {item}: {}", api.message);
            }
            api
        }
    }
}

/// The account of the items as `POST /v1/preprocess` answers it: one item's report, or the list's.
fn report_items(
    items: &[(Arc<LoadedPlugin>, Arc<Media>)],
    processed: &[pipeline::Processed],
    tokens: u64,
    max_tokens: u32,
    several: bool,
) -> Value {
    let mut reports = items
        .iter()
        .zip(processed)
        .map(|((plugin, _), processed)| {
            let mut report = serde_json::Map::new();
            report.insert("object".into(), json!("preprocess"));
            report.extend(pipeline::report(plugin, processed));
            Value::Object(report)
        })
        .collect::<Vec<_>>();
    if !several {
        return reports.pop().unwrap_or_default();
    }
    json!({ "object": "list", "tokens": tokens, "max_tokens": max_tokens, "data": reports })
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

/// A data URL's media (at most `limit` bytes), typed by its bytes when they are recognised, else
/// by the URL's MIME type.
fn media_of(url: &str, limit: usize) -> Result<Media, ApiError> {
    let (declared_mime, data) = decode_data_url(url, limit)?;
    let mime_type = sniff_mime_type(&data).map(str::to_owned).or(declared_mime);
    Ok(Media { data, mime_type })
}

/// Which of the two requests a body is: with `messages`, a chat request to plan (see
/// [`super::plan`]); else media items to run.
#[derive(Deserialize, Default)]
struct Form {
    messages: Option<serde::de::IgnoredAny>,
    model: Option<String>,
    #[serde(default)]
    pictures: bool,
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
    /// A served model whose processor config (and, in front of an engine, whose files) to use.
    #[serde(default)]
    model: Option<String>,
    /// The model's `preprocessor_config.json` (without `model`).
    #[serde(default)]
    processor_config: Option<Value>,
    /// The token budget of the item, or of all items together (default: unlimited, native sizes).
    #[serde(default)]
    max_tokens: Option<u32>,
}

/// `data:<mime>;base64,<data>` → (mime, bytes), decoded as chat requests decode theirs: one over
/// `limit` bytes is refused (413) from its encoded length, before it is decoded.
fn decode_data_url(url: &str, limit: usize) -> Result<(Option<String>, Vec<u8>), ApiError> {
    let invalid =
        |message: String| ApiError::new(StatusCode::BAD_REQUEST, "invalid_media_url", message);
    if !url.starts_with("data:") {
        return Err(invalid(
            "media must be a data URL (data:<mime>;base64,<bytes>)".into(),
        ));
    }
    match ByteSource::from_url(url) {
        ByteSource::Base64 { data, mime_type } => match decode_payload(&data, limit) {
            Ok(bytes) => Ok((mime_type, bytes)),
            Err(PayloadError::TooLarge(bytes)) => Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "media_too_large",
                format!("the media is {bytes} bytes; at most {limit} are allowed"),
            )),
            Err(e) => Err(invalid(format!(
                "the data URL's base64 does not decode: {e}"
            ))),
        },
        _ => Err(invalid(
            "the data URL is not base64 (data:<mime>;base64,<bytes>)".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_urls_decode_and_bad_ones_are_client_errors() {
        let (mime, data) =
            decode_data_url("data:image/PNG;base64,aGVsbG8=", 100).unwrap_or_default();
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
            let error = decode_data_url(bad, 100).err();
            assert_eq!(
                error.map(|e| e.status),
                Some(StatusCode::BAD_REQUEST),
                "{bad}"
            );
        }
    }
}
