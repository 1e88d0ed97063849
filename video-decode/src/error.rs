/// Why a video could not be opened or a frame not decoded. Each case maps to a client-facing class:
/// the upload's fault (invalid, unsupported, over a limit) or ours (internal).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum VideoError {
    /// The bytes are not a video FFmpeg can read (empty, truncated, corrupt, an image or audio file).
    #[error("{0}")]
    InvalidMedia(String),
    /// A container or codec this build of FFmpeg cannot decode.
    #[error("{0}")]
    Unsupported(String),
    /// The video exceeds a limit (bytes, duration, pixels per frame, frames decoded, decode time).
    #[error("{0}")]
    LimitExceeded(String),
    /// The caller asked for something impossible (frame indices out of range or not increasing).
    #[error("{0}")]
    BadRequest(String),
    /// Something failed that is not the upload's fault (out of memory for the in-memory file, say).
    #[error("{0}")]
    Internal(String),
}
