//! The CUDA backend's device, simulated: kernels run on the CPU by `mmgate-cuda-kernels`' simulator
//! (the same sources NVRTC compiles), GEMMs by a reference implementation of `cublasGemmEx`'s
//! column-major semantics. Every launch and GEMM is recorded, so tests can say which kernels they
//! ran. Device memory is host memory here: each buffer is mapped so that it ends exactly where a
//! page that may not be touched begins (and one precedes it), so a kernel that reads or writes past
//! its buffer faults, as a GPU reports an illegal address, instead of silently using a neighbour's
//! bytes.
#![allow(unsafe_code, dead_code)]

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::Mutex;

use mmgate_cuda_kernels::sim;
use mmgate_inference::backend::cuda::{Arg, DType, Device, GemmCall, LaunchDims, Op};
use mmgate_inference::{Error, Result};

pub struct SimMem {
    /// The whole mapping: a guard page, the data pages, a guard page.
    map: *mut u8,
    map_len: usize,
    /// The buffer: its last byte is the last before the trailing guard page.
    data: *mut u8,
    bytes: usize,
}

// SAFETY: the mapping is owned by this value alone (as a Vec's heap block is).
unsafe impl Send for SimMem {}
unsafe impl Sync for SimMem {}

fn page() -> usize {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_PAGESIZE) as usize }
}

impl SimMem {
    fn new(bytes: usize) -> Result<Self> {
        let page = page();
        let data_pages = bytes.div_ceil(page);
        let map_len = (data_pages + 2) * page;
        // SAFETY: an anonymous private mapping (zero-filled), then both ends made inaccessible;
        // every pointer used below stays inside it.
        unsafe {
            let map = libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            if map == libc::MAP_FAILED {
                return Err(refused("mmap failed"));
            }
            let map = map as *mut u8;
            let trailing = map.add((data_pages + 1) * page);
            if libc::mprotect(map as *mut c_void, page, libc::PROT_NONE) != 0
                || libc::mprotect(trailing as *mut c_void, page, libc::PROT_NONE) != 0
            {
                libc::munmap(map as *mut c_void, map_len);
                return Err(refused("mprotect failed"));
            }
            Ok(Self {
                map,
                map_len,
                data: trailing.sub(bytes),
                bytes,
            })
        }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `data..data + bytes` is inside the readable part of the mapping.
        unsafe { std::slice::from_raw_parts(self.data, self.bytes) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.data, self.bytes) }
    }
}

impl Drop for SimMem {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe {
            libc::munmap(self.map as *mut c_void, self.map_len);
        }
    }
}

#[derive(Default)]
pub struct Record {
    pub launches: BTreeMap<&'static str, usize>,
    pub gemms: Vec<GemmCall>,
}

pub struct SimDevice {
    name: String,
    pub record: Mutex<Record>,
}

impl SimDevice {
    pub fn new(name: &str) -> Self {
        Self {
            name: name.to_owned(),
            record: Mutex::new(Record::default()),
        }
    }
}

fn refused(what: impl std::fmt::Display) -> Error {
    Error::Device {
        device: "simulated".into(),
        reason: what.to_string(),
    }
}

fn element(bytes: &[u8], dtype: DType, index: usize) -> f32 {
    match dtype {
        DType::F32 => {
            let b = &bytes[4 * index..4 * index + 4];
            f32::from_le_bytes([b[0], b[1], b[2], b[3]])
        }
        DType::Bf16 => half::bf16::from_le_bytes([bytes[2 * index], bytes[2 * index + 1]]).to_f32(),
    }
}

fn store(bytes: &mut [u8], dtype: DType, index: usize, value: f32) {
    match dtype {
        DType::F32 => bytes[4 * index..4 * index + 4].copy_from_slice(&value.to_le_bytes()),
        DType::Bf16 => bytes[2 * index..2 * index + 2]
            .copy_from_slice(&half::bf16::from_f32(value).to_le_bytes()),
    }
}

