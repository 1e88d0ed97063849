//! Devices the models run on.
//!
//! A [`Backend`] owns device memory ([`Backend::Buffer`]) and the fused operations the models are
//! written in (a linear layer, a norm, rotary embedding, attention, row gathers and scatters). Models
//! only ever call these, through [`crate::Tensor`], so a new device (CUDA: cuBLAS for the linears,
//! NVRTC kernels for the rest, buffers resident on the GPU, work ordered on a stream) is a new
//! implementation of this trait and touches no model code. Host data crosses only at `upload` and
//! `download`.
//!
//! Every buffer holds `f32` row-major data, except a KV cache's, which each device lays out as its
//! attention reads it fastest ([`Backend::kv_cache`]: the CPU keeps keys transposed per head);
//! shapes travel with [`crate::Tensor`], and each operation receives the dimensions it needs and
//! checks them against the buffer lengths.

pub mod cpu;
pub mod cuda;

pub use cpu::Bf16Panels;

use crate::error::{Error, Result};

/// Values in one of the precisions the backends hold: f32, or a checkpoint's bf16/f16 (a weight
/// kept as stored). The CPU backend's buffers are these, and, for a CPU device computing bf16
/// linears in bf16, its matrices packed for that ([`Bf16Panels`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Values {
    F32(Vec<f32>),
    Bf16(Vec<half::bf16>),
    F16(Vec<half::f16>),
    Bf16Panels(Bf16Panels),
}

impl From<Vec<f32>> for Values {
    fn from(v: Vec<f32>) -> Self {
        Self::F32(v)
    }
}

impl Values {
    pub fn len(&self) -> usize {
        match self {
            Self::F32(v) => v.len(),
            Self::Bf16(v) => v.len(),
            Self::F16(v) => v.len(),
            Self::Bf16Panels(w) => w.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match self {
            Self::F32(v) => 4 * v.len(),
            Self::Bf16(v) => 2 * v.len(),
            Self::F16(v) => 2 * v.len(),
            Self::Bf16Panels(w) => w.bytes(),
        }
    }

    /// Values `range` (to split a packed matrix), in the same precision.
    pub fn slice(&self, range: std::ops::Range<usize>) -> Option<Self> {
        Some(match self {
            Self::F32(v) => Self::F32(v.get(range)?.to_vec()),
            Self::Bf16(v) => Self::Bf16(v.get(range)?.to_vec()),
            Self::F16(v) => Self::F16(v.get(range)?.to_vec()),
            // Packed once on a device; a matrix is split before it is uploaded.
            Self::Bf16Panels(_) => return None,
        })
    }

    /// The values widened to f32 (exactly: every half value is an f32).
    pub fn into_f32(self) -> Vec<f32> {
        match self {
            Self::F32(v) => v,
            other => other.to_f32(),
        }
    }

    /// A copy widened to f32.
    pub fn to_f32(&self) -> Vec<f32> {
        use half::slice::HalfFloatSliceExt;
        match self {
            Self::F32(v) => v.clone(),
            Self::Bf16(v) => v.to_f32_vec(),
            Self::F16(v) => v.to_f32_vec(),
            Self::Bf16Panels(w) => w.to_f32(),
        }
    }
}

/// 8-bit samples standing for f32 values through a table, as plugins send pixel values (the host
/// contract's `ByteSamples` layout): each row is `channels` runs of `run` samples; sample v in
/// channel c's run stands for `table[c * 256 + v]`; each run stands for `repeats` copies of itself.
#[derive(Debug, Clone, Copy)]
pub struct ByteSamplesView<'a> {
    pub samples: &'a [u8],
    pub table: &'a [f32],
    pub run: usize,
    pub channels: usize,
    pub repeats: usize,
}

impl ByteSamplesView<'_> {
    /// How many values the samples stand for.
    pub fn value_count(&self) -> usize {
        self.samples.len() * self.repeats
    }
}

