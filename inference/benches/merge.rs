//! Merge throughput: writing 5 000 encoder embeddings of width 4096 into a prompt's embeddings at
//! their placeholder rows (as the engine does), against a plain memcpy of the same bytes, measured in
//! the same run. Prints bytes/s of both and their ratio (goal: merge ≥ 50 % of memcpy).
//!
//!     cargo bench -p mmgate-inference --bench merge

use std::time::{Duration, Instant};

use mmgate_inference::merge::PlaceholderMap;
use mmgate_inference::{CpuBackend, Result, Tensor};

const HIDDEN: usize = 4096;
const MEDIA_TOKENS: usize = 5000;

fn best_of(runs: usize, mut f: impl FnMut() -> Result<()>) -> Result<Duration> {
    let mut best = Duration::MAX;
    for _ in 0..runs {
        let start = Instant::now();
        f()?;
        best = best.min(start.elapsed());
    }
    Ok(best)
}

fn main() -> Result<()> {
    let dev = CpuBackend::new("bench", 1)?;
    // A prompt of text, two images (3 000 and 2 000 tokens) and more text.
    let (placeholder, text) = (7u32, 1u32);
    let mut ids = vec![text; 100];
    ids.extend(std::iter::repeat_n(placeholder, 3000));
    ids.extend(std::iter::repeat_n(text, 50));
    ids.extend(std::iter::repeat_n(placeholder, 2000));
    ids.extend(std::iter::repeat_n(text, 50));
    let map = PlaceholderMap::build(&ids, placeholder, &[3000, 2000])?;
    let a = Tensor::from_host(&dev, &vec![0.5f32; 3000 * HIDDEN], &[3000, HIDDEN])?;
    let b = Tensor::from_host(&dev, &vec![0.25f32; 2000 * HIDDEN], &[2000, HIDDEN])?;
    let mut embeds = Tensor::zeros(&dev, &[ids.len(), HIDDEN])?;

    let src = vec![0.5f32; MEDIA_TOKENS * HIDDEN];
    let mut dst = vec![0.0f32; MEDIA_TOKENS * HIDDEN];
    let bytes = (MEDIA_TOKENS * HIDDEN * 4) as f64;
    let runs = 20;
    let memcpy = best_of(runs, || {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&dst);
        Ok(())
    })?;
    let merge = best_of(runs, || map.merge(&mut embeds, &[&a, &b]))?;
    let gbps = |d: Duration| bytes / d.as_secs_f64() / 1e9;
    println!(
        "merge of {MEDIA_TOKENS} x {HIDDEN} f32 ({:.0} MB), best of {runs}: merge {:.2} GB/s ({:.2} ms), memcpy {:.2} GB/s ({:.2} ms), merge/memcpy {:.0} %",
        bytes / 1e6,
        gbps(merge),
        merge.as_secs_f64() * 1e3,
        gbps(memcpy),
        memcpy.as_secs_f64() * 1e3,
        100.0 * memcpy.as_secs_f64() / merge.as_secs_f64()
    );
    Ok(())
}
