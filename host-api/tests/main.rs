//! The plugin host's integration tests against the real sandbox and the built-in plugins: one test
//! binary, a module per subject (`cargo test -p mmgate-host --test host MODULE::` runs one).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

mod audio_parity;
mod builtin_audio;
mod builtin_image;
mod compile_cache;
mod image_parity;
mod reduce;
mod registry_reload;
mod sandbox;
mod video_parity;
