//! The tensors a plugin returns, as the host checks and reads them: the contract's invariant (shape
//! × dtype size = bytes), the 8-bit samples a plugin may send in place of f32 values (with their
//! table and repeats companions), and little-endian values. Kept apart from [`crate::contract`]
//! because these checks fail with a [`CallError`], and [`crate::error`] builds on the contract's
//! types: the bindings stay below the errors, the checks above them.

use crate::contract::{Dtype, Tensor};
use crate::error::CallError;

impl Tensor {
    /// A tensor of `dtype` and `shape` holding `data` (little-endian, row-major), unchecked: see
    /// [`Tensor::validate`].
    pub fn new(name: impl Into<String>, dtype: Dtype, shape: &[u64], data: Vec<u8>) -> Tensor {
        Tensor {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            data,
        }
    }

    /// Number of elements, or `None` when the shape's product overflows.
    pub fn element_count(&self) -> Option<usize> {
        self.shape.iter().try_fold(1usize, |acc, &d| {
            usize::try_from(d).ok().and_then(|d| acc.checked_mul(d))
        })
    }

    /// Check the contract's tensor invariant: shape × dtype size = bytes.
    pub fn validate(&self) -> Result<(), CallError> {
        let expected = self
            .element_count()
            .and_then(|n| n.checked_mul(self.dtype.size()));
        match expected {
            Some(bytes) if bytes == self.data.len() => Ok(()),
            Some(bytes) => Err(CallError::Contract(format!(
                "tensor {:?}: shape {:?} of {} needs {bytes} bytes but carries {}",
                self.name,
                self.shape,
                self.dtype.name(),
                self.data.len()
            ))),
            None => Err(CallError::Contract(format!(
                "tensor {:?}: shape {:?} overflows",
                self.name, self.shape
            ))),
        }
    }
}

/// Suffix of the companion tensor that gives a `u8` tensor its values (see [`f32_values`]).
pub const TABLE_SUFFIX: &str = "_table";

/// Suffix of the optional companion of a `u8` tensor with a table that says how many copies of
/// itself each channel run of its rows stands for (an i64 scalar; 1 when absent): Qwen2-VL's
/// temporal copies of a still image, which HF's processor writes out, are sent once. The tensor's
/// values are those of its rows with every channel run repeated in place (see [`ByteSamples`]).
pub const REPEATS_SUFFIX: &str = "_repeats";

/// Most copies a repeats companion may ask for (Qwen2-VL asks for 2).
const MAX_REPEATS: i64 = 64;

/// Whether `name` is the table or repeats companion of another tensor, and of which.
pub fn companion_of(name: &str) -> Option<&str> {
    name.strip_suffix(TABLE_SUFFIX)
        .or_else(|| name.strip_suffix(REPEATS_SUFFIX))
}

/// The f32 values of the tensor `name` in a plugin's output: the tensor itself when it is f32, or
/// its [`ByteSamples`] mapped to their values when the plugin sent 8-bit samples.
pub fn f32_values(tensors: &[Tensor], name: &str) -> Result<Vec<f32>, CallError> {
    match ByteSamples::from_tensors(tensors, name)? {
        Some(samples) => {
            let mut values = Vec::with_capacity(samples.len());
            samples.map_into(&mut values);
            Ok(values)
        }
        None => Ok(le_f32s(&tensor(tensors, name)?.data)),
    }
}

/// The copies `<name>_repeats` asks for: 1 when there is no such tensor.
fn repeats(tensors: &[Tensor], name: &str) -> Result<usize, CallError> {
    let repeats_name = format!("{name}{REPEATS_SUFFIX}");
    let Some(tensor) = tensors.iter().find(|t| t.name == repeats_name) else {
        return Ok(1);
    };
    tensor.validate()?;
    let value = match (tensor.dtype, tensor.data.as_slice()) {
        (Dtype::I64, bytes) if bytes.len() == 8 => {
            i64::from_le_bytes(bytes.try_into().unwrap_or_default())
        }
        _ => 0,
    };
    if !(1..=MAX_REPEATS).contains(&value) {
        return Err(CallError::Contract(format!(
            "tensor {repeats_name:?}: must be one i64 from 1 to {MAX_REPEATS}"
        )));
    }
    Ok(value as usize)
}

fn tensor<'a>(tensors: &'a [Tensor], name: &str) -> Result<&'a Tensor, CallError> {
    tensors
        .iter()
        .find(|t| t.name == name)
        .ok_or_else(|| CallError::Contract(format!("tensor {name:?}: missing")))
}

