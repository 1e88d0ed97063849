//! `mmgate`: the multimodal LLM gateway's command line.

use std::process::ExitCode;

use clap::Parser;
use mmgate::cli;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    match cli::run(args) {
        Ok(code) => code,
        Err(error) => {
            // One line a person can act on; the chain says where it came from.
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}
