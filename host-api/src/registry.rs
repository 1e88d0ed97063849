//! The set of plugins a gateway serves: the built-ins embedded in the binary, then a plugin directory
//! whose plugins add to them or replace a built-in of the same name.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::builtin::BUILTIN_PLUGINS;
use crate::contract::Descriptor;
use crate::error::LoadError;
use crate::manifest::Manifest;
use crate::plugin::{LoadedPlugin, PluginOrigin};
use crate::sandbox::Sandbox;

#[derive(Default)]
pub struct PluginRegistry {
    plugins: BTreeMap<String, Arc<LoadedPlugin>>,
}

impl PluginRegistry {
    /// The built-in plugins only.
    pub fn builtin(sandbox: &Arc<Sandbox>) -> Result<PluginRegistry, LoadError> {
        let mut registry = PluginRegistry::default();
        for builtin in BUILTIN_PLUGINS {
            let plugin =
                LoadedPlugin::load(sandbox.clone(), builtin.component, PluginOrigin::Builtin)?;
            registry.insert(plugin);
        }
        Ok(registry)
    }

    /// The built-ins, then every plugin of `dir` (which replace built-ins of the same name).
    /// Any plugin of `dir` that fails to load fails the whole load: an operator who configured a
    /// plugin wants to know at start-up, not at the first request.
    pub fn with_dir(sandbox: &Arc<Sandbox>, dir: &Path) -> Result<PluginRegistry, LoadError> {
        let mut registry = PluginRegistry::builtin(sandbox)?;
        let mut seen: BTreeMap<String, String> = BTreeMap::new();
        for manifest_path in manifests_in(dir)? {
            let plugin = load_from_manifest(sandbox, &manifest_path)?;
            let label = manifest_path.display().to_string();
            if let Some(first) = seen.insert(plugin.name().to_owned(), label.clone()) {
                return Err(LoadError::Duplicate {
                    name: plugin.name().to_owned(),
                    first,
                    second: label,
                });
            }
            registry.insert(plugin);
        }
        Ok(registry)
    }

    fn insert(&mut self, plugin: LoadedPlugin) {
        if let Some(old) = self.plugins.get(plugin.name()) {
            tracing::info!(
                plugin = plugin.name(),
                replaced = %old.origin(),
                by = %plugin.origin(),
                "plugin replaced"
            );
        }
        self.plugins
            .insert(plugin.name().to_owned(), Arc::new(plugin));
    }

    pub fn get(&self, name: &str) -> Option<&Arc<LoadedPlugin>> {
        self.plugins.get(name)
    }

    /// The plugin serving `modality`: one loaded from a directory wins over a built-in.
    pub fn for_modality(&self, modality: &str) -> Option<&Arc<LoadedPlugin>> {
        self.preferred(|d| d.modalities.iter().any(|m| m == modality))
    }

    /// The plugin that accepts media of `mime_type` (e.g. `image/png`), with the same preference.
    pub fn for_mime_type(&self, mime_type: &str) -> Option<&Arc<LoadedPlugin>> {
        self.preferred(|d| {
            d.mime_types
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
fn manifests_in(dir: &Path) -> Result<Vec<std::path::PathBuf>, LoadError> {
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

/// Load the component a manifest names (see [`load_verified`]).
pub fn load_from_manifest(
    sandbox: &Arc<Sandbox>,
    manifest_path: &Path,
) -> Result<LoadedPlugin, LoadError> {
    let manifest = Manifest::read(manifest_path)?;
    let component_path = manifest.component_path(manifest_path);
    let bytes = std::fs::read(&component_path).map_err(|source| LoadError::Io {
        path: component_path.clone(),
        source,
    })?;
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
