//! The plugin host's tensors as the inference core's plain values: each tensor decoded once from
//! its little-endian bytes, 8-bit samples kept compact behind their table until the encoder packs
//! its batch.

use std::sync::Arc;

use anyhow::Context as _;

use mmgate_host::{ByteSamples, Dtype, PartPlan, Tensor};
use mmgate_inference::backend::ByteSamplesView;
use mmgate_inference::engine::{PixelSource, PixelValues};
use mmgate_inference::families::MediaKind;
use mmgate_inference::item_tensors::{ItemTensors, NamedTensor, Values};
use mmgate_inference::prompt::{PartLayout, PlacedItem, PromptModel};

use super::bands;

/// One item's tensors (or one part's), as the families read them.
pub fn item_tensors(tensors: &[Tensor]) -> ItemTensors {
    ItemTensors::new(
        tensors
            .iter()
            .map(|t| named(t, || ByteSamples::from_tensors(tensors, &t.name)))
            .collect(),
    )
}

/// The engine's items for an item its plugin made in parts: joined back into the whole first when
/// the model's encoder sees such an item whole (an image in bands of rows), else a piece each.
pub fn place_parts(
    prompt: &PromptModel,
    kind: MediaKind,
    tokens: usize,
    parts: &[Vec<Tensor>],
    index: usize,
) -> anyhow::Result<PlacedItem> {
    match prompt.row_bands(kind) {
        Some(bands) => {
            let whole = bands::join(parts, bands).context("the plugin's bands of rows")?;
            Ok(prompt.media_item(kind, tokens, item_tensors(&whole))?)
        }
        None => {
            let parts = parts.iter().map(|part| item_tensors(part)).collect();
            Ok(prompt.media_parts(kind, tokens, parts, index)?)
        }
    }
}

/// A part's layout from its plan: its tokens and placing tensors.
pub fn part_layouts(plans: &[PartPlan]) -> Vec<PartLayout> {
    plans
        .iter()
        .map(|plan| PartLayout {
            tokens: plan.tokens as usize,
            placing: item_tensors(&plan.placing),
        })
        .collect()
}

/// One tensor on its own (a client's embeddings or grid): 8-bit values have no table here.
pub fn named_tensor(tensor: &Tensor) -> NamedTensor {
    named(tensor, || {
        ByteSamples::from_tensors(std::slice::from_ref(tensor), &tensor.name)
    })
}

fn named(
    t: &Tensor,
    samples: impl FnOnce() -> Result<Option<ByteSamples>, mmgate_host::CallError>,
) -> NamedTensor {
    let dtype = t.dtype.name();
    let values = match t.dtype {
        Dtype::F32 => Values::Floats {
            dtype,
            values: mmgate_host::le_f32s(&t.data),
        },
        Dtype::F16 => Values::Floats {
            dtype,
            values: widened(&t.data, |b| half::f16::from_le_bytes(b).to_f32()),
        },
        Dtype::Bf16 => Values::Floats {
            dtype,
            values: widened(&t.data, |b| half::bf16::from_le_bytes(b).to_f32()),
        },
        Dtype::I64 => Values::Ints {
            dtype,
            values: mmgate_host::le_i64s(&t.data),
        },
        Dtype::I32 => Values::Ints {
            dtype,
            values: t
                .data
                .chunks_exact(4)
                .map(|b| i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])))
                .collect(),
        },
        Dtype::U8 => match samples() {
            Ok(Some(samples)) => {
                Values::Samples(PixelValues::Source(Arc::new(PluginSamples(samples))))
            }
            Ok(None) => Values::Unreadable(format!("{} is not 8-bit samples", t.name)),
            Err(e) => Values::Unreadable(e.to_string()),
        },
    };
    NamedTensor {
        name: t.name.clone(),
        shape: t.shape.clone(),
        values,
    }
}

/// Two-byte floats as f32.
fn widened(data: &[u8], widen: fn([u8; 2]) -> f32) -> Vec<f32> {
    data.chunks_exact(2).map(|b| widen([b[0], b[1]])).collect()
}

/// A plugin's 8-bit samples as the encoder's pixel source: expanded through their table when the
/// encoder packs a batch.
#[derive(Debug)]
struct PluginSamples(ByteSamples);

impl PixelSource for PluginSamples {
    fn value_count(&self) -> usize {
        self.0.len()
    }

    fn bytes(&self) -> usize {
        self.0.bytes()
    }

    fn feed_content(&self, feed: &mut dyn FnMut(&[u8])) {
        let (samples, table) = self.0.parts();
        feed(&(self.0.repeats() as u64).to_le_bytes());
        feed(samples);
        for v in table {
            feed(&v.to_le_bytes());
        }
    }

    fn extend_f32(&self, out: &mut Vec<f32>) {
        self.0.map_into(out);
    }

    fn write_f32(&self, start: usize, out: &mut [f32]) {
        self.0.map_range_into(start, out);
    }

    fn byte_samples(&self) -> Option<ByteSamplesView<'_>> {
        let (samples, table) = self.0.parts();
        Some(ByteSamplesView {
            samples,
            table,
            run: self.0.run(),
            channels: self.0.channels(),
            repeats: self.0.repeats(),
        })
    }
}