/// The activation functions the supported models use, each exactly as PyTorch computes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `x · sigmoid(x)` (SiLU / swish: Qwen2's MLP).
    Silu,
    /// `x · Φ(x)` with the exact error function (`nn.GELU()`: Whisper, the Qwen2-VL merger).
    Gelu,
    /// `x · sigmoid(1.702 x)` (Qwen2-VL's vision blocks).
    QuickGelu,
    /// The tanh approximation of GELU (`gelu_pytorch_tanh`).
    GeluTanh,
}

impl Activation {
    /// The name HF configs use for it (`hidden_act`).
    pub fn from_hf(name: &str) -> Option<Self> {
        match name {
            "silu" | "swish" => Some(Self::Silu),
            "gelu" => Some(Self::Gelu),
            "quick_gelu" => Some(Self::QuickGelu),
            "gelu_pytorch_tanh" | "gelu_new" => Some(Self::GeluTanh),
            _ => None,
        }
    }
}

/// Which keys each query row may attend to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttentionMask {
    /// Decoder self-attention: query row `i` sits at absolute position `first_query + i` of the key
    /// rows and sees keys `0..=first_query + i`.
    Causal { first_query: usize },
    /// Bidirectional attention inside each segment and none across them (packed images, frames or
    /// audio chunks in one encoder call). Query and key rows are the same rows; the segments must
    /// tile them in order.
    Segments(Vec<Segment>),
}

/// Rows of one independently attended item; its rows see only the segment's first `visible_keys`
/// rows as keys (the rest is padding, as in a partly filled 30 s audio chunk).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    pub rows: std::ops::Range<usize>,
    pub visible_keys: usize,
}

impl AttentionMask {
    /// Segments of the given lengths, each fully visible.
    pub fn segments(lengths: impl IntoIterator<Item = usize>) -> Self {
        let mut start = 0;
        Self::Segments(
            lengths
                .into_iter()
                .map(|len| {
                    let rows = start..start + len;
                    start += len;
                    Segment {
                        rows,
                        visible_keys: len,
                    }
                })
                .collect(),
        )
    }
}

/// A 1-D convolution's geometry over `segments` independent sequences of `len` time steps, each
/// `channels` wide, stored time-major (`[segments · len, channels]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv1dShape {
    pub segments: usize,
    pub len: usize,
    pub channels: usize,
    pub kernel: usize,
    pub stride: usize,
    pub padding: usize,
}

impl Conv1dShape {
    /// Output time steps per segment.
    pub fn out_len(&self) -> usize {
        (self.len + 2 * self.padding).saturating_sub(self.kernel) / self.stride.max(1) + 1
    }
}

/// Sizes of one attention call. Queries are `[q_rows, heads, head_dim]`; keys and values are
/// `[kv_rows, kv_heads, head_dim]` (the buffers may be longer: a KV cache with spare capacity);
/// `heads` must be a multiple of `kv_heads` (grouped-query attention). The output is
/// `[q_rows, heads · head_dim]`.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionShape {
    pub q_rows: usize,
    pub kv_rows: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    pub mask: AttentionMask,
}

