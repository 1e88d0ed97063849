//! Reloading a plugin directory while serving: unchanged plugins are reused, changed ones reloaded,
//! broken ones rejected while the version before keeps serving, removed ones dropped.

use std::path::Path;
use std::sync::Arc;

use mmgate_host::builtin::{BUILTIN_PLUGINS, artifact_dir};
use mmgate_host::{LoadError, PluginOrigin, PluginRegistry, Sandbox, SandboxLimits};
use sha2::{Digest, Sha256};

fn sandbox() -> Arc<Sandbox> {
    crate::common::sandbox_with(SandboxLimits::default())
}

/// Puts `component` into `dir` as NAME.wasm with a manifest that pins it.
fn install(dir: &Path, name: &str, version: &str, modalities: &[&str], component: &[u8]) {
    std::fs::write(dir.join(format!("{name}.wasm")), component).unwrap();
    let sha = hex::encode(Sha256::digest(component));
    std::fs::write(
        dir.join(format!("{name}.toml")),
        format!(
            "name = \"{name}\"\nversion = \"{version}\"\nmodalities = {modalities:?}\n\
             sha256 = \"{sha}\"\n"
        ),
    )
    .unwrap();
}

/// The test plugin's modalities.
const TESTING: &[&str] = &["test", "image"];

fn testing_component() -> Vec<u8> {
    std::fs::read(artifact_dir().join("testing.wasm")).unwrap()
}

fn builtin_image() -> &'static [u8] {
    BUILTIN_PLUGINS
        .iter()
        .find(|p| p.name == "image")
        .unwrap()
        .component
}

#[test]
fn unchanged_plugins_are_reused_and_removed_ones_dropped() {
    let sandbox = sandbox();
    let dir = tempfile::tempdir().unwrap();
    install(
        dir.path(),
        "testing",
        "0.1.0",
        TESTING,
        &testing_component(),
    );
    let first = PluginRegistry::with_dir(&sandbox, dir.path()).unwrap();

    let (second, rejected) = first.reload_dir(&sandbox, dir.path()).unwrap();
    assert!(rejected.is_empty(), "{rejected:?}");
    assert!(
        Arc::ptr_eq(
            first.get("testing").unwrap(),
            second.get("testing").unwrap()
        ),
        "an unchanged plugin is not recompiled"
    );

    std::fs::remove_file(dir.path().join("testing.toml")).unwrap();
    let (third, rejected) = second.reload_dir(&sandbox, dir.path()).unwrap();
    assert!(rejected.is_empty());
    assert!(third.get("testing").is_none());
    assert!(third.get("image").is_some(), "built-ins stay");
    // A call that took the registry before the reload still runs on the plugin it started with.
    let in_flight = second.get("testing").unwrap();
    let media = mmgate_host::Media {
        data: b"echo".to_vec(),
        mime_type: None,
    };
    assert!(in_flight.probe(&media).is_ok());
}

#[test]
fn a_broken_replacement_is_rejected_and_the_old_version_keeps_serving() {
    let sandbox = sandbox();
    let dir = tempfile::tempdir().unwrap();
    install(
        dir.path(),
        "testing",
        "0.1.0",
        TESTING,
        &testing_component(),
    );
    let serving = PluginRegistry::with_dir(&sandbox, dir.path()).unwrap();

    // A component that is not wasm, pinned by its manifest: it fails to compile.
    install(
        dir.path(),
        "testing",
        "0.1.0",
        TESTING,
        b"\0asm broken build",
    );
    let (next, rejected) = serving.reload_dir(&sandbox, dir.path()).unwrap();
    assert_eq!(rejected.len(), 1);
    assert!(rejected[0].kept_previous);
    assert!(
        matches!(rejected[0].error, LoadError::InvalidComponent { .. }),
        "{:?}",
        rejected[0].error
    );
    let kept = next.get("testing").unwrap();
    assert!(Arc::ptr_eq(kept, serving.get("testing").unwrap()));

    // A component overwritten without its manifest: the hash no longer matches.
    std::fs::write(dir.path().join("testing.wasm"), b"tampered").unwrap();
    let (next, rejected) = next.reload_dir(&sandbox, dir.path()).unwrap();
    assert!(rejected[0].error.to_string().contains("sha256 mismatch"));
    assert!(next.get("testing").is_some());

    // A plugin that was never loaded and fails is simply not there.
    install(dir.path(), "fresh", "0.1.0", &["test"], b"garbage");
    let (next, rejected) = next.reload_dir(&sandbox, dir.path()).unwrap();
    let fresh = rejected
        .iter()
        .find(|r| r.manifest.ends_with("fresh.toml"))
        .unwrap();
    assert!(!fresh.kept_previous);
    assert!(next.get("fresh").is_none());
}

#[test]
fn a_directory_plugin_replaces_a_builtin_until_it_is_removed() {
    let sandbox = sandbox();
    let dir = tempfile::tempdir().unwrap();
    let registry = PluginRegistry::builtin(&sandbox).unwrap();
    install(dir.path(), "image", "0.1.0", &["image"], builtin_image());
    let (replaced, rejected) = registry.reload_dir(&sandbox, dir.path()).unwrap();
    assert!(rejected.is_empty(), "{rejected:?}");
    assert!(matches!(
        replaced.get("image").unwrap().origin(),
        PluginOrigin::File(_)
    ));

    std::fs::remove_file(dir.path().join("image.toml")).unwrap();
    let (restored, _) = replaced.reload_dir(&sandbox, dir.path()).unwrap();
    assert_eq!(
        *restored.get("image").unwrap().origin(),
        PluginOrigin::Builtin
    );
}

#[test]
fn two_manifests_of_one_name_keep_the_first() {
    let sandbox = sandbox();
    let dir = tempfile::tempdir().unwrap();
    install(
        dir.path(),
        "testing",
        "0.1.0",
        TESTING,
        &testing_component(),
    );
    std::fs::copy(
        dir.path().join("testing.toml"),
        dir.path().join("z-copy.toml"),
    )
    .unwrap();
    let (registry, rejected) = PluginRegistry::builtin(&sandbox)
        .unwrap()
        .reload_dir(&sandbox, dir.path())
        .unwrap();
    assert!(registry.get("testing").is_some());
    assert_eq!(rejected.len(), 1);
    assert!(matches!(rejected[0].error, LoadError::Duplicate { .. }));
    assert!(
        PluginRegistry::with_dir(&sandbox, dir.path()).is_err(),
        "strict at start-up"
    );
}
