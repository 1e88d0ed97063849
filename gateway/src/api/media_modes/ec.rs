//! `media = "ec"`: mmgate is the encode tier of an unmodified vLLM. A request's media are planned
//! and preprocessed as for a native model, encoded on this model's encoder devices, and each
//! item's output is written to the [`EcStore`] that vLLM's EC connector reads; the request goes on
//! with only each item's placeholder metadata (its grid, or an audio's token count) and its
//! identifier as the part's `uuid`. Identifiers are content addresses (the weights, the processor
//! config, the preprocessed input, the dtype): a repeated item is encoded and written once, and
//! vLLM's own encoder and prefix caches hit on it too.
//!
//! A Qwen3-VL video goes with its temporal patches' timestamps beside its grid (vLLM writes each
//! into the prompt before the patch's tokens). What vLLM 0.32's consumer cannot place from
//! metadata alone goes as `preprocess` sends it: a Qwen2.5-VL video whose temporal patches are
//! not one second apart (its `second_per_grid_ts` is not among the fields it takes out of band:
//! vLLM would assume one second).

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use http::StatusCode;
use mmgate_inference::engine::{EncodeInput, MediaItem};
use mmgate_inference::families::MediaKind;
use mmgate_inference::rope::Grid;
use serde_json::{Value, json};

use super::{ModeCall, encode_failed, encoded_headers};
use crate::api::request::parsed_off_thread;
use crate::config::{EcDtype, EncodeErrorPolicy};
use crate::ec_store::{EcStore, EcStoreError, Pin};
use crate::error::ApiError;
use crate::media::account;
use crate::model::LocalModel;
use crate::native::chat;
use crate::upstream::ReplyAdditions;
use crate::wire::openai::parts::Rewrite;

/// A model whose encoder outputs reach vLLM through its EC connector.
pub struct EcMedia {
    pub model: LocalModel,
    pub store: Arc<EcStore>,
    dtype: EcDtype,
    /// What sets this model's outputs apart: its weights' fingerprint.
    weights: String,
    /// The M-RoPE step vLLM gives a video's temporal patches when it is not told their seconds
    /// (`tokens_per_second`, or 1): a video planned with another goes as `preprocess` sends it.
    unscaled_video_interval: f32,
}

impl EcMedia {
    /// `dtype`: the config's `ec_dtype`, else the checkpoint's (in `dir`).
    pub fn new(
        model: LocalModel,
        store: Arc<EcStore>,
        dtype: Option<EcDtype>,
        dir: &Path,
        weights: String,
    ) -> anyhow::Result<EcMedia> {
        let config: Value = serde_json::from_slice(&std::fs::read(dir.join("config.json"))?)?;
        let field = |name: &str| {
            config
                .get(name)
                .or_else(|| config.get("text_config").and_then(|t| t.get(name)))
                .and_then(Value::as_str)
        };
        let dtype = dtype.unwrap_or(match field("torch_dtype").or(field("dtype")) {
            Some("float16") => EcDtype::Float16,
            Some("float32") => EcDtype::Float32,
            _ => EcDtype::Bfloat16,
        });
        let unscaled_video_interval = config
            .get("vision_config")
            .and_then(|v| v.get("tokens_per_second"))
            .and_then(Value::as_f64)
            .unwrap_or(1.0) as f32;
        Ok(EcMedia {
            model,
            store,
            dtype,
            weights,
            unscaled_video_interval,
        })
    }

    /// What every identifier of this model's items starts from: the weights and the dtype.
    fn identifier_seed(&self) -> blake3::Hasher {
        let mut h = blake3::Hasher::new();
        h.update(b"mmgate-ec-1\0");
        h.update(self.weights.as_bytes());
        h.update(&[0]);
        h.update(dtype_name(self.dtype).as_bytes());
        h.update(&[0]);
        h
    }

