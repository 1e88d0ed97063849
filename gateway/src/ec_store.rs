//! The store of encoder outputs an unmodified vLLM reads through its EC connector
//! (`ECExampleConnector` as an `ec_consumer`, its `shared_storage_path` this directory): one folder
//! per item, named by the identifier the request sends as the part's `uuid`, holding
//! `encoder_cache.safetensors`.
//!
//! Identifiers are content addresses, so a file once written is never rewritten with other bytes:
//! replicas sharing the directory may write the same item at once. A file appears whole or not at
//! all (written beside it, then renamed). The store is bounded in bytes: an item a request in flight
//! needs is pinned, the rest are evicted least recently used first. Pins are shared `flock`s on the
//! file, and eviction takes an exclusive one without waiting: a file another process pinned (a
//! replica sharing the directory) is never removed under it.

use std::collections::HashSet;
use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File, TryLockError};
use std::io::{self, ErrorKind, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// The file vLLM's `ECExampleConnector` reads in an item's folder.
pub const FILE_NAME: &str = "encoder_cache.safetensors";

/// What a file of an item still being written is called (beside [`FILE_NAME`]).
const WRITING_SUFFIX: &str = ".writing";

#[derive(Debug, thiserror::Error)]
pub enum EcStoreError {
    /// Every byte the bound allows is held by items of requests in flight.
    #[error(
        "the EC store is full: an item of {needed} bytes does not fit beside {pinned} bytes of \
         items that requests in flight need (ec_storage_bytes = {bound})"
    )]
    Full {
        needed: u64,
        pinned: u64,
        bound: u64,
    },
    /// The directory refused a write (permissions, a full or read-only disk).
    #[error("the EC store {dir} cannot be written: {source}")]
    Unwritable { dir: PathBuf, source: io::Error },
}

impl EcStoreError {
    /// Whether the store had no room (the bound, or the disk), rather than refused writes.
    pub fn is_full(&self) -> bool {
        match self {
            Self::Full { .. } => true,
            Self::Unwritable { source, .. } => {
                matches!(
                    source.kind(),
                    ErrorKind::StorageFull | ErrorKind::QuotaExceeded
                )
            }
        }
    }
}

pub struct EcStore {
    dir: PathBuf,
    bound: u64,
    index: Mutex<Index>,
    /// Signalled whenever a write ends: a write of an item another one is writing waits for it.
    write_ended: Condvar,
}

/// What this process knows of the directory: the items it wrote, used or found at start.
#[derive(Default)]
struct Index {
    items: HashMap<String, Item>,
    /// Unpinned items by when they were last used (the eviction order).
    idle: BTreeMap<u64, String>,
    clock: u64,
    bytes: u64,
    /// Items this process is writing now.
    writing: HashSet<String>,
}

struct Item {
    bytes: u64,
    pins: usize,
    last_used: u64,
}

/// An item a request needs: its file stays until every pin on it is dropped.
pub struct Pin {
    store: Arc<EcStore>,
    id: String,
    /// Holds the shared lock that keeps other processes from evicting the file.
    _file: File,
}

impl Pin {
    pub fn id(&self) -> &str {
        &self.id
    }
}

impl Drop for Pin {
    fn drop(&mut self) {
        self.store.lock().unpin(&self.id);
    }
}

impl Index {
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn pin(&mut self, id: &str, bytes: u64) {
        let now = self.tick();
        match self.items.get_mut(id) {
            Some(item) => {
                if item.pins == 0 {
                    self.idle.remove(&item.last_used);
                }
                item.pins += 1;
                item.last_used = now;
            }
            None => {
                self.bytes += bytes;
                self.items.insert(
                    id.to_owned(),
                    Item {
                        bytes,
                        pins: 1,
                        last_used: now,
                    },
                );
            }
        }
    }

    fn unpin(&mut self, id: &str) {
        let now = self.tick();
        if let Some(item) = self.items.get_mut(id) {
            item.pins = item.pins.saturating_sub(1);
            item.last_used = now;
            if item.pins == 0 {
                self.idle.insert(now, id.to_owned());
            }
        }
    }

    fn forget(&mut self, id: &str) {
        if let Some(item) = self.items.remove(id) {
            self.bytes -= item.bytes;
            if item.pins == 0 {
                self.idle.remove(&item.last_used);
            }
        }
    }

