//! The encoder feature cache shared by replicas, in Redis: an encoder output is stored under its
//! input's content hash (with the model and its weights' fingerprint), so that the same media
//! through another replica skips the encoder. Each process's own feature store stays in front of
//! it (the engine looks there first); this is consulted only on a miss there.
//!
//! Entries expire (`feature_ttl_seconds`), and expiring keys are what Redis evicts under a
//! `volatile-*` `maxmemory-policy`: the byte budget of the shared cache is Redis's `maxmemory`,
//! and uploads without expiry are never evicted for it.

use std::sync::Arc;

use base64::Engine as _;
use mmgate_host::{Dtype, Tensor, TokenPlan, companion_of};
use mmgate_inference::engine::SharedFeatures;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use serde_json::{Value, json};

use crate::store::{Redis, Unavailable};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    outcome: &'static str,
}

/// Lookups in the shared feature cache, by outcome (exported in `/metrics`).
#[derive(Clone, Default)]
pub struct LookupCounters(Family<OutcomeLabels, Counter>);

impl LookupCounters {
    /// The counters as a metric family, to register.
    pub fn family(&self) -> Family<OutcomeLabels, Counter> {
        self.0.clone()
    }

    pub fn count(&self, outcome: &'static str) {
        self.0.get_or_create(&OutcomeLabels { outcome }).inc();
    }
}

/// A shared cache as one model uses it.
#[derive(Clone)]
pub struct SharedCache {
    pub features: Arc<dyn SharedFeatures>,
    /// What sets this model's outputs apart from another's for the same input: its name and its
    /// weights' fingerprint.
    pub namespace: String,
}

pub struct RedisFeatures {
    redis: Arc<Redis>,
    ttl_seconds: u64,
    /// Outputs larger than this are not shared (one entry must not crowd out the rest).
    max_entry_bytes: usize,
    counters: LookupCounters,
}

impl RedisFeatures {
    pub fn new(
        redis: Arc<Redis>,
        ttl_seconds: u64,
        max_entry_bytes: usize,
        counters: LookupCounters,
    ) -> RedisFeatures {
        RedisFeatures {
            redis,
            ttl_seconds,
            max_entry_bytes,
            counters,
        }
    }

    fn key(&self, key: &[u8; 32]) -> String {
        self.redis.key(&["features", &hex::encode(key)])
    }

    fn note_key(&self, key: &[u8; 32]) -> String {
        self.redis.key(&["features", &hex::encode(key), "note"])
    }

    /// `SET key value EX ttl`: every entry expires (see the module's note on eviction).
    fn set(&self, key: String, value: Vec<u8>) -> redis::Cmd {
        let mut set = redis::cmd("SET");
        set.arg(key).arg(value).arg("EX").arg(self.ttl_seconds);
        set
    }

    /// A lookup's value, counted as a hit, a miss or an error.
    fn counted<T>(&self, found: Result<Option<T>, Unavailable>) -> Option<T> {
        match found {
            Ok(Some(value)) => {
                self.counters.count("hit");
                Some(value)
            }
            Ok(None) => {
                self.counters.count("miss");
                None
            }
            Err(e) => {
                self.counters.count("error");
                tracing::debug!(error = %e.0, "shared feature cache lookup");
                None
            }
        }
    }
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

impl SharedFeatures for RedisFeatures {
    fn get(&self, key: &[u8; 32]) -> Option<(Vec<f32>, Vec<u8>)> {
        let keys = [self.key(key), self.note_key(key)];
        let found = self.redis.run_blocking(move |mut c| async move {
            redis::cmd("MGET")
                .arg(&keys[..])
                .query_async::<(Option<Vec<u8>>, Option<Vec<u8>>)>(&mut c)
                .await
        });
        self.counted(found.map(|found| match found {
            (Some(features), Some(note)) if features.len() % 4 == 0 => {
                Some((f32s(&features), note))
            }
            _ => None,
        }))
    }

    fn put_note(&self, key: &[u8; 32], note: Vec<u8>) {
        let set = self.set(self.note_key(key), note);
        self.redis
            .spawn(move |mut c| async move { set.query_async::<()>(&mut c).await });
    }

    fn put(&self, key: &[u8; 32], features: &[f32]) {
        if features.len() * 4 > self.max_entry_bytes {
            return;
        }
        let bytes: Vec<u8> = features.iter().flat_map(|f| f.to_le_bytes()).collect();
        let set = self.set(self.key(key), bytes);
        // Written before the item's requests hear of it, so that another replica asked for the
        // same media right after finds it (one round trip on the encoder's thread).
        let stored = self
            .redis
            .run_blocking(move |mut c| async move { set.query_async::<()>(&mut c).await });
        if let Err(e) = stored {
            self.counters.count("error");
            tracing::debug!(error = %e.0, "shared feature cache write");
        }
    }
}

/// Tensors of a plugin's output that only the encoder reads: what a shared entry replaces.
const ENCODER_INPUTS: [&str; 3] = ["pixel_values", "pixel_values_videos", "input_features"];

/// The key of an item's encoder output in the shared cache, known before the item is preprocessed:
/// the model (`namespace`: its name and weights' fingerprint), the plugin (its hash), the processor
/// config, the media's bytes and the plan. Equal keys mean equal encoder inputs, so a replica that
/// finds the key skips decoding, the plugin's preprocessing and the encoder.
pub fn item_key(
    namespace: &str,
    plugin_sha256: &str,
    processor_config: &str,
    media: &[u8],
    plan: &TokenPlan,
) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    for part in [namespace, plugin_sha256, processor_config] {
        h.update(part.as_bytes());
        h.update(&[0]);
    }
    h.update(&(media.len() as u64).to_le_bytes());
    h.update(media);
    h.update(&plan.tokens.to_le_bytes());
    h.update(plan.choices.as_bytes());
    *h.finalize().as_bytes()
}

/// The note stored beside an item's output: its tensors other than the encoder's inputs (grids,
/// `second_per_grid_ts`, masks), which place the output in the prompt.
pub fn note(tensors: &[Tensor]) -> Vec<u8> {
    let small: Vec<Value> = tensors
        .iter()
        .filter(|t| {
            !ENCODER_INPUTS
                .iter()
                .any(|n| t.name == *n || companion_of(&t.name) == Some(n))
        })
        .map(|t| {
            json!({
                "name": t.name,
                "dtype": t.dtype.name(),
                "shape": t.shape,
                "data": base64::engine::general_purpose::STANDARD.encode(&t.data),
            })
        })
        .collect();
    serde_json::to_vec(&small).unwrap_or_default()
}

/// The tensors of a [`note`], or `None` when it does not read back.
pub fn noted_tensors(note: &[u8]) -> Option<Vec<Tensor>> {
    let entries: Vec<Value> = serde_json::from_slice(note).ok()?;
    entries
        .iter()
        .map(|e| {
            let dtype = Dtype::from_name(e["dtype"].as_str()?)?;
            let data = base64::engine::general_purpose::STANDARD
                .decode(e["data"].as_str()?)
                .ok()?;
            Some(Tensor {
                name: e["name"].as_str()?.to_owned(),
                dtype,
                shape: serde_json::from_value(e["shape"].clone()).ok()?,
                data,
            })
        })
        .collect()
}
