//! A chat completion prepared for a model whose encoders run here (natively served, or encoded
//! here for an upstream engine: `media = "embed"`, `"ec"`): the request gathered as every model's is
//! ([`crate::prepare::gather`]), its plugin items made into tensors, and each item placed in the
//! templated prompt for the engine; what runs it is [`super::generation`].

use std::sync::Arc;

use mmgate_host::{LoadedPlugin, Media, Started, Tensor, TokenPlan};
use mmgate_inference::engine::{GenerateRequest, MediaItem};
use mmgate_inference::models::GenerationConfig;
use mmgate_inference::prompt::{PieceMaker, PlacedItem, expand_placeholders};
use mmgate_inference::sampling::SamplingParams;
use mmgate_inference::text::ChatMessage;

use crate::config::EncodeErrorPolicy;
use crate::error::ApiError;
use crate::media::account::MediaAccount;
use crate::media::feature_cache::{self, SharedCache};
use crate::media::pipeline::{self, Made};
use crate::model::LocalModel;
use crate::prepare::errors::{context_exceeded, internal, invalid, plugin_failed, unencodable};
use crate::prepare::gather::{Gathered, gather};
use crate::prepare::items::{ChatServices, ItemInput};
use crate::prepare::plugin_output::{item_tensors, part_layouts, place_parts};
use crate::prepare::prompt_text::{prompt_ids, without_media};
use crate::wire::openai::ChatCompletionRequest;

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
    model: &LocalModel,
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
        let mut account =
            MediaAccount::plugin(index, item.kind, &plugin, &processed).of_page(item.page);
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
