//! The CUDA backend: buffers resident on a GPU, linears as cuBLAS GEMMs (f32, or bf16 weights with
//! f32 accumulation), everything else as the NVRTC-compiled kernels of `mmgate-cuda-kernels`, all
//! issued in order on the device's stream.
//!
//! [`CudaBackend`] is written against [`Device`], not against the driver: [`DriverDevice`] runs it
//! on a real GPU, and the tests run it unchanged on a simulated device (kernels executed on the CPU
//! by the kernels crate's simulator, GEMMs by a reference with cuBLAS's column-major semantics). So
//! every launch's geometry and arguments and every GEMM's description are tested here without a
//! GPU; what only a GPU can show (the driver, cuBLAS itself, speed) is `./dev gpu-check`'s job.

mod device;
mod driver;

pub use device::{Arg, DType, Device, GemmCall, LaunchDims, Op};
pub use driver::{DriverDevice, compile_module, device_count, nvrtc_available};

use std::sync::Arc;

use super::{
    Activation, AttentionMask, AttentionShape, Backend, ByteSamplesView, Conv1dShape, Values,
    check_attention, check_ids, check_row_range, check_scatter_rows, expect_len, pooled_rows,
    rows_of,
};
use crate::error::{Error, Result};

/// Threads of an element-wise block.
const BLOCK: u32 = 256;

/// A buffer on the device: `len` elements of `dtype`.
pub struct CudaBuffer<M> {
    mem: M,
    len: usize,
    dtype: DType,
}

impl<M> std::fmt::Debug for CudaBuffer<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaBuffer({} x {:?})", self.len, self.dtype)
    }
}

/// The backend over one device.
pub struct CudaBackend<D: Device> {
    device: Arc<D>,
}

impl<D: Device> Clone for CudaBackend<D> {
    fn clone(&self) -> Self {
        Self {
            device: self.device.clone(),
        }
    }
}

impl<D: Device> std::fmt::Debug for CudaBackend<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.device.name())
    }
}

fn u32_of(op: &'static str, what: &str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| Error::shape(op, format!("{what} {v} is past u32")))
}

/// The kernels' code for each activation (`mmgate_activate` in `common.cuh`).
fn activation_code(act: Activation) -> i32 {
    match act {
        Activation::Silu => 0,
        Activation::Gelu => 1,
        Activation::QuickGelu => 2,
        Activation::GeluTanh => 3,
    }
}

/// Threads of a block that owns one row of `dim`: whole warps, at most 256.
fn row_threads(dim: usize) -> u32 {
    (dim.div_ceil(32) * 32).clamp(32, 256) as u32
}

/// Which keys each query row sees, as `key_begin`/`key_end` arrays (for a checked shape).
fn key_ranges(s: &AttentionShape) -> (Vec<u32>, Vec<u32>) {
    let mut begin = Vec::with_capacity(s.q_rows);
    let mut end = Vec::with_capacity(s.q_rows);
    match &s.mask {
        AttentionMask::Causal { first_query } => {
            for row in 0..s.q_rows {
                begin.push(0);
                end.push((first_query + row + 1) as u32);
            }
        }
        AttentionMask::Segments(segments) => {
            for seg in segments {
                for _ in seg.rows.clone() {
                    begin.push(seg.rows.start as u32);
                    end.push((seg.rows.start + seg.visible_keys) as u32);
                }
            }
        }
    }
    (begin, end)
}

impl<D: Device> CudaBackend<D> {
    pub fn new(device: D) -> Self {
        Self {
            device: Arc::new(device),
        }
    }

    pub fn device(&self) -> &D {
        &self.device
    }

    fn alloc(&self, len: usize, dtype: DType) -> Result<CudaBuffer<D::Mem>> {
        Ok(CudaBuffer {
            mem: self.device.alloc_zeroed(len * dtype.size())?,
            len,
            dtype,
        })
    }

    fn upload_u32(&self, values: &[u32]) -> Result<CudaBuffer<D::Mem>> {
        Ok(CudaBuffer {
            mem: self.device.upload(bytemuck::cast_slice(values))?,
            len: values.len(),
            dtype: DType::F32, // 4-byte elements; only ever passed to kernels as indices
        })
    }

    /// A grid-stride launch over `n` elements.
    fn elementwise(&self, n: usize) -> LaunchDims {
        let blocks = n
            .div_ceil(BLOCK as usize)
            .clamp(1, self.device.max_blocks() as usize);
        LaunchDims {
            grid: [blocks as u32, 1, 1],
            block: [BLOCK, 1, 1],
        }
    }

