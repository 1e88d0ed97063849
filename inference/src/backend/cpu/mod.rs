//! The CPU device: buffers are `Vec<f32>` (weights may stay bf16/f16, and a KV cache is bf16 halves on a CPU with AMX tiles: [`CpuBuffer`], `cpu::amx`), linears are `gemm` calls, everything else is rayon over
//! rows. Each `CpuBackend` owns its own rayon thread pool, so an encoder device and the LLM never
//! compete for the same threads (the "dedicated devices" of the design): work submitted to one
//! device runs only on that device's threads.

use std::sync::Arc;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;

mod activation_kernels;
mod amx;
mod attention;
mod attention_bf16;
mod attention_kernels;
mod bf16_gemm;
mod cpu_features;
mod gemm;

pub use bf16_gemm::Bf16Panels;

use crate::backend::{
    Activation, AttentionMask, AttentionShape, Backend, Conv1dShape, KvLayout, Values,
    check_attention, check_cached_attention, check_ids, check_row_range, check_scatter_rows,
    expect_len, pooled_rows, rows_of,
};
use crate::error::{Error, Result};
use attention::{
    AMX_QUERY_BLOCK, amx_shape, attend_heads, attend_heads_vectors, attention, cached_heads,
    head_rows, kv_cache_lens, transpose_into, transposed_stride,
};
use gemm::{MatMut, MatRef, Threads, matmul, matmul_weight_blocks};

/// Set to `0`, CPU devices keep their KV caches in f32 even where the CPU has AMX tiles.
const NO_AMX_VAR: &str = "MMGATE_CPU_AMX";

#[derive(Clone)]
pub struct CpuBackend {
    pool: Arc<rayon::ThreadPool>,
    label: Arc<str>,
    /// KV caches are kept for, and attended with, AMX tiles (see [`amx`]).
    amx: bool,
    /// bf16 matrices are uploaded packed for the AVX-512 BF16 GEMM, and linears with them round
    /// their input to bf16 (see [`bf16_gemm`]).
    bf16_inputs: bool,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

impl CpuBackend {
    /// A device with `threads` threads of its own, named `label` in logs and thread names.
    pub fn new(label: &str, threads: usize) -> Result<Self> {
        let threads = threads.max(1);
        let thread_label = label.to_owned();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(move |i| format!("{thread_label}-{i}"))
            .build()
            .map_err(|e| Error::Device {
                device: label.to_owned(),
                reason: e.to_string(),
            })?;
        Ok(Self {
            pool: Arc::new(pool),
            label: label.into(),
            amx: amx::available() && std::env::var_os(NO_AMX_VAR).is_none_or(|v| v != "0"),
            bf16_inputs: false,
        })
    }

    /// This device with its bf16-weight linears computed in bf16 — the input rounded to bf16,
    /// products summed in f32, as the CUDA backend's and bf16 engines' — where the CPU has AVX-512
    /// BF16, which does twice the f32 kernels' products an instruction and needs no widening of
    /// the weights. Matrices uploaded to it from then on are packed for that kernel
    /// ([`Bf16Panels`], as many bytes). Its attention rounds queries, keys, values and softmax
    /// weights to bf16 too ([`attention_bf16`]), unless it attends on AMX tiles. Elsewhere the
    /// input stays f32.
    pub fn with_bf16_inputs(mut self) -> Self {
        self.bf16_inputs = bf16_gemm::available();
        self
    }

    /// Whether bf16-weight linears round their input to bf16.
    pub fn uses_bf16_inputs(&self) -> bool {
        self.bf16_inputs
    }

    /// This device with its KV caches in f32 and every attention on the f32 kernels (AVX-512, AVX2
    /// or SSE2, whatever the CPU), as on a CPU without AMX tiles.
    pub fn without_amx(mut self) -> Self {
        self.amx = false;
        self
    }

    /// Whether this device attends with AMX tiles (its KV caches, and encoders' segments).
    pub fn uses_amx(&self) -> bool {
        self.amx
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    fn run<T: Send>(&self, work: impl FnOnce() -> T + Send) -> T {
        self.pool.install(work)
    }
}

impl Backend for CpuBackend {
    type Buffer = CpuBuffer;

    fn name(&self) -> String {
        let amx = if self.amx { ", AMX attention" } else { "" };
        let bf16 = if self.bf16_inputs {
            ", bf16 GEMMs and attention"
        } else {
            ""
        };
        format!("cpu:{} ({} threads{amx}{bf16})", self.label, self.threads())
    }

    fn run_on<R: Send>(&self, work: impl FnOnce() -> R + Send) -> R {
        self.run(work)
    }

    fn upload(&self, host: &[f32]) -> Result<CpuBuffer> {
        Ok(CpuBuffer::F32(host.to_vec()))
    }

    fn upload_owned(&self, host: Vec<f32>) -> Result<CpuBuffer> {
        Ok(CpuBuffer::F32(host))
    }

    /// Kept as it is (the CPU computes with half-precision weights directly), except a bf16
    /// matrix on a device computing in bf16: packed once for its kernel.
    fn upload_weight(&self, weight: Values, shape: &[usize]) -> Result<CpuBuffer> {
        Ok(match (weight, shape) {
            (Values::Bf16(w), &[rows, cols]) if self.bf16_inputs => {
                Values::Bf16Panels(self.run(|| Bf16Panels::pack(&w, rows, cols)))
            }
            (weight, _) => weight,
        })
    }

    fn download(&self, buffer: &CpuBuffer) -> Result<Vec<f32>> {
        Ok(buffer.to_f32())
    }

    fn zeros(&self, len: usize) -> Result<CpuBuffer> {
        Ok(CpuBuffer::F32(vec![0.0; len]))
    }

    fn len(&self, buffer: &CpuBuffer) -> usize {
        buffer.len()
    }

    fn bytes(&self, buffer: &CpuBuffer) -> usize {
        buffer.bytes()
    }

