//! Causal attention over a KV cache on Intel's AMX tiles (Sapphire Rapids and later), where the CPU
//! has them, and an encoder's attention within each segment (its keys and values laid out as a
//! cache of their own: [`attend_every_key`]). At long context attention is nearly all of a prefill
//! (every query meets every earlier key), and AVX-512's fused multiply-adds run it at 16 products a
//! cycle; a tile multiply (`tdpbf16ps`, 16 × 16 × 32 bf16 products into f32) does 512 a cycle.
//!
//! **Precision.** Tiles multiply bf16 (8 bits of mantissa), so each f32 operand is split in two
//! bf16 halves, `x = hi + lo` (`hi` is `x` rounded to bf16, `lo` the rest rounded to bf16: 16 bits
//! of mantissa in all), and a product is `hi·hi + hi·lo + lo·hi`: within about 2⁻¹⁷ of the f32
//! one, where one bf16 multiply is within 2⁻⁹. The scores `q·k` and the weighted sum of the values
//! (softmax weights times values) are each three tile multiplies; the softmax runs in f32.
//!
//! **Layout.** Every tile holds 16 queries as its 16 columns (the transposed problem: scores are
//! `S = K·Qᵀ`, the output `Oᵀ = Vᵀ·Pᵀ`), so a query's reference score, sum and rescaling are one
//! vector lane, with no reduction across a vector: the cache keeps each KV head's keys as rows and
//! its values transposed, both split and padded to whole tiles, block by block ([`CacheShape`]).
//!
//! **Exactness.** A query's result depends only on its own row: keys are taken in blocks of
//! [`KEYS`] from key 0 whatever query tile the row sits in, a key it may not see weighs exactly 0,
//! and its reference score moves (rescaling its sum and output) only by its own scores. So a prompt
//! prefilled in chunks of any size gives the same bits as in one step.

#![allow(unsafe_code)]

use std::sync::OnceLock;

use half::bf16;

/// Keys a block: one tile row of bf16 (64 bytes), the depth of the weighted sum's multiply.
pub const KEYS: usize = 32;
/// Queries a tile: a 16-row tile of 16 f32 columns.
const LANES: usize = 16;
/// Head dimensions one score multiply takes (a tile row of bf16).
const DEPTH: usize = 32;
/// Rows of the tiles the weighted sum accumulates into (`Oᵀ`: head dimensions).
const OUT_ROWS: usize = 16;

