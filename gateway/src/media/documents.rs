//! Documents as the images a model sees: how a PDF's pages are sized under a request's budget.
//!
//! Each page is planned as an image of the model's family would be, from the size it would be
//! rendered at with room to spare (`documents.scale` pixels per point, its long side at most
//! `documents.max_long_side`), sharing the request-wide budget with every other item (see
//! [`crate::media::budget`]). A page is shrunk no further than the legibility floor (its long side
//! `documents.min_long_side` pixels, or the page's own size if smaller): when even every page at
//! the floor does not fit, pages are left out, never made illegible, as `documents.overflow`
//! says. The document plugin then renders each page directly at the size its plan chose.

use std::cell::RefCell;
use std::collections::HashMap;

use mmgate_host::{CallError, PluginError, TokenPlan};
use serde::Deserialize;
use serde_json::Value;

use crate::media::budget::{self, BudgetError};

/// How documents become pages.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DocumentsConfig {
    /// Pixels per point a page is rendered at when the budget leaves room (2.0: 144 dpi).
    pub scale: f32,
    /// The longest side a page is rendered at, in pixels.
    pub max_long_side: u32,
    /// The legibility floor: the budget shrinks a page no further than this long side (pixels).
    pub min_long_side: u32,
    /// What happens when not every page fits the context even at the legibility floor.
    pub overflow: Overflow,
    /// A page's text layer in the prompt: `none`, `with_pages` (before each page's image) or
    /// `only` (the text alone, no images: a text PDF then costs a fraction of the tokens).
    pub text: TextLayer,
}

impl Default for DocumentsConfig {
    fn default() -> Self {
        Self {
            scale: 2.0,
            max_long_side: 2048,
            min_long_side: 768,
            overflow: Overflow::Refuse,
            text: TextLayer::None,
        }
    }
}

impl DocumentsConfig {
    pub fn validate(&self) -> anyhow::Result<()> {
        if !(self.scale.is_finite() && self.scale > 0.0 && self.scale <= 16.0) {
            anyhow::bail!("documents.scale must be above 0 and at most 16");
        }
        if self.max_long_side == 0 || self.max_long_side > 8192 {
            anyhow::bail!("documents.max_long_side must be 1 to 8192 pixels");
        }
        if self.min_long_side > self.max_long_side {
            anyhow::bail!("documents.min_long_side must be at most documents.max_long_side");
        }
        Ok(())
    }

    /// The size `page` (points) is rendered at with room to spare.
    pub fn nominal_size(&self, page: [f32; 2]) -> [u32; 2] {
        self.sizes(page).0
    }

    /// The size `page` (points) is rendered at with room to spare, and at the legibility floor.
    fn sizes(&self, page: [f32; 2]) -> ([u32; 2], [u32; 2]) {
        let [w, h] = page.map(|s| if s.is_finite() { s.max(1.0) } else { 1.0 });
        let long = w.max(h);
        let at = |long_side: f32| {
            let scale = long_side / long;
            [w, h].map(|s| ((s * scale).round() as u32).max(1))
        };
        let nominal_long = (long * self.scale).min(self.max_long_side as f32);
        let floor_long = nominal_long.min(self.min_long_side as f32);
        (at(nominal_long), at(floor_long))
    }
}

/// When a request's pages do not all fit the context at the legibility floor.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Overflow {
    /// Refuse the request (400), saying how many pages fit.
    #[default]
    Refuse,
    /// Keep the first pages that fit, and say so in `usage.media`.
    FirstPages,
}

/// Where a document's text layer goes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TextLayer {
    /// Not read: the pages' images alone.
    #[default]
    None,
    /// Each page's text before its image.
    WithPages,
    /// The pages' text alone.
    Only,
}

/// One item to plan: a page (its size in points), or any other item (its plugin plans it).
pub enum Planning {
    Page([f32; 2]),
    Other,
}

