//! The feature store: every media item's encoder output, keyed by a content hash (blake3 of the
//! preprocessed tensors, the processor config and the model), through its life:
//! encoding → ready → merged into a prefill → discarded, or kept as a cache entry so the same media
//! skips the encoder next time.
//!
//! Requests pin the entries they use; an unpinned ready entry is cache, evicted least recently used
//! first whenever cached bytes exceed the budget (a budget of 0 keeps nothing). Byte counts are
//! exact: the sum of the f32 embeddings held. When every request is gone, pinned bytes are 0.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use super::pool::EncodeResult;

pub type FeatureKey = [u8; 32];

/// The content hash of one media item's encoder input.
pub fn feature_key(
    model: &str,
    processor_config: &str,
    input: &super::input::EncodeInput,
) -> FeatureKey {
    let mut h = blake3::Hasher::new();
    h.update(model.as_bytes());
    h.update(&[0]);
    h.update(processor_config.as_bytes());
    h.update(&[0]);
    input.hash_into(&mut h);
    *h.finalize().as_bytes()
}

/// What a pinned entry currently is.
#[derive(Debug, Clone)]
pub enum FeatureState {
    Encoding,
    Ready(Arc<Vec<f32>>),
    Failed(String),
}

struct Entry {
    state: FeatureState,
    pins: usize,
    last_used: u64,
    /// Kept as cache once unpinned; not for content no other request can ask for (see
    /// [`FeatureStore::pin_once`]).
    cacheable: bool,
}

