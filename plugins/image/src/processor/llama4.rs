//! Llama 4's image processor (`Llama4ImageProcessor`), planned and counted for an engine that
//! makes the tensors: the image is fitted, without distortion, onto the best canvas of square
//! tiles (`size`, up to `max_patches` of them) and cut into them, beside a global view of the
//! whole when there is more than one tile; each costs the tower's patches of a tile, pixel-shuffled.
//!
//! The canvas is transformers' `get_best_fit`: of the canvases the image can be scaled up to fill
//! (limited by its tighter side), the one needing the least upscaling, else the one needing the
//! least downscaling; the smallest of those on a tie. Under a budget the plan picks a canvas of
//! fewer tiles closest in aspect ratio and sends the image squashed to exactly that canvas, which
//! then fits it at scale 1, the least upscaling, smallest of all that do.

use mmgate_plugin_sdk::imageops::{Filter, RgbImage};
use mmgate_plugin_sdk::*;
use serde::Deserialize;
use serde_json::Value;

use super::config::{BaseConfig, SizeField, positive, read, square_tile};
use super::{ImageProcessor, boxed};
use crate::choices::{Choices, tokens_u32};

/// Llama 4's processor (the defaults are Llama 4 Scout's). The resampling is the engine's: only
/// the tokens are planned here.
pub fn make(config: &Value) -> PluginResult<Box<dyn ImageProcessor>> {
    boxed(Llama4::from_config(config))
}

#[derive(Debug, Deserialize)]
struct Config {
    #[serde(flatten)]
    base: BaseConfig,
    size: Option<SizeField>,
    max_patches: Option<usize>,
    resize_to_max_canvas: Option<bool>,
    /// The tower's pixel shuffle (the model's, which its family adds with the tower's patch size).
    pixel_shuffle_ratio: Option<f64>,
}

pub struct Llama4 {
    /// A tile's side.
    pub tile: usize,
    pub max_tiles: usize,
    pub resize_to_max_canvas: bool,
    /// Tokens of a tile (and of the global view).
    pub tokens_per_tile: usize,
}

impl Llama4 {
    fn from_config(config: &Value) -> PluginResult<Self> {
        let config: Config = read(config)?;
        let tile = square_tile(&config.size, 336, "Llama 4")?;
        let patch = config.base.patch_edge(14)?;
        let ratio = config.pixel_shuffle_ratio.unwrap_or(0.5);
        if !(ratio > 0.0 && ratio <= 1.0) || tile < patch {
            return Err(PluginError::unsupported(format!(
                "processor config: tiles of {tile} px in patches of {patch} px, shuffled by {ratio}"
            )));
        }
        // transformers' and vLLM's `(tile // patch)² // round(1 / ratio²)`.
        let shuffle = (1.0 / (ratio * ratio)).round() as usize;
        Ok(Llama4 {
            tile,
            max_tiles: positive("max_patches", config.max_patches.unwrap_or(16))?,
            resize_to_max_canvas: config.resize_to_max_canvas.unwrap_or(false),
            tokens_per_tile: positive("tokens per tile", (tile / patch).pow(2) / shuffle.max(1))?,
        })
    }

    /// transformers' `find_supported_resolutions`, in its order, as `(rows, columns)` of tiles:
    /// grouped by aspect ratio in the order each ratio is first seen, from the most tiles down.
    fn canvases(&self) -> Vec<(usize, usize)> {
        let mut groups: Vec<(f64, Vec<(usize, usize)>)> = Vec::new();
        for tiles in (1..=self.max_tiles).rev() {
            for rows in (1..=tiles).filter(|f| tiles.is_multiple_of(*f)) {
                let columns = tiles / rows;
                let ratio = rows as f64 / columns as f64;
                match groups.iter_mut().find(|(r, _)| *r == ratio) {
                    Some((_, group)) => group.push((rows, columns)),
                    None => groups.push((ratio, vec![(rows, columns)])),
                }
            }
        }
        groups.into_iter().flat_map(|(_, group)| group).collect()
    }

    /// transformers' `get_best_fit` (in torch's float32) for a `width`×`height` image: the canvas
    /// as `(rows, columns)` of tiles.
    fn best_fit(&self, width: usize, height: usize) -> (usize, usize) {
        let canvases = self.canvases();
        let tile = self.tile as f32;
        let scales: Vec<f32> = canvases
            .iter()
            .map(|&(rows, columns)| {
                let scale_h = rows as f32 * tile / height as f32;
                let scale_w = columns as f32 * tile / width as f32;
                if scale_h > scale_w { scale_w } else { scale_h }
            })
            .collect();
        let up = scales.iter().copied().filter(|&s| s >= 1.0);
        let chosen = if scales.iter().any(|&s| s >= 1.0) {
            if self.resize_to_max_canvas {
                up.fold(f32::MIN, f32::max)
            } else {
                up.fold(f32::MAX, f32::min)
            }
        } else {
            scales.iter().copied().fold(f32::MIN, f32::max)
        };
        let mut best = canvases[0];
        let mut least_area = usize::MAX;
        for (&canvas, &scale) in canvases.iter().zip(&scales) {
            // torch's argmin: the first of the smallest.
            if scale == chosen && canvas.0 * canvas.1 < least_area {
                (best, least_area) = (canvas, canvas.0 * canvas.1);
            }
        }
        best
    }

