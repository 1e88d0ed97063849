//! The one tensor type of the core: a device buffer, its shape, and the device it lives on.
//!
//! Shapes are checked here, before any backend call, so a model bug or a malformed input surfaces as
//! [`Error::Shape`] naming the operation instead of a panic inside a kernel.

use crate::backend::{Activation, AttentionShape, Backend, Conv1dShape, KvLayout, Values};
use crate::error::{Error, Result};

pub struct Tensor<B: Backend> {
    buffer: B::Buffer,
    shape: Vec<usize>,
    device: B,
}

impl<B: Backend> std::fmt::Debug for Tensor<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor{:?} on {}", self.shape, self.device.name())
    }
}

/// Whether `len` values fill `shape`.
fn check_count(op: &'static str, len: usize, shape: &[usize]) -> Result<()> {
    if shape.iter().product::<usize>() == len {
        Ok(())
    } else {
        Err(Error::shape(
            op,
            format!("{len} values for shape {shape:?}"),
        ))
    }
}

impl<B: Backend> Tensor<B> {
    /// Copies host data onto the device.
    pub fn from_host(device: &B, data: &[f32], shape: &[usize]) -> Result<Self> {
        check_count("from_host", data.len(), shape)?;
        Ok(Self {
            buffer: device.upload(data)?,
            shape: shape.to_vec(),
            device: device.clone(),
        })
    }

    /// [`Self::from_host`] of data the caller is done with (no copy where the device's memory is
    /// the host's).
    pub fn from_host_vec(device: &B, data: Vec<f32>, shape: &[usize]) -> Result<Self> {
        check_count("from_host_vec", data.len(), shape)?;
        Ok(Self {
            buffer: device.upload_owned(data)?,
            shape: shape.to_vec(),
            device: device.clone(),
        })
    }

    /// A weight matrix or embedding table in its checkpoint's precision (see
    /// [`Backend::upload_weight`]).
    pub fn from_weight(device: &B, data: Values, shape: &[usize]) -> Result<Self> {
        check_count("from_weight", data.len(), shape)?;
        Ok(Self {
            buffer: device.upload_weight(data, shape)?,
            shape: shape.to_vec(),
            device: device.clone(),
        })
    }

    /// A buffer already on `device`, as a tensor of `shape`.
    pub fn from_buffer(device: &B, buffer: B::Buffer, shape: &[usize]) -> Result<Self> {
        check_count("from_buffer", device.len(&buffer), shape)?;
        Ok(Self {
            buffer,
            shape: shape.to_vec(),
            device: device.clone(),
        })
    }

    pub fn zeros(device: &B, shape: &[usize]) -> Result<Self> {
        Ok(Self {
            buffer: device.zeros(shape.iter().product())?,
            shape: shape.to_vec(),
            device: device.clone(),
        })
    }

    fn with(&self, buffer: B::Buffer, shape: Vec<usize>) -> Self {
        Self {
            buffer,
            shape,
            device: self.device.clone(),
        }
    }