    fn linear(
        &self,
        x: &CpuBuffer,
        weight: &CpuBuffer,
        bias: Option<&CpuBuffer>,
        dims: [usize; 3],
    ) -> Result<CpuBuffer> {
        let x = x.f32s("linear")?;
        let bias = bias.map(|b| b.f32s("linear")).transpose()?;
        let [m, k, n] = dims;
        expect_len("linear", "input", x.len(), m * k)?;
        expect_len("linear", "weight", weight.len(), n * k)?;
        if let Some(b) = bias {
            expect_len("linear", "bias", b.len(), n)?;
        }
        let threads = self.threads();
        // The f32 and widening paths add their product to the output, which starts as the bias.
        let added_to_bias = |product: &(dyn Fn(&mut [f32]) -> Result<()> + Sync)| {
            let mut out = vec![0.0; m * n];
            self.run(|| {
                if let Some(b) = bias {
                    out.par_chunks_mut(n).for_each(|row| row.copy_from_slice(b));
                }
                product(&mut out)
            })?;
            Ok(out.into())
        };
        match weight {
            CpuBuffer::Bf16Panels(weight) if weight.cols() != k || weight.rows() != n => {
                Err(Error::shape(
                    "linear",
                    format!("a {}x{} weight as {n}x{k}", weight.rows(), weight.cols()),
                ))
            }
            // Writes each output once, the bias included.
            CpuBuffer::Bf16Panels(weight) => {
                Ok(self.run(|| bf16_gemm::linear(x, weight, m, bias)).into())
            }
            CpuBuffer::F32(weight) => added_to_bias(&|out| {
                matmul(
                    MatMut::row_major(out, m, n),
                    MatRef::row_major(x, m, k),
                    MatRef::row_major(weight, n, k).t(),
                    bias.is_some(),
                    Threads::Pool(threads),
                )
            }),
            CpuBuffer::Bf16(weight) => {
                added_to_bias(&|out| linear_half(out, x, weight, dims, threads))
            }
            CpuBuffer::F16(weight) => {
                added_to_bias(&|out| linear_half(out, x, weight, dims, threads))
            }
        }
    }

    fn rms_norm(
        &self,
        x: &CpuBuffer,
        weight: &CpuBuffer,
        dim: usize,
        eps: f32,
    ) -> Result<CpuBuffer> {
        let x = x.f32s("rms_norm")?;
        let weight = weight.f32s("rms_norm")?;
        rows_of("rms_norm", x.len(), dim)?;
        expect_len("rms_norm", "weight", weight.len(), dim)?;
        let mut out = vec![0.0; x.len()];
        self.run(|| {
            out.par_chunks_mut(dim)
                .zip(x.par_chunks(dim))
                .for_each(|(o, row)| {
                    let mean_sq = row.iter().map(|v| v * v).sum::<f32>() / dim as f32;
                    let inv = 1.0 / (mean_sq + eps).sqrt();
                    for ((o, v), w) in o.iter_mut().zip(row).zip(weight) {
                        *o = w * (v * inv);
                    }
                })
        });
        Ok(out.into())
    }

    fn layer_norm(
        &self,
        x: &CpuBuffer,
        weight: &CpuBuffer,
        bias: &CpuBuffer,
        dim: usize,
        eps: f32,
    ) -> Result<CpuBuffer> {
        let x = x.f32s("layer_norm")?;
        let weight = weight.f32s("layer_norm")?;
        let bias = bias.f32s("layer_norm")?;
        rows_of("layer_norm", x.len(), dim)?;
        expect_len("layer_norm", "weight", weight.len(), dim)?;
        expect_len("layer_norm", "bias", bias.len(), dim)?;
        let mut out = vec![0.0; x.len()];
        self.run(|| {
            out.par_chunks_mut(dim)
                .zip(x.par_chunks(dim))
                .for_each(|(o, row)| {
                    let mean = row.iter().sum::<f32>() / dim as f32;
                    let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / dim as f32;
                    let inv = 1.0 / (var + eps).sqrt();
                    for (((o, v), w), b) in o.iter_mut().zip(row).zip(weight).zip(bias) {
                        *o = (v - mean) * inv * w + b;
                    }
                })
        });
        Ok(out.into())
    }

    fn add_assign(&self, acc: &mut CpuBuffer, x: &CpuBuffer) -> Result<()> {
        let acc = acc.f32s_mut("add_assign")?;
        let x = x.f32s("add_assign")?;
        expect_len("add", "addend", x.len(), acc.len())?;
        self.run(|| {
            acc.par_chunks_mut(4096)
                .zip(x.par_chunks(4096))
                .for_each(|(a, b)| a.iter_mut().zip(b).for_each(|(a, b)| *a += b))
        });
        Ok(())
    }

    fn activate(&self, x: &mut CpuBuffer, act: Activation) -> Result<()> {
        let x = x.f32s_mut("activate")?;
        self.run(|| {
            x.par_chunks_mut(4096)
                .for_each(|c| activation_kernels::activate(c, act))
        });
        Ok(())
    }

    fn gated_activate(&self, gate: &mut CpuBuffer, up: &CpuBuffer, act: Activation) -> Result<()> {
        let gate = gate.f32s_mut("gated_activate")?;
        let up = up.f32s("gated_activate")?;
        expect_len("gated_activate", "up", up.len(), gate.len())?;
        self.run(|| {
            gate.par_chunks_mut(4096)
                .zip(up.par_chunks(4096))
                .for_each(|(g, u)| activation_kernels::gated(g, u, act))
        });
        Ok(())
    }

    fn rope(
        &self,
        x: &mut CpuBuffer,
        cos: &CpuBuffer,
        sin: &CpuBuffer,
        heads: usize,
        head_dim: usize,
    ) -> Result<()> {
        let x = x.f32s_mut("rope")?;
        let cos = cos.f32s("rope")?;
        let sin = sin.f32s("rope")?;
        if !head_dim.is_multiple_of(2) {
            return Err(Error::shape("rope", format!("head_dim {head_dim} is odd")));
        }
        let row = heads * head_dim;
        let rows = rows_of("rope", x.len(), row)?;
        expect_len("rope", "cos", cos.len(), rows * head_dim)?;
        expect_len("rope", "sin", sin.len(), rows * head_dim)?;
        let half = head_dim / 2;
        self.run(|| {
            x.par_chunks_mut(row).enumerate().for_each(|(r, xs)| {
                let c = &cos[r * head_dim..(r + 1) * head_dim];
                let s = &sin[r * head_dim..(r + 1) * head_dim];
                for head in xs.chunks_mut(head_dim) {
                    for i in 0..half {
                        let (a, b) = (head[i], head[i + half]);
                        head[i] = a * c[i] - b * s[i];
                        head[i + half] = b * c[i + half] + a * s[i + half];
                    }
                }
            })
        });
        Ok(())
    }

