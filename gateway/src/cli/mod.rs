//! Command-line parsing and dispatch.

mod generate;
mod plugin;
mod preprocess;
mod render;
mod scaffold;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::config::Config;

#[derive(Parser, Debug)]
#[command(
    name = "mmgate",
    version,
    about = "A multimodal LLM gateway with sandboxed WebAssembly preprocessing plugins"
)]
pub struct Cli {
    /// Log filter, e.g. `info` or `mmgate=debug` (default: $RUST_LOG, else `info`).
    #[arg(long, global = true)]
    pub log: Option<String>,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run the gateway (with no config: the embedded default on 127.0.0.1:8080).
    Serve {
        /// A TOML config file.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Address to listen on (overrides the config).
        #[arg(long)]
        listen: Option<SocketAddr>,
    },
    /// Manage and inspect modality plugins.
    #[command(subcommand)]
    Plugin(plugin::PluginCommand),
    /// Preprocess one media file as a request would and write its tensors as safetensors.
    Preprocess(preprocess::PreprocessArgs),
    /// Generate a reply with the native inference core (plugins + encoders + LLM in this process);
    /// prints one JSON line.
    Generate(generate::GenerateArgs),
}

pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Serve { config, listen } => {
            let mut config = match config {
                Some(path) => Config::load(&path)?,
                None => Config::default(),
            };
            if let Some(listen) = listen {
                config.listen = listen;
            }
            crate::server::serve(config)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Plugin(command) => plugin::run(command),
        Command::Preprocess(args) => preprocess::run(args),
        Command::Generate(args) => generate::run(args),
    }
}
