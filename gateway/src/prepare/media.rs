//! A request's media resolved within its limits: each part's bytes (inline, fetched, uploaded) or
//! embeddings, checked before anything is decoded or fetched, and the plugin that takes each.

use std::sync::Arc;

use base64::Engine as _;
use http::StatusCode;
use mmgate_host::{LoadedPlugin, Media};
use mmgate_inference::engine::MediaItem;
use mmgate_inference::families::MediaKind;
use mmgate_inference::prompt::PromptModel;
use tracing::Instrument as _;

use super::documents::{Document, Resolved, text_tokens};
use super::errors::{invalid, too_large, unsupported_media};
use super::items::{ChatServices, Item, ItemInput};
use super::plugin_output::named_tensor;
use crate::access::as_attribute;
use crate::config::RequestLimits;
use crate::error::ApiError;
use crate::media::documents::TextLayer;
use crate::media::pipeline;
use crate::media::sniff::sniff_mime_type;
use crate::wire::openai::{self, ByteSource, MediaSource, PayloadError};
use crate::wire::torchfile;

/// Every media part's bytes, within the limits (checked before decoding or fetching), and the
/// plugin that takes each, which must handle the kind the part claims and the model must take it;
/// a document probed, its pages made later ([`super::documents::into_items`]).
pub(crate) async fn resolve_media(
    runtime: &PromptModel,
    sources: Vec<(Option<MediaKind>, MediaSource)>,
    text_bytes: usize,
    services: &ChatServices<'_>,
) -> Result<Vec<Resolved>, ApiError> {
    let mut tally = MediaTally::new(services.limits, sources.len())?.with_text(text_bytes);
    let mut resolved = Vec::with_capacity(sources.len());
    let mut items = Vec::with_capacity(sources.len());
    for (index, (kind, source)) in sources.into_iter().enumerate() {
        if let Some(kind) = kind {
            // A kind the model does not take is media it cannot use (415), as the README's table says.
            runtime
                .placeholder(kind)
                .map_err(|e| unsupported_media(format!("media item {index}: {e}")))?;
        }
        let limit = tally.limit(kind);
        let (data, declared) = match source {
            MediaSource::Embeddings { embeddings, grid } => {
                let kind = kind.unwrap_or(MediaKind::Image);
                let input = embeddings_item(runtime, kind, &embeddings, grid.as_deref())
                    .map_err(|e| invalid("messages", format!("media item {index}: {e}")))?;
                items.push((
                    index,
                    Resolved::Item(Item {
                        kind,
                        input: ItemInput::Embeddings(input),
                        page: None,
                    }),
                ));
                continue;
            }
            MediaSource::Bytes(source) => {
                let from = match &source {
                    ByteSource::Base64 { .. } | ByteSource::NotBase64 => "inline",
                    ByteSource::Url(_) => "url",
                    ByteSource::File(_) => "upload",
                };
                let span = tracing::info_span!(
                    "media.read",
                    mmgate.item = as_attribute(index),
                    mmgate.source = from,
                    mmgate.bytes = tracing::field::Empty,
                );
                let read = source_bytes(index, source, limit, services)
                    .instrument(span.clone())
                    .await?;
                span.record("mmgate.bytes", as_attribute(read.0.len()));
                read
            }
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
    let count = resolved.len();
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
        .instrument(tracing::info_span!(
            "plugin.choose",
            mmgate.items = as_attribute(count)
        ))
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
        if kind.is_none() && plugin.descriptor().modalities.iter().any(|m| m == DOCUMENT) {
            let mut document = document(index, runtime, plugin, media, services).await?;
            tally.add_pages(index, document.pages.len())?;
            let resolved = match services.documents.text {
                TextLayer::None => Resolved::Document(document),
                TextLayer::WithPages => {
                    document.texts = document.read_text(index, services).await?;
                    tally.add_text(index, &document.texts)?;
                    document.text_tokens = text_tokens(runtime, &document.texts).await?;
                    Resolved::Document(document)
                }
                TextLayer::Only => {
                    let texts = document.read_text(index, services).await?;
                    tally.add_text(index, &texts)?;
                    Resolved::Text(texts)
                }
            };
            items.push((index, resolved));
            continue;
        }
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
            Resolved::Item(Item {
                kind,
                input: ItemInput::Plugin {
                    plugin,
                    media: Arc::new(media),
                },
                page: None,
            }),
        ));
    }
    items.sort_by_key(|(index, _)| *index);
    Ok(items.into_iter().map(|(_, item)| item).collect())
}

/// The modality of documents (PDFs): their pages are the model's images.
const DOCUMENT: &str = "document";

/// Media item `index`, a document, probed: refused when the model takes no images (its pages) or
/// it is over the document limits.
async fn document(
    index: usize,
    runtime: &PromptModel,
    plugin: Arc<LoadedPlugin>,
    media: Media,
    services: &ChatServices<'_>,
) -> Result<Document, ApiError> {
    runtime.placeholder(MediaKind::Image).map_err(|_| {
        unsupported_media(format!(
            "media item {index}: model {} does not take documents (their pages are images)",
            runtime.name
        ))
    })?;
    let limit = services.limits.max_document_bytes;
    if media.data.len() > limit {
        return Err(too_large(index, media.data.len(), limit));
    }
    Document::probe(index, plugin, Arc::new(media), services).await
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
pub(crate) fn embeddings_item(
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
/// route): how many items, each one's bytes by kind, all images' bytes together, documents' pages
/// together, and the text documents add to the request's own.
pub struct MediaTally<'a> {
    limits: &'a RequestLimits,
    image_bytes: usize,
    pages: usize,
    text_bytes: usize,
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
            pages: 0,
            text_bytes: 0,
        })
    }

    /// The request's own text is `bytes` (already within `limits.max_text_bytes`): documents' text
    /// layers count with it.
    pub fn with_text(mut self, bytes: usize) -> Self {
        self.text_bytes = bytes;
        self
    }

    /// Item `index`, a document whose text layer is `texts`: the request's text with it stays
    /// within `limits.max_text_bytes`.
    pub fn add_text(&mut self, index: usize, texts: &[String]) -> Result<(), ApiError> {
        self.text_bytes += texts.iter().map(String::len).sum::<usize>();
        let max = self.limits.max_text_bytes;
        if self.text_bytes > max {
            return Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "text_too_large",
                format!(
                    "media item {index}: with the document's text the request's text is {} bytes; at most {max} are allowed (limits.max_text_bytes)",
                    self.text_bytes
                ),
            ));
        }
        Ok(())
    }

    /// Item `index`, a document of `pages` pages: each page is an image to render and encode, so
    /// the request's documents together have at most `limits.max_document_pages`.
    pub fn add_pages(&mut self, index: usize, pages: usize) -> Result<(), ApiError> {
        self.pages += pages;
        let max = self.limits.max_document_pages;
        if self.pages > max {
            return Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "document_too_long",
                format!(
                    "media item {index}: the request's documents have {} pages together; at most {max} are allowed (limits.max_document_pages)",
                    self.pages
                ),
            ));
        }
        Ok(())
    }

    /// The most bytes an item of `kind` may have; an item of unknown kind (an upload, until its
    /// bytes say what it is) gets the largest, and is checked again once known.
    pub fn limit(&self, kind: Option<MediaKind>) -> usize {
        match kind {
            Some(MediaKind::Image) => self.limits.max_image_bytes,
            Some(MediaKind::Audio) => self.limits.max_audio_bytes,
            Some(MediaKind::Video) => self.limits.max_video_bytes,
            None => self
                .limits
                .max_video_bytes
                .max(self.limits.max_document_bytes),
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
