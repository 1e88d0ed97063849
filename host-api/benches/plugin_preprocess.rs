//! A built-in plugin through the host, timed on one core: probe + plan + preprocess, each in a fresh
//! store as the gateway runs them.
//!
//!     cargo bench -p mmgate-host --bench plugin_preprocess -- MODALITY FILE CONFIG.json ITERATIONS
//!
//! Prints one JSON line: {"file", "wasm_ms_median", "tokens"}. The scripts in `bench/` run it beside
//! the same code built natively (`plugins/native-bench`) and HF's processors, and print the ratios.

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
    let [modality, file, config, iterations] = args.as_slice() else {
        eprintln!("usage: plugin_preprocess MODALITY FILE CONFIG.json ITERATIONS (see bench/)");
        return;
    };
    let media = Media {
        data: std::fs::read(file).unwrap(),
        mime_type: None,
    };
    let config = std::fs::read_to_string(config).unwrap();
    let iterations: usize = iterations.parse::<usize>().unwrap().max(1);
    let sandbox = Arc::new(Sandbox::new(SandboxLimits::default()).unwrap());
    let registry = PluginRegistry::builtin(&sandbox).unwrap();
    let plugin = registry.for_modality(modality).unwrap();
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
        "{{\"file\": {file:?}, \"wasm_ms_median\": {:.3}, \"tokens\": {tokens}}}",
        samples[samples.len() / 2]
    );
}
