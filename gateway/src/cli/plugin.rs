//! `mmgate plugin new|build|check|list`: writing, building, validating and listing plugins.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::Subcommand;
use mmgate_host::component::{BuildOptions, build_component};
use mmgate_host::{
    CONTRACT_VERSION, LoadedPlugin, Manifest, PluginOrigin, PluginRegistry, Sandbox, SandboxLimits,
    registry,
};
use serde_json::json;

use super::scaffold;
use crate::config::PluginsConfig;

#[derive(Subcommand, Debug)]
pub enum PluginCommand {
    /// Write a ready-to-build plugin project (Cargo.toml, src, a test under the real host).
    New {
        /// The plugin's name (lowercase letters, digits, '-').
        name: String,
        /// Where to create the project (default: ./NAME).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// The mmgate plugin SDK to depend on (default: the SDK of the source tree mmgate was built
        /// from).
        #[arg(long)]
        sdk: Option<PathBuf>,
    },
    /// Build a plugin project for wasm32-wasip2 and write its component and manifest (with sha256).
    Build {
        /// The plugin project (a directory with Cargo.toml).
        #[arg(default_value = ".")]
        dir: PathBuf,
        /// Where to write NAME.wasm and NAME.toml (default: DIR/dist). A gateway's plugin directory
        /// works: both files are replaced atomically, the component first.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Require the project's Cargo.lock to be up to date.
        #[arg(long)]
        locked: bool,
    },
    /// List the built-in plugins and those of a plugin directory.
    List {
        /// A plugin directory to load as well (`*.toml` manifests beside `.wasm` components).
        #[arg(long)]
        plugin_dir: Option<PathBuf>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Load a plugin component, validate it against the contract, and print what it describes.
    Check {
        /// The `.wasm` component.
        file: PathBuf,
        /// A manifest to verify it against (default: `<file stem>.toml` beside it, if present).
        #[arg(long)]
        manifest: Option<PathBuf>,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

pub fn run(command: PluginCommand) -> anyhow::Result<ExitCode> {
    let sandbox =
        crate::media::plugins::sandbox(SandboxLimits::default(), &PluginsConfig::default())?;
    match command {
        PluginCommand::New { name, dir, sdk } => {
            let dir = dir.unwrap_or_else(|| PathBuf::from(&name));
            let sdk = sdk.or_else(scaffold::source_tree_sdk).context(
                "this mmgate was not built from a source tree that still exists: pass --sdk with \
                 the path of an mmgate checkout's plugins/sdk",
            )?;
            scaffold::create(&name, &dir, &sdk)?;
            println!("created plugin {name} in {}", dir.display());
            println!("  cargo test                       # under the real host");
            println!("  mmgate plugin build {} --out PLUGIN_DIR", dir.display());
            Ok(ExitCode::SUCCESS)
        }
        PluginCommand::Build { dir, out, locked } => {
            let out = out.unwrap_or_else(|| dir.join("dist"));
            let built = build(&sandbox, &dir, &out, locked)?;
            println!(
                "built {} {} → {} (sha256 {})",
                built.name,
                built.version,
                built.component.display(),
                built.sha256
            );
            println!("manifest {}", built.manifest.display());
            Ok(ExitCode::SUCCESS)
        }
        PluginCommand::List { plugin_dir, json } => {
            let registry = match &plugin_dir {
                Some(dir) => PluginRegistry::with_dir(&sandbox, dir),
                None => PluginRegistry::builtin(&sandbox),
            }?;
            print_list(&registry, json);
            Ok(ExitCode::SUCCESS)
        }
        PluginCommand::Check {
            file,
            manifest,
            json,
        } => {
            let plugin = check(&sandbox, &file, manifest.as_deref())?;
            print_check(&plugin, json);
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// What `plugin build` wrote.
struct Built {
    name: String,
    version: String,
    sha256: String,
    component: PathBuf,
    manifest: PathBuf,
}

/// Builds the project, loads the component into the sandbox (so a component the gateway would refuse
/// is refused here), then writes NAME.wasm and NAME.toml into `out`.
fn build(sandbox: &Arc<Sandbox>, dir: &Path, out: &Path, locked: bool) -> anyhow::Result<Built> {
    let options = BuildOptions {
        target_dir: None,
        locked,
    };
    let wasm = build_component(dir, &options)?;
    let bytes = std::fs::read(&wasm).with_context(|| format!("cannot read {}", wasm.display()))?;
    let plugin = LoadedPlugin::load(sandbox.clone(), &bytes, PluginOrigin::File(wasm.clone()))
        .context("the component does not load")?;
    let name = plugin.name().to_owned();
    let file = format!("{name}.wasm");
    let manifest = Manifest::for_component(plugin.descriptor(), plugin.sha256(), &file);
    let manifest_text = toml::to_string(&manifest).context("cannot write the manifest")?;
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    // The component before the manifest that pins it: a gateway watching `out` never sees a manifest
    // whose component is not there yet (and a half-written file is never visible, only renamed ones).
    let component = out.join(&file);
    write_atomically(&component, &bytes)?;
    let manifest_path = out.join(format!("{name}.toml"));
    write_atomically(&manifest_path, manifest_text.as_bytes())?;
    Ok(Built {
        name,
        version: plugin.descriptor().version.clone(),
        sha256: plugin.sha256().to_owned(),
        component,
        manifest: manifest_path,
    })
}

/// Write to a temporary file beside `path`, then rename it over `path`.
fn write_atomically(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let temporary = path.with_file_name(format!(".{file_name}.partial"));
    std::fs::write(&temporary, bytes)
        .with_context(|| format!("cannot write {}", temporary.display()))?;
    std::fs::rename(&temporary, path)
        .with_context(|| format!("cannot move {} into place", path.display()))
}

fn check(
    sandbox: &Arc<Sandbox>,
    file: &Path,
    manifest: Option<&Path>,
) -> anyhow::Result<LoadedPlugin> {
    let bytes = std::fs::read(file).with_context(|| format!("cannot read {}", file.display()))?;
    let sibling = file.with_extension("toml");
    let manifest_path = manifest
        .map(Path::to_owned)
        .or_else(|| sibling.is_file().then_some(sibling));
    let manifest = manifest_path
        .as_deref()
        .map(|path| Manifest::read(path).map(|m| (path, m)))
        .transpose()?;
    let manifest = manifest.as_ref().map(|(path, m)| (*path, m));
    Ok(registry::load_verified(
        sandbox,
        &bytes,
        PluginOrigin::File(file.to_owned()),
        manifest,
    )?)
}

fn plugin_json(plugin: &LoadedPlugin) -> serde_json::Value {
    let d = plugin.descriptor();
    json!({
        "name": d.name,
        "version": d.version,
        "description": d.description,
        "contract_version": plugin.contract_version().to_string(),
        "modalities": d.modalities,
        "mime_types": d.mime_types,
        "processor_types": d.processor_types,
        "origin": plugin.origin().to_string(),
        "sha256": plugin.sha256(),
    })
}

fn print_list(registry: &PluginRegistry, json: bool) {
    if json {
        let plugins: Vec<_> = registry.iter().map(|p| plugin_json(p)).collect();
        let out =
            json!({ "host_contract_version": CONTRACT_VERSION.to_string(), "plugins": plugins });
        println!("{out:#}");
        return;
    }
    println!("host contract version {CONTRACT_VERSION}");
    println!(
        "{:<16} {:<9} {:<9} {:<16} {:<10} SHA256",
        "NAME", "VERSION", "CONTRACT", "MODALITIES", "ORIGIN"
    );
    for plugin in registry.iter() {
        let d = plugin.descriptor();
        println!(
            "{:<16} {:<9} {:<9} {:<16} {:<10} {}",
            d.name,
            d.version,
            plugin.contract_version().to_string(),
            d.modalities.join(","),
            match plugin.origin() {
                PluginOrigin::Builtin => "built-in".to_owned(),
                PluginOrigin::File(path) => path.display().to_string(),
            },
            &plugin.sha256()[..16],
        );
    }
}

fn print_check(plugin: &LoadedPlugin, json: bool) {
    if json {
        println!("{:#}", plugin_json(plugin));
        return;
    }
    let d = plugin.descriptor();
    println!("ok: {} {} — {}", d.name, d.version, d.description);
    println!(
        "  contract:        {} (host {CONTRACT_VERSION})",
        plugin.contract_version()
    );
    println!("  modalities:      {}", d.modalities.join(", "));
    println!("  mime types:      {}", d.mime_types.join(", "));
    println!("  processor types: {}", d.processor_types.join(", "));
    println!("  sha256:          {}", plugin.sha256());
}
