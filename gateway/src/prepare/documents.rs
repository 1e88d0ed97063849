//! A request's documents made into the pages its model sees: each document probed by its plugin
//! (pages and their sizes; `limits.max_document_pages` for them all), its pages sized under the
//! request-wide budget as the model's images are planned ([`crate::media::documents`]), and each
//! kept page rendered in the document plugin's sandbox at exactly that size, as a PNG the image
//! plugin then takes like any image.

use std::sync::Arc;

use mmgate_host::{Budget, CallError, LoadedPlugin, Media, MediaInfo, TokenPlan};
use mmgate_inference::families::MediaKind;
use mmgate_inference::prompt::PromptModel;
use serde_json::json;
use tracing::Instrument as _;

use super::errors::{context_exceeded, internal, plugin_failed, unsupported_media};
use super::items::{ChatServices, Item, ItemInput};
use crate::access::as_attribute;
use crate::error::ApiError;
use crate::media::budget::BudgetError;
use crate::media::documents::{
    PageOf, PlannedPage, Planning, Sized, SizingError, page_text, size_pages,
};
use crate::media::pipeline;

/// A document among a request's media, probed: its pages not yet made.
pub(crate) struct Document {
    pub plugin: Arc<LoadedPlugin>,
    pub media: Arc<Media>,
    /// Each page's size in points, as shown.
    pub pages: Vec<[f32; 2]>,
    /// Each page's text layer, when it goes before the page's image (`documents.text`), and the
    /// tokens each makes in the prompt.
    pub texts: Vec<String>,
    pub text_tokens: Vec<usize>,
}

impl Document {
    /// Media item `index` (a document), probed by its plugin: its pages' count and sizes (the
    /// caller bounds the request's pages together before any is rendered).
    pub async fn probe(
        index: usize,
        plugin: Arc<LoadedPlugin>,
        media: Arc<Media>,
        services: &ChatServices<'_>,
    ) -> Result<Self, ApiError> {
        let probing = (plugin.clone(), media.clone());
        let info = services
            .pool
            .run_ahead(move || probing.0.probe(&probing.1))
            .await
            .map_err(|e| plugin_failed(index, &e))?;
        let pages = page_sizes(&info).ok_or_else(|| {
            internal(format!(
                "media item {index}: the document plugin gave no page sizes"
            ))
        })?;
        Ok(Self {
            plugin,
            media,
            pages,
            texts: Vec::new(),
            text_tokens: Vec::new(),
        })
    }

    /// Each page's text layer (media item `index`), read in the sandbox (the caller counts it as
    /// the request's text, within `limits.max_text_bytes`).
    pub async fn read_text(
        &self,
        index: usize,
        services: &ChatServices<'_>,
    ) -> Result<Vec<String>, ApiError> {
        let pages: Vec<_> = (1..=self.pages.len())
            .map(|page| json!({"page": page, "width": 1, "height": 1}))
            .collect();
        let plan = TokenPlan {
            tokens: 0,
            reduced: false,
            reason: String::new(),
            choices: json!({"pages": pages, "text": true, "pixels": false}).to_string(),
        };
        let (plugin, media) = (self.plugin.clone(), self.media.clone());
        let read = services
            .pool
            .run(move || plugin.reduce(&media, &plan, "{}"))
            .await
            .map_err(|e| plugin_failed(index, &e))?;
        let texts: Vec<String> = read
            .files
            .into_iter()
            .map(|file| String::from_utf8_lossy(&file.data).into_owned())
            .collect();
        Ok(texts)
    }
}

/// The tokens each page's text (`texts`, already within `limits.max_text_bytes`) makes where the
/// prompt has it, counted by `prompt`'s tokenizer off the threads that serve connections.
pub(crate) async fn text_tokens(
    prompt: &PromptModel,
    texts: &[String],
) -> Result<Vec<usize>, ApiError> {
    let (text, pages) = (prompt.text.clone(), texts.to_vec());
    tokio::task::spawn_blocking(move || {
        (1..)
            .zip(&pages)
            .map(|(page, t)| text.encode(&page_text(page, t)).map(|ids| ids.len()))
            .collect::<Result<Vec<_>, _>>()
    })
    .await
    .map_err(|e| internal(e.to_string()))?
    .map_err(|e| internal(format!("counting a document's text: {e}")))
}

/// The page sizes a document plugin's probe gives (`page-sizes`, a JSON list of `[w, h]`).
fn page_sizes(info: &MediaInfo) -> Option<Vec<[f32; 2]>> {
    let (_, sizes) = info.extra.iter().find(|(key, _)| key == "page-sizes")?;
    serde_json::from_str(sizes)
        .ok()
        .filter(|s: &Vec<_>| !s.is_empty())
}

/// A media part resolved: an item, a document whose pages become items, or a document read as
/// its pages' text alone (`documents.text = "only"`).
pub(crate) enum Resolved {
    Item(Item),
    Document(Document),
    Text(Vec<String>),
}

