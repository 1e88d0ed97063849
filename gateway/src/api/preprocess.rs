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
use crate::error::ApiError;
use crate::media::budget::BudgetError;
use crate::media::pipeline;
use crate::media::sniff::sniff_mime_type;
use crate::wire::openai::{ByteSource, decode_payload};

/// Largest request body accepted (base64 makes a 48 MiB item 64 MiB).
const MAX_BODY_BYTES: usize = 64 << 20;

impl Gateway {
    pub(super) async fn preprocess(&self, session: &mut ServerSession) -> Result<Value, ApiError> {
        let body = read_body(session, MAX_BODY_BYTES.max(self.limits.max_body_bytes)).await?;
        let form: Form = serde_json::from_slice(&body).unwrap_or_default();
        if form.messages.is_some() {
            let Some(model) = form.model else {
                return Err(ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_request",
                    "a chat request to plan (messages) needs its model",
                ));
            };
            return self.plan_chat(session, body, &model, form.pictures).await;
        }
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
        let (config, produce) = self.processor_of(&request)?;
        let max_tokens = request.max_tokens.unwrap_or(u32::MAX);
        // Choosing may probe, so it runs on the plugin pool too, in the same job as the items.
        self.pool
            .run(move || {
                let mut items = Vec::with_capacity(media.len());
                for (index, media) in media.into_iter().enumerate() {
                    let chosen = named.clone().or_else(|| {
                        pipeline::choose_plugin(&registry, &media, None, &config).cloned()
                    });
                    match chosen {
                        Some(plugin) => items.push((plugin, media)),
                        None => return Ok(Err(unsupported(index, several, media.mime_type))),
                    }
                }
                Ok(Ok(run_items(
                    &items, &config, max_tokens, several, &produce,
                )))
            })
            .await
            .map_err(|e| ApiError::from(&e))?
            .and_then(|outcome| outcome)
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

/// The account of the items as `POST /v1/preprocess` answers it: one item's report, or the list's.
fn run_items(
    items: &[(Arc<LoadedPlugin>, Media)],
    config: &str,
    max_tokens: u32,
    several: bool,
    produce: &pipeline::Produce,
) -> Result<Value, ApiError> {
    let processed =
        pipeline::process_together(items, config, max_tokens, produce).map_err(|e| match e {
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

/// `data:<mime>;base64,<data>` → (mime, bytes), decoded as chat requests decode theirs (the body
/// limit has already bounded it).
fn decode_data_url(url: &str) -> Result<(Option<String>, Vec<u8>), ApiError> {
    let invalid =
        |message: String| ApiError::new(StatusCode::BAD_REQUEST, "invalid_media_url", message);
    if !url.starts_with("data:") {
        return Err(invalid(
            "media must be a data URL (data:<mime>;base64,<bytes>)".into(),
        ));
    }
    match ByteSource::from_url(url) {
        ByteSource::Base64 { data, mime_type } => match decode_payload(&data, usize::MAX) {
            Ok(bytes) => Ok((mime_type, bytes)),
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