/// Whether this CPU (and its OS) runs AMX bf16 tiles and AVX-512 (with its bf16 conversions and
/// `vreduceps`).
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(detect)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect() -> bool {
    use std::arch::is_x86_feature_detected as has;
    let avx512 = has!("avx512f") && has!("avx512bw") && has!("avx512dq") && has!("avx512bf16");
    if !(avx512 && has!("fma")) {
        return false;
    }
    // CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE.
    #[allow(unused_unsafe)]
    // SAFETY: CPUID leaf 7 exists on every x86-64 CPU with AVX-512.
    let leaf7 = unsafe { std::arch::x86_64::__cpuid_count(7, 0) };
    if leaf7.edx & (1 << 22) == 0 || leaf7.edx & (1 << 24) == 0 {
        return false;
    }
    // Linux gives a process the tiles' 8 KiB of register state per thread only when asked.
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with these arguments only changes which register state the process may use.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn detect() -> bool {
    false
}

/// One layer's cache as AMX reads it, per KV head and block of [`KEYS`] keys: the keys as rows of
/// `depth` bf16, their high halves then their low; the values transposed, `depth` rows of
/// [`KEYS`] bf16, high halves then low. Rows and head dimensions are padded with zeros to whole
/// blocks ([`KEYS`], [`DEPTH`]), so a tile never reads past a head's part, and a block's tiles are
/// contiguous (values transposed over the whole context put each of a tile's 16 rows in a page
/// of its own, and made a decoding step at long context much slower than with f32).
#[derive(Clone, Copy, Debug)]
pub struct CacheShape {
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Padded rows.
    pub keys: usize,
    /// Padded head dimensions.
    pub depth: usize,
}

impl CacheShape {
    pub fn new(capacity: usize, kv_heads: usize, head_dim: usize) -> Self {
        Self {
            kv_heads,
            head_dim,
            keys: capacity.div_ceil(KEYS).max(1) * KEYS,
            depth: head_dim.div_ceil(DEPTH).max(1) * DEPTH,
        }
    }

    /// bf16 values of one KV head's keys (or values), both halves.
    pub fn head_len(&self) -> usize {
        2 * self.keys * self.depth
    }

    /// bf16 values of one block's keys (or values), both halves.
    fn block_len(&self) -> usize {
        2 * KEYS * self.depth
    }

    /// bf16 values of one layer's keys (or values), every head's.
    pub fn len(&self) -> usize {
        self.kv_heads * self.head_len()
    }
}

/// `x`'s high half, as bf16 bits: `x` rounded to the nearest bf16, ties to even (rounded, not cut,
/// so that the low half is at most 2⁻⁹ of `x` and the product of two low halves, which is
/// dropped, at most 2⁻¹⁸). Wrapping: a NaN's bits may carry out, and stay a NaN's.
#[inline(always)]
fn high_bits(x: f32) -> u32 {
    let bits = x.to_bits();
    bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16
}

/// `x − high(x)` rounded to bf16.
#[inline(always)]
fn low_bits(x: f32) -> u32 {
    high_bits(x - f32::from_bits(high_bits(x) << 16))
}

/// Writes rows `at..at + n` of a layer's keys and values (`new_keys`, `new_values`: `n` rows of
/// every head's `head_dim` values) into `keys` and `values` laid out as `shape` says.
pub fn write(
    shape: &CacheShape,
    (keys, values): (&mut [bf16], &mut [bf16]),
    at: usize,
    new_keys: &[f32],
    new_values: &[f32],
) {
    let (hd, depth) = (shape.head_dim, shape.depth);
    let width = shape.kv_heads * hd;
    let half = KEYS * depth;
    for (h, (head_keys, head_values)) in keys
        .chunks_exact_mut(shape.head_len())
        .zip(values.chunks_exact_mut(shape.head_len()))
        .enumerate()
    {
        for (i, (k, v)) in new_keys
            .chunks_exact(width)
            .zip(new_values.chunks_exact(width))
            .enumerate()
        {
            let (block, j) = ((at + i) / KEYS, (at + i) % KEYS);
            let block_keys = &mut head_keys[block * shape.block_len()..][..shape.block_len()];
            let block_values = &mut head_values[block * shape.block_len()..][..shape.block_len()];
            let (keys_hi, keys_lo) = block_keys.split_at_mut(half);
            let (values_hi, values_lo) = block_values.split_at_mut(half);
            for d in 0..hd {
                let (k, v) = (k[h * hd + d], v[h * hd + d]);
                keys_hi[j * depth + d] = bf16::from_bits(high_bits(k) as u16);
                keys_lo[j * depth + d] = bf16::from_bits(low_bits(k) as u16);
                values_hi[d * KEYS + j] = bf16::from_bits(high_bits(v) as u16);
                values_lo[d * KEYS + j] = bf16::from_bits(low_bits(v) as u16);
            }
        }
    }
}

/// One KV head's part of a cache laid out as `shape` says.
#[derive(Clone, Copy)]
pub struct HeadCache<'a> {
    pub keys: &'a [bf16],
    pub values: &'a [bf16],
    pub shape: CacheShape,
}

impl<'a> HeadCache<'a> {
    pub fn of(shape: CacheShape, keys: &'a [bf16], values: &'a [bf16], head: usize) -> Self {
        let len = shape.head_len();
        Self {
            keys: &keys[head * len..(head + 1) * len],
            values: &values[head * len..(head + 1) * len],
            shape,
        }
    }
}