    /// What vLLM's consumer needs to place `item` (whose runs are at `times` in its video, if
    /// the family writes them) beside its identifier; `None` for an item it cannot place from
    /// that alone (see the module's note).
    fn placement(&self, kind: MediaKind, item: &MediaItem, times: &[f64]) -> Option<Placement> {
        let grid = match item.input.as_ref() {
            EncodeInput::Vision { grid, .. }
            | EncodeInput::Embeddings {
                grid: Some(grid), ..
            } => Some(*grid),
            _ => None,
        };
        match (kind, grid) {
            (MediaKind::Image, Some(grid)) => Some(Placement::Image(grid)),
            // A video in one run, or (Qwen3-VL) one run per temporal patch, each at its time.
            (MediaKind::Video, Some(grid))
                if (item.time_interval - self.unscaled_video_interval).abs() < 1e-6 =>
            {
                match item.part {
                    None => Some(Placement::Video(grid, None)),
                    Some(_) if times.len() == grid.t => {
                        Some(Placement::Video(grid, Some(times.to_vec())))
                    }
                    Some(_) => None,
                }
            }
            (MediaKind::Audio, None) if matches!(*item.input, EncodeInput::Audio { .. }) => {
                Some(Placement::Audio(item.tokens))
            }
            _ => None,
        }
    }
}

/// An item's placeholder metadata, as vLLM's parser takes it for the modality.
#[derive(Clone)]
enum Placement {
    Image(Grid),
    /// A video's grid, and its temporal patches' timestamps where the family writes them.
    Video(Grid, Option<Vec<f64>>),
    Audio(usize),
}

impl Placement {
    /// The part vLLM gets in place of the media: the metadata and the identifier, no tensor.
    fn part(&self, id: &str) -> Value {
        let thw = |g: &Grid| json!([g.t, g.h, g.w]);
        let (kind, metadata) = match self {
            Self::Image(grid) => ("image_embeds", json!({"image_grid_thw": thw(grid)})),
            Self::Video(grid, None) => ("video_embeds", json!({"video_grid_thw": thw(grid)})),
            Self::Video(grid, Some(times)) => (
                "video_embeds",
                json!({"video_grid_thw": thw(grid), "timestamps": times}),
            ),
            Self::Audio(tokens) => ("audio_embeds", json!({"audio_num_tokens": [tokens]})),
        };
        json!({"type": kind, kind: metadata, "uuid": id})
    }
}

/// What became of a request with media.
pub enum Outcome {
    /// Each media part replaced by its identifier and metadata, its item in the store.
    Carried(Value, ReplyAdditions),
    /// The request as it came: an item cannot go this way (the caller sends it as `preprocess`
    /// does).
    NotCarried(Value),
}