    fn attention(
        &self,
        q: &CpuBuffer,
        k: &CpuBuffer,
        v: &CpuBuffer,
        shape: &AttentionShape,
    ) -> Result<CpuBuffer> {
        let q = q.f32s("attention")?;
        let k = k.f32s("attention")?;
        let v = v.f32s("attention")?;
        attention(self, q, k, v, shape).map(CpuBuffer::F32)
    }

    fn kv_cache(&self, layout: &KvLayout) -> Result<(CpuBuffer, CpuBuffer)> {
        if self.amx {
            let len = amx_shape(layout).len();
            let zeros = || CpuBuffer::Bf16(vec![bf16::ZERO; len]);
            return Ok((zeros(), zeros()));
        }
        let (keys, values) = kv_cache_lens(layout);
        Ok((self.zeros(keys)?, self.zeros(values)?))
    }

    fn write_kv(
        &self,
        (keys, values): (&mut CpuBuffer, &mut CpuBuffer),
        layout: &KvLayout,
        at: usize,
        new_keys: &CpuBuffer,
        new_values: &CpuBuffer,
    ) -> Result<()> {
        let (new_keys, new_values) = (new_keys.f32s("write_kv")?, new_values.f32s("write_kv")?);
        let (width, hd, capacity) = (layout.width(), layout.head_dim, layout.capacity);
        let n = rows_of("write_kv", new_keys.len(), width)?;
        expect_len("write_kv", "values", new_values.len(), n * width)?;
        check_row_range("write_kv", at, n, capacity)?;
        if let (CpuBuffer::Bf16(keys), CpuBuffer::Bf16(values)) = (&mut *keys, &mut *values) {
            let shape = amx_shape(layout);
            expect_len("write_kv", "keys cache", keys.len(), shape.len())?;
            expect_len("write_kv", "values cache", values.len(), shape.len())?;
            amx::write(&shape, (keys, values), at, new_keys, new_values);
            return Ok(());
        }
        let (keys, values) = (keys.f32s_mut("write_kv")?, values.f32s_mut("write_kv")?);
        let (keys_len, values_len) = kv_cache_lens(layout);
        expect_len("write_kv", "keys cache", keys.len(), keys_len)?;
        expect_len("write_kv", "values cache", values.len(), values_len)?;
        let stride = transposed_stride(capacity);
        for (h, (keys_t, head_values)) in keys
            .chunks_exact_mut(hd * stride)
            .zip(values.chunks_exact_mut(capacity * hd))
            .enumerate()
        {
            transpose_into(head_rows(new_keys, 0..n, width, h, hd), keys_t, stride, at);
            for (j, row) in head_values[at * hd..(at + n) * hd]
                .chunks_exact_mut(hd)
                .enumerate()
            {
                row.copy_from_slice(&new_values[j * width + h * hd..][..hd]);
            }
        }
        Ok(())
    }

    fn attention_cached(
        &self,
        q: &CpuBuffer,
        (keys, values): (&CpuBuffer, &CpuBuffer),
        layout: &KvLayout,
        shape: &AttentionShape,
    ) -> Result<CpuBuffer> {
        check_cached_attention(layout, shape)?;
        let q = q.f32s("attention_cached")?;
        // The rows' lengths the mask and heads are checked against (the cache holds at least them).
        let rows_len = shape.kv_rows * layout.width();
        check_attention(shape, q.len(), rows_len, rows_len)?;
        if let (CpuBuffer::Bf16(keys), CpuBuffer::Bf16(values)) = (keys, values) {
            let cache = amx_shape(layout);
            expect_len("attention_cached", "keys cache", keys.len(), cache.len())?;
            expect_len(
                "attention_cached",
                "values cache",
                values.len(),
                cache.len(),
            )?;
            let AttentionMask::Causal { .. } = shape.mask else {
                return Err(Error::shape(
                    "attention_cached",
                    "an AMX cache is attended with a causal mask only",
                ));
            };
            let group = shape.heads / shape.kv_heads;
            let out = attend_heads(self, q, shape, AMX_QUERY_BLOCK, |t, queries| {
                amx::attend(
                    queries,
                    (t.q1 - t.q0) * group,
                    t.causal_first.unwrap_or(0),
                    group,
                    amx::HeadCache::of(cache, keys, values, t.kv_head),
                )
            });
            return Ok(CpuBuffer::F32(out));
        }
        let (keys, values) = (
            keys.f32s("attention_cached")?,
            values.f32s("attention_cached")?,
        );
        let (keys_len, values_len) = kv_cache_lens(layout);
        expect_len("attention_cached", "keys cache", keys.len(), keys_len)?;
        expect_len("attention_cached", "values cache", values.len(), values_len)?;
        let heads = cached_heads(keys, values, layout);
        Ok(CpuBuffer::F32(attend_heads_vectors(self, q, &heads, shape)))
    }

    fn im2col_1d(&self, x: &CpuBuffer, c: &Conv1dShape) -> Result<CpuBuffer> {
        let x = x.f32s("im2col_1d")?;
        c.check(x.len())?;
        let out_len = c.out_len();
        let width = c.channels * c.kernel;
        let mut out = vec![0.0f32; c.segments * out_len * width];
        self.run(|| {
            out.par_chunks_mut(width).enumerate().for_each(|(row, o)| {
                let (seg, t) = (row / out_len, row % out_len);
                let base = seg * c.len;
                for j in 0..c.kernel {
                    // Input step feeding tap j; outside the segment it is zero padding.
                    let Some(step) = (t * c.stride + j)
                        .checked_sub(c.padding)
                        .filter(|&s| s < c.len)
                    else {
                        continue;
                    };
                    let input = &x[(base + step) * c.channels..(base + step + 1) * c.channels];
                    for (ch, v) in input.iter().enumerate() {
                        o[ch * c.kernel + j] = *v;
                    }
                }
            })
        });
        Ok(out.into())
    }

