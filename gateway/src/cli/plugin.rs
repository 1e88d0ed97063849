//! `mmgate plugin list` and `mmgate plugin check`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::Subcommand;
use mmgate_host::{
    CONTRACT_VERSION, LoadedPlugin, Manifest, PluginOrigin, PluginRegistry, Sandbox, SandboxLimits,
    registry,
};
use serde_json::json;

#[derive(Subcommand, Debug)]
pub enum PluginCommand {
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
    let sandbox = Arc::new(Sandbox::new(SandboxLimits::default())?);
    match command {
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
