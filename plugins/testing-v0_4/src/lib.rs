//! A plugin exactly as one built in the 0.4 days: it imports `host@0.4.1` and `image@0.4.1` and
//! exports `plugin@0.4.1` (with `parts` and `preprocess-part`, without `part-plans`). It decodes a
//! JPEG through the 0.4 image decoder, costs one token per row, hands back the pixels, and makes
//! them in two parts, each decoding only its band of rows (`decode-jpeg-rows`, 0.4.1).

wit_bindgen::generate!({
    world: "modality-plugin",
    path: "../../host-api/wit/v0.4",
});

use exports::mmgate::modality::plugin::Guest;
use mmgate::modality::image::{ImageError, ImageLimits, decode_jpeg, decode_jpeg_rows};
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

fn pixels(width: u32, rows: u32, rgb: Vec<u8>) -> Tensor {
    Tensor {
        name: "pixels".into(),
        dtype: Dtype::U8,
        shape: vec![u64::from(rows), u64::from(width), 3],
        data: rgb,
    }
}

impl Guest for Legacy {
    fn describe() -> Descriptor {
        Descriptor {
            name: "legacy-image-parts".into(),
            version: "0.4.1".into(),
            description: "built against contract 0.4".into(),
            modalities: vec!["legacy-image".into()],
            mime_types: vec![],
            processor_types: vec![],
        }
    }

    fn probe(media: Media) -> Result<MediaInfo, PluginError> {
        let image = decode_jpeg(&media.data, LIMITS).map_err(plugin_error)?;
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
        Ok(vec![pixels(image.width, image.height, image.rgb)])
    }

    fn reduce(media: Media, _plan: TokenPlan, _config: String) -> Result<ReducedItem, PluginError> {
        Ok(ReducedItem {
            files: vec![media],
            timestamps: vec![0.0],
        })
    }

    fn parts(_plan: TokenPlan, _config: String) -> Result<u32, PluginError> {
        Ok(2)
    }

    /// The top half of the rows, then the rest.
    fn preprocess_part(
        media: Media,
        plan: TokenPlan,
        _config: String,
        index: u32,
    ) -> Result<Vec<Tensor>, PluginError> {
        let top = plan.tokens / 2;
        let (first, rows) = match index {
            0 => (0, top),
            1 => (top, plan.tokens - top),
            _ => return Err(PluginError::Internal(format!("no part {index}"))),
        };
        let band = decode_jpeg_rows(&media.data, LIMITS, first, rows).map_err(plugin_error)?;
        Ok(vec![pixels(band.width, band.height, band.rgb)])
    }
}

export!(Legacy);
