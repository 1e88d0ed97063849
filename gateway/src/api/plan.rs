//! `POST /v1/preprocess` with `messages`: a chat request planned as `/v1/chat/completions` would
//! plan it for its model (the limits, the request-wide budget, each item's plan), without running
//! it. With `pictures`, each item comes back as its model gets it, drawn by the gateway: the
//! console shows these, so what a person sees is what the model is given.

use base64::Engine as _;
use bytes::Bytes;
use http::StatusCode;
use mmgate_host::ReducedItem;
use mmgate_inference::families::MediaKind;
use mmgate_inference::prompt::PromptModel;
use pingora::protocols::http::ServerSession;
use serde_json::{Value, json};

use super::media_modes::UpstreamMedia;
use super::media_modes::preprocess::{PlannedSource, plan_for_upstream};
use super::request::{checked_shape, invalid_json, parsed_off_thread};
use super::{Gateway, Route};
use crate::error::ApiError;
use crate::keylimits::TokenTally;
use crate::media::{account, render};

use crate::upstream::planned;

/// The prompt side that plans a served model's media.
pub(super) struct PlanningSide<'a> {
    pub prompt: &'a PromptModel,
    /// Whether the model takes `image_embeds` (they cost what they hold).
    pub accept_image_embeds: bool,
    /// Whether the model's server runs its own processor on the items as planned (`preprocess`):
    /// then it is sent files, not tensors.
    pub server_processes: bool,
}

impl Gateway {
    /// Plans the chat request `body` for its model.
    pub(super) async fn plan_chat(
        &self,
        session: &ServerSession,
        body: Bytes,
        model: &str,
        pictures: bool,
        tally: Option<&TokenTally>,
    ) -> Result<Value, ApiError> {
        let PlanningSide {
            prompt,
            accept_image_embeds,
            ..
        } = self.planning_side(model)?;
        checked_shape(&body, "messages", &self.limits, invalid_json).await?;
        let request = parsed_off_thread(body, &self.limits).await?;
        let max_tokens = request.max_tokens;
        let caller = self.caller(session);
        let planned = plan_for_upstream(
            prompt,
            accept_image_embeds,
            request,
            &self.services(&caller),
            planned::choices_as_read,
        )
        .await?;
        let media_tokens: usize = planned.accounts.iter().map(|a| a.tokens).sum();
        if let Some(tally) = tally {
            tally.used(media_tokens as u64);
        }
        let mut items = account::render(&planned.accounts);
        if pictures {
            let config = prompt.processor_config.as_str();
            let sources = planned.parts.iter().zip(&planned.sources);
            let mut drawn = Vec::with_capacity(planned.parts.len());
            for ((kind, files), source) in sources {
                drawn.push(self.picture(*kind, files.as_ref(), source, config).await?);
            }
            let mut drawn = drawn.into_iter();
            for item in &mut items {
                // A document's entry stands for its kept pages, each an item drawn as an image.
                let picture = match item["pages_kept"].as_array() {
                    Some(pages) => {
                        let pages: Vec<Value> = pages
                            .iter()
                            .zip(drawn.by_ref())
                            .map(|(page, picture)| {
                                json!({"page": page, "image": picture.map(|p| p["image"].clone())})
                            })
                            .collect();
                        Some(json!({ "pages": pages }))
                    }
                    None => drawn.next().flatten(),
                };
                if let Some(picture) = picture {
                    item["picture"] = picture;
                }
            }
        }
        Ok(json!({
            "object": "chat.plan",
            "model": model,
            "context_length": prompt.context_length,
            "max_tokens": max_tokens,
            "prompt_tokens": planned.prompt_tokens,
            "text_tokens": planned.prompt_tokens.saturating_sub(media_tokens),
            "media_budget": planned.budget,
            "media": items,
        }))
    }

