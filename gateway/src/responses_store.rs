//! Responses kept for `previous_response_id` and `GET /v1/responses/{id}` (the Responses API's
//! `store`): each with the conversation it ended, which a follow-up turn continues. In this
//! process, or in Redis so that every replica finds them; each caller sees only its own, and
//! each is forgotten after the configured time.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::store::{Caller, Redis, Unavailable};

/// Most responses one process keeps (the oldest go first): a bound on memory without Redis.
const MAX_KEPT_IN_MEMORY: usize = 10_000;
/// Most bytes of kept responses one process holds (their conversations carry media).
const MAX_BYTES_IN_MEMORY: usize = 512 << 20;
/// What one kept response costs besides its bytes: its map entries, id and bookkeeping.
const BYTES_PER_ENTRY: usize = 256;

/// A kept response, as [`ResponseStore::get`] gives it.
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

/// The conversation a response ends, to keep: its messages, of which the first `earlier` are
/// those of the kept response `previous` (the one this turn followed), when there is one.
pub struct Conversation<'a> {
    pub previous: Option<&'a str>,
    pub earlier: usize,
    pub messages: Vec<Value>,
}

pub struct ResponseStore {
    ttl_seconds: u64,
    backend: Backend,
}

enum Backend {
    Memory(Mutex<Memory>),
    /// Each response with its whole conversation, under Redis's own memory bound and the TTL.
    Redis(Arc<Redis>),
}

/// Kept responses held as the JSON they are encoded to (a parsed conversation holds many times
/// its bytes), each conversation a chain of turns that follow-ups share: a follow-up keeps only
/// its own turn. What is held is counted in bytes actually held: a turn still shared by a later
/// response stays held (and counted) after the response it came with is gone.
#[derive(Default)]
struct Memory {
    entries: HashMap<String, Entry>,
    /// Ids in the order they were kept, for evicting the oldest.
    order: VecDeque<String>,
    held: Arc<AtomicUsize>,
}

struct Entry {
    owner: String,
    expires_at: u64,
    /// The response object, encoded.
    response: Box<[u8]>,
    turns: Arc<Turns>,
}

/// One turn's messages (a JSON array, encoded) and the turns before it.
struct Turns {
    messages: Box<[u8]>,
    earlier: Option<Arc<Turns>>,
    held: Arc<AtomicUsize>,
}

impl Turns {
    fn new(messages: Box<[u8]>, earlier: Option<Arc<Turns>>, held: &Arc<AtomicUsize>) -> Turns {
        held.fetch_add(messages.len(), Ordering::Relaxed);
        Turns {
            messages,
            earlier,
            held: held.clone(),
        }
    }

    /// The conversation's messages, oldest first.
    fn decode(self: &Arc<Turns>) -> Option<Vec<Value>> {
        let mut chain = Vec::new();
        let mut turn = Some(self);
        while let Some(t) = turn {
            chain.push(t);
            turn = t.earlier.as_ref();
        }
        let mut messages = Vec::new();
        for turn in chain.into_iter().rev() {
            messages.extend(serde_json::from_slice::<Vec<Value>>(&turn.messages).ok()?);
        }
        Some(messages)
    }
}

