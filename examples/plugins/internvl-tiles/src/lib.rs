//! `internvl-tiles`: InternVL's dynamic-resolution image preprocessing as an mmgate plugin.
//!
//! The image is cut into 448-px tiles: the tile grid (columns × rows, between `min_patches` and
//! `max_patches` tiles) is the one whose aspect ratio is closest to the image's; the image is resized
//! (Pillow bicubic) to exactly fill that grid and cut, and when there is more than one tile a thumbnail
//! (the whole image resized to one tile) is appended. Each tile is normalised with ImageNet mean/std and
//! costs `image_seq_length` (256) LLM tokens: 32×32 patches of 14 px, pixel-shuffled by 0.5.
//! This is transformers' `GotOcr2ImageProcessor` with `crop_to_patches`, which InternVL3's HF
//! checkpoints use.
//!
//! Output: `pixel_values` f32 [tiles, 3, 448, 448] and `num_patches` i64 [1] (= tiles), as HF returns.
//!
//! Under a token budget smaller than the native tiling, the largest `max_patches` whose tiling fits
//! is used (exactly what HF produces with that `max_patches`), down to a single resized tile.

mod config;

use mmgate_plugin_sdk::imageops::RgbImage;
use mmgate_plugin_sdk::*;
use serde::{Deserialize, Serialize};

pub use config::Config;
pub use mmgate_plugin_sdk::imageops::tiling::{Grid, optimal_grid};

/// What `plan` chose, handed to `preprocess` unchanged.
#[derive(Debug, Serialize, Deserialize)]
struct Choices {
    /// The tile grid (1×1 when not tiled).
    grid: Grid,
    /// A thumbnail tile follows the grid's tiles.
    thumbnail: bool,
    /// Tiles emitted (grid + thumbnail).
    tiles: u32,
    /// The `max_patches` used (lower than configured when the budget cut it).
    max_patches: u32,
}

/// The tiling for an image with at most `max_patches` tiles (HF: tiling only when `max_patches > 1`).
fn tiling(config: &Config, width: u32, height: u32, max_patches: u32) -> Choices {
    if !config.crop_to_patches || max_patches <= 1 {
        let grid = Grid {
            columns: 1,
            rows: 1,
        };
        return Choices {
            grid,
            thumbnail: false,
            tiles: 1,
            max_patches,
        };
    }
    let grid = optimal_grid(width, height, config.tile, config.min_patches, max_patches);
    let thumbnail = grid.tiles() > 1;
    Choices {
        grid,
        thumbnail,
        tiles: grid.tiles() + u32::from(thumbnail),
        max_patches,
    }
}

/// The plugin; public so its code can also run natively.
pub struct InternVlTiles;

impl Plugin for InternVlTiles {
    fn describe() -> Descriptor {
        Descriptor::new(
            "internvl-tiles",
            env!("CARGO_PKG_VERSION"),
            "InternVL dynamic tiling: 448-px tiles by closest aspect ratio plus a thumbnail",
            &["image"],
            imagedecode::MIME_TYPES,
            config::PROCESSOR_TYPES,
        )
    }

    fn probe(media: Media) -> PluginResult<MediaInfo> {
        Ok(imagedecode::probe(&media.data)?.media_info())
    }

    fn plan(info: MediaInfo, budget: Budget, config: ProcessorConfig) -> PluginResult<TokenPlan> {
        let config = Config::parse(&config)?;
        let (width, height) = imagedecode::dimensions(&info)?;
        let cost = |choices: &Choices| choices.tiles.saturating_mul(config.tokens_per_tile);
        let native = tiling(&config, width, height, config.max_patches);
        if cost(&native) <= budget.max_tokens {
            let reason = describe(&native, width, height);
            return TokenPlan::new(cost(&native), false, reason, &native);
        }
        // Fewer tiles: the largest max_patches whose tiling fits (1 = a single resized tile).
        for max_patches in (1..config.max_patches).rev() {
            let choices = tiling(&config, width, height, max_patches);
            if cost(&choices) <= budget.max_tokens {
                let reason = format!(
                    "{}; max_patches lowered from {} to {max_patches} to fit {} tokens",
                    describe(&choices, width, height),
                    config.max_patches,
                    budget.max_tokens
                );
                return TokenPlan::new(cost(&choices), true, reason, &choices);
            }
        }
        Err(PluginError::over_budget(
            config.tokens_per_tile,
            budget.max_tokens,
            format!(
                "one {0}x{0} tile needs {1} tokens, the budget is {2}",
                config.tile, config.tokens_per_tile, budget.max_tokens
            ),
        ))
    }

    fn preprocess(
        media: Media,
        plan: TokenPlan,
        config: ProcessorConfig,
    ) -> PluginResult<Vec<Tensor>> {
        let config = Config::parse(&config)?;
        let choices: Choices = plan.choices()?;
        let image = imagedecode::decode_rgb(&media.data)?;
        let tile = config.tile as usize;
        let Grid { columns, rows } = choices.grid;
        let (columns, rows) = (columns as usize, rows as usize);

        let mut tiles: Vec<RgbImage> = Vec::with_capacity(choices.tiles as usize);
        let canvas = image.resize(columns * tile, rows * tile, config.filter);
        for index in 0..columns * rows {
            let (column, row) = (index % columns, index / columns);
            tiles.push(canvas.crop((column * tile) as isize, (row * tile) as isize, tile, tile));
        }
        if choices.thumbnail {
            tiles.push(image.resize(tile, tile, config.filter));
        }

        // Channels first per tile: [tiles, 3, tile, tile], each value one table lookup.
        let table = config.normalize.table_le_bytes();
        let plane = tile * tile;
        let mut bytes = vec![0u8; tiles.len() * 3 * plane * 4];
        for (tile_image, out) in tiles.iter().zip(bytes.chunks_exact_mut(3 * plane * 4)) {
            for (i, pixel) in tile_image.data.chunks_exact(3).enumerate() {
                for (c, &value) in pixel.iter().enumerate() {
                    let at = (c * plane + i) * 4;
                    out[at..at + 4].copy_from_slice(&table[c][usize::from(value)]);
                }
            }
        }
        let shape = [tiles.len(), 3, tile, tile];
        Ok(vec![
            Tensor::from_f32_bytes("pixel_values", &shape, bytes)?,
            Tensor::from_i64("num_patches", &[1], &[i64::from(choices.tiles)])?,
        ])
    }
}

fn describe(choices: &Choices, width: u32, height: u32) -> String {
    let Grid { columns, rows } = choices.grid;
    if choices.thumbnail {
        format!(
            "{width}x{height} tiled {columns}x{rows} plus a thumbnail: {} tiles",
            choices.tiles
        )
    } else {
        format!("{width}x{height} resized to a single tile")
    }
}

// Natively (unit tests) there is no component to export.
#[cfg(target_arch = "wasm32")]
mmgate_plugin_sdk::export_plugin!(InternVlTiles);