/// The request (`value`, parsed from `body`) with its media through the EC store.
pub async fn prepare(
    ec: &EcMedia,
    call: &ModeCall<'_>,
    mut value: Value,
    body: Bytes,
) -> Result<Outcome, ApiError> {
    let request = parsed_off_thread(body, call.services.limits).await?;
    let prepared = chat::prepare(&ec.model, request, &call.services).await?;
    call.metrics.media_prepared(&prepared.media);
    let prompt_tokens = prepared.prompt_tokens();
    let (items, accounts) = prepared.into_media();

    let mut kept = Vec::with_capacity(items.len());
    let mut items = items.into_iter();
    for account in accounts.iter().filter(|a| a.dropped.is_none()) {
        let Some(chat::KeptItem { item, times }) = items.next() else {
            return Err(encode_failed("a media item was not prepared"));
        };
        let Some(placement) = ec.placement(account.kind, &item, &times) else {
            return Ok(Outcome::NotCarried(value));
        };
        kept.push((account.index, item, placement));
    }

    // Hashing the inputs and looking for their files is blocking work.
    let looked = {
        let (store, seed) = (ec.store.clone(), ec.identifier_seed());
        let inputs: Vec<(Arc<EncodeInput>, String)> = kept
            .iter()
            .map(|(_, item, _)| (item.input.clone(), item.processor_config.clone()))
            .collect();
        tokio::task::spawn_blocking(move || {
            inputs
                .into_iter()
                .map(|(input, processor_config)| {
                    let id = identifier(&seed, &input, &processor_config);
                    let pin = store.pin_existing(&id);
                    (id, pin)
                })
                .collect::<Vec<_>>()
        })
        .await
        .map_err(|_| encode_failed("looking up the EC store failed"))?
    };

    // What is not stored goes to the encoder devices at once (each distinct item once); each
    // output is written as soon as it is made.
    let mut writes = Vec::new();
    let mut first_write = std::collections::HashMap::new();
    let mut placed = Vec::with_capacity(kept.len());
    for ((index, item, placement), (id, pin)) in kept.into_iter().zip(looked) {
        let slot = match (pin, first_write.get(&id)) {
            (Some(pin), _) => Slot::Stored(pin),
            (None, Some(_)) => Slot::SameAs,
            (None, None) => {
                first_write.insert(id.clone(), writes.len());
                writes.push(write_when_encoded(ec, item, id.clone()));
                Slot::Written(writes.len() - 1)
            }
        };
        placed.push(Placed {
            slot,
            index,
            placement,
            id,
        });
    }
    let written = futures_util::future::join_all(writes).await;

    let mut pins = Vec::with_capacity(placed.len());
    let mut rewrites = Vec::with_capacity(accounts.len());
    let mut dropped_here = false;
    let mut placed = placed.into_iter();
    let mut outcomes: Vec<Option<Result<Pin, WriteFailure>>> =
        written.into_iter().map(Some).collect();
    for account in &accounts {
        if account.dropped.is_some() {
            rewrites.push(Rewrite::Drop);
            continue;
        }
        let Some(placed) = placed.next() else {
            return Err(encode_failed("a media item was not encoded"));
        };
        let part = Rewrite::Replace(placed.placement.part(&placed.id));
        let outcome = match placed.slot {
            Slot::Stored(pin) => Ok(pin),
            Slot::Written(n) => outcomes[n]
                .take()
                .unwrap_or_else(|| Err(WriteFailure::Encode("written twice".into()))),
            // Its file is pinned by the item it repeats (if that one was dropped, so is this:
            // see below).
            Slot::SameAs => {
                rewrites.push(part);
                continue;
            }
        };
        match outcome {
            Ok(pin) => {
                pins.push(pin);
                rewrites.push(part);
            }
            Err(WriteFailure::Store(e)) => return Err(store_error(&e)),
            Err(WriteFailure::Encode(failure)) => {
                if ec.model.on_encode_error != EncodeErrorPolicy::Drop {
                    return Err(encode_failed(&format!(
                        "media item {}: {failure}",
                        placed.index
                    )));
                }
                tracing::warn!(item = placed.index, error = %failure, "encoding failed; dropping the media");
                rewrites.push(Rewrite::Drop);
                dropped_here = true;
            }
        }
    }
    if dropped_here {
        // A repeat of a dropped item has no file either: drop every part whose id is not stored.
        let stored: std::collections::HashSet<&str> = pins.iter().map(|p| p.id()).collect();
        for rewrite in &mut rewrites {
            if let Rewrite::Replace(part) = rewrite
                && part["uuid"].as_str().is_some_and(|id| !stored.contains(id))
            {
                *rewrite = Rewrite::Drop;
            }
        }
    }
    super::rewrite_parts(&mut value, rewrites, &accounts);
    let additions = ReplyAdditions {
        headers: encoded_headers(&accounts, prompt_tokens, dropped_here),
        usage_media: Some(Value::Array(account::render(&accounts))),
        held: pins,
    };
    Ok(Outcome::Carried(value, additions))
}

enum Slot {
    /// Its file was there already.
    Stored(Pin),
    /// Written by the `n`th write.
    Written(usize),
    /// The same item as an earlier one of the request (written there).
    SameAs,
}

struct Placed {
    slot: Slot,
    index: usize,
    placement: Placement,
    id: String,
}

enum WriteFailure {
    Encode(String),
    Store(EcStoreError),
}

/// The identifier an item is written and sent under: a content address of what its encoder output
/// is made from (`seed`: the model's [`EcMedia::identifier_seed`]).
fn identifier(seed: &blake3::Hasher, input: &EncodeInput, processor_config: &str) -> String {
    let mut h = seed.clone();
    h.update(processor_config.as_bytes());
    h.update(&[0]);
    input.hash_into(&mut h);
    h.finalize().to_hex().to_string()
}

