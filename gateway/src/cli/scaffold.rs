//! `mmgate plugin new NAME`: a ready-to-build plugin project from the template in `template/`.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

/// (path inside the project, template text with `{{placeholders}}`).
const FILES: &[(&str, &str)] = &[
    ("Cargo.toml", include_str!("template/Cargo.toml.tmpl")),
    (
        "rust-toolchain.toml",
        include_str!("template/rust-toolchain.toml.tmpl"),
    ),
    (".gitignore", include_str!("template/gitignore.tmpl")),
    ("README.md", include_str!("template/README.md.tmpl")),
    ("src/lib.rs", include_str!("template/lib.rs.tmpl")),
    ("tests/plugin.rs", include_str!("template/test.rs.tmpl")),
];

/// (path inside the project, bytes written as they are).
const DATA: &[(&str, &[u8])] = &[(
    "tests/data/sample.png",
    include_bytes!("template/sample.png"),
)];

/// The toolchain the template pins: the one mmgate itself is built with.
fn toolchain() -> String {
    let pinned: Option<toml::Value> =
        toml::from_str(include_str!("../../../rust-toolchain.toml")).ok();
    pinned
        .as_ref()
        .and_then(|t| t.get("toolchain")?.get("channel")?.as_str())
        .unwrap_or("stable")
        .to_owned()
}

/// Where the SDK of the source tree this binary was built from is, when that tree is still there.
pub fn source_tree_sdk() -> Option<PathBuf> {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../plugins/sdk")
        .canonicalize()
        .ok()
        .filter(|sdk| sdk.join("Cargo.toml").is_file())
}

/// A plugin name: what `describe()` returns, the manifest's name, the crate's name.
fn check_name(name: &str) -> anyhow::Result<()> {
    let valid = name.len() <= 64
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !name.ends_with('-');
    if !valid {
        bail!(
            "plugin name {name:?}: use lowercase letters, digits and '-', starting with a letter \
             (at most 64 characters)"
        );
    }
    Ok(())
}

/// Writes the project `dir` (which must not exist yet) for plugin `name`, depending on the SDK at `sdk`.
pub fn create(name: &str, dir: &Path, sdk: &Path) -> anyhow::Result<()> {
    check_name(name)?;
    if dir.exists() {
        bail!("{} already exists", dir.display());
    }
    if !sdk.join("Cargo.toml").is_file() {
        bail!(
            "{} is not the mmgate plugin SDK (no Cargo.toml)",
            sdk.display()
        );
    }
    let sdk = sdk
        .canonicalize()
        .with_context(|| format!("cannot resolve {}", sdk.display()))?;
    // A TOML string, quoted and escaped (paths may hold quotes or backslashes).
    let sdk_path = toml::Value::String(sdk.display().to_string()).to_string();
    for (path, template) in FILES {
        let text = template
            .replace("{{name}}", name)
            .replace("{{sdk_path}}", &sdk_path)
            .replace("{{toolchain}}", &toolchain());
        write(&dir.join(path), text.as_bytes())?;
    }
    for (path, bytes) in DATA {
        write(&dir.join(path), bytes)?;
    }
    Ok(())
}

fn write(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create {}", parent.display()))?;
    }
    std::fs::write(path, bytes).with_context(|| format!("cannot write {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_crate_and_manifest_safe() {
        for good in ["tiles", "internvl-tiles", "a1"] {
            assert!(check_name(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "Tiles",
            "1tiles",
            "tiles-",
            "ti les",
            "ti_les",
            "../x",
            &"a".repeat(65),
        ] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn every_placeholder_is_filled() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let Some(sdk) = source_tree_sdk() else {
            panic!("the SDK is part of this source tree");
        };
        let project = dir.path().join("p");
        create("my-plugin", &project, &sdk).unwrap_or_else(|e| panic!("{e:#}"));
        for (path, _) in FILES {
            let text = std::fs::read_to_string(project.join(path)).unwrap_or_default();
            assert!(!text.contains("{{"), "{path} keeps a placeholder");
        }
        let manifest = std::fs::read_to_string(project.join("Cargo.toml")).unwrap_or_default();
        let manifest: toml::Value = toml::from_str(&manifest).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(manifest["package"]["name"].as_str(), Some("my-plugin"));
        assert!(
            create("my-plugin", &project, &sdk).is_err(),
            "an existing directory is kept"
        );
        assert_ne!(toolchain(), "stable", "the pinned channel is read");
    }
}
