//! CPU attention's two products in bf16, for a device whose linears round their inputs to bf16
//! (`cpu_bf16_inputs`, on a CPU with AVX-512 BF16): the queries, keys, values and softmax
//! weights rounded to bf16, the products summed in f32 — what a bf16 engine's attention on a GPU
//! computes (flash attention's operands are bf16). The f32 kernels (`attention_kernels`) do 16
//! products a vector instruction; `vdpbf16ps` does 32, and a prefill's attention is a large part
//! of its time after its linears.
//!
//! A task's queries are rounded once; each block's keys and values are rounded as the block is
//! reached (the cache stays f32, so a device reads the same cache whichever kernels it runs),
//! into the pair layout of the bf16 GEMM's panels: the keys' pairs run down their head
//! dimensions (two transposed rows a pair), the values' down their keys. A score or output value
//! is one lane summing its pairs in order, whatever tile it is in, so a row's result depends on
//! its own queries and keys only: a prompt prefilled in chunks of any size gives the same bits.

use super::attention_kernels::{BlockProducts, Strided};
use super::bf16_gemm::{self, interleave_to_pairs, pair_product, round_to_pairs};

/// Columns an operand's rows are padded to: the bf16 GEMM tile's width.
const COLUMNS: usize = 32;

/// Whether [`Bf16Products`] runs heads of `hd` dimensions on this CPU.
pub fn supports(hd: usize) -> bool {
    bf16_gemm::available() && hd > 0 && hd.is_multiple_of(2)
}

/// The products of one task's queries with block after block of keys, in bf16 (see the module).
pub struct Bf16Products {
    nq: usize,
    hd: usize,
    /// `nq` rows of `hd / 2` pairs.
    queries: Vec<u32>,
    /// The current block's keys: `hd / 2` rows of the block's keys (pairs of head dimensions).
    keys: Vec<u32>,
    /// The current block's values: a row of `hd` pairs for each pair of keys.
    values: Vec<u32>,
    /// The current block's softmax weights: `nq` rows of one pair a pair of keys.
    weights: Vec<u32>,
    /// A key past an odd block's last, for its values' last pair.
    zeros: Vec<f32>,
}

impl Bf16Products {
    /// `nq` query rows of `hd` values; the CPU and `hd` must be as [`supports`] checks.
    pub fn new(queries: Strided<'_>, nq: usize, hd: usize) -> Self {
        assert!(supports(hd), "Bf16Products: heads of {hd}");
        let pairs = hd / 2;
        let mut rounded = vec![0; nq * pairs];
        for (i, out) in rounded.chunks_exact_mut(pairs).enumerate() {
            round_to_pairs(&queries.data[i * queries.stride..][..hd], out);
        }
        Self {
            nq,
            hd,
            queries: rounded,
            keys: Vec::new(),
            values: Vec::new(),
            weights: Vec::new(),
            zeros: vec![0.0; hd],
        }
    }
}

impl BlockProducts for Bf16Products {
    fn scores(&mut self, keys_t: Strided<'_>, nb: usize, scores: &mut [f32]) {
        let (pairs, stride) = (self.hd / 2, nb.next_multiple_of(COLUMNS));
        // Columns past `nb` are read by the last tile and their scores dropped: whatever they hold.
        self.keys.resize(pairs * stride, 0);
        for (t, row) in self.keys.chunks_exact_mut(stride).enumerate() {
            interleave_to_pairs(
                &keys_t.data[2 * t * keys_t.stride..][..nb],
                &keys_t.data[(2 * t + 1) * keys_t.stride..][..nb],
                &mut row[..nb],
            );
        }
        pair_product(
            (&self.queries, self.nq, pairs),
            (&self.keys, stride),
            nb,
            (scores, nb),
            false,
        );
    }

    fn add_weighted_values(
        &mut self,
        weights: &[f32],
        values: Strided<'_>,
        nb: usize,
        out: &mut [f32],
    ) {
        let (hd, key_pairs) = (self.hd, nb.div_ceil(2));
        let stride = hd.next_multiple_of(COLUMNS);
        self.values.resize(key_pairs * stride, 0);
        for (s, row) in self.values.chunks_exact_mut(stride).enumerate() {
            let key = |j: usize| {
                if j < nb {
                    &values.data[j * values.stride..][..hd]
                } else {
                    // Weighs 0 (its weight's half is 0): a finite 0 here, never a NaN's product.
                    &self.zeros[..]
                }
            };
            interleave_to_pairs(key(2 * s), key(2 * s + 1), &mut row[..hd]);
        }
        self.weights.resize(self.nq * key_pairs, 0);
        for (row, pairs) in weights
            .chunks_exact(nb)
            .zip(self.weights.chunks_exact_mut(key_pairs))
        {
            round_to_pairs(row, pairs);
        }
        pair_product(
            (&self.weights, self.nq, key_pairs),
            (&self.values, stride),
            hd,
            (out, hd),
            true,
        );
    }
}
