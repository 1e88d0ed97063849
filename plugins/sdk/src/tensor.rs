//! Building contract tensors from typed Rust data (little-endian bytes, shape checked).

use crate::{Dtype, PluginError, PluginResult, Tensor};

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::U8 => 1,
            Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::I32 | Dtype::F32 => 4,
            Dtype::I64 => 8,
        }
    }
}

fn checked_tensor(
    name: &str,
    dtype: Dtype,
    shape: &[usize],
    data: Vec<u8>,
) -> PluginResult<Tensor> {
    let elements = shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| {
            PluginError::internal(format!("tensor {name}: shape {shape:?} overflows"))
        })?;
    if elements * dtype.size() != data.len() {
        return Err(PluginError::internal(format!(
            "tensor {name}: shape {shape:?} needs {} bytes, got {}",
            elements * dtype.size(),
            data.len()
        )));
    }
    Ok(Tensor {
        name: name.to_owned(),
        dtype,
        shape: shape.iter().map(|&d| d as u64).collect(),
        data,
    })
}

impl Tensor {
    /// A `u8` tensor that takes ownership of `data` (no copy).
    pub fn from_u8(name: &str, shape: &[usize], data: Vec<u8>) -> PluginResult<Tensor> {
        checked_tensor(name, Dtype::U8, shape, data)
    }

    /// An `f32` tensor.
    pub fn from_f32(name: &str, shape: &[usize], values: &[f32]) -> PluginResult<Tensor> {
        let mut data = Vec::with_capacity(values.len() * 4);
        data.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        checked_tensor(name, Dtype::F32, shape, data)
    }

    /// An `f32` tensor from values already in little-endian bytes (no copy). Large outputs are
    /// best written this way: e.g. a lookup table of `[u8; 4]` per input byte, then
    /// `Vec::into_flattened`.
    pub fn from_f32_bytes(name: &str, shape: &[usize], data: Vec<u8>) -> PluginResult<Tensor> {
        checked_tensor(name, Dtype::F32, shape, data)
    }

    /// An `i64` tensor.
    pub fn from_i64(name: &str, shape: &[usize], values: &[i64]) -> PluginResult<Tensor> {
        let mut data = Vec::with_capacity(values.len() * 8);
        data.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        checked_tensor(name, Dtype::I64, shape, data)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().map(|&d| d as usize).product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
