//! Qwen2-VL parity with transformers: the fixtures in tests/fixtures/qwen2-vl were made by its
//! generate.py with the pinned transformers (a tiny random model, its inputs and HF's outputs). The
//! vision tower, the M-RoPE positions, the logits of merged multimodal prompts and 32 greedy tokens
//! must match, for the checkpoint as transformers 5 saves it and as the Hub ships it (flat config,
//! legacy names, sharded).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use mmgate_inference::merge::PlaceholderMap;
use mmgate_inference::models::Qwen2Vl;
use mmgate_inference::rope::{Grid, MediaSpan, mrope_positions};
use mmgate_inference::{CpuBackend, Tensor};
use safetensors::{Dtype, SafeTensors};

/// fp32 tolerance: max |ours − HF| relative to the largest |HF| value of the tensor.
const REL_TOLERANCE: f32 = 1e-4;
const GREEDY_TOKENS: usize = 32;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen2-vl")
}

enum Golden {
    F32(Vec<usize>, Vec<f32>),
    I64(Vec<i64>),
}

struct Goldens(HashMap<String, Golden>);

impl Goldens {
    fn load() -> Self {
        let bytes = std::fs::read(fixtures().join("goldens.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let mut map = HashMap::new();
        for (name, view) in st.tensors() {
            let shape = view.shape().to_vec();
            let g = match view.dtype() {
                Dtype::F32 => Golden::F32(
                    shape,
                    view.data()
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                        .collect(),
                ),
                Dtype::I64 => Golden::I64(
                    view.data()
                        .chunks_exact(8)
                        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
                        .collect(),
                ),
                other => panic!("{name}: {other:?}"),
            };
            map.insert(name, g);
        }
        Self(map)
    }

    fn f32(&self, name: &str) -> (&[usize], &[f32]) {
        match &self.0[name] {
            Golden::F32(s, d) => (s, d),
            Golden::I64(..) => panic!("{name} is i64"),
        }
    }

    fn i64(&self, name: &str) -> &[i64] {
        match &self.0[name] {
            Golden::I64(d) => d,
            Golden::F32(..) => panic!("{name} is f32"),
        }
    }

    fn grids(&self, name: &str) -> Vec<Grid> {
        self.i64(name)
            .chunks(3)
            .map(|g| Grid {
                t: g[0] as usize,
                h: g[1] as usize,
                w: g[2] as usize,
            })
            .collect()
    }
}

fn relative_error(ours: &[f32], reference: &[f32]) -> f32 {
    assert_eq!(ours.len(), reference.len());
    let scale = reference.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let diff = ours
        .iter()
        .zip(reference)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    diff / scale
}

type Model = Qwen2Vl<CpuBackend, CpuBackend>;

fn load(dir: &str) -> Model {
    let encoder = CpuBackend::new("encoder", 2).unwrap();
    let llm = CpuBackend::new("llm", 2).unwrap();
    Qwen2Vl::load(&fixtures().join(dir), &encoder, &llm).unwrap()
}

fn encode(model: &Model, g: &Goldens, item: &str) -> Tensor<CpuBackend> {
    let (shape, pixels) = g.f32(&format!("{item}.pixel_values"));
    let pixels = Tensor::from_host(model.vision.device(), pixels, shape).unwrap();
    model
        .vision
        .encode(&pixels, &g.grids(&format!("{item}.grid_thw")))
        .unwrap()
}

fn check_vision(model: &Model, g: &Goldens, item: &str) {
    let ours = encode(model, g, item);
    let (shape, want) = g.f32(&format!("{item}.embeds"));
    assert_eq!(ours.shape(), shape);
    let err = relative_error(&ours.to_host().unwrap(), want);
    eprintln!("{item} embeddings: relative error {err:.2e}");
    assert!(
        err <= REL_TOLERANCE,
        "{item} embeddings: relative error {err}"
    );
}

/// The merged prompt's prefill logits and 32 greedy tokens, against HF's.
fn check_prompt(model: &Model, g: &Goldens, prompt: &str, item: &str, token: u32) {
    let ids: Vec<u32> = g
        .i64(&format!("{prompt}.input_ids"))
        .iter()
        .map(|&i| i as u32)
        .collect();
    let grids = g.grids(&format!("{item}.grid_thw"));
    let merge = model.config.vision.merge;

    let media: Vec<MediaSpan> = grids
        .iter()
        .map(|&grid| MediaSpan {
            token,
            grid,
            time_step: 1,
        })
        .collect();
    let (positions, delta) = mrope_positions(&ids, &media, merge).unwrap();
    let want_pos = g.i64(&format!("{prompt}.position_ids"));
    let n = ids.len();
    for (i, p) in positions.iter().enumerate() {
        assert_eq!(
            *p,
            [want_pos[i], want_pos[n + i], want_pos[2 * n + i]],
            "{prompt}: position of token {i}"
        );
    }
    assert_eq!(
        delta,
        g.i64(&format!("{prompt}.rope_delta"))[0],
        "{prompt}: rope delta"
    );

    // Encoder output crosses from the encoder device to the LLM's.
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
    let parts: Vec<Tensor<CpuBackend>> = per_item
        .iter()
        .map(|&k| {
            let part = features.slice_rows(offset, k).unwrap();
            offset += k;
            part
        })
        .collect();
    let mut embeds = model.llm.embed(&ids).unwrap();
    map.merge(&mut embeds, &parts.iter().collect::<Vec<_>>())
        .unwrap();

    let mut cache = model.llm.new_cache(n + GREEDY_TOKENS).unwrap();
    let hidden = model.llm.forward(embeds, &positions, &mut cache).unwrap();
    let logits = model.llm.logits(&hidden).unwrap();
    let (shape, want) = g.f32(&format!("{prompt}.logits"));
    assert_eq!(logits.shape(), shape);
    let host = logits.to_host().unwrap();
    let err = relative_error(&host, want);
    let vocab = shape[1];
    let max_abs = host
        .iter()
        .zip(want)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    eprintln!("{prompt} logits: relative error {err:.2e} (max abs {max_abs:.2e})");
    assert!(
        err <= REL_TOLERANCE,
        "{prompt} logits: relative error {err}"
    );

    // Greedy decoding: each step's token feeds the next; positions continue at len + delta.
    let (_, want_margins) = g.f32(&format!("{prompt}.margins"));
    let min_margin = want_margins.iter().fold(f32::INFINITY, |m, &v| m.min(v));
    let mut last = host[(n - 1) * vocab..].to_vec();
    let mut generated = Vec::new();
    for _ in 0..GREEDY_TOKENS {
        let next = argmax(&last);
        generated.push(next as i64);
        let pos = cache.len() as i64 + delta;
        let x = model.llm.embed(&[next as u32]).unwrap();
        let h = model.llm.forward(x, &[[pos; 3]], &mut cache).unwrap();
        last = model.llm.logits(&h).unwrap().to_host().unwrap();
    }
    assert_eq!(
        generated,
        g.i64(&format!("{prompt}.generated")),
        "{prompt}: greedy tokens"
    );
    eprintln!(
        "{prompt}: {GREEDY_TOKENS} greedy tokens identical; smallest HF top-2 margin {min_margin:.3}, our largest prefill logit error {max_abs:.2e}"
    );
    assert!(
        max_abs * 10.0 < min_margin,
        "logit error too close to the greedy margins"
    );
}

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &x)| {
            if x > bv { (i, x) } else { (bi, bv) }
        })
        .0
}

fn check_model(dir: &str) {
    let model = load(dir);
    let g = Goldens::load();
    check_vision(&model, &g, "image");
    check_vision(&model, &g, "video");
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
    check_model("model");
}

#[test]
fn hub_layout_matches_transformers() {
    check_model("model-legacy");
}
