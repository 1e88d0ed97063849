//! InternVL's dynamic tiling (`GotOcr2ImageProcessor` with `crop_to_patches`, which InternVL 2.5 and
//! 3's transformers checkpoints use and vLLM runs through transformers): the image is resized to
//! fill the grid of square tiles (`min_patches` to `max_patches` of them) whose aspect ratio is
//! closest to its own, cut into those tiles, and followed by a thumbnail of the whole when there is
//! more than one. Each tile costs `image_seq_length` tokens.
//!
//! The grid depends only on the image's aspect ratio, so no resize that keeps it cuts tiles. Under
//! a budget the plan picks the grid of fewer tiles closest in aspect ratio and sends the image
//! squashed to exactly that grid's canvas, the size the server's processor resizes it to anyway,
//! for which the same rule picks exactly that grid.

use mmgate_plugin_sdk::imageops::tiling::{Grid, candidate_grids, optimal_grid};
use mmgate_plugin_sdk::imageops::{Filter, Normalize, RgbImage};
use mmgate_plugin_sdk::*;
use serde::Deserialize;
use serde_json::Value;

use super::config::{BaseConfig, SizeField, positive, read, square_tile};
use super::{ImageProcessor, boxed};
use crate::choices::{Choices, tokens_u32};

pub fn make(config: &Value) -> PluginResult<Box<dyn ImageProcessor>> {
    boxed(InternVl::from_config(config))
}

#[derive(Debug, Deserialize)]
struct Config {
    #[serde(flatten)]
    base: BaseConfig,
    size: Option<SizeField>,
    /// Tiling, and the tiles it may make.
    crop_to_patches: Option<bool>,
    min_patches: Option<usize>,
    max_patches: Option<usize>,
    image_seq_length: Option<usize>,
}

pub struct InternVl {
    /// Whether the image is tiled at all (else one resized tile).
    pub crop_to_patches: bool,
    pub min_patches: usize,
    pub max_patches: usize,
    /// A tile's side.
    pub tile: usize,
    pub tokens_per_tile: usize,
    pub filter: Filter,
    pub normalize: Normalize,
}

impl InternVl {
    fn from_config(config: &Value) -> PluginResult<Self> {
        let config: Config = read(config)?;
        let tile = square_tile(&config.size, 448, "InternVL")?;
        let min_patches = positive("min_patches", config.min_patches.unwrap_or(1))?;
        let max_patches = positive("max_patches", config.max_patches.unwrap_or(12))?;
        if min_patches > max_patches || max_patches > 64 {
            return Err(PluginError::unsupported(format!(
                "processor config: need min_patches <= max_patches <= 64 (min {min_patches}, \
                 max {max_patches})"
            )));
        }
        Ok(InternVl {
            crop_to_patches: config.crop_to_patches.unwrap_or(true),
            min_patches,
            max_patches,
            tile,
            tokens_per_tile: positive("image_seq_length", config.image_seq_length.unwrap_or(256))?,
            filter: config.base.filter(Filter::Bicubic)?,
            normalize: config
                .base
                .normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        })
    }

    /// transformers' `get_number_of_image_patches`: the grid, `None` when the image is one tile.
    fn grid(&self, width: usize, height: usize) -> Option<Grid> {
        if !self.crop_to_patches || self.max_patches <= 1 {
            return None;
        }
        let grid = optimal_grid(
            width as u32,
            height as u32,
            self.tile as u32,
            self.min_patches as u32,
            self.max_patches as u32,
        );
        (grid.tiles() > 1).then_some(grid)
    }

    /// Tiles made of an image tiled as `grid`: its tiles and the thumbnail, or one.
    fn tiles(grid: Option<Grid>) -> usize {
        grid.map_or(1, |g| g.tiles() as usize + 1)
    }

    /// The grid of fewest tiles' worth of tokens within the budget whose aspect ratio is closest to
    /// the image's (on a tie, the one of more tiles); `None`: one tile.
    fn fewer_tiles(&self, width: usize, height: usize, budget: u32) -> PluginResult<Option<Grid>> {
        let affordable = budget as usize / self.tokens_per_tile;
        let aspect = width as f64 / height as f64;
        let mut best: Option<(f64, Grid)> = None;
        if self.crop_to_patches && self.max_patches > 1 && affordable >= 3 {
            // A grid of n > 1 tiles costs n + 1 (its thumbnail).
            let most = (affordable - 1).min(self.max_patches) as u32;
            for grid in candidate_grids(self.min_patches as u32, most) {
                if grid.tiles() < 2 {
                    continue;
                }
                let diff = (aspect - f64::from(grid.columns) / f64::from(grid.rows)).abs();
                if best.is_none_or(|(least, _)| diff <= least) {
                    best = Some((diff, grid));
                }
            }
        }
        if let Some((_, grid)) = best {
            return Ok(Some(grid));
        }
        if affordable >= 1 && self.min_patches <= 1 {
            return Ok(None);
        }
        let least = if self.min_patches <= 1 {
            1
        } else {
            self.min_patches + 1
        };
        Err(PluginError::over_budget(
            tokens_u32(least * self.tokens_per_tile)?,
            budget,
            format!(
                "this model's images are at least {least} tiles of {} tokens",
                self.tokens_per_tile
            ),
        ))
    }
}

