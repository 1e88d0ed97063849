//! The mmgate plugin SDK: everything a modality plugin needs to talk to the host.
//!
//! A plugin implements [`Plugin`] (the contract's exported interface) for a type of its own and exports
//! it with [`export_plugin!`]:
//!
//! ```ignore
//! use mmgate_plugin_sdk::*;
//!
//! struct MyPlugin;
//! impl Plugin for MyPlugin { /* describe, probe, plan, preprocess; reduce if it can */ }
//! mmgate_plugin_sdk::export_plugin!(MyPlugin);
//! ```
//!
//! and is built with `cargo build --release --target wasm32-wasip2` into a component the host loads.
//! The contract itself, with every type documented, is `wit/modality.wit`.

#[cfg(all(feature = "harness", not(target_arch = "wasm32")))]
pub mod harness;
#[cfg(feature = "image")]
pub mod imagedecode;
pub mod imageops;
pub mod log;
mod tensor;
pub mod video;

/// Generated bindings of the `modality-plugin` world (the contract in `wit/modality.wit`).
pub mod bindings {
    wit_bindgen::generate!({
        world: "modality-plugin",
        path: "../../wit",
        pub_export_macro: true,
        export_macro_name: "export_bindings",
        default_bindings_module: "mmgate_plugin_sdk::bindings",
    });
}

#[cfg(feature = "files")]
pub mod files;

pub use bindings::mmgate::modality::types::{
    Budget, Descriptor, Dtype, Media, MediaInfo, OverBudget, PartPlan, PluginError,
    ProcessorConfig, ReducedItem, Tensor, TokenPlan,
};

/// The functions a plugin exports (the contract's `plugin` interface), as a plugin author writes
/// them. Unlike the generated bindings' trait, functions a contract version added carry a default,
/// so a plugin written for an earlier version builds unchanged against this one: one that does not
/// implement [`Plugin::reduce`] answers `unsupported` (its models can still be served natively).
pub trait Plugin {
    /// Describe the plugin. Must be cheap and must not fail.
    fn describe() -> Descriptor;

    /// Read the header of `media` and report what it is, without decoding the whole item.
    fn probe(media: Media) -> PluginResult<MediaInfo>;

    /// Decide what to produce within `budget` and its exact token count. Deterministic.
    fn plan(info: MediaInfo, budget: Budget, config: ProcessorConfig) -> PluginResult<TokenPlan>;

    /// Decode `media` and produce the tensors `plan` promised.
    fn preprocess(
        media: Media,
        plan: TokenPlan,
        config: ProcessorConfig,
    ) -> PluginResult<Vec<Tensor>>;

    /// Decode `media` and hand back the item `plan` chose as files a model server reads as that
    /// item (see [`files`] for the encoders); that server's processor must make `plan.tokens`.
    fn reduce(media: Media, plan: TokenPlan, config: ProcessorConfig) -> PluginResult<ReducedItem> {
        let _ = (media, plan, config);
        Err(PluginError::unsupported(
            "this plugin does not hand back reduced media (it implements no reduce)",
        ))
    }

    /// How many independent parts `plan`'s tensors come in (see [`Plugin::preprocess_part`]): 1,
    /// the item made whole, unless the plugin splits it. Cheap and deterministic: no decoding.
    fn parts(plan: TokenPlan, config: ProcessorConfig) -> PluginResult<u32> {
        let _ = (plan, config);
        Ok(1)
    }

    /// The tensors of part `index` of the planned item: what [`Plugin::preprocess`] makes of that
    /// piece alone (a video's run of temporal patches with its own grid, an audio file's chunk),
    /// so that the parts' tensors in order hold exactly the whole's values. The host runs parts on
    /// several instances at once. Unless the plugin splits items, part 0 is the whole item.
    fn preprocess_part(
        media: Media,
        plan: TokenPlan,
        config: ProcessorConfig,
        index: u32,
    ) -> PluginResult<Vec<Tensor>> {
        match index {
            0 => Self::preprocess(media, plan, config),
            _ => Err(PluginError::internal(format!(
                "part {index} asked of a plugin that makes items whole"
            ))),
        }
    }

    /// Where each part goes before any is made (contract 0.5): per part, its tokens and the
    /// small tensors [`Plugin::preprocess_part`] will return that place it in the prompt (a video
    /// part's `video_grid_thw` and frame timing: the same names, types and values), computed from
    /// the plan alone. With it the gateway hands the request to the engine at once and each part
    /// to the encoder as soon as it is made, so the model starts on an item before its last part
    /// exists. The default answers `unsupported`: the parts are then placed once all are made.
    fn part_plans(plan: TokenPlan, config: ProcessorConfig) -> PluginResult<Vec<PartPlan>> {
        let _ = (plan, config);
        Err(PluginError::unsupported(
            "this plugin does not place its parts before making them",
        ))
    }
}

