//! A chat request checked against a model's prompt side, its media resolved within the limits
//! and its text templated, with the tokens its plugin items may share; then those items run
//! through their plugins under that budget. What a natively served model and an upstream one whose
//! media are planned here have in common.

use std::sync::Arc;

use mmgate_host::{LoadedPlugin, Media};
use mmgate_inference::prompt::PromptModel;
use mmgate_inference::text::{ChatMessage, ContentPart};

use super::documents::{self, Resolved};
use super::errors::{context_exceeded, embeds_refused, invalid, plugin_failed};
use super::items::{ChatServices, Item, ItemInput};
use super::media::resolve_media;
use super::prompt_text::{checked_text, prompt_ids_off_thread};
use crate::error::ApiError;
use crate::media::budget::BudgetError;
use crate::media::documents::page_text;
use crate::media::pipeline;
use crate::wire::openai::{self, ChatCompletionRequest, Content, Part};

/// Most stop strings a request may give (OpenAI allows 4).
const MAX_STOP_STRINGS: usize = 16;

/// A request's conversation and media, resolved and checked against a model's prompt side, with
/// the tokens its plugin items may share: what a natively served model and an upstream one whose
/// media are planned here (`media = "preprocess"`) have in common.
pub(crate) struct Gathered {
    /// The conversation as the chat template sees it, each media part its kind's placeholder.
    pub messages: Vec<ChatMessage>,
    /// The media parts in prompt order.
    pub items: Vec<Item>,
    /// The templated prompt, one placeholder per item.
    pub ids: Vec<u32>,
    /// What the context leaves the plugins' items: less the text, the completion and embeddings.
    pub budget: usize,
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
}

impl Gathered {
    /// The plugins' items with their bytes, for [`pipeline::process_concurrently`].
    fn plugin_jobs(&self) -> Vec<(Arc<LoadedPlugin>, Arc<Media>)> {
        self.items
            .iter()
            .filter_map(|i| match &i.input {
                ItemInput::Plugin { plugin, media } => Some((plugin.clone(), media.clone())),
                ItemInput::Embeddings(_) => None,
            })
            .collect()
    }

    /// Runs every plugin item through probe, the shared budget's plans, and `produce`.
    pub async fn process(
        &self,
        prompt: &PromptModel,
        services: &ChatServices<'_>,
        produce: pipeline::Produce,
        lookup: Option<pipeline::Lookup>,
    ) -> Result<Vec<pipeline::Processed>, ApiError> {
        pipeline::process_concurrently(
            services.pool,
            &self.plugin_jobs(),
            Arc::from(prompt.processor_config.as_str()),
            u32::try_from(self.budget).unwrap_or(u32::MAX),
            produce,
            lookup,
        )
        .await
        .map_err(|e| match e {
            BudgetError::TooSmall { .. } => context_exceeded(e.to_string()),
            BudgetError::Plugin { item, error } => plugin_failed(item, &error),
        })
    }
}

/// Checks `request` against `prompt` (and whether the model takes `image_embeds`), resolves its
/// media within the limits, templates it, and works out the tokens its media may share.
pub(crate) async fn gather(
    prompt: &PromptModel,
    accept_image_embeds: bool,
    request: &mut ChatCompletionRequest,
    services: &ChatServices<'_>,
) -> Result<Gathered, ApiError> {
    if request.n.is_some_and(|n| n != 1) {
        return Err(invalid("n", "only n = 1 is supported"));
    }
    request
        .check()
        .map_err(|openai::Invalid { param, message }| invalid(param, message))?;
    if request.messages.is_empty() {
        return Err(invalid("messages", "messages is empty"));
    }
    let stop = request
        .stop
        .take()
        .map(|s| s.into_vec())
        .unwrap_or_default();
    if stop.len() > MAX_STOP_STRINGS {
        return Err(invalid(
            "stop",
            format!("at most {MAX_STOP_STRINGS} stop strings"),
        ));
    }

    // The conversation as the chat template sees it, and the media parts in prompt order.
    let text_bytes = checked_text(prompt, &request.messages, services.limits).await?;
    let mut unplaced = Vec::with_capacity(request.messages.len());
    let mut sources = Vec::new();
    for message in std::mem::take(&mut request.messages) {
        let mut content = Vec::new();
        match message.content {
            None => {}
            Some(Content::Text(text)) => content.push(ContentPart::Text(text)),
            Some(Content::Parts(parts)) => {
                for part in parts {
                    if matches!(part, Part::ImageEmbeds { .. }) && !accept_image_embeds {
                        return Err(embeds_refused(&prompt.name));
                    }
                    match (part.media(), part) {
                        (Some((kind, source)), _) => {
                            sources.push((kind, source));
                            // The kind of a `file` part is settled below; the slot is fixed then.
                            content.push(ContentPart::Image);
                        }
                        (None, Part::Text { text }) => content.push(ContentPart::Text(text)),
                        (None, _) => {}
                    }
                }
            }
        }
        unplaced.push(ChatMessage {
            role: message.role,
            content,
        });
    }
    let resolved = resolve_media(prompt, sources, text_bytes, services).await?;
    // Each media part's place takes its item's kind; a document's, one image per page (its text
    // before it, when read), or its pages' text alone.
    let slots: Vec<Slot> = resolved.iter().map(Slot::of).collect();
    let has_documents = resolved.iter().any(|r| matches!(r, Resolved::Document(_)));
    // Kept only while pages may yet be left out, when the prompt is made again.
    let again = has_documents.then(|| unplaced.clone());
    let (mut messages, mut ids) =
        prompt_ids_off_thread(prompt, placed(unplaced, &slots, 0)).await?;
    let max_tokens = match request.max_tokens {
        Some(0) => return Err(invalid("max_tokens", "max_tokens must be at least 1")),
        Some(n) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        None => None,
    };
    // Embeddings cost what they hold; the plugins' items share the rest.
    let fixed: usize = resolved
        .iter()
        .map(|r| match r {
            Resolved::Item(Item {
                input: ItemInput::Embeddings(item),
                ..
            }) => item.tokens,
            _ => 0,
        })
        .sum();
    let mut budget = media_budget(prompt, &ids, max_tokens, fixed)?;
    let (items, pages_left_out) =
        documents::into_items(&prompt.processor_config, services, resolved, budget).await?;
    if let Some(unplaced) = again
        && pages_left_out > 0
    {
        // Pages were left out: the prompt is made again without their places.
        (messages, ids) =
            prompt_ids_off_thread(prompt, placed(unplaced, &slots, pages_left_out)).await?;
        budget = media_budget(prompt, &ids, max_tokens, fixed)?;
    }
    Ok(Gathered {
        messages,
        items,
        ids,
        budget,
        max_tokens,
        stop,
    })
}

