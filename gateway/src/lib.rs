//! mmgate's gateway. The binary (`src/main.rs`) is its command line ([`cli`]); the fuzz targets
//! (`gateway/fuzz`) and the corpus replay test reach the parsers that see client and upstream bytes
//! through [`fuzzing`]. Everything else is private to the crate.

mod api;
mod budget;
mod chat;
pub mod cli;
mod config;
mod error;
mod feature_cache;
mod fetch;
mod files;
pub mod fuzzing;
mod http1;
mod keylimits;
pub mod logging;
mod media;
mod metrics;
mod model;
mod openai;
mod pipeline;
mod plugins;
mod server;
mod store;
mod torchfile;
mod upstream;
