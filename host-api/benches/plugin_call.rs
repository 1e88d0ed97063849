//! Plugin call overhead: `cargo bench -p mmgate-host --bench plugin_call`.
//!
//! Each case runs a fresh store + instantiation + one call, as the gateway does per request step, and is
//! printed beside the same work done natively in this run (copying the bytes in and out), so the ratio
//! and the difference are the sandbox's own cost.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mmgate_host::builtin::artifact_dir;
use mmgate_host::{LoadedPlugin, Media, PluginOrigin, Sandbox, SandboxLimits, TokenPlan};

/// Median time of `f` over enough runs to fill `budget` (at least 5).
fn median(budget: Duration, mut f: impl FnMut()) -> Duration {
    for _ in 0..3 {
        f();
    }
    let mut samples = Vec::new();
    let start = Instant::now();
    while samples.len() < 5 || (start.elapsed() < budget && samples.len() < 100_000) {
        let t = Instant::now();
        f();
        samples.push(t.elapsed());
    }
    samples.sort();
    samples[samples.len() / 2]
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn main() {
    let sandbox = Arc::new(Sandbox::new(SandboxLimits::default()).unwrap());
    let path = artifact_dir().join("testing.wasm");
    let bytes = std::fs::read(&path).unwrap();
    let plugin = LoadedPlugin::load(sandbox, &bytes, PluginOrigin::File(path)).unwrap();
    let plan = TokenPlan {
        tokens: 1,
        reduced: false,
        reason: String::new(),
        choices: "{}".into(),
    };
    let budget = Duration::from_secs(2);

    println!("plugin call overhead (median; native = the same bytes copied in and out in-process)");
    println!(
        "{:<34} {:>12} {:>12} {:>10} {:>12}",
        "case", "wasm µs", "native µs", "ratio", "overhead µs"
    );
    let trivial = median(budget, || {
        black_box(plugin.describe().unwrap());
    });
    let native_trivial = median(budget, || {
        black_box(String::from("testing").clone());
    });
    report("instantiate + describe()", trivial, native_trivial);

    for size in [1usize << 20, 16 << 20] {
        let mut data = b"echo".to_vec();
        data.resize(size, 0xab);
        let media = Media {
            data,
            mime_type: None,
        };
        let wasm = median(budget, || {
            let out = plugin.preprocess(&media, &plan, "{}").unwrap();
            black_box(out);
        });
        let native = median(budget, || {
            // In: the host copies the media into guest memory; out: it copies the tensor back.
            let inside = black_box(media.data.clone());
            black_box(inside.clone());
        });
        report(
            &format!("preprocess echo {} MiB in + out", size >> 20),
            wasm,
            native,
        );
    }
}

fn report(case: &str, wasm: Duration, native: Duration) {
    println!(
        "{case:<34} {:>12.1} {:>12.1} {:>9.1}x {:>12.1}",
        micros(wasm),
        micros(native),
        wasm.as_secs_f64() / native.as_secs_f64().max(1e-9),
        micros(wasm.saturating_sub(native)),
    );
}
