//! The compile cache under a real engine: a second load comes from disk and behaves the same; a
//! corrupted, truncated or foreign entry is recompiled (and rewritten), never loaded.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use mmgate_host::builtin::BUILTIN_PLUGINS;
use mmgate_host::{CompileCache, LoadedPlugin, PluginOrigin, Sandbox, SandboxLimits};

fn image_component() -> &'static [u8] {
    BUILTIN_PLUGINS
        .iter()
        .find(|p| p.name == "image")
        .expect("a built-in image plugin")
        .component
}

fn load(dir: &Path) -> LoadedPlugin {
    let cache = CompileCache::open(dir).unwrap();
    let sandbox = Arc::new(
        Sandbox::new(SandboxLimits::default())
            .unwrap()
            .with_compile_cache(cache),
    );
    LoadedPlugin::load(sandbox, image_component(), PluginOrigin::Builtin).unwrap()
}

/// What the plugin says of itself, asked anew (a call into the loaded code).
fn describe(plugin: &LoadedPlugin) -> String {
    format!("{:?}", plugin.describe().unwrap())
}

fn entries(dir: &Path) -> Vec<PathBuf> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    entries
}

#[test]
fn a_cached_plugin_loads_from_disk_and_a_damaged_entry_is_recompiled() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");

    let compiled = load(&dir);
    let stored = entries(&dir);
    assert_eq!(stored.len(), 1, "{stored:?}");
    let entry = stored[0].clone();
    let original = std::fs::read(&entry).unwrap();

    // From the cache: the same plugin, answering the same way.
    let cached = load(&dir);
    assert_eq!(describe(&cached), describe(&compiled));
    assert_eq!(cached.sha256(), compiled.sha256());
    assert_eq!(
        std::fs::read(&entry).unwrap(),
        original,
        "a hit rewrites nothing"
    );

    // A flipped byte deep in the compiled code, a truncated file, a file that is not an entry:
    // each is recompiled, the plugin works, and the entry is whole again.
    let mut flipped = original.clone();
    let middle = flipped.len() / 2;
    flipped[middle] ^= 0x40;
    for damaged in [
        flipped,
        original[..original.len() / 3].to_vec(),
        b"junk".to_vec(),
    ] {
        std::fs::write(&entry, &damaged).unwrap();
        let reloaded = load(&dir);
        assert_eq!(describe(&reloaded), describe(&compiled));
        assert_eq!(std::fs::read(&entry).unwrap(), original);
    }
    assert_eq!(entries(&dir), stored, "no stray temporary files");
}
