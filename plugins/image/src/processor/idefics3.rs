//! Idefics3's and SmolVLM's image splitting (`Idefics3ImageProcessor`, `SmolVLMImageProcessor`),
//! planned and counted for an engine that makes the tensors: the image is scaled so that its long
//! side is `size.longest_edge` (up or down), then cut into a grid of tiles of
//! `max_image_size.longest_edge` (the short side rounded up to whole tiles) beside a global view;
//! each tile and the global view cost `image_seq_len` tokens. A grid of one tile is no split: the
//! global view alone.
//!
//! The long side always makes the same number of tiles, so only the aspect ratio decides the
//! grid. Under a budget the plan takes fewer tiles along the short side by sending the image
//! squashed to an aspect ratio that makes them (the short side aimed at the middle of its last
//! tile, so the processor's rounding cannot tip it); it cannot go below one row of tiles.

use mmgate_plugin_sdk::imageops::{Filter, RgbImage};
use mmgate_plugin_sdk::*;
use serde::Deserialize;
use serde_json::Value;

use super::config::{SizeConfig, SizeField, positive, read};
use super::{ImageProcessor, boxed};
use crate::choices::{Choices, tokens_u32};

/// Idefics3's and SmolVLM's processor (the defaults are Idefics3-8B's). The resampling is the
/// engine's: only the tokens are planned here.
pub fn make(config: &Value) -> PluginResult<Box<dyn ImageProcessor>> {
    boxed(Idefics3::from_config(config))
}

#[derive(Debug, Deserialize)]
struct Config {
    do_image_splitting: Option<bool>,
    size: Option<SizeField>,
    /// A tile's side, as `longest_edge`.
    max_image_size: Option<SizeField>,
    /// Tokens of a tile (the processor's, which the family adds).
    image_seq_len: Option<usize>,
}

/// transformers' bound on the scaled image's sides (`MAX_IMAGE_SIZE`).
const MAX_IMAGE_SIDE: usize = 4096;

pub struct Idefics3 {
    pub splitting: bool,
    /// `size.longest_edge`: the long side every image is scaled to.
    pub longest_edge: usize,
    /// `max_image_size.longest_edge`: a tile's side.
    pub tile: usize,
    pub tokens_per_tile: usize,
}

impl Idefics3 {
    fn from_config(config: &Value) -> PluginResult<Self> {
        let config: Config = read(config)?;
        let longest = |field: &Option<SizeField>, name: &str, default: usize| match field {
            None => Ok(default),
            Some(SizeField::Dict(SizeConfig {
                longest_edge: Some(edge),
                ..
            })) => positive(name, *edge),
            Some(_) => Err(PluginError::unsupported(format!(
                "processor config: {name} needs longest_edge"
            ))),
        };
        Ok(Idefics3 {
            splitting: config.do_image_splitting.unwrap_or(true),
            longest_edge: longest(&config.size, "size", 4 * 364)?,
            tile: longest(&config.max_image_size, "max_image_size", 364)?,
            tokens_per_tile: positive("image_seq_len", config.image_seq_len.unwrap_or(169))?,
        })
    }

    /// transformers' `get_number_of_image_patches`: the grid as `(rows, columns)`, `None` when
    /// the image is not split.
    fn grid(&self, width: usize, height: usize) -> Option<(usize, usize)> {
        if !self.splitting {
            return None;
        }
        let (h, w) = rescale_to_max_len(height, width, self.longest_edge);
        let (h, w) = scale_below_upper_bound(h, w, MAX_IMAGE_SIDE);
        let (rows, columns) = (h.div_ceil(self.tile), w.div_ceil(self.tile));
        (rows > 1 || columns > 1).then_some((rows, columns))
    }

    fn tokens(&self, grid: Option<(usize, usize)>) -> usize {
        grid.map_or(1, |(rows, columns)| rows * columns + 1) * self.tokens_per_tile
    }

    /// The most rows of tiles along the short side (down to one) that fit the budget, and the
    /// size the image is squashed to for them.
    #[allow(clippy::type_complexity)]
    fn fewer_rows(
        &self,
        width: usize,
        height: usize,
        (rows, columns): (usize, usize),
        budget: u32,
    ) -> PluginResult<(Option<(usize, usize)>, Option<[usize; 2]>)> {
        let landscape = width >= height;
        let (long_tiles, short_tiles) = if landscape {
            (columns, rows)
        } else {
            (rows, columns)
        };
        let long_side = width.max(height);
        for short in (1..short_tiles).rev() {
            let grid = if landscape {
                (short, long_tiles)
            } else {
                (long_tiles, short)
            };
            if self.tokens(Some(grid)) > budget as usize {
                continue;
            }
            // The short side, once the long one is scaled to `longest_edge`, aimed at the middle
            // of its last tile; the image keeps its long side.
            let aim = (short * self.tile - self.tile / 2) as f64;
            let scaled_long = self.longest_edge.min(MAX_IMAGE_SIDE) as f64;
            let short_side = ((long_side as f64 * aim / scaled_long).round() as usize).max(1);
            let size = if landscape {
                [long_side, short_side]
            } else {
                [short_side, long_side]
            };
            if self.grid(size[0], size[1]) == Some(grid) {
                return Ok((Some(grid), Some(size)));
            }
        }
        let least = if landscape {
            (1, long_tiles)
        } else {
            (long_tiles, 1)
        };
        Err(PluginError::over_budget(
            tokens_u32(self.tokens(Some(least)))?,
            budget,
            format!(
                "a {width}x{height} image is at least {} tiles and a global view of {} tokens each",
                long_tiles, self.tokens_per_tile
            ),
        ))
    }
}

