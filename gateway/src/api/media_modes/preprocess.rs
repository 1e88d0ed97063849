//! `media = "preprocess"`: the model's server runs its own processor, and each media item goes to it
//! as planned here (limits, the request-wide budget, each item's plan) — reduced by its plugin to
//! the files that processor reads back as planned ([`planned`]). The prompt's token count is a
//! promise the server keeps: it goes in the answer's headers with the media accounts, and in
//! `usage.media` of a JSON answer.

use bytes::Bytes;
use http::StatusCode;
use serde_json::Value;

use super::{ModeCall, accounts_header, prompt_tokens_header};
use crate::api::request::parsed_off_thread;
use crate::error::ApiError;
use crate::media::account;
use crate::native::chat;
use crate::upstream::{ReplyAdditions, planned};
use crate::wire::openai::parts::{self, Rewrite};
use mmgate_inference::prompt::PromptModel;

/// Whether the request has media to plan (else it goes as [`super::forward`] sends it).
pub fn has_media(value: &Value) -> bool {
    parts::media_parts(value).next().is_some()
}

/// The request (`value`, parsed from `body`) with each media part replaced by its item as planned.
pub async fn prepare(
    prompt: &PromptModel,
    call: &ModeCall<'_>,
    mut value: Value,
    body: Bytes,
) -> Result<(Value, ReplyAdditions), ApiError> {
    let request = parsed_off_thread(body, call.services.limits).await?;
    let planned = chat::plan_for_upstream(
        prompt,
        call.pool.accept_image_embeds,
        request,
        &call.services,
        planned::choices_as_read,
    )
    .await?;
    call.metrics.media_prepared(&planned.accounts);
    let mut rewrites = Vec::with_capacity(planned.parts.len());
    for (index, (kind, files)) in planned.parts.iter().enumerate() {
        rewrites.push(match files {
            Some(files) => Rewrite::Replace(planned::part(*kind, files).ok_or_else(|| {
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "plugin_output_mismatch",
                    format!(
                        "media item {index}: its plugin reduced the {} to {} files",
                        kind.name(),
                        files.files.len()
                    ),
                )
            })?),
            None => Rewrite::Keep,
        });
    }
    parts::rewrite(&mut value, rewrites);
    let mut additions = ReplyAdditions {
        headers: vec![prompt_tokens_header(planned.prompt_tokens)],
        usage_media: Some(Value::Array(account::render(&planned.accounts))),
        held: Vec::new(),
    };
    additions.headers.extend(accounts_header(&planned.accounts));
    Ok((value, additions))
}
