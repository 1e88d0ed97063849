//! An item's tensors as plain values by name: what a plugin made of one media item (or of one of
//! its parts), the small tensors that place embeddings made elsewhere, or a client's grid. Whoever
//! holds the tensors (the gateway, over the plugin host's) converts them once; the families read
//! them here and know nothing of where they came from.

use crate::engine::PixelValues;
use crate::error::{Error, Result};

/// One tensor's values, decoded from its wire form.
#[derive(Debug)]
pub enum Values {
    /// Floats: f32, or f16 / bf16 widened (`dtype` says which it was).
    Floats {
        dtype: &'static str,
        values: Vec<f32>,
    },
    /// Integers: i64, or i32 widened (`dtype` says which it was).
    Ints {
        dtype: &'static str,
        values: Vec<i64>,
    },
    /// 8-bit samples that stand for float values through their table (pixel values kept compact
    /// until the encoder packs its batch).
    Samples(PixelValues),
    /// Values that could not be read, and why (8-bit samples without their table, say).
    Unreadable(String),
}

impl Values {
    fn dtype(&self) -> &'static str {
        match self {
            Self::Floats { dtype, .. } | Self::Ints { dtype, .. } => dtype,
            Self::Samples(_) => "u8",
            Self::Unreadable(_) => "unreadable",
        }
    }
}

/// A named tensor: its dimensions and values.
#[derive(Debug)]
pub struct NamedTensor {
    pub name: String,
    pub shape: Vec<u64>,
    pub values: Values,
}

/// Where an item's tensors came from, which words the error for one that is missing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TensorOrigin {
    /// A plugin's output for the whole item.
    #[default]
    Plugin,
    /// A plugin's output for one part of an item.
    PluginPart,
    /// The placing tensors of a part's plan.
    PartPlan,
    /// An entry another replica stored.
    SharedEntry,
    /// A client's request.
    Client,
}

impl TensorOrigin {
    fn lacks(self, name: &str) -> String {
        match self {
            Self::Plugin => format!(
                "the plugin's output lacks {name}: does this model's processor config match?"
            ),
            Self::PluginPart => format!("a part of the plugin's output lacks {name}"),
            Self::PartPlan => format!("a part plan lacks {name}"),
            Self::SharedEntry => format!("the shared entry lacks {name}"),
            Self::Client => format!("{name} is missing"),
        }
    }
}

/// One item's tensors by name. Each reader fails with an input error naming the tensor when it is
/// missing or of another type.
#[derive(Debug, Default)]
pub struct ItemTensors {
    tensors: Vec<NamedTensor>,
    origin: TensorOrigin,
}

impl ItemTensors {
    pub fn new(tensors: Vec<NamedTensor>) -> Self {
        Self {
            tensors,
            origin: TensorOrigin::default(),
        }
    }

    /// The same tensors, a missing one reported as missing from `origin`.
    pub fn from_origin(mut self, origin: TensorOrigin) -> Self {
        self.origin = origin;
        self
    }

    pub fn origin(&self) -> TensorOrigin {
        self.origin
    }

