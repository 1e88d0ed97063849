//! The CPU device: buffers are `Vec<f32>`, linears are `gemm` calls, everything else is rayon over
//! rows. Each `CpuBackend` owns its own rayon thread pool, so an encoder device and the LLM never
//! compete for the same threads (the "dedicated devices" of the design): work submitted to one
//! device runs only on that device's threads.

use std::sync::Arc;

use rayon::prelude::*;

use super::gemm::{MatMut, MatRef, Threads, matmul};
use super::{
    Activation, AttentionMask, AttentionShape, Backend, Conv1dShape, check_attention, check_ids,
    check_row_range, check_scatter_rows, expect_len, pooled_rows, rows_of,
};
use crate::error::{Error, Result};

/// Query rows one attention task handles: bounds the scores scratch to `QUERY_BLOCK × keys` floats.
const QUERY_BLOCK: usize = 64;

#[derive(Clone)]
pub struct CpuBackend {
    pool: Arc<rayon::ThreadPool>,
    label: Arc<str>,
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
        })
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    fn run<T: Send>(&self, work: impl FnOnce() -> T + Send) -> T {
        self.pool.install(work)
    }
}

fn activate_one(x: f32, act: Activation) -> f32 {
    match act {
        Activation::Silu => x / (1.0 + (-x).exp()),
        Activation::Gelu => 0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2)),
        Activation::QuickGelu => x / (1.0 + (-1.702 * x).exp()),
        Activation::GeluTanh => {
            let inner = 0.797_884_6 * (x + 0.044715 * x * x * x);
            0.5 * x * (1.0 + inner.tanh())
        }
    }
}

impl Backend for CpuBackend {
    type Buffer = Vec<f32>;

    fn name(&self) -> String {
        format!("cpu:{} ({} threads)", self.label, self.threads())
    }

    fn run_on<R: Send>(&self, work: impl FnOnce() -> R + Send) -> R {
        self.run(work)
    }

    fn upload(&self, host: &[f32]) -> Result<Vec<f32>> {
        Ok(host.to_vec())
    }

    fn upload_owned(&self, host: Vec<f32>) -> Result<Vec<f32>> {
        Ok(host)
    }

    fn download(&self, buffer: &Vec<f32>) -> Result<Vec<f32>> {
        Ok(buffer.clone())
    }

