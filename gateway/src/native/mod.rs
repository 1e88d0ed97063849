//! Native serving: a request prepared for the engine of a model on this machine's devices (its
//! items made into tensors and placed in the prompt: [`chat`], which `mmgate generate` shares), and
//! the engine's events turned into text ([`generation`]).

pub mod chat;
pub mod generation;
#[cfg(test)]
mod placement_tests;
