//! `media = "embed"`: the model's LLM runs upstream and its images are encoded here — preprocessed
//! and budgeted as for a native model, encoded on this model's encoder devices, and sent on as
//! `image_embeds` parts in place of the images ([`embeds`]), with the media accounts (`usage.media`
//! of a native model) in the [`super::MEDIA_HEADER`] of the reply.

use bytes::Bytes;
use http::StatusCode;
use mmgate_inference::engine::EncodeInput;
use mmgate_inference::families::MediaKind;
use serde_json::Value;

use super::{ModeCall, encode_failed, encoded_headers};
use crate::api::request::chat_request;
use crate::config::EncodeErrorPolicy;
use crate::error::ApiError;
use crate::model::LocalModel;
use crate::native::chat;
use crate::upstream::{ReplyAdditions, embeds};
use crate::wire::openai::parts::Rewrite;

/// Whether the request is encoded here (see [`embeds::encode_here`]).
pub fn encodes_here(value: &Value) -> bool {
    embeds::encode_here(value)
}

/// The request (`value`, parsed from `body`) with its images as embeddings.
pub async fn prepare(
    model: &LocalModel,
    call: &ModeCall<'_>,
    mut value: Value,
    body: Bytes,
) -> Result<(Value, ReplyAdditions), ApiError> {
    let request = chat_request(&body)?;
    drop(body);
    let prepared = chat::prepare(model, request, &call.services).await?;
    call.metrics.media_prepared(&prepared.media);
    // The prompt as placed for a native model: the upstream places the embeddings alike.
    let prompt_tokens = prepared.prompt_tokens();
    let (items, accounts) = prepared.into_media();
    let mut dropped_here = false;

    // Every item goes to the encoder devices at once; they batch what they can.
    let mut encoding = Vec::with_capacity(items.len());
    for chat::KeptItem { item, .. } in items {
        let (done, result) = tokio::sync::oneshot::channel();
        model
            .runtime
            .encoders
            .submit_shared(item.input.clone(), item.share_key, move |r| {
                let _ = done.send(r);
            })
            .map_err(|e| encode_failed(&e.to_string()))?;
        encoding.push((item, result));
    }
    let mut encoding = encoding.into_iter();
    let mut rewrites = Vec::with_capacity(accounts.len());
    for (index, account) in accounts.iter().enumerate() {
        if account.dropped.is_some() {
            rewrites.push(Rewrite::Drop);
            continue;
        }
        let Some((item, result)) = encoding.next() else {
            return Err(encode_failed("a media item was not encoded"));
        };
        let grid = match item.input.as_ref() {
            EncodeInput::Vision { grid, .. }
            | EncodeInput::Embeddings {
                grid: Some(grid), ..
            } if account.kind == MediaKind::Image => *grid,
            _ => {
                return Err(ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_request",
                    format!(
                        "media item {index} is {}: model {} encodes only images for its upstream; send video and audio as video_url, audio_url or input_audio parts",
                        account.kind.name(),
                        model.runtime.prompt.name
                    ),
                ));
            }
        };
        let failure = match result.await {
            Ok(Ok(features)) => {
                let part = embeds::part(&features, model.runtime.prompt.embedding_width, grid)
                    .map_err(|e| encode_failed(&e.to_string()))?;
                rewrites.push(Rewrite::Replace(part));
                continue;
            }
            Ok(Err(message)) => message,
            Err(_) => "the encoder device stopped".to_owned(),
        };
        if model.on_encode_error == EncodeErrorPolicy::Drop {
            tracing::warn!(item = index, error = %failure, "encoding failed; dropping the media");
            rewrites.push(Rewrite::Drop);
            dropped_here = true;
        } else {
            return Err(encode_failed(&format!("media item {index}: {failure}")));
        }
    }
    super::rewrite_parts(&mut value, rewrites, &accounts);
    let additions = ReplyAdditions {
        headers: encoded_headers(&accounts, prompt_tokens, dropped_here),
        usage_media: None,
        held: Vec::new(),
    };
    Ok((value, additions))
}