    fn launch(
        &self,
        kernel: &'static str,
        dims: LaunchDims,
        args: &mut [Arg<'_, D::Mem>],
    ) -> Result<()> {
        self.device.launch(kernel, dims, args)
    }

    /// Uploads f32 values stored as `dtype` (rounded to nearest even for bf16).
    pub fn upload_as(&self, host: &[f32], dtype: DType) -> Result<CudaBuffer<D::Mem>> {
        let mem = match dtype {
            DType::F32 => self.device.upload(bytemuck::cast_slice(host))?,
            DType::Bf16 => {
                let bits: Vec<u16> = host
                    .iter()
                    .map(|&v| half::bf16::from_f32(v).to_bits())
                    .collect();
                self.device.upload(bytemuck::cast_slice(&bits))?
            }
        };
        Ok(CudaBuffer {
            mem,
            len: host.len(),
            dtype,
        })
    }

    fn expect_f32(op: &'static str, buffers: &[&CudaBuffer<D::Mem>]) -> Result<()> {
        if buffers.iter().all(|b| b.dtype == DType::F32) {
            Ok(())
        } else {
            Err(Error::shape(op, "takes f32 buffers only"))
        }
    }

    fn row_norm(
        &self,
        kernel: &'static str,
        x: &CudaBuffer<D::Mem>,
        params: &[&CudaBuffer<D::Mem>],
        dim: usize,
        eps: f32,
    ) -> Result<CudaBuffer<D::Mem>> {
        let rows = rows_of(kernel, x.len, dim)?;
        for p in params {
            expect_len(kernel, "weight", p.len, dim)?;
        }
        let mut all = vec![x];
        all.extend_from_slice(params);
        Self::expect_f32(kernel, &all)?;
        let mut out = self.alloc(x.len, DType::F32)?;
        if rows == 0 {
            return Ok(out);
        }
        let dims = LaunchDims {
            grid: [u32_of(kernel, "rows", rows)?, 1, 1],
            block: [row_threads(dim), 1, 1],
        };
        let mut args = vec![Arg::In(&x.mem)];
        args.extend(params.iter().map(|p| Arg::In(&p.mem)));
        args.extend([
            Arg::Out(&mut out.mem),
            Arg::U32(u32_of(kernel, "dim", dim)?),
            Arg::F32(eps),
        ]);
        self.launch(kernel, dims, &mut args)?;
        Ok(out)
    }
}

impl<D: Device> Backend for CudaBackend<D> {
    type Buffer = CudaBuffer<D::Mem>;

    fn name(&self) -> String {
        self.device.name()
    }

    fn upload(&self, host: &[f32]) -> Result<Self::Buffer> {
        Ok(CudaBuffer {
            mem: self.device.upload(bytemuck::cast_slice(host))?,
            len: host.len(),
            dtype: DType::F32,
        })
    }

    /// bf16 weights stay bf16 (their linears run as bf16 GEMMs with f32 accumulation); f16
    /// weights are widened to f32 (no f16 GEMM path yet: they take f32's memory).
    fn upload_weight(&self, weight: Values, _shape: &[usize]) -> Result<Self::Buffer> {
        match weight {
            Values::Bf16(bits) => Ok(CudaBuffer {
                mem: self.device.upload(bytemuck::cast_slice(
                    &bits.iter().map(|b| b.to_bits()).collect::<Vec<u16>>(),
                ))?,
                len: bits.len(),
                dtype: DType::Bf16,
            }),
            other => self.upload_owned(other.into_f32()),
        }
    }

    fn expand_samples(&self, view: &ByteSamplesView<'_>) -> Result<Option<Self::Buffer>> {
        let ok = view.channels > 0
            && view.run > 0
            && view.repeats > 0
            && view.table.len() == view.channels * 256
            && view.samples.len().is_multiple_of(view.run);
        if !ok {
            return Err(Error::shape("expand_samples", format!("{view:?}")));
        }
        let values = view.value_count();
        let mut out = self.alloc(values, DType::F32)?;
        if values == 0 {
            return Ok(Some(out));
        }
        let samples = self.device.upload(view.samples)?;
        let table = self.device.upload(bytemuck::cast_slice(view.table))?;
        let u = |what, v| u32_of("expand_samples", what, v);
        self.launch(
            "expand_samples",
            self.elementwise(values),
            &mut [
                Arg::In(&samples),
                Arg::In(&table),
                Arg::Out(&mut out.mem),
                Arg::U64(values as u64),
                Arg::U32(u("run", view.run)?),
                Arg::U32(u("channels", view.channels)?),
                Arg::U32(u("repeats", view.repeats)?),
            ],
        )?;
        Ok(Some(out))
    }

