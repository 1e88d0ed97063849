//! The encoder feature cache shared by replicas, in Redis: an encoder output is stored under its
//! input's content hash (with the model and its weights' fingerprint), so that the same media
//! through another replica skips the encoder. Each process's own feature store stays in front of
//! it (the engine looks there first); this is consulted only on a miss there.
//!
//! Entries expire (`feature_ttl_seconds`), and expiring keys are what Redis evicts under a
//! `volatile-*` `maxmemory-policy`: the byte budget of the shared cache is Redis's `maxmemory`,
//! and uploads without expiry are never evicted for it.

use std::sync::Arc;

use mmgate_inference::engine::SharedFeatures;

use crate::metrics::LookupCounters;
use crate::store::Redis;

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
}

impl SharedFeatures for RedisFeatures {
    fn get(&self, key: &[u8; 32]) -> Option<Vec<f32>> {
        let key = self.key(key);
        let found = self.redis.run_blocking(move |mut c| async move {
            redis::cmd("GET")
                .arg(key)
                .query_async::<Option<Vec<u8>>>(&mut c)
                .await
        });
        match found {
            Ok(Some(bytes)) if bytes.len() % 4 == 0 => {
                self.counters.count("hit");
                Some(
                    bytes
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect(),
                )
            }
            Ok(_) => {
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

    fn put(&self, key: &[u8; 32], features: &[f32]) {
        if features.len() * 4 > self.max_entry_bytes {
            return;
        }
        let key = self.key(key);
        let bytes: Vec<u8> = features.iter().flat_map(|f| f.to_le_bytes()).collect();
        let ttl = self.ttl_seconds;
        // Written before the item's requests hear of it, so that another replica asked for the
        // same media right after finds it (one round trip on the encoder's thread).
        let stored = self.redis.run_blocking(move |mut c| async move {
            redis::cmd("SET")
                .arg(key)
                .arg(bytes)
                .arg("EX")
                .arg(ttl)
                .query_async::<()>(&mut c)
                .await
        });
        if let Err(e) = stored {
            self.counters.count("error");
            tracing::debug!(error = %e.0, "shared feature cache write");
        }
    }
}
