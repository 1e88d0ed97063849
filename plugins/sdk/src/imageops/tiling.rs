//! Choosing a tile grid by aspect ratio: InternVL's dynamic preprocessing as transformers
//! implements it (`GotOcr2ImageProcessor` with `crop_to_patches`: `get_all_supported_aspect_ratios`
//! and `get_optimal_tiled_canvas`), shared by the plugins that tile so.

/// A grid of `columns` × `rows` tiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Grid {
    pub columns: u32,
    pub rows: u32,
}

impl Grid {
    pub fn tiles(self) -> u32 {
        self.columns * self.rows
    }
}

/// Every grid with `min_tiles..=max_tiles` tiles, ordered by tile count (stable, so ties keep the
/// columns-outer order transformers builds them in — the order decides exact ties below).
pub fn candidate_grids(min_tiles: u32, max_tiles: u32) -> Vec<Grid> {
    let mut grids = Vec::new();
    for columns in 1..=max_tiles {
        for rows in 1..=max_tiles {
            let tiles = columns * rows;
            if (min_tiles..=max_tiles).contains(&tiles) {
                grids.push(Grid { columns, rows });
            }
        }
    }
    grids.sort_by_key(|g| g.tiles());
    grids
}

/// The grid whose aspect ratio is closest to the image's; on an exact tie the later (larger) grid
/// wins while the image has more than half the pixels of the tiles it would fill.
pub fn optimal_grid(width: u32, height: u32, tile: u32, min_tiles: u32, max_tiles: u32) -> Grid {
    let aspect = f64::from(width) / f64::from(height);
    let area = f64::from(width) * f64::from(height);
    let tile_area = f64::from(tile) * f64::from(tile);
    let mut best = Grid {
        columns: 1,
        rows: 1,
    };
    let mut best_diff = f64::INFINITY;
    for grid in candidate_grids(min_tiles, max_tiles) {
        let diff = (aspect - f64::from(grid.columns) / f64::from(grid.rows)).abs();
        if diff < best_diff {
            best_diff = diff;
            best = grid;
        } else if diff == best_diff && area > 0.5 * tile_area * f64::from(grid.tiles()) {
            best = grid;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_match_transformers_docstring() {
        let grids: Vec<(u32, u32)> = candidate_grids(1, 4)
            .iter()
            .map(|g| (g.columns, g.rows))
            .collect();
        assert_eq!(
            grids,
            [
                (1, 1),
                (1, 2),
                (2, 1),
                (1, 3),
                (3, 1),
                (1, 4),
                (2, 2),
                (4, 1)
            ]
        );
    }

    #[test]
    fn closest_aspect_ratio_wins() {
        let grid = |w, h| optimal_grid(w, h, 448, 1, 12);
        assert_eq!(
            grid(448, 448),
            Grid {
                columns: 1,
                rows: 1
            }
        );
        assert_eq!(
            grid(1000, 500),
            Grid {
                columns: 2,
                rows: 1
            }
        );
        assert_eq!(
            grid(300, 1200),
            Grid {
                columns: 1,
                rows: 4
            }
        );
        // A large square image: same ratio as 1x1, and large enough to fill more tiles.
        assert_eq!(
            grid(2000, 2000),
            Grid {
                columns: 3,
                rows: 3
            }
        );
    }
}
