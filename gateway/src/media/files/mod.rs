//! `/v1/files`: uploads, so that a chat request can refer to media by `file_id` instead of carrying
//! them. Each upload belongs to the API key that made it (its [`Caller`]): other keys neither see
//! nor use it. Kept in this process ([`memory`]) or in the shared store ([`redis`]), under byte and
//! count limits per key (and in all, in memory), and forgotten after `expire_after_seconds` if set.

mod memory;
mod redis;

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::store::{Caller, Redis, Unavailable};

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FilesConfig {
    /// All uploads together (in memory; with a Redis store its own `maxmemory` bounds the total).
    pub max_total_bytes: usize,
    /// One upload.
    pub max_file_bytes: usize,
    /// All uploads together (in memory).
    pub max_files: usize,
    /// The uploads of one API key together (default: `max_total_bytes`).
    pub max_bytes_per_key: Option<usize>,
    /// The uploads of one API key (default: `max_files`).
    pub max_files_per_key: Option<usize>,
    /// Uploads are forgotten this long after they were made (default: kept until deleted).
    pub expire_after_seconds: Option<u64>,
}

impl Default for FilesConfig {
    fn default() -> Self {
        FilesConfig {
            max_total_bytes: 1 << 30,
            max_file_bytes: 64 << 20,
            max_files: 1000,
            max_bytes_per_key: None,
            max_files_per_key: None,
            expire_after_seconds: None,
        }
    }
}

impl FilesConfig {
    fn per_key_bytes(&self) -> usize {
        self.max_bytes_per_key.unwrap_or(self.max_total_bytes)
    }

    fn per_key_files(&self) -> usize {
        self.max_files_per_key.unwrap_or(self.max_files)
    }
}

/// What is known of an upload besides its bytes: OpenAI's file object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileMeta {
    pub id: String,
    pub filename: String,
    pub purpose: String,
    pub mime_type: Option<String>,
    pub created_at: u64,
    pub bytes: usize,
    pub expires_at: Option<u64>,
}

impl FileMeta {
    pub fn json(&self) -> Value {
        json!({
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "filename": self.filename,
            "purpose": self.purpose,
        })
    }
}

#[derive(Debug, Clone)]
pub struct StoredFile {
    pub meta: FileMeta,
    pub data: Bytes,
}

#[derive(Debug, thiserror::Error)]
pub enum FilesError {
    #[error("the file is {size} bytes; one upload may be at most {limit}")]
    FileTooLarge { size: usize, limit: usize },
    #[error("the file store is full ({limit} bytes or {files} files); delete files first")]
    Full { limit: usize, files: usize },
    #[error(
        "this API key's uploads would exceed their quota ({limit} bytes or {files} files); \
         delete files first"
    )]
    QuotaExceeded { limit: usize, files: usize },
    #[error(transparent)]
    Unavailable(#[from] Unavailable),
}

/// A new upload, before it is stored.
pub struct NewFile {
    pub filename: String,
    pub purpose: String,
    pub mime_type: Option<String>,
    pub data: Bytes,
}

pub struct FileStore {
    config: FilesConfig,
    backend: Backend,
}

enum Backend {
    Memory(memory::MemoryFiles),
    Redis(redis::RedisFiles),
}

impl FileStore {
    /// Uploads kept in this process.
    pub fn in_memory(config: FilesConfig) -> FileStore {
        FileStore {
            backend: Backend::Memory(memory::MemoryFiles::new(config.clone())),
            config,
        }
    }

    /// Uploads kept in the shared store.
    pub fn in_redis(config: FilesConfig, redis: Arc<Redis>) -> FileStore {
        FileStore {
            backend: Backend::Redis(redis::RedisFiles::new(config.clone(), redis)),
            config,
        }
    }

    pub fn max_file_bytes(&self) -> usize {
        self.config.max_file_bytes
    }

    pub async fn insert(&self, owner: &Caller, file: NewFile) -> Result<FileMeta, FilesError> {
        let size = file.data.len();
        if size > self.config.max_file_bytes {
            return Err(FilesError::FileTooLarge {
                size,
                limit: self.config.max_file_bytes,
            });
        }
        let now = unix_now();
        let meta = FileMeta {
            id: new_id(),
            filename: file.filename,
            purpose: file.purpose,
            mime_type: file.mime_type,
            created_at: now,
            bytes: size,
            expires_at: self.config.expire_after_seconds.map(|s| now + s),
        };
        match &self.backend {
            Backend::Memory(m) => m.insert(owner, meta, file.data, now),
            Backend::Redis(r) => r.insert(owner, meta, file.data, now).await,
        }
    }

    /// `owner`'s upload `id`, unless it has expired.
    pub async fn get(&self, owner: &Caller, id: &str) -> Result<Option<StoredFile>, Unavailable> {
        match &self.backend {
            Backend::Memory(m) => Ok(m.get(owner, id, unix_now())),
            Backend::Redis(r) => r.get(owner, id, unix_now()).await,
        }
    }

    /// `owner`'s uploads, oldest first.
    pub async fn list(&self, owner: &Caller) -> Result<Vec<FileMeta>, Unavailable> {
        match &self.backend {
            Backend::Memory(m) => Ok(m.list(owner, unix_now())),
            Backend::Redis(r) => r.list(owner, unix_now()).await,
        }
    }

    /// Whether `owner` had the upload. Requests already holding it keep their copy.
    pub async fn remove(&self, owner: &Caller, id: &str) -> Result<bool, Unavailable> {
        match &self.backend {
            Backend::Memory(m) => Ok(m.remove(owner, id)),
            Backend::Redis(r) => r.remove(owner, id).await,
        }
    }

    /// Bytes this process holds for uploads (none when they live in the shared store).
    pub fn local_bytes(&self) -> usize {
        match &self.backend {
            Backend::Memory(m) => m.bytes(),
            Backend::Redis(_) => 0,
        }
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// 96 random bits: unique across replicas without coordination.
fn new_id() -> String {
    format!("file-{:024x}", rand::random::<u128>() >> 32)
}
