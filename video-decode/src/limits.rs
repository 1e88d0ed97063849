use std::time::Duration;

use serde::{Deserialize, Serialize};

/// What one opened video may cost. The defaults admit any ordinary upload (up to 4K, half an hour)
/// and refuse what would only exhaust the machine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Most bytes of an upload.
    pub max_bytes: usize,
    /// Longest duration in seconds.
    pub max_duration_seconds: f64,
    /// Most pixels of one frame (width × height), checked on the header and on every decoded frame.
    pub max_frame_pixels: u64,
    /// Most frames in the stream's index (packets demuxed when the video is opened).
    pub max_indexed_frames: u64,
    /// Most frames decoded for one video, counting those decoded only to reach a wanted one.
    pub max_decoded_frames: u64,
    /// Most wall-clock milliseconds spent indexing and decoding one video.
    pub max_decode_ms: u64,
    /// Decoder threads per video (0: FFmpeg chooses from the core count).
    pub decoder_threads: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_bytes: 64_000_000,
            max_duration_seconds: 30.0 * 60.0,
            max_frame_pixels: 4096 * 4096,
            // Half an hour at 240 fps.
            max_indexed_frames: 432_000,
            max_decoded_frames: 20_000,
            max_decode_ms: 60_000,
            decoder_threads: 2,
        }
    }
}

impl Limits {
    pub fn max_decode_time(&self) -> Duration {
        Duration::from_millis(self.max_decode_ms)
    }
}
