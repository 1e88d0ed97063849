//! A chat completion on a natively served model: the request's media resolved and checked against
//! the limits, run through their plugins under the request-wide token budget, the prompt templated
//! and expanded, and the engine's events turned into text — with the model's encode-error policy.

use std::sync::Arc;

use base64::Engine as _;
use http::StatusCode;
use mmgate_host::{
    LoadedPlugin, Media, PluginPool, PluginRegistry, ReducedItem, Started, Tensor, TokenPlan,
};
use mmgate_inference::engine::{
    Event, Failure, FinishReason, GenerateRequest, MediaItem, RequestHandle, Usage,
};
use mmgate_inference::families::MediaKind;
use mmgate_inference::models::GenerationConfig;
use mmgate_inference::prompt::{PieceMaker, PlacedItem, PromptModel, expand_placeholders};
use mmgate_inference::sampling::SamplingParams;
use mmgate_inference::text::{ChatMessage, ContentPart};
use serde_json::Value;

use crate::config::{EncodeErrorPolicy, RequestLimits};
use crate::error::ApiError;
use crate::media::account::{self, MediaAccount};
use crate::media::budget::BudgetError;
use crate::media::feature_cache::{self, SharedCache};
use crate::media::files::FileStore;
use crate::media::pipeline::{self, Made};
use crate::media::sniff::sniff_mime_type;
use crate::native::model::ModelRuntime;
use crate::native::plugin_output::{item_tensors, named_tensor, part_layouts, place_parts};
use crate::store::Caller;
use crate::wire::openai::{
    self, ByteSource, ChatCompletionRequest, Content, MediaSource, Part, PayloadError,
};
use crate::wire::torchfile;

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

/// What a chat request needs besides its model.
pub struct ChatServices<'a> {
    /// Whose request it is: uploads are looked up as theirs.
    pub caller: &'a Caller,
    pub registry: Arc<PluginRegistry>,
    pub pool: &'a PluginPool,
    pub limits: &'a RequestLimits,
    pub files: &'a FileStore,
    pub fetcher: &'a crate::media::fetch::Fetcher,
}

/// One media part of the request, resolved: bytes for a plugin, or embeddings ready to merge.
struct Item {
    kind: MediaKind,
    input: ItemInput,
}

enum ItemInput {
    Plugin {
        plugin: Arc<LoadedPlugin>,
        media: Arc<Media>,
    },
    /// Encoded elsewhere (an `image_embeds` part): a fixed number of tokens, nothing to run.
    Embeddings(MediaItem),
}

