//! The plugin contract on the host side: bindings generated from `wit/modality.wit` and from the
//! frozen earlier versions, the versions this host serves, and what the contract's types say of
//! themselves. What the host checks of the tensors a plugin returns is in [`crate::tensor`].
//!
//! The `video-decoder` resource is the decoder's own [`mmgate_video_decode::Video`], held in the
//! call's resource table: naming it here rather than a type of [`crate::video`] keeps the bindings
//! below the capabilities that implement them.

wasmtime::component::bindgen!({
    world: "modality-plugin",
    path: "../wit",
    additional_derives: [serde::Serialize, serde::Deserialize],
    with: { "mmgate:modality/video.video-decoder": mmgate_video_decode::Video },
});

/// The previous contract, 0.4, frozen in `host-api/wit/v0.4/`: plugins built against it keep
/// loading; their parts are made before they are placed (it has no `part-plans`). Its types are the
/// current ones (0.5 only added a record); its `host`, `video` and `image` interfaces are its own
/// (the host implements each by the current one).
pub mod v0_4 {
    wasmtime::component::bindgen!({
        world: "modality-plugin",
        path: "wit/v0.4",
        with: {
            "mmgate:modality/types": super::mmgate::modality::types,
            "mmgate:modality/video.video-decoder": mmgate_video_decode::Video,
        },
    });
}

/// Older still, 0.3, frozen in `host-api/wit/v0.3/`: plugins built against it keep
/// loading and are made whole (it has no `parts`). Its types are the current ones; its `host`,
/// `video` and `image` interfaces are its own (the host implements each by the current one).
pub mod v0_3 {
    wasmtime::component::bindgen!({
        world: "modality-plugin",
        path: "wit/v0.3",
        with: {
            "mmgate:modality/types": super::mmgate::modality::types,
            "mmgate:modality/video.video-decoder": mmgate_video_decode::Video,
        },
    });
}

/// Before it, 0.2, frozen in `host-api/wit/v0.2/`: plugins built against it keep loading.
/// Its types are the current ones (0.3 only added a record), so calls into it share one set of Rust
/// types; its `host` and `video` interfaces are its own (the host implements each by the current
/// one), and it has no `reduce`.
pub mod v0_2 {
    wasmtime::component::bindgen!({
        world: "modality-plugin",
        path: "wit/v0.2",
        with: {
            "mmgate:modality/types": super::mmgate::modality::types,
            "mmgate:modality/video.video-decoder": mmgate_video_decode::Video,
        },
    });
}

/// The first, 0.1, frozen in `host-api/wit/v0.1/`: plugins built against it keep loading. Its types
/// are the current ones (unchanged since), so calls into either version share one set of Rust types;
/// only its `host` interface is its own.
pub mod v0_1 {
    wasmtime::component::bindgen!({
        world: "modality-plugin",
        path: "wit/v0.1",
        with: { "mmgate:modality/types": super::mmgate::modality::types },
    });
}

pub use mmgate::modality::host::LogLevel;
pub use mmgate::modality::types::{
    Budget, Descriptor, Dtype, Media, MediaInfo, OverBudget, PartPlan, PluginError, ReducedItem,
    Tensor, TokenPlan,
};
pub use mmgate::modality::video::{Frame, VideoError, VideoInfo};

impl MediaInfo {
    /// What a plugin's probe says of a `width` x `height` image in `format`: how the host asks an
    /// image plugin to plan an image it has not made yet (a document's page at a size it may be
    /// rendered at).
    pub fn image(format: &str, width: u32, height: u32) -> Self {
        MediaInfo {
            modality: "image".into(),
            format: format.into(),
            width: Some(width),
            height: Some(height),
            frame_count: None,
            fps: None,
            duration_seconds: None,
            sample_rate: None,
            channels: None,
            extra: Vec::new(),
        }
    }
}

/// The contract version this host implements (the `mmgate:modality` package version in `wit/`).
pub const CONTRACT_VERSION: Version = Version {
    major: 0,
    minor: 5,
    patch: 1,
};

/// Every contract version this host serves plugins of, newest first: the current one, and 0.4,
/// 0.3, 0.2 and 0.1 through the frozen bindings in [`v0_4`], [`v0_3`], [`v0_2`] and [`v0_1`].
pub const SUPPORTED_VERSIONS: [Version; 5] = [
    CONTRACT_VERSION,
    Version {
        major: 0,
        minor: 4,
        patch: 1,
    },
    Version {
        major: 0,
        minor: 3,
        patch: 1,
    },
    Version {
        major: 0,
        minor: 2,
        patch: 0,
    },
    Version {
        major: 0,
        minor: 1,
        patch: 0,
    },
];

