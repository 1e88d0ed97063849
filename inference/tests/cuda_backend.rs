//! The CUDA backend without a GPU: every kernel, launched exactly as the backend launches it on a
//! GPU, runs on the CPU simulator of CUDA's execution model and must match the CPU backend on the
//! same inputs; every GEMM description goes through a reference with cuBLAS's semantics. Shapes are
//! small and odd on purpose (head_dim 80, rows that are not whole warps or blocks, grids of 3 blocks
//! that must loop grid-stride).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::gpu_ops;
use common::sim_device::SimDevice;
use mmgate_inference::backend::cuda::{Arg, CudaBackend, DType, Device, LaunchDims};
use mmgate_inference::{AttentionMask, AttentionShape, Backend, CpuBackend, Error};

type Sim = CudaBackend<SimDevice>;

fn backends() -> (CpuBackend, Sim) {
    (
        CpuBackend::new("reference", 1).unwrap(),
        CudaBackend::new(SimDevice::new("cuda:0")),
    )
}

fn random(seed: u64, n: usize) -> Vec<f32> {
    gpu_ops::random(seed, n)
}

fn up<B: Backend>(b: &B, v: &[f32]) -> B::Buffer {
    b.upload(v).unwrap()
}

/// Runs every backend operation on both devices, then checks that every kernel of the kernels
/// crate was launched at least once (a kernel no test runs is a kernel nobody has verified).
#[test]
fn every_kernel_matches_the_cpu_backend() {
    let gpu: Sim = CudaBackend::new(SimDevice::new("cuda:0"));
    gpu_ops::every_op_matches_the_cpu_backend(&gpu);

    let record = gpu.device().record.lock().unwrap();
    let missing: Vec<&str> = mmgate_cuda_kernels::kernels()
        .filter(|k| !record.launches.contains_key(k))
        .collect();
    assert!(missing.is_empty(), "kernels no test launched: {missing:?}");
    // Each linear is one GEMM; the bf16 ones take bf16 operands and write f32.
    assert_eq!(record.gemms.len(), 4);
    assert_eq!(
        record
            .gemms
            .iter()
            .filter(|g| g.a_type == DType::Bf16)
            .count(),
        2
    );
}

#[test]
fn bad_shapes_are_errors_before_any_launch() {
    let (cpu, gpu) = backends();
    let table = up(&gpu, &random(1, 12));
    // A token id outside the table: the same input error as the CPU backend's.
    let err = gpu.gather_rows(&table, 4, &[1, 3]).unwrap_err();
    let cpu_err = cpu
        .gather_rows(&up(&cpu, &random(1, 12)), 4, &[1, 3])
        .unwrap_err();
    assert!(matches!(err, Error::Input(_)), "{err}");
    assert_eq!(err.to_string(), cpu_err.to_string());
    assert!(matches!(
        gpu.linear(&up(&gpu, &[1.0; 6]), &up(&gpu, &[1.0; 6]), None, [2, 4, 2]),
        Err(Error::Shape { .. })
    ));
    let wide = AttentionShape {
        q_rows: 1,
        kv_rows: 1,
        heads: 1,
        kv_heads: 1,
        head_dim: 512,
        scale: 1.0,
        mask: AttentionMask::Causal { first_query: 0 },
    };
    let q = up(&gpu, &[0.0; 512]);
    assert!(matches!(
        gpu.attention(&q, &q, &q, &wide),
        Err(Error::Shape { .. })
    ));
    let launched = gpu.device().record.lock().unwrap().launches.len();
    assert_eq!(launched, 0, "a refused call launched a kernel");
}

#[test]
fn the_simulator_refuses_launches_a_gpu_would_refuse() {
    let device = SimDevice::new("cuda:0");
    let mut mem = device.alloc_zeroed(4).unwrap();
    let too_many = LaunchDims {
        grid: [1, 1, 1],
        block: [2048, 1, 1],
    };
    let err = device
        .launch(
            "add_assign",
            too_many,
            &mut [Arg::U64(0), Arg::Out(&mut mem), Arg::U64(0)],
        )
        .unwrap_err();
    assert!(err.to_string().contains("1024 threads"), "{err}");
}
