//! Building a plugin crate into the component the host loads: `cargo build --release --target
//! wasm32-wasip2`, then finding the `.wasm` cargo wrote. Shared by `mmgate plugin build` and the SDK's
//! test harness, so an author's tests load exactly what ships.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The target every plugin is compiled for.
pub const WASM_TARGET: &str = "wasm32-wasip2";

/// Why a plugin crate could not be built into a component.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("{0} has no Cargo.toml: not a plugin crate")]
    NotACrate(PathBuf),
    #[error("cannot run cargo: {0}")]
    Spawn(std::io::Error),
    #[error(
        "`cargo build --release --target {WASM_TARGET}` failed in {dir} ({status}); \
         the compiler's messages are above"
    )]
    Failed {
        dir: PathBuf,
        status: std::process::ExitStatus,
    },
    #[error(
        "cargo built {dir} but produced no .wasm component: is its [lib] crate-type \"cdylib\"?"
    )]
    NoComponent { dir: PathBuf },
}

/// How to build.
#[derive(Debug, Clone, Default)]
pub struct BuildOptions {
    /// Cargo's target directory (default: cargo's own choice, i.e. `CARGO_TARGET_DIR` or the crate's
    /// `target/`).
    pub target_dir: Option<PathBuf>,
    /// Pass `--locked` (the crate's Cargo.lock must be up to date).
    pub locked: bool,
}

/// Builds the plugin crate in `crate_dir` in release mode for [`WASM_TARGET`] and returns the path of
/// the component. Cargo's progress and diagnostics go to stderr as usual.
pub fn build_component(crate_dir: &Path, options: &BuildOptions) -> Result<PathBuf, BuildError> {
    // Absolute, because cargo runs inside the crate (to pick up its rust-toolchain.toml and
    // .cargo/config.toml), where a relative path would no longer point at it.
    let crate_dir = crate_dir
        .canonicalize()
        .map_err(|_| BuildError::NotACrate(crate_dir.to_owned()))?;
    let crate_dir = crate_dir.as_path();
    let manifest = crate_dir.join("Cargo.toml");
    if !manifest.is_file() {
        return Err(BuildError::NotACrate(crate_dir.to_owned()));
    }
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut command = Command::new(cargo);
    command
        .current_dir(crate_dir)
        .args(["build", "--release", "--target", WASM_TARGET])
        .args(["--message-format", "json-render-diagnostics"])
        .arg("--manifest-path")
        .arg(&manifest)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if options.locked {
        command.arg("--locked");
    }
    if let Some(dir) = &options.target_dir {
        command.arg("--target-dir").arg(dir);
    }
    // Inside `cargo test` (the SDK's harness) the outer cargo's per-package variables are set; the
    // nested build must not read them as its own.
    for key in [
        "CARGO_MANIFEST_DIR",
        "CARGO_PRIMARY_PACKAGE",
        "CARGO_TARGET_TMPDIR",
    ] {
        command.env_remove(key);
    }
    let mut child = command.spawn().map_err(BuildError::Spawn)?;
    let mut component = None;
    if let Some(stdout) = child.stdout.take() {
        for line in std::io::BufReader::new(stdout).lines() {
            let line = line.map_err(BuildError::Spawn)?;
            if let Some(wasm) = component_artifact(&line, &manifest) {
                component = Some(wasm);
            }
        }
    }
    let status = child.wait().map_err(BuildError::Spawn)?;
    if !status.success() {
        return Err(BuildError::Failed {
            dir: crate_dir.to_owned(),
            status,
        });
    }
    component.ok_or_else(|| BuildError::NoComponent {
        dir: crate_dir.to_owned(),
    })
}

/// The `.wasm` of a `compiler-artifact` message about the crate of `manifest`, if `line` is one.
fn component_artifact(line: &str, manifest: &Path) -> Option<PathBuf> {
    let message: serde_json::Value = serde_json::from_str(line).ok()?;
    if message["reason"] != "compiler-artifact" {
        return None;
    }
    // `manifest` is canonical (see `build_component`).
    let ours = message["manifest_path"]
        .as_str()
        .and_then(|path| Path::new(path).canonicalize().ok())
        .is_some_and(|path| path == manifest);
    if !ours {
        return None;
    }
    message["filenames"]
        .as_array()?
        .iter()
        .filter_map(|f| f.as_str())
        .find(|f| f.ends_with(".wasm"))
        .map(PathBuf::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_component_of_the_crate_built_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let manifest = dir.path().join("Cargo.toml");
        std::fs::write(&manifest, "").unwrap_or_else(|e| panic!("{e}"));
        let manifest = manifest.canonicalize().unwrap_or_else(|e| panic!("{e}"));
        let ours = serde_json::json!({
            "reason": "compiler-artifact",
            "manifest_path": manifest,
            "filenames": ["/t/wasm32-wasip2/release/libx.rlib", "/t/wasm32-wasip2/release/x.wasm"],
        });
        assert_eq!(
            component_artifact(&ours.to_string(), &manifest),
            Some(PathBuf::from("/t/wasm32-wasip2/release/x.wasm"))
        );
        let dependency = serde_json::json!({
            "reason": "compiler-artifact",
            "manifest_path": "/registry/serde/Cargo.toml",
            "filenames": ["/t/dep.wasm"],
        });
        assert_eq!(component_artifact(&dependency.to_string(), &manifest), None);
        assert_eq!(component_artifact("not json", &manifest), None);
        let finished = serde_json::json!({"reason": "build-finished", "success": true});
        assert_eq!(component_artifact(&finished.to_string(), &manifest), None);
    }
}
