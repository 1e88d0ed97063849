//! The real GPU, through `cudarc` with the CUDA libraries loaded at run time: nothing CUDA is needed
//! to build mmgate, and a machine without a driver gets a clear error when a `cuda:N` device is
//! configured, never a crash at start-up.
//!
//! Kernels are compiled by NVRTC when the device opens, for that GPU's architecture. Work is issued
//! on one stream per device (ordered; `download` synchronises). cuBLAS runs the GEMMs.
//!
//! Never run on a GPU in this project's CI: what is verified there is everything up to these
//! calls (see the module above and `./dev gpu-check` for a machine with one).
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::{CudaBlas, result as blas, sys as blas_sys};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig,
    PinnedHostSlice, PushKernelArg, sys as driver_sys,
};
use cudarc::nvrtc::{CompileOptions, Ptx, compile_ptx_with_opts};

use super::device::{Arg, DType, Device, GemmCall, LaunchDims, Op};
use crate::error::{Error, Result};

/// Whether NVRTC (`libnvrtc.so`) can be loaded here: the kernels' compiler, needed by any CUDA
/// device and by the kernel compilation tests.
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to open the library by its names (no symbol is called).
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// NVRTC's PTX for one kernel module, compiled for `arch` (`sm_80`, `sm_90`, ...). Works without a
/// GPU: only `libnvrtc.so` is needed.
pub fn compile_module(module: &mmgate_cuda_kernels::Module, arch: &str) -> Result<String> {
    let failed = |reason: String| Error::Device {
        device: format!("nvrtc ({arch})"),
        reason,
    };
    if !nvrtc_available() {
        return Err(failed(
            "NVRTC (libnvrtc.so) cannot be loaded on this machine".into(),
        ));
    }
    let options = CompileOptions {
        options: vec![format!("--gpu-architecture={arch}")],
        name: Some(format!("{}.cu", module.name)),
        ..Default::default()
    };
    compile_ptx_with_opts(module.program(), options)
        .map(|ptx| ptx.to_src())
        .map_err(|e| failed(format!("compiling {}.cu: {e:?}", module.name)))
}

/// How many GPUs the driver sees; an error where there is no driver.
pub fn device_count() -> Result<usize> {
    let failed = |reason: String| Error::Device {
        device: "cuda".into(),
        reason,
    };
    if !driver_available() {
        return Err(failed(
            "the CUDA driver (libcuda.so) cannot be loaded on this machine".into(),
        ));
    }
    CudaContext::device_count()
        .map(|n| n.max(0) as usize)
        .map_err(|e| failed(format!("{e:?}")))
}

fn driver_available() -> bool {
    // SAFETY: as above, for libcuda.
    unsafe { driver_sys::is_culib_present() }
}

fn cublas_available() -> bool {
    // SAFETY: as above, for libcublas.
    unsafe { blas_sys::is_culib_present() }
}

/// Device memory: the allocation and the bytes asked for (zero-byte buffers hold one byte).
pub struct DeviceMem {
    slice: CudaSlice<u8>,
    bytes: usize,
}

/// Uploads of at least this many bytes go through the device's pinned staging buffer (page-locked
/// host memory the GPU reads by DMA at full speed; a pageable upload is staged by the driver).
const STAGED_UPLOAD_BYTES: usize = 1 << 20;
/// The staging buffer's size: larger uploads go through it in pieces.
const STAGING_BYTES: usize = 64 << 20;

pub struct DriverDevice {
    label: String,
    /// Pinned host memory for uploads, allocated on first use and reused.
    staging: std::sync::Mutex<Option<PinnedHostSlice<u8>>>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    functions: HashMap<&'static str, CudaFunction>,
    max_blocks: u32,
    context: Arc<CudaContext>,
}

fn failed(label: &str, what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Device {
        device: label.to_owned(),
        reason: format!("{what}: {e:?}"),
    }
}