/// One layer's KV cache: room for `capacity` rows of `kv_heads` heads of `head_dim` keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub capacity: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl KvLayout {
    /// Values in one row of keys (or of values): every head's.
    pub fn width(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// A compute device: memory plus the operations models are written in.
///
/// Operations that return a buffer allocate it; `*_assign`/in-place ones overwrite their first
/// argument. Implementations check every length they are given and return
/// [`crate::Error::Shape`] rather than reading out of bounds.
pub trait Backend: Clone + Send + Sync + 'static {
    type Buffer: Send + Sync + 'static;

    /// A short human-readable name ("cpu:encoders (4 threads)").
    fn name(&self) -> String;
    /// Runs `work` on this device's own threads, so that the many operations of a forward pass are
    /// issued from there instead of each handing over from the caller's thread.
    fn run_on<R: Send>(&self, work: impl FnOnce() -> R + Send) -> R {
        work()
    }
    fn upload(&self, host: &[f32]) -> Result<Self::Buffer>;
    /// [`Self::upload`] of data the caller is done with: a backend whose buffers are host memory
    /// takes it as it is instead of copying it.
    fn upload_owned(&self, host: Vec<f32>) -> Result<Self::Buffer> {
        self.upload(&host)
    }
    /// A linear layer's weight or an embedding table (`shape`: `[rows, cols]` for a matrix), kept
    /// in its checkpoint's precision where the backend computes with it (as `linear`'s weight and
    /// `gather_rows`' table; accumulation stays f32). The default widens it to f32.
    fn upload_weight(&self, weight: Values, _shape: &[usize]) -> Result<Self::Buffer> {
        self.upload_owned(weight.into_f32())
    }
    fn download(&self, buffer: &Self::Buffer) -> Result<Vec<f32>>;
    /// The values 8-bit samples stand for, expanded on the device (a quarter of the bytes cross
    /// to it), or `None` where the device leaves that to the host (the CPU, which expands a block
    /// at a time as it packs patches).
    fn expand_samples(&self, _samples: &ByteSamplesView<'_>) -> Result<Option<Self::Buffer>> {
        Ok(None)
    }
    /// Pixel values the vision encoders pack per block: bounded on the host (4 MiB of f32 at a time,
    /// cache-sized; a 12 MP photo's f32 patches are 290 MB), a whole batch at once on a GPU.
    fn pixel_block_values(&self) -> usize {
        1 << 20
    }
    fn zeros(&self, len: usize) -> Result<Self::Buffer>;
    fn len(&self, buffer: &Self::Buffer) -> usize;
    /// Bytes of device memory the buffer holds (for accounting).
    fn bytes(&self, buffer: &Self::Buffer) -> usize {
        self.len(buffer) * std::mem::size_of::<f32>()
    }

    /// `y[m, n] = x[m, k] · w[n, k]ᵀ + bias[n]`: PyTorch's `nn.Linear` with its `[out, in]` weight.
    fn linear(
        &self,
        x: &Self::Buffer,
        weight: &Self::Buffer,
        bias: Option<&Self::Buffer>,
        dims: [usize; 3],
    ) -> Result<Self::Buffer>;
    /// RMSNorm over rows of `dim`: `w · x / sqrt(mean(x²) + eps)`.
    fn rms_norm(
        &self,
        x: &Self::Buffer,
        weight: &Self::Buffer,
        dim: usize,
        eps: f32,
    ) -> Result<Self::Buffer>;
    /// LayerNorm over rows of `dim` (biased variance, as `nn.LayerNorm`).
    fn layer_norm(
        &self,
        x: &Self::Buffer,
        weight: &Self::Buffer,
        bias: &Self::Buffer,
        dim: usize,
        eps: f32,
    ) -> Result<Self::Buffer>;
    /// `acc += x`, elementwise.
    fn add_assign(&self, acc: &mut Self::Buffer, x: &Self::Buffer) -> Result<()>;
    fn activate(&self, x: &mut Self::Buffer, act: Activation) -> Result<()>;
    /// `gate = act(gate) · up`, elementwise (the gated MLP).
    fn gated_activate(
        &self,
        gate: &mut Self::Buffer,
        up: &Self::Buffer,
        act: Activation,
    ) -> Result<()>;
    /// Rotary embedding in PyTorch's `rotate_half` convention: for each row `r` and head,
    /// `x = x · cos[r] + rotate_half(x) · sin[r]`, with `cos`/`sin` `[rows, head_dim]`.
    fn rope(
        &self,
        x: &mut Self::Buffer,
        cos: &Self::Buffer,
        sin: &Self::Buffer,
        heads: usize,
        head_dim: usize,
    ) -> Result<()>;
    /// Scaled dot-product attention with a softmax in f32.
    fn attention(
        &self,
        q: &Self::Buffer,
        k: &Self::Buffer,
        v: &Self::Buffer,
        shape: &AttentionShape,
    ) -> Result<Self::Buffer>;
    /// One layer's KV cache (keys, values), arranged as this device attends over it fastest. The
    /// default is what [`Self::attention`] takes: `[capacity, kv_heads · head_dim]` rows each.
    fn kv_cache(&self, layout: &KvLayout) -> Result<(Self::Buffer, Self::Buffer)> {
        let len = layout.capacity * layout.width();
        Ok((self.zeros(len)?, self.zeros(len)?))
    }
    /// Stores `new_keys` and `new_values` (`[n, kv_heads · head_dim]` rows each) as rows
    /// `at..at + n` of a cache made by [`Self::kv_cache`].
    fn write_kv(
        &self,
        (keys, values): (&mut Self::Buffer, &mut Self::Buffer),
        layout: &KvLayout,
        at: usize,
        new_keys: &Self::Buffer,
        new_values: &Self::Buffer,
    ) -> Result<()> {
        self.write_rows(keys, layout.width(), at, new_keys)?;
        self.write_rows(values, layout.width(), at, new_values)
    }
    /// [`Self::attention`] over the first `shape.kv_rows` rows of a cache made by
    /// [`Self::kv_cache`].
    fn attention_cached(
        &self,
        q: &Self::Buffer,
        (keys, values): (&Self::Buffer, &Self::Buffer),
        layout: &KvLayout,
        shape: &AttentionShape,
    ) -> Result<Self::Buffer> {
        check_cached_attention(layout, shape)?;
        self.attention(q, keys, values, shape)
    }
    /// The patches a 1-D convolution multiplies by its `[out, channels · kernel]` weight:
    /// `[segments · out_len, channels · kernel]`, element `(t, c · kernel + j)` being input step
    /// `t · stride + j − padding` of channel `c` (zero outside the segment).
    fn im2col_1d(&self, x: &Self::Buffer, shape: &Conv1dShape) -> Result<Self::Buffer>;
    /// Means of consecutive groups of `window` rows of `dim` (average pooling over time).
    fn mean_pool_rows(&self, x: &Self::Buffer, dim: usize, window: usize) -> Result<Self::Buffer>;
    /// `out[i] = table[ids[i]]` for rows of `dim` (embedding lookup).
    fn gather_rows(&self, table: &Self::Buffer, dim: usize, ids: &[u32]) -> Result<Self::Buffer>;
    /// `dst[rows[i]] = src[i]` for rows of `dim` (placing encoder outputs at placeholder positions).
    fn scatter_rows(
        &self,
        dst: &mut Self::Buffer,
        dim: usize,
        rows: &[u32],
        src: &Self::Buffer,
    ) -> Result<()>;
    /// Copy all of `src` into `dst` starting at row `at` (appending to a KV cache).
    fn write_rows(
        &self,
        dst: &mut Self::Buffer,
        dim: usize,
        at: usize,
        src: &Self::Buffer,
    ) -> Result<()>;
    /// Rows `start..start + count` of `src` as a new buffer.
    fn slice_rows(
        &self,
        src: &Self::Buffer,
        dim: usize,
        start: usize,
        count: usize,
    ) -> Result<Self::Buffer>;
}

