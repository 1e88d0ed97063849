//! FFmpeg-backed video decoding for mmgate's plugin host.
//!
//! A [`Video`] is opened from the bytes of an upload (held in an anonymous in-memory file, so nothing is
//! written to disk and nothing is left behind), indexed once by demuxing its packets (no decoding: this
//! gives the exact frame count and every frame's timestamp and keyframe, as decord's reader does), and
//! then decodes only the frames asked for, one at a time, seeking to the nearest keyframe before each
//! one when that is shorter than decoding on.
//!
//! Everything an upload controls is bounded by [`Limits`]: bytes, duration, pixels per frame, frames
//! decoded and decode time. Every FFmpeg failure becomes a [`VideoError`]; nothing panics.

mod error;
mod index;
mod limits;
mod rotate;
mod video;

pub use error::VideoError;
pub use limits::Limits;
pub use video::{Frame, Video, VideoInfo};
