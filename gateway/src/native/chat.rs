//! A chat completion prepared for a natively served model (or planned for an upstream one with
//! `media = "preprocess"`): the request checked, its media resolved ([`super::media`]) and run
//! through their plugins under the request-wide token budget, each item placed in the templated
//! prompt; what runs it is [`super::generation`].

use std::sync::Arc;

use mmgate_host::{LoadedPlugin, Media, ReducedItem, Started, Tensor, TokenPlan};
use mmgate_inference::engine::{GenerateRequest, MediaItem};
use mmgate_inference::families::{MediaKind, PlannedItem};
use mmgate_inference::models::GenerationConfig;
use mmgate_inference::prompt::{PieceMaker, PlacedItem, PromptModel, expand_placeholders};
use mmgate_inference::sampling::SamplingParams;
use mmgate_inference::text::{ChatMessage, ContentPart};

use super::errors::{
    context_exceeded, embeds_refused, internal, invalid, plugin_failed, unencodable,
};
use super::media::{ChatServices, Item, ItemInput, resolve_media};
use super::model::ModelRuntime;
use super::plugin_output::{item_tensors, part_layouts, place_parts};
use super::prompt_text::{checked_text, prompt_ids, prompt_ids_off_thread, without_media};
use crate::config::EncodeErrorPolicy;
use crate::error::ApiError;
use crate::media::account::MediaAccount;
use crate::media::budget::BudgetError;
use crate::media::feature_cache::{self, SharedCache};
use crate::media::pipeline::{self, Made};
use crate::wire::openai::{self, ChatCompletionRequest, Content, Part};

/// Most stop strings a request may give (OpenAI allows 4).
const MAX_STOP_STRINGS: usize = 16;

/// A model served by the native inference core.
pub struct NativeModel {
    pub runtime: ModelRuntime,
    pub on_encode_error: EncodeErrorPolicy,
    /// Whether clients may send `image_embeds` parts.
    pub accept_image_embeds: bool,
    /// Whether items are made in their plugin's parts (see the config's `media_parts`).
    pub media_parts: bool,
}

impl NativeModel {
    /// How this model's items are made: in parts handed to the engine as each is made when the
    /// LLM runs here and parts are on; all parts first for an encoder-only model (the request
    /// goes upstream once every item is encoded anyway).
    fn parts(&self) -> pipeline::Parts {
        match (self.media_parts, self.runtime.engine().is_ok()) {
            (false, _) => pipeline::Parts::Whole,
            (true, true) => pipeline::Parts::Coming,
            (true, false) => pipeline::Parts::Made,
        }
    }
}

/// A request ready for the engine, and what is needed to rerun it without its media.
pub struct Prepared {
    pub(super) request: GenerateRequest,
    /// The conversation with its media parts, for the text-only rerun of the drop policy.
    pub(super) messages: Vec<ChatMessage>,
    /// Per media item: the account `usage.media` shows.
    pub media: Vec<MediaAccount>,
    pub stream: bool,
    pub include_usage: bool,
    /// The parts still being made of items placed before them, each with what hands it to the
    /// engine: fed once the request is submitted.
    pub(super) feeds: Vec<(Started<Vec<Tensor>>, PieceMaker)>,
}

/// One media item of a prepared request, whole.
pub struct KeptItem {
    pub item: MediaItem,
    /// Each of its runs' time in its video where the family writes one (a Qwen3-VL video's
    /// temporal patches), in prompt order; empty otherwise.
    pub times: Vec<f64>,
}