    fn tokens(&self, (rows, columns): (usize, usize)) -> usize {
        let tiles = rows * columns;
        (if tiles > 1 { tiles + 1 } else { 1 }) * self.tokens_per_tile
    }
}

impl ImageProcessor for Llama4 {
    fn plan(
        &self,
        width: usize,
        height: usize,
        _jpeg: bool,
        budget: u32,
    ) -> PluginResult<TokenPlan> {
        let native = self.best_fit(width, height);
        let budget_tokens = budget as usize;
        let (grid, squashed) = if self.tokens(native) <= budget_tokens {
            (native, None)
        } else {
            let aspect = width as f64 / height as f64;
            let mut best: Option<(f64, (usize, usize))> = None;
            for canvas in self.canvases() {
                if self.tokens(canvas) > budget_tokens {
                    continue;
                }
                let diff = (aspect - canvas.1 as f64 / canvas.0 as f64).abs();
                let more = |b: &(f64, (usize, usize))| {
                    diff < b.0 || (diff == b.0 && canvas.0 * canvas.1 > b.1.0 * b.1.1)
                };
                if best.as_ref().is_none_or(more) {
                    best = Some((diff, canvas));
                }
            }
            let Some((_, canvas)) = best else {
                return Err(PluginError::over_budget(
                    tokens_u32(self.tokens_per_tile)?,
                    budget,
                    format!(
                        "one tile of this model's images costs {} tokens",
                        self.tokens_per_tile
                    ),
                ));
            };
            let size = [canvas.1 * self.tile, canvas.0 * self.tile];
            (canvas, Some(size))
        };
        let tokens = self.tokens(grid);
        let (rows, columns) = grid;
        let layout = if rows * columns > 1 {
            format!(
                "{rows}x{columns} tiles (rows x columns) of {0}x{0} and a global view",
                self.tile
            )
        } else {
            format!("one {0}x{0} tile", self.tile)
        };
        let reason = match squashed {
            Some([w, h]) => format!(
                "{width}x{height} squashed to {w}x{h}: {layout}, {tokens} tokens, to fit the \
                 budget of {budget}; as it came it would cost {}",
                self.tokens(native)
            ),
            None => format!("{width}x{height}: {layout}, {tokens} tokens"),
        };
        let choices = Choices {
            crops: Some(rows * columns),
            squashed,
            tile_grid: Some([rows, columns]),
            ..Choices::sized(width, height)
        };
        TokenPlan::new(tokens_u32(tokens)?, squashed.is_some(), reason, &choices)
    }

    fn whole_resize(&self, _choices: &Choices) -> Option<(usize, usize, Filter)> {
        None
    }

    /// The image the model's server is sent for a reduced plan: squashed to its canvas (the
    /// server resizes it again, so the filter is only this step's).
    fn reduced_image(&self, image: RgbImage, choices: &Choices) -> PluginResult<RgbImage> {
        choices.squash(image, Filter::Bilinear)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama4(max_tiles: usize) -> Llama4 {
        Llama4 {
            tile: 224,
            max_tiles,
            resize_to_max_canvas: false,
            tokens_per_tile: 4,
        }
    }

    /// transformers' docstring examples.
    #[test]
    fn canvases_and_fits_follow_transformers() {
        let p = llama4(4);
        assert_eq!(
            p.canvases(),
            [
                (1, 4),
                (2, 2),
                (1, 1),
                (4, 1),
                (1, 3),
                (3, 1),
                (1, 2),
                (2, 1)
            ]
        );
        // 200x300 (h x w) upscales by 1.12 to 224x448 (smaller than 672x224's 1.12).
        assert_eq!(p.best_fit(300, 200), (1, 2));
        // A large 2:1 image: the least downscaling (0.224, which 1x2, 2x2 and 1x4 tie on), the
        // smallest canvas.
        assert_eq!(p.best_fit(2000, 1000), (1, 2));
        assert_eq!(p.tokens((1, 1)), 4);
        assert_eq!(p.tokens((1, 2)), 12);
    }

    #[test]
    fn a_budget_squashes_the_image_to_a_canvas_of_fewer_tiles() {
        let p = llama4(16);
        let native = p.plan(1600, 1200, false, 10_000).unwrap();
        assert!(!native.reduced);
        for budget in [40, 20, 12] {
            let plan = p.plan(1600, 1200, false, budget).unwrap();
            assert!(plan.reduced && plan.tokens <= budget, "{}", plan.reason);
            let choices: Choices = plan.choices().unwrap();
            let [w, h] = choices.squashed.unwrap();
            let [rows, columns] = choices.tile_grid.unwrap();
            assert_eq!(p.best_fit(w, h), (rows, columns));
        }
        assert!(p.plan(1600, 1200, false, 3).is_err());
    }
}
