//! Builds the plugins workspace (`../plugins`) for wasm32-wasip2 and embeds the built-in plugins.
//!
//! A plain `cargo build` of the host workspace is all anyone ever runs: this script invokes a nested
//! cargo on the plugins workspace (in its own target directory, so the two builds never contend for
//! one lock), copies the components into OUT_DIR and writes `builtin_plugins.rs`, which `include_bytes!`
//! the built-in ones. Test-only plugins are built too but only their directory is exported
//! (`MMGATE_PLUGIN_ARTIFACTS`), for tests and benchmarks.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Built-in plugins: (name the host registers, crate artifact name). Embedded in the binary.
const BUILTIN: &[(&str, &str)] = &[
    ("image", "mmgate_image_plugin"),
    ("video", "mmgate_video_plugin"),
    ("audio", "mmgate_audio_plugin"),
    ("document", "mmgate_document_plugin"),
];
/// Test-only plugins: built beside the built-ins, never embedded.
const TEST_ONLY: &[(&str, &str)] = &[
    ("testing", "mmgate_test_plugin"),
    ("testing-v0_1", "mmgate_test_plugin_v0_1"),
    ("testing-v0_2", "mmgate_test_plugin_v0_2"),
    ("testing-v0_3", "mmgate_test_plugin_v0_3"),
    ("testing-v0_4", "mmgate_test_plugin_v0_4"),
];

const WASM_TARGET: &str = "wasm32-wasip2";

fn main() {
    if let Err(message) = run() {
        // A build script's panic message is what cargo shows: make it the whole story.
        panic!("building the wasm plugins failed: {message}");
    }
}

