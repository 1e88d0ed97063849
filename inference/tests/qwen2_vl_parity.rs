//! Qwen2-VL and Qwen2.5-VL parity with transformers (fixtures: tests/fixtures/models, made by its
//! generate.py with the pinned transformers): the vision tower, the M-RoPE positions, the logits of
//! merged image and video prompts and 32 greedy tokens each, for the checkpoint as transformers 5
//! saves it and as the Hub ships it (flat config, legacy names, sharded). The Qwen2.5-VL model has
//! window attention with windows cut by the image's edge and a video whose temporal positions are
//! scaled by time.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{Goldens, check_close, check_prefill_and_greedy, devices, family_dir, simulated_gpus};
use mmgate_inference::merge::PlaceholderMap;
use mmgate_inference::models::Qwen2Vl;
use mmgate_inference::rope::{Grid, MediaSpan, mrope_positions};
use mmgate_inference::{Backend, Tensor};

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

fn encode<E: Backend, L: Backend>(model: &Qwen2Vl<E, L>, g: &Goldens, item: &str) -> Tensor<E> {
    let (shape, pixels) = g.f32(&format!("{item}.pixel_values"));
    let pixels = Tensor::from_host(model.vision.device(), pixels, shape).unwrap();
    model.vision.encode(&pixels, &grids(g, item)).unwrap()
}

fn check_prompt<E: Backend, L: Backend>(
    model: &Qwen2Vl<E, L>,
    g: &Goldens,
    prompt: &str,
    item: &str,
    token: u32,
) {
    let ids = g.ids(&format!("{prompt}.input_ids"));
    let grids = grids(g, item);
    let merge = model.config.vision.merge;
    // Videos of Qwen2.5-VL carry the seconds between temporal patches; images and Qwen2-VL do not.
    let seconds = g
        .has(&format!("{item}.second_per_grid_ts"))
        .then(|| g.f32(&format!("{item}.second_per_grid_ts")).1.to_vec());

    let media: Vec<MediaSpan> = grids
        .iter()
        .enumerate()
        .map(|(i, &grid)| MediaSpan {
            token,
            grid,
            time_interval: seconds
                .as_ref()
                .map_or(1.0, |s| model.config.vision.time_interval(s[i])),
        })
        .collect();
    let (positions, delta) = mrope_positions(&ids, &media, merge).unwrap();
    let want = g.i64(&format!("{prompt}.position_ids"));
    let n = ids.len();
    for (i, p) in positions.iter().enumerate() {
        assert_eq!(
            *p,
            [want[i], want[n + i], want[2 * n + i]],
            "{prompt}: position of token {i}"
        );
    }
    assert_eq!(
        delta,
        g.i64(&format!("{prompt}.rope_delta"))[0],
        "{prompt}: rope delta"
    );

    // Encoder output crosses from the encoder device to the LLM's, then is split per item.
    let features = encode(model, g, item);
    let features = Tensor::from_host(
        model.llm.device(),
        &features.to_host().unwrap(),
        features.shape(),
    )
    .unwrap();
    let per_item: Vec<usize> = grids.iter().map(|g| g.tokens(merge)).collect();
    let map = PlaceholderMap::build(&ids, token, &per_item).unwrap();
    let mut offset = 0;
    let parts: Vec<Tensor<L>> = per_item
        .iter()
        .map(|&k| {
            offset += k;
            features.slice_rows(offset - k, k).unwrap()
        })
        .collect();
    let mut embeds = model.llm.embed(&ids).unwrap();
    map.merge(&mut embeds, &parts.iter().collect::<Vec<_>>())
        .unwrap();
    check_prefill_and_greedy(&model.llm, g, prompt, embeds, &positions, delta);
}

fn check_model(family: &str, dir: &str) {
    let (encoder, llm) = devices();
    check_model_on(family, dir, &encoder, &llm);
}

fn check_model_on<E: Backend, L: Backend>(family: &str, dir: &str, encoder: &E, llm: &L) {
    let dir = family_dir(family).join(dir);
    let model: Qwen2Vl<E, L> = Qwen2Vl::load(&dir, encoder, llm).unwrap();
    let g = Goldens::load(family);
    // A second encoder device loads the tower alone; it must be the same tower.
    let (pixels_shape, pixels) = g.f32("image.pixel_values");
    let alone = Qwen2Vl::<E, L>::load_vision(&dir, encoder).unwrap();
    let pixels = Tensor::from_host(encoder, pixels, pixels_shape).unwrap();
    assert_eq!(
        alone
            .encode(&pixels, &grids(&g, "image"))
            .unwrap()
            .to_host()
            .unwrap(),
        encode(&model, &g, "image").to_host().unwrap()
    );
    check_close(
        "image embeddings",
        &encode(&model, &g, "image"),
        g.f32("image.embeds"),
    );
    check_close(
        "video embeddings",
        &encode(&model, &g, "video"),
        g.f32("video.embeds"),
    );
    check_prompt(
        &model,
        &g,
        "image_prompt",
        "image",
        model.config.image_token_id,
    );
    check_prompt(
        &model,
        &g,
        "video_prompt",
        "video",
        model.config.video_token_id,
    );
}

#[test]
fn current_layout_matches_transformers() {
    check_model("qwen2-vl", "model");
}

#[test]
fn hub_layout_matches_transformers() {
    check_model("qwen2-vl", "model-legacy");
}

#[test]
fn qwen2_5_vl_current_layout_matches_transformers() {
    check_model("qwen2.5-vl", "model");
}

#[test]
fn qwen2_5_vl_hub_layout_matches_transformers() {
    check_model("qwen2.5-vl", "model-legacy");
}

/// The CUDA backend, simulated on the CPU (every kernel as NVRTC compiles it, GEMMs with cuBLAS's
/// semantics), with the tower on "cuda:1" and the LLM on "cuda:0": the same parity as the CPU
/// backend against transformers. Qwen2.5-VL exercises window attention's reordering on top.
#[test]
fn qwen2_5_vl_on_simulated_gpus_matches_transformers() {
    let (encoder, llm) = simulated_gpus();
    check_model_on("qwen2.5-vl", "model", &encoder, &llm);
}
