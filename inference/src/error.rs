//! The one error type of the inference core.

use std::path::PathBuf;

/// Everything that can go wrong loading a model or running it. Shape and config errors name what
/// did not fit; none of them is a panic, because a bad model directory or a malformed request must
/// not take the process down.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("shape mismatch in {op}: {detail}")]
    Shape { op: &'static str, detail: String },

    #[error("model config {path}: {reason}")]
    Config { path: PathBuf, reason: String },

    #[error("weights: {0}")]
    Weights(String),

    #[error("reading {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("input: {0}")]
    Input(String),

    #[error("device {device}: {reason}")]
    Device { device: String, reason: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn shape(op: &'static str, detail: impl Into<String>) -> Self {
        Error::Shape {
            op,
            detail: detail.into(),
        }
    }
}
