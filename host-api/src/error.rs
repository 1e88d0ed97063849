//! Typed errors of the plugin host: loading a plugin, and calling one.

use std::path::PathBuf;
use std::time::Duration;

use crate::contract::PluginError;

/// Why one plugin call failed. Every case ends that call only: the host and other calls go on.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The call ran past its deadline and was stopped: a stuck or hostile plugin, or a server too
    /// loaded to finish in time; not something the media alone decides (its cost is bounded by
    /// the limits, checked on what the client sent).
    #[error("{0}")]
    Deadline(DeadlinePassed),
    /// The plugin tried to grow its memory past the cap.
    #[error("plugin tried to use more than its memory limit of {limit} bytes")]
    Memory { limit: usize },
    /// The plugin trapped (a panic, an out-of-bounds access, a stack overflow, ...).
    #[error("plugin crashed: {0}")]
    Trap(String),
    /// The plugin returned a typed error: its message is meant for the client.
    #[error("{}", .0.message())]
    Plugin(PluginError),
    /// The plugin returned more bytes than the host accepts from one call. `size` is exact up to
    /// `limit` + 16 MiB; beyond that the copy is cut off there and `size` says so much at least.
    #[error("plugin returned {size} bytes or more, over the limit of {limit}")]
    OutputTooLarge { size: usize, limit: usize },
    /// The plugin returned something the contract forbids (e.g. a tensor whose bytes do not match its
    /// shape).
    #[error("plugin broke the contract: {0}")]
    Contract(String),
    /// Every plugin worker is busy and the queue is full.
    #[error("plugin workers are saturated ({queued} calls queued); try again")]
    Overloaded { queued: usize },
    /// The host itself failed (e.g. the pool shut down).
    #[error("plugin host error: {0}")]
    Host(String),
}

/// Which deadline a call ran past, in which call, after how long.
#[derive(Debug, Clone, PartialEq)]
pub struct DeadlinePassed {
    pub plugin: String,
    /// The contract function called (`probe`, `preprocess`, `preprocess-part`, ...).
    pub call: &'static str,
    pub clock: DeadlineClock,
    pub limit: Duration,
    /// Time on that clock when the call was stopped.
    pub spent: Duration,
}

/// The two clocks a call is held to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadlineClock {
    /// The plugin's own code: its thread's CPU time less what host capabilities (video and image
    /// decoding) spent for it, so a loaded machine does not fail work it will finish.
    PluginCpu,
    /// Wall-clock time, host work included: the backstop for a call that makes no progress.
    Wall,
}

impl std::fmt::Display for DeadlinePassed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let clock = match self.clock {
            DeadlineClock::PluginCpu => "its own CPU time",
            DeadlineClock::Wall => "wall-clock time",
        };
        write!(
            f,
            "plugin {} was stopped in {} after {} ms of {clock} (the limit is {} ms)",
            self.plugin,
            self.call,
            self.spent.as_millis(),
            self.limit.as_millis()
        )
    }
}

/// Why a plugin could not be loaded. Loading never panics and never leaves a half-registered plugin.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot read {path}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The bytes are not a valid WebAssembly component (a core module, garbage, or unsupported features).
    #[error("{origin} is not a valid WebAssembly component: {reason}")]
    InvalidComponent { origin: String, reason: String },
    /// The component is not a plugin of a contract version this host implements, or needs imports the
    /// host does not provide.
    #[error("{origin}: {reason}")]
    ContractMismatch { origin: String, reason: String },
    /// The manifest is unreadable, or disagrees with the component.
    #[error("manifest {path}: {reason}")]
    Manifest { path: PathBuf, reason: String },
    /// `describe()` itself failed.
    #[error("{origin}: describe() failed")]
    Describe { origin: String, source: CallError },
    /// Two plugins claim the same name in one directory.
    #[error("plugin name {name:?} is defined twice ({first} and {second})")]
    Duplicate {
        name: String,
        first: String,
        second: String,
    },
    /// The engine could not be configured (should not happen with valid limits).
    #[error("cannot create the wasm engine: {0}")]
    Engine(String),
}
