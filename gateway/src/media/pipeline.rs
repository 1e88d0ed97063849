//! Media items through their plugins: choosing the plugin, probe → plan → preprocess (one item, or
//! several sharing one budget), and the JSON account of what was done. Shared by `mmgate preprocess`
//! and `POST /v1/preprocess`.

use std::cell::RefCell;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt as _;
use futures_util::future::join_all;
use futures_util::stream::FuturesUnordered;
use mmgate_host::{
    Budget, CallError, Descriptor, LoadedPlugin, Media, MediaInfo, PartPlan, PluginPool,
    PluginRegistry, ReducedItem, Started, Tensor, TokenPlan,
};
use serde_json::{Value, json};
use tracing::Instrument as _;

use crate::access::as_attribute;
use crate::media::budget::{self, BudgetError};

/// The plugin for `media`: the one that lists its MIME type (a directory plugin before a built-in),
/// else the first whose probe accepts it. Plugins that serve the model's processor come first
/// ([`serves_processor`]): a directory plugin for another model family must not take this model's
/// images; when none does, the choice is made among all, so the chosen plugin's error says what it
/// does not support. Containers are shared between modalities (an MP4 may hold only audio and is
/// still sniffed as video/mp4), so:
/// - when the client said what the item is (`modality`, from an `audio_url` part say), only plugins of
///   that modality are considered, and the probe rule finds the one the client meant;
/// - when it did not, the listed plugin must accept the item in its probe, else the others are asked
///   (the listed one is still returned when none does, so its error is what the client sees).
pub fn choose_plugin<'r>(
    registry: &'r PluginRegistry,
    media: &Media,
    modality: Option<&str>,
    processor_config: &str,
) -> Option<&'r Arc<LoadedPlugin>> {
    let processors = processor_types(processor_config);
    choose_among(registry, media, modality, &processors)
        .or_else(|| choose_among(registry, media, modality, &[]))
}

fn choose_among<'r>(
    registry: &'r PluginRegistry,
    media: &Media,
    modality: Option<&str>,
    processors: &[String],
) -> Option<&'r Arc<LoadedPlugin>> {
    let serves = |d: &Descriptor| {
        modality.is_none_or(|m| d.modalities.iter().any(|x| x == m))
            && serves_processor(d, processors)
    };
    let listed = media
        .mime_type
        .as_deref()
        .and_then(|mime| registry.for_mime_type(mime, serves));
    if let Some(plugin) = listed
        && (modality.is_some() || plugin.probe(media).is_ok())
    {
        return Some(plugin);
    }
    registry
        .iter()
        .filter(|p| serves(p.descriptor()) && listed.is_none_or(|l| !Arc::ptr_eq(l, p)))
        .find(|p| p.probe(media).is_ok())
        .or(listed)
}

/// The processor classes a processor config names (`image_processor_type`, `video_processor_type`,
/// `feature_extractor_type`, `processor_class`, and a model's own video processor config's type
/// under `video_preprocessor_config`), without the `Fast`/`Pil` suffixes of their implementation
/// variants.
fn processor_types(processor_config: &str) -> Vec<String> {
    let Ok(Value::Object(config)) = serde_json::from_str::<Value>(processor_config) else {
        return Vec::new();
    };
    let nested_video = config
        .get("video_preprocessor_config")
        .and_then(|v| v.get("video_processor_type"));
    [
        "image_processor_type",
        "video_processor_type",
        "feature_extractor_type",
        "processor_class",
    ]
    .iter()
    .filter_map(|key| config.get(*key))
    .chain(nested_video)
    .filter_map(Value::as_str)
    .map(|class| processor_family(class).to_owned())
    .collect()
}

fn processor_family(class: &str) -> &str {
    let class = class.strip_suffix("Pil").unwrap_or(class);
    class.strip_suffix("Fast").unwrap_or(class)
}

/// Whether a plugin serves a model whose config names `processors`: a plugin that lists no
/// processor types serves any, as does every plugin when the config names none.
fn serves_processor(descriptor: &Descriptor, processors: &[String]) -> bool {
    descriptor.processor_types.is_empty()
        || processors.is_empty()
        || descriptor
            .processor_types
            .iter()
            .any(|t| processors.iter().any(|p| p == processor_family(t)))
}