impl Resolved {
    /// How many prompt items the part makes: a document one per page.
    pub fn item_count(&self) -> usize {
        match self {
            Self::Item(_) => 1,
            Self::Document(document) => document.pages.len(),
            Self::Text(_) => 0,
        }
    }
}

/// The request's items, each document's pages sized within `budget` (the tokens the plugins'
/// items share) and rendered, and how many pages were left out (the last ones).
pub(crate) async fn into_items(
    processor_config: &str,
    services: &ChatServices<'_>,
    resolved: Vec<Resolved>,
    budget: usize,
) -> Result<(Vec<Item>, usize), ApiError> {
    if !resolved.iter().any(|r| matches!(r, Resolved::Document(_))) {
        let items = resolved.into_iter().filter_map(|r| match r {
            Resolved::Item(item) => Some(item),
            Resolved::Document(_) | Resolved::Text(_) => None,
        });
        return Ok((items.collect(), 0));
    }
    let image = pipeline::choose_plugin(
        &services.registry,
        &Media {
            data: Vec::new(),
            mime_type: Some("image/png".into()),
        },
        Some(MediaKind::Image.name()),
        processor_config,
    )
    .cloned()
    .ok_or_else(|| unsupported_media("no loaded image plugin renders documents' pages".into()))?;

    let sized = size(processor_config, services, &resolved, &image, budget).await?;
    let renders = page_renders(&resolved, &sized.pages);
    // The first pages that fit may leave a whole later document out: refused, as its part in
    // the request would have no item (and a client would not see a document silently vanish).
    let unread = resolved.iter().enumerate().position(|(part, r)| {
        matches!(r, Resolved::Document(_)) && !renders.iter().any(|render| render.part == part)
    });
    if let Some(part) = unread {
        return Err(context_exceeded(format!(
            "the context fits the request's first {} document pages at the legibility floor, which leaves media part {part} (a document) out entirely: send fewer pages",
            renders.len()
        )));
    }
    let mut pngs = render(services, &renders).await?.into_iter();

    let mut items = Vec::with_capacity(renders.len() + resolved.len());
    let mut next = 0;
    for (part, resolved) in resolved.into_iter().enumerate() {
        let document = match resolved {
            Resolved::Item(item) => {
                items.push(item);
                continue;
            }
            Resolved::Document(document) => document,
            Resolved::Text(_) => continue,
        };
        let total = document.pages.len() as u32;
        let first = next;
        while renders.get(next).is_some_and(|r| r.part == part) {
            next += 1;
        }
        let kept = &renders[first..next];
        let left_out = (kept.len() < document.pages.len()).then(|| {
            Arc::from(format!(
                "pages {} to {total} left out: the context fits the first {} at the legibility floor (documents.overflow = \"first_pages\")",
                kept.len() + 1,
                kept.len()
            ))
        });
        for render in kept {
            let png = pngs
                .next()
                .ok_or_else(|| internal("a page was not rendered"))?;
            items.push(Item {
                kind: MediaKind::Image,
                input: ItemInput::Plugin {
                    plugin: image.clone(),
                    media: Arc::new(png),
                },
                page: Some(PageOf {
                    document: part,
                    page: render.page,
                    pages: total,
                    shrunk: render.shrunk,
                    left_out: left_out.clone(),
                    text_chars: document
                        .texts
                        .get(render.page as usize - 1)
                        .map(|t| t.chars().count()),
                    text_tokens: document.text_tokens.get(render.page as usize - 1).copied(),
                }),
            });
        }
    }
    Ok((items, sized.left_out))
}

/// Each of `renders`, on the plugin pool (a request's pages at most as many at once as the pool
/// has workers, so other requests' items get in between), as PNGs in order.
async fn render(
    services: &ChatServices<'_>,
    renders: &[PageRender],
) -> Result<Vec<Media>, ApiError> {
    let rendering = renders.iter().map(|render| {
        let (plugin, media) = (render.plugin.clone(), render.media.clone());
        let (item, [width, height]) = (render.item, render.size);
        let plan = TokenPlan {
            tokens: 0,
            reduced: false,
            reason: String::new(),
            choices: json!({"pages": [{"page": render.page, "width": width, "height": height}]})
                .to_string(),
        };
        let span = tracing::info_span!(
            "document.render",
            mmgate.item = as_attribute(item),
            mmgate.page = render.page,
            mmgate.width = width,
            mmgate.height = height,
        );
        async move {
            let made = services
                .pool
                .run(move || plugin.reduce(&media, &plan, "{}"))
                .await
                .map_err(|e| plugin_failed(item, &e))?;
            made.files
                .into_iter()
                .next()
                .ok_or_else(|| internal(format!("media item {item}: a page was not rendered")))
        }
        .instrument(span)
    });
    pipeline::at_most_at_once(services.pool.threads(), rendering).await
}

