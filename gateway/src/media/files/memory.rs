//! Uploads in this process's memory: a restart forgets them, other replicas never see them.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, MutexGuard};

use bytes::Bytes;

use super::{FileMeta, FilesConfig, FilesError, StoredFile};
use crate::store::Caller;

pub struct MemoryFiles {
    config: FilesConfig,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// By id; ids are random, so the owner is kept with each file and checked on every access.
    files: BTreeMap<String, (Caller, StoredFile)>,
    bytes: usize,
    /// Bytes and files per owner.
    owners: HashMap<Caller, (usize, usize)>,
}

impl Inner {
    fn take(&mut self, id: &str) -> Option<(Caller, StoredFile)> {
        let (owner, file) = self.files.remove(id)?;
        self.bytes -= file.data.len();
        if let Some(used) = self.owners.get_mut(&owner) {
            used.0 -= file.data.len();
            used.1 -= 1;
            if used.1 == 0 {
                self.owners.remove(&owner);
            }
        }
        Some((owner, file))
    }

    /// Forgets what has expired by `now`.
    fn expire(&mut self, now: u64) {
        let expired: Vec<String> = self
            .files
            .iter()
            .filter(|(_, (_, f))| f.meta.expires_at.is_some_and(|t| t <= now))
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            self.take(&id);
        }
    }
}

impl MemoryFiles {
    pub fn new(config: FilesConfig) -> MemoryFiles {
        MemoryFiles {
            config,
            inner: Mutex::new(Inner::default()),
        }
    }

    pub fn insert(
        &self,
        owner: &Caller,
        meta: FileMeta,
        data: Bytes,
        now: u64,
    ) -> Result<FileMeta, FilesError> {
        let size = data.len();
        let mut inner = self.lock();
        inner.expire(now);
        if inner.bytes + size > self.config.max_total_bytes
            || inner.files.len() >= self.config.max_files
        {
            return Err(FilesError::Full {
                limit: self.config.max_total_bytes,
                files: self.config.max_files,
            });
        }
        let (bytes, files) = inner.owners.get(owner).copied().unwrap_or_default();
        if bytes + size > self.config.per_key_bytes() || files >= self.config.per_key_files() {
            return Err(FilesError::QuotaExceeded {
                limit: self.config.per_key_bytes(),
                files: self.config.per_key_files(),
            });
        }
        inner.bytes += size;
        let used = inner.owners.entry(owner.clone()).or_default();
        used.0 += size;
        used.1 += 1;
        let file = StoredFile {
            meta: meta.clone(),
            data,
        };
        inner.files.insert(meta.id.clone(), (owner.clone(), file));
        Ok(meta)
    }

    pub fn get(&self, owner: &Caller, id: &str, now: u64) -> Option<StoredFile> {
        let mut inner = self.lock();
        inner.expire(now);
        match inner.files.get(id) {
            Some((o, file)) if o == owner => Some(file.clone()),
            _ => None,
        }
    }

    pub fn list(&self, owner: &Caller, now: u64) -> Vec<FileMeta> {
        let mut inner = self.lock();
        inner.expire(now);
        let mut metas: Vec<FileMeta> = inner
            .files
            .values()
            .filter(|(o, _)| o == owner)
            .map(|(_, f)| f.meta.clone())
            .collect();
        metas.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
        metas
    }

    pub fn remove(&self, owner: &Caller, id: &str) -> bool {
        let mut inner = self.lock();
        if inner.files.get(id).is_some_and(|(o, _)| o == owner) {
            inner.take(id);
            true
        } else {
            false
        }
    }

    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Each update completes before the lock is released, so a poisoned lock is consistent.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(id: &str, bytes: usize, expires_at: Option<u64>) -> FileMeta {
        FileMeta {
            id: id.into(),
            filename: "f".into(),
            purpose: "vision".into(),
            mime_type: None,
            created_at: 0,
            bytes,
            expires_at,
        }
    }

    fn store(total: usize, per_key: usize) -> MemoryFiles {
        MemoryFiles::new(FilesConfig {
            max_total_bytes: total,
            max_file_bytes: total,
            max_files: 10,
            max_bytes_per_key: Some(per_key),
            ..FilesConfig::default()
        })
    }

    fn add(s: &MemoryFiles, owner: &Caller, id: &str, n: usize) -> Result<FileMeta, FilesError> {
        s.insert(owner, meta(id, n, None), Bytes::from(vec![0; n]), 0)
    }

    #[test]
    fn uploads_are_bounded_in_all_and_per_key_and_their_bytes_return_on_delete() {
        let s = store(10, 6);
        let (a, b) = (Caller::for_key("a"), Caller::for_key("b"));
        assert!(add(&s, &a, "1", 6).is_ok());
        assert!(matches!(
            add(&s, &a, "2", 1),
            Err(FilesError::QuotaExceeded { .. })
        ));
        assert!(matches!(add(&s, &b, "3", 5), Err(FilesError::Full { .. })));
        assert!(add(&s, &b, "3", 4).is_ok());
        assert_eq!(s.bytes(), 10);
        // Another key's upload is invisible to it, and not its to delete.
        assert!(s.get(&b, "1", 0).is_none());
        assert!(!s.remove(&b, "1"));
        assert!(s.remove(&a, "1"));
        assert!(!s.remove(&a, "1"));
        assert_eq!(s.bytes(), 4);
        assert!(add(&s, &a, "4", 6).is_ok());
    }

    #[test]
    fn expired_uploads_are_gone_and_free_their_bytes() {
        let s = store(10, 10);
        let a = Caller::public();
        let stored = s.insert(&a, meta("1", 8, Some(100)), Bytes::from(vec![0; 8]), 0);
        assert!(stored.is_ok());
        assert!(s.get(&a, "1", 99).is_some());
        assert!(s.get(&a, "1", 100).is_none());
        assert_eq!(s.bytes(), 0);
        assert!(s.list(&a, 100).is_empty());
    }
}
