//! Opening a PDF and rendering one of its pages at an exact pixel size, with hayro.

use hayro::hayro_interpret::InterpreterSettings;
use hayro::hayro_interpret::util::TransformExt as _;
use hayro::hayro_syntax::{DecryptionError, LoadPdfError, Pdf};
use hayro::kurbo::Affine;
use hayro::vello_cpu::color::palette::css::WHITE;
use hayro::vello_cpu::{Pixmap, RasterizerSettings, RenderContext, Resources, TargetInit};
use hayro::{RenderCache, RenderSettings, render_into};
use mmgate_plugin_sdk::imageops::RgbImage;
use mmgate_plugin_sdk::{PluginError, PluginResult};

use crate::{MAX_PAGES, PageRender};

/// A page's size in points, as it is shown (its crop box, rotation applied).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PageSize {
    pub width: f32,
    pub height: f32,
}

/// Where the header may start: the PDF specification lets readers accept up to 1024 bytes of
/// junk before it, as viewers do.
const HEADER_WINDOW: usize = 1024;

/// The PDF in `data`, its cross-reference table and page tree read (no content stream). A file
/// is a PDF by its `%PDF-` header, whatever it was called or declared as.
pub fn open(data: Vec<u8>) -> PluginResult<Pdf> {
    let window = &data[..data.len().min(HEADER_WINDOW)];
    if !window.windows(5).any(|w| w == b"%PDF-") {
        return Err(PluginError::invalid("not a PDF: no %PDF- header"));
    }
    Pdf::new(data).map_err(|e| match e {
        LoadPdfError::Decryption(DecryptionError::PasswordProtected) => {
            PluginError::invalid("the PDF is encrypted with a password: send it decrypted")
        }
        LoadPdfError::Decryption(other) => PluginError::unsupported(format!(
            "the PDF is encrypted and its encryption cannot be read ({other:?})"
        )),
        LoadPdfError::Invalid => PluginError::invalid(
            "the PDF is malformed: its cross-reference table or page tree cannot be read",
        ),
    })
}

/// Each page's size in points, in order; a document without pages, or with more than
/// [`MAX_PAGES`], is refused.
pub fn page_sizes(pdf: &Pdf) -> PluginResult<Vec<PageSize>> {
    let pages = pdf.pages();
    if pages.is_empty() {
        return Err(PluginError::invalid("the PDF has no pages"));
    }
    if pages.len() > MAX_PAGES {
        return Err(PluginError::limit(format!(
            "the PDF has {} pages; at most {MAX_PAGES} are read",
            pages.len()
        )));
    }
    Ok(pages
        .iter()
        .map(|page| {
            let (width, height) = page.render_dimensions();
            // hayro keeps each side at least one point; a box of NaN or infinite size is a point.
            let side = |s: f32| if s.is_finite() { s.max(1.0) } else { 1.0 };
            PageSize {
                width: (side(width) * 10.0).round() / 10.0,
                height: (side(height) * 10.0).round() / 10.0,
            }
        })
        .collect())
}

/// Page `render.page` of `pdf` drawn on white at exactly `render.width` x `render.height`
/// pixels: the page's box scaled to fill it (each axis on its own, so the size the plan chose is
/// the size made, to the pixel).
pub fn render_page(pdf: &Pdf, render: &PageRender) -> PluginResult<RgbImage> {
    let index = render.page as usize - 1;
    let page = pdf
        .pages()
        .get(index)
        .ok_or_else(|| PluginError::invalid(format!("page {} does not exist", render.page)))?;
    let side = |pixels: u32| {
        u16::try_from(pixels)
            .map_err(|_| PluginError::limit("a page is at most 65535 pixels a side"))
    };
    let (width, height) = (side(render.width)?, side(render.height)?);
    let (points_wide, points_high) = page.render_dimensions();
    let transform = Affine::scale_non_uniform(
        f64::from(width) / f64::from(points_wide.max(1.0)),
        f64::from(height) / f64::from(points_high.max(1.0)),
    ) * page.initial_transform(true).to_kurbo();
    let cache = RenderCache::new();
    let mut context = RenderContext::new(width, height);
    render_into(
        page,
        &cache,
        &InterpreterSettings::default(),
        &RenderSettings::default(),
        &mut context,
        transform,
    );
    context.flush();
    let mut pixmap = Pixmap::new(width, height);
    context.render_with(
        &mut pixmap,
        &mut Resources::default(),
        RasterizerSettings {
            target_init: TargetInit::Clear(WHITE),
            ..Default::default()
        },
    );
    // Drawn over opaque white, every pixel is opaque: premultiplied RGBA is plain RGBA.
    let data = pixmap
        .data_as_u8_slice()
        .chunks_exact(4)
        .flat_map(|px| [px[0], px[1], px[2]])
        .collect();
    Ok(RgbImage {
        width: usize::from(width),
        height: usize::from(height),
        data,
    })
}
