//! One tensor in `torch.save`'s file format: how vLLM's OpenAI server takes precomputed media
//! embeddings (an `image_embeds` part carries base64 of such a file), so mmgate writes it when it
//! sends embeddings upstream and reads it when it is the upstream.
//!
//! The format is a zip archive of stored entries: `<archive>/data.pkl`, a pickle that rebuilds the
//! tensor from a storage named by a persistent id, and `<archive>/data/<key>`, the storage's raw
//! little-endian bytes. Reading runs no pickle code: a small stack machine understands the opcodes
//! `torch.save` emits and accepts exactly one plain tensor (`torch._utils._rebuild_tensor_v2` of a
//! contiguous CPU storage); anything else is an error.

use std::io::{Cursor, Read, Write};

use mmgate_host::{Dtype, Tensor};
use zip::write::SimpleFileOptions;
use zip::{CompressionMethod, ZipArchive, ZipWriter};

#[derive(Debug, thiserror::Error)]
pub enum TorchFileError {
    #[error("not a torch.save file: {0}")]
    Archive(String),
    #[error("the tensor's pickle is not understood: {0}")]
    Pickle(String),
    #[error("{0}")]
    Tensor(String),
}

type Result<T> = std::result::Result<T, TorchFileError>;

/// Torch aligns storages to 64 bytes so that they can be memory-mapped; it does the same here.
const STORAGE_ALIGNMENT: u16 = 64;
const ARCHIVE: &str = "archive";

fn storage_class(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::U8 => "ByteStorage",
        Dtype::I32 => "IntStorage",
        Dtype::I64 => "LongStorage",
        Dtype::F16 => "HalfStorage",
        Dtype::Bf16 => "BFloat16Storage",
        Dtype::F32 => "FloatStorage",
    }
}

fn dtype_of_storage(class: &str) -> Option<Dtype> {
    Dtype::ALL.into_iter().find(|&d| storage_class(d) == class)
}

/// `tensor` (its shape and little-endian data; the name is not stored) as `torch.save` writes it.
pub fn write(tensor: &Tensor) -> Result<Vec<u8>> {
    let numel = tensor
        .element_count()
        .ok_or_else(|| TorchFileError::Tensor("the shape overflows".into()))?;
    if numel * tensor.dtype.size() != tensor.data.len() {
        return Err(TorchFileError::Tensor(format!(
            "shape {:?} does not match {} bytes",
            tensor.shape,
            tensor.data.len()
        )));
    }
    let mut zip = ZipWriter::new(Cursor::new(Vec::with_capacity(tensor.data.len() + 1024)));
    let stored = SimpleFileOptions::default().compression_method(CompressionMethod::Stored);
    let records: [(&str, &[u8]); 4] = [
        ("data.pkl", &rebuild_pickle(tensor, numel)),
        ("byteorder", b"little"),
        ("data/0", &tensor.data),
        ("version", b"3\n"),
    ];
    for (name, bytes) in records {
        zip.start_file(
            format!("{ARCHIVE}/{name}"),
            stored.with_alignment(STORAGE_ALIGNMENT),
        )
        .and_then(|()| zip.write_all(bytes).map_err(Into::into))
        .map_err(|e| TorchFileError::Archive(e.to_string()))?;
    }
    zip.finish()
        .map(Cursor::into_inner)
        .map_err(|e| TorchFileError::Archive(e.to_string()))
}