    fn pinned_bytes(&self) -> u64 {
        self.items
            .values()
            .filter(|i| i.pins > 0)
            .map(|i| i.bytes)
            .sum()
    }
}

impl EcStore {
    /// The store in `dir` (made if missing), bounded to `bound` bytes. What an earlier run left
    /// is taken in, oldest first in the eviction order; files half-written by a process that is
    /// gone, and the empty folders vLLM makes when it looks for an item, are removed.
    pub fn open(dir: &Path, bound: u64) -> Result<Arc<EcStore>, EcStoreError> {
        let unwritable = |source| EcStoreError::Unwritable {
            dir: dir.to_owned(),
            source,
        };
        fs::create_dir_all(dir).map_err(unwritable)?;
        let mut found = Vec::new();
        for entry in fs::read_dir(dir).map_err(unwritable)? {
            let entry = entry.map_err(unwritable)?;
            let name = entry.file_name();
            let Some(id) = name.to_str().filter(|n| is_identifier(n)) else {
                continue;
            };
            let folder = entry.path();
            remove_abandoned_writes(&folder);
            match fs::metadata(folder.join(FILE_NAME)) {
                Ok(meta) => found.push((meta.mtime(), id.to_owned(), meta.len())),
                // Left empty: vLLM looked for an item that was not there.
                Err(_) => {
                    let _ = fs::remove_dir(&folder);
                }
            }
        }
        found.sort();
        let store = Arc::new(EcStore {
            dir: dir.to_owned(),
            bound,
            index: Mutex::new(Index::default()),
            write_ended: Condvar::new(),
        });
        {
            let mut index = store.lock();
            for (_, id, bytes) in found {
                index.pin(&id, bytes);
                index.unpin(&id);
            }
            store.evict(&mut index, 0);
        }
        Ok(store)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Bytes of the items this process knows of, and of those pinned.
    pub fn held_bytes(&self) -> (u64, u64) {
        let index = self.lock();
        (index.bytes, index.pinned_bytes())
    }

    fn lock(&self) -> MutexGuard<'_, Index> {
        // The index holds no invariant a panic elsewhere could break mid-way.
        self.index.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn file(&self, id: &str) -> PathBuf {
        self.dir.join(id).join(FILE_NAME)
    }

    /// The item `id` pinned, if its file is there (written by this process, an earlier run or a
    /// replica sharing the directory). `None`: it has to be written (it never was, was evicted,
    /// or was removed by hand). Blocking: call off the async threads.
    pub fn pin_existing(self: &Arc<Self>, id: &str) -> Option<Pin> {
        let path = self.file(id);
        let file = File::open(&path).ok();
        let Some(file) = file.filter(|f| f.lock_shared().is_ok() && still_at(f, &path)) else {
            let mut index = self.lock();
            // Not there yet while it is written: that write's reservation stays.
            if !index.writing.contains(id) {
                index.forget(id);
            }
            return None;
        };
        let bytes = file.metadata().map(|m| m.len()).unwrap_or(0);
        self.lock().pin(id, bytes);
        Some(Pin {
            store: self.clone(),
            id: id.to_owned(),
            _file: file,
        })
    }

    /// Writes `bytes` as item `id` and pins it, after evicting what the bound needs. The file
    /// appears whole (renamed into place) or not at all. Blocking: call off the async threads.
    pub fn write(self: &Arc<Self>, id: &str, bytes: &[u8]) -> Result<Pin, EcStoreError> {
        let size = bytes.len() as u64;
        loop {
            if let Some(pin) = self.pin_existing(id) {
                return Ok(pin);
            }
            let mut index = self.lock();
            // The same item for another request: its file is there once that write ends.
            if index.writing.contains(id) {
                drop(self.write_ended.wait(index));
                continue;
            }
            self.evict(&mut index, size);
            let pinned = index.pinned_bytes();
            if index.bytes + size > self.bound {
                return Err(EcStoreError::Full {
                    needed: size,
                    pinned,
                    bound: self.bound,
                });
            }
            // Counted (and pinned) from now, so concurrent writes cannot overrun the bound.
            index.pin(id, size);
            index.writing.insert(id.to_owned());
            break;
        }
        let written = self.write_file(id, bytes);
        self.lock().writing.remove(id);
        self.write_ended.notify_all();
        match written {
            Ok(file) => Ok(Pin {
                store: self.clone(),
                id: id.to_owned(),
                _file: file,
            }),
            Err(source) => {
                self.lock().forget(id);
                Err(EcStoreError::Unwritable {
                    dir: self.dir.clone(),
                    source,
                })
            }
        }
    }

    fn write_file(&self, id: &str, bytes: &[u8]) -> io::Result<File> {
        let folder = self.dir.join(id);
        fs::create_dir_all(&folder)?;
        let writing = folder.join(format!(
            "{FILE_NAME}.{:016x}{WRITING_SUFFIX}",
            rand::random::<u64>()
        ));
        let written = (|| {
            let mut file = File::create_new(&writing)?;
            // Exclusive while written: a starting replica's clean-up leaves it alone.
            file.lock()?;
            file.write_all(bytes)?;
            // The lock follows the file through the rename: pinned from its first moment there.
            file.lock_shared()?;
            fs::rename(&writing, folder.join(FILE_NAME))?;
            Ok(file)
        })();
        if written.is_err() {
            let _ = fs::remove_file(&writing);
        }
        written
    }

    /// Evicts idle items, least recently used first, until `room` more bytes fit the bound. An
    /// item another process has pinned (a replica sharing the directory) stays, and stays first
    /// in line.
    fn evict(&self, index: &mut Index, room: u64) {
        let mut held_elsewhere = Vec::new();
        while index.bytes + room > self.bound {
            let Some((last_used, id)) = index.idle.pop_first() else {
                break;
            };
            let path = self.file(&id);
            if let Ok(file) = File::open(&path) {
                match file.try_lock() {
                    Ok(()) => {
                        if still_at(&file, &path) {
                            let _ = fs::remove_file(&path);
                        }
                        let _ = fs::remove_dir(path.parent().unwrap_or(&self.dir));
                    }
                    Err(TryLockError::WouldBlock) => {
                        held_elsewhere.push((last_used, id));
                        continue;
                    }
                    Err(TryLockError::Error(e)) => {
                        tracing::warn!(item = %id, error = %e, "EC store: cannot lock an item to evict it");
                        held_elsewhere.push((last_used, id));
                        continue;
                    }
                }
            }
            // Evicted, or already gone (removed by hand or by a replica).
            if let Some(item) = index.items.remove(&id) {
                index.bytes -= item.bytes;
            }
        }
        index.idle.extend(held_elsewhere);
    }
}

/// Whether `file` is still the one at `path` (not removed or replaced since it was opened).
fn still_at(file: &File, path: &Path) -> bool {
    match (file.metadata(), fs::metadata(path)) {
        (Ok(open), Ok(there)) => open.ino() == there.ino() && open.dev() == there.dev(),
        _ => false,
    }
}

/// An item's folder name: a lowercase hex content hash (what this store writes; anything else
/// in the directory is left alone).
fn is_identifier(name: &str) -> bool {
    name.len() == 64 && name.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Removes files of `folder` half-written by a process that is gone (one still writing holds its
/// lock).
fn remove_abandoned_writes(folder: &Path) {
    let Ok(entries) = fs::read_dir(folder) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if !path.to_string_lossy().ends_with(WRITING_SUFFIX) {
            continue;
        }
        if let Ok(file) = File::open(&path)
            && file.try_lock().is_ok()
        {
            let _ = fs::remove_file(&path);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn id(n: u8) -> String {
        format!("{n:02x}").repeat(32)
    }

    #[test]
    fn items_are_written_whole_and_found_again() {
        let dir = tempfile::tempdir().unwrap();
        let store = EcStore::open(dir.path(), 1 << 20).unwrap();
        assert!(store.pin_existing(&id(1)).is_none());
        let pin = store.write(&id(1), b"abc").unwrap();
        assert_eq!(
            fs::read(dir.path().join(id(1)).join(FILE_NAME)).unwrap(),
            b"abc"
        );
        assert_eq!(store.held_bytes(), (3, 3));
        drop(pin);
        assert_eq!(store.held_bytes(), (3, 0));
        assert!(store.pin_existing(&id(1)).is_some());
        // Nothing but the file is left in the folder.
        let left: Vec<_> = fs::read_dir(dir.path().join(id(1))).unwrap().collect();
        assert_eq!(left.len(), 1);
    }

    #[test]
    fn one_item_written_for_several_requests_at_once_is_written_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = EcStore::open(dir.path(), 1 << 20).unwrap();
        let pins: Vec<Pin> = std::thread::scope(|scope| {
            let writers: Vec<_> = (0..8)
                .map(|_| scope.spawn(|| store.write(&id(1), &[7; 1000]).unwrap()))
                .collect();
            writers.into_iter().map(|w| w.join().unwrap()).collect()
        });
        assert_eq!(store.held_bytes(), (1000, 1000));
        drop(pins);
        assert_eq!(store.held_bytes(), (1000, 0));
        let left: Vec<_> = fs::read_dir(dir.path().join(id(1))).unwrap().collect();
        assert_eq!(left.len(), 1);
    }

    #[test]
    fn the_least_recently_used_idle_item_goes_first_and_pinned_ones_never() {
        let dir = tempfile::tempdir().unwrap();
        let store = EcStore::open(dir.path(), 10).unwrap();
        let held = store.write(&id(1), &[0; 4]).unwrap();
        drop(store.write(&id(2), &[0; 4]).unwrap());
        drop(store.write(&id(3), &[0; 4]).unwrap());
        // 1 is pinned: 2, the oldest idle one, made room for 3.
        assert!(dir.path().join(id(1)).join(FILE_NAME).exists());
        assert!(!dir.path().join(id(2)).exists());
        assert!(dir.path().join(id(3)).join(FILE_NAME).exists());
        // With 1 and a new item pinned, nothing more fits.
        let _also = store.write(&id(3), &[0; 4]).unwrap();
        let full = store.write(&id(4), &[0; 4]).err().unwrap();
        assert!(full.is_full(), "{full}");
        assert!(!dir.path().join(id(4)).join(FILE_NAME).exists());
        drop(held);
        store.write(&id(4), &[0; 4]).unwrap();
        assert!(!dir.path().join(id(1)).exists());
    }

    #[test]
    fn another_process_pin_keeps_a_file_from_eviction() {
        let dir = tempfile::tempdir().unwrap();
        let store = EcStore::open(dir.path(), 4).unwrap();
        drop(store.write(&id(1), &[0; 4]).unwrap());
        // A replica sharing the directory pins it (its own open file description).
        let replica = EcStore::open(dir.path(), 4).unwrap();
        let theirs = replica.pin_existing(&id(1)).unwrap();
        let full = store.write(&id(2), &[0; 4]).err().unwrap();
        assert!(full.is_full(), "{full}");
        assert!(dir.path().join(id(1)).join(FILE_NAME).exists());
        drop(theirs);
        drop(replica);
        store.write(&id(2), &[0; 4]).unwrap();
        assert!(!dir.path().join(id(1)).exists());
    }

    #[test]
    fn a_restart_takes_in_whole_files_and_cleans_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = EcStore::open(dir.path(), 1 << 20).unwrap();
            drop(store.write(&id(1), b"kept").unwrap());
        }
        let abandoned = dir.path().join(id(2));
        fs::create_dir_all(&abandoned).unwrap();
        fs::write(
            abandoned.join(format!("{FILE_NAME}.0{WRITING_SUFFIX}")),
            b"half",
        )
        .unwrap();
        fs::create_dir_all(dir.path().join(id(3))).unwrap();
        fs::create_dir_all(dir.path().join("not-ours")).unwrap();
        let store = EcStore::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(store.held_bytes(), (4, 0));
        assert!(!abandoned.exists());
        assert!(!dir.path().join(id(3)).exists());
        assert!(dir.path().join("not-ours").exists());
        // An item removed by hand is written again.
        fs::remove_dir_all(dir.path().join(id(1))).unwrap();
        assert!(store.pin_existing(&id(1)).is_none());
        assert_eq!(store.held_bytes(), (0, 0));
    }

    #[test]
    fn a_bound_smaller_than_what_is_left_evicts_at_start() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = EcStore::open(dir.path(), 1 << 20).unwrap();
            drop(store.write(&id(1), &[0; 8]).unwrap());
            drop(store.write(&id(2), &[0; 8]).unwrap());
        }
        let store = EcStore::open(dir.path(), 8).unwrap();
        assert_eq!(store.held_bytes(), (8, 0));
    }

    #[test]
    fn an_unwritable_directory_is_an_error_and_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = EcStore::open(dir.path(), 1 << 20).unwrap();
        // A file where the item's folder would go.
        fs::write(dir.path().join(id(1)), b"").unwrap();
        let error = store.write(&id(1), b"abc").err().unwrap();
        assert!(!error.is_full(), "{error}");
        assert_eq!(store.held_bytes(), (0, 0));
    }
}
