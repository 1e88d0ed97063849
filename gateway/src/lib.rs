//! mmgate's gateway. The binary (`src/main.rs`) is its command line ([`cli`]); the fuzz targets
//! (`gateway/fuzz`) and the corpus replay test reach the parsers that see client and upstream bytes
//! through [`fuzzing`]. Everything else is private to the crate.

mod access;
mod api;
pub mod cli;
mod config;
mod console;
mod deadline;
mod draining;
mod ec_store;
mod error;
pub mod fuzzing;
mod keylimits;
pub mod logging;
mod metrics;
mod model;
mod responses_store;
mod server;
mod store;
mod telemetry;
mod tls_files;
mod upstream;
// The three layers a request passes: formats on the wire, media through the plugins, and
// native serving on this machine's devices.
mod media;
mod native;
mod prepare;
mod wire;