/// Causal attention of `nq` query rows (`queries`: rows of `head_dim`, scaled so that a score is
/// its softmax exponent in powers of two) against `cache`: row `i` is at position
/// `first + i / group` and sees keys `0..=` its position. Returns `nq` rows of `head_dim`.
///
/// Keys are taken a block at a time for every tile of 16 queries in turn, so that a block is read
/// from memory once for all of them (a 30k-token context's keys and values do not stay in cache
/// from one tile to the next).
///
/// The caller must have checked [`available`].
pub fn attend(
    queries: &[f32],
    nq: usize,
    first: usize,
    group: usize,
    cache: HeadCache<'_>,
) -> Vec<f32> {
    let hd = cache.shape.head_dim;
    let mut tiles: Vec<QueryTile> = (0..nq)
        .step_by(LANES)
        .map(|at| {
            let rows = LANES.min(nq - at);
            QueryTile::new(
                &queries[at * hd..(at + rows) * hd],
                rows,
                first,
                group,
                at,
                cache.shape,
            )
        })
        .collect();
    attend_tiles(&mut tiles, cache);
    let mut out = vec![0.0f32; nq * hd];
    for (tile, out) in tiles.iter().zip(out.chunks_mut(LANES * hd)) {
        for (lane, row) in out.chunks_exact_mut(hd).enumerate() {
            // A row always sees at least its own key, so its sum is at least 1.
            let inv = 1.0 / tile.sum[lane];
            for (d, o) in row.iter_mut().enumerate() {
                *o = tile.out_t[d][lane] * inv;
            }
        }
    }
    out
}

/// Attention of `nq` query rows (scaled as [`attend`] says) against every one of the first `keys`
/// keys of `cache`: an encoder's bidirectional segment, laid out as a cache of its own.
///
/// The caller must have checked [`available`].
pub fn attend_every_key(queries: &[f32], nq: usize, keys: usize, cache: HeadCache<'_>) -> Vec<f32> {
    // Every row at the last key's position: a group as large as the rows puts them all there.
    attend(queries, nq, keys.saturating_sub(1), nq.max(1), cache)
}

/// Up to 16 queries, a lane each, and their softmax's running state.
struct QueryTile {
    /// The queries transposed into pairs of head dimensions (a tile's second operand: row `r`
    /// holds each query's dimensions 2r and 2r + 1), high halves and low.
    q_hi: Vec<[u32; LANES]>,
    q_lo: Vec<[u32; LANES]>,
    /// Each lane's position (a lane past the rows copies the last row's; its result is dropped).
    position: [i32; LANES],
    lowest: usize,
    highest: usize,
    /// Each lane's reference score, the exponent its weights are relative to (see
    /// [`softmax::weigh`]; `f32::MIN` before any: finite, so that rescaling from it is a factor of
    /// 0, never a NaN), and its sum of weights.
    reference: [f32; LANES],
    sum: [f32; LANES],
    /// Oᵀ: `depth` rows of 16 lanes, the weighted sums so far.
    out_t: Vec<[f32; LANES]>,
}

impl QueryTile {
    fn new(
        queries: &[f32],
        rows: usize,
        first: usize,
        group: usize,
        at: usize,
        shape: CacheShape,
    ) -> Self {
        let hd = shape.head_dim;
        let mut q_hi = vec![[0u32; LANES]; shape.depth / 2];
        let mut q_lo = vec![[0u32; LANES]; shape.depth / 2];
        for lane in 0..rows {
            let q = &queries[lane * hd..(lane + 1) * hd];
            for d in (0..hd).step_by(2) {
                let (a, b) = (q[d], q.get(d + 1).copied().unwrap_or(0.0));
                q_hi[d / 2][lane] = high_bits(b) << 16 | high_bits(a);
                q_lo[d / 2][lane] = low_bits(b) << 16 | low_bits(a);
            }
        }
        let position_of = |lane: usize| first + (at + lane.min(rows - 1)) / group;
        let mut position = [0i32; LANES];
        for (lane, p) in position.iter_mut().enumerate() {
            // Positions are below the cache's capacity, far below 2³¹.
            *p = position_of(lane) as i32;
        }
        Self {
            q_hi,
            q_lo,
            position,
            lowest: position_of(0),
            highest: position_of(rows - 1),
            reference: [f32::MIN; LANES],
            sum: [0.0; LANES],
            out_t: vec![[0.0; LANES]; shape.depth],
        }
    }
}

