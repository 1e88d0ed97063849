//! Qwen2-VL and Qwen2.5-VL parity with transformers (fixtures: tests/fixtures/models, made by its
//! generate.py with the pinned transformers): the vision tower, the M-RoPE positions, the logits of
//! merged image and video prompts and 32 greedy tokens each, for the checkpoint as transformers 5
//! saves it and as the Hub ships it (flat config, legacy names, sharded). The Qwen2.5-VL model has
//! window attention with windows cut by the image's edge and a video whose temporal positions are
//! scaled by time.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{
    Goldens, check_close, check_prefill_and_greedy, devices, family_dir, grids, real_gpus,
    relative_error, simulated_gpus,
};
use mmgate_inference::backend::cuda::DType;
use mmgate_inference::merge::PlaceholderMap;
use mmgate_inference::models::Qwen2Vl;
use mmgate_inference::rope::{MediaSpan, mrope_positions};
use mmgate_inference::{Backend, Tensor};

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
            continues_at: None,
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

/// A bf16 checkpoint (the tiny Qwen2-VL saved in bfloat16 by fixtures' bf16.py) stays bf16 in
/// memory: its weights take about half the bytes of the f32 checkpoint's (norms and biases stay
/// f32). mmgate computes with bf16 weights, f32 activations and f32 accumulation, so it matches
/// transformers running the same bf16 weights in f32 within the f32 tolerances, greedy tokens
/// included. Against transformers in bf16 end to end (activations rounded at every op, as PyTorch
/// runs a bf16 model on a GPU) the logits differ by bf16's own rounding: stated and bounded here.
#[test]
fn bf16_checkpoint_halves_memory_and_matches_transformers() {
    let (encoder, llm) = devices();
    let f32_model = Qwen2Vl::load(&family_dir("qwen2-vl").join("model"), &encoder, &llm).unwrap();
    let dir = family_dir("qwen2-vl").join("model-bf16");
    let model = Qwen2Vl::load(&dir, &encoder, &llm).unwrap();
    let bytes = |m: &Qwen2Vl<_, _>| m.vision.weight_bytes() + m.llm.weight_bytes();
    let (half, full) = (bytes(&model), bytes(&f32_model));
    // Exactly: every matrix (2-D or more) at 2 bytes a value, every vector at 4.
    let file = std::fs::read(dir.join("model.safetensors")).unwrap();
    let (mut matrices, mut vectors) = (0, 0);
    for (_, t) in safetensors::SafeTensors::deserialize(&file)
        .unwrap()
        .tensors()
    {
        let n: usize = t.shape().iter().product();
        if t.shape().len() >= 2 {
            matrices += n
        } else {
            vectors += n
        }
    }
    assert_eq!(full, 4 * (matrices + vectors));
    assert_eq!(half, 2 * matrices + 4 * vectors);
    eprintln!(
        "weights: bf16 checkpoint {half} bytes, f32 {full} bytes ({:.3}x; vectors are {:.1}% of this \
         tiny model's values)",
        half as f64 / full as f64,
        100.0 * vectors as f64 / (matrices + vectors) as f64
    );

    let g = Goldens::load_file("qwen2-vl", "goldens-bf16.safetensors");
    let run = image_prompt(&model, &g);
    check_close("bf16 image embeddings", &run.image, g.f32("image.embeds"));
    check_prefill_and_greedy(
        &model.llm,
        &g,
        "image_prompt",
        run.embeds,
        &run.positions,
        run.delta,
    );

    // Transformers in bf16 end to end.
    let err = relative_error(&run.logits, g.f32("bf16_compute.image_prompt.logits").1);
    eprintln!(
        "vs transformers in bf16: logits relative error {err:.2e}, embeddings {:.2e}",
        relative_error(
            &run.image.to_host().unwrap(),
            g.f32("bf16_compute.image.embeds").1
        )
    );
    // bf16 keeps 8 bits of mantissa (relative rounding 2^-9 per op); through a few layers of
    // rounded activations that compounds to about 1e-2 of the largest logit.
    assert!(
        err < 3e-2,
        "logits vs bf16 transformers: relative error {err}"
    );
}

