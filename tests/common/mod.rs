//! What the end-to-end tests share: running the real `mmgate` binary.
// Each test file is its own crate and uses only part of this module.
#![allow(dead_code)]

pub mod engine;
pub mod files_server;
pub mod redis;
pub mod server;

use std::process::{Command, Output};

/// The built `mmgate` binary, with logs quiet enough that stderr carries only what a test checks.
pub fn mmgate_command() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_mmgate"));
    command.env("RUST_LOG", "warn");
    command
}

/// The bytes of `tests/fixtures/<path>`.
pub fn fixture(path: &str) -> Vec<u8> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
    std::fs::read(root.join(path)).unwrap_or_else(|e| panic!("fixture {path}: {e}"))
}

/// Runs `mmgate ARGS...` to completion.
pub fn mmgate(args: &[&str]) -> Output {
    mmgate_command().args(args).output().expect("run mmgate")
}

/// Sets its flag when dropped, a panic's unwinding included: threads a test started to load the
/// machine stop however the test ends.
pub struct StopOnDrop<'a>(pub &'a std::sync::atomic::AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}
