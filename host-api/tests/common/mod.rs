//! Helpers the host's integration tests share.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::any::Any;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use mmgate_host::{CompileCache, LoadedPlugin, PluginRegistry, Sandbox, SandboxLimits};

/// A sandbox with `limits` whose components are compiled once for all tests (and kept between
/// runs) in the product's own compile cache: compiling the built-ins is most of what a test would
/// otherwise spend.
pub fn sandbox_with(limits: SandboxLimits) -> Arc<Sandbox> {
    let cache = CompileCache::open(Path::new(env!("CARGO_TARGET_TMPDIR")).join("compiled-plugins"))
        .unwrap();
    Arc::new(Sandbox::new(limits).unwrap().with_compile_cache(cache))
}

/// The built-in plugin for `modality`, in a sandbox of its own with `limits`.
pub fn builtin_plugin_with(modality: &str, limits: SandboxLimits) -> Arc<LoadedPlugin> {
    let sandbox = sandbox_with(limits);
    PluginRegistry::builtin(&sandbox)
        .unwrap()
        .for_modality(modality)
        .unwrap_or_else(|| panic!("a built-in {modality} plugin"))
        .clone()
}

/// The built-in plugin for `modality` under the default limits.
pub fn builtin_plugin(modality: &str) -> Arc<LoadedPlugin> {
    builtin_plugin_with(modality, SandboxLimits::default())
}

/// The parity fixtures of `modality` (`tests/fixtures/<modality>` at the repository root).
pub fn fixtures_dir(modality: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(modality)
}

fn panic_message(payload: Box<dyn Any + Send>) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_default()
}

/// Check every case and report every failure at once, rather than stopping at the first: `check`
/// returns `Err(why)` for a case out of tolerance, and a panic inside it (a failed assertion) fails
/// that case only.
pub fn check_all<C>(
    cases: &[C],
    name: impl Fn(&C) -> &str,
    check: impl Fn(&C) -> Result<(), String>,
) {
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|case| {
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(case)));
            match outcome {
                Ok(Ok(())) => None,
                Ok(Err(why)) => Some(format!("{}: {why}", name(case))),
                Err(panic) => Some(format!("{}: {}", name(case), panic_message(panic))),
            }
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{} cases failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
