//! `media = "preprocess"`: the model's server runs its own processor, and each media item goes to it
//! as planned here (limits, the request-wide budget, each item's plan) — reduced by its plugin to
//! the files that processor reads back as planned ([`planned`]). The prompt's token count is a
//! promise the server keeps: it goes in the answer's headers with the media accounts, and in
//! `usage.media` of a JSON answer.

use std::sync::Arc;

use bytes::Bytes;
use http::StatusCode;
use mmgate_host::{LoadedPlugin, Media, ReducedItem, TokenPlan};
use mmgate_inference::families::{MediaKind, PlannedItem};
use mmgate_inference::prompt::PromptModel;
use serde_json::Value;

use super::{ModeCall, accounts_header, prompt_tokens_header};
use crate::api::request::parsed_off_thread;
use crate::error::ApiError;
use crate::media::account::{self, MediaAccount};
use crate::media::pipeline::{self, Made};
use crate::prepare::errors::{context_exceeded, internal};
use crate::prepare::gather::{Gathered, gather};
use crate::prepare::items::{ChatServices, ItemInput};
use crate::upstream::{ReplyAdditions, planned};
use crate::wire::openai::ChatCompletionRequest;
use crate::wire::openai::parts::{self, Rewrite};

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
    let planned = plan_for_upstream(
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
    super::rewrite_parts(&mut value, rewrites, &planned.accounts);
    let mut additions = ReplyAdditions {
        headers: vec![prompt_tokens_header(planned.prompt_tokens)],
        usage_media: Some(Value::Array(account::render(&planned.accounts))),
        held: Vec::new(),
    };
    additions.headers.extend(accounts_header(&planned.accounts));
    Ok((value, additions))
}

/// A request for a model whose server preprocesses media itself, planned here: every media part
/// as it goes upstream, and the accounts.
pub struct PlannedUpstream {
    /// Per media part in prompt order: the files its plugin reduced it to, or `None` for a part
    /// that goes as it came (`image_embeds`, which cost what they hold).
    pub parts: Vec<(MediaKind, Option<ReducedItem>)>,
    /// Per media part: the account `usage.media` shows.
    pub accounts: Vec<MediaAccount>,
    /// The prompt's tokens as the server's processor will count them: text and every item.
    pub prompt_tokens: usize,
    /// The tokens the plugins' items shared (the context less the text, the completion and
    /// embeddings, and less any overflow a first plan left).
    pub budget: usize,
    /// Per media part: what its plugin planned, from what (`None` for `image_embeds`); what a
    /// picture of the item (the console's) is made from.
    pub sources: Vec<Option<PlannedSource>>,
}

/// One plugin item as it was planned.
pub struct PlannedSource {
    pub plugin: Arc<LoadedPlugin>,
    pub media: Arc<Media>,
    pub plan: TokenPlan,
}

/// Plans `request`'s media for `prompt`'s model exactly as for a native model (limits, probe, the
/// request-wide budget, plan), then has each plugin reduce its item to files the upstream's own
/// processor reads as planned. A request that cannot fit is refused here.
pub async fn plan_for_upstream(
    prompt: &PromptModel,
    accept_image_embeds: bool,
    mut request: ChatCompletionRequest,
    services: &ChatServices<'_>,
    as_read: AsRead,
) -> Result<PlannedUpstream, ApiError> {
    let mut gathered = gather(prompt, accept_image_embeds, &mut request, services).await?;
    // The budget the plugins share leaves out the text a family may set each item off with (its
    // length depends on the plan): a plan whose prompt then overflows the context is made again
    // with the overflow taken off the budget.
    let completion = gathered.max_tokens.unwrap_or(1);
    for _ in 0..PLAN_ATTEMPTS {
        let planned = plan_upstream_once(prompt, &gathered, services, as_read).await?;
        let needed = planned.prompt_tokens + completion;
        if needed <= prompt.context_length {
            return Ok(planned);
        }
        let over = needed - prompt.context_length;
        match gathered.budget.checked_sub(over) {
            Some(budget) if budget > 0 => gathered.budget = budget,
            _ => break,
        }
    }
    Err(context_exceeded(format!(
        "the media do not fit: as this model's processor writes them into the prompt, with \
         max_tokens {completion}, they need more than this model's context of {} tokens",
        prompt.context_length
    )))
}

/// An item's plan as the server reads it back from what it is sent of the item (the server's
/// reading of a video's frame times, say): what its prompt is counted with.
pub type AsRead = fn(MediaKind, serde_json::Value) -> serde_json::Value;

/// Plans made again at most this often when the items' text overflows the context (each attempt
/// takes the overflow off the budget; one is enough unless the text grows as plans shrink).
const PLAN_ATTEMPTS: usize = 3;

/// One pass of [`plan_for_upstream`] under `gathered`'s budget.
async fn plan_upstream_once(
    prompt: &PromptModel,
    gathered: &Gathered,
    services: &ChatServices<'_>,
    as_read: AsRead,
) -> Result<PlannedUpstream, ApiError> {
    let mut processed = gathered
        .process(prompt, services, pipeline::Produce::Files, None)
        .await?
        .into_iter();
    let mut parts = Vec::with_capacity(gathered.items.len());
    let mut accounts = Vec::with_capacity(gathered.items.len());
    let mut planned_items = Vec::with_capacity(gathered.items.len());
    let mut sources = Vec::with_capacity(gathered.items.len());
    for (index, item) in gathered.items.iter().enumerate() {
        match &item.input {
            ItemInput::Embeddings(input) => {
                planned_items.push(PlannedItem::counted(item.kind, input.tokens));
                accounts.push(MediaAccount::embeddings(index, item.kind, input.tokens));
                parts.push((item.kind, None));
                sources.push(None);
            }
            ItemInput::Plugin { plugin, media } => {
                let done = processed
                    .next()
                    .ok_or_else(|| internal("a media item was not processed"))?;
                // Choices that are not JSON (a third-party plugin's) say nothing to a family.
                planned_items.push(PlannedItem {
                    kind: item.kind,
                    tokens: done.plan.tokens as usize,
                    choices: as_read(
                        item.kind,
                        serde_json::from_str(&done.plan.choices).unwrap_or_default(),
                    ),
                });
                accounts.push(
                    MediaAccount::plugin(index, item.kind, plugin, &done)
                        .of_page(item.page.clone()),
                );
                sources.push(Some(PlannedSource {
                    plugin: plugin.clone(),
                    media: media.clone(),
                    plan: done.plan.clone(),
                }));
                let Made::Files(files) = done.made else {
                    return Err(internal("a media item was not reduced"));
                };
                parts.push((item.kind, Some(files)));
            }
        }
    }
    // Each item is one placeholder in the templated prompt; the server expands it to its tokens.
    let text_tokens = prompt.text_tokens(&gathered.ids);
    let placeholders = gathered.ids.len() - text_tokens;
    if placeholders != gathered.items.len() {
        return Err(internal(format!(
            "the chat template placed {placeholders} media placeholders for {} media items",
            gathered.items.len()
        )));
    }
    // As the server's processor writes each item into the prompt (a family may set it off with
    // text of its own, which can merge with the tokens around it).
    let prompt_tokens = prompt
        .planned_prompt_tokens(&gathered.messages, &gathered.ids, &planned_items)
        .map_err(|e| internal(format!("counting the planned prompt: {e}")))?;
    Ok(PlannedUpstream {
        parts,
        accounts,
        prompt_tokens,
        budget: gathered.budget,
        sources,
    })
}