/// The request's plan: the pages kept (a prefix of the request's pages, in order) and the size
/// each is rendered at, and why pages were shrunk or left out.
#[derive(Debug, PartialEq, Eq)]
pub struct Sized {
    /// Each kept page, in order.
    pub pages: Vec<PlannedPage>,
    /// How many of the request's pages were left out (from the end).
    pub left_out: usize,
}

/// A kept page: the size it is rendered at, and whether the budget made it smaller than it
/// would be with room to spare.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedPage {
    pub size: [u32; 2],
    pub shrunk: bool,
}

/// Why pages could not be sized.
#[derive(Debug, thiserror::Error)]
pub enum SizingError {
    /// Not every page fits at the legibility floor and `documents.overflow` is `refuse`.
    #[error(
        "the request's {pages} document pages need at least {needed} tokens at the legibility floor (a long side of {floor} pixels) but {available} are left of the context: {fit} of them fit. Send fewer pages, or set documents.overflow = \"first_pages\" to keep the first pages that fit"
    )]
    Overflow {
        pages: usize,
        fit: usize,
        needed: u64,
        available: u32,
        floor: u32,
    },
    #[error(transparent)]
    Budget(#[from] BudgetError),
}

/// Sizes the request's pages within `budget` shared with its other items (`items`, in the order
/// they are planned). `plan_image(width, height, max_tokens)` is the model's image plan of a
/// `width` x `height` image; `plan_other(i, max_tokens)` the plan of other item `i` (its index in
/// `items`).
pub fn size_pages(
    config: &DocumentsConfig,
    items: &[Planning],
    budget: u32,
    plan_image: impl Fn(u32, u32, u32) -> Result<TokenPlan, CallError>,
    plan_other: impl Fn(usize, u32) -> Result<TokenPlan, CallError>,
) -> Result<Sized, SizingError> {
    // Documents' pages mostly share one size: each plan is asked once.
    let known: RefCell<HashMap<([u32; 2], u32), TokenPlan>> = RefCell::default();
    let image = |size: [u32; 2], max_tokens: u32| {
        let key = (size, max_tokens);
        if let Some(plan) = known.borrow().get(&key) {
            return Ok(plan.clone());
        }
        let plan = plan_image(size[0], size[1], max_tokens)?;
        known.borrow_mut().insert(key, plan.clone());
        Ok(plan)
    };
    let sizes: Vec<Option<([u32; 2], [u32; 2])>> = items
        .iter()
        .map(|item| match item {
            Planning::Page(points) => Some(config.sizes(*points)),
            Planning::Other => None,
        })
        .collect();
    // Each item's count of pages before it: a page is kept when that is below the pages kept.
    let ordinals: Vec<usize> = sizes
        .iter()
        .scan(0, |before, size| {
            let ordinal = *before;
            *before += usize::from(size.is_some());
            Some(ordinal)
        })
        .collect();
    let floor_tokens = |floor: [u32; 2]| image(floor, u32::MAX).map(|p| p.tokens);
    let (sizes_ref, ordinals_ref) = (&sizes, &ordinals);
    let (image_ref, floor_ref, other_ref) = (&image, &floor_tokens, &plan_other);
    let plan = |kept: usize| {
        move |i: usize, max_tokens: u32| match sizes_ref[i] {
            Some((nominal, floor)) => {
                if ordinals_ref[i] >= kept {
                    return Ok(nothing());
                }
                let floor = floor_ref(floor)?;
                if max_tokens < floor {
                    return Err(CallError::Plugin(PluginError::OverBudget(
                        mmgate_host::contract::OverBudget {
                            needed_tokens: floor,
                            budget_tokens: max_tokens,
                            message: "a page below the legibility floor".into(),
                        },
                    )));
                }
                image_ref(nominal, max_tokens)
            }
            None => other_ref(i, max_tokens),
        }
    };
    let pages = sizes.iter().filter(|s| s.is_some()).count();
    let planned = match budget::allocate(items.len(), budget, plan(pages)) {
        Ok(plans) => (plans, 0),
        Err(BudgetError::TooSmall { needed, available }) => {
            let fit = pages_that_fit(&sizes, items.len(), budget, &plan(pages))?;
            if config.overflow == Overflow::Refuse || fit == 0 {
                return Err(SizingError::Overflow {
                    pages,
                    fit,
                    needed,
                    available,
                    floor: config.min_long_side,
                });
            }
            (
                budget::allocate(items.len(), budget, plan(fit))?,
                pages - fit,
            )
        }
        Err(e) => return Err(e.into()),
    };
    let (plans, left_out) = planned;
    let kept = pages - left_out;
    let mut pages = Vec::with_capacity(kept);
    for (i, (plan, size)) in plans.iter().zip(&sizes).enumerate() {
        let Some((nominal, _)) = *size else { continue };
        if ordinals[i] < kept {
            let native =
                image(nominal, u32::MAX).map_err(|error| BudgetError::Plugin { item: i, error })?;
            let shrunk = plan.tokens < native.tokens;
            pages.push(PlannedPage {
                size: planned_size(plan).unwrap_or(nominal),
                shrunk,
            });
        }
    }
    Ok(Sized { pages, left_out })
}

