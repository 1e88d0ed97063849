//! What the CUDA backend needs from a device: memory, kernel launches and GEMMs, described the way
//! the driver and cuBLAS take them. [`super::driver::DriverDevice`] is the real GPU through
//! `cudarc`; the tests run the same backend on a simulated device (the kernels executed on the CPU
//! by `mmgate-cuda-kernels`' simulator, GEMMs by a reference with cuBLAS's column-major semantics),
//! so everything above this trait is exercised without a GPU.

use crate::error::{Error, Result};

/// Element types crossing the device boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F32,
    /// bfloat16: checkpoint weights kept at half the memory, and a GEMM's converted input.
    Bf16,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 => 2,
        }
    }
}

/// A kernel launch's grid and block (x, y, z). No kernel uses dynamic shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchDims {
    pub grid: [u32; 3],
    pub block: [u32; 3],
}

/// One kernel argument: a device buffer read or written, or a scalar. The kernel's C signature
/// decides which; the backend passes exactly that (checked by the tests, which run every launch
/// through the simulator).
pub enum Arg<'a, M> {
    In(&'a M),
    Out(&'a mut M),
    U32(u32),
    I32(i32),
    U64(u64),
    F32(f32),
}

/// A transpose flag of a cuBLAS call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    N,
    T,
}

/// One `cublasGemmEx` call, column-major as cuBLAS sees it:
/// `C[m, n] = alpha · op(A)[m, k] · op(B)[k, n] + beta · C`, with A stored `lda`-strided as
/// `m × k` (or `k × m` when transposed), B as `k × n` (or `n × k`), C as `m × n`. Accumulation and
/// the scalars are f32 (`CUBLAS_COMPUTE_32F`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GemmCall {
    pub transa: Op,
    pub transb: Op,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub alpha: f32,
    pub beta: f32,
    pub a_type: DType,
    pub lda: usize,
    pub b_type: DType,
    pub ldb: usize,
    pub c_type: DType,
    pub ldc: usize,
}

impl GemmCall {
    /// The checks cuBLAS makes (it returns `CUBLAS_STATUS_INVALID_VALUE` for them) and the ones it
    /// cannot make (that every element the call touches lies inside the buffers given): a call
    /// that passes reads and writes only its buffers.
    pub fn validate(&self, a_bytes: usize, b_bytes: usize, c_bytes: usize) -> Result<()> {
        let bad = |what: String| Err(Error::shape("gemm", format!("{what} in {self:?}")));
        let int = |v: usize| v <= i32::MAX as usize;
        if self.m == 0 || self.n == 0 || self.k == 0 {
            return bad("an empty dimension".into());
        }
        if ![self.m, self.n, self.k, self.lda, self.ldb, self.ldc]
            .into_iter()
            .all(int)
        {
            return bad("a dimension past i32".into());
        }
        let types_ok = match (self.a_type, self.b_type) {
            (DType::F32, DType::F32) => self.c_type == DType::F32,
            (DType::Bf16, DType::Bf16) => true,
            _ => false,
        };
        if !types_ok {
            return bad("a type combination cublasGemmEx has no kernel for".into());
        }
        // Stored shapes (rows × columns, column-major).
        let (a_rows, a_cols) = match self.transa {
            Op::N => (self.m, self.k),
            Op::T => (self.k, self.m),
        };
        let (b_rows, b_cols) = match self.transb {
            Op::N => (self.k, self.n),
            Op::T => (self.n, self.k),
        };
        for (name, ld, rows, cols, dtype, bytes) in [
            ("A", self.lda, a_rows, a_cols, self.a_type, a_bytes),
            ("B", self.ldb, b_rows, b_cols, self.b_type, b_bytes),
            ("C", self.ldc, self.m, self.n, self.c_type, c_bytes),
        ] {
            if ld < rows.max(1) {
                return bad(format!("ld{name} {ld} below its {rows} rows"));
            }
            let elements = ld * (cols - 1) + rows;
            if elements * dtype.size() > bytes {
                return bad(format!(
                    "{name} reaches element {elements} of a {bytes}-byte buffer"
                ));
            }
        }
        Ok(())
    }
}