/// Encodes `item` and writes its output as `id`.
async fn write_when_encoded(
    ec: &EcMedia,
    item: MediaItem,
    id: String,
) -> Result<Pin, WriteFailure> {
    let (done, result) = tokio::sync::oneshot::channel();
    ec.model
        .runtime
        .encoders
        .submit_shared(item.input.clone(), item.share_key, move |r| {
            let _ = done.send(r);
        })
        .map_err(|e| WriteFailure::Encode(e.to_string()))?;
    let features = match result.await {
        Ok(Ok(features)) => features,
        Ok(Err(message)) => return Err(WriteFailure::Encode(message)),
        Err(_) => return Err(WriteFailure::Encode("the encoder device stopped".into())),
    };
    let (store, dtype, width) = (
        ec.store.clone(),
        ec.dtype,
        ec.model.runtime.prompt.embedding_width,
    );
    tokio::task::spawn_blocking(move || {
        let file = encoder_cache_file(&features, width, dtype)
            .map_err(|e| WriteFailure::Encode(format!("writing its encoder output: {e}")))?;
        store.write(&id, &file).map_err(WriteFailure::Store)
    })
    .await
    .map_err(|_| WriteFailure::Encode("writing its encoder output failed".into()))?
}

/// The safetensors file vLLM's `ECExampleConnector` loads: one tensor `ec_cache`,
/// `[tokens, width]` in the dtype the model runs in.
fn encoder_cache_file(
    features: &[f32],
    width: usize,
    dtype: EcDtype,
) -> Result<Vec<u8>, safetensors::SafeTensorError> {
    use safetensors::tensor::{Dtype, TensorView};
    let rows = features.len() / width.max(1);
    let (dtype, data): (Dtype, Vec<u8>) = match dtype {
        EcDtype::Float32 => (
            Dtype::F32,
            features.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
        EcDtype::Bfloat16 => (
            Dtype::BF16,
            features
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                .collect(),
        ),
        EcDtype::Float16 => (
            Dtype::F16,
            features
                .iter()
                .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                .collect(),
        ),
    };
    let view = TensorView::new(dtype, vec![rows, width], &data)?;
    safetensors::tensor::serialize([("ec_cache", view)], None)
}

fn dtype_name(dtype: EcDtype) -> &'static str {
    match dtype {
        EcDtype::Bfloat16 => "bfloat16",
        EcDtype::Float16 => "float16",
        EcDtype::Float32 => "float32",
    }
}

/// A store that cannot take an item: 503, the request goes nowhere.
fn store_error(error: &EcStoreError) -> ApiError {
    let code = if error.is_full() {
        "ec_store_full"
    } else {
        "ec_store_unavailable"
    };
    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, code, error.to_string())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn an_encoder_cache_file_is_one_tensor_of_the_model_dtype() {
        let features = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        for (dtype, expected, bytes) in [
            (EcDtype::Float32, safetensors::Dtype::F32, 24),
            (EcDtype::Bfloat16, safetensors::Dtype::BF16, 12),
            (EcDtype::Float16, safetensors::Dtype::F16, 12),
        ] {
            let file = encoder_cache_file(&features, 3, dtype).unwrap();
            let read = safetensors::SafeTensors::deserialize(&file).unwrap();
            assert_eq!(read.names(), vec!["ec_cache"]);
            let tensor = read.tensor("ec_cache").unwrap();
            assert_eq!(
                (tensor.dtype(), tensor.shape(), tensor.data().len()),
                (expected, &[2usize, 3][..], bytes)
            );
        }
    }

    #[test]
    fn parts_carry_metadata_and_the_identifier_only() {
        let grid = Grid { t: 1, h: 4, w: 6 };
        assert_eq!(
            Placement::Image(grid).part("ab"),
            json!({"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 4, 6]}, "uuid": "ab"})
        );
        assert_eq!(
            Placement::Video(Grid { t: 2, ..grid }, None).part("cd")["video_embeds"],
            json!({"video_grid_thw": [2, 4, 6]})
        );
        // Qwen3-VL's: each temporal patch's time, as floats (vLLM reads a float array).
        assert_eq!(
            Placement::Video(Grid { t: 2, ..grid }, Some(vec![0.25, 1.0])).part("cd")
                ["video_embeds"]
                .to_string(),
            r#"{"video_grid_thw":[2,4,6],"timestamps":[0.25,1.0]}"#
        );
        assert_eq!(
            Placement::Audio(25).part("ef")["audio_embeds"],
            json!({"audio_num_tokens": [25]})
        );
    }
}
