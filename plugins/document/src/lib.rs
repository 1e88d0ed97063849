//! The built-in document plugin: reads a PDF's pages and renders them, inside the sandbox, with
//! `hayro` (a PDF renderer written in Rust; the standard 14 fonts and CMaps are its own embedded
//! data, nothing comes from the host). A document becomes images: the gateway plans each page as
//! an image of the model's family, this plugin renders each page directly at the size that plan
//! chose (never at 72 dpi and then resized), and the image plugin makes the model's tensors of it.
//!
//! - `probe` reads the cross-reference table and the page tree, no content stream: the page count
//!   and each page's size in points, which the gateway checks against its limits and plans with;
//! - `plan` checks the pages and sizes the gateway chose (a processor config with
//!   `mmgate_document_pages`), or, without them, chooses every page at twice its size in points;
//! - `reduce` renders the planned pages, each as a PNG at exactly its planned size, and, when the
//!   plan asks for it (`text`), gives each page's text layer before its picture (`text/plain`);
//!   a plan with `pixels: false` gives only the text.

mod render;
mod text;

use mmgate_plugin_sdk::*;
use serde::{Deserialize, Serialize};

pub use render::{PageSize, open, page_sizes, render_page};
pub use text::page_text;

/// Most pages a document may have for this plugin to read it at all; the gateway's own limit
/// (`limits.max_document_pages`) is lower and applies after the probe.
pub const MAX_PAGES: usize = 10_000;
/// Longest side, in pixels, a page may be rendered at.
pub const MAX_SIDE: u32 = 8192;
/// Most pixels one rendered page may have (its RGBA canvas is 4 bytes each, inside the sandbox's
/// memory).
pub const MAX_PIXELS: u64 = 4096 * 4096;
/// Without the gateway's sizes, pages are rendered at this many pixels per point (144 dpi)...
const DEFAULT_SCALE: f32 = 2.0;
/// ...their longest side at most this.
const DEFAULT_LONG_SIDE: f32 = 2048.0;

/// One page to render: its number (1-based) and the size in pixels it is rendered at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageRender {
    pub page: u32,
    pub width: u32,
    pub height: u32,
}

/// What a plan chose: the pages, in the order they are rendered, and what of each is made.
#[derive(Debug, Serialize, Deserialize)]
pub struct Choices {
    pub pages: Vec<PageRender>,
    /// Each page's text layer, before its picture.
    #[serde(default)]
    pub text: bool,
    /// Each page's picture (a PNG).
    #[serde(default = "yes")]
    pub pixels: bool,
}

fn yes() -> bool {
    true
}

/// The part of the processor config this plugin reads: the pages and sizes the gateway planned.
#[derive(Debug, Deserialize)]
struct DocumentConfig {
    #[serde(default)]
    mmgate_document_pages: Option<Vec<PageRender>>,
    #[serde(default)]
    mmgate_document_text: bool,
    #[serde(default = "yes")]
    mmgate_document_pixels: bool,
}

/// The plugin; public so its code can also run natively (parity and speed benchmarks).
pub struct DocumentPlugin;

impl Plugin for DocumentPlugin {
    fn describe() -> Descriptor {
        Descriptor::new(
            "document",
            env!("CARGO_PKG_VERSION"),
            "read PDF pages and render each at the size the gateway planned, inside the sandbox",
            &["document"],
            &["application/pdf"],
            &[],
        )
    }

    fn probe(media: Media) -> PluginResult<MediaInfo> {
        let pdf = open(media.data)?;
        let sizes = page_sizes(&pdf)?;
        let mut info = MediaInfo::new("document", "pdf");
        info.width = sizes.first().map(|s| s.width.ceil() as u32);
        info.height = sizes.first().map(|s| s.height.ceil() as u32);
        info.frame_count = Some(sizes.len() as u64);
        let sizes: Vec<[f32; 2]> = sizes.iter().map(|s| [s.width, s.height]).collect();
        let sizes = serde_json::to_string(&sizes)
            .map_err(|e| PluginError::internal(format!("page sizes: {e}")))?;
        info.extra = vec![
            ("pdf-version".into(), format!("{:?}", pdf.version())),
            ("page-sizes".into(), sizes),
        ];
        Ok(info)
    }