    fn mean_pool_rows(&self, x: &CpuBuffer, dim: usize, window: usize) -> Result<CpuBuffer> {
        let x = x.f32s("mean_pool_rows")?;
        let out_rows = pooled_rows(x.len(), dim, window)?;
        let mut out = vec![0.0f32; out_rows * dim];
        self.run(|| {
            out.par_chunks_mut(dim)
                .zip(x.par_chunks(dim * window))
                .for_each(|(o, group)| {
                    for row in group.chunks(dim) {
                        o.iter_mut().zip(row).for_each(|(o, v)| *o += v);
                    }
                    let inv = 1.0 / window as f32;
                    o.iter_mut().for_each(|v| *v *= inv);
                })
        });
        Ok(out.into())
    }

    fn gather_rows(&self, table: &CpuBuffer, dim: usize, ids: &[u32]) -> Result<CpuBuffer> {
        let rows = rows_of("gather_rows", table.len(), dim)?;
        check_ids(ids, rows)?;
        let mut out = vec![0.0; ids.len() * dim];
        for (o, &id) in out.chunks_mut(dim).zip(ids) {
            let row = id as usize * dim..(id as usize + 1) * dim;
            match table {
                CpuBuffer::F32(t) => o.copy_from_slice(&t[row]),
                CpuBuffer::Bf16(t) => t[row].convert_to_f32_slice(o),
                CpuBuffer::F16(t) => t[row].convert_to_f32_slice(o),
                CpuBuffer::Bf16Panels(t) if t.cols() == dim => t.row_to_f32(id as usize, o),
                CpuBuffer::Bf16Panels(t) => {
                    return Err(Error::shape(
                        "gather_rows",
                        format!("rows of {} from a {}x{} table", dim, t.rows(), t.cols()),
                    ));
                }
            }
        }
        Ok(out.into())
    }

    fn scatter_rows(
        &self,
        dst: &mut CpuBuffer,
        dim: usize,
        rows: &[u32],
        src: &CpuBuffer,
    ) -> Result<()> {
        let dst = dst.f32s_mut("scatter_rows")?;
        let src = src.f32s("scatter_rows")?;
        let dst_rows = rows_of("scatter_rows", dst.len(), dim)?;
        expect_len("scatter_rows", "source", src.len(), rows.len() * dim)?;
        check_scatter_rows(rows, dst_rows)?;
        for (&r, s) in rows.iter().zip(src.chunks(dim)) {
            let r = r as usize;
            dst[r * dim..(r + 1) * dim].copy_from_slice(s);
        }
        Ok(())
    }

    fn write_rows(
        &self,
        dst: &mut CpuBuffer,
        dim: usize,
        at: usize,
        src: &CpuBuffer,
    ) -> Result<()> {
        let dst = dst.f32s_mut("write_rows")?;
        let src = src.f32s("write_rows")?;
        let dst_rows = rows_of("write_rows", dst.len(), dim)?;
        let n = rows_of("write_rows", src.len(), dim)?;
        check_row_range("write_rows", at, n, dst_rows)?;
        dst[at * dim..(at + n) * dim].copy_from_slice(src);
        Ok(())
    }

    fn slice_rows(
        &self,
        src: &CpuBuffer,
        dim: usize,
        start: usize,
        count: usize,
    ) -> Result<CpuBuffer> {
        let src = src.f32s("slice_rows")?;
        let rows = rows_of("slice_rows", src.len(), dim)?;
        check_row_range("slice_rows", start, count, rows)?;
        Ok(src[start * dim..(start + count) * dim].to_vec().into())
    }
}

/// A CPU buffer: f32 values, or a weight kept in its checkpoint's half precision (which only
/// `linear`, as the weight, and `gather_rows`, as the table, read; every other operation takes and
/// makes f32).
pub type CpuBuffer = Values;

impl Values {
    fn f32s(&self, op: &'static str) -> Result<&[f32]> {
        match self {
            Self::F32(v) => Ok(v),
            _ => Err(Error::shape(
                op,
                "a half-precision weight where f32 values go",
            )),
        }
    }

