//! Logging through the host: lines land in the gateway's log, tagged with the plugin's name.

use crate::bindings::mmgate::modality::host::{self, LogLevel};

/// Log `message` at `level`.
pub fn log(level: LogLevel, message: &str) {
    host::log(level, message);
}

pub fn debug(message: &str) {
    log(LogLevel::Debug, message);
}

pub fn info(message: &str) {
    log(LogLevel::Info, message);
}

pub fn warn(message: &str) {
    log(LogLevel::Warn, message);
}

/// Nanoseconds on the host's monotonic clock (arbitrary origin): for timing work inside a call.
pub fn monotonic_now_ns() -> u64 {
    host::monotonic_now()
}

/// Nanoseconds left before the host interrupts the current call.
pub fn time_remaining_ns() -> u64 {
    host::time_remaining()
}
