//! Attention on the CPU: over a prompt's own keys (prefill and encoders) and over a KV cache,
//! in tasks of query rows per KV head, f32 or bf16 products, or AMX tiles where the CPU has them.

use std::ops::Range;

use half::bf16;
use rayon::prelude::*;

use super::attention_bf16::{self, Bf16Products};
use super::attention_kernels::{self, BlockProducts, F32Products, exp2_and_sum, row_max};
use super::gemm::MatRef;
use super::{CpuBackend, amx};
use crate::backend::{AttentionMask, AttentionShape, KvLayout, check_attention};
use crate::error::Result;

/// Query rows one attention task handles: its keys are transposed once for all of them.
pub(super) const QUERY_BLOCK: usize = 256;
/// Query rows one attention task handles on AMX tiles, which need no scores scratch: a block of
/// keys and values is read from memory once for every tile of a task, so larger tasks read a long
/// context fewer times. A prefill step cut to a few hundred rows by its attention cost (see the
/// engine) had one task of at most 256 rows per KV head and thread left slower than whole
/// 512-row steps; tasks of up to 1 024 rows take it back (measured by `benches/long_prefill.rs`).
pub(super) const AMX_QUERY_BLOCK: usize = 1024;
/// Keys one attention step scores at a time: a `QUERY_BLOCK × KEY_BLOCK` scores scratch (256 KiB)
/// stays in cache, where scoring every key at once wrote and re-read 8 MiB per task at 32k keys.
pub(super) const KEY_BLOCK: usize = 256;

/// One unit of attention work: the query rows of positions `q0..q1` of every head of one KV
/// head's group, against key rows `k0..k1`.
pub(super) struct Task {
    pub(super) kv_head: usize,
    pub(super) q0: usize,
    pub(super) q1: usize,
    pub(super) k0: usize,
    pub(super) k1: usize,
    /// Absolute key position of query position `q0` under a causal mask (`None`: no mask in
    /// range).
    pub(super) causal_first: Option<usize>,
}

/// Where one KV head's keys and values are: the keys transposed (`hd` rows of all its keys, so a
/// block of keys is a range of columns and a row of scores a sum of contiguous rows), the values
/// as rows of `hd`.
#[derive(Clone, Copy)]
pub(super) struct HeadKv<'a> {
    keys_t: attention_kernels::Strided<'a>,
    values: attention_kernels::Strided<'a>,
}

/// Attention over keys and values given as `[kv_rows, kv_heads · hd]` rows (an encoder's, made
/// for this call): each KV head's keys are transposed once for every task that reads them.
pub(super) fn attention(
    dev: &CpuBackend,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: &AttentionShape,
) -> Result<Vec<f32>> {
    check_attention(s, q.len(), k.len(), v.len())?;
    if dev.amx {
        return Ok(attention_amx(dev, q, k, v, s));
    }
    let (hd, kv_heads) = (s.head_dim, s.kv_heads);
    let (kv_stride, keys_stride) = (kv_heads * hd, transposed_stride(s.kv_rows));
    let keys_t: Vec<Vec<f32>> = dev.run(|| {
        (0..kv_heads)
            .into_par_iter()
            .map(|h| {
                let mut out = vec![0.0f32; hd * keys_stride];
                let keys = head_rows(k, 0..s.kv_rows, kv_stride, h, hd);
                transpose_into(keys, &mut out, keys_stride, 0);
                out
            })
            .collect()
    });
    let heads: Vec<HeadKv<'_>> = keys_t
        .iter()
        .enumerate()
        .map(|(h, keys_t)| HeadKv {
            keys_t: attention_kernels::Strided {
                data: keys_t,
                stride: keys_stride,
            },
            values: attention_kernels::Strided {
                data: &v[h * hd..],
                stride: kv_stride,
            },
        })
        .collect();
    Ok(attend_heads_vectors(dev, q, &heads, s))
}