/// A request's conversation and media, resolved and checked against a model's prompt side, with
/// the tokens its plugin items may share: what a natively served model and an upstream one whose
/// media are planned here (`media = "preprocess"`) have in common.
struct Gathered {
    /// The conversation as the chat template sees it, each media part its kind's placeholder.
    messages: Vec<ChatMessage>,
    /// The media parts in prompt order.
    items: Vec<Item>,
    /// The templated prompt, one placeholder per item.
    ids: Vec<u32>,
    /// What the context leaves the plugins' items: less the text, the completion and embeddings.
    budget: usize,
    max_tokens: Option<usize>,
    stop: Vec<String>,
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
    async fn process(
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
async fn gather(
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
    checked_text(prompt, &request.messages, services.limits).await?;
    let mut messages = Vec::with_capacity(request.messages.len());
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
        messages.push(ChatMessage {
            role: message.role,
            content,
        });
    }
    let items = resolve_media(prompt, sources, services).await?;
    let mut next_item = items.iter();
    for part in messages.iter_mut().flat_map(|m| m.content.iter_mut()) {
        if !matches!(part, ContentPart::Text(_))
            && let Some(item) = next_item.next()
        {
            *part = item.kind.content_part();
        }
    }

    let (messages, ids) = prompt_ids_off_thread(prompt, messages).await?;
    let text_tokens = prompt.text_tokens(&ids);
    let context = prompt.context_length;
    let max_tokens = match request.max_tokens {
        Some(0) => return Err(invalid("max_tokens", "max_tokens must be at least 1")),
        Some(n) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        None => None,
    };
    // Media share what the context leaves after the text and the completion; without max_tokens
    // the completion gets whatever the media leave (at least one token).
    let budget = context
        .checked_sub(text_tokens)
        .and_then(|left| left.checked_sub(max_tokens.unwrap_or(1)))
        .ok_or_else(|| {
            context_exceeded(format!(
                "the messages are {text_tokens} tokens and max_tokens is {}; this model's context is {context} tokens",
                max_tokens.unwrap_or(1)
            ))
        })?;
    // Embeddings cost what they hold; the plugins' items share the rest.
    let fixed: usize = items
        .iter()
        .map(|i| match &i.input {
            ItemInput::Embeddings(item) => item.tokens,
            ItemInput::Plugin { .. } => 0,
        })
        .sum();
    let budget = budget.checked_sub(fixed).ok_or_else(|| {
        context_exceeded(format!(
            "the request's image_embeds are {fixed} tokens; {budget} are left for media in this model's context of {context} tokens"
        ))
    })?;
    Ok(Gathered {
        messages,
        items,
        ids,
        budget,
        max_tokens,
        stop,
    })
}

/// The encoder outputs other replicas made, as one model looks its items up there (see
/// [`feature_cache::item_key`]).
struct SharedLookup {
    shared: SharedCache,
    processor_config: String,
}

impl pipeline::SharedOutputs for SharedLookup {
    fn item_key(&self, plugin: &LoadedPlugin, media: &Media, plan: &TokenPlan) -> [u8; 32] {
        feature_cache::item_key(
            &self.shared.namespace,
            plugin.sha256(),
            &self.processor_config,
            &media.data,
            plan,
        )
    }