/// What a media part's place in the prompt becomes: its groups of parts, in order; a document's
/// `pages` are groups that may be left out (the last ones first).
struct Slot {
    groups: Vec<Vec<ContentPart>>,
    pages: bool,
}

impl Slot {
    fn of(resolved: &Resolved) -> Self {
        let page_text = |page: usize, text: &str| ContentPart::Text(page_text(page, text));
        match resolved {
            Resolved::Item(item) => Self {
                groups: vec![vec![item.kind.content_part()]],
                pages: false,
            },
            Resolved::Document(document) => Self {
                groups: (1..=document.pages.len())
                    .map(|page| {
                        let text = document.texts.get(page - 1).map(|t| page_text(page, t));
                        text.into_iter().chain([ContentPart::Image]).collect()
                    })
                    .collect(),
                pages: true,
            },
            Resolved::Text(texts) => Self {
                groups: vec![
                    texts
                        .iter()
                        .enumerate()
                        .map(|(at, text)| page_text(at + 1, text))
                        .collect(),
                ],
                pages: false,
            },
        }
    }
}

/// `messages` with each media part's place taken by its slot's parts, the last `pages_left_out`
/// document pages left out.
fn placed(
    mut messages: Vec<ChatMessage>,
    slots: &[Slot],
    pages_left_out: usize,
) -> Vec<ChatMessage> {
    let pages: usize = slots
        .iter()
        .filter(|slot| slot.pages)
        .map(|slot| slot.groups.len())
        .sum();
    let mut pages_kept = pages.saturating_sub(pages_left_out);
    let mut slots = slots.iter();
    for message in &mut messages {
        let mut content = Vec::with_capacity(message.content.len());
        for part in std::mem::take(&mut message.content) {
            if matches!(part, ContentPart::Text(_)) {
                content.push(part);
                continue;
            }
            let Some(slot) = slots.next() else {
                continue;
            };
            let groups = if slot.pages {
                let kept = slot.groups.len().min(pages_kept);
                pages_kept -= kept;
                &slot.groups[..kept]
            } else {
                &slot.groups[..]
            };
            content.extend(groups.iter().flatten().cloned());
        }
        message.content = content;
    }
    messages
}

/// What the context leaves the plugins' items: less the text (`ids`), the completion and the
/// embeddings' `fixed` tokens. Without max_tokens the completion gets whatever the media leave
/// (at least one token).
fn media_budget(
    prompt: &PromptModel,
    ids: &[u32],
    max_tokens: Option<usize>,
    fixed: usize,
) -> Result<usize, ApiError> {
    let text_tokens = prompt.text_tokens(ids);
    let context = prompt.context_length;
    let budget = context
        .checked_sub(text_tokens)
        .and_then(|left| left.checked_sub(max_tokens.unwrap_or(1)))
        .ok_or_else(|| {
            context_exceeded(format!(
                "the messages are {text_tokens} tokens and max_tokens is {}; this model's context is {context} tokens",
                max_tokens.unwrap_or(1)
            ))
        })?;
    budget.checked_sub(fixed).ok_or_else(|| {
        context_exceeded(format!(
            "the request's image_embeds are {fixed} tokens; {budget} are left for media in this model's context of {context} tokens"
        ))
    })
}