    fn f32s_mut(&mut self, op: &'static str) -> Result<&mut [f32]> {
        match self {
            Self::F32(v) => Ok(v),
            _ => Err(Error::shape(
                op,
                "a half-precision weight where f32 values go",
            )),
        }
    }
}

/// Values of widened weights one linear task holds at a time (16 MiB of f32, in a scratch each
/// thread keeps): a block of output rows is widened just before it is multiplied, so a
/// half-precision weight is never resident in f32. Each block's product packs the input rows
/// again, so blocks are as large as the split between threads allows (`linear_precision`, 512
/// rows on two threads: 1.06x the f32 weights' time with 1 MiB blocks, 1.00x with these).
const WIDENED_BLOCK_VALUES: usize = 1 << 22;

/// `out[m, n] += x[m, k] · w[n, k]ᵀ` for a bf16/f16 weight: blocks of output rows of `w` widened
/// to f32 (exactly: every half value is an f32) and multiplied in parallel, each straight into its
/// own columns of `out`. So the result is the f32 product with the rounded weights, accumulated in
/// f32 like the f32 path.
fn linear_half<T: HalfFloat>(
    out: &mut [f32],
    x: &[f32],
    w: &[T],
    [m, k, n]: [usize; 3],
    threads: usize,
) -> Result<()> {
    if m == 0 || n == 0 {
        return Ok(());
    }
    if m <= GEMV_ROWS {
        linear_half_gemv(out, x, w, [m, k, n], threads);
        return Ok(());
    }
    // Enough blocks for every thread a few times over, none larger than the scratch bound, a
    // multiple of the GEMM kernels' widths (6 columns on AVX2, 8 or 12 elsewhere) where it can be.
    let rows = (n / (4 * threads.max(1))).clamp(1, (WIDENED_BLOCK_VALUES / k.max(1)).max(1));
    let rows = if rows >= KERNEL_WIDTHS {
        rows / KERNEL_WIDTHS * KERNEL_WIDTHS
    } else {
        rows
    };
    matmul_weight_blocks(
        MatMut::row_major(out, m, n),
        MatRef::row_major(x, m, k),
        rows,
        |block, wide| T::convert_to_f32_slice(&w[block.start * k..block.end * k], wide),
    )
}

/// A common multiple of the widths of the GEMM's kernels, for blocks of weight rows they tile
/// without a narrower kernel at the edge.
const KERNEL_WIDTHS: usize = 24;

/// Input rows up to which a half-precision linear streams each weight row once against every input
/// row (decoding, up to a batch of this many sequences: memory-bound, so the weights are read once,
/// at 2 bytes a value) instead of widening blocks for the GEMM. `benches/linear_precision.rs`: on
/// AVX2 the streaming kernel is as fast as the f32 GEMM at 32 rows, and the widened GEMM slower.
const GEMV_ROWS: usize = 32;

/// `out[m, n] += x[m, k] · w[n, k]ᵀ` for a few input rows, a block of weight rows per task.
fn linear_half_gemv<T: HalfFloat>(
    out: &mut [f32],
    x: &[f32],
    w: &[T],
    [m, k, n]: [usize; 3],
    threads: usize,
) {
    let rows = n.div_ceil(4 * threads.max(1)).max(1);
    let parts: Vec<(usize, Vec<f32>)> = (0..n.div_ceil(rows))
        .into_par_iter()
        .map(|b| {
            let (n0, n1) = (b * rows, ((b + 1) * rows).min(n));
            // [m, n1 - n0]: this block's columns of the output.
            let mut part = vec![0.0f32; m * (n1 - n0)];
            T::dot_rows(x, m, &w[n0 * k..n1 * k], k, &mut part);
            (n0, part)
        })
        .collect();
    for (n0, part) in parts {
        let nb = part.len() / m;
        for (row, part_row) in out.chunks_mut(n).zip(part.chunks(nb)) {
            row[n0..n0 + nb]
                .iter_mut()
                .zip(part_row)
                .for_each(|(o, p)| *o += p);
        }
    }
}

/// A half-precision float type the CPU computes with by widening.
trait HalfFloat: Copy + Send + Sync {
    fn convert_to_f32_slice(slice: &[Self], out: &mut [f32]);
    /// `out[r, j] = x[r] · w[j]` for the `rows` rows of `x` and the rows of `w` (both `k` wide),
    /// `w` widened as it is read.
    fn dot_rows(x: &[f32], rows: usize, w: &[Self], k: usize, out: &mut [f32]);
}

impl HalfFloat for bf16 {
    fn convert_to_f32_slice(slice: &[Self], out: &mut [f32]) {
        HalfFloatSliceExt::convert_to_f32_slice(slice, out)
    }

    fn dot_rows(x: &[f32], rows: usize, w: &[Self], k: usize, out: &mut [f32]) {
        gemm::dot_rows_bf16(x, rows, w, k, out)
    }
}

impl HalfFloat for f16 {
    fn convert_to_f32_slice(slice: &[Self], out: &mut [f32]) {
        HalfFloatSliceExt::convert_to_f32_slice(slice, out)
    }

