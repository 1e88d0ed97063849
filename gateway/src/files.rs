//! `/v1/files`: uploads kept in memory under a byte budget, so a chat request can refer to media
//! by `file_id` instead of carrying it. Nothing is written to disk; a restart forgets them.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use serde::Deserialize;
use serde_json::{Value, json};

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FilesConfig {
    /// All uploads together.
    pub max_total_bytes: usize,
    /// One upload.
    pub max_file_bytes: usize,
    pub max_files: usize,
}

impl Default for FilesConfig {
    fn default() -> Self {
        FilesConfig {
            max_total_bytes: 1 << 30,
            max_file_bytes: 64 << 20,
            max_files: 1000,
        }
    }
}

#[derive(Debug)]
pub struct StoredFile {
    pub id: String,
    pub filename: String,
    pub purpose: String,
    pub mime_type: Option<String>,
    pub created_at: u64,
    pub data: Bytes,
}

impl StoredFile {
    /// OpenAI's file object.
    pub fn json(&self) -> Value {
        json!({
            "id": self.id,
            "object": "file",
            "bytes": self.data.len(),
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the file is {size} bytes; one upload may be at most {limit}")]
    FileTooLarge { size: usize, limit: usize },
    #[error("the file store is full ({limit} bytes or {files} files); delete files first")]
    Full { limit: usize, files: usize },
}

pub struct FileStore {
    config: FilesConfig,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    files: BTreeMap<String, Arc<StoredFile>>,
    bytes: usize,
    next_id: u64,
}

impl FileStore {
    pub fn new(config: FilesConfig) -> FileStore {
        FileStore {
            config,
            inner: Mutex::new(Inner::default()),
        }
    }

    pub fn max_file_bytes(&self) -> usize {
        self.config.max_file_bytes
    }

    pub fn insert(
        &self,
        filename: String,
        purpose: String,
        mime_type: Option<String>,
        data: Bytes,
    ) -> Result<Arc<StoredFile>, StoreError> {
        let size = data.len();
        if size > self.config.max_file_bytes {
            return Err(StoreError::FileTooLarge {
                size,
                limit: self.config.max_file_bytes,
            });
        }
        let mut inner = self.lock();
        if inner.bytes + size > self.config.max_total_bytes
            || inner.files.len() >= self.config.max_files
        {
            return Err(StoreError::Full {
                limit: self.config.max_total_bytes,
                files: self.config.max_files,
            });
        }
        inner.next_id += 1;
        // Unique within this process; the clock part keeps ids from one run out of the next.
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let file = Arc::new(StoredFile {
            id: format!("file-{:x}{:06x}", nanos & 0xffff_ffff_ffff, inner.next_id),
            filename,
            purpose,
            mime_type,
            created_at: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            data,
        });
        inner.bytes += size;
        inner.files.insert(file.id.clone(), file.clone());
        Ok(file)
    }

    pub fn get(&self, id: &str) -> Option<Arc<StoredFile>> {
        self.lock().files.get(id).cloned()
    }

    pub fn list(&self) -> Vec<Arc<StoredFile>> {
        self.lock().files.values().cloned().collect()
    }

    /// Whether the file existed. Requests already holding it keep their copy.
    pub fn remove(&self, id: &str) -> bool {
        let mut inner = self.lock();
        match inner.files.remove(id) {
            Some(file) => {
                inner.bytes -= file.data.len();
                true
            }
            None => false,
        }
    }

    /// Bytes held by all uploads.
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave the map half-updated: recover it.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uploads_are_bounded_and_their_bytes_return_on_delete() {
        let store = FileStore::new(FilesConfig {
            max_total_bytes: 10,
            max_file_bytes: 6,
            max_files: 10,
        });
        let add =
            |n: usize| store.insert("f".into(), "vision".into(), None, Bytes::from(vec![0; n]));
        assert!(matches!(add(7), Err(StoreError::FileTooLarge { .. })));
        let a = add(6).unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(add(5), Err(StoreError::Full { .. })));
        assert_eq!(store.bytes(), 6);
        assert!(store.remove(&a.id));
        assert!(!store.remove(&a.id));
        assert_eq!(store.bytes(), 0);
        assert!(add(5).is_ok());
    }
}