    fn zeros(&self, len: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; len])
    }

    fn len(&self, buffer: &Vec<f32>) -> usize {
        buffer.len()
    }

    fn linear(
        &self,
        x: &Vec<f32>,
        weight: &Vec<f32>,
        bias: Option<&Vec<f32>>,
        dims: [usize; 3],
    ) -> Result<Vec<f32>> {
        let [m, k, n] = dims;
        expect_len("linear", "input", x.len(), m * k)?;
        expect_len("linear", "weight", weight.len(), n * k)?;
        if let Some(b) = bias {
            expect_len("linear", "bias", b.len(), n)?;
        }
        let mut out = vec![0.0; m * n];
        let threads = self.threads();
        self.run(|| {
            if let Some(b) = bias {
                out.par_chunks_mut(n).for_each(|row| row.copy_from_slice(b));
            }
            matmul(
                MatMut::row_major(&mut out, m, n),
                MatRef::row_major(x, m, k),
                MatRef::row_major(weight, n, k).t(),
                bias.is_some(),
                Threads::Pool(threads),
            )
        })?;
        Ok(out)
    }

    fn rms_norm(&self, x: &Vec<f32>, weight: &Vec<f32>, dim: usize, eps: f32) -> Result<Vec<f32>> {
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
        Ok(out)
    }

    fn layer_norm(
        &self,
        x: &Vec<f32>,
        weight: &Vec<f32>,
        bias: &Vec<f32>,
        dim: usize,
        eps: f32,
    ) -> Result<Vec<f32>> {
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
        Ok(out)
    }

    fn add_assign(&self, acc: &mut Vec<f32>, x: &Vec<f32>) -> Result<()> {
        expect_len("add", "addend", x.len(), acc.len())?;
        self.run(|| {
            acc.par_chunks_mut(4096)
                .zip(x.par_chunks(4096))
                .for_each(|(a, b)| a.iter_mut().zip(b).for_each(|(a, b)| *a += b))
        });
        Ok(())
    }

    fn activate(&self, x: &mut Vec<f32>, act: Activation) -> Result<()> {
        self.run(|| {
            x.par_chunks_mut(4096)
                .for_each(|c| c.iter_mut().for_each(|v| *v = activate_one(*v, act)))
        });
        Ok(())
    }

    fn gated_activate(&self, gate: &mut Vec<f32>, up: &Vec<f32>, act: Activation) -> Result<()> {
        expect_len("gated_activate", "up", up.len(), gate.len())?;
        self.run(|| {
            gate.par_chunks_mut(4096)
                .zip(up.par_chunks(4096))
                .for_each(|(g, u)| {
                    g.iter_mut()
                        .zip(u)
                        .for_each(|(g, u)| *g = activate_one(*g, act) * u)
                })
        });
        Ok(())
    }

    fn rope(
        &self,
        x: &mut Vec<f32>,
        cos: &Vec<f32>,
        sin: &Vec<f32>,
        heads: usize,
        head_dim: usize,
    ) -> Result<()> {
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
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        shape: &AttentionShape,
    ) -> Result<Vec<f32>> {
        attention(self, q, k, v, shape)
    }

    fn im2col_1d(&self, x: &Vec<f32>, c: &Conv1dShape) -> Result<Vec<f32>> {
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
        Ok(out)
    }

    fn mean_pool_rows(&self, x: &Vec<f32>, dim: usize, window: usize) -> Result<Vec<f32>> {
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
        Ok(out)
    }

    fn gather_rows(&self, table: &Vec<f32>, dim: usize, ids: &[u32]) -> Result<Vec<f32>> {
        let rows = rows_of("gather_rows", table.len(), dim)?;
        check_ids(ids, rows)?;
        let mut out = vec![0.0; ids.len() * dim];
        for (o, &id) in out.chunks_mut(dim).zip(ids) {
            let id = id as usize;
            o.copy_from_slice(&table[id * dim..(id + 1) * dim]);
        }
        Ok(out)
    }

    fn scatter_rows(
        &self,
        dst: &mut Vec<f32>,
        dim: usize,
        rows: &[u32],
        src: &Vec<f32>,
    ) -> Result<()> {
        let dst_rows = rows_of("scatter_rows", dst.len(), dim)?;
        expect_len("scatter_rows", "source", src.len(), rows.len() * dim)?;
        check_scatter_rows(rows, dst_rows)?;
        for (&r, s) in rows.iter().zip(src.chunks(dim)) {
            let r = r as usize;
            dst[r * dim..(r + 1) * dim].copy_from_slice(s);
        }
        Ok(())
    }

    fn write_rows(&self, dst: &mut Vec<f32>, dim: usize, at: usize, src: &Vec<f32>) -> Result<()> {
        let dst_rows = rows_of("write_rows", dst.len(), dim)?;
        let n = rows_of("write_rows", src.len(), dim)?;
        check_row_range("write_rows", at, n, dst_rows)?;
        dst[at * dim..(at + n) * dim].copy_from_slice(src);
        Ok(())
    }

    fn slice_rows(
        &self,
        src: &Vec<f32>,
        dim: usize,
        start: usize,
        count: usize,
    ) -> Result<Vec<f32>> {
        let rows = rows_of("slice_rows", src.len(), dim)?;
        check_row_range("slice_rows", start, count, rows)?;
        Ok(src[start * dim..(start + count) * dim].to_vec())
    }
}

/// One unit of attention work: query rows `q0..q1` of one head, against key rows `k0..k1`.
struct Task {
    head: usize,
    q0: usize,
    q1: usize,
    k0: usize,
    k1: usize,
    /// Absolute key position of query row `q0` under a causal mask (`None`: no mask in range).
    causal_first: Option<usize>,
}