    fn pixel_block_values(&self) -> usize {
        usize::MAX
    }

    fn download(&self, buffer: &Self::Buffer) -> Result<Vec<f32>> {
        match buffer.dtype {
            DType::F32 => {
                let mut out = vec![0.0f32; buffer.len];
                self.device
                    .download(&buffer.mem, bytemuck::cast_slice_mut(&mut out))?;
                Ok(out)
            }
            DType::Bf16 => {
                let mut bits = vec![0u16; buffer.len];
                self.device
                    .download(&buffer.mem, bytemuck::cast_slice_mut(&mut bits))?;
                Ok(bits
                    .into_iter()
                    .map(|b| half::bf16::from_bits(b).to_f32())
                    .collect())
            }
        }
    }

    fn zeros(&self, len: usize) -> Result<Self::Buffer> {
        self.alloc(len, DType::F32)
    }

    fn len(&self, buffer: &Self::Buffer) -> usize {
        buffer.len
    }

    fn bytes(&self, buffer: &Self::Buffer) -> usize {
        buffer.len * buffer.dtype.size()
    }

    fn linear(
        &self,
        x: &Self::Buffer,
        weight: &Self::Buffer,
        bias: Option<&Self::Buffer>,
        dims: [usize; 3],
    ) -> Result<Self::Buffer> {
        let [m, k, n] = dims;
        expect_len("linear", "input", x.len, m * k)?;
        expect_len("linear", "weight", weight.len, n * k)?;
        Self::expect_f32("linear", &[x])?;
        let mut out = self.alloc(m * n, DType::F32)?;
        if m == 0 || n == 0 {
            return Ok(out);
        }
        if let Some(b) = bias {
            expect_len("linear", "bias", b.len, n)?;
            Self::expect_f32("linear", &[b])?;
            self.launch(
                "fill_rows",
                self.elementwise(m * n),
                &mut [
                    Arg::Out(&mut out.mem),
                    Arg::In(&b.mem),
                    Arg::U32(u32_of("linear", "rows", m)?),
                    Arg::U32(u32_of("linear", "columns", n)?),
                ],
            )?;
        }
        // A bf16 weight multiplies a bf16 copy of the input (cuBLAS's bf16 GEMMs take both
        // operands in bf16; they accumulate in f32 and write f32 here).
        let converted;
        let input = match weight.dtype {
            DType::F32 => x,
            DType::Bf16 => {
                let mut half = self.alloc(x.len, DType::Bf16)?;
                self.launch(
                    "to_bf16",
                    self.elementwise(x.len),
                    &mut [
                        Arg::In(&x.mem),
                        Arg::Out(&mut half.mem),
                        Arg::U64(x.len as u64),
                    ],
                )?;
                converted = half;
                &converted
            }
        };
        // Row-major y[m, n] = x[m, k] · w[n, k]ᵀ is column-major yᵀ[n, m] = (w as k × n)ᵀ · (x as
        // k × m): cuBLAS sees the same bytes with no copy.
        let call = GemmCall {
            transa: Op::T,
            transb: Op::N,
            m: n,
            n: m,
            k,
            alpha: 1.0,
            beta: if bias.is_some() { 1.0 } else { 0.0 },
            a_type: weight.dtype,
            lda: k,
            b_type: input.dtype,
            ldb: k,
            c_type: DType::F32,
            ldc: n,
        };
        call.validate(self.bytes(weight), self.bytes(input), self.bytes(&out))?;
        self.device
            .gemm(&call, &weight.mem, &input.mem, &mut out.mem)?;
        Ok(out)
    }

    fn rms_norm(
        &self,
        x: &Self::Buffer,
        weight: &Self::Buffer,
        dim: usize,
        eps: f32,
    ) -> Result<Self::Buffer> {
        self.row_norm("rms_norm", x, &[weight], dim, eps)
    }

    fn layer_norm(
        &self,
        x: &Self::Buffer,
        weight: &Self::Buffer,
        bias: &Self::Buffer,
        dim: usize,
        eps: f32,
    ) -> Result<Self::Buffer> {
        self.row_norm("layer_norm", x, &[weight, bias], dim, eps)
    }

    fn add_assign(&self, acc: &mut Self::Buffer, x: &Self::Buffer) -> Result<()> {
        expect_len("add", "addend", x.len, acc.len)?;
        Self::expect_f32("add", &[acc, x])?;
        if acc.len == 0 {
            return Ok(());
        }
        let n = acc.len;
        self.launch(
            "add_assign",
            self.elementwise(n),
            &mut [Arg::Out(&mut acc.mem), Arg::In(&x.mem), Arg::U64(n as u64)],
        )
    }