/// `got == want` for a buffer of operation `op`.
pub(crate) fn expect_len(op: &'static str, what: &str, got: usize, want: usize) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(Error::shape(
            op,
            format!("{what} has {got} elements, expected {want}"),
        ))
    }
}

/// How many rows of `dim` a buffer of `len` elements holds (an error if it is not whole rows).
pub(crate) fn rows_of(op: &'static str, len: usize, dim: usize) -> Result<usize> {
    if dim == 0 || !len.is_multiple_of(dim) {
        return Err(Error::shape(
            op,
            format!("{len} elements are not rows of {dim}"),
        ));
    }
    Ok(len / dim)
}

/// An attention over a KV cache reads inside it, with its heads.
pub(crate) fn check_cached_attention(layout: &KvLayout, s: &AttentionShape) -> Result<()> {
    if s.kv_rows > layout.capacity || s.kv_heads != layout.kv_heads || s.head_dim != layout.head_dim
    {
        return Err(Error::shape(
            "attention_cached",
            format!(
                "{} rows of {} heads of {} over a cache of {} rows of {} heads of {}",
                s.kv_rows,
                s.kv_heads,
                s.head_dim,
                layout.capacity,
                layout.kv_heads,
                layout.head_dim
            ),
        ));
    }
    Ok(())
}

