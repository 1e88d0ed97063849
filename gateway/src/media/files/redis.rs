//! Uploads in Redis, where every replica finds them. Per owner, three keys that share one hash tag
//! (so that a Redis Cluster keeps them on one shard and the scripts below may touch them together):
//!
//! - `files:{owner}:<id>`: a hash of the upload's `owner`, `meta` (JSON) and `data`, with a TTL when
//!   uploads expire;
//! - `files:{owner}`: a sorted set of the owner's ids, scored by when each expires (`+inf`: never);
//! - `files:{owner}:sizes`: a hash of id → bytes, what the quota counts.
//!
//! An upload and its quota change in one script, so that concurrent uploads through several replicas
//! cannot overrun a key's quota together.

use std::sync::{Arc, LazyLock};

use bytes::Bytes;
use redis::Script;

use super::{FileMeta, FilesConfig, FilesError, StoredFile};
use crate::store::{Caller, Redis, Unavailable};

/// KEYS: the file, the owner's set, the owner's sizes. ARGV: now, expires-at score, size, the
/// owner's byte and file limits, id, owner, meta, data, TTL in seconds (0: none).
/// Returns 1 when stored, 0 when over the owner's quota.
static INSERT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
        local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[1])
        for _, id in ipairs(expired) do redis.call('HDEL', KEYS[3], id) end
        redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[1])
        local used = 0
        for _, v in ipairs(redis.call('HVALS', KEYS[3])) do used = used + tonumber(v) end
        if used + tonumber(ARGV[3]) > tonumber(ARGV[4])
            or redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[5]) then
            return 0
        end
        redis.call('HSET', KEYS[1], 'owner', ARGV[7], 'meta', ARGV[8], 'data', ARGV[9])
        if tonumber(ARGV[10]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[10]) end
        redis.call('ZADD', KEYS[2], ARGV[2], ARGV[6])
        redis.call('HSET', KEYS[3], ARGV[6], ARGV[3])
        return 1
        ",
    )
});

/// KEYS: the file, the owner's set, the owner's sizes. ARGV: owner, id. Returns 1 when deleted.
static DELETE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
        if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
        redis.call('DEL', KEYS[1])
        redis.call('ZREM', KEYS[2], ARGV[2])
        redis.call('HDEL', KEYS[3], ARGV[2])
        return 1
        ",
    )
});

pub struct RedisFiles {
    config: FilesConfig,
    redis: Arc<Redis>,
}

struct Keys {
    file: String,
    set: String,
    sizes: String,
}

impl RedisFiles {
    pub fn new(config: FilesConfig, redis: Arc<Redis>) -> RedisFiles {
        RedisFiles { config, redis }
    }

    fn keys(&self, owner: &Caller, id: &str) -> Keys {
        let tag = format!("{{{}}}", owner.as_str());
        Keys {
            file: self.redis.key(&["files", &tag, id]),
            set: self.redis.key(&["files", &tag]),
            sizes: self.redis.key(&["files", &tag, "sizes"]),
        }
    }

    pub async fn insert(
        &self,
        owner: &Caller,
        meta: FileMeta,
        data: Bytes,
        now: u64,
    ) -> Result<FileMeta, FilesError> {
        let keys = self.keys(owner, &meta.id);
        let encoded = serde_json::to_string(&meta)
            .map_err(|e| Unavailable(format!("encoding a file's metadata: {e}")))?;
        let expires = meta
            .expires_at
            .map_or_else(|| "+inf".to_owned(), |t| t.to_string());
        let ttl = self.config.expire_after_seconds.unwrap_or(0);
        let (max_bytes, max_files) = (self.config.per_key_bytes(), self.config.per_key_files());
        let (id, owner) = (meta.id.clone(), owner.as_str().to_owned());
        let stored: i64 = self
            .redis
            .run(move |mut c| async move {
                INSERT
                    .key(keys.file)
                    .key(keys.set)
                    .key(keys.sizes)
                    .arg(now)
                    .arg(expires)
                    .arg(data.len())
                    .arg(max_bytes)
                    .arg(max_files)
                    .arg(id)
                    .arg(owner)
                    .arg(encoded)
                    .arg(&data[..])
                    .arg(ttl)
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        if stored == 1 {
            Ok(meta)
        } else {
            Err(FilesError::QuotaExceeded {
                limit: max_bytes,
                files: max_files,
            })
        }
    }

    pub async fn get(
        &self,
        owner: &Caller,
        id: &str,
        now: u64,
    ) -> Result<Option<StoredFile>, Unavailable> {
        let key = self.keys(owner, id).file;
        let (stored_owner, meta, data): (Option<String>, Option<String>, Option<Vec<u8>>) = self
            .redis
            .run(move |mut c| async move {
                redis::cmd("HMGET")
                    .arg(key)
                    .arg("owner")
                    .arg("meta")
                    .arg("data")
                    .query_async(&mut c)
                    .await
            })
            .await?;
        let (Some(stored_owner), Some(meta), Some(data)) = (stored_owner, meta, data) else {
            return Ok(None);
        };
        let Ok(meta) = serde_json::from_str::<FileMeta>(&meta) else {
            tracing::warn!(id, "an upload in the store has unreadable metadata");
            return Ok(None);
        };
        if stored_owner != owner.as_str() || meta.expires_at.is_some_and(|t| t <= now) {
            return Ok(None);
        }
        Ok(Some(StoredFile {
            meta,
            data: Bytes::from(data),
        }))
    }

    pub async fn list(&self, owner: &Caller, now: u64) -> Result<Vec<FileMeta>, Unavailable> {
        let set = self.keys(owner, "").set;
        let ids: Vec<String> = self
            .redis
            .run(move |mut c| async move {
                redis::cmd("ZRANGEBYSCORE")
                    .arg(set)
                    .arg(format!("({now}"))
                    .arg("+inf")
                    .query_async(&mut c)
                    .await
            })
            .await?;
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        for id in &ids {
            pipe.cmd("HGET").arg(self.keys(owner, id).file).arg("meta");
        }
        let metas: Vec<Option<String>> = self
            .redis
            .run(move |mut c| async move { pipe.query_async(&mut c).await })
            .await?;
        let mut metas: Vec<FileMeta> = metas
            .into_iter()
            .flatten()
            .filter_map(|m| serde_json::from_str(&m).ok())
            .collect();
        metas.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
        Ok(metas)
    }

    pub async fn remove(&self, owner: &Caller, id: &str) -> Result<bool, Unavailable> {
        let keys = self.keys(owner, id);
        let (owner, id) = (owner.as_str().to_owned(), id.to_owned());
        let deleted: i64 = self
            .redis
            .run(move |mut c| async move {
                DELETE
                    .key(keys.file)
                    .key(keys.set)
                    .key(keys.sizes)
                    .arg(owner)
                    .arg(id)
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        Ok(deleted == 1)
    }
}
