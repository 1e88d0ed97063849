//! Reading a model's weights from an HF directory: `model.safetensors`, or the shards listed in
//! `model.safetensors.index.json`. Tensors are converted to f32 on the host (from f32, f16 or bf16)
//! and renamed once to the names the model code uses, so checkpoints saved by different
//! transformers versions load through one path.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// One tensor on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// All tensors of a checkpoint, by (renamed) name. Models take what they need; what is left over is
/// reported so a checkpoint with unexpected parts is noticed.
#[derive(Debug)]
pub struct Weights {
    dir: PathBuf,
    tensors: HashMap<String, HostTensor>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_owned(),
        source,
    }
}

/// The safetensors files of a model directory, in a stable order.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(io(&index))?;
        let parsed: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::Weights(format!("{}: {e}", index.display())))?;
        let map = parsed
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| Error::Weights(format!("{}: no weight_map", index.display())))?;
        let mut files: Vec<&str> = map.values().filter_map(|v| v.as_str()).collect();
        files.sort_unstable();
        files.dedup();
        return files
            .into_iter()
            .map(|f| {
                // Shard names come from the file; refuse anything that would leave the directory.
                if f.contains('/') || f.contains('\\') || f == ".." {
                    Err(Error::Weights(format!(
                        "shard name {f:?} in {}",
                        index.display()
                    )))
                } else {
                    Ok(dir.join(f))
                }
            })
            .collect();
    }
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    Err(Error::Weights(format!(
        "{} has neither model.safetensors nor model.safetensors.index.json",
        dir.display()
    )))
}

fn to_f32(dtype: Dtype, bytes: &[u8], name: &str) -> Result<Vec<f32>> {
    let chunks = |n: usize| bytes.chunks_exact(n);
    Ok(match dtype {
        Dtype::F32 => chunks(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::F16 => chunks(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::BF16 => chunks(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => {
            return Err(Error::Weights(format!(
                "{name}: dtype {other:?} is not supported (f32, f16, bf16)"
            )));
        }
    })
}

impl Weights {
    /// Loads every tensor of the directory's checkpoint, renaming each with `rename`.
    pub fn load(dir: &Path, rename: impl Fn(&str) -> String) -> Result<Self> {
        let mut tensors = HashMap::new();
        for file in weight_files(dir)? {
            let bytes = std::fs::read(&file).map_err(io(&file))?;
            let st = SafeTensors::deserialize(&bytes)
                .map_err(|e| Error::Weights(format!("{}: {e}", file.display())))?;
            for (name, view) in st.tensors() {
                let data = to_f32(view.dtype(), view.data(), &name)?;
                let renamed = rename(&name);
                let tensor = HostTensor {
                    shape: view.shape().to_vec(),
                    data,
                };
                if tensors.insert(renamed.clone(), tensor).is_some() {
                    return Err(Error::Weights(format!(
                        "{renamed} appears twice (after renaming {name})"
                    )));
                }
            }
        }
        Ok(Self {
            dir: dir.to_owned(),
            tensors,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Removes and returns a tensor, checking its shape.
    pub fn take_host(&mut self, name: &str, shape: &[usize]) -> Result<HostTensor> {
        let t = self
            .tensors
            .remove(name)
            .ok_or_else(|| Error::Weights(format!("{} lacks {name}", self.dir.display())))?;
        if t.shape != shape {
            return Err(Error::Weights(format!(
                "{name} has shape {:?}, the config implies {shape:?}",
                t.shape
            )));
        }
        Ok(t)
    }

    /// Removes a tensor and uploads it to `device`.
    pub fn take<B: Backend>(
        &mut self,
        device: &B,
        name: &str,
        shape: &[usize],
    ) -> Result<Tensor<B>> {
        let t = self.take_host(name, shape)?;
        Tensor::from_host(device, &t.data, shape)
    }

    /// Logs the tensors no model part took (a checkpoint with parts this code does not know).
    pub fn warn_unused(&self) {
        let leftover = self.leftover();
        if !leftover.is_empty() {
            tracing::warn!(dir = %self.dir.display(), unused = ?leftover, "checkpoint tensors the model does not use");
        }
    }

    /// The names no model part took, sorted.
    pub fn leftover(&self) -> Vec<String> {
        let sorted: BTreeMap<_, _> = self.tensors.iter().collect();
        sorted.into_keys().cloned().collect()
    }
}

/// The weights under one name prefix, placed on one device: what a model part's loader reads from.
pub struct Scope<'a, B: Backend> {
    pub weights: &'a mut Weights,
    pub device: &'a B,
    pub prefix: String,
}

/// A linear layer's weight `[out, in]` and optional bias `[out]`.
pub type Linear<B> = (Tensor<B>, Option<Tensor<B>>);

impl<'a, B: Backend> Scope<'a, B> {
    pub fn new(weights: &'a mut Weights, device: &'a B, prefix: impl Into<String>) -> Self {
        Self {
            weights,
            device,
            prefix: prefix.into(),
        }
    }

    pub fn tensor(&mut self, name: &str, shape: &[usize]) -> Result<Tensor<B>> {
        self.weights
            .take(self.device, &format!("{}{name}", self.prefix), shape)
    }

    /// `name.weight` `[out, in]` and, if `bias`, `name.bias` `[out]`.
    pub fn linear(&mut self, name: &str, out: usize, inp: usize, bias: bool) -> Result<Linear<B>> {
        let w = self.tensor(&format!("{name}.weight"), &[out, inp])?;
        let b = if bias {
            Some(self.tensor(&format!("{name}.bias"), &[out])?)
        } else {
            None
        };
        Ok((w, b))
    }

    /// A LayerNorm's `name.weight` and `name.bias`, both `[dim]`.
    pub fn layer_norm(&mut self, name: &str, dim: usize) -> Result<(Tensor<B>, Tensor<B>)> {
        Ok((
            self.tensor(&format!("{name}.weight"), &[dim])?,
            self.tensor(&format!("{name}.bias"), &[dim])?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn converts_half_precision_exactly() {
        let bf = half::bf16::from_f32(1.5).to_le_bytes();
        let hf = half::f16::from_f32(-0.25).to_le_bytes();
        assert_eq!(to_f32(Dtype::BF16, &bf, "x").unwrap(), vec![1.5]);
        assert_eq!(to_f32(Dtype::F16, &hf, "x").unwrap(), vec![-0.25]);
        assert!(to_f32(Dtype::I64, &[0; 8], "x").is_err());
    }
}