/// The interface every plugin exports, without its version suffix.
pub const PLUGIN_INTERFACE: &str = "mmgate:modality/plugin";

/// A contract version, `major.minor.patch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub struct Version {
    pub major: u64,
    pub minor: u64,
    pub patch: u64,
}

impl Version {
    pub fn parse(text: &str) -> Option<Version> {
        let mut parts = text.split('.').map(|p| p.parse::<u64>().ok());
        let version = Version {
            major: parts.next()??,
            minor: parts.next()??,
            patch: parts.next()??,
        };
        parts.next().is_none().then_some(version)
    }

    /// The supported contract whose bindings serve a plugin built against `self`, if any.
    pub fn supported(self) -> Option<Version> {
        SUPPORTED_VERSIONS
            .into_iter()
            .find(|&host| self.runs_on(host))
    }

    /// Whether a plugin built against `self` can run on a host implementing `host`: the component
    /// model's semver rule (same major; for 0.x, same minor), and not newer than the host, since a newer
    /// plugin may import capabilities this host lacks.
    pub fn runs_on(self, host: Version) -> bool {
        let same_series = if self.major == 0 {
            host.major == 0 && self.minor == host.minor
        } else {
            self.major == host.major
        };
        same_series && self <= host
    }
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

impl Dtype {
    /// Every element type, in the contract's order.
    pub const ALL: [Dtype; 6] = [
        Dtype::U8,
        Dtype::I32,
        Dtype::I64,
        Dtype::F16,
        Dtype::Bf16,
        Dtype::F32,
    ];

    /// The type [`Self::name`] names.
    pub fn from_name(name: &str) -> Option<Dtype> {
        Self::ALL.into_iter().find(|d| d.name() == name)
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::U8 => 1,
            Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::I32 | Dtype::F32 => 4,
            Dtype::I64 => 8,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::U8 => "u8",
            Dtype::I32 => "i32",
            Dtype::I64 => "i64",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
            Dtype::F32 => "f32",
        }
    }
}

impl PluginError {
    /// The message a client sees: what kind of failure, and the plugin's words.
    /// (The generated `Display` prints the Rust debug form.)
    pub fn message(&self) -> String {
        match self {
            PluginError::Unsupported(m) => format!("unsupported: {m}"),
            PluginError::InvalidMedia(m) => format!("invalid media: {m}"),
            PluginError::OverBudget(o) => format!(
                "over budget: needs {} tokens, {} available: {}",
                o.needed_tokens, o.budget_tokens, o.message
            ),
            PluginError::LimitExceeded(m) => format!("limit exceeded: {m}"),
            PluginError::Internal(m) => format!("plugin internal error: {m}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_compatibility_follows_component_semver() {
        let host = Version::parse("0.1.3").unwrap();
        assert!(Version::parse("0.1.0").unwrap().runs_on(host));
        assert!(Version::parse("0.1.3").unwrap().runs_on(host));
        assert!(!Version::parse("0.1.4").unwrap().runs_on(host));
        assert!(!Version::parse("0.2.0").unwrap().runs_on(host));
        assert!(!Version::parse("1.1.0").unwrap().runs_on(host));
        let host1 = Version::parse("1.4.0").unwrap();
        assert!(Version::parse("1.0.0").unwrap().runs_on(host1));
        assert!(!Version::parse("2.0.0").unwrap().runs_on(host1));
        assert!(Version::parse("0.1").is_none());
        assert!(Version::parse("0.1.0-rc1").is_none());
    }

    #[test]
    fn plugins_of_the_previous_minor_version_are_still_served() {
        let v = |s| Version::parse(s).unwrap();
        assert_eq!(v("0.1.0").supported(), Some(v("0.1.0")));
        assert_eq!(v("0.2.0").supported(), Some(v("0.2.0")));
        assert_eq!(v("0.3.0").supported(), Some(v("0.3.1")));
        assert_eq!(v("0.3.1").supported(), Some(v("0.3.1")));
        assert_eq!(v("0.3.2").supported(), None);
        assert_eq!(v("0.4.0").supported(), Some(v("0.4.1")));
        assert_eq!(v("0.4.1").supported(), Some(v("0.4.1")));
        assert_eq!(v("0.5.0").supported(), Some(CONTRACT_VERSION));
        assert_eq!(v("0.5.1").supported(), Some(CONTRACT_VERSION));
        assert_eq!(v("0.1.1").supported(), None);
        assert_eq!(v("0.4.2").supported(), None);
        assert_eq!(v("0.5.2").supported(), None);
        assert_eq!(v("0.6.0").supported(), None);
        assert_eq!(v("0.0.9").supported(), None);
    }
}