/// [`attention`] on AMX tiles: each segment's visible keys and values (under a causal mask, all
/// of them) laid out as an AMX cache of their own for this call, then attended as a cache is. A
/// vision tower's or audio encoder's attention within each frame or chunk was most of its time on
/// the f32 kernels (profiled over a `bench/pieces.py` run); laying the keys and values out
/// costs a pass over them, the attention a pass per query tile.
pub(super) fn attention_amx(
    dev: &CpuBackend,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: &AttentionShape,
) -> Vec<f32> {
    let width = s.kv_heads * s.head_dim;
    // Each cache's first key and number of keys (segments are not empty and start apart).
    let spans: Vec<(usize, usize)> = match &s.mask {
        AttentionMask::Causal { .. } => vec![(0, s.kv_rows)],
        AttentionMask::Segments(segments) => segments
            .iter()
            .map(|seg| (seg.rows.start, seg.visible_keys))
            .collect(),
    };
    let caches: Vec<(amx::CacheShape, Vec<bf16>, Vec<bf16>)> = dev.run(|| {
        spans
            .par_iter()
            .map(|&(k0, n)| {
                let shape = amx::CacheShape::new(n, s.kv_heads, s.head_dim);
                let mut keys = vec![bf16::ZERO; shape.len()];
                let mut values = vec![bf16::ZERO; shape.len()];
                let rows = k0 * width..(k0 + n) * width;
                amx::write(
                    &shape,
                    (&mut keys, &mut values),
                    0,
                    &k[rows.clone()],
                    &v[rows],
                );
                (shape, keys, values)
            })
            .collect()
    });
    let group = s.heads / s.kv_heads;
    attend_heads(dev, q, s, AMX_QUERY_BLOCK, |t, queries| {
        let nq = (t.q1 - t.q0) * group;
        let span = spans.partition_point(|&(k0, _)| k0 < t.k0);
        let (shape, keys, values) = &caches[span];
        let cache = amx::HeadCache::of(*shape, keys, values, t.kv_head);
        match t.causal_first {
            Some(first) => amx::attend(queries, nq, first, group, cache),
            None => amx::attend_every_key(queries, nq, t.k1 - t.k0, cache),
        }
    })
}

/// [`attend_heads`] with the vector kernels, over each KV head's keys and values in `heads`: in
/// bf16 on a device whose linears round their inputs to bf16 (see [`attention_bf16`]), in f32
/// elsewhere.
pub(super) fn attend_heads_vectors(
    dev: &CpuBackend,
    q: &[f32],
    heads: &[HeadKv<'_>],
    s: &AttentionShape,
) -> Vec<f32> {
    let (group, hd) = (s.heads / s.kv_heads, s.head_dim);
    let bf16 = dev.bf16_inputs && attention_bf16::supports(hd);
    attend_heads(dev, q, s, QUERY_BLOCK, |t, queries| {
        let queries = attention_kernels::Strided {
            data: queries,
            stride: hd,
        };
        let nq = (t.q1 - t.q0) * group;
        let kv = heads[t.kv_head];
        match bf16 {
            true => attend(t, group, hd, &mut Bf16Products::new(queries, nq, hd), kv),
            false => attend(t, group, hd, &mut F32Products { queries, nq, hd }, kv),
        }
    })
}

/// The AMX layout of a cache of `layout`.
pub(super) fn amx_shape(layout: &KvLayout) -> amx::CacheShape {
    amx::CacheShape::new(layout.capacity, layout.kv_heads, layout.head_dim)
}

/// The CPU's KV cache layer: each KV head's keys transposed (`hd` rows of
/// [`transposed_stride`]`(capacity)` floats: row `d` holds every key's value `d`), then each KV
/// head's values as `capacity` rows of `hd`. Attention reads them in place: kept as rows, every
/// step transposed the whole context's keys again (a 30k-token context's decoding step spent more
/// time there than attending) and read each head's values out of rows holding every head's.
pub(super) fn kv_cache_lens(layout: &KvLayout) -> (usize, usize) {
    let (heads, hd) = (layout.kv_heads, layout.head_dim);
    (
        heads * hd * transposed_stride(layout.capacity),
        heads * layout.capacity * hd,
    )
}

/// The KV heads of a cache laid out as [`kv_cache_lens`] says.
pub(super) fn cached_heads<'a>(
    keys: &'a [f32],
    values: &'a [f32],
    layout: &KvLayout,
) -> Vec<HeadKv<'a>> {
    let (hd, stride) = (layout.head_dim, transposed_stride(layout.capacity));
    (0..layout.kv_heads)
        .map(|h| HeadKv {
            keys_t: attention_kernels::Strided {
                data: &keys[h * hd * stride..],
                stride,
            },
            values: attention_kernels::Strided {
                data: &values[h * layout.capacity * hd..],
                stride: hd,
            },
        })
        .collect()
}