/// What an item's last plugin call makes of it, once planned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Produce {
    /// The tensors this gateway's encoders take, made as `parts` says; whole (`preprocess`)
    /// whatever it says when the plugin makes the item whole or it is looked up in the shared
    /// cache (whose entries are whole items).
    Tensors { parts: Parts },
    /// `reduce`: the item as planned, as files for a model server that preprocesses itself.
    Files,
}

/// Whether an item is made in the plugin's parts (contract 0.4) on several instances at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parts {
    /// Whole, by one `preprocess` call.
    Whole,
    /// In parts, all made before the item is handed on.
    Made,
    /// In parts handed on one by one as each is made ([`Coming`]), when the plugin places them
    /// beforehand (contract 0.5's `part-plans`); otherwise as [`Parts::Made`].
    Coming,
}

/// An item's parts still being made, each placed beforehand by its part plan: the plans, and each
/// part's call, all already queued on the plugin pool in order.
pub struct Coming {
    pub plans: Vec<PartPlan>,
    pub parts: Vec<Started<Vec<Tensor>>>,
    /// With a shared cache, each part's key there: its output is stored for other replicas.
    pub share_keys: Vec<[u8; 32]>,
}

impl Coming {
    /// Every part, once all are made (for a model that must see the item whole).
    pub async fn all(self) -> Result<Vec<Vec<Tensor>>, CallError> {
        let mut parts = Vec::with_capacity(self.parts.len());
        for part in self.parts {
            parts.push(part.wait().await?);
        }
        Ok(parts)
    }
}

/// What running one item produced.
pub struct Processed {
    pub info: MediaInfo,
    pub plan: TokenPlan,
    pub made: Made,
    /// The item's key in the shared cache, when it was looked up there.
    pub share_key: Option<[u8; 32]>,
    pub timings: Timings,
}

/// What an item's last plugin calls made of it, or what another replica had made of it.
pub enum Made {
    /// `preprocess`'s tensors: the item whole.
    Tensors(Vec<Tensor>),
    /// Each part's tensors, in order, when the item was made in more than one.
    Parts(Vec<Vec<Tensor>>),
    /// The parts still being made, when they are handed on as each is made.
    Coming(Coming),
    /// `reduce`'s files, when those were asked for.
    Files(ReducedItem),
    /// The encoder's output, when another replica had made it of the whole item: no encoder
    /// input was made here.
    Encoded(Encoded),
    /// The parts' encoder outputs, when another replica had made them (see
    /// [`Coming::share_keys`]).
    EncodedParts(EncodedParts),
}

impl Made {
    /// How many parts the item was made in, when more than one.
    fn part_count(&self) -> usize {
        match self {
            Self::Parts(parts) => parts.len(),
            Self::Coming(coming) => coming.plans.len(),
            Self::EncodedParts(known) => known.plans.len(),
            Self::Tensors(_) | Self::Files(_) | Self::Encoded(_) => 0,
        }
    }
}

/// What another replica's encoder already made of an item: its output, and the item's tensors
/// other than the encoder's inputs (those that place it).
pub struct Encoded {
    pub features: Arc<Vec<f32>>,
    pub tensors: Vec<Tensor>,
}

/// The outputs other replicas made, as items are looked up there: a hit skips the item's
/// preprocessing and encoding. An item is stored whole under its key, or, when it was made in
/// parts placed beforehand, each part under its piece's key ([`SharedOutputs::piece_key`]).
pub trait SharedOutputs: Send + Sync {
    /// The key of an item (its plugin, media and plan).
    fn item_key(&self, plugin: &LoadedPlugin, media: &Media, plan: &TokenPlan) -> [u8; 32];
    /// What is stored under `key`.
    fn get(&self, key: &[u8; 32]) -> Option<Encoded>;
    /// The key of part `index` of the item under `item`.
    fn piece_key(&self, item: &[u8; 32], index: usize) -> [u8; 32] {
        let mut h = blake3::Hasher::new();
        h.update(item);
        h.update(b"piece");
        h.update(&(index as u64).to_le_bytes());
        *h.finalize().as_bytes()
    }
}

