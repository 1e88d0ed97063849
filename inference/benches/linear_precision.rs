//! The CPU linear with bf16 weights (kept half size, widened a block of rows at a time inside the
//! linear) against the same linear with f32 weights, in the same run, one thread: decode (one row,
//! and batches of 8 to 32 rows) and prefill (256 rows, and 512: a prefill chunk) through a
//! Qwen2-VL-2B-sized MLP projection. Where the CPU has AVX-512 BF16, also the bf16 weights with
//! the input rounded to bf16 (`cpu_bf16_inputs`).
//!
//!     cargo bench -p mmgate-inference --bench linear_precision [-- THREADS]
//!
//! (`THREADS` runs the linears on that many threads instead of one; `MMGATE_CPU_AVX512=0` runs
//! them on the AVX2 kernels.)

use std::time::{Duration, Instant};

use mmgate_inference::backend::Values;
use mmgate_inference::{Backend, CpuBackend, Result, Tensor};

/// The `mmgate` binary's allocator. Under the system allocator the `gemm` crate's packing buffers,
/// allocated every call, were unmapped and mapped again with their page faults once smaller
/// products had run first: 512 rows on two threads took 1.44–1.51x the f32 time after the smaller
/// sizes and 0.99–1.00x as the first size (1.02x in order with glibc told to keep its memory).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn median(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64() * 1e3
}

fn main() -> Result<()> {
    let threads = std::env::args()
        .skip(1)
        .find_map(|a| a.parse::<usize>().ok())
        .unwrap_or(1);
    let dev = CpuBackend::new("bench", threads)?;
    let rounding = CpuBackend::new("bench-bf16", threads)?.with_bf16_inputs();
    println!("{threads} thread(s), {}", rounding.name());
    let (k, n) = (1536, 8960);
    let values: Vec<f32> = (0..n * k)
        .map(|i| ((i % 977) as f32 - 488.0) * 1e-3)
        .collect();
    let bf16: Vec<half::bf16> = values.iter().map(|&v| half::bf16::from_f32(v)).collect();
    let w32 = Tensor::from_weight(&dev, Values::F32(values), &[n, k])?;
    let w16 = Tensor::from_weight(&dev, Values::Bf16(bf16.clone()), &[n, k])?;
    let w16_rounding = Tensor::from_weight(&rounding, Values::Bf16(bf16), &[n, k])?;
    println!(
        "weights {n}x{k}: f32 {} MiB, bf16 {} MiB",
        w32.bytes() >> 20,
        w16.bytes() >> 20
    );
    for m in [1usize, 8, 16, 32, 256, 512] {
        let x = Tensor::from_host(&dev, &vec![0.01; m * k], &[m, k])?;
        let x_rounding = Tensor::from_host(&rounding, &vec![0.01; m * k], &[m, k])?;
        let mut times = [Vec::new(), Vec::new(), Vec::new()];
        // Interleaved, so all see the same machine state.
        for _ in 0..if m < 64 { 100 } else { 20 } {
            for (t, (x, w)) in
                times
                    .iter_mut()
                    .zip([(&x, &w32), (&x, &w16), (&x_rounding, &w16_rounding)])
            {
                let start = Instant::now();
                let y = x.linear(w, None)?;
                t.push(start.elapsed());
                std::hint::black_box(y.to_host()?);
            }
        }
        let [f32_ms, bf16_ms, rounded_ms] = times.map(median);
        println!(
            "{m:>4} rows: f32 weights {f32_ms:.3} ms, bf16 weights {bf16_ms:.3} ms ({:.2}x the f32 \
             time), bf16 weights and inputs {rounded_ms:.3} ms ({:.2}x)",
            bf16_ms / f32_ms,
            rounded_ms / f32_ms
        );
    }
    let _ = dev.name();
    Ok(())
}
