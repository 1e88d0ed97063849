//! The host's FFmpeg video decoder (contract 0.2): open a media item's bytes, read its info and
//! keyframes, decode chosen frames one at a time as upright RGB.
//!
//! ```ignore
//! let video = VideoDecoder::open(&media.data)?;
//! let info = video.info();
//! for index in [0, info.frame_count / 2] {
//!     let frame = video.frame(index)?; // frame.rgb: width * height * 3 bytes
//! }
//! ```
//!
//! Frames asked for in ascending order cost the least. A plugin that never uses this module does not
//! import the decoder, and loads on hosts without one.

use crate::PluginError;
pub use crate::bindings::mmgate::modality::video::{Frame, VideoDecoder, VideoError, VideoInfo};

impl From<VideoError> for PluginError {
    /// The host's decoding errors, as the plugin error a client should see.
    fn from(error: VideoError) -> Self {
        match error {
            VideoError::InvalidMedia(m) => PluginError::InvalidMedia(m),
            VideoError::Unsupported(m) => PluginError::Unsupported(m),
            VideoError::LimitExceeded(m) => PluginError::LimitExceeded(m),
            VideoError::BadRequest(m) | VideoError::Internal(m) => PluginError::Internal(m),
        }
    }
}