/// Attends every tile of `query_tiles` to `cache`, on this thread's tiles.
#[cfg(target_arch = "x86_64")]
fn attend_tiles(query_tiles: &mut [QueryTile], cache: HeadCache<'_>) {
    // SAFETY: `available()` was checked by the caller (the CPU backend uses this module only
    // then): the CPU has AMX and AVX-512 with its bf16 conversions.
    unsafe {
        tiles::configure();
        attend_blocks(query_tiles, cache);
        tiles::release();
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn attend_tiles(_: &mut [QueryTile], _: HeadCache<'_>) {
    unreachable!("AMX is x86-64's: `available()` is false elsewhere")
}

/// Blocks of keys and values fetched ahead of the one attended.
#[cfg(target_arch = "x86_64")]
const PREFETCH_BLOCKS: usize = 2;

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16,fma")]
fn attend_blocks(query_tiles: &mut [QueryTile], cache: HeadCache<'_>) {
    use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
    let Some(highest) = query_tiles.iter().map(|t| t.highest).max() else {
        return;
    };
    let depth = cache.shape.depth;
    let (half, block_len) = (KEYS * depth, cache.shape.block_len());
    let mut scores = [[[0.0f32; LANES]; KEYS]; 2];
    let mut p_hi = [[0u32; LANES]; KEYS / 2];
    let mut p_lo = [[0u32; LANES]; KEYS / 2];
    for b0 in (0..=highest).step_by(KEYS) {
        let at = b0 / KEYS * block_len;
        // The block after next is fetched from memory meanwhile: tile loads are not followed by
        // the hardware's prefetchers as vector loads are. A decoding step (one query tile) waited
        // on memory for every block, and so did a prefill step's first tile on each block, though
        // dozens of tiles follow it (both measured by `benches/long_prefill.rs`).
        let ahead = at + PREFETCH_BLOCKS * block_len;
        if b0 + PREFETCH_BLOCKS * KEYS <= highest {
            for part in [
                &cache.keys[ahead..][..block_len],
                &cache.values[ahead..][..block_len],
            ] {
                for line in part.chunks(32) {
                    _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast());
                }
            }
        }
        let (keys, values) = (
            &cache.keys[at..][..block_len],
            &cache.values[at..][..block_len],
        );
        let (keys, values) = (keys.split_at(half), values.split_at(half));
        // The tiles that see keys of this block (positions grow from tile to tile).
        let seeing = query_tiles.partition_point(|t| t.highest < b0);
        let tiles = &mut query_tiles[seeing..];
        // The next tile's scores are multiplied (the tile unit working on its own) while this
        // one's softmax runs on the vector units.
        score(&tiles[0], keys, depth, &mut scores[0]);
        for i in 0..tiles.len() {
            let [even, odd] = &mut scores;
            let (this, next) = if i % 2 == 0 { (even, odd) } else { (odd, even) };
            if let Some(next_tile) = tiles.get(i + 1) {
                score(next_tile, keys, depth, next);
            }
            softmax::weigh(&mut tiles[i], b0, this, (&mut p_hi, &mut p_lo));
            add_weighted_values(&mut tiles[i], values, cache.shape.head_dim, (&p_hi, &p_lo));
        }
    }
}

#[cfg(target_arch = "x86_64")]
/// A block's scores for `tile`, 16 keys a tile (two accumulators: tile multiplies into one
/// accumulator wait for each other): `S = K·Qᵀ` with each operand split, hi·hi + hi·lo + lo·hi.
#[inline(always)]
fn score(
    tile: &QueryTile,
    (keys_hi, keys_lo): (&[bf16], &[bf16]),
    depth: usize,
    scores: &mut [[f32; LANES]; KEYS],
) {
    // SAFETY: the tiles are configured; each load reads 16 rows of 64 bytes inside the slices
    // indexed here (the cache is padded to whole blocks of keys and dimensions).
    unsafe {
        tiles::zero::<0>();
        tiles::zero::<1>();
        for c in 0..depth / DEPTH {
            let key_tile = |keys: &[bf16], h: usize| {
                keys[h * LANES * depth + c * DEPTH..][..(LANES - 1) * depth + DEPTH].as_ptr()
            };
            let pairs = c * DEPTH / 2..(c + 1) * DEPTH / 2;
            tiles::load::<2>(tile.q_hi[pairs.clone()].as_ptr().cast(), LANES * 4);
            tiles::load::<3>(tile.q_lo[pairs].as_ptr().cast(), LANES * 4);
            tiles::load::<4>(key_tile(keys_hi, 0).cast(), depth * 2);
            tiles::load::<5>(key_tile(keys_hi, 1).cast(), depth * 2);
            tiles::load::<6>(key_tile(keys_lo, 0).cast(), depth * 2);
            tiles::load::<7>(key_tile(keys_lo, 1).cast(), depth * 2);
            tiles::three_products();
        }
        tiles::store::<0>(scores.as_mut_ptr().cast(), LANES * 4);
        tiles::store::<1>(scores[LANES..].as_mut_ptr().cast(), LANES * 4);
    }
}

#[cfg(target_arch = "x86_64")]
/// `Oᵀ += Vᵀ·Pᵀ` for `tile`, 16 head dimensions a tile, two tiles at a time, the same three
/// products; a tile of padding only (past `head_dim`, as the second of a head of 16 or the last of
/// one of 80) is left out.
#[inline(always)]
fn add_weighted_values(
    tile: &mut QueryTile,
    (values_hi, values_lo): (&[bf16], &[bf16]),
    head_dim: usize,
    (p_hi, p_lo): (&[[u32; LANES]; KEYS / 2], &[[u32; LANES]; KEYS / 2]),
) {
    // SAFETY: as in `score`; the accumulators are 16 rows of 16 f32 each in `out_t`.
    unsafe {
        for e in (0..tile.out_t.len() / OUT_ROWS).step_by(2) {
            if (e + 1) * OUT_ROWS >= head_dim {
                let value_tile =
                    |values: &[bf16]| values[e * OUT_ROWS * KEYS..][..OUT_ROWS * KEYS].as_ptr();
                let acc = &mut tile.out_t[e * OUT_ROWS..][..OUT_ROWS];
                tiles::load::<0>(acc.as_ptr().cast(), LANES * 4);
                tiles::load::<4>(value_tile(values_hi).cast(), KEYS * 2);
                tiles::load::<6>(value_tile(values_lo).cast(), KEYS * 2);
                // The weights last, as below.
                tiles::load::<2>(p_hi.as_ptr().cast(), LANES * 4);
                tiles::load::<3>(p_lo.as_ptr().cast(), LANES * 4);
                tiles::three_products_into_one();
                tiles::store::<0>(acc.as_mut_ptr().cast(), LANES * 4);
                continue;
            }
            let value_tile = |values: &[bf16], i: usize| {
                values[(e + i) * OUT_ROWS * KEYS..][..OUT_ROWS * KEYS].as_ptr()
            };
            let acc = &mut tile.out_t[e * OUT_ROWS..][..2 * OUT_ROWS];
            tiles::load::<0>(acc.as_ptr().cast(), LANES * 4);
            tiles::load::<1>(acc[OUT_ROWS..].as_ptr().cast(), LANES * 4);
            tiles::load::<4>(value_tile(values_hi, 0).cast(), KEYS * 2);
            tiles::load::<5>(value_tile(values_hi, 1).cast(), KEYS * 2);
            tiles::load::<6>(value_tile(values_lo, 0).cast(), KEYS * 2);
            tiles::load::<7>(value_tile(values_lo, 1).cast(), KEYS * 2);
            // The weights last: the vector stores that wrote them are then done.
            tiles::load::<2>(p_hi.as_ptr().cast(), LANES * 4);
            tiles::load::<3>(p_lo.as_ptr().cast(), LANES * 4);
            tiles::three_products();
            tiles::store::<0>(acc.as_mut_ptr().cast(), LANES * 4);
            tiles::store::<1>(acc[OUT_ROWS..].as_mut_ptr().cast(), LANES * 4);
        }
    }
}

/// The online softmax of a block's scores, on AVX-512 vectors of 16 lanes (one per query).
#[cfg(target_arch = "x86_64")]
mod softmax {
    use std::arch::x86_64::*;

    use super::{KEYS, LANES, QueryTile};

    /// Largest sum of one block's weights a lane takes without moving its reference (at most
    /// 2¹⁶: its weights stay far from f32's range, summed over any context).
    const BLOCK_SUM_LIMIT: f32 = 65_536.0;

    /// Adds the weights 2^(s − m) of the block's keys from `b0` (0 for a key past a lane's
    /// position) to `tile`'s sums, and writes them as pairs of keys, high halves and low (a tile's
    /// second operand). `m` is a lane's **reference**, not its running maximum: a score above it
    /// weighs more than 1, which f32 carries as well, so the block's maximum is not needed. Only
    /// where a lane's block sums past [`BLOCK_SUM_LIMIT`] (or the lane has no reference yet) does
    /// it move its reference to the block's maximum, rescaling its sum and output, and weigh the
    /// block again. A block's maximum was a pass over its scores each time, a chain of 32 waits
    /// that the AMX attention's time showed (measured by `benches/cached_attention.rs`). A lane's
    /// reference moves by its own scores only, so its result is still its row's alone.
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16,fma")]
    pub fn weigh(
        tile: &mut QueryTile,
        b0: usize,
        scores: &[[f32; LANES]; KEYS],
        (p_hi, p_lo): (&mut [[u32; LANES]; KEYS / 2], &mut [[u32; LANES]; KEYS / 2]),
    ) {
        // SAFETY: `attend_tiles` runs only where AVX-512 (F, BW, DQ, BF16) is (`available`); every
        // load and store is of a whole array of 16 lanes.
        unsafe {
            let positions = _mm512_loadu_si512(tile.position.as_ptr().cast());
            // Only the block holding the tile's positions hides any key.
            let masked = b0 + KEYS - 1 > tile.lowest;
            let visible = |j: usize| -> __mmask16 {
                if masked {
                    _mm512_cmple_epi32_mask(_mm512_set1_epi32((b0 + j) as i32), positions)
                } else {
                    0xFFFF
                }
            };
            let score = |j: usize| _mm512_loadu_ps(scores[j].as_ptr());
            // Word 2n of a pair is key 2r's lane n, word 2n + 1 key 2r + 1's.
            let interleave = _mm512_set_epi16(
                31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5,
                20, 4, 19, 3, 18, 2, 17, 1, 16, 0,
            );
            let high_mask = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
            // Writes the block's weights relative to `reference` and returns their sums, in two
            // chains (one chain of 32 additions waited on each), added together: the same order
            // for every lane and block.
            let mut weigh_block = |reference: __m512| {
                let mut block_sums = [_mm512_setzero_ps(); 2];
                for r in 0..KEYS / 2 {
                    let weight = |j: usize| {
                        let w = exp2(_mm512_sub_ps(score(j), reference));
                        _mm512_maskz_mov_ps(visible(j), w)
                    };
                    let (a, b) = (weight(2 * r), weight(2 * r + 1));
                    block_sums[0] = _mm512_add_ps(block_sums[0], a);
                    block_sums[1] = _mm512_add_ps(block_sums[1], b);
                    // bf16 pairs, rounded to nearest: [a's 16, b's 16] interleaved lane by lane.
                    let hi: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(b, a));
                    let hi = _mm512_permutexvar_epi16(interleave, hi);
                    let a_hi = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(hi));
                    let b_hi = _mm512_castsi512_ps(_mm512_and_si512(hi, high_mask));
                    let lo: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(
                        _mm512_sub_ps(b, b_hi),
                        _mm512_sub_ps(a, a_hi),
                    ));
                    let lo = _mm512_permutexvar_epi16(interleave, lo);
                    _mm512_storeu_si512(p_hi[r].as_mut_ptr().cast(), hi);
                    _mm512_storeu_si512(p_lo[r].as_mut_ptr().cast(), lo);
                }
                _mm512_add_ps(block_sums[0], block_sums[1])
            };
            let reference = _mm512_loadu_ps(tile.reference.as_ptr());
            let mut block_sum = weigh_block(reference);
            let mut sum = _mm512_loadu_ps(tile.sum.as_ptr());
            // Not "above the limit": a lane without a reference sums to infinity or NaN.
            let within =
                _mm512_cmp_ps_mask::<_CMP_LE_OQ>(block_sum, _mm512_set1_ps(BLOCK_SUM_LIMIT));
            if within != 0xFFFF {
                let mut block_max = _mm512_set1_ps(f32::MIN);
                for j in 0..KEYS {
                    block_max = _mm512_mask_max_ps(block_max, visible(j), block_max, score(j));
                }
                // A lane past the limit has a score above its reference (its weights sum to more
                // than 32), so its reference only grows; the others keep theirs, rescaled by
                // 2^0 = 1 exactly and weighed again to the same bits.
                let moved = _mm512_mask_mov_ps(reference, !within, block_max);
                let rescale = exp2(_mm512_sub_ps(reference, moved));
                sum = _mm512_mul_ps(sum, rescale);
                for row in tile.out_t.iter_mut() {
                    let scaled = _mm512_mul_ps(_mm512_loadu_ps(row.as_ptr()), rescale);
                    _mm512_storeu_ps(row.as_mut_ptr(), scaled);
                }
                _mm512_storeu_ps(tile.reference.as_mut_ptr(), moved);
                block_sum = weigh_block(moved);
            }
            _mm512_storeu_ps(tile.sum.as_mut_ptr(), _mm512_add_ps(sum, block_sum));
        }
    }

    /// 2^x (x > 0 for a score above a lane's reference, +∞ past f32's range; −∞ and NaN give NaN:
    /// callers mask those lanes): x = n + r with n = ⌊x⌋ and r ∈ [0, 1) (`vreduceps`: one
    /// instruction, where rounding to the nearest integer and subtracting it were two, the second
    /// showing in the AMX attention's time in `benches/cached_attention.rs`), 2^r a degree-4 polynomial with 2^0 = 1 exactly (fitted for relative error on [0, 1): within 3.0e-6, about 2⁻¹⁸, as close as
    /// the weights' split into bf16 halves keeps them; the f32 kernels' degree 6 cost two more
    /// multiply-adds a score), scaled by 2^⌊x⌋ (`vscalefps` takes the floor of its exponent).
    #[target_feature(enable = "avx512f,avx512dq,fma")]
    pub(super) fn exp2(x: __m512) -> __m512 {
        // Rounding down (imm bits 1:0 = 01), no fraction bits kept (7:4), no precision exception (3).
        let r = _mm512_reduce_ps::<0b1001>(x);
        let mut p = _mm512_set1_ps(1.342_664_8e-2);
        for c in [5.224_253_2e-2, 2.412_801_8e-1, 6.930_448_4e-1, 1.0] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        _mm512_scalef_ps(p, x)
    }
}

