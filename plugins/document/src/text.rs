//! A page's text layer: its content stream interpreted (nothing rasterised), every glyph's
//! Unicode text and place collected, then laid out as lines in reading order (top to bottom, left
//! to right within a line). A scanned page has none.

use hayro::hayro_interpret::font::GlyphRun;
use hayro::hayro_interpret::hayro_cmap::BfString;
use hayro::hayro_interpret::util::RectExt as _;
use hayro::hayro_interpret::{
    BlendMode, ClipPath, Context, Device, DrawMode, DrawProps, Image, ImageDrawProps,
    InterpreterCache, InterpreterSettings, SoftMask, interpret_page,
};
use hayro::hayro_syntax::Pdf;
use hayro::kurbo::{Affine, BezPath, Point};
use mmgate_plugin_sdk::{PluginError, PluginResult};

/// Most characters of text a page gives: a hostile page may show millions of glyphs.
const MAX_PAGE_CHARS: usize = 200_000;

/// One glyph's text where it stands on the page (y down).
struct Placed {
    text: String,
    x: f64,
    y: f64,
}

/// Collects the glyphs a page shows.
#[derive(Default)]
struct Glyphs {
    placed: Vec<Placed>,
    chars: usize,
}

impl<'a> Device<'a> for Glyphs {
    fn draw_path(&mut self, _: &BezPath, _: DrawProps<'a>, _: &DrawMode) {}
    fn push_clip_path(&mut self, _: &ClipPath) {}
    fn push_transparency_group(&mut self, _: f32, _: Option<SoftMask<'a>>, _: BlendMode) {}
    fn draw_image(&mut self, _: Image<'a, '_>, _: ImageDrawProps<'a>) {}
    fn pop_clip(&mut self) {}
    fn pop_transparency_group(&mut self) {}

    fn draw_glyph_run(&mut self, run: &GlyphRun<'_, 'a>, props: DrawProps<'a>, _: &DrawMode) {
        for glyph in run.glyphs() {
            if self.chars >= MAX_PAGE_CHARS {
                return;
            }
            let text = match glyph.as_unicode() {
                Some(BfString::Char(c)) => c.to_string(),
                Some(BfString::String(s)) => s,
                None => continue,
            };
            let origin = props.transform * glyph.transform() * Point::ORIGIN;
            if !(origin.x.is_finite() && origin.y.is_finite()) {
                continue;
            }
            self.chars += text.chars().count();
            self.placed.push(Placed {
                text,
                x: origin.x,
                y: origin.y,
            });
        }
    }
}

/// Page `page` (1-based) of `pdf`'s text, as lines in reading order.
pub fn page_text(pdf: &Pdf, page: u32) -> PluginResult<String> {
    let index = page as usize - 1;
    let page = pdf
        .pages()
        .get(index)
        .ok_or_else(|| PluginError::invalid(format!("page {page} does not exist")))?;
    // Reading order is the page's own, before its /Rotate turns it for display: only y flipped
    // (down the page), so a rotated page reads as it was written.
    let flip = Affine::scale_non_uniform(1.0, -1.0);
    let bbox = flip.transform_rect_bbox(page.intersected_crop_box().to_kurbo());
    let cache = InterpreterCache::new();
    let mut context = Context::new(
        flip,
        bbox,
        &cache,
        page.xref(),
        InterpreterSettings::default(),
    );
    let mut glyphs = Glyphs::default();
    interpret_page(page, &mut context, &mut glyphs);
    Ok(lay_out(glyphs.placed))
}

/// Glyphs as lines: sorted top to bottom, a glyph whose baseline is within `tolerance` of a
/// line's joins it; within a line, left to right, a gap of more than two and a half times the
/// line's usual advance reads as a space (most PDFs show their spaces as glyphs; tables and
/// columns leave gaps). The tolerance is most of the page's usual advance between glyphs (about
/// half an em): glyph sizes alone do not say an em, a font's units do.
fn lay_out(mut placed: Vec<Placed>) -> String {
    placed.sort_by(|a, b| a.y.total_cmp(&b.y).then(a.x.total_cmp(&b.x)));
    let tolerance = usual_advance(&placed).map_or(1.0, |a| a * 0.8);
    let mut lines: Vec<(f64, Vec<Placed>)> = Vec::new();
    for glyph in placed {
        match lines.last_mut() {
            Some((y, line)) if (glyph.y - *y).abs() <= tolerance => line.push(glyph),
            _ => lines.push((glyph.y, vec![glyph])),
        }
    }
    let mut out = String::new();
    for (_, mut line) in lines {
        line.sort_by(|a, b| a.x.total_cmp(&b.x));
        let gap = usual_advance(&line).map_or(f64::INFINITY, |a| a * 2.5);
        let mut last: Option<&Placed> = None;
        for glyph in &line {
            if let Some(previous) = last
                && glyph.x - previous.x > gap
                && !previous.text.ends_with(' ')
                && !glyph.text.starts_with(' ')
            {
                out.push(' ');
            }
            out.push_str(&glyph.text);
            last = Some(glyph);
        }
        let trimmed = out.trim_end_matches(' ').len();
        out.truncate(trimmed);
        out.push('\n');
    }
    out.trim_end().to_owned()
}

/// The median step from one glyph to the next along a row (glyphs sorted by y, then x).
fn usual_advance(glyphs: &[Placed]) -> Option<f64> {
    let mut steps: Vec<f64> = glyphs
        .windows(2)
        .filter(|w| w[0].y == w[1].y)
        .map(|w| w[1].x - w[0].x)
        .filter(|step| *step > 0.0)
        .collect();
    if steps.is_empty() {
        return None;
    }
    let middle = steps.len() / 2;
    let (_, median, _) = steps.select_nth_unstable_by(middle, f64::total_cmp);
    Some(*median)
}
