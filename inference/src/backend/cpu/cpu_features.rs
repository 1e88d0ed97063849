//! Which vector instructions the CPU kernels may use, decided at run time: the attention kernels
//! come compiled for AVX-512, AVX2 (with FMA) and plain SSE2, the half-precision rows and the
//! activations for AVX2 and SSE2, and each takes the widest this CPU runs; the bf16 GEMMs
//! (`bf16_gemm`) and bf16 attention (`attention_bf16`) need AVX-512 BF16.
//!
//! Set [`NO_AVX512_VAR`] to `0` to run as a CPU without AVX-512 would, on the same machine: the
//! attention on its AVX2 kernels (the same bits, only the time moves) and nothing in bf16.

use std::sync::OnceLock;

/// Set to `0`, the CPU kernels take their AVX2 paths even where the CPU has AVX-512.
pub const NO_AVX512_VAR: &str = "MMGATE_CPU_AVX512";

/// AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
pub fn has_avx2() -> bool {
    std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
}

/// AVX-512F and FMA (with AVX2, which every AVX-512 CPU has), unless [`NO_AVX512_VAR`] is `0`.
#[cfg(target_arch = "x86_64")]
pub fn has_avx512() -> bool {
    static ALLOWED: OnceLock<bool> = OnceLock::new();
    std::is_x86_feature_detected!("avx512f")
        && has_avx2()
        && *ALLOWED.get_or_init(|| std::env::var_os(NO_AVX512_VAR).is_none_or(|v| v != "0"))
}