impl DriverDevice {
    /// Opens GPU `ordinal` (as `cuda:N` names it) and compiles the kernels for it.
    pub fn open(label: &str, ordinal: usize) -> Result<Self> {
        let missing = |lib: &str| Error::Device {
            device: label.to_owned(),
            reason: format!(
                "cuda:{ordinal} is configured but {lib} cannot be loaded on this machine \
                 (no NVIDIA driver / CUDA libraries on the library path)"
            ),
        };
        if !driver_available() {
            return Err(missing("the CUDA driver (libcuda.so)"));
        }
        if !cublas_available() {
            return Err(missing("cuBLAS (libcublas.so)"));
        }
        if !nvrtc_available() {
            return Err(missing("NVRTC (libnvrtc.so)"));
        }
        let context =
            CudaContext::new(ordinal).map_err(|e| failed(label, &format!("cuda:{ordinal}"), e))?;
        let (major, minor) = context
            .compute_capability()
            .map_err(|e| failed(label, "compute capability", e))?;
        let sms = context
            .attribute(driver_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| failed(label, "multiprocessor count", e))?;
        let stream = context
            .new_stream()
            .map_err(|e| failed(label, "stream", e))?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| failed(label, "cuBLAS", e))?;
        let mut functions = HashMap::new();
        for module in mmgate_cuda_kernels::MODULES {
            let ptx = compile_module(module, &format!("sm_{major}{minor}"))?;
            let loaded = context
                .load_module(Ptx::from_src(ptx))
                .map_err(|e| failed(label, &format!("loading {}.cu", module.name), e))?;
            for &kernel in module.kernels {
                let f = loaded
                    .load_function(kernel)
                    .map_err(|e| failed(label, kernel, e))?;
                functions.insert(kernel, f);
            }
        }
        Ok(Self {
            label: format!("{label} (cuda:{ordinal}, sm_{major}{minor}, {sms} SMs)"),
            staging: std::sync::Mutex::new(None),
            stream,
            blas,
            functions,
            max_blocks: (sms.max(1) as u32) * 8,
            context,
        })
    }

    fn fail(&self, what: &str, e: impl std::fmt::Debug) -> Error {
        failed(&self.label, what, e)
    }
}

fn data_type(t: DType) -> blas_sys::cudaDataType {
    match t {
        DType::F32 => blas_sys::cudaDataType::CUDA_R_32F,
        DType::Bf16 => blas_sys::cudaDataType::CUDA_R_16BF,
    }
}

fn operation(op: Op) -> blas_sys::cublasOperation_t {
    match op {
        Op::N => blas_sys::cublasOperation_t::CUBLAS_OP_N,
        Op::T => blas_sys::cublasOperation_t::CUBLAS_OP_T,
    }
}

impl Device for DriverDevice {
    type Mem = DeviceMem;

    fn name(&self) -> String {
        self.label.clone()
    }

    fn max_blocks(&self) -> u32 {
        self.max_blocks
    }

    fn alloc_zeroed(&self, bytes: usize) -> Result<DeviceMem> {
        let slice = self
            .stream
            .alloc_zeros::<u8>(bytes.max(1))
            .map_err(|e| self.fail("allocation", e))?;
        Ok(DeviceMem { slice, bytes })
    }

    fn upload(&self, bytes: &[u8]) -> Result<DeviceMem> {
        if bytes.is_empty() {
            return self.alloc_zeroed(0);
        }
        if bytes.len() < STAGED_UPLOAD_BYTES {
            let slice = self
                .stream
                .clone_htod(bytes)
                .map_err(|e| self.fail("upload", e))?;
            return Ok(DeviceMem {
                slice,
                bytes: bytes.len(),
            });
        }
        let mut mem = self.alloc_zeroed(bytes.len())?;
        let mut staging = self
            .staging
            .lock()
            .map_err(|_| self.fail("upload", "staging buffer poisoned"))?;
        if staging.is_none() {
            // SAFETY: page-locked memory the driver allocates; every byte copied out of it below
            // is written first.
            let pinned = unsafe { self.context.alloc_pinned::<u8>(STAGING_BYTES) }
                .map_err(|e| self.fail("pinned staging buffer", e))?;
            *staging = Some(pinned);
        }
        let Some(pinned) = staging.as_mut() else {
            return Err(self.fail("upload", "no staging buffer"));
        };
        for start in (0..bytes.len()).step_by(STAGING_BYTES) {
            let piece = &bytes[start..(start + STAGING_BYTES).min(bytes.len())];
            let host = pinned.as_mut_slice().map_err(|e| self.fail("staging", e))?;
            host[..piece.len()].copy_from_slice(piece);
            self.stream
                .memcpy_htod(
                    &host[..piece.len()],
                    &mut mem.slice.slice_mut(start..start + piece.len()),
                )
                .map_err(|e| self.fail("upload", e))?;
            // The next piece (or upload) rewrites the staging buffer: the copy must be done.
            self.stream
                .synchronize()
                .map_err(|e| self.fail("synchronize", e))?;
        }
        Ok(mem)
    }