/// A CUDA device as the backend uses it. Work is ordered as issued (one stream per device); only
/// `download` waits for it.
pub trait Device: Send + Sync + 'static {
    /// Device memory: one allocation, freed on drop.
    type Mem: Send + Sync + 'static;

    fn name(&self) -> String;
    /// Most blocks an element-wise launch uses (its kernels loop grid-stride, so this is a tuning
    /// choice, not a correctness one).
    fn max_blocks(&self) -> u32;
    fn alloc_zeroed(&self, bytes: usize) -> Result<Self::Mem>;
    fn upload(&self, bytes: &[u8]) -> Result<Self::Mem>;
    fn download(&self, mem: &Self::Mem, out: &mut [u8]) -> Result<()>;
    /// Bytes of `mem`.
    fn size(&self, mem: &Self::Mem) -> usize;
    /// Copies `bytes` bytes from `src` at `src_offset` to `dst` at `dst_offset` (device to device).
    fn copy(
        &self,
        src: &Self::Mem,
        src_offset: usize,
        dst: &mut Self::Mem,
        dst_offset: usize,
        bytes: usize,
    ) -> Result<()>;
    /// Launches `kernel` (a name from `mmgate_cuda_kernels::MODULES`).
    fn launch(
        &self,
        kernel: &'static str,
        dims: LaunchDims,
        args: &mut [Arg<'_, Self::Mem>],
    ) -> Result<()>;
    /// Runs a validated GEMM.
    fn gemm(&self, call: &GemmCall, a: &Self::Mem, b: &Self::Mem, c: &mut Self::Mem) -> Result<()>;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn linear_call(m: usize, k: usize, n: usize) -> GemmCall {
        // y[m, n] = x[m, k] · w[n, k]ᵀ, as the backend describes it.
        GemmCall {
            transa: Op::T,
            transb: Op::N,
            m: n,
            n: m,
            k,
            alpha: 1.0,
            beta: 0.0,
            a_type: DType::F32,
            lda: k,
            b_type: DType::F32,
            ldb: k,
            c_type: DType::F32,
            ldc: n,
        }
    }

    #[test]
    fn gemm_validation_checks_strides_extents_and_types() {
        let call = linear_call(3, 4, 5);
        assert!(call.validate(4 * 20, 4 * 12, 4 * 15).is_ok());
        // One element short in each buffer.
        assert!(call.validate(4 * 19, 4 * 12, 4 * 15).is_err());
        assert!(call.validate(4 * 20, 4 * 11, 4 * 15).is_err());
        assert!(call.validate(4 * 20, 4 * 12, 4 * 14).is_err());
        // A leading dimension below the stored rows.
        assert!(
            GemmCall { lda: 3, ..call }
                .validate(1 << 20, 1 << 20, 1 << 20)
                .is_err()
        );
        assert!(
            GemmCall { ldc: 4, ..call }
                .validate(1 << 20, 1 << 20, 1 << 20)
                .is_err()
        );
        // Mixed input types have no cuBLAS kernel; bf16 inputs may write f32.
        let mixed = GemmCall {
            a_type: DType::Bf16,
            ..call
        };
        assert!(mixed.validate(1 << 20, 1 << 20, 1 << 20).is_err());
        let bf16 = GemmCall {
            a_type: DType::Bf16,
            b_type: DType::Bf16,
            ..call
        };
        assert!(bf16.validate(2 * 20, 2 * 12, 4 * 15).is_ok());
        assert!(
            GemmCall { m: 0, ..call }
                .validate(1 << 20, 1 << 20, 1 << 20)
                .is_err()
        );
    }
}