impl ImageProcessor for Idefics3 {
    fn plan(
        &self,
        width: usize,
        height: usize,
        _jpeg: bool,
        budget: u32,
    ) -> PluginResult<TokenPlan> {
        let native = self.grid(width, height);
        let budget_tokens = budget as usize;
        let (grid, squashed) = match native {
            Some(grid) if self.tokens(Some(grid)) > budget_tokens => {
                self.fewer_rows(width, height, grid, budget)?
            }
            _ if self.tokens(native) > budget_tokens => {
                return Err(PluginError::over_budget(
                    tokens_u32(self.tokens(native))?,
                    budget,
                    format!(
                        "this model's images cost at least {} tokens",
                        self.tokens(native)
                    ),
                ));
            }
            _ => (native, None),
        };
        let tokens = self.tokens(grid);
        let layout = match grid {
            Some((rows, columns)) => format!(
                "{rows}x{columns} tiles (rows x columns) of {0}x{0} and a global view",
                self.tile
            ),
            None => "one global view".to_owned(),
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
            crops: Some(grid.map_or(0, |(rows, columns)| rows * columns)),
            squashed,
            tile_grid: grid.map(|(rows, columns)| [rows, columns]),
            ..Choices::sized(width, height)
        };
        TokenPlan::new(tokens_u32(tokens)?, squashed.is_some(), reason, &choices)
    }

    fn whole_resize(&self, _choices: &Choices) -> Option<(usize, usize, Filter)> {
        None
    }

    /// The image the model's server is sent for a reduced plan: squashed to the planned grid's
    /// aspect ratio (the server scales it again, so the filter is only this step's).
    fn reduced_image(&self, image: RgbImage, choices: &Choices) -> PluginResult<RgbImage> {
        choices.squash(image, Filter::Bicubic)
    }
}

/// transformers' `_resize_output_size_rescale_to_max_len`: the long side becomes `max_len`, the
/// short one follows, rounded up to even. Returns (height, width).
fn rescale_to_max_len(height: usize, width: usize, max_len: usize) -> (usize, usize) {
    let aspect = width as f64 / height as f64;
    let even = |side: usize| side + side % 2;
    let (h, w) = if width >= height {
        (even((max_len as f64 / aspect) as usize), max_len)
    } else {
        (max_len, even((max_len as f64 * aspect) as usize))
    };
    (h.max(1), w.max(1))
}

/// transformers' `_resize_output_size_scale_below_upper_bound`. Returns (height, width).
fn scale_below_upper_bound(height: usize, width: usize, max_len: usize) -> (usize, usize) {
    let aspect = width as f64 / height as f64;
    let (h, w) = if width >= height && width > max_len {
        ((max_len as f64 / aspect) as usize, max_len)
    } else if height > width && height > max_len {
        (max_len, (max_len as f64 * aspect) as usize)
    } else {
        (height, width)
    };
    (h.max(1), w.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Idefics3-8B's settings.
    fn idefics3() -> Idefics3 {
        Idefics3 {
            splitting: true,
            longest_edge: 4 * 364,
            tile: 364,
            tokens_per_tile: 169,
        }
    }

    /// Grids worked by hand from transformers' `get_number_of_image_patches`.
    #[test]
    fn the_long_side_makes_four_tiles_the_short_side_follows() {
        let p = idefics3();
        // 640x480 → 1456x1092: 4 columns, 3 rows.
        assert_eq!(p.grid(640, 480), Some((3, 4)));
        // A small image is scaled up all the same.
        assert_eq!(p.grid(64, 64), Some((4, 4)));
        // 1000x300 → 1456x436 (436.8 floored, even): 2 rows.
        assert_eq!(p.grid(1000, 300), Some((2, 4)));
        assert_eq!(p.grid(300, 1000), Some((4, 2)));
        let whole = Idefics3 {
            splitting: false,
            ..idefics3()
        };
        assert_eq!(whole.grid(640, 480), None);
        assert_eq!(whole.plan(640, 480, false, 1000).unwrap().tokens, 169);
    }

    #[test]
    fn a_budget_squashes_the_image_to_fewer_rows() {
        let p = idefics3();
        let plan = p.plan(640, 480, false, 10_000).unwrap();
        assert_eq!(plan.tokens, 13 * 169);
        // 9 tiles (2 rows of 4 and the global view) fit 1600 tokens.
        let plan = p.plan(640, 480, false, 1600).unwrap();
        assert!(plan.reduced);
        assert_eq!(plan.tokens, 9 * 169);
        let choices: Choices = plan.choices().unwrap();
        let [w, h] = choices.squashed.unwrap();
        assert_eq!(p.grid(w, h), Some((2, 4)));
        assert_eq!(choices.tile_grid, Some([2, 4]));
        let plan = p.plan(300, 1000, false, 900).unwrap();
        let choices: Choices = plan.choices().unwrap();
        assert_eq!(choices.tile_grid, Some([4, 1]));
        // One row is the least.
        assert!(p.plan(640, 480, false, 800).is_err());
    }
}