impl Drop for Turns {
    /// Uncounts this turn and, without recursing (a conversation may have thousands of turns),
    /// every earlier one that no other response shares.
    fn drop(&mut self) {
        self.held.fetch_sub(self.messages.len(), Ordering::Relaxed);
        let mut earlier = self.earlier.take();
        while let Some(turn) = earlier {
            match Arc::try_unwrap(turn) {
                // Dropped at the end of this arm with nothing after it: it only uncounts itself.
                Ok(mut turn) => earlier = turn.earlier.take(),
                Err(_) => break,
            }
        }
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn encoding_error(e: serde_json::Error) -> Unavailable {
    Unavailable(format!("encoding a response: {e}"))
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
        conversation: Conversation<'_>,
    ) -> Result<(), Unavailable> {
        let id = response["id"].as_str().unwrap_or_default().to_owned();
        let expires_at = now() + self.ttl_seconds;
        match &self.backend {
            Backend::Memory(memory) => {
                let response = serde_json::to_vec(&response).map_err(encoding_error)?;
                let mut memory = memory.lock().unwrap_or_else(|e| e.into_inner());
                // The earlier turns are shared when the response followed is still here (and the
                // caller's); else the whole conversation is this turn.
                let shared = conversation
                    .previous
                    .filter(|_| conversation.earlier > 0)
                    .and_then(|previous| memory.entries.get(previous))
                    .filter(|entry| entry.owner == owner.as_str())
                    .map(|entry| entry.turns.clone())
                    .zip(conversation.messages.get(conversation.earlier..));
                let (earlier, new) = match shared {
                    Some((turns, new)) => (Some(turns), new),
                    None => (None, conversation.messages.as_slice()),
                };
                let messages = serde_json::to_vec(new).map_err(encoding_error)?;
                let turns = Arc::new(Turns::new(messages.into(), earlier, &memory.held));
                let entry = Entry {
                    owner: owner.as_str().to_owned(),
                    expires_at,
                    response: response.into(),
                    turns,
                };
                memory.insert(id, entry);
                Ok(())
            }
            Backend::Redis(redis) => {
                let kept = Kept {
                    owner: owner.as_str().to_owned(),
                    expires_at,
                    response,
                    conversation: conversation.messages,
                };
                let encoded = serde_json::to_vec(&kept).map_err(encoding_error)?;
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
                let found = {
                    let memory = memory.lock().unwrap_or_else(|e| e.into_inner());
                    memory.entries.get(id).map(|entry| {
                        let expired = entry.expires_at <= now();
                        let owned = entry.owner == owner.as_str();
                        (owned && !expired).then(|| {
                            (
                                entry.owner.clone(),
                                entry.expires_at,
                                entry.response.clone(),
                                entry.turns.clone(),
                            )
                        })
                    })
                };
                // Decoded outside the lock: other requests keep and find theirs meanwhile.
                found
                    .flatten()
                    .and_then(|(owner, expires_at, response, turns)| {
                        Some(Kept {
                            owner,
                            expires_at,
                            response: serde_json::from_slice(&response).ok()?,
                            conversation: turns.decode()?,
                        })
                    })
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
        match &self.backend {
            Backend::Memory(memory) => {
                let mut memory = memory.lock().unwrap_or_else(|e| e.into_inner());
                let theirs = memory
                    .entries
                    .get(id)
                    .is_some_and(|e| e.owner == owner.as_str() && e.expires_at > now());
                Ok(theirs && memory.remove(id))
            }
            Backend::Redis(redis) => {
                if self.get(owner, id).await?.is_none() {
                    return Ok(false);
                }
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

    /// Bytes the kept responses hold in this process (0 with Redis).
    #[cfg(test)]
    fn held_bytes(&self) -> usize {
        match &self.backend {
            Backend::Memory(memory) => {
                let memory = memory.lock().unwrap_or_else(|e| e.into_inner());
                memory.held.load(Ordering::Relaxed)
            }
            Backend::Redis(_) => 0,
        }
    }
}

impl Memory {
    fn insert(&mut self, id: String, entry: Entry) {
        self.remove(&id);
        let bytes = entry.response.len() + BYTES_PER_ENTRY;
        self.held.fetch_add(bytes, Ordering::Relaxed);
        self.entries.insert(id.clone(), entry);
        self.order.push_back(id);
        let now = now();
        // The newest stays whatever it costs (it was counted against the request limits).
        while self.order.len() > 1
            && (self.entries.len() > MAX_KEPT_IN_MEMORY
                || self.held.load(Ordering::Relaxed) > MAX_BYTES_IN_MEMORY
                || self.oldest_expired(now))
        {
            if let Some(oldest) = self.order.pop_front() {
                self.remove(&oldest);
            }
        }
    }

    fn oldest_expired(&self, now: u64) -> bool {
        self.order
            .front()
            .and_then(|id| self.entries.get(id))
            .is_some_and(|entry| entry.expires_at <= now)
    }

    fn remove(&mut self, id: &str) -> bool {
        match self.entries.remove(id) {
            Some(entry) => {
                self.held
                    .fetch_sub(entry.response.len() + BYTES_PER_ENTRY, Ordering::Relaxed);
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

    fn first(messages: Vec<Value>) -> Conversation<'static> {
        Conversation {
            previous: None,
            earlier: 0,
            messages,
        }
    }

    #[tokio::test]
    async fn follow_ups_share_their_earlier_turns_and_keep_them_when_those_go() {
        let store = ResponseStore::in_memory(60);
        let alice = Caller::for_key("a");
        let big = "x".repeat(100_000);
        let mut messages = vec![json!({"role": "user", "content": big})];
        store
            .put(&alice, json!({"id": "r0"}), first(messages.clone()))
            .await
            .unwrap();
        let root = store.held_bytes();
        for turn in 1..=10 {
            let earlier = messages.len();
            messages.push(json!({"role": "assistant", "content": format!("a{turn}")}));
            messages.push(json!({"role": "user", "content": format!("q{turn}")}));
            let previous = format!("r{}", turn - 1);
            let conversation = Conversation {
                previous: Some(&previous),
                earlier,
                messages: messages.clone(),
            };
            store
                .put(&alice, json!({"id": format!("r{turn}")}), conversation)
                .await
                .unwrap();
        }
        // Ten follow-ups of a 100 kB root hold far less than ten copies of it.
        assert!(
            store.held_bytes() < root + 10 * 1_000,
            "{}",
            store.held_bytes()
        );
        let kept = store.get(&alice, "r10").await.unwrap().unwrap();
        assert_eq!(kept.conversation, messages);
        // The root's turn outlives the root's own entry while a follow-up shares it.
        for turn in 0..10 {
            assert!(store.remove(&alice, &format!("r{turn}")).await.unwrap());
        }
        assert!(store.held_bytes() > 100_000);
        let kept = store.get(&alice, "r10").await.unwrap().unwrap();
        assert_eq!(kept.conversation, messages);
        assert!(store.remove(&alice, "r10").await.unwrap());
        assert_eq!(store.held_bytes(), 0);
    }

    #[test]
    fn a_long_chain_of_turns_is_dropped_without_recursing() {
        let held = Arc::new(AtomicUsize::new(0));
        let mut turns = Arc::new(Turns::new(Box::new(*b"[]"), None, &held));
        for _ in 0..200_000 {
            turns = Arc::new(Turns::new(Box::new(*b"[]"), Some(turns), &held));
        }
        assert_eq!(held.load(Ordering::Relaxed), 2 * 200_001);
        drop(turns);
        assert_eq!(held.load(Ordering::Relaxed), 0);
    }

    #[tokio::test]
    async fn a_kept_response_is_its_owners_alone_until_removed() {
        let store = ResponseStore::in_memory(60);
        let (alice, bob) = (Caller::for_key("a"), Caller::for_key("b"));
        let conversation = vec![json!({"role": "user", "content": "hi"})];
        store
            .put(&alice, json!({"id": "resp_1"}), first(conversation.clone()))
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
        store
            .put(&alice, json!({"id": "r"}), first(vec![]))
            .await
            .unwrap();
        assert!(store.get(&alice, "r").await.unwrap().is_none());
    }
}
