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
    /// The video exceeds a limit (bytes, duration, pixels per frame, frames indexed or decoded).
    #[error("{0}")]
    LimitExceeded(String),
    /// Indexing or decoding ran past a wall-clock limit (the video's `max_decode_ms`, or the
    /// caller's deadline): how long it takes depends on the machine and its load, not only on the
    /// upload, so it is not the upload's fault.
    #[error("{0}")]
    TimedOut(String),
    /// The caller asked for something impossible (frame indices out of range or not increasing).
    #[error("{0}")]
    BadRequest(String),
    /// Something failed that is not the upload's fault (out of memory for the in-memory file, say).
    #[error("{0}")]
    Internal(String),
}
