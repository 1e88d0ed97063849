//! The set of plugins a gateway serves: the built-ins embedded in the binary, then a plugin directory
//! whose plugins add to them or replace a built-in of the same name.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::builtin::BUILTIN_PLUGINS;
use crate::contract::Descriptor;
use crate::error::LoadError;
use crate::manifest::Manifest;
use crate::plugin::{LoadedPlugin, PluginOrigin};
use crate::sandbox::Sandbox;

#[derive(Default, Clone)]
pub struct PluginRegistry {
    /// What serves, by name.
    plugins: BTreeMap<String, Arc<LoadedPlugin>>,
    /// Every built-in, including those a directory plugin replaces (they serve again if it goes).
    builtins: Vec<Arc<LoadedPlugin>>,
    /// The directory plugins, by the manifest they were loaded from.
    from_dir: BTreeMap<PathBuf, Arc<LoadedPlugin>>,
}

/// A plugin of a directory that [`PluginRegistry::reload_dir`] could not load.
#[derive(Debug)]
pub struct Rejected {
    pub manifest: PathBuf,
    pub error: LoadError,
    /// The version loaded from this manifest before keeps serving.
    pub kept_previous: bool,
}

impl PluginRegistry {
    /// The built-in plugins only.
    pub fn builtin(sandbox: &Arc<Sandbox>) -> Result<PluginRegistry, LoadError> {
        let mut registry = PluginRegistry::default();
        for builtin in BUILTIN_PLUGINS {
            let plugin =
                LoadedPlugin::load(sandbox.clone(), builtin.component, PluginOrigin::Builtin)?;
            let plugin = Arc::new(plugin);
            registry.builtins.push(plugin.clone());
            registry.insert(plugin);
        }
        Ok(registry)
    }

    /// The built-ins, then every plugin of `dir` (which replace built-ins of the same name).
    /// Any plugin of `dir` that fails to load fails the whole load: an operator who configured a
    /// plugin wants to know at start-up, not at the first request.
    pub fn with_dir(sandbox: &Arc<Sandbox>, dir: &Path) -> Result<PluginRegistry, LoadError> {
        let (registry, rejected) = PluginRegistry::builtin(sandbox)?.reload_dir(sandbox, dir)?;
        match rejected.into_iter().next() {
            Some(first) => Err(first.error),
            None => Ok(registry),
        }
    }

    /// The registry for what `dir` holds now, for a running gateway: plugins whose manifest and
    /// component are unchanged are reused (not recompiled), new and changed ones are loaded and
    /// verified, removed ones are dropped (a built-in they replaced serves again). A plugin that fails
    /// to load is reported in the second value and, if this registry had loaded one from the same
    /// manifest, that one keeps serving. `self` is not changed: calls holding it finish on the plugins
    /// they started with. Fails only when `dir` cannot be listed.
    pub fn reload_dir(
        &self,
        sandbox: &Arc<Sandbox>,
        dir: &Path,
    ) -> Result<(PluginRegistry, Vec<Rejected>), LoadError> {
        let mut next = PluginRegistry {
            builtins: self.builtins.clone(),
            ..PluginRegistry::default()
        };
        for builtin in &self.builtins {
            next.insert(builtin.clone());
        }
        let mut rejected = Vec::new();
        let mut names: BTreeMap<String, PathBuf> = BTreeMap::new();
        for manifest_path in manifests_in(dir)? {
            let previous = self.from_dir.get(&manifest_path);
            let loaded = match previous {
                Some(previous) => reuse_or_load(sandbox, &manifest_path, previous),
                None => load_from_manifest(sandbox, &manifest_path).map(Arc::new),
            };
            let plugin = match (loaded, previous) {
                (Ok(plugin), _) => plugin,
                (Err(error), previous) => {
                    rejected.push(Rejected {
                        manifest: manifest_path.clone(),
                        error,
                        kept_previous: previous.is_some(),
                    });
                    match previous {
                        Some(previous) => previous.clone(),
                        None => continue,
                    }
                }
            };
            if let Some(first) = names.get(plugin.name()) {
                rejected.push(Rejected {
                    error: LoadError::Duplicate {
                        name: plugin.name().to_owned(),
                        first: first.display().to_string(),
                        second: manifest_path.display().to_string(),
                    },
                    manifest: manifest_path,
                    kept_previous: false,
                });
                continue;
            }
            names.insert(plugin.name().to_owned(), manifest_path.clone());
            next.from_dir.insert(manifest_path, plugin.clone());
            next.insert(plugin);
        }
        Ok((next, rejected))
    }

    fn insert(&mut self, plugin: Arc<LoadedPlugin>) {
        if let Some(old) = self.plugins.get(plugin.name()) {
            tracing::info!(
                plugin = plugin.name(),
                replaced = %old.origin(),
                by = %plugin.origin(),
                "plugin replaced"
            );
        }
        self.plugins.insert(plugin.name().to_owned(), plugin);
    }

