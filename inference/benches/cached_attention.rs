//! One attention step over a KV cache at long context on the CPU, one thread: the last 512
//! positions of an 8 192-token prompt (the demo LLM's heads: 4 query heads over 2 KV heads of 32),
//! on the f32 kernels and, where the CPU has them, AMX tiles. The inner loop of a long prefill,
//! timed alone.
//!
//!     cargo bench -p mmgate-inference --bench cached_attention

use std::time::{Duration, Instant};

use mmgate_inference::Result;
use mmgate_inference::backend::cpu::{CpuBackend, CpuBuffer};
use mmgate_inference::backend::{AttentionMask, AttentionShape, Backend, KvLayout};

const CONTEXT: usize = 8_192;
const ROWS: usize = 512;
const ROUNDS: usize = 30;

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
    Ok(())
}