    fn find(&self, name: &str) -> Result<&NamedTensor> {
        self.tensors
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| Error::Input(self.origin.lacks(name)))
    }

    fn find_mut(&mut self, name: &str) -> Result<&mut NamedTensor> {
        let origin = self.origin;
        self.tensors
            .iter_mut()
            .find(|t| t.name == name)
            .ok_or_else(|| Error::Input(origin.lacks(name)))
    }

    /// The tensor's dimensions.
    pub fn shape(&self, name: &str) -> Result<&[u64]> {
        Ok(&self.find(name)?.shape)
    }

    /// f32 values, copied.
    pub fn f32s(&self, name: &str) -> Result<Vec<f32>> {
        match &self.find(name)?.values {
            Values::Floats {
                dtype: "f32",
                values,
            } => Ok(values.clone()),
            other => Err(wrong_type(name, other, "f32")),
        }
    }

    /// f32 values, taken out: for the large ones an encoder consumes (read once).
    pub fn take_f32s(&mut self, name: &str) -> Result<Vec<f32>> {
        self.take(name, "f32", |values| match values {
            Values::Floats {
                dtype: "f32",
                values,
            } => Ok(values),
            other => Err(other),
        })
    }

    /// Floats of any width (f32, f16, bf16), widened: embeddings a client sends.
    pub fn floats(&self, name: &str) -> Result<&[f32]> {
        match &self.find(name)?.values {
            Values::Floats { values, .. } => Ok(values),
            other => Err(Error::Input(format!(
                "{name} are {}; floats are expected",
                other.dtype()
            ))),
        }
    }

    /// Integers: i64, or i32 widened.
    pub fn ints(&self, name: &str) -> Result<&[i64]> {
        match &self.find(name)?.values {
            Values::Ints { values, .. } => Ok(values),
            other => Err(wrong_type(name, other, "i64")),
        }
    }

    /// Pixel values, taken out: f32, or 8-bit samples the encoder expands.
    pub fn take_pixel_values(&mut self, name: &str) -> Result<PixelValues> {
        self.take(name, "f32", |values| match values {
            Values::Floats {
                dtype: "f32",
                values,
            } => Ok(PixelValues::F32(values)),
            Values::Samples(samples) => Ok(samples),
            other => Err(other),
        })
    }

    /// Tensor `name`'s values moved out by `convert` (a second read says so), or, when `convert`
    /// hands them back as not what it takes, left in place and reported as not `expected`.
    fn take<T>(
        &mut self,
        name: &str,
        expected: &str,
        convert: impl FnOnce(Values) -> std::result::Result<T, Values>,
    ) -> Result<T> {
        let tensor = self.find_mut(name)?;
        let read = Values::Unreadable(format!("{name} was read already"));
        match convert(std::mem::replace(&mut tensor.values, read)) {
            Ok(taken) => Ok(taken),
            Err(values) => {
                let error = wrong_type(name, &values, expected);
                tensor.values = values;
                Err(error)
            }
        }
    }
}

fn wrong_type(name: &str, values: &Values, expected: &str) -> Error {
    match values {
        Values::Unreadable(why) => Error::Input(why.clone()),
        other => Error::Input(format!("{name} is {}, expected {expected}", other.dtype())),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn tensors() -> ItemTensors {
        ItemTensors::new(vec![
            NamedTensor {
                name: "grid".into(),
                shape: vec![3],
                values: Values::Ints {
                    dtype: "i32",
                    values: vec![1, 4, 6],
                },
            },
            NamedTensor {
                name: "pixels".into(),
                shape: vec![2],
                values: Values::Floats {
                    dtype: "f32",
                    values: vec![0.5, 1.5],
                },
            },
            NamedTensor {
                name: "half".into(),
                shape: vec![1],
                values: Values::Floats {
                    dtype: "f16",
                    values: vec![2.0],
                },
            },
        ])
    }

    #[test]
    fn readers_check_the_type_and_name_what_is_missing_by_its_origin() {
        let mut t = tensors();
        assert_eq!(t.ints("grid").unwrap(), [1, 4, 6]);
        assert_eq!(t.shape("pixels").unwrap(), [2]);
        assert_eq!(t.floats("half").unwrap(), [2.0]);
        let err = t.f32s("half").unwrap_err().to_string();
        assert!(err.contains("half is f16, expected f32"), "{err}");
        let err = t.ints("pixels").unwrap_err().to_string();
        assert!(err.contains("pixels is f32, expected i64"), "{err}");
        assert_eq!(t.take_pixel_values("pixels").unwrap().len(), 2);
        let again = t.take_pixel_values("pixels").unwrap_err().to_string();
        assert!(again.contains("pixels was read already"), "{again}");
        let err = t.take_f32s("grid").unwrap_err().to_string();
        assert!(err.contains("grid is i32, expected f32"), "{err}");
        assert_eq!(
            t.ints("grid").unwrap(),
            [1, 4, 6],
            "a refused take leaves the values"
        );
        let err = t.ints("nothing").unwrap_err().to_string();
        assert!(err.contains("the plugin's output lacks nothing"), "{err}");
        let t = t.from_origin(TensorOrigin::PartPlan);
        let err = t.ints("nothing").unwrap_err().to_string();
        assert!(err.contains("a part plan lacks nothing"), "{err}");
    }

    #[test]
    fn unreadable_values_say_why_when_read() {
        let mut t = ItemTensors::new(vec![NamedTensor {
            name: "pixels".into(),
            shape: vec![4],
            values: Values::Unreadable("u8 samples need a pixels_table tensor".into()),
        }]);
        let err = t.take_pixel_values("pixels").unwrap_err().to_string();
        assert!(err.contains("need a pixels_table"), "{err}");
    }
}