/// Attention of `q` by `kernel`, a task at a time: a task takes every query head of one KV head's
/// group, its rows interleaved (position by position, each group's heads in order: `kernel` gets
/// them from the task's first, rows of `hd`), so the group's keys and values are read once for all
/// of them: a decoding step (one position) or a short chunk at long context reads the whole
/// context's keys and values, and that reading, not the arithmetic, is most of its time.
pub(super) fn attend_heads(
    dev: &CpuBackend,
    q: &[f32],
    s: &AttentionShape,
    task_rows: usize,
    kernel: impl Fn(&Task, &[f32]) -> Vec<f32> + Sync,
) -> Vec<f32> {
    let (hd, kv_heads) = (s.head_dim, s.kv_heads);
    let group = s.heads / kv_heads;
    let q_stride = s.heads * hd;
    let split = |rows: usize| task_positions(rows, group, kv_heads, dev.threads(), task_rows);
    let mut tasks = Vec::new();
    match &s.mask {
        AttentionMask::Causal { first_query } => {
            let positions = split(s.q_rows);
            for kv_head in 0..kv_heads {
                for q0 in (0..s.q_rows).step_by(positions) {
                    let q1 = (q0 + positions).min(s.q_rows);
                    tasks.push(Task {
                        kv_head,
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
                let positions = split(seg.rows.len());
                for kv_head in 0..kv_heads {
                    for q0 in seg.rows.clone().step_by(positions) {
                        let q1 = (q0 + positions).min(seg.rows.end);
                        let (k0, k1) = (seg.rows.start, seg.rows.start + seg.visible_keys);
                        tasks.push(Task {
                            kv_head,
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

    // The queries scaled once by the attention's scale and log2 e (every score is then its
    // softmax exponent in powers of two, see `attention_kernels::exp2_and_sum`, with no pass over
    // the scores to scale them), and laid out as the tasks read them: `[kv_heads, q_rows, group,
    // hd]` (a group's heads are adjacent in a query row already).
    let to_log2 = s.scale * std::f32::consts::LOG2_E;
    let group_width = group * hd;
    let mut grouped = vec![0.0f32; q.len()];
    dev.run(|| {
        grouped
            .par_chunks_mut(s.q_rows * group_width)
            .enumerate()
            .for_each(|(kv_head, dst)| {
                for (i, dst) in dst.chunks_mut(group_width).enumerate() {
                    let src = &q[i * q_stride + kv_head * group_width..][..group_width];
                    dst.iter_mut().zip(src).for_each(|(d, &x)| *d = x * to_log2);
                }
            })
    });
    let results: Vec<(usize, usize, Vec<f32>)> = dev.run(|| {
        tasks
            .par_iter()
            .map(|t| {
                let queries = &grouped[(t.kv_head * s.q_rows + t.q0) * group_width..]
                    [..(t.q1 - t.q0) * group_width];
                (t.kv_head, t.q0, kernel(t, queries))
            })
            .collect()
    });
    let mut out = vec![0.0f32; s.q_rows * q_stride];
    for (kv_head, q0, block) in results {
        for (i, rows) in block.chunks(group_width).enumerate() {
            let at = (q0 + i) * q_stride + kv_head * group_width;
            out[at..at + group_width].copy_from_slice(rows);
        }
    }
    out
}

/// Query positions per attention task over `positions` positions, each with `group` query heads
/// on each of `kv_heads` KV heads: at most `task_rows` rows a task (the f32 kernels' scores
/// scratch holds [`QUERY_BLOCK`]), the positions split evenly (a short remainder task left one
/// thread working alone), and at least two tasks a thread while each keeps a register tile's 8
/// rows, so a thread held up (the LLM shares its cores with the encoders and plugins) leaves work
/// the others can take.
pub(super) fn task_positions(
    positions: usize,
    group: usize,
    kv_heads: usize,
    threads: usize,
    task_rows: usize,
) -> usize {
    const TILE_ROWS: usize = 8;
    let rows = positions * group;
    let for_size = rows.div_ceil(task_rows);
    let for_threads = (2 * threads).div_ceil(kv_heads).min(rows / TILE_ROWS);
    positions.div_ceil(for_size.max(for_threads).max(1)).max(1)
}

/// Rows `rows` of one head's `hd` columns in a `[rows, heads, hd]` buffer whose rows are `stride`
/// floats apart.
pub(super) fn head_rows(
    data: &[f32],
    rows: Range<usize>,
    stride: usize,
    head: usize,
    hd: usize,
) -> MatRef<'_> {
    MatRef {
        data: &data[rows.start * stride + head * hd..],
        rows: rows.len(),
        cols: hd,
        row_stride: stride,
        col_stride: 1,
    }
}

/// Writes `m` transposed into `out` (`m.cols` rows, `stride` floats apart) from column `col0`.
pub(super) fn transpose_into(m: MatRef<'_>, out: &mut [f32], stride: usize, col0: usize) {
    // In blocks of 16 rows, so that each output row gets 64 contiguous bytes at a time (a write per
    // value, each to another output row, was most of the transposition's time).
    const BLOCK: usize = 16;
    for j0 in (0..m.rows).step_by(BLOCK) {
        let rows = BLOCK.min(m.rows - j0);
        for d in 0..m.cols {
            let column = &mut out[d * stride + col0 + j0..][..rows];
            for (j, x) in column.iter_mut().enumerate() {
                *x = m.data[(j0 + j) * m.row_stride + d];
            }
        }
    }
}

/// Floats from one row of transposed keys to the next: their count rounded up to a multiple of
/// 32 and 16 more, never a multiple of 128 bytes, so the rows a tile reads at once do not all fall
/// in the same cache sets (as they would 4 KiB apart or any multiple of it).
pub(super) fn transposed_stride(rows: usize) -> usize {
    rows.div_ceil(32) * 32 + 16
}

/// One task's attention output (`[(q1 - q0) · group, hd]`, rows interleaved as the queries), its
/// keys taken `KEY_BLOCK` at a time with an online softmax (each row's running maximum and sum,
/// the output rescaled when the maximum grows), so the scores scratch stays `QUERY_BLOCK ×
/// KEY_BLOCK` floats in cache however long the context. Blocks start at multiples of `KEY_BLOCK`
/// from the task's first key, so a row's blocks are the same whichever rows it is computed with.
/// `products`' queries come scaled to powers of two (see [`attend_heads`]).
pub(super) fn attend(
    t: &Task,
    group: usize,
    hd: usize,
    products: &mut impl BlockProducts,
    kv: HeadKv<'_>,
) -> Vec<f32> {
    let nq = (t.q1 - t.q0) * group;
    let block = KEY_BLOCK.min(t.k1 - t.k0);
    let mut out = vec![0.0f32; nq * hd];
    let mut max = vec![f32::NEG_INFINITY; nq];
    let mut sum = vec![0.0f32; nq];
    let mut scores = vec![0.0f32; nq * block];
    for b0 in (t.k0..t.k1).step_by(KEY_BLOCK) {
        let b1 = (b0 + KEY_BLOCK).min(t.k1);
        let nb = b1 - b0;
        let scores = &mut scores[..nq * nb];
        let block_keys_t = attention_kernels::Strided {
            data: &kv.keys_t.data[b0..],
            stride: kv.keys_t.stride,
        };
        products.scores(block_keys_t, nb, scores);
        for (i, row) in scores.chunks_mut(nb).enumerate() {
            // Keys of this block the row may see: all of them, or up to its own position.
            let visible = match t.causal_first {
                Some(first) => (first + i / group + 1).saturating_sub(b0).min(nb),
                None => nb,
            };
            let (seen, hidden) = row.split_at_mut(visible);
            hidden.fill(0.0);
            if seen.is_empty() {
                continue;
            }
            let new_max = max[i].max(row_max(seen));
            let block_sum = exp2_and_sum(seen, new_max);
            if new_max > max[i] {
                // Earlier blocks' weights were relative to a smaller maximum.
                let rescale = (max[i] - new_max).exp2();
                sum[i] *= rescale;
                out[i * hd..(i + 1) * hd]
                    .iter_mut()
                    .for_each(|o| *o *= rescale);
                max[i] = new_max;
            }
            sum[i] += block_sum;
        }
        let values = attention_kernels::Strided {
            data: &kv.values.data[b0 * kv.values.stride..],
            stride: kv.values.stride,
        };
        products.add_weighted_values(scores, values, nb, &mut out);
    }
    for (row, &total) in out.chunks_mut(hd).zip(&sum) {
        // A row always sees at least its own key, so its sum is at least 1.
        let inv = 1.0 / total;
        row.iter_mut().for_each(|o| *o *= inv);
    }
    out
}