/// A request ready for the engine, and what is needed to rerun it without its media.
pub struct Prepared {
    request: GenerateRequest,
    /// The conversation with its media parts, for the text-only rerun of the drop policy.
    messages: Vec<ChatMessage>,
    /// Per media item: the account `usage.media` shows.
    pub media: Vec<MediaAccount>,
    pub stream: bool,
    pub include_usage: bool,
    /// The parts still being made of items placed before them, each with what hands it to the
    /// engine: fed once the request is submitted.
    feeds: Vec<(Started<Vec<Tensor>>, PieceMaker)>,
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

/// Item `item`'s plugin call failed.
fn plugin_failed(item: usize, error: &mmgate_host::CallError) -> ApiError {
    let mut api = ApiError::from(error);
    api.message = format!("media item {item}: {}", api.message);
    api
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

/// A plugin's output for item `index` that the model's encoder cannot take.
fn unencodable(index: usize, e: &anyhow::Error) -> ApiError {
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "plugin_output_mismatch",
        format!("media item {index}: {e:#}"),
    )
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
}

/// Plans `request`'s media for `prompt`'s model exactly as for a native model (limits, probe, the
/// request-wide budget, plan), then has each plugin reduce its item to files the upstream's own
/// processor reads as planned. A request that cannot fit is refused here.
pub async fn plan_for_upstream(
    prompt: &PromptModel,
    accept_image_embeds: bool,
    mut request: ChatCompletionRequest,
    services: &ChatServices<'_>,
) -> Result<PlannedUpstream, ApiError> {
    let gathered = gather(prompt, accept_image_embeds, &mut request, services).await?;
    let mut processed = gathered
        .process(prompt, services, pipeline::Produce::Files, None)
        .await?
        .into_iter();
    let mut parts = Vec::with_capacity(gathered.items.len());
    let mut accounts = Vec::with_capacity(gathered.items.len());
    let mut media_tokens = 0usize;
    for (index, item) in gathered.items.iter().enumerate() {
        match &item.input {
            ItemInput::Embeddings(input) => {
                media_tokens += input.tokens;
                accounts.push(MediaAccount::embeddings(index, item.kind, input.tokens));
                parts.push((item.kind, None));
            }
            ItemInput::Plugin { plugin, .. } => {
                let done = processed
                    .next()
                    .ok_or_else(|| internal("a media item was not processed"))?;
                media_tokens += done.plan.tokens as usize;
                accounts.push(MediaAccount::plugin(index, item.kind, plugin, &done));
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
    let prompt_tokens = text_tokens + media_tokens;
    Ok(PlannedUpstream {
        parts,
        accounts,
        prompt_tokens,
    })
}

impl Prepared {
    /// The media as the engine takes them (dropped items left out), and every item's account.
    pub fn into_media(self) -> (Vec<MediaItem>, Vec<MediaAccount>) {
        // One per item: the parts of an input split over several runs share it, and of an item
        // made in pieces the first stands for it.
        let mut media: Vec<MediaItem> = Vec::with_capacity(self.media.len());
        for item in self.request.media {
            let same_piece = |kept: &MediaItem| {
                item.piece.is_some() && kept.piece.map(|p| p.item) == item.piece.map(|p| p.item)
            };
            if item.part.is_none_or(|p| p.first_token == 0) && !media.last().is_some_and(same_piece)
            {
                media.push(item);
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

/// Every media part's bytes, within the limits (checked before decoding or fetching), and the
/// plugin that takes each, which must handle the kind the part claims and the model must take it.
async fn resolve_media(
    runtime: &PromptModel,
    sources: Vec<(Option<MediaKind>, MediaSource)>,
    services: &ChatServices<'_>,
) -> Result<Vec<Item>, ApiError> {
    let mut tally = MediaTally::new(services.limits, sources.len())?;
    let mut resolved = Vec::with_capacity(sources.len());
    let mut items = Vec::with_capacity(sources.len());
    for (index, (kind, source)) in sources.into_iter().enumerate() {
        if let Some(kind) = kind {
            runtime
                .placeholder(kind)
                .map_err(|e| invalid("messages", format!("media item {index}: {e}")))?;
        }
        let limit = tally.limit(kind);
        let (data, declared) = match source {
            MediaSource::Embeddings { embeddings, grid } => {
                let kind = kind.unwrap_or(MediaKind::Image);
                let input = embeddings_item(runtime, kind, &embeddings, grid.as_deref())
                    .map_err(|e| invalid("messages", format!("media item {index}: {e}")))?;
                items.push((
                    index,
                    Item {
                        kind,
                        input: ItemInput::Embeddings(input),
                    },
                ));
                continue;
            }
            MediaSource::Bytes(source) => source_bytes(index, source, limit, services).await?,
        };
        if data.len() > limit {
            return Err(too_large(index, data.len(), limit));
        }
        let mime_type = sniff_mime_type(&data).map(str::to_owned).or(declared);
        resolved.push((index, kind, Media { data, mime_type }));
    }

    // A text-only request must not wait for a plugin worker (all may be busy with another's parts).
    if resolved.is_empty() {
        return Ok(items.into_iter().map(|(_, item)| item).collect());
    }
    // Choosing a plugin may probe: plugin work runs on the plugin pool, ahead of preprocessing.
    let registry = services.registry.clone();
    let processor_config = runtime.processor_config.clone();
    let chosen = services
        .pool
        .run_ahead(move || {
            Ok(resolved
                .into_iter()
                .map(|(index, kind, media)| {
                    let plugin = pipeline::choose_plugin(
                        &registry,
                        &media,
                        kind.map(MediaKind::name),
                        &processor_config,
                    )
                    .cloned();
                    (index, kind, media, plugin)
                })
                .collect::<Vec<_>>())
        })
        .await
        .map_err(|e| ApiError::from(&e))?;

    for (index, kind, media, plugin) in chosen {
        let what = media
            .mime_type
            .clone()
            .unwrap_or_else(|| "unknown content".into());
        let plugin = plugin.ok_or_else(|| {
            unsupported_media(format!(
                "media item {index}: no loaded plugin accepts it ({what})"
            ))
        })?;
        let handles = |k: MediaKind| plugin.descriptor().modalities.iter().any(|m| m == k.name());
        let kind = match kind {
            Some(kind) if handles(kind) => kind,
            Some(kind) => {
                return Err(unsupported_media(format!(
                    "media item {index} is sent as {} but holds {what}",
                    kind.name()
                )));
            }
            // An upload is whatever its plugin makes of it, if the model takes that.
            None => runtime
                .media_kinds()
                .iter()
                .copied()
                .find(|&k| handles(k))
                .ok_or_else(|| {
                    unsupported_media(format!(
                        "media item {index}: model {} does not take {what}",
                        runtime.name
                    ))
                })?,
        };
        tally.add(index, kind, media.data.len())?;
        items.push((
            index,
            Item {
                kind,
                input: ItemInput::Plugin {
                    plugin,
                    media: Arc::new(media),
                },
            },
        ));
    }
    items.sort_by_key(|(index, _)| *index);
    Ok(items.into_iter().map(|(_, item)| item).collect())
}

/// The bytes of media item `index` and the MIME type its source declared: base64 decoded, a URL
/// fetched (through the SSRF guard), an upload read. At most `limit` bytes, checked before anything
/// is decoded or fetched.
pub async fn source_bytes(
    index: usize,
    source: ByteSource,
    limit: usize,
    services: &ChatServices<'_>,
) -> Result<(Vec<u8>, Option<String>), ApiError> {
    let (data, declared) = match source {
        ByteSource::Base64 { data, mime_type } => match openai::decode_payload(&data, limit) {
            Ok(bytes) => (bytes, mime_type),
            Err(PayloadError::TooLarge(decoded)) => return Err(too_large(index, decoded, limit)),
            Err(PayloadError::NotBase64(e)) => {
                return Err(ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_media_url",
                    format!("media item {index}: the base64 data does not decode: {e}"),
                ));
            }
        },
        ByteSource::NotBase64 => {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_media_url",
                format!("media item {index}: {}", openai::NOT_BASE64),
            ));
        }
        ByteSource::Url(url) => {
            let fetched = services.fetcher.fetch(&url, limit).await.map_err(|e| {
                let mut api = ApiError::from(&e);
                api.message = format!("media item {index}: {}", api.message);
                api
            })?;
            (fetched.data, fetched.mime_type)
        }
        ByteSource::File(id) => {
            let file = services
                .files
                .get(services.caller, &id)
                .await?
                .ok_or_else(|| {
                    ApiError::new(
                        StatusCode::NOT_FOUND,
                        "file_not_found",
                        format!("media item {index}: no uploaded file {id:?}"),
                    )
                })?;
            (file.data.to_vec(), file.meta.mime_type)
        }
    };
    if data.len() > limit {
        return Err(too_large(index, data.len(), limit));
    }
    Ok((data, declared))
}

/// An `image_embeds` part's tensors (base64 `torch.save` files), checked against the model. The
/// embeddings can hold no more tokens than the model's context.
fn embeddings_item(
    runtime: &PromptModel,
    kind: MediaKind,
    embeddings: &str,
    grid: Option<&str>,
) -> anyhow::Result<MediaItem> {
    let max_bytes = runtime
        .context_length
        .saturating_mul(runtime.embedding_width)
        .saturating_mul(4);
    let read = |b64: &str, name: &str, max: usize| -> anyhow::Result<mmgate_host::Tensor> {
        // Base64 is 4 characters per 3 bytes; a torch file adds a few kB around its storage.
        if b64.len() / 4 * 3 > max.saturating_add(64 << 10) {
            anyhow::bail!("{name} is larger than any this model takes ({max} bytes)");
        }
        let file = base64::engine::general_purpose::STANDARD
            .decode(b64.trim())
            .map_err(|e| anyhow::anyhow!("{name}: the base64 data does not decode: {e}"))?;
        torchfile::read(&file, name, max).map_err(|e| anyhow::anyhow!("{name}: {e}"))
    };
    let embeddings = read(embeddings, "image_embeds", max_bytes)?;
    let grid = grid.map(|g| read(g, "image_grid_thw", 64)).transpose()?;
    let grid = grid.as_ref().map(named_tensor);
    Ok(runtime.embeddings_item(kind, named_tensor(&embeddings), grid)?)
}

/// A request's media measured against its limits as they are resolved (the same checks on every
/// route): how many items, each one's bytes by kind, and all images' bytes together.
pub struct MediaTally<'a> {
    limits: &'a RequestLimits,
    image_bytes: usize,
}

impl<'a> MediaTally<'a> {
    /// For a request of `items` media items: refused when they are too many.
    pub fn new(limits: &'a RequestLimits, items: usize) -> Result<Self, ApiError> {
        if items > limits.max_media_items {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "too_many_media_items",
                format!(
                    "the request has {items} media items; at most {} are allowed",
                    limits.max_media_items
                ),
            ));
        }
        Ok(MediaTally {
            limits,
            image_bytes: 0,
        })
    }

    /// The most bytes an item of `kind` may have; an item of unknown kind (an upload, until its
    /// bytes say what it is) gets the largest, and is checked again once known.
    pub fn limit(&self, kind: Option<MediaKind>) -> usize {
        match kind {
            Some(MediaKind::Image) => self.limits.max_image_bytes,
            Some(MediaKind::Audio) => self.limits.max_audio_bytes,
            Some(MediaKind::Video) | None => self.limits.max_video_bytes,
        }
    }

    /// Item `index`, of `kind` and `bytes` long.
    pub fn add(&mut self, index: usize, kind: MediaKind, bytes: usize) -> Result<(), ApiError> {
        let limit = self.limit(Some(kind));
        if bytes > limit {
            return Err(too_large(index, bytes, limit));
        }
        if kind == MediaKind::Image {
            self.image_bytes += bytes;
            if self.image_bytes > self.limits.max_total_image_bytes {
                return Err(ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "media_too_large",
                    format!(
                        "the request's images are over {} bytes together",
                        self.limits.max_total_image_bytes
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// A running generation. Its steps are text deltas, then the end; an encode failure is retried
/// without the media when the model's policy says so (before any token was produced: a request's
/// first token needs all its media).
pub struct Generation<'m> {
    model: &'m NativeModel,
    handle: RequestHandle,
    messages: Vec<ChatMessage>,
    max_tokens: usize,
    stop: Vec<String>,
    sampling: SamplingParams,
    /// The media accounts, updated when items are dropped.
    pub media: Vec<MediaAccount>,
    produced: bool,
    /// The tokens generated so far.
    pub token_ids: Vec<u32>,
    /// One per task handing a part still being made to the engine: dropping it stops the task
    /// (a part not yet begun is then never made).
    feeding: Vec<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for Generation<'_> {
    fn drop(&mut self) {
        self.stop_feeding();
    }
}

pub enum Step {
    Text(String),
    Done { finish: &'static str, usage: Value },
}

impl<'m> Generation<'m> {
    pub fn start(model: &'m NativeModel, prepared: Prepared) -> Result<Self, ApiError> {
        let Prepared {
            request,
            messages,
            media,
            feeds,
            ..
        } = prepared;
        let (max_tokens, stop, sampling) = (
            request.max_tokens,
            request.stop.clone(),
            request.sampling.clone(),
        );
        let handle = model
            .runtime
            .engine()
            .map_err(|e| internal(e.to_string()))?
            .submit(request)
            .map_err(|e| internal(e.to_string()))?;
        // Each part goes to the engine as soon as it is made; the engine merges and prefills the
        // pieces in order meanwhile.
        let feeding = feeds
            .into_iter()
            .map(|(part, maker)| {
                let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
                tokio::spawn(async move {
                    tokio::select! {
                        made = part.wait() => maker.deliver(
                            made.map(|tensors| item_tensors(&tensors)).map_err(|e| e.to_string()),
                        ),
                        _ = stopped => maker.cancel(),
                    }
                });
                stop
            })
            .collect();
        Ok(Self {
            model,
            handle,
            messages,
            max_tokens,
            stop,
            sampling,
            media,
            produced: false,
            token_ids: Vec::new(),
            feeding,
        })
    }

    /// The next step; `Ok(None)` never comes before `Done`.
    pub async fn next(&mut self) -> Result<Step, ApiError> {
        loop {
            let event = self
                .handle
                .events
                .recv()
                .await
                .ok_or_else(|| internal("the inference engine stopped"))?;
            match event {
                Event::Token { id, text } => {
                    self.produced = true;
                    self.token_ids.push(id);
                    if !text.is_empty() {
                        return Ok(Step::Text(text));
                    }
                }
                Event::Done { finish, usage } => return Ok(self.done(finish, &usage)),
                Event::Failed(Failure::Encode { item, message })
                    if self.model.on_encode_error == EncodeErrorPolicy::Drop && !self.produced =>
                {
                    tracing::warn!(item, %message, "encoding failed; dropping the media");
                    self.rerun_without_media(&message)?;
                }
                Event::Failed(failure) => return Err(failure_error(&failure)),
            }
        }
    }

    fn done(&self, finish: FinishReason, usage: &Usage) -> Step {
        let finish = match finish {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        };
        Step::Done {
            finish,
            usage: crate::wire::openai::usage_json(
                usage.prompt_tokens,
                usage.completion_tokens,
                &account::render(&self.media),
            ),
        }
    }

    fn stop_feeding(&mut self) {
        self.feeding.clear();
    }

    /// The drop policy: the same conversation with its media parts removed.
    fn rerun_without_media(&mut self, reason: &str) -> Result<(), ApiError> {
        self.stop_feeding();
        for account in &mut self.media {
            if account.dropped.is_none() {
                account.drop_for(reason);
            }
        }
        let prompt = prompt_ids(
            &self.model.runtime.prompt,
            &without_media(&self.messages, |_| true),
        )?;
        let context = self.model.runtime.prompt.context_length;
        let max_tokens = self
            .max_tokens
            .min(context.saturating_sub(prompt.len()).max(1));
        self.handle = self
            .model
            .runtime
            .engine()
            .map_err(|e| internal(e.to_string()))?
            .submit(GenerateRequest {
                prompt,
                media: Vec::new(),
                sampling: self.sampling.clone(),
                max_tokens,
                stop: self.stop.clone(),
            })
            .map_err(|e| internal(e.to_string()))?;
        Ok(())
    }
}

/// What tokenizing a request's text costs is bounded before it is paid: all its text together
/// within `max_text_bytes`, and text that surely makes more tokens than the model's context
/// refused after counting only as much as shows that. Counting runs off the threads that serve
/// connections.
async fn checked_text(
    prompt: &PromptModel,
    messages: &[openai::Message],
    limits: &RequestLimits,
) -> Result<(), ApiError> {
    let texts: Vec<&str> = messages.iter().flat_map(|m| m.texts()).collect();
    let bytes: usize = texts.iter().map(|t| t.len()).sum();
    if bytes > limits.max_text_bytes {
        return Err(text_too_large(bytes, limits.max_text_bytes));
    }
    // Short text is counted in full in a moment below; only long text is worth a check first.
    if bytes < TEXT_WORTH_COUNTING_FIRST {
        return Ok(());
    }
    let joined = texts.join("\n");
    let (text, context) = (prompt.text.clone(), prompt.context_length);
    let surely_over =
        tokio::task::spawn_blocking(move || text.surely_longer_than(&joined, context))
            .await
            .map_err(|e| internal(e.to_string()))?
            .map_err(|e| invalid("messages", e.to_string()))?;
    if surely_over {
        return Err(context_exceeded(format!(
            "the messages' text alone is more than {context} tokens, this model's context"
        )));
    }
    Ok(())
}

/// The answer to a request whose messages' text is `bytes`, over `limit`.
pub fn text_too_large(bytes: usize, limit: usize) -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "text_too_large",
        format!("the messages' text is {bytes} bytes; the limit is {limit}"),
    )
}

/// Bytes of text below which [`checked_text`] leaves the count to the tokenizer's full pass.
const TEXT_WORTH_COUNTING_FIRST: usize = 64 << 10;

/// [`prompt_ids`] on a blocking thread, not one serving connections: templating and tokenizing
/// a long conversation takes long enough to hold up every other request on the thread.
async fn prompt_ids_off_thread(
    prompt: &PromptModel,
    messages: Vec<ChatMessage>,
) -> Result<(Vec<ChatMessage>, Vec<u32>), ApiError> {
    let text = prompt.text.clone();
    tokio::task::spawn_blocking(move || {
        let ids = templated_ids(&text, &messages);
        ids.map(|ids| (messages, ids))
    })
    .await
    .map_err(|e| internal(e.to_string()))?
}

/// The conversation templated and tokenized (placeholders not yet expanded).
fn prompt_ids(runtime: &PromptModel, messages: &[ChatMessage]) -> Result<Vec<u32>, ApiError> {
    templated_ids(&runtime.text, messages)
}

/// [`prompt_ids`] with the model's text processor alone.
fn templated_ids(
    text: &mmgate_inference::text::TextProcessor,
    messages: &[ChatMessage],
) -> Result<Vec<u32>, ApiError> {
    let templated = text
        .apply_chat_template(messages, true)
        .map_err(|e| invalid("messages", format!("the chat template refused them: {e}")))?;
    text.encode(&templated).map_err(|e| internal(e.to_string()))
}

/// `messages` without the media parts whose item index (their order in the conversation) `drop`
/// picks.
fn without_media(messages: &[ChatMessage], drop: impl Fn(usize) -> bool) -> Vec<ChatMessage> {
    let mut item = 0;
    messages
        .iter()
        .map(|m| ChatMessage {
            role: m.role.clone(),
            content: m
                .content
                .iter()
                .filter(|part| {
                    if matches!(part, ContentPart::Text(_)) {
                        return true;
                    }
                    item += 1;
                    !drop(item - 1)
                })
                .cloned()
                .collect(),
        })
        .collect()
}

fn failure_error(failure: &Failure) -> ApiError {
    match failure {
        Failure::Encode { .. } => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "encode_failed",
            failure.to_string(),
        ),
        Failure::Invalid(message) => {
            ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", message.clone())
        }
        Failure::Internal(message) => internal(message.clone()),
    }
}

fn invalid(param: &'static str, message: impl Into<String>) -> ApiError {
    let mut error = ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", message);
    error.param = Some(param);
    error
}

/// A medium of a kind its part, or the model, does not take: one code whatever the part's type.
fn unsupported_media(message: String) -> ApiError {
    let mut error = ApiError::new(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported_media",
        message,
    );
    error.param = Some("messages");
    error
}

fn internal(message: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal_error", message)
}

fn context_exceeded(message: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, "context_length_exceeded", message)
}

/// The answer to an `image_embeds` part for a model that does not take them.
pub fn embeds_refused(model: &str) -> ApiError {
    let mut error = ApiError::new(
        StatusCode::BAD_REQUEST,
        "image_embeds_not_accepted",
        format!(
            "model {model} does not take image_embeds parts: send the image itself (its operator can allow embeddings with accept_image_embeds = true)"
        ),
    );
    error.param = Some("messages");
    error
}

fn too_large(index: usize, bytes: usize, limit: usize) -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "media_too_large",
        format!("media item {index} is {bytes} bytes; the limit is {limit}"),
    )
}
