//! Qwen3-VL against transformers (fixtures: tests/fixtures/models/qwen3-vl, made by qwen3_vl.py with
//! the pinned transformers). Only the prompt positions so far: the vision tower with its deepstack
//! taps, the Qwen3 LLM and its interleaved M-RoPE are not built yet (issue 30).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::Goldens;
use mmgate_inference::rope::{Grid, MediaSpan, mrope_positions};

const IMAGE_TOKEN: u32 = 500;
const VIDEO_TOKEN: u32 = 501;

fn grids(g: &Goldens, item: &str) -> Vec<Grid> {
    g.i64(&format!("{item}.grid_thw"))
        .chunks(3)
        .map(|v| Grid {
            t: v[0] as usize,
            h: v[1] as usize,
            w: v[2] as usize,
        })
        .collect()
}

/// A Qwen3-VL video is one block per temporal patch in the prompt, each after its timestamp text:
/// placed as that many one-frame items, its positions are transformers' (`get_rope_index`).
#[test]
fn prompt_positions_match_transformers_with_video_frames_as_blocks() {
    let g = Goldens::load("qwen3-vl");
    for (prompt, item, token) in [
        ("image_prompt", "image", IMAGE_TOKEN),
        ("video_prompt", "video", VIDEO_TOKEN),
    ] {
        let ids = g.ids(&format!("{prompt}.input_ids"));
        let media: Vec<MediaSpan> = grids(&g, item)
            .into_iter()
            .flat_map(|grid| {
                (0..grid.t).map(move |_| MediaSpan {
                    token,
                    grid: Grid { t: 1, ..grid },
                    time_interval: 1.0,
                })
            })
            .collect();
        let (positions, delta) = mrope_positions(&ids, &media, 2).unwrap();
        let want = g.i64(&format!("{prompt}.position_ids"));
        let n = ids.len();
        for (i, p) in positions.iter().enumerate() {
            assert_eq!(
                *p,
                [want[i], want[n + i], want[2 * n + i]],
                "{prompt}: position of token {i}"
            );
        }
        assert_eq!(delta, g.i64(&format!("{prompt}.rope_delta"))[0], "{prompt}");
    }
}