/// The tile instructions, on eight tiles of 16 rows of 64 bytes: `tmm0` and `tmm1` f32
/// accumulators (16 × 16), `tmm2` and `tmm3` second operands (16 rows of 16 bf16 pairs), `tmm4` to
/// `tmm7` first operands (16 rows of 32 bf16). A tile is not renamed as vector registers are: a
/// load into a tile waits for the multiplies reading it, and a multiply for the last into its
/// accumulator, so each step uses tiles of its own and two accumulators.
#[cfg(target_arch = "x86_64")]
mod tiles {
    use std::arch::asm;

    /// The 64-byte tile configuration (palette 1).
    #[repr(C, align(64))]
    struct Config([u8; 64]);

    const CONFIG: Config = {
        let mut c = [0u8; 64];
        c[0] = 1;
        let mut t = 0;
        while t < 8 {
            c[16 + 2 * t] = 64;
            c[48 + t] = 16;
            t += 1;
        }
        Config(c)
    };

    /// Loads the configuration on this thread. Caller: AMX is available.
    pub unsafe fn configure() {
        // SAFETY: the configuration is a valid palette-1 layout; the caller checked AMX.
        unsafe { asm!("ldtilecfg [{0}]", in(reg) CONFIG.0.as_ptr(), options(nostack, readonly)) }
    }

