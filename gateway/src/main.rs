//! `mmgate`: the multimodal LLM gateway's command line.

mod api;
mod budget;
mod chat;
mod cli;
mod config;
mod error;
mod fetch;
mod files;
mod http1;
mod logging;
mod media;
mod metrics;
mod model;
mod openai;
mod pipeline;
mod plugins;
mod server;
mod torchfile;
mod upstream;

use std::process::ExitCode;

use clap::Parser;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    logging::init(args.log.as_deref());
    match cli::run(args) {
        Ok(code) => code,
        Err(error) => {
            // One line a person can act on; the chain says where it came from.
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}