    fn activate(&self, x: &mut Self::Buffer, act: Activation) -> Result<()> {
        Self::expect_f32("activate", &[x])?;
        if x.len == 0 {
            return Ok(());
        }
        let n = x.len;
        self.launch(
            "activate",
            self.elementwise(n),
            &mut [
                Arg::Out(&mut x.mem),
                Arg::U64(n as u64),
                Arg::I32(activation_code(act)),
            ],
        )
    }

    fn gated_activate(
        &self,
        gate: &mut Self::Buffer,
        up: &Self::Buffer,
        act: Activation,
    ) -> Result<()> {
        expect_len("gated_activate", "up", up.len, gate.len)?;
        Self::expect_f32("gated_activate", &[gate, up])?;
        if gate.len == 0 {
            return Ok(());
        }
        let n = gate.len;
        self.launch(
            "gated_activate",
            self.elementwise(n),
            &mut [
                Arg::Out(&mut gate.mem),
                Arg::In(&up.mem),
                Arg::U64(n as u64),
                Arg::I32(activation_code(act)),
            ],
        )
    }

    fn rope(
        &self,
        x: &mut Self::Buffer,
        cos: &Self::Buffer,
        sin: &Self::Buffer,
        heads: usize,
        head_dim: usize,
    ) -> Result<()> {
        if !head_dim.is_multiple_of(2) {
            return Err(Error::shape("rope", format!("head_dim {head_dim} is odd")));
        }
        let rows = rows_of("rope", x.len, heads * head_dim)?;
        expect_len("rope", "cos", cos.len, rows * head_dim)?;
        expect_len("rope", "sin", sin.len, rows * head_dim)?;
        Self::expect_f32("rope", &[x, cos, sin])?;
        if x.len == 0 {
            return Ok(());
        }
        let dims = self.elementwise(rows * heads * head_dim / 2);
        self.launch(
            "rope",
            dims,
            &mut [
                Arg::Out(&mut x.mem),
                Arg::In(&cos.mem),
                Arg::In(&sin.mem),
                Arg::U32(u32_of("rope", "rows", rows)?),
                Arg::U32(u32_of("rope", "heads", heads)?),
                Arg::U32(u32_of("rope", "head_dim", head_dim)?),
            ],
        )
    }

    fn attention(
        &self,
        q: &Self::Buffer,
        k: &Self::Buffer,
        v: &Self::Buffer,
        shape: &AttentionShape,
    ) -> Result<Self::Buffer> {
        check_attention(shape, q.len, k.len, v.len)?;
        Self::expect_f32("attention", &[q, k, v])?;
        if shape.head_dim > 256 {
            return Err(Error::shape(
                "attention",
                format!("head_dim {} is over the kernel's 256", shape.head_dim),
            ));
        }
        u32_of("attention", "key rows", shape.kv_rows)?;
        let mut out = self.alloc(shape.q_rows * shape.heads * shape.head_dim, DType::F32)?;
        if shape.q_rows == 0 || shape.heads == 0 {
            return Ok(out);
        }
        let (begin, end) = key_ranges(shape);
        let (begin, end) = (self.upload_u32(&begin)?, self.upload_u32(&end)?);
        let dims = LaunchDims {
            grid: [
                u32_of("attention", "query rows", shape.q_rows)?,
                u32_of("attention", "heads", shape.heads)?,
                1,
            ],
            block: [32, 1, 1],
        };
        if dims.grid[1] > 65_535 {
            return Err(Error::shape("attention", "more than 65535 heads"));
        }
        self.launch(
            "attention",
            dims,
            &mut [
                Arg::In(&q.mem),
                Arg::In(&k.mem),
                Arg::In(&v.mem),
                Arg::Out(&mut out.mem),
                Arg::In(&begin.mem),
                Arg::In(&end.mem),
                Arg::U32(shape.heads as u32),
                Arg::U32(u32_of("attention", "kv heads", shape.kv_heads)?),
                Arg::U32(u32_of("attention", "head_dim", shape.head_dim)?),
                Arg::F32(shape.scale),
            ],
        )?;
        Ok(out)
    }