/// A plan of no tokens: a page left out.
fn nothing() -> TokenPlan {
    TokenPlan {
        tokens: 0,
        reduced: true,
        reason: String::new(),
        choices: "{}".into(),
    }
}

/// The most pages (a prefix) whose floors fit `budget` beside the other items' cheapest plans.
fn pages_that_fit(
    sizes: &[Option<([u32; 2], [u32; 2])>],
    items: usize,
    budget: u32,
    plan: &impl Fn(usize, u32) -> Result<TokenPlan, CallError>,
) -> Result<usize, SizingError> {
    let cheapest = |i: usize| match plan(i, 0) {
        Ok(p) => Ok(u64::from(p.tokens)),
        Err(CallError::Plugin(PluginError::OverBudget(o))) => Ok(u64::from(o.needed_tokens)),
        Err(error) => Err(SizingError::Budget(BudgetError::Plugin { item: i, error })),
    };
    let mut used = 0u64;
    for i in (0..items).filter(|&i| sizes[i].is_none()) {
        used += cheapest(i)?;
    }
    let mut fit = 0;
    for i in (0..items).filter(|&i| sizes[i].is_some()) {
        used += cheapest(i)?;
        if used > u64::from(budget) {
            break;
        }
        fit += 1;
    }
    Ok(fit)
}

/// The size an image plan chose (its `width` and `height`), which a page is rendered at.
fn planned_size(plan: &TokenPlan) -> Option<[u32; 2]> {
    let choices: Value = serde_json::from_str(&plan.choices).ok()?;
    let side = |key: &str| {
        choices
            .get(key)
            .and_then(Value::as_u64)
            .and_then(|s| u32::try_from(s).ok())
    };
    Some([side("width")?, side("height")?])
}

/// Which page of which document an item is: what `usage.media` tells of it as one document.
#[derive(Debug, Clone)]
pub struct PageOf {
    /// The document's place among the request's media parts.
    pub document: usize,
    /// The page's number (1-based) and the document's page count.
    pub page: u32,
    pub pages: u32,
    /// Rendered smaller than with room to spare, to fit the budget.
    pub shrunk: bool,
    /// Why pages of the document were left out, when some were.
    pub left_out: Option<std::sync::Arc<str>>,
    /// The page's text layer before its image, when it is read: its characters, and the tokens
    /// it makes in the prompt (as [`page_text`] puts it there).
    pub text_chars: Option<usize>,
    pub text_tokens: Option<usize>,
}