/// Exports `$plugin` (a type implementing [`Plugin`]) as the component's `plugin` interface.
#[macro_export]
macro_rules! export_plugin {
    ($plugin:ty) => {
        #[doc(hidden)]
        pub struct __MmgatePluginExport;

        impl $crate::bindings::exports::mmgate::modality::plugin::Guest for __MmgatePluginExport {
            fn describe() -> $crate::Descriptor {
                <$plugin as $crate::Plugin>::describe()
            }
            fn probe(media: $crate::Media) -> $crate::PluginResult<$crate::MediaInfo> {
                <$plugin as $crate::Plugin>::probe(media)
            }
            fn plan(
                info: $crate::MediaInfo,
                budget: $crate::Budget,
                config: $crate::ProcessorConfig,
            ) -> $crate::PluginResult<$crate::TokenPlan> {
                <$plugin as $crate::Plugin>::plan(info, budget, config)
            }
            fn preprocess(
                media: $crate::Media,
                plan: $crate::TokenPlan,
                config: $crate::ProcessorConfig,
            ) -> $crate::PluginResult<::std::vec::Vec<$crate::Tensor>> {
                <$plugin as $crate::Plugin>::preprocess(media, plan, config)
            }
            fn reduce(
                media: $crate::Media,
                plan: $crate::TokenPlan,
                config: $crate::ProcessorConfig,
            ) -> $crate::PluginResult<$crate::ReducedItem> {
                <$plugin as $crate::Plugin>::reduce(media, plan, config)
            }
            fn parts(
                plan: $crate::TokenPlan,
                config: $crate::ProcessorConfig,
            ) -> $crate::PluginResult<u32> {
                <$plugin as $crate::Plugin>::parts(plan, config)
            }
            fn preprocess_part(
                media: $crate::Media,
                plan: $crate::TokenPlan,
                config: $crate::ProcessorConfig,
                index: u32,
            ) -> $crate::PluginResult<::std::vec::Vec<$crate::Tensor>> {
                <$plugin as $crate::Plugin>::preprocess_part(media, plan, config, index)
            }
            fn part_plans(
                plan: $crate::TokenPlan,
                config: $crate::ProcessorConfig,
            ) -> $crate::PluginResult<::std::vec::Vec<$crate::PartPlan>> {
                <$plugin as $crate::Plugin>::part_plans(plan, config)
            }
        }

        $crate::bindings::export_bindings!(__MmgatePluginExport);
    };
}

use serde::Serialize;
use serde::de::DeserializeOwned;

/// The contract version this SDK was built against (the `mmgate:modality` package version).
pub const CONTRACT_VERSION: &str = "0.5.1";

/// Result type of the fallible contract functions.
pub type PluginResult<T> = Result<T, PluginError>;

impl PluginError {
    /// The bytes are not a valid item of the claimed format.
    pub fn invalid(message: impl Into<String>) -> Self {
        PluginError::InvalidMedia(message.into())
    }

    /// The format, codec or processor type is not handled.
    pub fn unsupported(message: impl Into<String>) -> Self {
        PluginError::Unsupported(message.into())
    }

    /// The item exceeds a configured limit.
    pub fn limit(message: impl Into<String>) -> Self {
        PluginError::LimitExceeded(message.into())
    }

    /// Something unexpected inside the plugin.
    pub fn internal(message: impl Into<String>) -> Self {
        PluginError::Internal(message.into())
    }

    /// Even the cheapest plan needs `needed` tokens but only `budget` are available.
    pub fn over_budget(needed: u32, budget: u32, message: impl Into<String>) -> Self {
        PluginError::OverBudget(OverBudget {
            needed_tokens: needed,
            budget_tokens: budget,
            message: message.into(),
        })
    }
}

impl TokenPlan {
    /// A plan whose machine-readable `choices` are `choices` serialised as JSON.
    pub fn new(
        tokens: u32,
        reduced: bool,
        reason: impl Into<String>,
        choices: &impl Serialize,
    ) -> PluginResult<Self> {
        let choices = serde_json::to_string(choices)
            .map_err(|e| PluginError::internal(format!("cannot serialise plan choices: {e}")))?;
        Ok(TokenPlan {
            tokens,
            reduced,
            reason: reason.into(),
            choices,
        })
    }

    /// Read back the choices `plan` stored (the host hands the plan to `preprocess` unchanged).
    pub fn choices<T: DeserializeOwned>(&self) -> PluginResult<T> {
        serde_json::from_str(&self.choices)
            .map_err(|e| PluginError::internal(format!("plan choices do not parse: {e}")))
    }
}

/// Parse the processor configuration (the model's `preprocessor_config.json` plus overrides).
pub fn parse_config<T: DeserializeOwned>(config: &str) -> PluginResult<T> {
    serde_json::from_str(config)
        .map_err(|e| PluginError::unsupported(format!("processor config: {e}")))
}

/// A plugin's whole per-item path as the host runs it (probe; plan within `max_tokens`; preprocess)
/// as one native call: for timing a plugin's code outside the sandbox, or testing it with `cargo
/// test` on the build machine. The host gives each step a fresh instance; here they share a process.
pub fn run_natively<P: Plugin>(
    data: Vec<u8>,
    config: &str,
    max_tokens: u32,
) -> PluginResult<(TokenPlan, Vec<Tensor>)> {
    let media = || Media {
        data: data.clone(),
        mime_type: None,
    };
    let info = P::probe(media())?;
    let plan = P::plan(info, Budget { max_tokens }, config.to_owned())?;
    let tensors = P::preprocess(media(), plan.clone(), config.to_owned())?;
    Ok((plan, tensors))
}

impl Descriptor {
    /// A descriptor from the string constants a plugin usually keeps them in.
    pub fn new(
        name: &str,
        version: &str,
        description: &str,
        modalities: &[&str],
        mime_types: &[&str],
        processor_types: &[&str],
    ) -> Self {
        let owned = |items: &[&str]| items.iter().map(|s| (*s).to_owned()).collect();
        Descriptor {
            name: name.to_owned(),
            version: version.to_owned(),
            description: description.to_owned(),
            modalities: owned(modalities),
            mime_types: owned(mime_types),
            processor_types: owned(processor_types),
        }
    }
}

impl MediaInfo {
    /// A media-info with only the modality and format set; fill in the fields that apply.
    pub fn new(modality: impl Into<String>, format: impl Into<String>) -> Self {
        MediaInfo {
            modality: modality.into(),
            format: format.into(),
            width: None,
            height: None,
            frame_count: None,
            fps: None,
            duration_seconds: None,
            sample_rate: None,
            channels: None,
            extra: Vec::new(),
        }
    }
}