fn attention(
    dev: &CpuBackend,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: &AttentionShape,
) -> Result<Vec<f32>> {
    check_attention(s, q.len(), k.len(), v.len())?;
    let (hd, heads, kv_heads) = (s.head_dim, s.heads, s.kv_heads);
    let mut tasks = Vec::new();
    match &s.mask {
        AttentionMask::Causal { first_query } => {
            for head in 0..heads {
                for q0 in (0..s.q_rows).step_by(QUERY_BLOCK) {
                    let q1 = (q0 + QUERY_BLOCK).min(s.q_rows);
                    tasks.push(Task {
                        head,
                        q0,
                        q1,
                        k0: 0,
                        k1: first_query + q1,
                        causal_first: Some(first_query + q0),
                    });
                }
            }
        }
        AttentionMask::Segments(segments) => {
            for seg in segments {
                for head in 0..heads {
                    for q0 in seg.rows.clone().step_by(QUERY_BLOCK) {
                        let q1 = (q0 + QUERY_BLOCK).min(seg.rows.end);
                        let (k0, k1) = (seg.rows.start, seg.rows.start + seg.visible_keys);
                        tasks.push(Task {
                            head,
                            q0,
                            q1,
                            k0,
                            k1,
                            causal_first: None,
                        });
                    }
                }
            }
        }
    }

    let group = heads / kv_heads;
    let (q_stride, kv_stride) = (heads * hd, kv_heads * hd);
    let results: Vec<Result<(usize, usize, Vec<f32>)>> = dev.run(|| {
        tasks
            .par_iter()
            .map(|t| {
                let (nq, nk) = (t.q1 - t.q0, t.k1 - t.k0);
                let kvh = t.head / group;
                let mut scores = vec![0.0f32; nq * nk];
                matmul(
                    MatMut::row_major(&mut scores, nq, nk),
                    MatRef {
                        data: &q[t.q0 * q_stride + t.head * hd..],
                        rows: nq,
                        cols: hd,
                        row_stride: q_stride,
                        col_stride: 1,
                    },
                    MatRef {
                        data: &k[t.k0 * kv_stride + kvh * hd..],
                        rows: nk,
                        cols: hd,
                        row_stride: kv_stride,
                        col_stride: 1,
                    }
                    .t(),
                    false,
                    Threads::One,
                )?;
                for (i, row) in scores.chunks_mut(nk).enumerate() {
                    // Keys this row may see: all of them, or up to its own position.
                    let visible = match t.causal_first {
                        Some(first) => (first + i + 1 - t.k0).min(nk),
                        None => nk,
                    };
                    let (seen, hidden) = row.split_at_mut(visible);
                    let mut max = f32::NEG_INFINITY;
                    for x in seen.iter_mut() {
                        *x *= s.scale;
                        max = max.max(*x);
                    }
                    let mut sum = 0.0;
                    for x in seen.iter_mut() {
                        *x = (*x - max).exp();
                        sum += *x;
                    }
                    let inv = 1.0 / sum;
                    seen.iter_mut().for_each(|x| *x *= inv);
                    hidden.fill(0.0);
                }
                let mut out = vec![0.0f32; nq * hd];
                matmul(
                    MatMut::row_major(&mut out, nq, hd),
                    MatRef::row_major(&scores, nq, nk),
                    MatRef {
                        data: &v[t.k0 * kv_stride + kvh * hd..],
                        rows: nk,
                        cols: hd,
                        row_stride: kv_stride,
                        col_stride: 1,
                    },
                    false,
                    Threads::One,
                )?;
                Ok((t.head, t.q0, out))
            })
            .collect()
    });
    let mut out = vec![0.0f32; s.q_rows * q_stride];
    for r in results {
        let (head, q0, block) = r?;
        for (i, row) in block.chunks(hd).enumerate() {
            let at = (q0 + i) * q_stride + head * hd;
            out[at..at + hd].copy_from_slice(row);
        }
    }
    Ok(out)
}