/// Raw 8-bit samples a plugin sent in place of f32 values (a quarter of the bytes through the
/// sandbox and in memory), with what they stand for: the companion `<name>_table`, f32 `[C, 256]`.
/// Each row (the tensor's last dimension) is C equal runs, one per channel, and sample v in channel
/// c's run stands for `table[c][v]` — the layout of Qwen2-VL's `pixel_values` rows, whose table is
/// HF's rescale-and-normalise evaluated exactly, byte by byte. With a `<name>_repeats` companion R,
/// each run stands for R copies of itself in a row R times as long (a still image's temporal
/// copies): the values are those of the expanded rows.
#[derive(Debug, Clone, PartialEq)]
pub struct ByteSamples {
    samples: Vec<u8>,
    /// `[C * 256]` values.
    table: Vec<f32>,
    /// Samples per channel run, as sent.
    run: usize,
    channels: usize,
    /// Copies each run stands for.
    repeats: usize,
}

impl ByteSamples {
    /// The samples of tensor `name` and its table, checked against each other; `None` when the
    /// tensor is f32 (its values are its own).
    pub fn from_tensors(tensors: &[Tensor], name: &str) -> Result<Option<ByteSamples>, CallError> {
        let contract = |m: String| CallError::Contract(format!("tensor {name:?}: {m}"));
        let samples = tensor(tensors, name)?;
        samples.validate()?;
        match samples.dtype {
            Dtype::F32 => return Ok(None),
            Dtype::U8 => {}
            other => return Err(contract(format!("is {}, expected f32 or u8", other.name()))),
        }
        let table_name = format!("{name}{TABLE_SUFFIX}");
        let table = tensor(tensors, &table_name)
            .map_err(|_| contract(format!("u8 samples need a {table_name} tensor")))?;
        table.validate()?;
        let [channels, 256] = table.shape[..] else {
            return Err(contract(format!(
                "{table_name} is {:?}, not [channels, 256]",
                table.shape
            )));
        };
        let channels = usize::try_from(channels).unwrap_or(usize::MAX);
        let row = samples
            .shape
            .last()
            .and_then(|&d| usize::try_from(d).ok())
            .unwrap_or(0);
        if table.dtype != Dtype::F32 || channels == 0 || row == 0 || !row.is_multiple_of(channels) {
            return Err(contract(format!(
                "{table_name} ({} {:?}) does not split rows of {row} into channels",
                table.dtype.name(),
                table.shape
            )));
        }
        Ok(Some(ByteSamples {
            samples: samples.data.clone(),
            table: le_f32s(&table.data),
            run: row / channels,
            channels,
            repeats: repeats(tensors, name)?,
        }))
    }

    /// How many values the samples stand for.
    pub fn len(&self) -> usize {
        self.samples.len() * self.repeats
    }

    /// How many copies of itself each channel run stands for (1: none).
    pub fn repeats(&self) -> usize {
        self.repeats
    }

    /// Samples per channel run, as sent.
    pub fn run(&self) -> usize {
        self.run
    }