/// The pickle `torch.save` writes for a contiguous tensor on storage `0`.
fn rebuild_pickle(tensor: &Tensor, numel: usize) -> Vec<u8> {
    let mut p = Pickle(vec![0x80, 2]); // PROTO 2
    p.global("torch._utils", "_rebuild_tensor_v2");
    p.op(b'('); // MARK: the arguments
    p.op(b'('); // MARK: the storage's persistent id
    p.str("storage");
    p.global("torch", storage_class(tensor.dtype));
    p.str("0");
    p.str("cpu");
    p.int(numel as u64);
    p.op(b't'); // TUPLE
    p.op(b'Q'); // BINPERSID
    p.int(0); // storage offset
    p.tuple(&tensor.shape);
    let mut strides = vec![0; tensor.shape.len()];
    let mut step = 1;
    for (stride, &dim) in strides.iter_mut().zip(&tensor.shape).rev() {
        *stride = step;
        step *= dim;
    }
    p.tuple(&strides);
    p.op(0x89); // NEWFALSE: requires_grad
    p.global("collections", "OrderedDict"); // backward hooks: none
    p.op(b')'); // EMPTY_TUPLE
    p.op(b'R'); // REDUCE
    p.op(b't'); // TUPLE
    p.op(b'R'); // REDUCE
    p.op(b'.'); // STOP
    p.0
}

struct Pickle(Vec<u8>);

impl Pickle {
    fn op(&mut self, op: u8) {
        self.0.push(op);
    }

    fn global(&mut self, module: &str, name: &str) {
        self.0.push(b'c');
        for part in [module, name] {
            self.0.extend_from_slice(part.as_bytes());
            self.0.push(b'\n');
        }
    }

    fn str(&mut self, s: &str) {
        self.0.push(b'X'); // BINUNICODE
        self.0.extend_from_slice(&(s.len() as u32).to_le_bytes());
        self.0.extend_from_slice(s.as_bytes());
    }

    fn int(&mut self, n: u64) {
        if let Ok(n) = u8::try_from(n) {
            self.0.extend_from_slice(&[b'K', n]); // BININT1
        } else if let Ok(n) = u16::try_from(n) {
            self.0.push(b'M'); // BININT2
            self.0.extend_from_slice(&n.to_le_bytes());
        } else if let Ok(n) = i32::try_from(n) {
            self.0.push(b'J'); // BININT
            self.0.extend_from_slice(&n.to_le_bytes());
        } else {
            self.0.extend_from_slice(&[0x8a, 9]); // LONG1, 9 bytes: a positive i72
            self.0.extend_from_slice(&n.to_le_bytes());
            self.0.push(0);
        }
    }

    fn tuple(&mut self, items: &[u64]) {
        match items.len() {
            0 => self.op(b')'),
            1..=3 => {
                for &i in items {
                    self.int(i);
                }
                self.op([0x85, 0x86, 0x87][items.len() - 1]); // TUPLE1..3
            }
            _ => {
                self.op(b'(');
                for &i in items {
                    self.int(i);
                }
                self.op(b't');
            }
        }
    }
}

