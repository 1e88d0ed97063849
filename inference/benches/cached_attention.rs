//! One attention step over a KV cache at long context on the CPU, one thread: the last 512
//! positions of an 8 192-token prompt (the demo LLM's heads: 4 query heads over 2 KV heads of 32),
//! on the f32 kernels and, where the CPU has them, AMX tiles. The inner loop of a long prefill,
//! timed alone. Then an encoder's attention within its segments, the same two ways: one piece of a
//! 60 s 1080p video at the demo's 32k plan (8 temporal patches of 34 × 64 patches each, the demo
//! vision tower's 4 heads of 16).
//!
//!     cargo bench -p mmgate-inference --bench cached_attention

use std::time::{Duration, Instant};

use mmgate_inference::Result;
use mmgate_inference::backend::cpu::{CpuBackend, CpuBuffer};
use mmgate_inference::backend::{AttentionMask, AttentionShape, Backend, KvLayout};

const CONTEXT: usize = 8_192;
const ROWS: usize = 512;
const ROUNDS: usize = 30;
/// An encoder call's segments (temporal patches) and their rows (patches).
const SEGMENTS: usize = 8;
const SEGMENT_ROWS: usize = 34 * 64;

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / 4.3e9 - 0.5)
        .collect()
}

fn step_time(dev: &CpuBackend) -> Result<Duration> {
    let (heads, kv_heads, hd) = (4, 2, 32);
    let layout = KvLayout {
        capacity: CONTEXT,
        kv_heads,
        head_dim: hd,
    };
    let (mut keys, mut cached_values) = dev.kv_cache(&layout)?;
    let width = kv_heads * hd;
    dev.write_kv(
        (&mut keys, &mut cached_values),
        &layout,
        0,
        &CpuBuffer::F32(values(CONTEXT * width, 1)),
        &CpuBuffer::F32(values(CONTEXT * width, 2)),
    )?;
    let q = CpuBuffer::F32(values(ROWS * heads * hd, 3));
    let shape = AttentionShape {
        q_rows: ROWS,
        kv_rows: CONTEXT,
        heads,
        kv_heads,
        head_dim: hd,
        scale: 0.2,
        mask: AttentionMask::Causal {
            first_query: CONTEXT - ROWS,
        },
    };
    let mut best = Duration::MAX;
    for _ in 0..ROUNDS {
        let start = Instant::now();
        dev.attention_cached(&q, (&keys, &cached_values), &layout, &shape)?;
        best = best.min(start.elapsed());
    }
    Ok(best)
}

fn segments_time(dev: &CpuBackend) -> Result<Duration> {
    let (heads, hd) = (4, 16);
    let rows = SEGMENTS * SEGMENT_ROWS;
    let up = |seed| CpuBuffer::F32(values(rows * heads * hd, seed));
    let (q, k, v) = (up(4), up(5), up(6));
    let shape = AttentionShape {
        q_rows: rows,
        kv_rows: rows,
        heads,
        kv_heads: heads,
        head_dim: hd,
        scale: 0.25,
        mask: AttentionMask::segments([SEGMENT_ROWS; SEGMENTS]),
    };
    let mut best = Duration::MAX;
    for _ in 0..ROUNDS / 3 {
        let start = Instant::now();
        dev.attention(&q, &k, &v, &shape)?;
        best = best.min(start.elapsed());
    }
    Ok(best)
}

fn main() -> Result<()> {
    let dev = CpuBackend::new("bench", 1)?;
    // Query rows (every head) times keys: the last rows of a prompt see nearly all of them.
    let pairs = (ROWS * 4 * CONTEXT) as f64;
    let f32_time = step_time(&dev.clone().without_amx())?;
    println!(
        "cached attention, {ROWS} rows at {CONTEXT} keys, 1 thread: f32 kernels {:.2} ms ({:.2} ns a score)",
        f32_time.as_secs_f64() * 1e3,
        f32_time.as_secs_f64() * 1e9 / pairs
    );
    if dev.uses_amx() {
        let amx_time = step_time(&dev)?;
        println!(
            "  AMX tiles {:.2} ms ({:.2} ns a score): {:.2}x the f32 kernels' speed",
            amx_time.as_secs_f64() * 1e3,
            amx_time.as_secs_f64() * 1e9 / pairs,
            f32_time.as_secs_f64() / amx_time.as_secs_f64()
        );
    } else {
        println!("  (no AMX tiles on this CPU)");
    }
    let f32_time = segments_time(&dev.clone().without_amx())?;
    println!(
        "encoder attention, {SEGMENTS} segments of {SEGMENT_ROWS} rows, 1 thread: f32 kernels {:.1} ms",
        f32_time.as_secs_f64() * 1e3
    );
    if dev.uses_amx() {
        let amx_time = segments_time(&dev)?;
        println!(
            "  AMX tiles {:.1} ms: {:.2}x the f32 kernels' speed",
            amx_time.as_secs_f64() * 1e3,
            f32_time.as_secs_f64() / amx_time.as_secs_f64()
        );
    }
    Ok(())
}
