//! `mmgate-host`: the sandboxed WebAssembly plugin host of mmgate.
//!
//! - [`contract`]: the plugin contract (`wit/modality.wit`) as Rust types, and its version rules;
//! - [`tensor`]: what the host checks and reads of the tensors a plugin returns;
//! - [`sandbox`]: the wasmtime engine, per-call limits, and the state every call's store holds;
//! - [`compile_cache`]: compiled plugins kept on disk between runs, checked before they are loaded;
//! - [`plugin`]: loading one component and calling its exports, each call in a fresh store;
//! - [`manifest`] and [`registry`]: the built-in plugins plus a plugin directory;
//! - [`component`]: building a plugin crate into a component (`mmgate plugin build`, the SDK's harness);
//! - [`pool`]: the bounded thread pool plugin calls run on, away from async reactors;
//! - [`video`]: the FFmpeg video decoder plugins import (contract 0.2);
//! - [`image`]: the libjpeg-turbo JPEG decoder plugins import (contract 0.3.1), and Pillow's
//!   resize of what it decodes (0.5.1);
//! - [`audio`]: Whisper's log-mel spectrogram, computed natively for plugins (0.5.1);
//! - [`error`]: what can go wrong, typed.
//!
//! A host capability is one module ([`video`], [`image`], [`audio`]): what one call holds of it (its limits,
//! its open resources), which the call's state keeps as one field, and its interface's `Host` impls
//! on a view of that share and of the parts of the call it uses (the resource table, the call's
//! clock), as wasmtime-wasi's `WasiView` does. A capability does not know the call's state: the
//! linker in [`sandbox`] links each interface with a getter that lends the call's state as that
//! capability's view. So a new capability adds its interface to `wit/`, its module (share, view,
//! impls), its limits in [`SandboxLimits`], that field, and one line per contract version in the
//! linker.
//!
//! The modules depend one way, none on a module listed after it here: [`contract`] (the bindings),
//! [`error`], the call's clock, [`tensor`] and the capabilities, [`sandbox`], then [`plugin`] and
//! what loads, registers and runs plugins.
//!
//! This crate knows nothing of HTTP or models: the gateway drives it, the inference core consumes the
//! tensors it returns.

pub mod audio;
pub mod builtin;
mod call_clock;
pub mod compile_cache;
pub mod component;
pub mod contract;
pub mod error;
pub mod image;
pub mod manifest;
pub mod plugin;
pub mod pool;
pub mod priority;
pub mod registry;
pub mod sandbox;
pub mod tensor;
pub mod video;

pub use compile_cache::{CacheError, CompileCache};
pub use contract::{
    Budget, CONTRACT_VERSION, Descriptor, Dtype, Media, MediaInfo, PartPlan, PluginError,
    ReducedItem, Tensor, TokenPlan, Version,
};
pub use error::{CallError, DeadlineClock, DeadlinePassed, LoadError};
pub use manifest::Manifest;
pub use plugin::{LoadedPlugin, PluginOrigin, tensor_bytes};
pub use pool::{PluginPool, Started};
pub use registry::{PluginRegistry, Rejected};
pub use sandbox::{Sandbox, SandboxLimits};
pub use tensor::{
    ByteSamples, REPEATS_SUFFIX, TABLE_SUFFIX, companion_of, f32_values, le_f32s, le_i64s,
    with_f32_values,
};
