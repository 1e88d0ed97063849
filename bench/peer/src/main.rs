//! `mmgate-peer-bench IMAGE PREPROCESSOR_CONFIG ITERATIONS`: `llm-multimodal`'s Qwen2-VL image path
//! (libjpeg-turbo decode when the library is present, then its processor) on one core, the median of
//! ITERATIONS runs after one warm-up, as one JSON line: `{"peer_ms_median", "tokens",
//! "turbojpeg"}`.

use std::time::Instant;

use anyhow::{Context, bail};
use llm_multimodal::vision::PreProcessorConfig;
use llm_multimodal::vision::processor::VisionPreProcessor;
use llm_multimodal::vision::processors::Qwen2VLProcessor;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let [_, image, config, iterations] = args.as_slice() else {
        bail!("usage: mmgate-peer-bench IMAGE PREPROCESSOR_CONFIG ITERATIONS");
    };
    let iterations: usize = iterations.parse().context("ITERATIONS")?;
    // One core, as every other row of the benchmark.
    llm_multimodal::configure_parallelism(llm_multimodal::Parallelism::Inline)
        .map_err(|current| anyhow::anyhow!("parallelism already set to {current:?}"))?;
    let bytes = std::fs::read(image).with_context(|| format!("reading {image}"))?;
    let config = PreProcessorConfig::from_json(
        &std::fs::read_to_string(config).with_context(|| format!("reading {config}"))?,
    )
    .map_err(|e| anyhow::anyhow!("the preprocessor config: {e}"))?;
    let processor = Qwen2VLProcessor::from_preprocessor_config(&config);
    let turbojpeg = llm_multimodal::jpeg_turbo::turbojpeg_available();
    let run = || -> anyhow::Result<usize> {
        let decoded = llm_multimodal::jpeg_turbo::decode_jpeg_rgb(&bytes)
            .map(Ok)
            .unwrap_or_else(|| image_decode(&bytes))?;
        let out = processor
            .preprocess(&[decoded], &config)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(out.feature_token_counts.iter().sum())
    };
    let tokens = run()?;
    let mut samples = Vec::with_capacity(iterations);
    for _ in 0..iterations {
        let started = Instant::now();
        run()?;
        samples.push(started.elapsed().as_secs_f64() * 1e3);
    }
    samples.sort_by(f64::total_cmp);
    let median = samples[samples.len() / 2];
    println!(
        "{}",
        serde_json::json!({"peer_ms_median": median, "tokens": tokens, "turbojpeg": turbojpeg})
    );
    Ok(())
}

/// The `image` crate's decoder, as the peer falls back to without libjpeg-turbo.
fn image_decode(bytes: &[u8]) -> anyhow::Result<image::DynamicImage> {
    image::load_from_memory(bytes).context("decoding the image")
}