/// The image prompt of the bf16 goldens through `model`: the tower's output, the merged prompt's
/// embeddings and positions, and the prefill logits at the stored rows.
struct ImagePromptRun<E: Backend, L: Backend> {
    image: Tensor<E>,
    embeds: Tensor<L>,
    positions: Vec<[i64; 3]>,
    delta: i64,
    logits: Vec<f32>,
}

fn image_prompt<E: Backend, L: Backend>(
    model: &Qwen2Vl<E, L>,
    g: &Goldens,
) -> ImagePromptRun<E, L> {
    let inputs = Goldens::load("qwen2-vl");
    let image = encode(model, &inputs, "image");
    let ids = g.ids("image_prompt.input_ids");
    let grids = grids(&inputs, "image");
    let token = model.config.image_token_id;
    let media: Vec<MediaSpan> = grids
        .iter()
        .map(|&grid| MediaSpan {
            token,
            grid,
            time_interval: 1.0,
            continues_at: None,
        })
        .collect();
    let (positions, delta) = mrope_positions(&ids, &media, model.config.vision.merge).unwrap();
    let per_item: Vec<usize> = grids.iter().map(|g| g.tokens(2)).collect();
    let map = PlaceholderMap::build(&ids, token, &per_item).unwrap();
    let crossed =
        Tensor::from_host(model.llm.device(), &image.to_host().unwrap(), image.shape()).unwrap();
    let parts = [
        crossed.slice_rows(0, per_item[0]).unwrap(),
        crossed.slice_rows(per_item[0], per_item[1]).unwrap(),
    ];
    let merged = || {
        let mut embeds = model.llm.embed(&ids).unwrap();
        map.merge(&mut embeds, &parts.iter().collect::<Vec<_>>())
            .unwrap();
        embeds
    };
    let mut cache = model.llm.new_cache(ids.len()).unwrap();
    let hidden = model.llm.forward(merged(), &positions, &mut cache).unwrap();
    let all = model.llm.logits(&hidden).unwrap().to_host().unwrap();
    let vocab = model.config.text.vocab_size;
    let logits = g
        .i64("image_prompt.logit_rows")
        .iter()
        .flat_map(|&r| all[r as usize * vocab..(r as usize + 1) * vocab].to_vec())
        .collect();
    ImagePromptRun {
        image,
        embeds: merged(),
        positions,
        delta,
        logits,
    }
}

/// The bf16 checkpoint on the simulated CUDA backend: bf16 weights on the device, linears as
/// bf16 GEMMs (cuBLAS's: the input rounded to bf16 too, f32 accumulation and output). That sits
/// between transformers' two runs: further from its f32 compute than the CPU backend (the rounded
/// inputs), nearer its bf16 compute (activations stay f32 between ops).
#[test]
fn bf16_checkpoint_on_simulated_gpus_matches_transformers_within_bf16_rounding() {
    let (encoder, llm) = simulated_gpus();
    let model = Qwen2Vl::load(&family_dir("qwen2-vl").join("model-bf16"), &encoder, &llm).unwrap();
    let g = Goldens::load_file("qwen2-vl", "goldens-bf16.safetensors");
    let run = image_prompt(&model, &g);
    let gemms = llm.device().record.lock().unwrap().gemms.clone();
    assert!(!gemms.is_empty() && gemms.iter().all(|c| c.a_type == DType::Bf16));
    let vs_f32 = relative_error(&run.logits, g.f32("image_prompt.logits").1);
    let vs_bf16 = relative_error(&run.logits, g.f32("bf16_compute.image_prompt.logits").1);
    let embeds = relative_error(&run.image.to_host().unwrap(), g.f32("image.embeds").1);
    eprintln!(
        "simulated GPUs, bf16: logits vs transformers f32 compute {vs_f32:.2e}, vs bf16 compute \
         {vs_bf16:.2e}; embeddings vs f32 compute {embeds:.2e}"
    );
    assert!(vs_f32 < 1e-2 && vs_bf16 < 3e-2 && embeds < 1e-2);
}