/// Everything an attention call's buffers and mask must satisfy, whatever device runs it: head
/// groups, buffer lengths, a causal window inside the keys, segments tiling the rows in order.
pub(crate) fn check_attention(
    s: &AttentionShape,
    q_len: usize,
    k_len: usize,
    v_len: usize,
) -> Result<()> {
    let (hd, heads, kv_heads) = (s.head_dim, s.heads, s.kv_heads);
    if kv_heads == 0 || heads % kv_heads != 0 {
        return Err(Error::shape(
            "attention",
            format!("{heads} heads over {kv_heads} kv heads"),
        ));
    }
    expect_len("attention", "queries", q_len, s.q_rows * heads * hd)?;
    let kv_need = s.kv_rows * kv_heads * hd;
    if k_len < kv_need || v_len < kv_need {
        return Err(Error::shape(
            "attention",
            format!("keys/values hold fewer than {} rows", s.kv_rows),
        ));
    }
    match &s.mask {
        AttentionMask::Causal { first_query } => {
            if first_query + s.q_rows > s.kv_rows {
                return Err(Error::shape(
                    "attention",
                    format!(
                        "{} queries from position {first_query} past {} keys",
                        s.q_rows, s.kv_rows
                    ),
                ));
            }
        }
        AttentionMask::Segments(segments) => {
            let mut next = 0;
            for seg in segments {
                let ok = seg.rows.start == next
                    && seg.rows.end >= seg.rows.start
                    && (1..=seg.rows.len()).contains(&seg.visible_keys);
                if !ok {
                    return Err(Error::shape(
                        "attention",
                        format!("segment {seg:?} after row {next}"),
                    ));
                }
                next = seg.rows.end;
            }
            if next != s.q_rows || s.q_rows != s.kv_rows {
                return Err(Error::shape(
                    "attention",
                    format!("segments end at {next} of {} rows", s.q_rows),
                ));
            }
        }
    }
    Ok(())
}

impl Conv1dShape {
    /// The input length and geometry an `im2col_1d` call needs.
    pub(crate) fn check(&self, input_len: usize) -> Result<()> {
        expect_len(
            "im2col_1d",
            "input",
            input_len,
            self.segments * self.len * self.channels,
        )?;
        if self.stride == 0 || self.kernel == 0 || self.len + 2 * self.padding < self.kernel {
            return Err(Error::shape("im2col_1d", format!("{self:?}")));
        }
        Ok(())
    }
}

/// Rows of a `mean_pool_rows` input, checked to be whole windows.
pub(crate) fn pooled_rows(len: usize, dim: usize, window: usize) -> Result<usize> {
    let rows = rows_of("mean_pool_rows", len, dim)?;
    if window == 0 || !rows.is_multiple_of(window) {
        return Err(Error::shape(
            "mean_pool_rows",
            format!("{rows} rows in windows of {window}"),
        ));
    }
    Ok(rows / window)
}

/// Row `at` onwards of `dst_rows` has room for `n` rows.
pub(crate) fn check_row_range(op: &'static str, at: usize, n: usize, rows: usize) -> Result<()> {
    if at + n > rows {
        return Err(Error::shape(op, format!("rows {at}..{} of {rows}", at + n)));
    }
    Ok(())
}

/// Token ids of an embedding lookup, each inside the table's `rows`.
pub(crate) fn check_ids(ids: &[u32], rows: usize) -> Result<()> {
    match ids.iter().find(|&&i| i as usize >= rows) {
        Some(bad) => Err(Error::Input(format!(
            "token id {bad} is outside the vocabulary of {rows}"
        ))),
        None => Ok(()),
    }
}

/// Destination rows of a scatter, each inside `dst_rows`.
pub(crate) fn check_scatter_rows(rows: &[u32], dst_rows: usize) -> Result<()> {
    match rows.iter().find(|&&r| r as usize >= dst_rows) {
        Some(bad) => Err(Error::shape(
            "scatter_rows",
            format!("row {bad} of {dst_rows}"),
        )),
        None => Ok(()),
    }
}