impl Entry {
    fn bytes(&self) -> usize {
        match &self.state {
            FeatureState::Ready(f) => f.len() * 4,
            _ => 0,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreStats {
    pub entries: usize,
    pub encoding: usize,
    /// Bytes of ready entries some request still uses.
    pub pinned_bytes: usize,
    /// Bytes of ready entries no request uses (the cache).
    pub cached_bytes: usize,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
}

struct Inner {
    entries: HashMap<FeatureKey, Entry>,
    clock: u64,
    stats: StoreStats,
}

pub struct FeatureStore {
    inner: Mutex<Inner>,
    cache_budget: usize,
}

/// Whether a pinned key needs encoding (the caller submits the job) or is already there.
#[derive(Debug, PartialEq, Eq)]
pub enum Pinned {
    /// First request for this content: the caller must encode it and call `complete`.
    MustEncode,
    /// Ready or being encoded for another request.
    Shared,
}

impl FeatureStore {
    pub fn new(cache_budget_bytes: usize) -> Self {
        Self {
            inner: Mutex::new(Inner {
                entries: HashMap::new(),
                clock: 0,
                stats: StoreStats::default(),
            }),
            cache_budget: cache_budget_bytes,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave an entry half-updated (each update is one
        // assignment), so a poisoned lock is still consistent.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Pins `key` for a request: counts a hit if the content is ready or on its way.
    pub fn pin(&self, key: FeatureKey) -> Pinned {
        let mut inner = self.lock();
        inner.clock += 1;
        let now = inner.clock;
        match inner.entries.get_mut(&key) {
            Some(e) if !matches!(e.state, FeatureState::Failed(_)) => {
                e.pins += 1;
                e.last_used = now;
                inner.stats.hits += 1;
                Pinned::Shared
            }
            _ => {
                inner.entries.insert(
                    key,
                    Entry {
                        state: FeatureState::Encoding,
                        pins: 1,
                        last_used: now,
                        cacheable: true,
                    },
                );
                inner.stats.misses += 1;
                Pinned::MustEncode
            }
        }
    }

    /// Pins a key no other request will ask for (a piece named by its handoff before its input
    /// exists): always to be encoded, and gone as soon as it is unpinned, whatever its state, so
    /// that it never takes cache room and a result arriving after its request ended is dropped.
    pub fn pin_once(&self, key: FeatureKey) {
        let mut inner = self.lock();
        inner.clock += 1;
        let last_used = inner.clock;
        inner.entries.insert(
            key,
            Entry {
                state: FeatureState::Encoding,
                pins: 1,
                last_used,
                cacheable: false,
            },
        );
        inner.stats.misses += 1;
    }

    /// Records an encoder result. If no request holds the entry any more it becomes cache (or goes).
    pub fn complete(&self, key: FeatureKey, result: EncodeResult) {
        let mut inner = self.lock();
        if let Some(e) = inner.entries.get_mut(&key) {
            e.state = match result {
                Ok(f) => FeatureState::Ready(f),
                Err(msg) => FeatureState::Failed(msg),
            };
        }
        Self::settle(&mut inner, self.cache_budget);
    }

    pub fn state(&self, key: &FeatureKey) -> Option<FeatureState> {
        self.lock().entries.get(key).map(|e| e.state.clone())
    }

    /// A request is done with `key` (merged, finished, cancelled or failed).
    pub fn unpin(&self, key: &FeatureKey) {
        let mut inner = self.lock();
        if let Some(e) = inner.entries.get_mut(key) {
            e.pins = e.pins.saturating_sub(1);
        }
        Self::settle(&mut inner, self.cache_budget);
    }

    /// Drops unpinned failures and uncacheable entries, then evicts unpinned ready entries, least recently used first,
    /// until the cache fits its budget. Unpinned entries still encoding stay until they complete.
    fn settle(inner: &mut Inner, budget: usize) {
        inner.entries.retain(|_, e| {
            e.pins > 0 || (e.cacheable && !matches!(e.state, FeatureState::Failed(_)))
        });
        loop {
            let cached: usize = inner
                .entries
                .values()
                .filter(|e| e.pins == 0)
                .map(Entry::bytes)
                .sum();
            if cached <= budget {
                break;
            }
            let victim = inner
                .entries
                .iter()
                .filter(|(_, e)| e.pins == 0 && matches!(e.state, FeatureState::Ready(_)))
                .min_by_key(|(_, e)| e.last_used)
                .map(|(k, _)| *k);
            match victim {
                Some(k) => {
                    inner.entries.remove(&k);
                    inner.stats.evictions += 1;
                }
                None => break,
            }
        }
    }

    pub fn stats(&self) -> StoreStats {
        let inner = self.lock();
        let mut s = inner.stats.clone();
        s.entries = inner.entries.len();
        s.encoding = inner
            .entries
            .values()
            .filter(|e| matches!(e.state, FeatureState::Encoding))
            .count();
        s.pinned_bytes = inner
            .entries
            .values()
            .filter(|e| e.pins > 0)
            .map(Entry::bytes)
            .sum();
        s.cached_bytes = inner
            .entries
            .values()
            .filter(|e| e.pins == 0)
            .map(Entry::bytes)
            .sum();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u8) -> FeatureKey {
        [n; 32]
    }

    #[test]
    fn lifecycle_hits_and_byte_accounting() {
        let store = FeatureStore::new(1024);
        assert_eq!(store.pin(key(1)), Pinned::MustEncode);
        assert_eq!(store.pin(key(1)), Pinned::Shared);
        store.complete(key(1), Ok(Arc::new(vec![0.0; 64])));
        let s = store.stats();
        assert_eq!(
            (s.pinned_bytes, s.cached_bytes, s.hits, s.misses),
            (256, 0, 1, 1)
        );
        store.unpin(&key(1));
        store.unpin(&key(1));
        assert_eq!(store.stats().cached_bytes, 256);
        // A later request finds it ready.
        assert_eq!(store.pin(key(1)), Pinned::Shared);
        assert!(matches!(store.state(&key(1)), Some(FeatureState::Ready(_))));
        store.unpin(&key(1));
    }

    #[test]
    fn cache_evicts_least_recently_used_beyond_its_budget() {
        let store = FeatureStore::new(600);
        for n in 1..=3 {
            store.pin(key(n));
            store.complete(key(n), Ok(Arc::new(vec![0.0; 64])));
            store.unpin(&key(n));
        }
        let s = store.stats();
        assert_eq!((s.entries, s.cached_bytes, s.evictions), (2, 512, 1));
        assert_eq!(
            store.pin(key(1)),
            Pinned::MustEncode,
            "the oldest was evicted"
        );
    }

    #[test]
    fn zero_budget_keeps_nothing_and_failures_are_not_cached() {
        let store = FeatureStore::new(0);
        store.pin(key(1));
        store.complete(key(1), Ok(Arc::new(vec![0.0; 8])));
        store.unpin(&key(1));
        store.pin(key(2));
        store.complete(key(2), Err("bad".into()));
        assert!(matches!(
            store.state(&key(2)),
            Some(FeatureState::Failed(_))
        ));
        store.unpin(&key(2));
        assert_eq!(
            store.stats(),
            StoreStats {
                misses: 2,
                evictions: 1,
                ..StoreStats::default()
            }
        );
        // Cancelled while encoding: the entry stays until the encoder finishes, then goes.
        store.pin(key(3));
        store.unpin(&key(3));
        assert_eq!(store.stats().encoding, 1);
        store.complete(key(3), Ok(Arc::new(vec![0.0; 8])));
        assert_eq!(store.stats().entries, 0);
    }
}