/// Reads the one tensor of a `torch.save` file; its storage may hold at most `max_bytes`. The
/// tensor is named `name`.
pub fn read(file: &[u8], name: &str, max_bytes: usize) -> Result<Tensor> {
    let archive_error = |e: zip::result::ZipError| TorchFileError::Archive(e.to_string());
    let mut zip = ZipArchive::new(Cursor::new(file)).map_err(archive_error)?;
    let pickle_name = zip
        .file_names()
        .filter_map(|n| n.ok())
        .find(|n| n.ends_with("/data.pkl") && n.matches('/').count() == 1)
        .map(|n| n.into_owned())
        .ok_or_else(|| TorchFileError::Archive("it has no data.pkl".into()))?;
    let prefix = pickle_name.trim_end_matches("data.pkl").to_owned();
    if let Ok(mut order) = zip.by_name(&format!("{prefix}byteorder")) {
        let mut text = String::new();
        order
            .by_ref()
            .take(16)
            .read_to_string(&mut text)
            .map_err(|e| TorchFileError::Archive(e.to_string()))?;
        if text != "little" {
            return Err(TorchFileError::Tensor(format!(
                "its byte order is {text:?}; only little is read"
            )));
        }
    }
    let pickle = read_entry(&mut zip, &pickle_name, 1 << 16)?;
    let Rebuild {
        dtype,
        key,
        numel,
        offset,
        shape,
        strides,
    } = rebuild_args(unpickle(&pickle)?)?;

    let count = shape
        .iter()
        .try_fold(1usize, |acc, &d| {
            usize::try_from(d).ok().and_then(|d| acc.checked_mul(d))
        })
        .ok_or_else(|| TorchFileError::Tensor(format!("shape {shape:?} overflows")))?;
    let mut step = 1u64;
    for (&stride, &dim) in strides.iter().zip(&shape).rev() {
        if dim > 1 && stride != step {
            return Err(TorchFileError::Tensor(format!(
                "shape {shape:?} with strides {strides:?} is not contiguous"
            )));
        }
        step = step.saturating_mul(dim);
    }
    let size = dtype.size();
    let (start, end) = offset
        .checked_add(count)
        .filter(|&end| end <= numel)
        .map(|end| (offset * size, end * size))
        .ok_or_else(|| {
            TorchFileError::Tensor(format!(
                "{count} values from offset {offset} do not fit a storage of {numel}"
            ))
        })?;
    if numel.saturating_mul(size) > max_bytes {
        return Err(TorchFileError::Tensor(format!(
            "its storage is {} bytes; at most {max_bytes} are taken",
            numel.saturating_mul(size)
        )));
    }
    let storage = read_entry(&mut zip, &format!("{prefix}data/{key}"), numel * size)?;
    if storage.len() != numel * size {
        return Err(TorchFileError::Archive(format!(
            "storage {key} is {} bytes, not the {} its {numel} values need",
            storage.len(),
            numel * size
        )));
    }
    Ok(Tensor {
        name: name.to_owned(),
        dtype,
        shape,
        data: storage[start..end].to_vec(),
    })
}

fn read_entry(zip: &mut ZipArchive<Cursor<&[u8]>>, name: &str, limit: usize) -> Result<Vec<u8>> {
    let mut entry = zip
        .by_name(name)
        .map_err(|e| TorchFileError::Archive(format!("{name}: {e}")))?;
    if entry.size() > limit as u64 {
        return Err(TorchFileError::Archive(format!(
            "{name} is {} bytes, more than the {limit} expected",
            entry.size()
        )));
    }
    let mut bytes = Vec::with_capacity(entry.size() as usize);
    entry
        .by_ref()
        .take(limit as u64)
        .read_to_end(&mut bytes)
        .map_err(|e| TorchFileError::Archive(format!("{name}: {e}")))?;
    Ok(bytes)
}

/// A value on the unpickler's stack: only what a tensor's pickle builds.
#[derive(Debug, Clone, PartialEq)]
enum Value {
    Mark,
    None,
    Bool(bool),
    Int(i64),
    Str(String),
    Tuple(Vec<Value>),
    Dict,
    List,
    Global(String, String),
    PersistentId(Box<Value>),
    Call(Box<Value>, Box<Value>),
}

fn pickle_error(message: impl Into<String>) -> TorchFileError {
    TorchFileError::Pickle(message.into())
}

