//! Native serving: a model on this machine's devices (its family, encoders and engine) and the
//! chat route's preparation of a request for it, shared by `mmgate generate`.

mod bands;
pub mod chat;
pub mod model;
#[cfg(test)]
mod placement_tests;
mod plugin_output;
