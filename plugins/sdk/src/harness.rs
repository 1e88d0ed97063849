//! Testing a plugin under the real host (feature `harness`, native targets only).
//!
//! [`Harness::build`] compiles the plugin crate for wasm32-wasip2 in release mode, exactly as
//! `mmgate plugin build` does, and loads the component into mmgate's own sandbox with the production
//! limits (memory cap, deadline, output cap, no filesystem or network). A test then calls the plugin as
//! the gateway would:
//!
//! ```ignore
//! use mmgate_plugin_sdk::harness::Harness;
//!
//! #[test]
//! fn plans_and_preprocesses_under_the_real_host() {
//!     let plugin = Harness::build(env!("CARGO_MANIFEST_DIR")).unwrap();
//!     let (plan, tensors) = plugin.run(&std::fs::read("tests/cat.png").unwrap(), "{}", 4096).unwrap();
//!     assert_eq!(plan.tokens, 256);
//! }
//! ```
//!
//! Add it as a dev-dependency only:
//! `mmgate-plugin-sdk = { ..., features = ["harness"] }` under `[dev-dependencies]`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

pub use mmgate_host as host;
use mmgate_host::component::{BuildError, BuildOptions, build_component};
pub use mmgate_host::{
    Budget, CallError, Descriptor, Dtype, LoadError, LoadedPlugin, Media, MediaInfo, PluginError,
    SandboxLimits, Tensor, TokenPlan,
};
use mmgate_host::{PluginOrigin, Sandbox};

/// Why the harness could not produce a loaded plugin.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    #[error(transparent)]
    Build(#[from] BuildError),
    #[error("cannot read the built component {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Load(#[from] LoadError),
}

/// A plugin built from source and loaded into the real sandbox.
pub struct Harness {
    plugin: LoadedPlugin,
    component: PathBuf,
}

impl Harness {
    /// Builds the plugin crate in `crate_dir` (usually `env!("CARGO_MANIFEST_DIR")`) and loads it with
    /// the production [`SandboxLimits`]. Built once per test process and crate; later calls share it.
    pub fn build(crate_dir: impl AsRef<Path>) -> Result<Arc<Harness>, HarnessError> {
        static BUILT: OnceLock<Mutex<HashMap<PathBuf, Arc<Harness>>>> = OnceLock::new();
        let crate_dir = crate_dir.as_ref().to_owned();
        // One build at a time: cargo serialises on its target directory anyway, and tests run in
        // parallel threads.
        let mut built = BUILT
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(harness) = built.get(&crate_dir) {
            return Ok(harness.clone());
        }
        let harness = Arc::new(Harness::build_with(&crate_dir, SandboxLimits::default())?);
        built.insert(crate_dir, harness.clone());
        Ok(harness)
    }

    /// Like [`Harness::build`] but with other limits (e.g. to test how the plugin fails under a small
    /// memory cap), and never shared.
    pub fn build_with(crate_dir: &Path, limits: SandboxLimits) -> Result<Harness, HarnessError> {
        let options = BuildOptions {
            target_dir: Some(harness_target_dir(crate_dir)),
            locked: false,
        };
        let component = build_component(crate_dir, &options)?;
        let bytes = std::fs::read(&component).map_err(|source| HarnessError::Read {
            path: component.clone(),
            source,
        })?;
        let sandbox = Arc::new(Sandbox::new(limits)?);
        let plugin = LoadedPlugin::load(sandbox, &bytes, PluginOrigin::File(component.clone()))?;
        Ok(Harness { plugin, component })
    }

    /// The loaded plugin: every call the host makes (`describe`, `probe`, `plan`, `preprocess`).
    pub fn plugin(&self) -> &LoadedPlugin {
        &self.plugin
    }

    /// Where the built component is.
    pub fn component(&self) -> &Path {
        &self.component
    }

    pub fn descriptor(&self) -> &Descriptor {
        self.plugin.descriptor()
    }

    /// `probe` of `data` (no MIME type hint, as when a client sends none).
    pub fn probe(&self, data: &[u8]) -> Result<MediaInfo, CallError> {
        self.plugin.probe(&media(data))
    }

    /// The whole per-item path, each step in a fresh sandbox as in production: probe, plan within
    /// `max_tokens`, preprocess. The tensors have passed the host's contract checks.
    pub fn run(
        &self,
        data: &[u8],
        processor_config: &str,
        max_tokens: u32,
    ) -> Result<(TokenPlan, Vec<Tensor>), CallError> {
        let media = media(data);
        let info = self.plugin.probe(&media)?;
        let plan = self
            .plugin
            .plan(&info, Budget { max_tokens }, processor_config)?;
        let tensors = self.plugin.preprocess(&media, &plan, processor_config)?;
        Ok((plan, tensors))
    }
}

fn media(data: &[u8]) -> Media {
    Media {
        data: data.to_vec(),
        mime_type: None,
    }
}

/// `<target>/mmgate-harness`: its own target directory, because the `cargo test` that runs the harness
/// holds the lock of the crate's usual one while building.
fn harness_target_dir(crate_dir: &Path) -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate_dir.join("target"));
    target.join("mmgate-harness")
}
