//! The plugins embedded in the binary, compiled by `build.rs` from the plugins workspace.

use std::path::Path;

/// One embedded plugin component.
pub struct BuiltinPlugin {
    /// The name the plugin describes itself with.
    pub name: &'static str,
    /// The wasm component bytes.
    pub component: &'static [u8],
}

include!(concat!(env!("OUT_DIR"), "/builtin_plugins.rs"));

/// The directory where this build put every plugin it compiled, the test-only ones included
/// (`testing.wasm`). Tests and benchmarks load those from here; nothing in production does.
pub fn artifact_dir() -> &'static Path {
    Path::new(env!("MMGATE_PLUGIN_ARTIFACTS"))
}
