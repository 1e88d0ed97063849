//! A plugin exactly as one built in the 0.3 days: it imports `host@0.3.1` and `image@0.3.1` and
//! exports `plugin@0.3.1` (with `reduce`, without `parts`). It decodes a JPEG through the 0.3
//! image decoder, costs one token per row, hands back the pixels, and reduces to the bytes as they
//! came.

wit_bindgen::generate!({
    world: "modality-plugin",
    path: "../../host-api/wit/v0.3",
});

use exports::mmgate::modality::plugin::Guest;
use mmgate::modality::host::{LogLevel, log};
use mmgate::modality::image::{ImageError, ImageLimits, decode_jpeg};
use mmgate::modality::types::{
    Budget, Descriptor, Dtype, Media, MediaInfo, PluginError, ReducedItem, Tensor, TokenPlan,
};

struct Legacy;

fn plugin_error(e: ImageError) -> PluginError {
    match e {
        ImageError::InvalidMedia(m) => PluginError::InvalidMedia(m),
        ImageError::Unsupported(m) => PluginError::Unsupported(m),
        ImageError::LimitExceeded(m) => PluginError::LimitExceeded(m),
        ImageError::Internal(m) => PluginError::Internal(m),
    }
}

const LIMITS: ImageLimits = ImageLimits {
    max_width: 4096,
    max_height: 4096,
    max_pixels: 1 << 24,
    max_scans: 100,
};

impl Guest for Legacy {
    fn describe() -> Descriptor {
        Descriptor {
            name: "legacy-image".into(),
            version: "0.3.1".into(),
            description: "built against contract 0.3".into(),
            modalities: vec!["legacy-image".into()],
            mime_types: vec![],
            processor_types: vec![],
        }
    }

    fn probe(media: Media) -> Result<MediaInfo, PluginError> {
        let image = decode_jpeg(&media.data, LIMITS).map_err(plugin_error)?;
        log(LogLevel::Info, "probed an image through the 0.3 decoder");
        Ok(MediaInfo {
            modality: "legacy-image".into(),
            format: "jpeg".into(),
            width: Some(image.width),
            height: Some(image.height),
            frame_count: None,
            fps: None,
            duration_seconds: None,
            sample_rate: None,
            channels: None,
            extra: vec![],
        })
    }

    fn plan(info: MediaInfo, _budget: Budget, _config: String) -> Result<TokenPlan, PluginError> {
        Ok(TokenPlan {
            tokens: info.height.unwrap_or(0),
            reduced: false,
            reason: "one token per row".into(),
            choices: "{}".into(),
        })
    }

    fn preprocess(
        media: Media,
        _plan: TokenPlan,
        _config: String,
    ) -> Result<Vec<Tensor>, PluginError> {
        let image = decode_jpeg(&media.data, LIMITS).map_err(plugin_error)?;
        Ok(vec![Tensor {
            name: "pixels".into(),
            dtype: Dtype::U8,
            shape: vec![u64::from(image.height), u64::from(image.width), 3],
            data: image.rgb,
        }])
    }

    fn reduce(media: Media, _plan: TokenPlan, _config: String) -> Result<ReducedItem, PluginError> {
        Ok(ReducedItem {
            files: vec![media],
            timestamps: vec![0.0],
        })
    }
}

export!(Legacy);
