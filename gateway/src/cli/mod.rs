//! Command-line parsing and dispatch.

mod generate;
mod plugin;
mod preprocess;
mod scaffold;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::config::Config;
use crate::logging::{self, LogFormat};

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

    /// Log lines as text or as JSON objects (default: `serve`'s config `log_format`, else text).
    #[arg(long, global = true, value_enum)]
    pub log_format: Option<LogFormat>,

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

/// Runs the command, logging as `--log` and `--log-format` (or `serve`'s config) say.
pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let filter = cli.log.as_deref();
    let tool_logging = || logging::init(filter, cli.log_format.unwrap_or_default());
    match cli.command {
        Command::Serve { config, listen } => {
            let config = match config {
                Some(path) => Config::load(&path),
                None => Ok(Config::default()),
            };
            let format = cli
                .log_format
                .or(config.as_ref().ok().map(|c| c.log_format));
            logging::init_with_traces(filter, format.unwrap_or_default())?;
            let mut config = config?;
            if let Some(listen) = listen {
                config.listen = listen;
            }
            crate::server::serve(config)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Plugin(command) => {
            tool_logging();
            plugin::run(command)
        }
        Command::Preprocess(args) => {
            tool_logging();
            preprocess::run(args)
        }
        Command::Generate(args) => {
            tool_logging();
            generate::run(args)
        }
    }
}