    /// Channel runs per row (the table's rows).
    pub fn channels(&self) -> usize {
        self.channels
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// Bytes held: the samples and the table.
    pub fn bytes(&self) -> usize {
        self.samples.len() + 4 * self.table.len()
    }

    /// The samples and the table's values, in order: all that the values depend on.
    pub fn parts(&self) -> (&[u8], &[f32]) {
        (&self.samples, &self.table)
    }

    /// Appends the values the samples stand for.
    pub fn map_into(&self, out: &mut Vec<f32>) {
        let at = out.len();
        out.resize(at + self.len(), 0.0);
        self.map_range_into(0, &mut out[at..]);
    }

    /// The values of the samples from `start` on, into `out` (as many as there are samples for).
    pub fn map_range_into(&self, start: usize, out: &mut [f32]) {
        // `at` counts values; a run of values is `repeats` copies of a run of samples.
        let values_per_run = self.run * self.repeats;
        let (mut at, mut written) = (start, 0);
        while written < out.len() && at < self.len() {
            // Each run of samples is one channel's: one table for all of it.
            let run = at / values_per_run;
            let offset = at % values_per_run % self.run;
            let n = (self.run - offset).min(out.len() - written);
            // A repeat copies the values one run back, when they were written by this call: the
            // same samples, looked up once.
            if at % values_per_run >= self.run && written >= self.run {
                let from = written - self.run;
                out.copy_within(from..from + n, written);
                at += n;
                written += n;
                continue;
            }
            let table = (run % self.channels) * 256;
            let first = run * self.run + offset;
            let (Some(samples), Some(map)) = (
                self.samples.get(first..first + n),
                self.table.get(table..table + 256),
            ) else {
                return;
            };
            for (value, &sample) in out[written..written + n].iter_mut().zip(samples) {
                *value = map[usize::from(sample)];
            }
            at += n;
            written += n;
        }
    }
}

/// Little-endian f32 bytes as values (a trailing partial value, which a validated tensor never has,
/// is ignored).
pub fn le_f32s(data: &[u8]) -> Vec<f32> {
    data.chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// Little-endian i64 bytes as values (a trailing partial value is ignored, as in [`le_f32s`]).
pub fn le_i64s(data: &[u8]) -> Vec<i64> {
    data.chunks_exact(8)
        .map(|b| i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
        .collect()
}

/// The tensors as the model's own processor would give them: every `u8` tensor that has a
/// `<name>_table` companion replaced by its f32 values (see [`f32_values`]), rows as long as its
/// repeats make them, the companions dropped.
pub fn with_f32_values(tensors: &[Tensor]) -> Result<Vec<Tensor>, CallError> {
    let tabled = |name: &str| {
        tensors
            .iter()
            .any(|t| t.name == name && t.dtype == Dtype::U8)
            && tensors
                .iter()
                .any(|t| t.name == format!("{name}{TABLE_SUFFIX}"))
    };
    let mut out = Vec::with_capacity(tensors.len());
    for tensor in tensors {
        if companion_of(&tensor.name).is_some_and(&tabled) {
            continue;
        }
        if tensor.dtype == Dtype::U8 && tabled(&tensor.name) {
            let values = f32_values(tensors, &tensor.name)?;
            let mut shape = tensor.shape.clone();
            if let Some(row) = shape.last_mut() {
                *row *= repeats(tensors, &tensor.name)? as u64;
            }
            out.push(Tensor {
                name: tensor.name.clone(),
                dtype: Dtype::F32,
                shape,
                data: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            });
        } else {
            out.push(tensor.clone());
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(name: &str, dtype: Dtype, shape: &[u64], data: Vec<u8>) -> Tensor {
        Tensor::new(name, dtype, shape, data)
    }

    /// A `[2, 256]` table in which channel c maps v to 1000c + v.
    fn two_channel_table(name: &str) -> Tensor {
        let table: Vec<u8> = (0..2)
            .flat_map(|c| (0..256).map(move |v| (1000 * c + v) as f32))
            .flat_map(f32::to_le_bytes)
            .collect();
        tensor(name, Dtype::F32, &[2, 256], table)
    }

    #[test]
    fn u8_samples_take_their_values_from_the_table_channel_by_channel() {
        // Two rows of 2 channels x 2 samples.
        let tensors = vec![
            tensor("x", Dtype::U8, &[2, 4], vec![1, 2, 3, 4, 5, 6, 7, 8]),
            two_channel_table("x_table"),
            tensor("grid", Dtype::I64, &[1], 7i64.to_le_bytes().to_vec()),
        ];
        let expected = [1.0, 2.0, 1003.0, 1004.0, 5.0, 6.0, 1007.0, 1008.0];
        assert_eq!(f32_values(&tensors, "x").unwrap(), expected);
        let hf = with_f32_values(&tensors).unwrap();
        let names: Vec<&str> = hf.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["x", "grid"]);
        assert_eq!((hf[0].dtype, &hf[0].shape), (Dtype::F32, &vec![2, 4]));
        assert_eq!(f32_values(&hf, "x").unwrap(), expected);
        assert_eq!(
            (&hf[1].name, &hf[1].data),
            (&tensors[2].name, &tensors[2].data)
        );
    }

    #[test]
    fn any_range_of_u8_samples_maps_as_the_whole_does() {
        let tensors = vec![
            tensor("x", Dtype::U8, &[2, 4], vec![1, 2, 3, 4, 5, 6, 7, 8]),
            two_channel_table("x_table"),
        ];
        let samples = ByteSamples::from_tensors(&tensors, "x")
            .ok()
            .flatten()
            .unwrap_or_else(|| panic!("no samples"));
        let mut whole = Vec::new();
        samples.map_into(&mut whole);
        for start in 0..8 {
            for len in 0..=8 - start {
                let mut part = vec![f32::NAN; len];
                samples.map_range_into(start, &mut part);
                assert_eq!(part, whole[start..start + len], "{start}+{len}");
            }
        }
        // Past the end nothing is written.
        let mut past = [f32::NAN; 2];
        samples.map_range_into(7, &mut past);
        assert_eq!(past[0], 1008.0);
        assert!(past[1].is_nan());
    }

    #[test]
    fn repeated_runs_stand_for_their_copies_in_place() {
        // Rows of 2 channels x 2 samples, each run standing for 3 copies: rows of 12 values.
        let compact = vec![
            tensor("x", Dtype::U8, &[2, 4], vec![1, 2, 3, 4, 5, 6, 7, 8]),
            two_channel_table("x_table"),
            tensor("x_repeats", Dtype::I64, &[], 3i64.to_le_bytes().to_vec()),
        ];
        // The same values written out, as a processor that copies would send them.
        let written_out = vec![
            tensor(
                "x",
                Dtype::U8,
                &[2, 12],
                vec![
                    1, 2, 1, 2, 1, 2, 3, 4, 3, 4, 3, 4, 5, 6, 5, 6, 5, 6, 7, 8, 7, 8, 7, 8,
                ],
            ),
            two_channel_table("x_table"),
        ];
        let expected = f32_values(&written_out, "x").unwrap();
        assert_eq!(expected.len(), 24);
        assert_eq!(f32_values(&compact, "x").unwrap(), expected);
        let samples = ByteSamples::from_tensors(&compact, "x")
            .ok()
            .flatten()
            .unwrap_or_else(|| panic!("no samples"));
        assert_eq!((samples.len(), samples.repeats()), (24, 3));
        for start in 0..24 {
            for len in 0..=24 - start {
                let mut part = vec![f32::NAN; len];
                samples.map_range_into(start, &mut part);
                assert_eq!(part, expected[start..start + len], "{start}+{len}");
            }
        }
        // Past the end nothing is written, repeats or not.
        let mut past = [f32::NAN; 3];
        samples.map_range_into(23, &mut past);
        assert_eq!(past[0], expected[23]);
        assert!(past[1].is_nan() && past[2].is_nan());
        let hf = with_f32_values(&compact).unwrap();
        let names: Vec<&str> = hf.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["x"]);
        assert_eq!(hf[0].shape, vec![2, 12]);
        for bad in [0i64, -1, 65] {
            let mut tensors = compact.clone();
            tensors[2].data = bad.to_le_bytes().to_vec();
            assert!(
                matches!(f32_values(&tensors, "x"), Err(CallError::Contract(_))),
                "{bad}"
            );
        }
        let mut wrong_type = compact.clone();
        wrong_type[2] = tensor("x_repeats", Dtype::I32, &[], 3i32.to_le_bytes().to_vec());
        assert!(f32_values(&wrong_type, "x").is_err());
    }

    #[test]
    fn u8_samples_without_a_fitting_table_are_a_contract_error() {
        let samples = tensor("x", Dtype::U8, &[1, 3], vec![1, 2, 3]);
        let no_table = [samples.clone()];
        assert!(matches!(
            f32_values(&no_table, "x"),
            Err(CallError::Contract(_))
        ));
        // Rows of 3 do not split into 2 channels.
        let table = tensor("x_table", Dtype::F32, &[2, 256], vec![0; 2 * 256 * 4]);
        assert!(matches!(
            f32_values(&[samples.clone(), table], "x"),
            Err(CallError::Contract(_))
        ));
        let short = tensor("x_table", Dtype::F32, &[3, 256], vec![0; 10]);
        assert!(f32_values(&[samples, short], "x").is_err());
        assert!(matches!(f32_values(&[], "x"), Err(CallError::Contract(_))));
    }

    #[test]
    fn tensor_validation_catches_mismatched_bytes_and_overflow() {
        let ok = Tensor {
            name: "x".into(),
            dtype: Dtype::F32,
            shape: vec![2, 3],
            data: vec![0; 24],
        };
        assert!(ok.validate().is_ok());
        let short = Tensor {
            data: vec![0; 23],
            ..ok.clone()
        };
        assert!(matches!(short.validate(), Err(CallError::Contract(_))));
        let overflow = Tensor {
            shape: vec![u64::MAX, 2],
            ..ok
        };
        assert!(matches!(overflow.validate(), Err(CallError::Contract(_))));
    }
}
