//! Compiled plugins kept on disk, so that a restart, a CLI call or a new replica does not run
//! Cranelift over the same components again (about a second for the built-ins on two cores).
//!
//! An entry is keyed by the component's sha256 and the engine's compatibility hash (wasmtime's
//! version, the target and every setting that changes the code), so a plugin that changed, another
//! wasmtime or other sandbox settings simply miss. An entry is never trusted blindly:
//!
//! - the directory is created private (0700) and used only when it belongs to this user and no one
//!   else may write to it;
//! - each entry carries the sha256 of its payload, checked before the payload is deserialized, so a
//!   truncated or corrupted file is a miss (recompiled and rewritten), never loaded;
//! - wasmtime itself refuses an artifact built by an incompatible engine;
//! - entries are written to a temporary file and renamed into place: a reader sees a whole entry or
//!   none, and concurrent writers (replicas starting together) do not interleave.
//!
//! A cache that cannot be used for any reason costs the compile it would have saved, nothing else.

use std::hash::{Hash, Hasher};
use std::io::Write as _;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use wasmtime::Engine;
use wasmtime::component::Component;

/// The first bytes of every entry: the file format, bumped if the layout below ever changes.
const MAGIC: &[u8; 8] = b"mmgatec1";
/// Magic, then the payload's sha256, then the payload (wasmtime's serialized component).
const HEADER_LEN: usize = MAGIC.len() + 32;

/// Why the cache directory cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("cannot create the plugin compile cache {path}: {source}")]
    Create {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "the plugin compile cache {path} is not safe to load code from: {reason} \
         (remove it, or point the cache elsewhere)"
    )]
    Unsafe { path: PathBuf, reason: String },
}

/// A directory of compiled components.
#[derive(Debug, Clone)]
pub struct CompileCache {
    dir: PathBuf,
}

impl CompileCache {
    /// `$XDG_CACHE_HOME/mmgate/compiled-plugins`, or `~/.cache/mmgate/compiled-plugins`; `None`
    /// when neither variable is set.
    pub fn default_dir() -> Option<PathBuf> {
        let base = std::env::var_os("XDG_CACHE_HOME")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
        Some(base.join("mmgate").join("compiled-plugins"))
    }

    /// Opens `dir`, creating it (and its parents) private to this user if it does not exist.
    pub fn open(dir: impl Into<PathBuf>) -> Result<CompileCache, CacheError> {
        let dir = dir.into();
        create_private_dir(&dir).map_err(|source| CacheError::Create {
            path: dir.clone(),
            source,
        })?;
        check_private(&dir)?;
        Ok(CompileCache { dir })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The component for `wasm` (whose sha256 is `wasm_sha256`, hex): from the cache when a sound
    /// entry is there, otherwise compiled now and stored for next time.
    pub(crate) fn component(
        &self,
        engine: &Engine,
        wasm: &[u8],
        wasm_sha256: &str,
    ) -> wasmtime::Result<Component> {
        let path = self.entry_path(engine, wasm_sha256);
        match self.read(engine, &path) {
            Ok(component) => {
                tracing::debug!(entry = %path.display(), "plugin loaded from the compile cache");
                return Ok(component);
            }
            Err(Miss::Absent) => {}
            Err(Miss::Unsound(reason)) => {
                tracing::warn!(entry = %path.display(), %reason, "ignoring a compile cache entry; recompiling");
            }
        }
        let component = Component::new(engine, wasm)?;
        if let Err(e) = self.write(&path, &component) {
            tracing::warn!(entry = %path.display(), error = %e, "cannot store a compiled plugin");
        }
        Ok(component)
    }

    fn entry_path(&self, engine: &Engine, wasm_sha256: &str) -> PathBuf {
        // A stable hash is not needed: an entry another build cannot find is merely a miss, and one
        // it finds by accident is refused by wasmtime's own compatibility check.
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        engine.precompile_compatibility_hash().hash(&mut hasher);
        self.dir
            .join(format!("{wasm_sha256}-{:016x}.cwasm", hasher.finish()))
    }

    fn read(&self, engine: &Engine, path: &Path) -> Result<Component, Miss> {
        let bytes = match std::fs::read(path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(Miss::Absent),
            Err(e) => return Err(Miss::Unsound(format!("unreadable: {e}"))),
        };
        let payload = verified_payload(&bytes).map_err(Miss::Unsound)?;
        deserialize(engine, payload).map_err(|e| Miss::Unsound(format!("{e:#}")))
    }

    /// A failure here is logged by the caller, never surfaced: the compiled component is in hand.
    fn write(&self, path: &Path, component: &Component) -> std::io::Result<()> {
        let payload = component
            .serialize()
            .map_err(|e| std::io::Error::other(format!("{e:#}")))?;
        let mut file = tempfile::NamedTempFile::new_in(&self.dir)?;
        file.write_all(MAGIC)?;
        file.write_all(&Sha256::digest(&payload))?;
        file.write_all(&payload)?;
        file.as_file().sync_data()?;
        file.persist(path).map_err(|e| e.error)?;
        Ok(())
    }
}

/// Why an entry was not used.
enum Miss {
    Absent,
    Unsound(String),
}

/// The payload of an entry whose header is ours and whose checksum matches.
fn verified_payload(bytes: &[u8]) -> Result<&[u8], String> {
    if bytes.len() < HEADER_LEN || &bytes[..MAGIC.len()] != MAGIC {
        return Err("not an mmgate compile cache entry".into());
    }
    let (checksum, payload) = bytes[MAGIC.len()..].split_at(32);
    if Sha256::digest(payload).as_slice() != checksum {
        return Err("checksum mismatch (truncated or corrupted)".into());
    }
    Ok(payload)
}

#[allow(unsafe_code)]
fn deserialize(engine: &Engine, payload: &[u8]) -> wasmtime::Result<Component> {
    // SAFETY: `Component::deserialize` runs the machine code it is given, so the bytes must be what
    // `Component::serialize` produced. They are: the payload's sha256 was checked against the one
    // written beside it (no corruption), the directory belongs to this user and no one else can write
    // to it (no substitution by another user), and wasmtime checks the artifact's header against
    // this engine's version and settings before using it.
    unsafe { Component::deserialize(engine, payload) }
}

#[cfg(unix)]
fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

#[cfg(not(unix))]
fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)
}