    /// The pages the gateway planned (each checked against the document and the size limits), or
    /// every page at twice its size in points when it planned none.
    fn plan(info: MediaInfo, _budget: Budget, config: ProcessorConfig) -> PluginResult<TokenPlan> {
        let config: DocumentConfig = parse_config(&config)?;
        let pages = info.frame_count.unwrap_or(0);
        let chosen = match config.mmgate_document_pages {
            Some(chosen) => chosen,
            None => default_renders(&info)?,
        };
        for render in &chosen {
            check_render(render, pages)?;
        }
        let reason = format!("{} of {pages} pages rendered", chosen.len());
        let choices = Choices {
            pages: chosen,
            text: config.mmgate_document_text,
            pixels: config.mmgate_document_pixels,
        };
        // A document's tokens are its pages', which the image plugin plans and counts.
        TokenPlan::new(0, false, reason, &choices)
    }

    fn preprocess(
        _media: Media,
        _plan: TokenPlan,
        _config: ProcessorConfig,
    ) -> PluginResult<Vec<Tensor>> {
        Err(PluginError::unsupported(
            "a document is made as images: the gateway hands each rendered page to the image plugin",
        ))
    }

    fn reduce(
        media: Media,
        plan: TokenPlan,
        _config: ProcessorConfig,
    ) -> PluginResult<ReducedItem> {
        let choices: Choices = plan.choices()?;
        let pdf = open(media.data)?;
        let count = pdf.pages().len() as u64;
        let mut files = Vec::with_capacity(choices.pages.len());
        for render in &choices.pages {
            check_render(render, count)?;
            if choices.text {
                files.push(Media {
                    data: page_text(&pdf, render.page)?.into_bytes(),
                    mime_type: Some("text/plain; charset=utf-8".into()),
                });
            }
            if choices.pixels {
                files.push(files::png(&render_page(&pdf, render)?)?);
            }
        }
        let timestamps = vec![0.0; files.len()];
        Ok(ReducedItem { files, timestamps })
    }
}

/// Every page at [`DEFAULT_SCALE`] pixels per point, its long side at most [`DEFAULT_LONG_SIDE`].
fn default_renders(info: &MediaInfo) -> PluginResult<Vec<PageRender>> {
    let sizes = info
        .extra
        .iter()
        .find(|(key, _)| key == "page-sizes")
        .map(|(_, sizes)| serde_json::from_str::<Vec<[f32; 2]>>(sizes))
        .transpose()
        .map_err(|e| PluginError::internal(format!("page sizes do not parse: {e}")))?
        .unwrap_or_default();
    Ok(sizes
        .iter()
        .zip(1u32..)
        .map(|(&[w, h], page)| {
            let scale = DEFAULT_SCALE.min(DEFAULT_LONG_SIDE / w.max(h).max(1.0));
            PageRender {
                page,
                width: ((w * scale).round() as u32).max(1),
                height: ((h * scale).round() as u32).max(1),
            }
        })
        .collect())
}

fn check_render(render: &PageRender, pages: u64) -> PluginResult<()> {
    if render.page == 0 || u64::from(render.page) > pages {
        return Err(PluginError::invalid(format!(
            "page {} does not exist: the document has {pages}",
            render.page
        )));
    }
    let pixels = u64::from(render.width) * u64::from(render.height);
    if render.width == 0
        || render.height == 0
        || render.width.max(render.height) > MAX_SIDE
        || pixels > MAX_PIXELS
    {
        return Err(PluginError::limit(format!(
            "page {} at {}x{} pixels: a page is rendered at most {MAX_SIDE} pixels a side and {MAX_PIXELS} pixels in all",
            render.page, render.width, render.height
        )));
    }
    Ok(())
}

#[cfg(target_arch = "wasm32")]
mmgate_plugin_sdk::export_plugin!(DocumentPlugin);
