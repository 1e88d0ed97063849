//! The image plugin's code built natively, timed on one core: the baseline for the sandbox's cost.
//!
//!     cargo run --release --example native_bench -- IMAGE CONFIG.json ITERATIONS
//!
//! Prints one JSON line: {"image", "native_ms_median", "tokens"}. Run by `bench/image.py`.

use std::time::Instant;

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().collect();
    let [_, image, config, iterations] = args.as_slice() else {
        return Err("usage: native_bench IMAGE CONFIG.json ITERATIONS".into());
    };
    let data = std::fs::read(image).map_err(|e| format!("{image}: {e}"))?;
    let config = std::fs::read_to_string(config).map_err(|e| format!("{config}: {e}"))?;
    let iterations: usize = iterations
        .parse::<usize>()
        .map_err(|e| format!("{e}"))?
        .max(1);
    let run = || {
        mmgate_image_plugin::preprocess_bytes(data.clone(), &config, u32::MAX)
            .map_err(|e| format!("{e:?}"))
    };
    let (plan, _) = run()?;
    let mut samples = Vec::with_capacity(iterations);
    for _ in 0..iterations {
        let start = Instant::now();
        std::hint::black_box(run()?);
        samples.push(start.elapsed().as_secs_f64() * 1e3);
    }
    samples.sort_by(f64::total_cmp);
    println!(
        "{{\"image\": {image:?}, \"native_ms_median\": {:.3}, \"tokens\": {}}}",
        samples[samples.len() / 2],
        plan.tokens
    );
    Ok(())
}