    fn im2col_1d(&self, x: &Self::Buffer, c: &Conv1dShape) -> Result<Self::Buffer> {
        c.check(x.len)?;
        Self::expect_f32("im2col_1d", &[x])?;
        let out_len = c.out_len();
        let total = c.segments * out_len * c.channels * c.kernel;
        let mut out = self.alloc(total, DType::F32)?;
        if total == 0 {
            return Ok(out);
        }
        let u = |what, v| u32_of("im2col_1d", what, v);
        self.launch(
            "im2col_1d",
            self.elementwise(total),
            &mut [
                Arg::In(&x.mem),
                Arg::Out(&mut out.mem),
                Arg::U32(u("segments", c.segments)?),
                Arg::U32(u("len", c.len)?),
                Arg::U32(u("channels", c.channels)?),
                Arg::U32(u("kernel", c.kernel)?),
                Arg::U32(u("stride", c.stride)?),
                Arg::U32(u("padding", c.padding)?),
                Arg::U32(u("output length", out_len)?),
            ],
        )?;
        Ok(out)
    }

    fn mean_pool_rows(&self, x: &Self::Buffer, dim: usize, window: usize) -> Result<Self::Buffer> {
        let out_rows = pooled_rows(x.len, dim, window)?;
        Self::expect_f32("mean_pool_rows", &[x])?;
        let mut out = self.alloc(out_rows * dim, DType::F32)?;
        if out_rows == 0 {
            return Ok(out);
        }
        let u = |what, v| u32_of("mean_pool_rows", what, v);
        self.launch(
            "mean_pool_rows",
            self.elementwise(out_rows * dim),
            &mut [
                Arg::In(&x.mem),
                Arg::Out(&mut out.mem),
                Arg::U32(u("rows", out_rows)?),
                Arg::U32(u("dim", dim)?),
                Arg::U32(u("window", window)?),
            ],
        )?;
        Ok(out)
    }

    fn gather_rows(&self, table: &Self::Buffer, dim: usize, ids: &[u32]) -> Result<Self::Buffer> {
        let rows = rows_of("gather_rows", table.len, dim)?;
        check_ids(ids, rows)?;
        let mut out = self.alloc(ids.len() * dim, DType::F32)?;
        if ids.is_empty() {
            return Ok(out);
        }
        let kernel = match table.dtype {
            DType::F32 => "gather_rows",
            DType::Bf16 => "gather_rows_bf16",
        };
        let ids_buf = self.upload_u32(ids)?;
        self.launch(
            kernel,
            self.elementwise(ids.len() * dim),
            &mut [
                Arg::In(&table.mem),
                Arg::In(&ids_buf.mem),
                Arg::Out(&mut out.mem),
                Arg::U32(u32_of("gather_rows", "ids", ids.len())?),
                Arg::U32(u32_of("gather_rows", "dim", dim)?),
            ],
        )?;
        Ok(out)
    }

    fn scatter_rows(
        &self,
        dst: &mut Self::Buffer,
        dim: usize,
        rows: &[u32],
        src: &Self::Buffer,
    ) -> Result<()> {
        let dst_rows = rows_of("scatter_rows", dst.len, dim)?;
        expect_len("scatter_rows", "source", src.len, rows.len() * dim)?;
        check_scatter_rows(rows, dst_rows)?;
        Self::expect_f32("scatter_rows", &[dst, src])?;
        if rows.is_empty() {
            return Ok(());
        }
        let rows_buf = self.upload_u32(rows)?;
        self.launch(
            "scatter_rows",
            self.elementwise(rows.len() * dim),
            &mut [
                Arg::Out(&mut dst.mem),
                Arg::In(&rows_buf.mem),
                Arg::In(&src.mem),
                Arg::U32(u32_of("scatter_rows", "rows", rows.len())?),
                Arg::U32(u32_of("scatter_rows", "dim", dim)?),
            ],
        )
    }

    fn write_rows(
        &self,
        dst: &mut Self::Buffer,
        dim: usize,
        at: usize,
        src: &Self::Buffer,
    ) -> Result<()> {
        let dst_rows = rows_of("write_rows", dst.len, dim)?;
        let n = rows_of("write_rows", src.len, dim)?;
        check_row_range("write_rows", at, n, dst_rows)?;
        Self::expect_f32("write_rows", &[dst, src])?;
        if n == 0 {
            return Ok(());
        }
        self.device
            .copy(&src.mem, 0, &mut dst.mem, at * dim * 4, src.len * 4)
    }

    fn slice_rows(
        &self,
        src: &Self::Buffer,
        dim: usize,
        start: usize,
        count: usize,
    ) -> Result<Self::Buffer> {
        let rows = rows_of("slice_rows", src.len, dim)?;
        check_row_range("slice_rows", start, count, rows)?;
        Self::expect_f32("slice_rows", &[src])?;
        let mut out = self.alloc(count * dim, DType::F32)?;
        if count > 0 {
            self.device
                .copy(&src.mem, start * dim * 4, &mut out.mem, 0, count * dim * 4)?;
        }
        Ok(out)
    }
}
