//! `mmgate`: the multimodal LLM gateway's command line.

mod budget;
mod cli;
mod config;
mod error;
mod media;
mod model;
mod pipeline;
mod plugins;
mod server;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    cli::init_logging(args.log.as_deref());
    match cli::run(args) {
        Ok(code) => code,
        Err(error) => {
            // One line a person can act on; the chain says where it came from.
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}