/// Runs the pickle's opcodes without calling anything: globals stay names, calls stay records.
fn unpickle(bytes: &[u8]) -> Result<Value> {
    let mut ops = Ops { bytes, at: 0 };
    let mut stack: Vec<Value> = Vec::new();
    let mut memo: Vec<Option<Value>> = Vec::new();
    let pop = |stack: &mut Vec<Value>| stack.pop().ok_or_else(|| pickle_error("stack underflow"));
    let pop_mark = |stack: &mut Vec<Value>| -> Result<Vec<Value>> {
        let mark = stack
            .iter()
            .rposition(|v| *v == Value::Mark)
            .ok_or_else(|| pickle_error("no mark"))?;
        let items = stack.split_off(mark + 1);
        stack.pop();
        Ok(items)
    };
    let le = |b: &[u8]| {
        b.iter()
            .rev()
            .fold(0u64, |acc, &x| (acc << 8) | u64::from(x))
    };
    loop {
        let op = ops.take(1)?[0];
        match op {
            0x80 => {
                ops.take(1)?; // PROTO
            }
            0x95 => {
                ops.take(8)?; // FRAME
            }
            b'c' => {
                let module = ops.line()?;
                let name = ops.line()?;
                stack.push(Value::Global(module, name));
            }
            0x93 => {
                // STACK_GLOBAL
                let (Value::Str(name), Value::Str(module)) = (pop(&mut stack)?, pop(&mut stack)?)
                else {
                    return Err(pickle_error("STACK_GLOBAL of non-strings"));
                };
                stack.push(Value::Global(module, name));
            }
            b'X' | 0x8c | 0x8d => {
                let len = match op {
                    b'X' => le(ops.take(4)?),
                    0x8c => le(ops.take(1)?),
                    _ => le(ops.take(8)?),
                };
                let len = usize::try_from(len).map_err(|_| pickle_error("string too long"))?;
                let s = std::str::from_utf8(ops.take(len)?)
                    .map_err(|_| pickle_error("a string is not UTF-8"))?;
                stack.push(Value::Str(s.to_owned()));
            }
            b'(' => stack.push(Value::Mark),
            b't' => {
                let items = pop_mark(&mut stack)?;
                stack.push(Value::Tuple(items));
            }
            b')' => stack.push(Value::Tuple(Vec::new())),
            0x85..=0x87 => {
                let n = usize::from(op - 0x84);
                if stack.len() < n {
                    return Err(pickle_error("stack underflow"));
                }
                let items = stack.split_off(stack.len() - n);
                stack.push(Value::Tuple(items));
            }
            b'K' => stack.push(Value::Int(i64::from(ops.take(1)?[0]))),
            b'M' => stack.push(Value::Int(le(ops.take(2)?) as i64)),
            b'J' => {
                let b = ops.take(4)?;
                stack.push(Value::Int(i64::from(i32::from_le_bytes([
                    b[0], b[1], b[2], b[3],
                ]))));
            }
            0x8a => {
                // LONG1: little-endian two's complement of n bytes
                let n = usize::from(ops.take(1)?[0]);
                let b = ops.take(n)?;
                if n > 8 && b[8..].iter().any(|&x| x != 0) {
                    return Err(pickle_error("an integer is too large"));
                }
                let mut v = le(&b[..n.min(8)]);
                if n < 8 && n > 0 && b[n - 1] & 0x80 != 0 {
                    v |= u64::MAX << (8 * n);
                }
                stack.push(Value::Int(v as i64));
            }
            0x88 => stack.push(Value::Bool(true)),
            0x89 => stack.push(Value::Bool(false)),
            b'N' => stack.push(Value::None),
            b'}' => stack.push(Value::Dict),
            b']' => stack.push(Value::List),
            b'q' | b'r' | 0x94 => {
                let index = match op {
                    b'q' => le(ops.take(1)?) as usize,
                    b'r' => le(ops.take(4)?) as usize,
                    _ => memo.len(),
                };
                let top = stack
                    .last()
                    .cloned()
                    .ok_or_else(|| pickle_error("memo of an empty stack"))?;
                if index > memo.len() + 1024 {
                    return Err(pickle_error("memo index out of range"));
                }
                if memo.len() <= index {
                    memo.resize(index + 1, None);
                }
                memo[index] = Some(top);
            }
            b'h' | b'j' => {
                let index = if op == b'h' {
                    le(ops.take(1)?)
                } else {
                    le(ops.take(4)?)
                } as usize;
                let value = memo
                    .get(index)
                    .cloned()
                    .flatten()
                    .ok_or_else(|| pickle_error("memo get of an unset index"))?;
                stack.push(value);
            }
            b'Q' => {
                let id = pop(&mut stack)?;
                stack.push(Value::PersistentId(Box::new(id)));
            }
            b'R' => {
                let args = pop(&mut stack)?;
                let callable = pop(&mut stack)?;
                stack.push(Value::Call(Box::new(callable), Box::new(args)));
            }
            b'.' => return pop(&mut stack),
            other => return Err(pickle_error(format!("opcode 0x{other:02x} is not read"))),
        }
        if stack.len() > 256 {
            return Err(pickle_error("the stack grows past what a tensor needs"));
        }
    }
}

