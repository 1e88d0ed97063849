//! Plugin manifests: the small TOML file beside each component in a plugin directory.
//!
//! ```toml
//! name = "image"
//! version = "0.1.0"
//! modalities = ["image"]
//! sha256 = "…64 hex digits of the .wasm…"
//! component = "image.wasm"   # optional, default "<name>.wasm", relative to the manifest
//! ```
//!
//! The manifest is what an operator reviews and pins: the component must hash to `sha256`, and its
//! `describe()` must agree with `name`, `version` and `modalities`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::contract::Descriptor;
use crate::error::LoadError;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub name: String,
    pub version: String,
    pub modalities: Vec<String>,
    pub sha256: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub component: Option<String>,
}

impl Manifest {
    pub fn read(path: &Path) -> Result<Manifest, LoadError> {
        let text = std::fs::read_to_string(path).map_err(|source| LoadError::Io {
            path: path.to_owned(),
            source,
        })?;
        toml::from_str(&text).map_err(|e| LoadError::Manifest {
            path: path.to_owned(),
            reason: e.message().to_owned(),
        })
    }

    /// The manifest a freshly built component should ship with.
    pub fn for_component(descriptor: &Descriptor, sha256: &str, component: &str) -> Manifest {
        Manifest {
            name: descriptor.name.clone(),
            version: descriptor.version.clone(),
            modalities: descriptor.modalities.clone(),
            sha256: sha256.to_owned(),
            component: Some(component.to_owned()),
        }
    }

    /// Where the component lives: `component`, or `<name>.wasm`, beside the manifest.
    pub fn component_path(&self, manifest_path: &Path) -> PathBuf {
        let file = self
            .component
            .clone()
            .unwrap_or_else(|| format!("{}.wasm", self.name));
        manifest_path
            .parent()
            .unwrap_or_else(|| Path::new("."))
            .join(file)
    }

    /// Check the component's hash (before compiling it: a tampered file is never run).
    pub fn check_hash(&self, manifest_path: &Path, actual_sha256: &str) -> Result<(), LoadError> {
        if !self.sha256.eq_ignore_ascii_case(actual_sha256) {
            return Err(LoadError::Manifest {
                path: manifest_path.to_owned(),
                reason: format!(
                    "sha256 mismatch: the manifest pins {}, the component hashes to {actual_sha256}",
                    self.sha256
                ),
            });
        }
        Ok(())
    }

    /// Check that the plugin describes itself as the manifest says.
    pub fn check_descriptor(
        &self,
        manifest_path: &Path,
        descriptor: &Descriptor,
    ) -> Result<(), LoadError> {
        let mismatch = |field: &str, manifest: String, plugin: String| LoadError::Manifest {
            path: manifest_path.to_owned(),
            reason: format!("{field} is {manifest} in the manifest but {plugin} in describe()"),
        };
        if self.name != descriptor.name {
            return Err(mismatch(
                "name",
                format!("{:?}", self.name),
                format!("{:?}", descriptor.name),
            ));
        }
        if self.version != descriptor.version {
            return Err(mismatch(
                "version",
                format!("{:?}", self.version),
                format!("{:?}", descriptor.version),
            ));
        }
        let mut ours = self.modalities.clone();
        let mut theirs = descriptor.modalities.clone();
        ours.sort();
        theirs.sort();
        if ours != theirs {
            return Err(mismatch(
                "modalities",
                format!("{ours:?}"),
                format!("{theirs:?}"),
            ));
        }
        Ok(())
    }
}
