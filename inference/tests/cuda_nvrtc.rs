//! Every kernel compiles under NVRTC for the GPUs the backend targets first (Ampere sm_80, Hopper
//! sm_90), without a GPU: only `libnvrtc.so` is needed, which `./dev test` installs from PyPI's
//! `nvidia-cuda-nvrtc-cu12` wheel and puts on the library path.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use mmgate_inference::backend::cuda::{compile_module, nvrtc_available};

#[test]
fn every_kernel_compiles_under_nvrtc_for_sm80_and_sm90() {
    assert!(
        nvrtc_available(),
        "NVRTC (libnvrtc.so.12) is not on the library path: `./dev test` installs PyPI's \
         nvidia-cuda-nvrtc-cu12 and sets LD_LIBRARY_PATH (or point LD_LIBRARY_PATH at a CUDA \
         toolkit's lib64)"
    );
    for arch in ["sm_80", "sm_90"] {
        for module in mmgate_cuda_kernels::MODULES {
            let ptx = compile_module(module, arch)
                .unwrap_or_else(|e| panic!("{}.cu for {arch}: {e}", module.name));
            assert!(
                ptx.contains(&format!(".target {arch}")),
                "{}.cu: PTX not for {arch}",
                module.name
            );
            for kernel in module.kernels {
                assert!(
                    ptx.contains(&format!(".entry {kernel}(")),
                    "{}.cu for {arch}: no entry point {kernel}",
                    module.name
                );
            }
            eprintln!(
                "{arch} {}.cu: {} kernels, {} bytes of PTX",
                module.name,
                module.kernels.len(),
                ptx.len()
            );
        }
    }
}

#[test]
fn a_kernel_that_does_not_compile_is_an_error_with_the_compiler_log() {
    let broken = mmgate_cuda_kernels::Module {
        name: "broken",
        source: "extern \"C\" __global__ void broken(float* x) { x[0] = undefined_name; }",
        kernels: &["broken"],
    };
    let err = compile_module(&broken, "sm_80").unwrap_err().to_string();
    assert!(err.contains("undefined_name"), "{err}");
}