    pub fn to_host(&self) -> Result<Vec<f32>> {
        self.device.download(&self.buffer)
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn device(&self) -> &B {
        &self.device
    }

    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of device memory this tensor holds.
    pub fn bytes(&self) -> usize {
        self.device.bytes(&self.buffer)
    }

    /// The last dimension (a row's width).
    pub fn cols(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    /// Everything but the last dimension, flattened.
    pub fn rows(&self) -> usize {
        match self.cols() {
            0 => 0,
            c => self.len() / c,
        }
    }

    /// The same data seen with another shape of the same element count.
    pub fn reshape(mut self, shape: &[usize]) -> Result<Self> {
        if shape.iter().product::<usize>() != self.len() {
            return Err(Error::shape(
                "reshape",
                format!("{:?} to {shape:?}", self.shape),
            ));
        }
        self.shape = shape.to_vec();
        Ok(self)
    }

    /// `self · weightᵀ + bias` over the last dimension (`nn.Linear`, weight `[out, in]`).
    pub fn linear(&self, weight: &Tensor<B>, bias: Option<&Tensor<B>>) -> Result<Self> {
        let [out_f, in_f] = weight.shape[..] else {
            return Err(Error::shape(
                "linear",
                format!("weight shape {:?}", weight.shape),
            ));
        };
        if self.cols() != in_f {
            return Err(Error::shape(
                "linear",
                format!("input {:?} into weight {:?}", self.shape, weight.shape),
            ));
        }
        if let Some(b) = bias
            && b.shape != [out_f]
        {
            return Err(Error::shape(
                "linear",
                format!("bias {:?} for {out_f} outputs", b.shape),
            ));
        }
        let m = self.rows();
        let buffer = self.device.linear(
            &self.buffer,
            &weight.buffer,
            bias.map(|b| &b.buffer),
            [m, in_f, out_f],
        )?;
        let mut shape = self.shape.clone();
        if let Some(last) = shape.last_mut() {
            *last = out_f;
        }
        Ok(self.with(buffer, shape))
    }

    pub fn rms_norm(&self, weight: &Tensor<B>, eps: f32) -> Result<Self> {
        self.expect_row_param("rms_norm", weight)?;
        let buffer = self
            .device
            .rms_norm(&self.buffer, &weight.buffer, self.cols(), eps)?;
        Ok(self.with(buffer, self.shape.clone()))
    }

    pub fn layer_norm(&self, weight: &Tensor<B>, bias: &Tensor<B>, eps: f32) -> Result<Self> {
        self.expect_row_param("layer_norm", weight)?;
        self.expect_row_param("layer_norm", bias)?;
        let buffer =
            self.device
                .layer_norm(&self.buffer, &weight.buffer, &bias.buffer, self.cols(), eps)?;
        Ok(self.with(buffer, self.shape.clone()))
    }

    fn expect_row_param(&self, op: &'static str, p: &Tensor<B>) -> Result<()> {
        if p.shape != [self.cols()] {
            return Err(Error::shape(
                op,
                format!("parameter {:?} for rows of {}", p.shape, self.cols()),
            ));
        }
        Ok(())
    }

    pub fn add_assign(&mut self, x: &Tensor<B>) -> Result<()> {
        if x.shape != self.shape {
            return Err(Error::shape(
                "add",
                format!("{:?} + {:?}", self.shape, x.shape),
            ));
        }
        self.device.add_assign(&mut self.buffer, &x.buffer)
    }

    pub fn activate(mut self, act: Activation) -> Result<Self> {
        self.device.activate(&mut self.buffer, act)?;
        Ok(self)
    }

    /// `act(self) · up`, elementwise.
    pub fn gated(mut self, up: &Tensor<B>, act: Activation) -> Result<Self> {
        if up.shape != self.shape {
            return Err(Error::shape(
                "gated_activate",
                format!("{:?} and {:?}", self.shape, up.shape),
            ));
        }
        self.device
            .gated_activate(&mut self.buffer, &up.buffer, act)?;
        Ok(self)
    }

    /// Rotary embedding on `[rows, heads · head_dim]` with `cos`/`sin` `[rows, head_dim]`.
    pub fn rope(mut self, cos: &Tensor<B>, sin: &Tensor<B>, head_dim: usize) -> Result<Self> {
        if head_dim == 0 || !self.cols().is_multiple_of(head_dim) {
            return Err(Error::shape(
                "rope",
                format!("{:?} in heads of {head_dim}", self.shape),
            ));
        }
        if cos.shape != [self.rows(), head_dim] || sin.shape != cos.shape {
            return Err(Error::shape(
                "rope",
                format!("tables {:?} for {:?}", cos.shape, self.shape),
            ));
        }
        let heads = self.cols() / head_dim;
        self.device
            .rope(&mut self.buffer, &cos.buffer, &sin.buffer, heads, head_dim)?;
        Ok(self)
    }

    /// Attention of these queries over `k`/`v`; see [`AttentionShape`].
    pub fn attention(&self, k: &Tensor<B>, v: &Tensor<B>, shape: &AttentionShape) -> Result<Self> {
        let buffer = self
            .device
            .attention(&self.buffer, &k.buffer, &v.buffer, shape)?;
        Ok(self.with(buffer, vec![shape.q_rows, shape.heads * shape.head_dim]))
    }

    /// Attention of these queries over the first `shape.kv_rows` rows of a KV cache layer.
    pub fn attention_cached(&self, kv: &KvLayer<B>, shape: &AttentionShape) -> Result<Self> {
        let buffer = self.device.attention_cached(
            &self.buffer,
            (&kv.keys, &kv.values),
            &kv.layout,
            shape,
        )?;
        Ok(self.with(buffer, vec![shape.q_rows, shape.heads * shape.head_dim]))
    }

    /// The im2col patches of a 1-D convolution over this time-major input; see
    /// [`Backend::im2col_1d`].
    pub fn im2col_1d(&self, shape: &Conv1dShape) -> Result<Self> {
        if self.shape != [shape.segments * shape.len, shape.channels] {
            return Err(Error::shape(
                "im2col_1d",
                format!("{:?} for {shape:?}", self.shape),
            ));
        }
        let buffer = self.device.im2col_1d(&self.buffer, shape)?;
        Ok(self.with(
            buffer,
            vec![
                shape.segments * shape.out_len(),
                shape.channels * shape.kernel,
            ],
        ))
    }

    /// Means of consecutive groups of `window` rows.
    pub fn mean_pool_rows(&self, window: usize) -> Result<Self> {
        let buffer = self
            .device
            .mean_pool_rows(&self.buffer, self.cols(), window)?;
        Ok(self.with(buffer, vec![self.rows() / window.max(1), self.cols()]))
    }

    /// Rows `ids` of this `[rows, dim]` table.
    pub fn gather_rows(&self, ids: &[u32]) -> Result<Self> {
        let buffer = self.device.gather_rows(&self.buffer, self.cols(), ids)?;
        Ok(self.with(buffer, vec![ids.len(), self.cols()]))
    }

    /// Overwrites rows `rows` of this tensor with the rows of `src`, in order.
    pub fn scatter_rows(&mut self, rows: &[u32], src: &Tensor<B>) -> Result<()> {
        if src.cols() != self.cols() || src.rows() != rows.len() {
            return Err(Error::shape(
                "scatter_rows",
                format!(
                    "{} rows of {:?} into {:?}",
                    rows.len(),
                    src.shape,
                    self.shape
                ),
            ));
        }
        let dim = self.cols();
        self.device
            .scatter_rows(&mut self.buffer, dim, rows, &src.buffer)
    }

    /// Copies `src` into rows `at..` (shapes' row widths must agree).
    pub fn write_rows(&mut self, at: usize, src: &Tensor<B>) -> Result<()> {
        if src.cols() != self.cols() {
            return Err(Error::shape(
                "write_rows",
                format!("{:?} into {:?}", src.shape, self.shape),
            ));
        }
        let dim = self.cols();
        self.device
            .write_rows(&mut self.buffer, dim, at, &src.buffer)
    }

    /// Rows `start..start + count` as a new `[count, cols]` tensor.
    pub fn slice_rows(&self, start: usize, count: usize) -> Result<Self> {
        let buffer = self
            .device
            .slice_rows(&self.buffer, self.cols(), start, count)?;
        Ok(self.with(buffer, vec![count, self.cols()]))
    }
}

/// One layer's KV cache on a device, in the arrangement the device attends over fastest (see
/// [`Backend::kv_cache`]): rows are written with [`Self::write`] and read by
/// [`Tensor::attention_cached`].
pub struct KvLayer<B: Backend> {
    keys: B::Buffer,
    values: B::Buffer,
    layout: KvLayout,
    device: B,
}

impl<B: Backend> KvLayer<B> {
    pub fn new(device: &B, layout: KvLayout) -> Result<Self> {
        let (keys, values) = device.kv_cache(&layout)?;
        Ok(Self {
            keys,
            values,
            layout,
            device: device.clone(),
        })
    }

    /// Stores `keys` and `values` (`[n, kv_heads · head_dim]` each) as rows `at..at + n`.
    pub fn write(&mut self, at: usize, keys: &Tensor<B>, values: &Tensor<B>) -> Result<()> {
        let (width, n) = (self.layout.width(), keys.rows());
        if keys.shape() != [n, width] || values.shape() != [n, width] {
            return Err(Error::shape(
                "write_kv",
                format!(
                    "keys {:?} and values {:?} for rows of {width}",
                    keys.shape(),
                    values.shape()
                ),
            ));
        }
        if at + n > self.layout.capacity {
            return Err(Error::shape(
                "write_kv",
                format!("rows {at}..{} of {}", at + n, self.layout.capacity),
            ));
        }
        self.device.write_kv(
            (&mut self.keys, &mut self.values),
            &self.layout,
            at,
            &keys.buffer,
            &values.buffer,
        )
    }

    /// Device bytes held (whatever is filled).
    pub fn bytes(&self) -> usize {
        self.device.bytes(&self.keys) + self.device.bytes(&self.values)
    }
}
