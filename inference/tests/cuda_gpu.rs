//! The CUDA backend on a real GPU (the GPU bundle's `run.sh`, see `./dev gpu-bundle`; never run in
//! this project's CI, which has none): every operation against the CPU backend, as the simulator
//! checks it in `cuda_backend.rs`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use mmgate_inference::backend::cuda::{CudaBackend, DriverDevice};

#[test]
#[ignore = "needs an NVIDIA GPU: the GPU bundle's run.sh"]
fn every_op_matches_the_cpu_backend_on_a_gpu() {
    let gpu = CudaBackend::new(DriverDevice::open("gpu-check", 0).unwrap());
    eprintln!("{}", mmgate_inference::Backend::name(&gpu));
    common::gpu_ops::every_op_matches_the_cpu_backend(&gpu);
}