/// Media item `index`, the PDF in `data`, probed by the document plugin, for a model whose engine
/// takes media as they come.
pub(crate) async fn probe_pdf(
    index: usize,
    data: Vec<u8>,
    services: &ChatServices<'_>,
) -> Result<Document, ApiError> {
    let media = Media {
        data,
        mime_type: Some("application/pdf".into()),
    };
    let plugin = pipeline::choose_plugin(&services.registry, &media, None, "{}")
        .filter(|p| p.descriptor().modalities.iter().any(|m| m == "document"))
        .cloned()
        .ok_or_else(|| {
            unsupported_media(format!("media item {index}: no loaded plugin renders PDFs"))
        })?;
    Document::probe(index, plugin, Arc::new(media), services).await
}

/// Every page of `document` (media item `index`) rendered at `documents.scale` as a PNG, for an
/// engine's own processor (no engine takes PDFs).
pub(crate) async fn pages_for_engine(
    index: usize,
    document: &Document,
    services: &ChatServices<'_>,
) -> Result<Vec<Media>, ApiError> {
    let renders: Vec<PageRender> = (1..)
        .zip(&document.pages)
        .map(|(page, points)| PageRender {
            part: 0,
            item: index,
            plugin: document.plugin.clone(),
            media: document.media.clone(),
            page,
            size: services.documents.nominal_size(*points),
            shrunk: false,
        })
        .collect();
    render(services, &renders).await
}

/// One page to render: whose, which, at what size, and whether the budget made it smaller.
struct PageRender {
    part: usize,
    item: usize,
    plugin: Arc<LoadedPlugin>,
    media: Arc<Media>,
    page: u32,
    size: [u32; 2],
    shrunk: bool,
}

/// The kept pages of every document, in order, each with its planned size.
fn page_renders(resolved: &[Resolved], sizes: &[PlannedPage]) -> Vec<PageRender> {
    let mut sizes = sizes.iter();
    let mut renders = Vec::with_capacity(sizes.len());
    let mut item = 0;
    for (part, resolved) in resolved.iter().enumerate() {
        if let Resolved::Document(document) = resolved {
            for page in 1..=document.pages.len() {
                let Some(&PlannedPage { size, shrunk }) = sizes.next() else {
                    return renders;
                };
                renders.push(PageRender {
                    part,
                    item: item + page - 1,
                    plugin: document.plugin.clone(),
                    media: document.media.clone(),
                    page: page as u32,
                    size,
                    shrunk,
                });
            }
        }
        item += resolved.item_count();
    }
    renders
}

/// Every page sized within `budget` beside the request's other plugin items (probed here for
/// their plans), on the plugin pool.
async fn size(
    processor_config: &str,
    services: &ChatServices<'_>,
    resolved: &[Resolved],
    image: &Arc<LoadedPlugin>,
    budget: usize,
) -> Result<Sized, ApiError> {
    let mut planning = Vec::new();
    let mut others = Vec::new();
    let mut item_of = Vec::new();
    let mut item = 0;
    for resolved in resolved {
        match resolved {
            Resolved::Item(Item {
                input: ItemInput::Plugin { plugin, media },
                ..
            }) => {
                planning.push(Planning::Other);
                others.push((plugin.clone(), media.clone()));
                item_of.push(item);
            }
            Resolved::Item(_) | Resolved::Text(_) => {}
            Resolved::Document(document) => {
                for (page, points) in document.pages.iter().enumerate() {
                    planning.push(Planning::Page(*points));
                    item_of.push(item + page);
                }
            }
        }
        item += resolved.item_count();
    }
    let (config, image, settings) = (
        processor_config.to_owned(),
        image.clone(),
        services.documents.clone(),
    );
    let budget = u32::try_from(budget).unwrap_or(u32::MAX);
    let sized = services
        .pool
        .run_ahead(move || {
            Ok((|| {
                // The other items' probes, in planning order (pages have none).
                let mut infos = Vec::with_capacity(planning.len());
                let mut others = others.into_iter();
                for (item, p) in planning.iter().enumerate() {
                    let Some((plugin, media)) = matches!(p, Planning::Other)
                        .then(|| others.next())
                        .flatten()
                    else {
                        infos.push(None);
                        continue;
                    };
                    let info = plugin
                        .probe(&media)
                        .map_err(|error| BudgetError::Plugin { item, error })?;
                    infos.push(Some((plugin, info)));
                }
                let plan_image = |width, height, max_tokens| {
                    image.plan(
                        &MediaInfo::image("png", width, height),
                        Budget { max_tokens },
                        &config,
                    )
                };
                let plan_other = |i: usize, max_tokens| match &infos[i] {
                    Some((plugin, info)) => plugin.plan(info, Budget { max_tokens }, &config),
                    None => Err(CallError::Host(format!("item {i} was not probed"))),
                };
                size_pages(&settings, &planning, budget, plan_image, plan_other)
            })())
        })
        .instrument(tracing::info_span!("document.size"))
        .await
        .map_err(|e| plugin_failed(0, &e))?;
    let sized = sized.map_err(|e| match e {
        SizingError::Overflow { .. } | SizingError::Budget(BudgetError::TooSmall { .. }) => {
            context_exceeded(e.to_string())
        }
        SizingError::Budget(BudgetError::Plugin { item, error }) => {
            plugin_failed(item_of.get(item).copied().unwrap_or(item), &error)
        }
    })?;
    Ok(sized)
}