    fn get(&self, key: &[u8; 32]) -> Option<pipeline::Encoded> {
        let (features, note) = self.shared.features.get(key)?;
        Some(pipeline::Encoded {
            features: Arc::new(features),
            tensors: feature_cache::noted_tensors(&note)?,
        })
    }
}

fn shared_lookup(shared: &SharedCache, processor_config: &str) -> pipeline::Lookup {
    Arc::new(SharedLookup {
        shared: shared.clone(),
        processor_config: processor_config.to_owned(),
    })
}

pub async fn prepare(
    model: &NativeModel,
    mut request: ChatCompletionRequest,
    services: &ChatServices<'_>,
) -> Result<Prepared, ApiError> {
    let prompt = &model.runtime.prompt;
    let gathered = gather(prompt, model.accept_image_embeds, &mut request, services).await?;
    let shared = model.runtime.shared.as_ref();
    let lookup = shared.map(|s| shared_lookup(s, &prompt.processor_config));
    let processed = gathered
        .process(
            prompt,
            services,
            pipeline::Produce::Tensors {
                parts: model.parts(),
            },
            lookup,
        )
        .await?;
    let Gathered {
        messages,
        items,
        ids,
        max_tokens,
        stop,
        ..
    } = gathered;
    let context = prompt.context_length;

    let mut media = Vec::with_capacity(items.len());
    let mut report = Vec::with_capacity(items.len());
    let mut dropped = Vec::new();
    let mut feeds = Vec::new();
    let mut processed = processed.into_iter();
    for (index, item) in items.into_iter().enumerate() {
        let (plugin, processed) = match item.input {
            ItemInput::Embeddings(input) => {
                report.push(MediaAccount::embeddings(index, item.kind, input.tokens));
                media.push(PlacedItem::single(input));
                continue;
            }
            ItemInput::Plugin { plugin, .. } => match processed.next() {
                Some(processed) => (plugin, processed),
                None => return Err(internal("a media item was not processed")),
            },
        };
        let mut account = MediaAccount::plugin(index, item.kind, &plugin, &processed);
        let tokens = processed.plan.tokens as usize;
        let made = match processed.made {
            Made::EncodedParts(known) => {
                let layouts = part_layouts(&known.plans);
                match prompt.encoded_parts(item.kind, tokens, layouts, known.features, index) {
                    Ok(placed) => {
                        report.push(account);
                        media.push(placed);
                        continue;
                    }
                    Err(e) => return Err(unencodable(index, &e.into())),
                }
            }
            Made::Coming(coming) => {
                // With a shared cache, each part's output is stored for other replicas under its
                // piece's key (none without one), its part plan (what places it) beside it.
                let share_keys = &coming.share_keys;
                let layouts = part_layouts(&coming.plans);
                match prompt.coming_parts(item.kind, tokens, layouts, share_keys, index) {
                    Ok(Some((placed, makers))) => {
                        if let Some(shared) = shared {
                            for (plan, key) in coming.plans.iter().zip(share_keys) {
                                let note = feature_cache::note(&plan.placing);
                                shared.features.put_note(key, note);
                            }
                        }
                        feeds.extend(coming.parts.into_iter().zip(makers));
                        report.push(account);
                        media.push(placed);
                        continue;
                    }
                    // The model encodes such items whole: the parts are joined once all are made.
                    Ok(None) => {
                        let parts = coming
                            .all()
                            .await
                            .map_err(|error| plugin_failed(index, &error))?;
                        place_parts(prompt, item.kind, tokens, &parts, index)
                    }
                    Err(e) => return Err(unencodable(index, &e.into())),
                }
            }
            Made::Encoded(known) => prompt
                .encoded_item(
                    item.kind,
                    tokens,
                    item_tensors(&known.tensors),
                    known.features,
                )
                .map_err(anyhow::Error::from),
            Made::Parts(parts) => place_parts(prompt, item.kind, tokens, &parts, index),
            Made::Tensors(tensors) => {
                let made = prompt
                    .media_item(item.kind, tokens, item_tensors(&tensors))
                    .map_err(anyhow::Error::from);
                // Other replicas will look this item up by its key: the pool writes its output
                // there, and the note that places it goes beside it.
                made.map(|mut placed| {
                    if let (Some(shared), Some(key)) = (shared, processed.share_key) {
                        shared
                            .features
                            .put_note(&key, feature_cache::note(&tensors));
                        for item in &mut placed.items {
                            item.share_key = Some(key);
                        }
                    }
                    placed
                })
            }
            Made::Files(_) => return Err(internal("a media item was reduced to files")),
        };
        // Output the model's encoder cannot take fails to encode: the model's policy decides.
        let unencodable = match made {
            Ok(input) => {
                media.push(input);
                None
            }
            Err(e) if model.on_encode_error == EncodeErrorPolicy::Drop => {
                let reason = format!("{e:#}");
                tracing::warn!(item = index, error = %reason, "the plugin's output cannot be encoded; dropping the item");
                dropped.push(index);
                Some(reason)
            }
            Err(e) => return Err(unencodable(index, &e)),
        };
        if let Some(reason) = unencodable {
            account.drop_for(&reason);
        }
        report.push(account);
    }
    // Dropped items leave the conversation: their placeholders must not reach the prompt.
    let (messages, ids) = if dropped.is_empty() {
        (messages, ids)
    } else {
        let kept = without_media(&messages, |i| dropped.contains(&i));
        let ids = prompt_ids(prompt, &kept)?;
        (kept, ids)
    };
    let prompt_ids = expand_placeholders(&ids, &media).map_err(|e| internal(format!("{e:#}")))?;
    let max_tokens = max_tokens.unwrap_or_else(|| context.saturating_sub(prompt_ids.len()).max(1));
    if prompt_ids.len() + max_tokens > context {
        return Err(context_exceeded(format!(
            "the prompt is {} tokens and max_tokens is {max_tokens}; this model's context is {context} tokens",
            prompt_ids.len()
        )));
    }
    Ok(Prepared {
        request: GenerateRequest {
            prompt: prompt_ids,
            media: media.into_iter().flat_map(|placed| placed.items).collect(),
            sampling: sampling(
                &prompt.generation,
                request.temperature,
                request.top_p,
                request.top_k,
                request.sampling_seed(),
            )?,
            max_tokens,
            stop,
        },
        messages,
        media: report,
        stream: request.stream,
        include_usage: request.stream_options.is_some_and(|o| o.include_usage),
        feeds,
    })
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
                accounts.push(MediaAccount::plugin(index, item.kind, plugin, &done));
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

impl Prepared {
    /// Tokens of the prompt, each media item's placeholders expanded.
    pub fn prompt_tokens(&self) -> usize {
        self.request.prompt.len()
    }

    /// The media as the engine takes them (dropped items left out), and every item's account.
    pub fn into_media(self) -> (Vec<KeptItem>, Vec<MediaAccount>) {
        // One per item: the parts of an input split over several runs share it, and of an item
        // made in pieces the first stands for it.
        let mut media: Vec<KeptItem> = Vec::with_capacity(self.media.len());
        for item in self.request.media {
            if let Some(part) = item.part.filter(|p| p.first_token > 0) {
                if let Some(kept) = media.last_mut() {
                    kept.times.extend(part.at);
                }
                continue;
            }
            let same_piece = |kept: &KeptItem| {
                item.piece.is_some()
                    && kept.item.piece.map(|p| p.item) == item.piece.map(|p| p.item)
            };
            if !media.last().is_some_and(same_piece) {
                let times = item.part.and_then(|p| p.at).into_iter().collect();
                media.push(KeptItem { item, times });
            }
        }
        (media, self.media)
    }
}

/// The request's sampling settings; what it leaves out comes from the model's
/// `generation_config.json` (as vLLM and transformers take it), else OpenAI's defaults.
fn sampling(
    defaults: &GenerationConfig,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    seed: Option<u64>,
) -> Result<SamplingParams, ApiError> {
    if temperature.is_some_and(|t| !(0.0..=2.0).contains(&t)) {
        return Err(invalid("temperature", "temperature must be within [0, 2]"));
    }
    if top_p.is_some_and(|p| !(p > 0.0 && p <= 1.0)) {
        return Err(invalid("top_p", "top_p must be within (0, 1]"));
    }
    Ok(SamplingParams {
        temperature: temperature.unwrap_or_else(|| defaults.default_temperature(1.0)),
        top_p: top_p.or(defaults.top_p).unwrap_or(1.0),
        top_k: match top_k {
            Some(k) => usize::try_from(k).unwrap_or(0),
            None => defaults.top_k.unwrap_or(0),
        },
        seed,
    })
}