fn run() -> Result<(), String> {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").map_err(|e| e.to_string())?);
    let root = manifest_dir
        .parent()
        .ok_or("host-api has no parent directory")?;
    let plugins = root.join("plugins");
    let out_dir = PathBuf::from(env::var("OUT_DIR").map_err(|e| e.to_string())?);
    if env::var_os("CARGO_FEATURE_BUILTIN").is_none() {
        // Without the `builtin` feature (the SDK's test harness): nothing is built or embedded.
        return write_builtin_table(&out_dir, &[], &out_dir);
    }

    println!(
        "cargo:rerun-if-changed={}",
        plugins.join("Cargo.toml").display()
    );
    println!(
        "cargo:rerun-if-changed={}",
        plugins.join("Cargo.lock").display()
    );
    for dir in [
        "sdk",
        "image",
        "video",
        "audio",
        "document",
        "testing",
        "testing-v0_1",
        "testing-v0_2",
        "testing-v0_3",
        "testing-v0_4",
    ] {
        let path = plugins.join(dir);
        if path.exists() {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
    println!("cargo:rerun-if-changed={}", root.join("wit").display());
    println!(
        "cargo:rerun-if-changed={}",
        manifest_dir.join("wit").display()
    );
    println!("cargo:rerun-if-env-changed=MMGATE_PLUGINS_PROFILE");

    check_wasm_target()?;
    let target_dir = plugin_target_dir(&out_dir)?;
    let profile = env::var("MMGATE_PLUGINS_PROFILE").unwrap_or_else(|_| "release".into());
    build_plugins(&plugins, &target_dir, &profile)?;

    let built = target_dir.join(WASM_TARGET).join(&profile);
    let artifacts = out_dir.join("plugins");
    fs::create_dir_all(&artifacts).map_err(|e| format!("{}: {e}", artifacts.display()))?;
    for (name, artifact) in BUILTIN.iter().chain(TEST_ONLY) {
        let from = built.join(format!("{artifact}.wasm"));
        let to = artifacts.join(format!("{name}.wasm"));
        fs::copy(&from, &to).map_err(|e| format!("copy {}: {e}", from.display()))?;
    }

    let names: Vec<&str> = BUILTIN.iter().map(|(name, _)| *name).collect();
    write_builtin_table(&out_dir, &names, &artifacts)
}

/// Writes `builtin_plugins.rs` (embedding `<artifacts>/<name>.wasm` for each name) and exports the
/// artifact directory to the crate.
fn write_builtin_table(out_dir: &Path, names: &[&str], artifacts: &Path) -> Result<(), String> {
    let mut code = String::from(
        "/// The built-in plugins, compiled for wasm32-wasip2 by the build script.\n\
         pub static BUILTIN_PLUGINS: &[BuiltinPlugin] = &[\n",
    );
    for name in names {
        let path = artifacts.join(format!("{name}.wasm"));
        writeln!(
            code,
            "    BuiltinPlugin {{ name: {name:?}, component: include_bytes!({:?}) }},",
            path.display().to_string()
        )
        .map_err(|e| e.to_string())?;
    }
    code.push_str("];\n");
    fs::write(out_dir.join("builtin_plugins.rs"), code).map_err(|e| e.to_string())?;
    println!(
        "cargo:rustc-env=MMGATE_PLUGIN_ARTIFACTS={}",
        artifacts.display()
    );
    Ok(())
}

/// Fails with the command that fixes it when the compiler has no standard library for the wasm target
/// (rustup adds a toolchain file's targets only when it installs the toolchain itself).
fn check_wasm_target() -> Result<(), String> {
    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let output = Command::new(&rustc)
        .args(["--print", "sysroot"])
        .output()
        .map_err(|e| format!("cannot run {rustc}: {e}"))?;
    let sysroot = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    let target_lib = Path::new(&sysroot)
        .join("lib")
        .join("rustlib")
        .join(WASM_TARGET)
        .join("lib");
    if !output.status.success() || target_lib.is_dir() {
        // A sysroot that cannot be read is left for the build itself to report.
        return Ok(());
    }
    let toolchain = env::var("RUSTUP_TOOLCHAIN").unwrap_or_else(|_| "<your toolchain>".into());
    Err(format!(
        "the {WASM_TARGET} target is not installed for Rust {toolchain} (no {}). Run \
         `rustup target add {WASM_TARGET} --toolchain {toolchain}`, or `./dev serve` / `./dev test`, \
         which add whatever rust-toolchain.toml names",
        target_lib.display()
    ))
}

/// `<target>/<profile>/wasm-plugins`: beside the host build, shared by every build script run of this
/// profile, so the nested build is incremental.
fn plugin_target_dir(out_dir: &Path) -> Result<PathBuf, String> {
    // OUT_DIR is <target>/<profile>/build/<pkg>-<hash>/out (with an extra <triple> when cross compiling).
    let profile_dir = out_dir
        .ancestors()
        .find(|p| p.file_name().is_some_and(|n| n == "build"))
        .and_then(Path::parent)
        .ok_or_else(|| format!("unexpected OUT_DIR layout: {}", out_dir.display()))?;
    Ok(profile_dir.join("wasm-plugins"))
}

fn build_plugins(plugins: &Path, target_dir: &Path, profile: &str) -> Result<(), String> {
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(plugins)
        .args([
            "build",
            "--locked",
            "--target",
            WASM_TARGET,
            "--profile",
            profile,
        ])
        .arg("--target-dir")
        .arg(target_dir);
    // The outer build's settings are for the host target: none of them may leak into the wasm build.
    for (key, _) in env::vars_os() {
        let key = key.to_string_lossy();
        let outer = key.starts_with("CARGO_")
            && !matches!(
                key.as_ref(),
                "CARGO_HOME" | "CARGO_NET_OFFLINE" | "CARGO_TERM_COLOR"
            );
        if outer
            || matches!(
                key.as_ref(),
                "RUSTFLAGS"
                    | "RUSTC_WRAPPER"
                    | "RUSTC_WORKSPACE_WRAPPER"
                    | "RUSTDOCFLAGS"
                    | "RUSTC"
                    | "TARGET"
                    | "HOST"
                    | "OUT_DIR"
                    | "OPT_LEVEL"
                    | "PROFILE"
                    | "DEBUG"
            )
        {
            cmd.env_remove(key.as_ref());
        }
    }
    // Anything on a build script's stdout is read as cargo instructions: keep the nested build's off it.
    cmd.stdout(std::process::Stdio::from(std::io::stderr()));
    let status = cmd
        .status()
        .map_err(|e| format!("cannot run cargo for the plugins workspace: {e}"))?;
    if !status.success() {
        return Err(format!(
            "`cargo build --target {WASM_TARGET}` in {} failed ({status}); is the {WASM_TARGET} target \
             installed? rust-toolchain.toml asks rustup for it",
            plugins.display()
        ));
    }
    Ok(())
}
