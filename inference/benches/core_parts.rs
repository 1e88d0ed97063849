//! The two halves of the P13 prefill (bench/core.py) on the Qwen2-VL-2B-shaped random checkpoint,
//! in process and on every core: the vision tower encoding one 448x448 image (1 024 patches), and
//! the LLM prefilling 2 048 text tokens in chunks of 512. Tells which half a change moved.
//!
//!     MMGATE_CHECKPOINT_2B=<dir made by bench/checkpoint_2b.py> \
//!         cargo bench -p mmgate-inference --bench core_parts [-- vision|llm]
//!
//! (`vision` or `llm` times that half alone.)

mod common;

use std::time::Instant;

use mmgate_inference::models::Qwen2Vl;
use mmgate_inference::rope::Grid;
use mmgate_inference::{CpuBackend, Result, Tensor};

use common::{qwen2_vl_engine, ttft};

const ROUNDS: usize = 3;

/// The `mmgate` binary's allocator (see `linear_precision`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> Result<()> {
    let Some(dir) = std::env::var_os("MMGATE_CHECKPOINT_2B") else {
        println!(
            "core_parts: set MMGATE_CHECKPOINT_2B to the checkpoint bench/checkpoint_2b.py made"
        );
        return Ok(());
    };
    let dir = std::path::PathBuf::from(dir);
    let only = std::env::args()
        .skip(1)
        .find(|a| a == "vision" || a == "llm");
    let timed = |part: &str| only.as_deref().is_none_or(|o| o == part);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let enc_dev = CpuBackend::new("enc", threads)?;
    let llm_dev = CpuBackend::new("llm", threads)?;
    let model: Qwen2Vl<CpuBackend, CpuBackend> = Qwen2Vl::load(&dir, &enc_dev, &llm_dev)?;
    let side = 32;
    let patch_len = model.vision.config().patch_len();
    let pixels: Vec<f32> = (0..side * side * patch_len)
        .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 2e-3)
        .collect();
    let grid = Grid {
        t: 1,
        h: side,
        w: side,
    };
    let mut best = f64::MAX;
    for _ in 0..if std::env::var("PART").is_ok_and(|p| p == "llm") {
        0
    } else {
        ROUNDS
    } {
        let start = Instant::now();
        let input = Tensor::from_host(&enc_dev, &pixels, &[side * side, patch_len])?;
        std::hint::black_box(model.vision.encode(&input, &[grid])?.to_host()?);
        best = best.min(start.elapsed().as_secs_f64());
    }
    if timed("vision") {
        println!(
            "vision tower, {} patches on {threads} threads: {best:.2} s (best of {ROUNDS})",
            side * side
        );
    }
    if !timed("llm") {
        return Ok(());
    }
    let (engine, text, _pool) = qwen2_vl_engine(model, &dir, 1, 4096)?;
    let sentence = text.encode("Describe the weather in the garden today, please. ")?;
    let prompt: Vec<u32> = sentence.iter().copied().cycle().take(2048).collect();
    let mut best = f64::MAX;
    for _ in 0..ROUNDS {
        best = best.min(ttft(&engine, &prompt)?.as_secs_f64());
    }
    println!(
        "LLM prefill, {} tokens on {threads} threads: {best:.2} s, {:.1} tok/s (best of {ROUNDS})",
        prompt.len(),
        prompt.len() as f64 / best
    );
    Ok(())
}
