//! Native serving: a model on this machine's devices (its family, encoders and engine) and the
//! chat route's preparation of a request for it, shared by `mmgate generate`: the request's media
//! resolved within the limits ([`media`]), its text checked and templated ([`prompt_text`]), its
//! items planned and placed ([`chat`]), and the engine's events turned into text ([`generation`]).

mod bands;
pub mod chat;
pub mod errors;
pub mod generation;
pub mod media;
pub mod model;
#[cfg(test)]
mod placement_tests;
mod plugin_output;
pub mod prompt_text;
