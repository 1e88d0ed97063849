//! The CUDA backend's speed on a real GPU, for `bench/gpu.py` (which runs PyTorch eager on the same
//! bf16 weights in the same run and prints the ratios): a Qwen2-VL checkpoint's vision tower on one
//! 1280×960 image, the LLM's prefill of 1024 tokens, and its decode per token.
//!
//!     cargo bench -p mmgate-inference --bench gpu -- MODEL_DIR
//!
//! Prints one JSON line of medians in milliseconds. Fails with one line where there is no GPU
//! (never run in this project's CI, which has none).

use std::time::{Duration, Instant};

use mmgate_inference::Tensor;
use mmgate_inference::backend::cuda::{CudaBackend, DriverDevice, device_count};
use mmgate_inference::models::Qwen2Vl;
use mmgate_inference::rope::Grid;

fn median(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64() * 1e3
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .ok_or("usage: cargo bench -p mmgate-inference --bench gpu -- MODEL_DIR")?;
    let gpus = device_count()?;
    let open = |label: &str, n: usize| DriverDevice::open(label, n).map(CudaBackend::new);
    let encoder = open("encoder", if gpus > 1 { 1 } else { 0 })?;
    let llm = open("llm", 0)?;
    let model = Qwen2Vl::load(std::path::Path::new(&dir), &encoder, &llm)?;

    // 1280×960 as Qwen2-VL's processor resizes it: 952×1288 → 68×92 patches of 14.
    let grid = Grid { t: 1, h: 68, w: 92 };
    let patch = model.config.vision.patch_len();
    let pixels: Vec<f32> = (0..grid.patches() * patch)
        .map(|i| ((i % 251) as f32 / 125.0) - 1.0)
        .collect();
    let mut vision = Vec::new();
    for round in 0..12 {
        let start = Instant::now();
        let x = Tensor::from_host(&encoder, &pixels, &[grid.patches(), patch])?;
        let features = model.vision.encode(&x, &[grid])?;
        features.to_host()?; // waits for the stream
        if round >= 2 {
            vision.push(start.elapsed());
        }
    }

    let vocab = model.config.text.vocab_size as u32;
    let ids: Vec<u32> = (0..1024u32).map(|i| (i * 7919) % vocab).collect();
    let positions: Vec<[i64; 3]> = (0..ids.len() as i64).map(|p| [p; 3]).collect();
    let (mut prefill, mut decode) = (Vec::new(), Vec::new());
    for round in 0..6 {
        let mut cache = model.llm.new_cache(ids.len() + 65)?;
        let start = Instant::now();
        let h = model
            .llm
            .forward(model.llm.embed(&ids)?, &positions, &mut cache)?;
        let last = model
            .llm
            .logits(&h.slice_rows(ids.len() - 1, 1)?)?
            .to_host()?;
        if round >= 1 {
            prefill.push(start.elapsed());
        }
        let mut next = mmgate_inference::sampling::argmax(&last);
        let start = Instant::now();
        for _ in 0..64 {
            let pos = cache.len() as i64;
            let h = model
                .llm
                .forward(model.llm.embed(&[next])?, &[[pos; 3]], &mut cache)?;
            next = mmgate_inference::sampling::argmax(&model.llm.logits(&h)?.to_host()?);
        }
        if round >= 1 {
            decode.push(start.elapsed() / 64);
        }
    }
    println!(
        "{{\"device\": {:?}, \"vision_ms\": {:.3}, \"prefill_ms\": {:.3}, \"decode_ms_per_token\": {:.3}}}",
        mmgate_inference::Backend::name(&llm),
        median(vision),
        median(prefill),
        median(decode)
    );
    Ok(())
}