    fn dot_rows(x: &[f32], rows: usize, w: &[Self], k: usize, out: &mut [f32]) {
        let n = out.len() / rows.max(1);
        let mut wide = vec![0.0f32; k];
        for (j, row) in w.chunks(k.max(1)).take(n).enumerate() {
            HalfFloatSliceExt::convert_to_f32_slice(row, &mut wide);
            for r in 0..rows {
                out[r * n + j] = gemm::dot(&x[r * k..(r + 1) * k], &wide);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::attention::{KEY_BLOCK, QUERY_BLOCK};
    use super::*;
    use crate::backend::Segment;

    /// A half-precision linear, streamed (up to `GEMV_ROWS` rows) or widened for the GEMM (more),
    /// is the f64 product with the rounded weights, for bf16 and f16 and widths that leave tails.
    #[test]
    fn half_linears_match_the_product_with_the_rounded_weights_on_both_paths() {
        fn check<T: HalfFloat>(from: impl Fn(f32) -> T, widen: impl Fn(T) -> f32, what: &str) {
            // Blocks a few rows wide (padded products), and wide ones with a narrower last block.
            for (k, n) in [(37, 19), (64, 8), (300, 5), (64, 200)] {
                let w: Vec<T> = (0..n * k)
                    .map(|i| from(((i * 29 % 71) as f32 - 35.0) * 0.013))
                    .collect();
                for m in [1, 2, 3, 5, 8, GEMV_ROWS, GEMV_ROWS + 1, 40] {
                    let x: Vec<f32> = (0..m * k)
                        .map(|i| ((i * 17 % 43) as f32 - 21.0) * 0.05)
                        .collect();
                    let mut out = vec![0.0; m * n];
                    linear_half(&mut out, &x, &w, [m, k, n], 2).unwrap();
                    for (i, &got) in out.iter().enumerate() {
                        let (r, j) = (i / n, i % n);
                        let want: f64 = (0..k)
                            .map(|p| f64::from(x[r * k + p]) * f64::from(widen(w[j * k + p])))
                            .sum();
                        assert!(
                            (f64::from(got) - want).abs() <= 1e-4 * (1.0 + want.abs()),
                            "{what}: {m}x{k} by {n}: [{r}, {j}] {got} vs {want}"
                        );
                    }
                }
            }
        }
        check(bf16::from_f32, bf16::to_f32, "bf16");
        check(f16::from_f32, f16::to_f32, "f16");
    }

    /// Scaled dot-product attention in f64, one row at a time, keys `0..=visible(row)` (or the
    /// segment's visible keys): the definition the blocked kernel must agree with.
    fn reference(q: &[f32], k: &[f32], v: &[f32], s: &AttentionShape) -> Vec<f32> {
        let (hd, group) = (s.head_dim, s.heads / s.kv_heads);
        let keys_of = |row: usize| match &s.mask {
            AttentionMask::Causal { first_query } => 0..first_query + row + 1,
            AttentionMask::Segments(segments) => {
                let seg = segments.iter().find(|g| g.rows.contains(&row)).unwrap();
                seg.rows.start..seg.rows.start + seg.visible_keys
            }
        };
        let mut out = vec![0.0f32; s.q_rows * s.heads * hd];
        for row in 0..s.q_rows {
            for head in 0..s.heads {
                let kvh = head / group;
                let qv = &q[(row * s.heads + head) * hd..][..hd];
                let at = |j: usize| (j * s.kv_heads + kvh) * hd;
                let scores: Vec<f64> = keys_of(row)
                    .map(|j| {
                        let dot: f64 = (0..hd).map(|d| qv[d] as f64 * k[at(j) + d] as f64).sum();
                        dot * s.scale as f64
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                for d in 0..hd {
                    let acc: f64 = keys_of(row)
                        .zip(&weights)
                        .map(|(j, w)| w * v[at(j) + d] as f64)
                        .sum();
                    out[(row * s.heads + head) * hd + d] = (acc / total) as f32;
                }
            }
        }
        out
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let x = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8;
                (x % 2001) as f32 / 500.0 - 2.0
            })
            .collect()
    }

    fn check(s: AttentionShape) {
        // The f32 kernels (AMX tiles round to bf16 halves: see the AMX tests).
        let dev = CpuBackend::new("test", 2).unwrap().without_amx();
        let q = values(s.q_rows * s.heads * s.head_dim, 1);
        let k = values(s.kv_rows * s.kv_heads * s.head_dim, 2);
        let v = values(s.kv_rows * s.kv_heads * s.head_dim, 3);
        let got = attention(&dev, &q, &k, &v, &s).unwrap();
        let want = reference(&q, &k, &v, &s);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "{:?} at {i}: {g} vs {w}",
                s.mask
            );
        }
    }

    #[test]
    fn blocked_causal_attention_is_the_softmax_over_every_visible_key() {
        // Queries past the first query block, keys over several key blocks and a partial one,
        // grouped-query heads; a chunk starting mid-sequence (a KV cache) and one from the start.
        for first_query in [0, 300, 2 * KEY_BLOCK - 1] {
            check(AttentionShape {
                q_rows: QUERY_BLOCK + 37,
                kv_rows: first_query + QUERY_BLOCK + 37,
                heads: 4,
                kv_heads: 2,
                head_dim: 8,
                scale: 0.35,
                mask: AttentionMask::Causal { first_query },
            });
        }
    }

    #[test]
    fn blocked_segment_attention_sees_only_each_segments_visible_keys() {
        let rows = 2 * KEY_BLOCK + 90;
        let segments = vec![
            Segment {
                rows: 0..KEY_BLOCK + 10,
                visible_keys: KEY_BLOCK + 5,
            },
            Segment {
                rows: KEY_BLOCK + 10..rows,
                visible_keys: rows - KEY_BLOCK - 10,
            },
        ];
        check(AttentionShape {
            q_rows: rows,
            kv_rows: rows,
            heads: 2,
            kv_heads: 1,
            head_dim: 16,
            scale: 0.25,
            mask: AttentionMask::Segments(segments),
        });
    }

    #[test]
    fn attention_over_a_cache_filled_chunk_by_chunk_is_the_whole_prompts_bit_for_bit() {
        let dev = CpuBackend::new("test", 2).unwrap().without_amx();
        // The f32 cache: the same bits as attention over the whole prompt's keys and values.
        chunk_by_chunk(&dev, |q, k, v, shape| {
            attention(&dev, q, k, v, shape).unwrap()
        });
    }

    /// A device whose linears and attention round their inputs to bf16 (AVX-512 BF16), without
    /// AMX tiles, or `None` (said on stderr) where the CPU has no AVX-512 BF16.
    fn bf16_inputs_device() -> Option<CpuBackend> {
        let dev = CpuBackend::new("test", 2)
            .unwrap()
            .without_amx()
            .with_bf16_inputs();
        if !dev.uses_bf16_inputs() {
            eprintln!("this CPU has no AVX-512 BF16: nothing to test");
            return None;
        }
        Some(dev)
    }

    #[test]
    fn bf16_input_attention_is_within_bf16_rounding_of_the_softmax() {
        let Some(dev) = bf16_inputs_device() else {
            return;
        };
        let segments = vec![
            Segment {
                rows: 0..KEY_BLOCK + 11,
                visible_keys: KEY_BLOCK + 5,
            },
            Segment {
                rows: KEY_BLOCK + 11..KEY_BLOCK + 100,
                visible_keys: 89,
            },
        ];
        // Head dimensions narrower than, between and past the kernels' 32-column tiles; blocks
        // of keys of odd lengths; grouped-query heads.
        for (heads, kv_heads, hd, mask) in [
            (4, 2, 8, AttentionMask::Causal { first_query: 0 }),
            (6, 1, 40, AttentionMask::Causal { first_query: 301 }),
            (2, 2, 80, AttentionMask::Segments(segments.clone())),
            (2, 1, 128, AttentionMask::Causal { first_query: 7 }),
        ] {
            let q_rows = KEY_BLOCK + 100;
            let kv_rows = match mask {
                AttentionMask::Causal { first_query } => first_query + q_rows,
                AttentionMask::Segments(_) => q_rows,
            };
            let s = AttentionShape {
                q_rows,
                kv_rows,
                heads,
                kv_heads,
                head_dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
                mask,
            };
            let q = values(s.q_rows * heads * hd, 1);
            let k = values(kv_rows * kv_heads * hd, 2);
            let v = values(kv_rows * kv_heads * hd, 3);
            let want = reference(&q, &k, &v, &s);
            let error = worst_error(&attention(&dev, &q, &k, &v, &s).unwrap(), &want);
            let f32_dev = CpuBackend::new("test", 2).unwrap().without_amx();
            let f32_error = worst_error(&attention(&f32_dev, &q, &k, &v, &s).unwrap(), &want);
            // bf16 operands (8 bits of mantissa) put an output within about 2^-8 of the softmax,
            // where the f32 kernels are within rounding of f32 — so these were rounded.
            assert!(
                error <= 1.5e-2 && error > 10.0 * f32_error,
                "heads of {hd}, {:?}: bf16 {error}, f32 {f32_error}",
                s.mask
            );
        }
    }

    #[test]
    fn bf16_input_attention_over_a_cache_filled_chunk_by_chunk_is_the_whole_prompts_bit_for_bit() {
        let Some(dev) = bf16_inputs_device() else {
            return;
        };
        chunk_by_chunk(&dev, |q, k, v, shape| {
            attention(&dev, q, k, v, shape).unwrap()
        });
    }

    /// A device attending with AMX tiles, or `None` (said on stderr) where the CPU has none.
    fn amx_device() -> Option<CpuBackend> {
        let dev = CpuBackend::new("test", 2).unwrap();
        if !dev.uses_amx() {
            eprintln!("this CPU has no AMX tiles: nothing to test");
            return None;
        }
        Some(dev)
    }

    /// The largest `|got − want| / (1 + |want|)`.
    fn worst_error(got: &[f32], want: &[f32]) -> f32 {
        got.iter()
            .zip(want)
            .map(|(g, w)| (g - w).abs() / (1.0 + w.abs()))
            .fold(0.0, f32::max)
    }

    #[test]
    fn amx_encoder_attention_is_within_1e_4_and_each_segment_its_own_bit_for_bit() {
        let Some(dev) = amx_device() else {
            return;
        };
        // Segments shorter than a block of keys, over several with a partial one, one longer than
        // a task (split over tasks), one with padding rows that see only its first keys; head
        // dimensions padded to a tile's depth; grouped-query heads.
        let lengths = [(5, 5), (77, 77), (1100, 1100), (40, 29)];
        let (heads, kv_heads, hd) = (4, 2, 40);
        let mut start = 0;
        let segments: Vec<Segment> = lengths
            .iter()
            .map(|&(rows, visible_keys)| {
                let seg = Segment {
                    rows: start..start + rows,
                    visible_keys,
                };
                start += rows;
                seg
            })
            .collect();
        let shape = |rows: usize, mask: AttentionMask| AttentionShape {
            q_rows: rows,
            kv_rows: rows,
            heads,
            kv_heads,
            head_dim: hd,
            scale: 0.3,
            mask,
        };
        let all = shape(start, AttentionMask::Segments(segments.clone()));
        let q = values(start * heads * hd, 1);
        let k = values(start * kv_heads * hd, 2);
        let v = values(start * kv_heads * hd, 3);
        let got = attention(&dev, &q, &k, &v, &all).unwrap();
        let want = reference(&q, &k, &v, &all);
        let worst = worst_error(&got, &want);
        assert!(worst < 1e-4, "relative error {worst:e}");
        // Each segment attended alone (as a piece of an item is encoded) gives the same bits.
        for seg in &segments {
            let rows = seg.rows.clone();
            let alone = shape(
                rows.len(),
                AttentionMask::Segments(vec![Segment {
                    rows: 0..rows.len(),
                    visible_keys: seg.visible_keys,
                }]),
            );
            let part = |x: &[f32], width: usize| x[rows.start * width..rows.end * width].to_vec();
            let (qw, kw) = (heads * hd, kv_heads * hd);
            let got_alone =
                attention(&dev, &part(&q, qw), &part(&k, kw), &part(&v, kw), &alone).unwrap();
            assert_eq!(got_alone, part(&got, qw), "segment {rows:?}");
        }
        // Causal, keys and values made for the call (a chunk after 300 cached positions).
        let causal = AttentionShape {
            q_rows: 200,
            kv_rows: 500,
            mask: AttentionMask::Causal { first_query: 300 },
            ..shape(0, AttentionMask::Causal { first_query: 0 })
        };
        let q = values(200 * heads * hd, 4);
        let (k, v) = (
            values(500 * kv_heads * hd, 5),
            values(500 * kv_heads * hd, 6),
        );
        let got = attention(&dev, &q, &k, &v, &causal).unwrap();
        let worst = worst_error(&got, &reference(&q, &k, &v, &causal));
        assert!(worst < 1e-4, "causal: relative error {worst:e}");
    }

    #[test]
    fn amx_attention_chunk_by_chunk_is_its_whole_prompts_bit_for_bit_and_f32_within_1e_4() {
        let Some(dev) = amx_device() else {
            return;
        };
        let mut worst = 0.0f32;
        chunk_by_chunk(&dev, |q, k, v, shape| {
            // The whole prompt in one step over an AMX cache, checked against the f64 definition.
            let layout = KvLayout {
                capacity: shape.kv_rows,
                kv_heads: shape.kv_heads,
                head_dim: shape.head_dim,
            };
            let (mut keys, mut cached_values) = dev.kv_cache(&layout).unwrap();
            let f32s = |x: &[f32]| CpuBuffer::F32(x.to_vec());
            dev.write_kv(
                (&mut keys, &mut cached_values),
                &layout,
                0,
                &f32s(k),
                &f32s(v),
            )
            .unwrap();
            let got = dev
                .attention_cached(&f32s(q), (&keys, &cached_values), &layout, shape)
                .unwrap();
            let got = dev.download(&got).unwrap();
            let want = reference(q, k, v, shape);
            worst = worst.max(worst_error(&got, &want));
            got
        });
        // Scores here reach ±48 (in powers of two), so a score's 2⁻¹⁷ relative error is up to 4e-4 of
        // a weight; measured 3.6e-5 (f32: 1e-7).
        assert!(worst < 1e-4, "relative error {worst:e}");
        // An AMX cache is attended causally only (an encoder's segments never reach a cache).
        let layout = KvLayout {
            capacity: 8,
            kv_heads: 1,
            head_dim: 8,
        };
        let (keys, cached_values) = dev.kv_cache(&layout).unwrap();
        let segments = AttentionShape {
            q_rows: 4,
            kv_rows: 4,
            heads: 1,
            kv_heads: 1,
            head_dim: 8,
            scale: 1.0,
            mask: AttentionMask::Segments(vec![Segment {
                rows: 0..4,
                visible_keys: 4,
            }]),
        };
        let q = CpuBuffer::F32(vec![0.0; 32]);
        assert!(
            dev.attention_cached(&q, (&keys, &cached_values), &layout, &segments)
                .is_err()
        );
    }

    #[test]
    fn amx_attention_whose_scores_climb_key_by_key_moves_each_rows_reference_alone() {
        let Some(dev) = amx_device() else {
            return;
        };
        // Keys whose first dimension grows along the prompt: a query with a positive first
        // dimension meets, block after block, scores far above any before (its reference moves
        // many times), beside queries in the same tile whose scores fall (their references must
        // stay as they are).
        let (rows, heads, kv_heads, hd) = (700, 2, 1, 16);
        let q = values(rows * heads * hd, 7);
        let mut k = values(rows * kv_heads * hd, 8);
        for (j, row) in k.chunks_mut(hd).enumerate() {
            row[0] += 0.12 * j as f32;
        }
        let v = values(rows * kv_heads * hd, 9);
        // The first head's scores.
        let score = |row: usize, key: usize| -> f32 {
            let q = &q[row * heads * hd..][..hd];
            q.iter().zip(&k[key * hd..][..hd]).map(|(a, b)| a * b).sum()
        };
        // Some row's scores climb by more than 60 powers of two (four moves of a reference).
        let climb = (0..rows)
            .map(|row| {
                (0..=row)
                    .map(|j| score(row, j) - score(row, 0))
                    .fold(0.0, f32::max)
            })
            .fold(0.0, f32::max);
        assert!(climb * std::f32::consts::LOG2_E > 60.0, "climb {climb}");
        let shape = causal_shape(heads, kv_heads, hd, 1.0);
        let layout = KvLayout {
            capacity: rows,
            kv_heads,
            head_dim: hd,
        };
        let (mut keys, mut cached_values) = dev.kv_cache(&layout).unwrap();
        let f32s = |x: &[f32]| CpuBuffer::F32(x.to_vec());
        dev.write_kv(
            (&mut keys, &mut cached_values),
            &layout,
            0,
            &f32s(&k),
            &f32s(&v),
        )
        .unwrap();
        let attend = |q: &[f32], shape: &AttentionShape| {
            let out = dev.attention_cached(&f32s(q), (&keys, &cached_values), &layout, shape);
            dev.download(&out.unwrap()).unwrap()
        };
        let whole = attend(&q, &shape(rows, 0));
        // Scores of ±60 powers of two carry their split's 2⁻¹⁷ relative error into weights
        // (5e-4 of one): measured 8.3e-4, as before references moved lazily. A weight lost or
        // left unrescaled would be off by far more.
        let worst = worst_error(&whole, &reference(&q, &k, &v, &shape(rows, 0)));
        assert!(worst < 2e-3, "relative error {worst:e}");
        // In chunks (one row alone among them), each row gives the whole prompt's bits.
        let width = heads * hd;
        let mut at = 0;
        for n in [1, 37, 300, 1, 361] {
            let got = attend(&q[at * width..(at + n) * width], &shape(n, at));
            assert_eq!(
                got,
                whole[at * width..(at + n) * width],
                "rows {at}..{}",
                at + n
            );
            at += n;
        }
        assert_eq!(at, rows);
    }

    /// The shape of a causal attention step: `q_rows` rows after `first_query` cached positions.
    fn causal_shape(
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        scale: f32,
    ) -> impl Fn(usize, usize) -> AttentionShape {
        move |q_rows, first_query| AttentionShape {
            q_rows,
            kv_rows: first_query + q_rows,
            heads,
            kv_heads,
            head_dim,
            scale,
            mask: AttentionMask::Causal { first_query },
        }
    }

    /// Attends a prompt over a cache of `dev`'s filled a chunk at a time and checks each chunk's
    /// output against `whole`'s over the whole prompt, bit for bit.
    fn chunk_by_chunk(
        dev: &CpuBackend,
        mut whole: impl FnMut(&[f32], &[f32], &[f32], &AttentionShape) -> Vec<f32>,
    ) {
        // Chunks of one row (decoding steps), of less than a key block and of more than a query
        // block; one head per KV head, groups of two and of six; head dimensions of 8, 16 and 40.
        let chunks = [1, 300, 1, 37, KEY_BLOCK, 1, 2 * QUERY_BLOCK + 3, 1];
        let rows: usize = chunks.iter().sum();
        for (heads, kv_heads, hd) in [(4, 4, 8), (4, 2, 16), (6, 1, 8), (4, 2, 40)] {
            let (q_width, width) = (heads * hd, kv_heads * hd);
            let (q, k, v) = (
                values(rows * q_width, 1),
                values(rows * width, 2),
                values(rows * width, 3),
            );
            let shape = causal_shape(heads, kv_heads, hd, 0.3);
            let whole = whole(&q, &k, &v, &shape(rows, 0));
            let layout = KvLayout {
                capacity: rows + 5,
                kv_heads,
                head_dim: hd,
            };
            let (mut keys, mut cached_values) = dev.kv_cache(&layout).unwrap();
            let mut at = 0;
            for n in chunks {
                let part = |x: &[f32], w: usize| CpuBuffer::F32(x[at * w..(at + n) * w].to_vec());
                dev.write_kv(
                    (&mut keys, &mut cached_values),
                    &layout,
                    at,
                    &part(&k, width),
                    &part(&v, width),
                )
                .unwrap();
                let got = dev
                    .attention_cached(
                        &part(&q, q_width),
                        (&keys, &cached_values),
                        &layout,
                        &shape(n, at),
                    )
                    .unwrap();
                let got = dev.download(&got).unwrap();
                let want = &whole[at * q_width..(at + n) * q_width];
                assert!(
                    got.iter()
                        .zip(want)
                        .all(|(g, w)| g.to_bits() == w.to_bits()),
                    "{heads} heads over {kv_heads}: rows {at}..{}",
                    at + n
                );
                at += n;
            }
            // Nothing is written or read past the cache's rows.
            let row = |w: usize| CpuBuffer::F32(vec![0.0; 6 * w]);
            assert!(
                dev.write_kv(
                    (&mut keys, &mut cached_values),
                    &layout,
                    rows,
                    &row(width),
                    &row(width)
                )
                .is_err()
            );
            assert!(
                dev.attention_cached(
                    &row(q_width),
                    (&keys, &cached_values),
                    &layout,
                    &shape(6, rows)
                )
                .is_err()
            );
        }
    }
}