/// `cublasGemmEx` as its documentation defines it: column-major, `op(A)` `m × k`, `op(B)` `k × n`,
/// f32 accumulation, `beta == 0` ignoring C's old contents.
fn reference_gemm(call: &GemmCall, a: &[u8], b: &[u8], c: &mut [u8]) {
    for j in 0..call.n {
        for i in 0..call.m {
            let mut acc = 0.0f32;
            for p in 0..call.k {
                let a_at = match call.transa {
                    Op::N => i + p * call.lda,
                    Op::T => p + i * call.lda,
                };
                let b_at = match call.transb {
                    Op::N => p + j * call.ldb,
                    Op::T => j + p * call.ldb,
                };
                acc += element(a, call.a_type, a_at) * element(b, call.b_type, b_at);
            }
            let c_at = i + j * call.ldc;
            let old = if call.beta == 0.0 {
                0.0
            } else {
                call.beta * element(c, call.c_type, c_at)
            };
            store(c, call.c_type, c_at, call.alpha * acc + old);
        }
    }
}

impl Device for SimDevice {
    type Mem = SimMem;

    fn name(&self) -> String {
        format!("{} (simulated CUDA)", self.name)
    }

    /// Few blocks, so every grid-stride loop really strides.
    fn max_blocks(&self) -> u32 {
        3
    }

    fn alloc_zeroed(&self, bytes: usize) -> Result<SimMem> {
        SimMem::new(bytes)
    }

    fn upload(&self, bytes: &[u8]) -> Result<SimMem> {
        let mut mem = self.alloc_zeroed(bytes.len())?;
        mem.bytes_mut().copy_from_slice(bytes);
        Ok(mem)
    }

    fn download(&self, mem: &SimMem, out: &mut [u8]) -> Result<()> {
        if out.len() != mem.bytes {
            return Err(refused(format!(
                "download of {} into {}",
                mem.bytes,
                out.len()
            )));
        }
        out.copy_from_slice(mem.bytes());
        Ok(())
    }

    fn size(&self, mem: &SimMem) -> usize {
        mem.bytes
    }

    fn copy(
        &self,
        src: &SimMem,
        src_offset: usize,
        dst: &mut SimMem,
        dst_offset: usize,
        bytes: usize,
    ) -> Result<()> {
        if src_offset + bytes > src.bytes || dst_offset + bytes > dst.bytes {
            return Err(refused("copy outside a buffer"));
        }
        dst.bytes_mut()[dst_offset..dst_offset + bytes]
            .copy_from_slice(&src.bytes()[src_offset..src_offset + bytes]);
        Ok(())
    }

    fn launch(
        &self,
        kernel: &'static str,
        dims: LaunchDims,
        args: &mut [Arg<'_, SimMem>],
    ) -> Result<()> {
        let sim_args: Vec<sim::Arg> = args
            .iter_mut()
            .map(|a| match a {
                Arg::In(m) => sim::Arg::Ptr(m.data as *mut c_void),
                Arg::Out(m) => sim::Arg::Ptr(m.data as *mut c_void),
                Arg::U32(v) => sim::Arg::U32(*v),
                Arg::I32(v) => sim::Arg::I32(*v),
                Arg::U64(v) => sim::Arg::U64(*v),
                Arg::F32(v) => sim::Arg::F32(*v),
            })
            .collect();
        // SAFETY: the backend under test promises the kernel's parameter list and buffers large
        // enough for the dimensions it passes; a broken promise is exactly what these tests exist
        // to catch (as garbage or a crash of the test, never of a product process).
        unsafe { sim::launch(kernel, dims.grid, dims.block, &sim_args) }.map_err(refused)?;
        if let Ok(mut r) = self.record.lock() {
            *r.launches.entry(kernel).or_default() += 1;
        }
        Ok(())
    }

    fn gemm(&self, call: &GemmCall, a: &SimMem, b: &SimMem, c: &mut SimMem) -> Result<()> {
        call.validate(a.bytes, b.bytes, c.bytes)?;
        reference_gemm(call, a.bytes(), b.bytes(), c.bytes_mut());
        if let Ok(mut r) = self.record.lock() {
            r.gemms.push(*call);
        }
        Ok(())
    }
}