impl ImageProcessor for InternVl {
    fn plan(
        &self,
        width: usize,
        height: usize,
        _jpeg: bool,
        budget: u32,
    ) -> PluginResult<TokenPlan> {
        let native = self.grid(width, height);
        let cost = |grid: Option<Grid>| Self::tiles(grid) * self.tokens_per_tile;
        let budget_tokens = budget as usize;
        let (grid, reduced) = if cost(native) <= budget_tokens {
            (native, false)
        } else {
            (self.fewer_tiles(width, height, budget)?, true)
        };
        let tokens = cost(grid);
        let (columns, rows) = grid.map_or((1, 1), |g| (g.columns as usize, g.rows as usize));
        let canvas = (columns * self.tile, rows * self.tile);
        let tiles = Self::tiles(grid);
        let layout = match grid {
            Some(_) => format!(
                "{columns}x{rows} tiles of {0}x{0} and a thumbnail",
                self.tile
            ),
            None => format!("one {0}x{0} tile", self.tile),
        };
        let reason = if reduced {
            format!(
                "{width}x{height} squashed to {}x{}: {layout} ({tokens} tokens) to fit the \
                 budget of {budget}; as it came it would cost {}",
                canvas.0,
                canvas.1,
                cost(native)
            )
        } else {
            format!("{width}x{height}: {layout}, {tokens} tokens")
        };
        let choices = Choices {
            crops: Some(tiles),
            squashed: reduced.then_some([canvas.0, canvas.1]),
            ..Choices::sized(width, height)
        };
        TokenPlan::new(tokens_u32(tokens)?, reduced, reason, &choices)
    }

    fn whole_resize(&self, choices: &Choices) -> Option<(usize, usize, Filter)> {
        choices.squashed.map(|[w, h]| (w, h, self.filter))
    }

    /// The image the model's server is sent for a reduced plan: squashed to its grid's canvas.
    fn reduced_image(&self, image: RgbImage, choices: &Choices) -> PluginResult<RgbImage> {
        choices.squash(image, self.filter)
    }

    /// `pixel_values` [tiles, 3, T, T]: the grid's tiles left to right, top to bottom, then the
    /// thumbnail (of the squashed image when the plan was reduced, as the server sees it).
    fn preprocess(&self, image: RgbImage, choices: &Choices) -> PluginResult<Vec<Tensor>> {
        let image = match choices.squashed {
            Some([w, h]) => image.into_resized(w, h, self.filter),
            None => image,
        };
        let grid = self.grid(image.width, image.height);
        let made = Self::tiles(grid);
        if Some(made) != choices.crops {
            return Err(PluginError::internal(format!(
                "the plan has {:?} tiles, the image makes {made}",
                choices.crops
            )));
        }
        let tile = self.tile;
        let mut tiles = Vec::with_capacity(made);
        match grid {
            Some(grid) => {
                let (columns, rows) = (grid.columns as usize, grid.rows as usize);
                let canvas = image.resize(columns * tile, rows * tile, self.filter);
                for row in 0..rows {
                    for column in 0..columns {
                        let (left, top) = ((column * tile) as isize, (row * tile) as isize);
                        tiles.push(canvas.crop(left, top, tile, tile));
                    }
                }
                tiles.push(image.into_resized(tile, tile, self.filter));
            }
            None => tiles.push(image.into_resized(tile, tile, self.filter)),
        }
        let mut values = Vec::with_capacity(made * 3 * tile * tile * 4);
        for tile_image in &tiles {
            values.extend(self.normalize.planar_le_bytes(tile_image));
        }
        Ok(vec![
            Tensor::from_f32_bytes("pixel_values", &[made, 3, tile, tile], values)?,
            Tensor::from_i64("num_patches", &[1], &[made as i64])?,
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// InternVL 3's settings, with 4 tokens a tile.
    fn internvl3() -> InternVl {
        InternVl {
            crop_to_patches: true,
            min_patches: 1,
            max_patches: 12,
            tile: 448,
            tokens_per_tile: 4,
            filter: Filter::Bicubic,
            normalize: Normalize {
                rescale: 1.0 / 255.0,
                mean: [0.485, 0.456, 0.406],
                std: [0.229, 0.224, 0.225],
            },
        }
    }

    #[test]
    fn tiles_follow_the_closest_aspect_ratio() {
        let p = internvl3();
        // 4:3 is closest to 4x3 tiles, and the thumbnail.
        let plan = p.plan(640, 480, false, 1000).unwrap();
        assert_eq!(plan.tokens, (12 + 1) * 4);
        assert!(!plan.reduced);
        // A square image smaller than a tile's half-area stays one tile.
        assert_eq!(p.plan(256, 256, false, 1000).unwrap().tokens, 4);
    }

    /// Under a budget: the grid of fewer tiles closest in aspect ratio, and the image squashed to
    /// its canvas, which the rule tiles exactly so.
    #[test]
    fn a_budget_squashes_the_image_to_a_smaller_grid() {
        let p = internvl3();
        for (width, height, budget) in [(640, 480, 40), (1200, 300, 16), (300, 1000, 12)] {
            let plan = p.plan(width, height, false, budget).unwrap();
            assert!(plan.reduced && plan.tokens <= budget, "{}", plan.reason);
            let choices: Choices = plan.choices().unwrap();
            let [w, h] = choices.squashed.unwrap();
            assert_eq!(InternVl::tiles(p.grid(w, h)) * 4, plan.tokens as usize);
        }
        // 640x480 under 8 tokens: one tile (two tiles and a thumbnail would be 12).
        let plan = p.plan(640, 480, false, 8).unwrap();
        assert_eq!(plan.tokens, 4);
        assert!(p.plan(640, 480, false, 3).is_err());
    }
}