    /// Returns the tiles to their initial state (so the OS need not save them).
    pub unsafe fn release() {
        // SAFETY: the caller checked AMX.
        unsafe { asm!("tilerelease", options(nostack, nomem)) }
    }

    pub unsafe fn zero<const T: u8>() {
        // SAFETY: configured.
        unsafe { asm!("tilezero tmm{t}", t = const T, options(nostack, nomem)) }
    }

    /// Caller: 16 rows of 64 bytes, `stride` bytes apart from `at`, are readable.
    pub unsafe fn load<const T: u8>(at: *const u8, stride: usize) {
        // SAFETY: as the caller promises.
        unsafe {
            asm!("tileloadd tmm{t}, [{0} + {1}*1]", in(reg) at, in(reg) stride, t = const T,
                options(nostack, readonly))
        }
    }

    /// Caller: 16 rows of 64 bytes, `stride` bytes apart from `at`, are writable.
    pub unsafe fn store<const T: u8>(at: *mut u8, stride: usize) {
        // SAFETY: as the caller promises.
        unsafe {
            asm!("tilestored [{0} + {1}*1], tmm{t}", in(reg) at, in(reg) stride, t = const T,
                options(nostack))
        }
    }

    /// `tmm0 += tmm4·tmm2 + tmm4·tmm3 + tmm6·tmm2` alone (see [`three_products`]).
    pub unsafe fn three_products_into_one() {
        // SAFETY: configured.
        unsafe {
            asm!(
                "tdpbf16ps tmm0, tmm4, tmm2",
                "tdpbf16ps tmm0, tmm4, tmm3",
                "tdpbf16ps tmm0, tmm6, tmm2",
                options(nostack, nomem)
            )
        }
    }