/// The bf16 checkpoint on CPU devices asked for bf16 inputs: where the CPU has AVX-512 BF16 its
/// linears are bf16 GEMMs (the input rounded, as on the GPUs above) and its attention rounds
/// queries, keys, values and softmax weights to bf16 (as a bf16 engine's flash attention), so the
/// logits are nearer transformers' bf16 compute than its f32 compute is, and no further from its
/// f32 compute than its own bf16 compute. On a CPU without, the request changes nothing and the
/// f32 inputs' parity holds.
#[test]
fn bf16_checkpoint_with_bf16_inputs_on_the_cpu_matches_transformers_within_bf16_rounding() {
    let (encoder, llm) = devices();
    let (encoder, llm) = (encoder.with_bf16_inputs(), llm.with_bf16_inputs());
    let model = Qwen2Vl::load(&family_dir("qwen2-vl").join("model-bf16"), &encoder, &llm).unwrap();
    let g = Goldens::load_file("qwen2-vl", "goldens-bf16.safetensors");
    let run = image_prompt(&model, &g);
    let f32_logits = g.f32("image_prompt.logits").1;
    let bf16_logits = g.f32("bf16_compute.image_prompt.logits").1;
    let vs_f32 = relative_error(&run.logits, f32_logits);
    let vs_bf16 = relative_error(&run.logits, bf16_logits);
    let embeds = relative_error(&run.image.to_host().unwrap(), g.f32("image.embeds").1);
    let transformers_bf16_vs_f32 = relative_error(bf16_logits, f32_logits);
    eprintln!(
        "{}: logits vs transformers f32 compute {vs_f32:.2e}, vs bf16 compute {vs_bf16:.2e} \
         (transformers' bf16 vs its f32: {transformers_bf16_vs_f32:.2e}); embeddings vs f32 \
         compute {embeds:.2e}",
        llm.name()
    );
    assert!(vs_f32 < transformers_bf16_vs_f32.max(1e-2) && vs_bf16 < 3e-2 && embeds < 1e-2);
    if llm.uses_bf16_inputs() {
        // The rounding shows: the f32 inputs' run is within f32 tolerances, this one is not, and
        // it is nearer transformers' bf16 compute than its f32 compute is.
        assert!(vs_f32 > 1e-5, "bf16 inputs gave f32 results: {vs_f32:.2e}");
        assert!(vs_bf16 < transformers_bf16_vs_f32);
    }
}

/// On real GPUs (the GPU bundle's `run.sh`, see `./dev gpu-bundle`; never run in this project's
/// CI, which has none): the same parity as the simulated and CPU backends, f32 and bf16.
#[test]
#[ignore = "needs an NVIDIA GPU: the GPU bundle's run.sh"]
fn on_real_gpus_matches_transformers() {
    let (encoder, llm) = real_gpus();
    check_model_on("qwen2-vl", "model", &encoder, &llm);
    check_model_on("qwen2.5-vl", "model", &encoder, &llm);
    let model = Qwen2Vl::load(&family_dir("qwen2-vl").join("model-bf16"), &encoder, &llm).unwrap();
    let g = Goldens::load_file("qwen2-vl", "goldens-bf16.safetensors");
    let run = image_prompt(&model, &g);
    let vs_f32 = relative_error(&run.logits, g.f32("image_prompt.logits").1);
    let vs_bf16 = relative_error(&run.logits, g.f32("bf16_compute.image_prompt.logits").1);
    eprintln!(
        "GPU bf16: logits vs transformers f32 compute {vs_f32:.2e}, bf16 compute {vs_bf16:.2e}"
    );
    assert!(vs_f32 < 1e-2 && vs_bf16 < 3e-2);
}