    /// What plans `model`'s media here; refused for a model whose server gets them as they came.
    pub(super) fn planning_side(&self, model: &str) -> Result<PlanningSide<'_>, ApiError> {
        let side = |prompt, accept_image_embeds, server_processes| PlanningSide {
            prompt,
            accept_image_embeds,
            server_processes,
        };
        match self.models.get(model) {
            None => Err(ApiError::model_not_found(model)),
            Some(Route::Native(native)) => Ok(side(
                &native.runtime.prompt,
                native.accept_image_embeds,
                false,
            )),
            Some(Route::Upstream { media, .. }) if media.encoders().is_some() => {
                let native = media.encoders().ok_or_else(|| {
                    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", "no encoders")
                })?;
                Ok(side(
                    &native.runtime.prompt,
                    native.accept_image_embeds,
                    false,
                ))
            }
            Some(Route::Upstream {
                media: UpstreamMedia::Preprocess(prompt),
                pool,
            }) => Ok(side(prompt, pool.accept_image_embeds, true)),
            Some(Route::Upstream { .. }) => Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                format!(
                    "model {model:?} forwards media as they came (media = \"forward\"): its \
                     server plans them, not this gateway"
                ),
            )),
        }
    }

    /// One item as its model gets it: an image at its planned size, a video's chosen frames with
    /// their timestamps, an audio clip's log-mel spectrogram.
    async fn picture(
        &self,
        kind: MediaKind,
        files: Option<&ReducedItem>,
        source: &Option<PlannedSource>,
        config: &str,
    ) -> Result<Option<Value>, ApiError> {
        let Some(files) = files else {
            return Ok(None); // `image_embeds`: there is nothing to see
        };
        match kind {
            MediaKind::Image => {
                let file = files.files.first();
                // Handed on as it came, the engine's processor resizing it: drawn resized.
                let resized = match (file, source) {
                    (Some(file), Some(source)) if file.data == source.media.data => {
                        self.resized(source, config).await
                    }
                    _ => None,
                };
                let file = resized.as_ref().or(file);
                Ok(file.map(|file| json!({ "image": data_url(file) })))
            }
            MediaKind::Video => {
                let frames = files.files.iter().zip(&files.timestamps);
                let frames: Vec<Value> = frames
                    .map(|(file, at)| json!({ "timestamp": at, "image": data_url(file) }))
                    .collect();
                Ok(Some(json!({ "frames": frames })))
            }
            MediaKind::Audio => {
                let Some(source) = source else {
                    return Ok(None);
                };
                let png = self.spectrogram(source, config).await?;
                Ok(Some(json!({ "spectrogram": png_data_url(&png) })))
            }
        }
    }

    /// An image `reduce` handed on as it came (the model's processor resizes it to its planned
    /// size itself), at that size: asked as for an image the budget cut, the plugin resizes it as
    /// its processor does. `None` when the plugin cannot.
    async fn resized(&self, source: &PlannedSource, config: &str) -> Option<mmgate_host::Media> {
        let (plugin, media) = (source.plugin.clone(), source.media.clone());
        let mut plan = source.plan.clone();
        plan.reduced = true;
        let config = config.to_owned();
        let reduced = self
            .pool
            .run(move || plugin.reduce(&media, &plan, &config))
            .await;
        reduced.ok().and_then(|item| item.files.into_iter().next())
    }

    /// The log-mel features the item's plan makes, drawn.
    async fn spectrogram(&self, source: &PlannedSource, config: &str) -> Result<Vec<u8>, ApiError> {
        let (plugin, media, plan) = (
            source.plugin.clone(),
            source.media.clone(),
            source.plan.clone(),
        );
        let config = config.to_owned();
        let tensors = self
            .pool
            .run(move || plugin.preprocess(&media, &plan, &config))
            .await
            .map_err(|e| ApiError::from(&e))?;
        let drawn = mmgate_host::with_f32_values(&tensors)
            .map_err(anyhow::Error::from)
            .and_then(|tensors| render::mel_png(&tensors));
        drawn.map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "plugin_output_mismatch",
                format!("the audio plugin's features cannot be drawn: {e:#}"),
            )
        })
    }
}

fn data_url(file: &mmgate_host::Media) -> String {
    let mime = file
        .mime_type
        .as_deref()
        .unwrap_or("application/octet-stream");
    let data = base64::engine::general_purpose::STANDARD.encode(&file.data);
    format!("data:{mime};base64,{data}")
}

fn png_data_url(png: &[u8]) -> String {
    let data = base64::engine::general_purpose::STANDARD.encode(png);
    format!("data:image/png;base64,{data}")
}