pub type Lookup = Arc<dyn SharedOutputs>;

/// An item's parts as another replica encoded them, each placed by its part plan.
pub struct EncodedParts {
    pub plans: Vec<PartPlan>,
    pub features: Vec<Arc<Vec<f32>>>,
}

pub struct Timings {
    pub probe: Duration,
    pub plan: Duration,
    /// The last call: `preprocess` or `reduce`.
    pub preprocess: Duration,
}

/// Items of one request planned together within one budget (see [`crate::media::budget`]): probe each,
/// share the budget, preprocess (or `reduce`: `produce` says; tensors are made whole) each with
/// its plan; each step a sandboxed call.
pub fn process_together(
    items: &[(Arc<LoadedPlugin>, Media)],
    processor_config: &str,
    budget: u32,
    produce: &Produce,
) -> Result<Vec<Processed>, BudgetError> {
    let mut infos = Vec::with_capacity(items.len());
    let mut probe_times = Vec::with_capacity(items.len());
    for (item, (plugin, media)) in items.iter().enumerate() {
        let started = Instant::now();
        let info = plugin
            .probe(media)
            .map_err(|error| BudgetError::Plugin { item, error })?;
        probe_times.push(started.elapsed());
        infos.push(info);
    }
    let plugins: Vec<&LoadedPlugin> = items.iter().map(|(p, _)| p.as_ref()).collect();
    let (plans, plan_times) = plan_items(&plugins, &infos, processor_config, budget);
    let plans = plans?;
    let mut processed = Vec::with_capacity(items.len());
    for (item, (((plugin, media), info), plan)) in items.iter().zip(infos).zip(plans).enumerate() {
        let started = Instant::now();
        let made = match produce {
            Produce::Tensors { .. } => plugin
                .preprocess(media, &plan, processor_config)
                .map(Made::Tensors),
            Produce::Files => plugin
                .reduce(media, &plan, processor_config)
                .map(Made::Files),
        }
        .map_err(|error| BudgetError::Plugin { item, error })?;
        processed.push(Processed {
            info,
            plan,
            made,
            share_key: None,
            timings: Timings {
                probe: probe_times[item],
                plan: plan_times[item],
                preprocess: started.elapsed(),
            },
        });
    }
    Ok(processed)
}

/// Every item's plan within `budget` shared (see [`budget::allocate`]), and the time each item's
/// plan calls took.
fn plan_items(
    plugins: &[&LoadedPlugin],
    infos: &[MediaInfo],
    processor_config: &str,
    budget: u32,
) -> (Result<Vec<TokenPlan>, BudgetError>, Vec<Duration>) {
    let plan_times = RefCell::new(vec![Duration::ZERO; plugins.len()]);
    let plans = budget::allocate(plugins.len(), budget, |item, max_tokens| {
        let started = Instant::now();
        let plan = plugins[item].plan(&infos[item], Budget { max_tokens }, processor_config);
        plan_times.borrow_mut()[item] += started.elapsed();
        plan
    });
    (plans, plan_times.into_inner())
}

/// Runs `calls` (each a request's plugin calls for one item), at most `fair_share` of them at
/// once, and hands back their results in order, or the first error. The pool's queue is first
/// come, first served: a request holding no more than a worker's worth of its items in it at a
/// time lets another request's items in between, so a small chat beside a request of sixty images
/// waits behind a few items, not all sixty. A lone request keeps every worker busy all the same.
pub(crate) async fn at_most_at_once<T, E>(
    fair_share: usize,
    calls: impl Iterator<Item = impl Future<Output = Result<T, E>>>,
) -> Result<Vec<T>, E> {
    let mut calls = calls.enumerate();
    let mut running = FuturesUnordered::new();
    for (index, call) in calls.by_ref().take(fair_share.max(1)) {
        running.push(numbered(index, call));
    }
    let mut done = Vec::new();
    while let Some(result) = running.next().await {
        done.push(result?);
        if let Some((index, call)) = calls.next() {
            running.push(numbered(index, call));
        }
    }
    done.sort_unstable_by_key(|(index, _)| *index);
    Ok(done.into_iter().map(|(_, out)| out).collect())
}