/// How page `page`'s (1-based) text layer goes into the prompt, before the page's image or alone.
pub fn page_text(page: usize, text: &str) -> String {
    format!("Page {page}:\n{text}\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Qwen2-VL-like image plan: one token per 28x28 patch, shrunk by halves to fit.
    fn qwen_like(width: u32, height: u32, max_tokens: u32) -> Result<TokenPlan, CallError> {
        let (mut w, mut h) = (width, height);
        loop {
            let tokens = (w.div_ceil(28) * h.div_ceil(28)).max(1);
            if tokens <= max_tokens {
                return Ok(TokenPlan {
                    tokens,
                    reduced: (w, h) != (width, height),
                    reason: String::new(),
                    choices: serde_json::json!({"width": w, "height": h}).to_string(),
                });
            }
            if w <= 28 && h <= 28 {
                return Err(CallError::Plugin(PluginError::OverBudget(
                    mmgate_host::contract::OverBudget {
                        needed_tokens: tokens,
                        budget_tokens: max_tokens,
                        message: String::new(),
                    },
                )));
            }
            (w, h) = ((w / 2).max(1), (h / 2).max(1));
        }
    }

    fn no_other(_: usize, _: u32) -> Result<TokenPlan, CallError> {
        unreachable!("no other item")
    }

    const LETTER: [f32; 2] = [612.0, 792.0];

    #[test]
    fn pages_keep_their_room_to_spare_when_the_budget_allows() {
        let config = DocumentsConfig::default();
        let items = [Planning::Page(LETTER), Planning::Page(LETTER)];
        let sized = size_pages(&config, &items, 100_000, qwen_like, no_other).unwrap();
        let expected = PlannedPage {
            size: [1224, 1584],
            shrunk: false,
        };
        assert_eq!(sized.pages, vec![expected; 2]);
        assert_eq!(sized.left_out, 0);
    }

    #[test]
    fn pages_shrink_to_the_floor_before_any_is_left_out_and_then_overflow_decides() {
        let config = DocumentsConfig::default();
        let items: Vec<Planning> = (0..4).map(|_| Planning::Page(LETTER)).collect();
        // At the floor (593x768) a page is 22 x 28 = 616 tokens.
        let sized = size_pages(&config, &items, 4 * 700, qwen_like, no_other).unwrap();
        assert!(
            sized
                .pages
                .iter()
                .all(|p| p.shrunk && p.size[1] >= 768 && p.size[0] < 1224),
            "{sized:?}"
        );
        let refused = size_pages(&config, &items, 3 * 700, qwen_like, no_other).unwrap_err();
        assert!(
            matches!(
                refused,
                SizingError::Overflow {
                    pages: 4,
                    fit: 3,
                    ..
                }
            ),
            "{refused}"
        );
        assert!(refused.to_string().contains("documents.overflow"));
        let first = DocumentsConfig {
            overflow: Overflow::FirstPages,
            ..config
        };
        let sized = size_pages(&first, &items, 3 * 700, qwen_like, no_other).unwrap();
        assert_eq!((sized.pages.len(), sized.left_out), (3, 1));
    }

    #[test]
    fn other_items_share_the_budget_at_their_cheapest_before_pages_are_left_out() {
        let first = DocumentsConfig {
            overflow: Overflow::FirstPages,
            ..DocumentsConfig::default()
        };
        let items = [
            Planning::Other,
            Planning::Page(LETTER),
            Planning::Page(LETTER),
        ];
        let other = |_: usize, max_tokens: u32| qwen_like(2000, 2000, max_tokens);
        let sized = size_pages(&first, &items, 1000, qwen_like, other).unwrap();
        assert_eq!((sized.pages.len(), sized.left_out), (1, 1));
    }

    #[test]
    fn a_page_smaller_than_the_floor_is_its_own_floor_and_a_huge_box_is_scaled_down() {
        let config = DocumentsConfig::default();
        let (nominal, floor) = config.sizes([100.0, 50.0]);
        assert_eq!((nominal, floor), ([200, 100], [200, 100]));
        let (nominal, floor) = config.sizes([14_400.0, 200_000.0]);
        assert_eq!(nominal[1], 2048);
        assert_eq!(floor[1], 768);
        assert!(nominal[0] >= 1);
    }
}
