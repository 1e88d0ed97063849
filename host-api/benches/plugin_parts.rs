//! One item made whole vs in its plugin's parts (contract 0.4), through the host: the wall time of
//! `preprocess` on one thread, and of every `preprocess-part` on 1 and on 2 threads taking the
//! parts in order from a shared queue (as the gateway's plugin pool does). Each call in a fresh
//! store, as the gateway runs them; the plan is made once, outside the timing.
//!
//!     cargo bench -p mmgate-host --bench plugin_parts -- MODALITY FILE CONFIG.json ITERATIONS
//!
//! Prints one JSON line: {"file", "parts", "whole_ms", "parts_1_ms", "parts_2_ms",
//! "part_ms": [...], "model_ms": {"1": .., "2": .., "8": .., "16": ..}}. The model is the list
//! schedule of the parts' own one-thread times on N workers: what N cores would take if the parts
//! did not slow each other down (they share memory bandwidth and, on this machine, two cores).
//! `bench/parts.py` prints the table and the ratios.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use common::{Run, builtin, median_ms};
use mmgate_host::{Budget, LoadedPlugin, Media, SandboxLimits, TokenPlan};

fn main() {
    let Some(Run {
        modality,
        file,
        media,
        config,
        iterations,
    }) = Run::from_args("plugin_parts")
    else {
        return;
    };
    // A minute per call: a long item made whole takes longer than the default deadline allows.
    let limits = SandboxLimits {
        deadline_ms: 60_000,
        ..SandboxLimits::default()
    };
    let plugin = &builtin(&modality, limits);
    let info = plugin.probe(&media).unwrap();
    let budget = Budget {
        max_tokens: u32::MAX,
    };
    let plan = plugin.plan(&info, budget, &config).unwrap();
    let parts = plugin.parts(&plan, &config).unwrap();

    let whole = || plugin.preprocess(&media, &plan, &config).unwrap();
    // The item's main tensor (its largest), joined over the parts, is the whole's.
    let made = whole();
    let main = made.iter().max_by_key(|t| t.data.len()).unwrap();
    let joined: Vec<u8> = (0..parts)
        .flat_map(|i| {
            let part = plugin.preprocess_part(&media, &plan, &config, i).unwrap();
            part.into_iter().find(|t| t.name == main.name).unwrap().data
        })
        .collect();
    assert!(
        joined == main.data,
        "the parts make the whole's {}",
        main.name
    );

    let whole_ms = median_ms(iterations, whole);
    let parts_1_ms = median_ms(iterations, || {
        run_parts(plugin, &media, &plan, &config, parts, 1)
    });
    let parts_2_ms = median_ms(iterations, || {
        run_parts(plugin, &media, &plan, &config, parts, 2)
    });
    let part_ms: Vec<f64> = (0..parts)
        .map(|i| {
            median_ms(iterations, || {
                plugin.preprocess_part(&media, &plan, &config, i).unwrap()
            })
        })
        .collect();
    let model = [1usize, 2, 8, 16]
        .map(|workers| format!("\"{workers}\": {:.1}", list_schedule(&part_ms, workers)))
        .join(", ");
    let part_list = part_ms
        .iter()
        .map(|ms| format!("{ms:.1}"))
        .collect::<Vec<_>>()
        .join(", ");
    println!(
        "{{\"file\": {file:?}, \"parts\": {parts}, \"whole_ms\": {whole_ms:.1}, \"parts_1_ms\": {parts_1_ms:.1}, \"parts_2_ms\": {parts_2_ms:.1}, \"part_ms\": [{part_list}], \"model_ms\": {{{model}}}}}"
    );
}

/// Every part of the item on `threads` threads, each taking the next part in order.
fn run_parts(
    plugin: &Arc<LoadedPlugin>,
    media: &Media,
    plan: &TokenPlan,
    config: &str,
    parts: u32,
    threads: usize,
) {
    let next = AtomicU32::new(0);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                loop {
                    let index = next.fetch_add(1, Ordering::Relaxed);
                    if index >= parts {
                        break;
                    }
                    std::hint::black_box(
                        plugin.preprocess_part(media, plan, config, index).unwrap(),
                    );
                }
            });
        }
    });
}

/// When the last of `jobs` (their times, in order) ends on `workers` workers that each take the
/// next job as soon as they are free.
fn list_schedule(jobs: &[f64], workers: usize) -> f64 {
    let mut free_at = vec![0f64; workers.max(1)];
    for &job in jobs {
        let earliest = free_at
            .iter_mut()
            .min_by(|a, b| a.total_cmp(b))
            .expect("at least one worker");
        *earliest += job;
    }
    free_at.into_iter().fold(0.0, f64::max)
}