/// The pickle's bytes, read front to back.
struct Ops<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Ops<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let slice = self
            .bytes
            .get(self.at..self.at.saturating_add(n))
            .ok_or_else(|| pickle_error("it ends early"))?;
        self.at += n;
        Ok(slice)
    }

    /// A newline-terminated line (GLOBAL's operands), without its newline.
    fn line(&mut self) -> Result<String> {
        let rest = self.bytes.get(self.at..).unwrap_or_default();
        let end = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or_else(|| pickle_error("unterminated global"))?;
        let line = self.take(end + 1)?;
        Ok(String::from_utf8_lossy(&line[..end]).into_owned())
    }
}

struct Rebuild {
    dtype: Dtype,
    key: String,
    numel: usize,
    offset: usize,
    shape: Vec<u64>,
    strides: Vec<u64>,
}

/// The arguments of `_rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks)`.
fn rebuild_args(value: Value) -> Result<Rebuild> {
    let not_a_tensor = || pickle_error("it holds something other than one plain tensor");
    let Value::Call(callable, args) = value else {
        return Err(not_a_tensor());
    };
    if *callable != Value::Global("torch._utils".into(), "_rebuild_tensor_v2".into()) {
        return Err(not_a_tensor());
    }
    let Value::Tuple(args) = *args else {
        return Err(not_a_tensor());
    };
    let [
        Value::PersistentId(storage),
        Value::Int(offset),
        Value::Tuple(size),
        Value::Tuple(stride),
        ..,
    ] = &args[..]
    else {
        return Err(not_a_tensor());
    };
    let Value::Tuple(storage) = storage.as_ref() else {
        return Err(not_a_tensor());
    };
    let [
        Value::Str(kind),
        Value::Global(module, class),
        Value::Str(key),
        Value::Str(_location),
        Value::Int(numel),
    ] = &storage[..]
    else {
        return Err(not_a_tensor());
    };
    if kind != "storage" || module != "torch" {
        return Err(not_a_tensor());
    }
    let dtype = dtype_of_storage(class)
        .ok_or_else(|| TorchFileError::Tensor(format!("{class} tensors are not read")))?;
    let dims = |t: &[Value]| -> Result<Vec<u64>> {
        t.iter()
            .map(|v| match v {
                Value::Int(n) => u64::try_from(*n).map_err(|_| not_a_tensor()),
                _ => Err(not_a_tensor()),
            })
            .collect()
    };
    let (shape, strides) = (dims(size)?, dims(stride)?);
    if shape.len() != strides.len() {
        return Err(not_a_tensor());
    }
    if key.is_empty() || !key.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return Err(pickle_error(format!("storage key {key:?}")));
    }
    Ok(Rebuild {
        dtype,
        key: key.clone(),
        numel: usize::try_from(*numel).map_err(|_| not_a_tensor())?,
        offset: usize::try_from(*offset).map_err(|_| not_a_tensor())?,
        shape,
        strides,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(dtype: Dtype, shape: &[u64], data: Vec<u8>) -> Tensor {
        Tensor {
            name: "t".into(),
            dtype,
            shape: shape.to_vec(),
            data,
        }
    }

    #[test]
    fn what_it_writes_it_reads_back() {
        let values: Vec<u8> = (0..2 * 70_000u32)
            .flat_map(|i| (i as f32 * 0.5).to_le_bytes())
            .collect();
        for t in [
            tensor(Dtype::F32, &[2, 70_000], values),
            tensor(
                Dtype::I64,
                &[3],
                [1i64, 22, 40]
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
            ),
            tensor(Dtype::U8, &[], vec![7]),
            tensor(Dtype::Bf16, &[1, 1, 2, 2], vec![1, 2, 3, 4, 5, 6, 7, 8]),
        ] {
            let file = write(&t).unwrap();
            let back = read(&file, "t", 1 << 20).unwrap();
            assert_eq!(
                (back.dtype, back.shape, back.data),
                (t.dtype, t.shape, t.data)
            );
        }
    }

    fn fixture(name: &str) -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/torch")
            .join(name)
    }

    fn as_f64s(t: &Tensor) -> Vec<f64> {
        let chunks = |n: usize| t.data.chunks_exact(n);
        match t.dtype {
            Dtype::F32 => chunks(4)
                .map(|b| f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]])))
                .collect(),
            Dtype::F16 => chunks(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f64())
                .collect(),
            Dtype::Bf16 => chunks(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f64())
                .collect(),
            Dtype::I64 => chunks(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as f64)
                .collect(),
            other => panic!("no {other:?} fixtures"),
        }
    }

    /// Files torch.save wrote (`tests/fixtures/torch/generate.py`) read as torch reads them; what
    /// mmgate writes for the same tensors is byte for byte the `mmgate_*.pt` files that script
    /// checked with torch.load.
    #[test]
    fn torch_files_read_as_torch_reads_them_and_torch_reads_what_it_writes() {
        let cases: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fixture("cases.json")).unwrap()).unwrap();
        let regenerate = std::env::var_os("MMGATE_WRITE_TORCH_FIXTURES").is_some();
        for (name, case) in cases.as_object().unwrap() {
            let file = std::fs::read(fixture(&format!("torch_{name}.pt"))).unwrap();
            let read = read(&file, name, 1 << 20);
            if !case["contiguous"].as_bool().unwrap() {
                assert!(matches!(read, Err(TorchFileError::Tensor(_))), "{name}");
                continue;
            }
            let t = read.unwrap_or_else(|e| panic!("{name}: {e}"));
            let shape: Vec<u64> = serde_json::from_value(case["shape"].clone()).unwrap();
            let values: Vec<f64> = serde_json::from_value(case["values"].clone()).unwrap();
            assert_eq!((&t.shape, as_f64s(&t)), (&shape, values), "{name}");

            let ours = fixture(&format!("mmgate_{name}.pt"));
            let written = write(&t).unwrap();
            if regenerate {
                std::fs::write(&ours, &written).unwrap();
            } else {
                assert!(
                    written == std::fs::read(&ours).unwrap(),
                    "{name}: the writer changed"
                );
            }
        }
    }

    #[test]
    fn storages_past_the_limit_and_foreign_pickles_are_refused() {
        let t = tensor(Dtype::F32, &[4, 4], vec![0; 64]);
        let file = write(&t).unwrap();
        assert!(matches!(
            read(&file, "t", 63),
            Err(TorchFileError::Tensor(_))
        ));
        assert!(matches!(
            read(b"PK\x03\x04 nothing", "t", 64),
            Err(TorchFileError::Archive(_))
        ));
        assert!(matches!(
            read(b"", "t", 64),
            Err(TorchFileError::Archive(_))
        ));

        // A pickle that calls anything else (here os.system) is refused, never run.
        let mut p = Pickle(vec![0x80, 2]);
        p.global("os", "system");
        p.str("true");
        p.op(0x85);
        p.op(b'R');
        p.op(b'.');
        let mut zip = ZipWriter::new(Cursor::new(Vec::new()));
        zip.start_file("archive/data.pkl", SimpleFileOptions::default())
            .unwrap();
        zip.write_all(&p.0).unwrap();
        let file = zip.finish().unwrap().into_inner();
        assert!(matches!(
            read(&file, "t", 64),
            Err(TorchFileError::Pickle(_))
        ));
    }
}
