//! Reading a model's weights from an HF directory: `model.safetensors`, or the shards listed in
//! `model.safetensors.index.json`. Tensors are renamed once to the names the model code uses, so
//! checkpoints saved by different transformers versions load through one path.
//!
//! Loading reads only the files' headers. A tensor's bytes are read (positioned reads, no mapping)
//! and converted to f32 (from f32, f16 or bf16) when a model part takes it, so memory holds one
//! tensor in flight rather than the whole checkpoint, and a part loaded on its own (an encoder for
//! a second device) reads only its own tensors.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use safetensors::Dtype;
use safetensors::tensor::Metadata;

use crate::backend::{Backend, Values};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// One tensor on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// Where one tensor's bytes are.
#[derive(Debug)]
struct Entry {
    file: Arc<(PathBuf, File)>,
    /// The name in the file (before renaming), for messages.
    stored_name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Absolute byte offset in the file, and length.
    offset: u64,
    len: usize,
}

/// All tensors of a checkpoint, by (renamed) name. Models take what they need; what is left over is
/// reported so a checkpoint with unexpected parts is noticed.
#[derive(Debug)]
pub struct Weights {
    dir: PathBuf,
    tensors: HashMap<String, Entry>,
}

/// The largest header accepted (safetensors' own limit).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Reads a safetensors file's header: its tensors and where their data starts.
fn read_header(path: &Path, file: &mut File) -> Result<(Metadata, u64)> {
    let bad = |reason: String| Error::Weights(format!("{}: {reason}", path.display()));
    let mut prefix = [0u8; 8];
    file.read_exact(&mut prefix).map_err(io(path))?;
    let header_len = u64::from_le_bytes(prefix);
    if header_len > MAX_HEADER_BYTES {
        return Err(bad(format!("header of {header_len} bytes")));
    }
    let mut header = Vec::new();
    file.by_ref()
        .take(header_len)
        .read_to_end(&mut header)
        .map_err(io(path))?;
    if header.len() as u64 != header_len {
        return Err(bad("truncated header".into()));
    }
    // Deserialising checks that the tensors tile the data section with consistent sizes.
    let metadata: Metadata =
        serde_json::from_slice(&header).map_err(|e| bad(format!("header: {e}")))?;
    let data_start = 8 + header_len;
    let file_len = file.metadata().map_err(io(path))?.len();
    if file_len != data_start + metadata.data_len() as u64 {
        return Err(bad(format!(
            "{file_len} bytes, the header describes {}",
            data_start + metadata.data_len() as u64
        )));
    }
    Ok((metadata, data_start))
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
    /// Indexes every tensor of the directory's checkpoint, renaming each with `rename`.
    pub fn load(dir: &Path, rename: impl Fn(&str) -> String) -> Result<Self> {
        let mut tensors = HashMap::new();
        for path in weight_files(dir)? {
            let mut file = File::open(&path).map_err(io(&path))?;
            let (metadata, data_start) = read_header(&path, &mut file)?;
            let file = Arc::new((path, file));
            for (name, info) in metadata.tensors() {
                let (begin, end) = info.data_offsets;
                let renamed = rename(&name);
                let entry = Entry {
                    file: file.clone(),
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    offset: data_start + begin as u64,
                    len: end - begin,
                    stored_name: name,
                };
                if let Some(other) = tensors.insert(renamed.clone(), entry) {
                    return Err(Error::Weights(format!(
                        "{renamed} appears twice (after renaming {})",
                        other.stored_name
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

    /// The shape the checkpoint gives a tensor.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.tensors.get(name).map(|entry| entry.shape.clone())
    }

    /// Removes a tensor, checking its shape, and reads its bytes.
    fn take_bytes(&mut self, name: &str, shape: &[usize]) -> Result<(Entry, Vec<u8>)> {
        let entry = self
            .tensors
            .remove(name)
            .ok_or_else(|| Error::Weights(format!("{} lacks {name}", self.dir.display())))?;
        if entry.shape != shape {
            return Err(Error::Weights(format!(
                "{name} has shape {:?}, the config implies {shape:?}",
                entry.shape
            )));
        }
        let (path, file) = &*entry.file;
        let mut bytes = vec![0u8; entry.len];
        file.read_exact_at(&mut bytes, entry.offset)
            .map_err(io(path))?;
        Ok((entry, bytes))
    }

    /// Removes and returns a tensor, checking its shape.
    pub fn take_host(&mut self, name: &str, shape: &[usize]) -> Result<HostTensor> {
        let (entry, bytes) = self.take_bytes(name, shape)?;
        Ok(HostTensor {
            data: to_f32(entry.dtype, &bytes, &entry.stored_name)?,
            shape: entry.shape,
        })
    }

    /// Removes a weight matrix (a linear layer's, an embedding table) and uploads it to `device`
    /// in the checkpoint's own precision: a bf16 checkpoint's matrices take half the memory of
    /// f32 ones (the backend computes with them, accumulating in f32).
    pub fn take_weight<B: Backend>(
        &mut self,
        device: &B,
        name: &str,
        shape: &[usize],
    ) -> Result<Tensor<B>> {
        Tensor::from_weight(device, self.take_weight_data(name, shape)?, shape)
    }

    /// A weight matrix's values on the host, in the checkpoint's precision.
    pub fn take_weight_data(&mut self, name: &str, shape: &[usize]) -> Result<Values> {
        let (entry, bytes) = self.take_bytes(name, shape)?;
        let halves =
            |b: &[u8]| -> Vec<[u8; 2]> { b.chunks_exact(2).map(|c| [c[0], c[1]]).collect() };
        let data = match entry.dtype {
            Dtype::BF16 => Values::Bf16(
                halves(&bytes)
                    .into_iter()
                    .map(half::bf16::from_le_bytes)
                    .collect(),
            ),
            Dtype::F16 => Values::F16(
                halves(&bytes)
                    .into_iter()
                    .map(half::f16::from_le_bytes)
                    .collect(),
            ),
            other => Values::F32(to_f32(other, &bytes, &entry.stored_name)?),
        };
        Ok(data)
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

    /// A weight matrix, in the checkpoint's precision (see [`Weights::take_weight`]).
    pub fn matrix(&mut self, name: &str, shape: &[usize]) -> Result<Tensor<B>> {
        self.weights
            .take_weight(self.device, &format!("{}{name}", self.prefix), shape)
    }

    /// `name.weight` `[out, in]` (in the checkpoint's precision) and, if `bias`, `name.bias`
    /// `[out]`.
    pub fn linear(&mut self, name: &str, out: usize, inp: usize, bias: bool) -> Result<Linear<B>> {
        let w = self.matrix(&format!("{name}.weight"), &[out, inp])?;
        let b = if bias {
            Some(self.tensor(&format!("{name}.bias"), &[out])?)
        } else {
            None
        };
        Ok((w, b))
    }

    /// A weight matrix's values on the host, in the checkpoint's precision (to split it).
    pub fn matrix_data(&mut self, name: &str, shape: &[usize]) -> Result<Values> {
        self.weights
            .take_weight_data(&format!("{}{name}", self.prefix), shape)
    }

    /// `name.weight` `[out, in]` (in the checkpoint's precision) and `name.bias` `[out]` of a layer
    /// that always has a bias.
    pub fn biased_linear(
        &mut self,
        name: &str,
        out: usize,
        inp: usize,
    ) -> Result<(Tensor<B>, Tensor<B>)> {
        Ok((
            self.matrix(&format!("{name}.weight"), &[out, inp])?,
            self.tensor(&format!("{name}.bias"), &[out])?,
        ))
    }

    /// The q, k and v projections of a vision block's packed `name` (`[3d, d]` weight, `[3d]`
    /// bias), split once at load; the weights keep the checkpoint's precision through the split.
    pub fn packed_qkv(&mut self, name: &str, d: usize) -> Result<[(Tensor<B>, Tensor<B>); 3]> {
        let w = self.matrix_data(&format!("{name}.weight"), &[3 * d, d])?;
        let bias = self.tensor(&format!("{name}.bias"), &[3 * d])?.to_host()?;
        let part = |j: usize| -> Result<(Tensor<B>, Tensor<B>)> {
            let rows = w
                .slice(j * d * d..(j + 1) * d * d)
                .ok_or_else(|| Error::Weights(format!("{name}: part {j} of {} values", w.len())))?;
            Ok((
                Tensor::from_weight(self.device, rows, &[d, d])?,
                Tensor::from_host(self.device, &bias[j * d..(j + 1) * d], &[d])?,
            ))
        };
        Ok([part(0)?, part(1)?, part(2)?])
    }

    /// An RMSNorm's `name.weight` `[dim]`.
    pub fn rms_norm(&mut self, name: &str, dim: usize) -> Result<Tensor<B>> {
        self.tensor(&format!("{name}.weight"), &[dim])
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

    fn write_checkpoint(dir: &Path) -> Vec<u8> {
        let a: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let b: Vec<u8> = [half::bf16::from_f32(-2.5)]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let views = [
            (
                "model.a",
                safetensors::tensor::TensorView::new(Dtype::F32, vec![2, 2], &a).unwrap(),
            ),
            (
                "model.b",
                safetensors::tensor::TensorView::new(Dtype::BF16, vec![1], &b).unwrap(),
            ),
        ];
        let bytes = safetensors::serialize(views, None).unwrap();
        std::fs::write(dir.join("model.safetensors"), &bytes).unwrap();
        bytes
    }

    #[test]
    fn reads_each_tensor_when_taken_and_reports_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        write_checkpoint(dir.path());
        let mut w = Weights::load(dir.path(), |n| n.replace("model.", "m.")).unwrap();
        assert_eq!(w.leftover(), ["m.a", "m.b"]);
        assert!(w.take_host("m.a", &[4]).is_err(), "shape is checked");
        let mut w = Weights::load(dir.path(), |n| n.replace("model.", "m.")).unwrap();
        let a = w.take_host("m.a", &[2, 2]).unwrap();
        assert_eq!(a.data, [1.0, 2.0, 3.0, 4.0]);
        assert_eq!(w.leftover(), ["m.b"]);
        assert_eq!(w.take_host("m.b", &[1]).unwrap().data, [-2.5]);
        assert!(w.take_host("m.b", &[1]).is_err(), "taken once");
    }

    #[test]
    fn refuses_files_whose_size_or_header_do_not_add_up() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = write_checkpoint(dir.path());
        let path = dir.path().join("model.safetensors");
        for broken in [
            bytes[..bytes.len() - 1].to_vec(),
            [&bytes[..], &[0]].concat(),
            bytes[..20].to_vec(),
            bytes[..5].to_vec(),
            [&u64::MAX.to_le_bytes()[..], &bytes[8..]].concat(),
            [&bytes[..8], &vec![b' '; bytes.len() - 8][..]].concat(),
        ] {
            std::fs::write(&path, &broken).unwrap();
            let err = Weights::load(dir.path(), str::to_owned).unwrap_err();
            assert!(matches!(err, Error::Weights(_) | Error::Io { .. }), "{err}");
        }
    }
}
