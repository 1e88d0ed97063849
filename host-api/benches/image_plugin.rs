//! The built-in image plugin through the host, timed on one core: probe + plan + preprocess, each in
//! a fresh store as the gateway runs them.
//!
//!     cargo bench -p mmgate-host --bench image_plugin -- IMAGE CONFIG.json ITERATIONS
//!
//! Prints one JSON line: {"image", "wasm_ms_median", "tokens"}. `bench/image.py` runs it beside the
//! same code built natively and HF's processors, and prints the ratios.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Instant;

use mmgate_host::{Budget, Media, PluginRegistry, Sandbox, SandboxLimits};

fn main() {
    // `cargo bench` appends `--bench`; everything else is ours.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let [image, config, iterations] = args.as_slice() else {
        eprintln!("usage: image_plugin IMAGE CONFIG.json ITERATIONS (see bench/image.py)");
        return;
    };
    let media = Media {
        data: std::fs::read(image).unwrap(),
        mime_type: None,
    };
    let config = std::fs::read_to_string(config).unwrap();
    let iterations: usize = iterations.parse::<usize>().unwrap().max(1);
    let sandbox = Arc::new(Sandbox::new(SandboxLimits::default()).unwrap());
    let registry = PluginRegistry::builtin(&sandbox).unwrap();
    let plugin = registry.for_modality("image").unwrap();
    let budget = Budget {
        max_tokens: u32::MAX,
    };
    let run = || {
        let info = plugin.probe(&media).unwrap();
        let plan = plugin.plan(&info, budget, &config).unwrap();
        let tensors = plugin.preprocess(&media, &plan, &config).unwrap();
        (plan.tokens, tensors)
    };
    let (tokens, _) = run();
    let mut samples: Vec<f64> = (0..iterations)
        .map(|_| {
            let start = Instant::now();
            std::hint::black_box(run());
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    println!(
        "{{\"image\": {image:?}, \"wasm_ms_median\": {:.3}, \"tokens\": {tokens}}}",
        samples[samples.len() / 2]
    );
}