    pub fn get(&self, name: &str) -> Option<&Arc<LoadedPlugin>> {
        self.plugins.get(name)
    }

    /// The plugin serving `modality`: one loaded from a directory wins over a built-in.
    pub fn for_modality(&self, modality: &str) -> Option<&Arc<LoadedPlugin>> {
        self.preferred(|d| d.modalities.iter().any(|m| m == modality))
    }

    /// The plugin that accepts media of `mime_type` (e.g. `image/png`) among those `eligible` lets
    /// through, with the same preference.
    pub fn for_mime_type(
        &self,
        mime_type: &str,
        eligible: impl Fn(&Descriptor) -> bool,
    ) -> Option<&Arc<LoadedPlugin>> {
        self.preferred(|d| {
            eligible(d)
                && d.mime_types
                    .iter()
                    .any(|m| m.eq_ignore_ascii_case(mime_type))
        })
    }

    fn preferred(&self, serves: impl Fn(&Descriptor) -> bool) -> Option<&Arc<LoadedPlugin>> {
        let serves = |p: &&Arc<LoadedPlugin>| serves(p.descriptor());
        self.plugins
            .values()
            .filter(serves)
            .find(|p| *p.origin() != PluginOrigin::Builtin)
            .or_else(|| self.plugins.values().find(serves))
    }

    /// All plugins, by name.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<LoadedPlugin>> {
        self.plugins.values()
    }

    pub fn len(&self) -> usize {
        self.plugins.len()
    }

    pub fn is_empty(&self) -> bool {
        self.plugins.is_empty()
    }
}

/// The `*.toml` manifests of `dir`, sorted so that loading is deterministic.
fn manifests_in(dir: &Path) -> Result<Vec<PathBuf>, LoadError> {
    let io = |source| LoadError::Io {
        path: dir.to_owned(),
        source,
    };
    let mut manifests = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let path = entry.map_err(io)?.path();
        if path.extension().is_some_and(|e| e == "toml") && path.is_file() {
            manifests.push(path);
        }
    }
    manifests.sort();
    Ok(manifests)
}

/// `previous` again if the manifest still pins the very component it was loaded from, else a fresh
/// load: re-hashing a file is cheap, recompiling it is not.
fn reuse_or_load(
    sandbox: &Arc<Sandbox>,
    manifest_path: &Path,
    previous: &Arc<LoadedPlugin>,
) -> Result<Arc<LoadedPlugin>, LoadError> {
    let (manifest, component_path, bytes) = read_plugin_files(manifest_path)?;
    let sha256 = hex::encode(Sha256::digest(&bytes));
    let same = sha256 == previous.sha256()
        && *previous.origin() == PluginOrigin::File(component_path.clone());
    if same {
        manifest.check_hash(manifest_path, &sha256)?;
        manifest.check_descriptor(manifest_path, previous.descriptor())?;
        return Ok(previous.clone());
    }
    load_verified(
        sandbox,
        &bytes,
        PluginOrigin::File(component_path),
        Some((manifest_path, &manifest)),
    )
    .map(Arc::new)
}

/// A manifest, where its component is, and the component's bytes.
fn read_plugin_files(manifest_path: &Path) -> Result<(Manifest, PathBuf, Vec<u8>), LoadError> {
    let manifest = Manifest::read(manifest_path)?;
    let component_path = manifest.component_path(manifest_path);
    let bytes = std::fs::read(&component_path).map_err(|source| LoadError::Io {
        path: component_path.clone(),
        source,
    })?;
    Ok((manifest, component_path, bytes))
}

/// Load the component a manifest names (see [`load_verified`]).
pub fn load_from_manifest(
    sandbox: &Arc<Sandbox>,
    manifest_path: &Path,
) -> Result<LoadedPlugin, LoadError> {
    let (manifest, component_path, bytes) = read_plugin_files(manifest_path)?;
    load_verified(
        sandbox,
        &bytes,
        PluginOrigin::File(component_path),
        Some((manifest_path, &manifest)),
    )
}

/// Load a component, checking it against its manifest when it has one: the hash before anything is
/// compiled (a tampered file never runs), the descriptor after `describe()`.
pub fn load_verified(
    sandbox: &Arc<Sandbox>,
    bytes: &[u8],
    origin: PluginOrigin,
    manifest: Option<(&Path, &Manifest)>,
) -> Result<LoadedPlugin, LoadError> {
    if let Some((path, manifest)) = manifest {
        manifest.check_hash(path, &hex::encode(Sha256::digest(bytes)))?;
    }
    let plugin = LoadedPlugin::load(sandbox.clone(), bytes, origin)?;
    if let Some((path, manifest)) = manifest {
        manifest.check_descriptor(path, plugin.descriptor())?;
    }
    Ok(plugin)
}