    /// `tmm0 += tmm4·tmm2 + tmm4·tmm3 + tmm6·tmm2` and `tmm1 += tmm5·tmm2 + tmm5·tmm3 +
    /// tmm7·tmm2` (hi·hi + hi·lo + lo·hi, with `tmm2` the second operand's high halves, `tmm3` its
    /// low, `tmm4`/`tmm5` the first's high halves and `tmm6`/`tmm7` its low), in bf16 products
    /// and f32 sums, alternating accumulators.
    pub unsafe fn three_products() {
        // SAFETY: configured.
        unsafe {
            asm!(
                "tdpbf16ps tmm0, tmm4, tmm2",
                "tdpbf16ps tmm1, tmm5, tmm2",
                "tdpbf16ps tmm0, tmm4, tmm3",
                "tdpbf16ps tmm1, tmm5, tmm3",
                "tdpbf16ps tmm0, tmm6, tmm2",
                "tdpbf16ps tmm1, tmm7, tmm2",
                options(nostack, nomem)
            )
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    #[test]
    fn the_softmax_exp2_is_within_3e_6_and_exactly_1_at_0() {
        if !available() {
            eprintln!("this CPU has no AMX tiles: nothing to test");
            return;
        }
        let mut worst = 0.0f64;
        // Below a lane's reference and above it (weights up to 2¹⁶ and more before it moves).
        for i in -200_000..=200_000 {
            let x = -(i as f32) * 1e-4;
            // SAFETY: `available()` says the CPU has AVX-512.
            let got = unsafe {
                let v = softmax::exp2(std::arch::x86_64::_mm512_set1_ps(x));
                std::arch::x86_64::_mm512_cvtss_f32(v)
            };
            let want = 2f64.powf(x as f64);
            worst = worst.max((got as f64 - want).abs() / want);
        }
        assert!(worst < 3e-6, "relative error {worst:e}");
        // SAFETY: as above.
        let one = unsafe {
            std::arch::x86_64::_mm512_cvtss_f32(softmax::exp2(
                std::arch::x86_64::_mm512_setzero_ps(),
            ))
        };
        // A lane whose maximum did not grow is rescaled by exactly 1.
        assert_eq!(one, 1.0);
    }
}
