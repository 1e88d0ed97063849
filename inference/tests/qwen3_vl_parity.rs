//! Qwen3-VL against transformers (fixtures: tests/fixtures/models/qwen3-vl, made by qwen3_vl.py with
//! the pinned transformers): the vision tower (learned position embeddings resampled to each grid,
//! deepstack taps), the prompt positions, and the Qwen3 LLM (q/k norms, interleaved M-RoPE,
//! deepstack) fed the tower's outputs as transformers computed them. Not yet served: the family,
//! the plugin's processor entry and the engine's deepstack merge are issue 30's next steps.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{Goldens, check_close, check_prefill_and_greedy_with, devices, family_dir, grids};
use mmgate_inference::Tensor;
use mmgate_inference::models::Qwen2;
use mmgate_inference::models::config::ConfigFile;
use mmgate_inference::models::qwen2::Deepstack;
use mmgate_inference::models::qwen3_vl::Qwen3VisionTower;
use mmgate_inference::rope::{Grid, MediaSpan, mrope_positions};
use mmgate_inference::weights::Weights;

const IMAGE_TOKEN: u32 = 500;
const VIDEO_TOKEN: u32 = 501;

/// The vision tower on transformers' pixel values: the merged output and both deepstack features
/// of two images in one call and of a two-frame video.
#[test]
fn the_vision_tower_and_its_deepstack_taps_match_transformers() {
    let (encoder, _) = devices();
    let tower = Qwen3VisionTower::load(&family_dir("qwen3-vl").join("model"), &encoder).unwrap();
    let g = Goldens::load("qwen3-vl");
    for item in ["image", "video"] {
        let (shape, values) = g.f32(&format!("{item}.pixel_values"));
        let pixels = Tensor::from_host(&encoder, values, shape).unwrap();
        let (merged, deepstack) = tower.encode(&pixels, &grids(&g, item)).unwrap();
        check_close(
            &format!("{item} embeddings"),
            &merged,
            g.f32(&format!("{item}.embeds")),
        );
        assert_eq!(deepstack.len(), 2);
        for (i, features) in deepstack.iter().enumerate() {
            check_close(
                &format!("{item} deepstack {i}"),
                features,
                g.f32(&format!("{item}.deepstack.{i}")),
            );
        }
    }
    // A grid that is not whole merged patches is an error, not a panic.
    let odd = Grid { t: 1, h: 2, w: 1 };
    let pixels = Tensor::zeros(&encoder, &[2, tower.config().patch_len()]).unwrap();
    assert!(tower.encode(&pixels, &[odd]).is_err());
}

/// The media spans of `item` for M-RoPE: a video as one block per temporal patch.
fn spans(g: &Goldens, item: &str, token: u32) -> Vec<MediaSpan> {
    grids(g, item)
        .into_iter()
        .flat_map(|grid| {
            (0..grid.t).map(move |_| MediaSpan {
                token,
                grid: Grid { t: 1, ..grid },
                time_interval: 1.0,
            })
        })
        .collect()
}

/// The Qwen3 LLM on the tower's outputs as transformers made them: each prompt's media tokens take
/// the merged embeddings, the deepstack features are added after the first two layers at those
/// rows; prefill logits and 32 greedy tokens as transformers'.
#[test]
fn the_llm_with_deepstack_matches_transformers_on_the_towers_outputs() {
    let dir = family_dir("qwen3-vl").join("model");
    let text = ConfigFile::read(&dir).unwrap().text_config().unwrap();
    assert!(text.mrope_interleaved);
    let (_, dev) = devices();
    let mut weights = Weights::load(&dir, str::to_owned).unwrap();
    let llm = Qwen2::load(text, &mut weights, "model.language_model.", &dev).unwrap();
    let g = Goldens::load("qwen3-vl");
    for (prompt, item, token) in [
        ("image_prompt", "image", IMAGE_TOKEN),
        ("video_prompt", "video", VIDEO_TOKEN),
    ] {
        let ids = g.ids(&format!("{prompt}.input_ids"));
        let (positions, delta) = mrope_positions(&ids, &spans(&g, item, token), 2).unwrap();
        let rows: Vec<u32> = (0..ids.len() as u32)
            .filter(|&i| ids[i as usize] == token)
            .collect();
        let tensor = |name: &str| {
            let (shape, values) = g.f32(name);
            Tensor::from_host(&dev, values, shape).unwrap()
        };
        let mut embeds = llm.embed(&ids).unwrap();
        embeds
            .scatter_rows(&rows, &tensor(&format!("{item}.embeds")))
            .unwrap();
        let features = [
            tensor(&format!("{item}.deepstack.0")),
            tensor(&format!("{item}.deepstack.1")),
        ];
        let deepstack = Deepstack {
            rows: &rows,
            features: &features,
        };
        check_prefill_and_greedy_with(&llm, &g, prompt, embeds, &positions, delta, Some(deepstack));
    }
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
        let (positions, delta) = mrope_positions(&ids, &spans(&g, item, token), 2).unwrap();
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
