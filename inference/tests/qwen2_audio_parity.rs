//! Qwen2-Audio parity with transformers (fixtures: tests/fixtures/models, made by its generate.py
//! with the pinned transformers): the Whisper encoder + projector over a full and a partly filled
//! 30 s chunk, the logits of the merged audio prompt and 32 greedy tokens, for the checkpoint as
//! transformers 5 saves it and as the Hub ships it (legacy names, sharded).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{Goldens, check_close, check_prefill_and_greedy, devices, family_dir};
use mmgate_inference::merge::PlaceholderMap;
use mmgate_inference::models::Qwen2Audio;
use mmgate_inference::{Backend, Tensor};

fn check_model(dir: &str) {
    let (encoder, llm) = devices();
    check_model_on(dir, &encoder, &llm);
}

fn check_model_on<E: Backend, L: Backend>(dir: &str, encoder: &E, llm: &L) {
    let model: Qwen2Audio<E, L> =
        Qwen2Audio::load(&family_dir("qwen2-audio").join(dir), encoder, llm).unwrap();
    let g = Goldens::load("qwen2-audio");

    let (_, features) = g.f32("audio.input_features");
    let frames = model.config.audio.frames();
    let valid: Vec<usize> = g
        .i64("audio.feature_attention_mask")
        .chunks(frames)
        .map(|m| m.iter().sum::<i64>() as usize)
        .collect();
    let embeds_audio = model.audio.encode(features, &valid).unwrap();
    check_close("audio embeddings", &embeds_audio, g.f32("audio.embeds"));
    // A second encoder device loads the encoder alone; it must be the same encoder.
    let alone =
        Qwen2Audio::<E, L>::load_audio(&family_dir("qwen2-audio").join(dir), encoder).unwrap();
    assert_eq!(
        alone.encode(features, &valid).unwrap().to_host().unwrap(),
        embeds_audio.to_host().unwrap()
    );

    let ids = g.ids("audio_prompt.input_ids");
    let per_chunk: Vec<usize> = valid
        .iter()
        .map(|&v| model.config.audio.output_len(v))
        .collect();
    // One audio item: its chunks' embeddings are consecutive, as are its placeholders.
    let map = PlaceholderMap::build(&ids, model.config.audio_token_id, &[per_chunk.iter().sum()])
        .unwrap();
    // The encoder's output crosses to the LLM's device.
    let embeds_audio = Tensor::from_host(
        model.llm.device(),
        &embeds_audio.to_host().unwrap(),
        embeds_audio.shape(),
    )
    .unwrap();
    let mut embeds = model.llm.embed(&ids).unwrap();
    map.merge(&mut embeds, &[&embeds_audio]).unwrap();
    let positions: Vec<[i64; 3]> = (0..ids.len() as i64).map(|p| [p; 3]).collect();
    check_prefill_and_greedy(&model.llm, &g, "audio_prompt", embeds, &positions, 0);
}

#[test]
fn current_layout_matches_transformers() {
    check_model("model");
}

#[test]
fn hub_layout_matches_transformers() {
    check_model("model-legacy");
}

/// On a real GPU (the GPU bundle's `run.sh`; never run in this project's CI, which has none): the
/// same parity, the encoder and the LLM on CUDA.
#[test]
#[ignore = "needs an NVIDIA GPU: the GPU bundle's run.sh"]
fn on_real_gpus_matches_transformers() {
    let (encoder, llm) = common::real_gpus();
    check_model_on("model", &encoder, &llm);
}