async fn numbered<T, E>(
    index: usize,
    call: impl Future<Output = Result<T, E>>,
) -> Result<(usize, T), E> {
    call.await.map(|out| (index, out))
}

/// [`process_together`] on the plugin pool, the items' probes in parallel and then their last
/// calls (`preprocess`, or `reduce`: `produce` says) in parallel (planning, which shares the
/// budget, is one job in between): a request's items take as long as the slowest, not the sum.
pub async fn process_concurrently(
    pool: &PluginPool,
    items: &[(Arc<LoadedPlugin>, Arc<Media>)],
    processor_config: Arc<str>,
    budget: u32,
    produce: Produce,
    lookup: Option<Lookup>,
) -> Result<Vec<Processed>, BudgetError> {
    // A text-only request has nothing to plan: it must not wait for a plugin worker (they may all
    // be busy with another request's parts).
    if items.is_empty() {
        return Ok(Vec::new());
    }
    let plugin_error = |item: usize| move |error| BudgetError::Plugin { item, error };
    let probes = items.iter().enumerate().map(|(item, (plugin, media))| {
        let (plugin, media) = (plugin.clone(), media.clone());
        let span = stage_span("plugin.probe", item, &plugin, &media);
        async move {
            pool.run_ahead(move || {
                let started = Instant::now();
                plugin.probe(&media).map(|info| (info, started.elapsed()))
            })
            .await
            .map_err(plugin_error(item))
        }
        .instrument(span)
    });
    let fair_share = pool.threads();
    let (infos, probe_times): (Vec<MediaInfo>, Vec<Duration>) = at_most_at_once(fair_share, probes)
        .await?
        .into_iter()
        .unzip();

    let plugins: Vec<Arc<LoadedPlugin>> = items.iter().map(|(p, _)| p.clone()).collect();
    let infos = Arc::new(infos);
    let planning_infos = infos.clone();
    let config = processor_config.clone();
    let (plans, plan_times) = pool
        .run_ahead(move || {
            let plugins: Vec<&LoadedPlugin> = plugins.iter().map(AsRef::as_ref).collect();
            Ok(plan_items(&plugins, &planning_infos, &config, budget))
        })
        .instrument(tracing::info_span!(
            "plugin.plan",
            mmgate.items = as_attribute(items.len()),
            mmgate.budget_tokens = i64::from(budget)
        ))
        .await
        .map_err(plugin_error(0))?;
    let plans = plans?;

    let jobs = items
        .iter()
        .zip(&plans)
        .enumerate()
        .map(|(item, ((plugin, media), plan))| {
            let (plugin, media, plan, config, lookup) = (
                plugin.clone(),
                media.clone(),
                plan.clone(),
                processor_config.clone(),
                lookup.clone(),
            );
            let span = stage_span("plugin.preprocess", item, &plugin, &media);
            span.record("mmgate.tokens", i64::from(plan.tokens));
            async move {
                let started = Instant::now();
                // Found whole among other replicas' outputs: used as it is.
                let looked = match (&lookup, produce) {
                    (Some(lookup), Produce::Tensors { .. }) => {
                        let (lookup, plugin, media, plan) =
                            (lookup.clone(), plugin.clone(), media.clone(), plan.clone());
                        let looked = pool.run_ahead(move || {
                            let key = lookup.item_key(&plugin, &media, &plan);
                            Ok((key, lookup.get(&key)))
                        });
                        Some(looked.await.map_err(plugin_error(item))?)
                    }
                    _ => None,
                };
                let share_key = looked.as_ref().map(|(key, _)| *key);
                if let Some((_, Some(known))) = looked {
                    return Ok((Made::Encoded(known), share_key, started.elapsed()));
                }
                if let Produce::Tensors { parts } = produce
                    && parts != Parts::Whole
                {
                    let shared = lookup.clone().zip(share_key);
                    let (plugin, media, plan, config) =
                        (plugin.clone(), media.clone(), plan.clone(), config.clone());
                    let made =
                        made_in_parts(pool, plugin, media, plan, config, parts, shared).await;
                    if let Some(made) = made.map_err(plugin_error(item))? {
                        return Ok((made, None, started.elapsed()));
                    }
                }
                pool.run(move || {
                    let made = match produce {
                        Produce::Tensors { .. } => {
                            plugin.preprocess(&media, &plan, &config).map(Made::Tensors)
                        }
                        Produce::Files => plugin.reduce(&media, &plan, &config).map(Made::Files),
                    };
                    made.map(|made| (made, share_key, started.elapsed()))
                })
                .await
                .map_err(plugin_error(item))
            }
            .instrument(span)
        });
    let outputs = at_most_at_once(fair_share, jobs).await?;
    let infos = Arc::try_unwrap(infos).unwrap_or_else(|shared| (*shared).clone());
    Ok(infos
        .into_iter()
        .zip(plans)
        .zip(outputs)
        .enumerate()
        .map(
            |(item, ((info, plan), (made, share_key, preprocess)))| Processed {
                info,
                plan,
                made,
                share_key,
                timings: Timings {
                    probe: probe_times[item],
                    plan: plan_times[item],
                    preprocess,
                },
            },
        )
        .collect())
}