    fn download(&self, mem: &DeviceMem, out: &mut [u8]) -> Result<()> {
        if out.len() != mem.bytes {
            return Err(self.fail("download", format!("{} into {}", mem.bytes, out.len())));
        }
        if out.is_empty() {
            return Ok(());
        }
        self.stream
            .memcpy_dtoh(&mem.slice.slice(..mem.bytes), out)
            .map_err(|e| self.fail("download", e))?;
        self.stream
            .synchronize()
            .map_err(|e| self.fail("synchronize", e))
    }

    fn size(&self, mem: &DeviceMem) -> usize {
        mem.bytes
    }

    fn copy(
        &self,
        src: &DeviceMem,
        src_offset: usize,
        dst: &mut DeviceMem,
        dst_offset: usize,
        bytes: usize,
    ) -> Result<()> {
        if src_offset + bytes > src.bytes || dst_offset + bytes > dst.bytes {
            return Err(self.fail("copy", "range outside a buffer"));
        }
        self.stream
            .memcpy_dtod(
                &src.slice.slice(src_offset..src_offset + bytes),
                &mut dst.slice.slice_mut(dst_offset..dst_offset + bytes),
            )
            .map_err(|e| self.fail("copy", e))
    }

    fn launch(
        &self,
        kernel: &'static str,
        dims: LaunchDims,
        args: &mut [Arg<'_, DeviceMem>],
    ) -> Result<()> {
        let function = self
            .functions
            .get(kernel)
            .ok_or_else(|| self.fail("launch", format!("no kernel {kernel}")))?;
        let mut builder = self.stream.launch_builder(function);
        for arg in args.iter_mut() {
            match arg {
                Arg::In(m) => builder.arg(&m.slice),
                Arg::Out(m) => builder.arg(&mut m.slice),
                Arg::U32(v) => builder.arg(&*v),
                Arg::I32(v) => builder.arg(&*v),
                Arg::U64(v) => builder.arg(&*v),
                Arg::F32(v) => builder.arg(&*v),
            };
        }
        let config = LaunchConfig {
            grid_dim: (dims.grid[0], dims.grid[1], dims.grid[2]),
            block_dim: (dims.block[0], dims.block[1], dims.block[2]),
            shared_mem_bytes: 0,
        };
        // SAFETY: the backend passes each kernel exactly its C parameter list (the simulator tests
        // run every launch the backend makes against the same sources), with buffers sized for
        // the dimensions passed beside them (checked before each launch).
        unsafe { builder.launch(config) }
            .map(|_| ())
            .map_err(|e| self.fail(kernel, e))
    }

    fn gemm(&self, call: &GemmCall, a: &DeviceMem, b: &DeviceMem, c: &mut DeviceMem) -> Result<()> {
        call.validate(a.bytes, b.bytes, c.bytes)?;
        let (a_ptr, _a_sync) = a.slice.device_ptr(&self.stream);
        let (b_ptr, _b_sync) = b.slice.device_ptr(&self.stream);
        let (c_ptr, _c_sync) = c.slice.device_ptr_mut(&self.stream);
        let (alpha, beta) = (call.alpha, call.beta);
        // SAFETY: the call was validated against the buffers' sizes (every element it touches is
        // inside them), the pointers are live allocations on this device, and the scalars are host
        // f32 as CUBLAS_COMPUTE_32F with the default pointer mode expects.
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                operation(call.transa),
                operation(call.transb),
                call.m as i32,
                call.n as i32,
                call.k as i32,
                (&alpha as *const f32).cast(),
                a_ptr as *const std::ffi::c_void,
                data_type(call.a_type),
                call.lda as i32,
                b_ptr as *const std::ffi::c_void,
                data_type(call.b_type),
                call.ldb as i32,
                (&beta as *const f32).cast(),
                c_ptr as *mut std::ffi::c_void,
                data_type(call.c_type),
                call.ldc as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| self.fail("cublasGemmEx", e))
    }
}