#[cfg(unix)]
fn check_private(dir: &Path) -> Result<(), CacheError> {
    use std::os::unix::fs::MetadataExt;
    let unsafe_dir = |reason: String| CacheError::Unsafe {
        path: dir.to_owned(),
        reason,
    };
    // symlink_metadata: a symlink planted in place of the directory is refused, not followed.
    let meta = std::fs::symlink_metadata(dir).map_err(|e| unsafe_dir(e.to_string()))?;
    if !meta.is_dir() {
        return Err(unsafe_dir("it is not a directory".into()));
    }
    let owner = meta.uid();
    let me = current_uid(dir).map_err(unsafe_dir)?;
    if owner != me {
        return Err(unsafe_dir(format!(
            "it belongs to uid {owner}, not to this user ({me})"
        )));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(unsafe_dir(format!(
            "others may write to it (mode {:o})",
            meta.mode() & 0o777
        )));
    }
    Ok(())
}

/// This process's uid, without libc: the owner of a file it has just created.
#[cfg(unix)]
fn current_uid(dir: &Path) -> Result<u32, String> {
    use std::os::unix::fs::MetadataExt;
    let probe = tempfile::NamedTempFile::new_in(dir).map_err(|e| e.to_string())?;
    let uid = probe.as_file().metadata().map_err(|e| e.to_string())?.uid();
    Ok(uid)
}

#[cfg(not(unix))]
fn check_private(_dir: &Path) -> Result<(), CacheError> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payload_is_checked_before_use() {
        let payload = b"compiled code".as_slice();
        let mut entry = MAGIC.to_vec();
        entry.extend_from_slice(&Sha256::digest(payload));
        entry.extend_from_slice(payload);
        assert_eq!(verified_payload(&entry), Ok(payload));

        let mut flipped = entry.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        assert!(verified_payload(&flipped).is_err());
        assert!(verified_payload(&entry[..entry.len() - 1]).is_err());
        assert!(verified_payload(&entry[..10]).is_err());
        let mut foreign = entry.clone();
        foreign[0] = b'X';
        assert!(verified_payload(&foreign).is_err());
    }

    #[cfg(unix)]
    #[test]
    fn a_directory_others_may_write_to_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("cache");
        let cache = CompileCache::open(&dir).unwrap();
        let mode = std::fs::metadata(cache.dir()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(matches!(
            CompileCache::open(&dir),
            Err(CacheError::Unsafe { .. })
        ));
    }
}