/// A span for one item's plugin call `name`: which item, plugin and medium (never its bytes).
fn stage_span(
    name: &'static str,
    item: usize,
    plugin: &LoadedPlugin,
    media: &Media,
) -> tracing::Span {
    tracing::info_span!(
        "plugin",
        otel.name = name,
        mmgate.item = as_attribute(item),
        mmgate.plugin = %plugin.descriptor().name,
        mmgate.mime_type = media.mime_type.as_deref().unwrap_or("-"),
        mmgate.bytes = as_attribute(media.data.len()),
        mmgate.tokens = tracing::field::Empty,
    )
}

/// An item's parts, each made on its own instance of the plugin pool, all queued at once: made
/// before they are returned ([`Made::Parts`]), or, when `parts` is [`Parts::Coming`] and the plugin places them
/// beforehand, returned still coming ([`Made::Coming`]). `None` (made whole) when the plugin makes the item whole (one part), or
/// when fewer than two of the pool's workers are idle: parts cost more work in all than the whole
/// (each is a call of its own; an image's second band re-reads the first's entropy-coded rows),
/// which pays off only on cores that would otherwise wait. Under a backlog the item is made whole,
/// the same tensors for less work. With a shared cache (`shared`: it and the item's key there)
/// only parts placed beforehand are made, each stored under its piece's key; when every piece is
/// found there, nothing is made ([`Made::EncodedParts`]).
async fn made_in_parts(
    pool: &PluginPool,
    plugin: Arc<LoadedPlugin>,
    media: Arc<Media>,
    plan: TokenPlan,
    config: Arc<str>,
    parts: Parts,
    shared: Option<(Lookup, [u8; 32])>,
) -> Result<Option<Made>, CallError> {
    // Asked before `parts` too: under a backlog that call would wait in the queue for nothing.
    if pool.idle() < 2 {
        return Ok(None);
    }
    let asking = (plugin.clone(), plan.clone(), config.clone());
    let (count, plans) = pool
        .run_ahead(move || {
            let (plugin, plan, config) = asking;
            let count = plugin.parts(&plan, &config)?;
            let plans = match parts {
                Parts::Coming if count > 1 => plugin.part_plans(&plan, &config, count)?,
                _ => None,
            };
            Ok((count, plans))
        })
        .await?;
    if count <= 1 || pool.idle() < 2 || (shared.is_some() && plans.is_none()) {
        return Ok(None);
    }
    let share_keys: Vec<[u8; 32]> = match (&shared, &plans) {
        (Some((lookup, item)), Some(plans)) => (0..plans.len())
            .map(|index| lookup.piece_key(item, index))
            .collect(),
        _ => Vec::new(),
    };
    if let (Some((lookup, _)), Some(plans)) = (&shared, &plans) {
        let (lookup, keys) = (lookup.clone(), share_keys.clone());
        // Stops at the first piece not there.
        let found = pool
            .run_ahead(move || {
                Ok(keys
                    .iter()
                    .map(|key| lookup.get(key).map(|e| e.features))
                    .collect::<Option<Vec<_>>>())
            })
            .await?;
        if let Some(features) = found {
            return Ok(Some(Made::EncodedParts(EncodedParts {
                plans: plans.clone(),
                features,
            })));
        }
    }
    let Some(plans) = plans else {
        let jobs = (0..count).map(|index| {
            let (plugin, media, plan, config) =
                (plugin.clone(), media.clone(), plan.clone(), config.clone());
            pool.run(move || plugin.preprocess_part(&media, &plan, &config, index))
        });
        let parts = join_all(jobs)
            .await
            .into_iter()
            .collect::<Result<Vec<_>, _>>()?;
        plugin.check_parts_output(&parts)?;
        return Ok(Some(Made::Parts(parts)));
    };
    // Handed on one by one, the parts are held to the whole's output cap as they add up.
    let made_bytes = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let parts = plans
        .iter()
        .enumerate()
        .map(|(index, part_plan)| {
            let (plugin, media, plan, config, part_plan, made_bytes) = (
                plugin.clone(),
                media.clone(),
                plan.clone(),
                config.clone(),
                part_plan.clone(),
                made_bytes.clone(),
            );
            pool.start(move || {
                let index = index as u32;
                let started = std::time::Instant::now();
                let part =
                    plugin.preprocess_planned_part(&media, &plan, &config, index, &part_plan)?;
                tracing::debug!(index, took = ?started.elapsed(), "part made");
                let size = mmgate_host::tensor_bytes(&part);
                let total = made_bytes.fetch_add(size, std::sync::atomic::Ordering::Relaxed);
                plugin.check_output_size(total.saturating_add(size))?;
                Ok(part)
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Some(Made::Coming(Coming {
        plans,
        parts,
        share_keys,
    })))
}

/// The account of one item: the plugin, what the media is, the size/duration chosen, tokens, why
/// anything was cut, the tensors' shapes, and timings. Only the fields that apply to this kind of
/// media: no image sizes for audio, no duration for images.
pub fn report(plugin: &LoadedPlugin, processed: &Processed) -> serde_json::Map<String, Value> {
    let Processed {
        info,
        plan,
        made,
        timings,
        ..
    } = processed;
    let part_count = made.part_count();
    let tensors: &[Tensor] = match made {
        Made::Tensors(tensors) => tensors,
        Made::Encoded(known) => &known.tensors,
        _ => &[],
    };
    let choices: Value = serde_json::from_str(&plan.choices).unwrap_or(Value::Null);
    let size = |w: Option<u64>, h: Option<u64>| match (w, h) {
        (Some(w), Some(h)) => json!({"width": w, "height": h}),
        _ => Value::Null,
    };
    let ms = |d: Duration| (d.as_secs_f64() * 1e6).round() / 1e3;
    let report = json!({
        "plugin": {
            "name": plugin.name(),
            "version": plugin.descriptor().version,
            "sha256": plugin.sha256(),
        },
        "format": info.format,
        "original_size": size(info.width.map(u64::from), info.height.map(u64::from)),
        "resized_size": size(
            choices.get("width").and_then(Value::as_u64),
            choices.get("height").and_then(Value::as_u64),
        ),
        "duration_seconds": info.duration_seconds,
        "sample_rate": info.sample_rate,
        "channels": info.channels,
        "chunks": choices.get("chunks"),
        "frames": choices.get("frame_indices").and_then(Value::as_array).map(Vec::len),
        "tokens": plan.tokens,
        "reduced": plan.reduced,
        "reason": plan.reason,
        "choices": choices,
        // Made in parts on several instances at once (contract 0.4).
        "parts": (part_count > 0).then_some(part_count),
        // Handed on as each part was made (contract 0.5): `preprocess` below is the time to
        // plan and queue them, not to make them.
        "parts_streamed": matches!(made, Made::Coming(_)).then_some(true),
        "tensors": (!matches!(made, Made::Files(_))).then(|| tensors.iter().map(|t| json!({
            "name": t.name,
            "dtype": t.dtype.name(),
            "shape": t.shape,
        })).collect::<Vec<_>>()),
        "files": match made { Made::Files(f) => Some(f), _ => None }.map(|f| f.files.iter().map(|file| json!({
            "mime_type": file.mime_type,
            "bytes": file.data.len(),
        })).collect::<Vec<_>>()),
        // Another replica's encoder output was used: nothing was preprocessed or encoded here.
        "shared_encoding": matches!(made, Made::Encoded(_) | Made::EncodedParts(_)).then_some(true),
        "time_ms": {
            "probe": ms(timings.probe),
            "plan": ms(timings.plan),
            "preprocess": ms(timings.preprocess),
            "total": ms(timings.probe + timings.plan + timings.preprocess),
        },
    });
    match report {
        Value::Object(fields) => fields.into_iter().filter(|(_, v)| !v.is_null()).collect(),
        _ => serde_json::Map::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn descriptor(processor_types: &[&str]) -> Descriptor {
        Descriptor {
            name: "p".into(),
            version: "0.1.0".into(),
            description: String::new(),
            modalities: vec!["image".into()],
            mime_types: vec!["image/png".into()],
            processor_types: processor_types.iter().map(|t| (*t).to_owned()).collect(),
        }
    }

    #[test]
    fn a_plugin_serves_the_processors_it_lists_in_any_variant() {
        let qwen = processor_types(
            r#"{"image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen2VLProcessor"}"#,
        );
        assert_eq!(qwen, ["Qwen2VLImageProcessor", "Qwen2VLProcessor"]);
        assert!(serves_processor(
            &descriptor(&["Qwen2VLImageProcessor"]),
            &qwen
        ));
        assert!(!serves_processor(
            &descriptor(&["GotOcr2ImageProcessor"]),
            &qwen
        ));
        // A plugin listing nothing serves any model; a config naming nothing is served by any plugin.
        assert!(serves_processor(&descriptor(&[]), &qwen));
        assert!(serves_processor(
            &descriptor(&["GotOcr2ImageProcessor"]),
            &[]
        ));
        assert!(processor_types("not json").is_empty());
        // Qwen3-VL's video processor, from its own file inside the config.
        let qwen3 = processor_types(
            r#"{"image_processor_type": "Qwen2VLImageProcessorFast",
                "video_preprocessor_config": {"video_processor_type": "Qwen3VLVideoProcessor"}}"#,
        );
        assert_eq!(qwen3, ["Qwen2VLImageProcessor", "Qwen3VLVideoProcessor"]);
        assert!(serves_processor(
            &descriptor(&["Qwen3VLVideoProcessor"]),
            &qwen3
        ));
    }

    /// A request's items are queued a worker's worth at a time: another request's item, queued
    /// just after the first of six, runs second on a one-worker pool, not seventh; results come in
    /// order and the first error ends the request.
    #[tokio::test]
    async fn a_request_holds_at_most_its_fair_share_of_the_queue() {
        let pool = PluginPool::new(1, 64, 0).unwrap();
        let ran = Arc::new(std::sync::Mutex::new(Vec::new()));
        let call = |name: String| {
            let ran = ran.clone();
            pool.run(move || {
                ran.lock().unwrap().push(name.clone());
                Ok(name)
            })
        };
        let large = at_most_at_once(pool.threads(), (0..6).map(|i| call(format!("a{i}"))));
        let small = at_most_at_once(pool.threads(), std::iter::once(call("b".into())));
        let (large, small) = tokio::join!(large, small);
        assert_eq!(large.unwrap(), ["a0", "a1", "a2", "a3", "a4", "a5"]);
        assert_eq!(small.unwrap(), ["b"]);
        assert_eq!(ran.lock().unwrap()[..2], ["a0", "b"]);

        let failing = (0..4).map(|i| async move { if i == 2 { Err(i) } else { Ok(i) } });
        assert_eq!(at_most_at_once(2, failing).await, Err(2));
    }
}
