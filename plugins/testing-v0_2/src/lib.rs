//! A plugin exactly as one built in the 0.2 days: it imports `host@0.2.0` and `video@0.2.0` and
//! exports `plugin@0.2.0` (no `reduce`). It opens a video through the 0.2 decoder, costs one token
//! per frame, and hands back the first frame's pixels.

wit_bindgen::generate!({
    world: "modality-plugin",
    path: "../../host-api/wit/v0.2",
});

use exports::mmgate::modality::plugin::Guest;
use mmgate::modality::host::{LogLevel, log};
use mmgate::modality::types::{
    Budget, Descriptor, Dtype, Media, MediaInfo, PluginError, Tensor, TokenPlan,
};
use mmgate::modality::video::{VideoDecoder, VideoError};

struct Legacy;

fn plugin_error(e: VideoError) -> PluginError {
    match e {
        VideoError::InvalidMedia(m) => PluginError::InvalidMedia(m),
        VideoError::Unsupported(m) => PluginError::Unsupported(m),
        VideoError::LimitExceeded(m) => PluginError::LimitExceeded(m),
        VideoError::BadRequest(m) | VideoError::Internal(m) => PluginError::Internal(m),
    }
}

impl Guest for Legacy {
    fn describe() -> Descriptor {
        Descriptor {
            name: "legacy-video".into(),
            version: "0.2.0".into(),
            description: "built against contract 0.2".into(),
            modalities: vec!["legacy-video".into()],
            mime_types: vec![],
            processor_types: vec![],
        }
    }

    fn probe(media: Media) -> Result<MediaInfo, PluginError> {
        let video = VideoDecoder::open(&media.data).map_err(plugin_error)?;
        let info = video.info();
        log(LogLevel::Info, "probed a video through the 0.2 decoder");
        Ok(MediaInfo {
            modality: "legacy-video".into(),
            format: format!("{}/{}", info.container, info.codec),
            width: Some(info.width),
            height: Some(info.height),
            frame_count: Some(info.frame_count),
            fps: Some(info.fps),
            duration_seconds: Some(info.duration_seconds),
            sample_rate: None,
            channels: None,
            extra: vec![],
        })
    }

    fn plan(info: MediaInfo, _budget: Budget, _config: String) -> Result<TokenPlan, PluginError> {
        Ok(TokenPlan {
            tokens: info.frame_count.unwrap_or(0) as u32,
            reduced: false,
            reason: "one token per frame".into(),
            choices: "{}".into(),
        })
    }

    fn preprocess(
        media: Media,
        _plan: TokenPlan,
        _config: String,
    ) -> Result<Vec<Tensor>, PluginError> {
        let video = VideoDecoder::open(&media.data).map_err(plugin_error)?;
        let frame = video.frame(0).map_err(plugin_error)?;
        Ok(vec![Tensor {
            name: "frame0".into(),
            dtype: Dtype::U8,
            shape: vec![u64::from(frame.height), u64::from(frame.width), 3],
            data: frame.rgb,
        }])
    }
}

export!(Legacy);
