//! Responses kept for `previous_response_id` and `GET /v1/responses/{id}` (the Responses API's
//! `store`): each with the conversation it ended, which a follow-up turn continues. In this
//! process, or in Redis so that every replica finds them; each caller sees only its own, and
//! each is forgotten after the configured time.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::store::{Caller, Redis, Unavailable};

/// Most responses one process keeps (the oldest go first): a bound on memory without Redis.
const MAX_KEPT_IN_MEMORY: usize = 10_000;
/// Most bytes of kept responses one process holds (their conversations carry media).
const MAX_BYTES_IN_MEMORY: usize = 512 << 20;

/// A kept response.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Kept {
    owner: String,
    expires_at: u64,
    /// The response object, as `GET` answers it.
    pub response: Value,
    /// The chat messages of the conversation up to and including this response's answer,
    /// without the request's `instructions` (a follow-up brings its own).
    pub conversation: Vec<Value>,
}

pub struct ResponseStore {
    ttl_seconds: u64,
    backend: Backend,
}

enum Backend {
    Memory(Mutex<Memory>),
    Redis(Arc<Redis>),
}

#[derive(Default)]
struct Memory {
    entries: HashMap<String, (Kept, usize)>,
    /// Ids in the order they were kept, for evicting the oldest.
    order: VecDeque<String>,
    bytes: usize,
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl ResponseStore {
    pub fn in_memory(ttl_seconds: u64) -> ResponseStore {
        ResponseStore {
            ttl_seconds,
            backend: Backend::Memory(Mutex::default()),
        }
    }

    pub fn in_redis(ttl_seconds: u64, redis: Arc<Redis>) -> ResponseStore {
        ResponseStore {
            ttl_seconds,
            backend: Backend::Redis(redis),
        }
    }

    /// Keeps `response` (its `id`) and the `conversation` it ended, for `owner`.
    pub async fn put(
        &self,
        owner: &Caller,
        response: Value,
        conversation: Vec<Value>,
    ) -> Result<(), Unavailable> {
        let id = response["id"].as_str().unwrap_or_default().to_owned();
        let kept = Kept {
            owner: owner.as_str().to_owned(),
            expires_at: now() + self.ttl_seconds,
            response,
            conversation,
        };
        let encoded = serde_json::to_vec(&kept)
            .map_err(|e| Unavailable(format!("encoding a response: {e}")))?;
        match &self.backend {
            Backend::Memory(memory) => {
                let mut memory = memory.lock().unwrap_or_else(|e| e.into_inner());
                memory.insert(id, kept, encoded.len());
                Ok(())
            }
            Backend::Redis(redis) => {
                let (key, ttl) = (redis.key(&["responses", &id]), self.ttl_seconds.max(1));
                redis
                    .run(move |mut c| async move {
                        redis::cmd("SET")
                            .arg(key)
                            .arg(encoded)
                            .arg("EX")
                            .arg(ttl)
                            .query_async(&mut c)
                            .await
                    })
                    .await
            }
        }
    }

    /// `owner`'s kept response `id`, if it is theirs and not expired.
    pub async fn get(&self, owner: &Caller, id: &str) -> Result<Option<Kept>, Unavailable> {
        let kept = match &self.backend {
            Backend::Memory(memory) => {
                let memory = memory.lock().unwrap_or_else(|e| e.into_inner());
                memory.entries.get(id).map(|(kept, _)| kept.clone())
            }
            Backend::Redis(redis) => {
                let key = redis.key(&["responses", id]);
                let encoded: Option<Vec<u8>> = redis
                    .run(move |mut c| async move {
                        redis::cmd("GET").arg(key).query_async(&mut c).await
                    })
                    .await?;
                encoded.and_then(|bytes| serde_json::from_slice(&bytes).ok())
            }
        };
        Ok(kept.filter(|k| k.owner == owner.as_str() && k.expires_at > now()))
    }

    /// Forgets `owner`'s response `id`; whether there was one.
    pub async fn remove(&self, owner: &Caller, id: &str) -> Result<bool, Unavailable> {
        if self.get(owner, id).await?.is_none() {
            return Ok(false);
        }
        match &self.backend {
            Backend::Memory(memory) => {
                let mut memory = memory.lock().unwrap_or_else(|e| e.into_inner());
                Ok(memory.remove(id))
            }
            Backend::Redis(redis) => {
                let key = redis.key(&["responses", id]);
                let deleted: i64 = redis
                    .run(move |mut c| async move {
                        redis::cmd("DEL").arg(key).query_async(&mut c).await
                    })
                    .await?;
                Ok(deleted > 0)
            }
        }
    }
}

impl Memory {
    fn insert(&mut self, id: String, kept: Kept, bytes: usize) {
        self.remove(&id);
        let now = now();
        while !self.order.is_empty()
            && (self.entries.len() >= MAX_KEPT_IN_MEMORY
                || self.bytes + bytes > MAX_BYTES_IN_MEMORY
                || self.oldest_expired(now))
        {
            if let Some(oldest) = self.order.pop_front() {
                self.remove(&oldest);
            }
        }
        self.bytes += bytes;
        self.order.push_back(id.clone());
        self.entries.insert(id, (kept, bytes));
    }

    fn oldest_expired(&self, now: u64) -> bool {
        self.order
            .front()
            .and_then(|id| self.entries.get(id))
            .is_some_and(|(kept, _)| kept.expires_at <= now)
    }

    fn remove(&mut self, id: &str) -> bool {
        match self.entries.remove(id) {
            Some((_, bytes)) => {
                self.bytes -= bytes;
                self.order.retain(|kept| kept != id);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[tokio::test]
    async fn a_kept_response_is_its_owners_alone_until_removed() {
        let store = ResponseStore::in_memory(60);
        let (alice, bob) = (Caller::for_key("a"), Caller::for_key("b"));
        let conversation = vec![json!({"role": "user", "content": "hi"})];
        store
            .put(&alice, json!({"id": "resp_1"}), conversation.clone())
            .await
            .unwrap();
        let kept = store.get(&alice, "resp_1").await.unwrap().unwrap();
        assert_eq!(kept.conversation, conversation);
        assert!(store.get(&bob, "resp_1").await.unwrap().is_none());
        assert!(!store.remove(&bob, "resp_1").await.unwrap());
        assert!(store.remove(&alice, "resp_1").await.unwrap());
        assert!(store.get(&alice, "resp_1").await.unwrap().is_none());
    }

    #[tokio::test]
    async fn expired_responses_are_gone() {
        let store = ResponseStore::in_memory(0);
        let alice = Caller::for_key("a");
        store.put(&alice, json!({"id": "r"}), vec![]).await.unwrap();
        assert!(store.get(&alice, "r").await.unwrap().is_none());
    }
}
