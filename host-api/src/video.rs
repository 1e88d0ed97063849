//! The `video-decoder` host resource (since contract 0.2): FFmpeg decoding through
//! `mmgate-video-decode`, owned by the call's resource table so everything a plugin opened is freed
//! when its call ends. 0.2's interface is 0.3's under another version: served by the same code.
//!
//! The capability works on a `VideoView`: its own share of a call and the parts of the call it
//! uses, which the call's state lends it when the linker calls in (see [`crate::sandbox`]).

use mmgate_video_decode::{Limits, Video, VideoError as DecodeError};
use wasmtime::component::{HasData, Resource, ResourceTable};

use crate::call_clock::CallClock;
use crate::contract::mmgate::modality::video::{Host, HostVideoDecoder};
use crate::contract::{Frame, VideoError, VideoInfo};

/// Most videos one plugin call may hold open at once: each holds the upload and a decoder.
pub const MAX_OPEN_VIDEOS: usize = 4;

/// A video opened by a plugin: the contract's `video-decoder` resource, which the bindings take to
/// be the decoder's own video (see [`crate::contract`]).
pub type HostVideo = Video;

/// What one plugin call holds of this capability: the decoder's limits and how many videos it
/// has open.
pub(crate) struct CallVideos {
    limits: Limits,
    open: usize,
}

impl CallVideos {
    pub(crate) fn new(limits: &Limits) -> Self {
        Self {
            limits: limits.clone(),
            open: 0,
        }
    }

    pub(crate) fn decode_on_one_thread(&mut self) {
        self.limits.decoder_threads = 1;
    }
}

/// What this capability works on in one call, as the call's state lends it: its own share, the
/// resource table its videos live in (beside WASI's resources, so everything a plugin opened is
/// freed when its call ends) and the call's clock, which decoding is charged to as host work.
pub(crate) struct VideoView<'a> {
    pub(crate) videos: &'a mut CallVideos,
    pub(crate) table: &'a mut ResourceTable,
    pub(crate) clock: &'a mut CallClock,
}

/// What the linker hands the `video` interfaces of a call: a [`VideoView`] of its state.
pub(crate) struct HasVideo;

impl HasData for HasVideo {
    type Data<'a> = VideoView<'a>;
}

fn contract_error(error: DecodeError) -> VideoError {
    match error {
        DecodeError::InvalidMedia(m) => VideoError::InvalidMedia(m),
        DecodeError::Unsupported(m) => VideoError::Unsupported(m),
        DecodeError::LimitExceeded(m) => VideoError::LimitExceeded(m),
        // The contract has no such case: the plugin is told a limit was hit, and the call fails
        // for the time the host ran out of (see `CallClock::host_ran_out`), whatever it answers.
        DecodeError::TimedOut(m) => VideoError::LimitExceeded(m),
        DecodeError::BadRequest(m) => VideoError::BadRequest(m),
        DecodeError::Internal(m) => VideoError::Internal(m),
    }
}

/// The video behind `handle` in `table`.
fn video<'t>(
    table: &'t mut ResourceTable,
    handle: &Resource<HostVideo>,
) -> Result<&'t mut Video, VideoError> {
    table
        .get_mut(handle)
        .map_err(|e| VideoError::Internal(format!("unknown video handle: {e}")))
}

impl VideoView<'_> {
    /// `decode` run as host work for the plugin (not charged to its own time); a decode that ran
    /// out of time fails the call for that.
    fn decoding<R>(
        &mut self,
        decode: impl FnOnce(&mut ResourceTable) -> Result<R, DecodeError>,
    ) -> Result<R, VideoError> {
        let table = &mut *self.table;
        let result = self.clock.host_work(|| decode(table));
        if matches!(result, Err(DecodeError::TimedOut(_))) {
            self.clock.host_ran_out();
        }
        result.map_err(contract_error)
    }
}

impl Host for VideoView<'_> {}

impl HostVideoDecoder for VideoView<'_> {
    fn open(&mut self, data: Vec<u8>) -> Result<Resource<HostVideo>, VideoError> {
        if self.videos.open >= MAX_OPEN_VIDEOS {
            return Err(VideoError::LimitExceeded(format!(
                "a plugin call may hold at most {MAX_OPEN_VIDEOS} videos open"
            )));
        }
        let limits = self.videos.limits.clone();
        let video = self.decoding(|_| Video::open(&data, limits))?;
        // FFmpeg reads its own in-memory copy: the call's copy can go now.
        drop(data);
        let handle = self
            .table
            .push(video)
            .map_err(|e| VideoError::Internal(format!("cannot keep the video: {e}")))?;
        self.videos.open += 1;
        Ok(handle)
    }

    fn info(&mut self, handle: Resource<HostVideo>) -> VideoInfo {
        match video(self.table, &handle) {
            Ok(video) => {
                let info = video.info();
                VideoInfo {
                    container: info.container.clone(),
                    codec: info.codec.clone(),
                    width: info.width,
                    height: info.height,
                    rotation: info.rotation,
                    fps: info.fps,
                    frame_count: info.frame_count,
                    duration_seconds: info.duration_seconds,
                }
            }
            // Only a handle of this call can reach here; an empty answer rather than a trap.
            Err(_) => VideoInfo {
                container: String::new(),
                codec: String::new(),
                width: 0,
                height: 0,
                rotation: 0,
                fps: 0.0,
                frame_count: 0,
                duration_seconds: 0.0,
            },
        }
    }

    fn keyframes(&mut self, handle: Resource<HostVideo>) -> Vec<u64> {
        video(self.table, &handle)
            .map(|v| v.keyframe_indices())
            .unwrap_or_default()
    }

    fn frame(&mut self, handle: Resource<HostVideo>, index: u64) -> Result<Frame, VideoError> {
        let deadline = self.clock.wall_deadline();
        let frame = self.decoding(|table| match video(table, &handle) {
            Ok(video) => video.frame(index, Some(deadline)),
            Err(e) => Err(DecodeError::Internal(e.to_string())),
        })?;
        Ok(Frame {
            index: frame.index,
            timestamp: frame.timestamp,
            width: frame.width,
            height: frame.height,
            rgb: frame.rgb,
        })
    }

    fn frames_decoded(&mut self, handle: Resource<HostVideo>) -> u64 {
        video(self.table, &handle)
            .map(|v| v.frames_decoded())
            .unwrap_or(0)
    }

    fn drop(&mut self, handle: Resource<HostVideo>) -> wasmtime::Result<()> {
        self.table.delete(handle)?;
        self.videos.open = self.videos.open.saturating_sub(1);
        Ok(())
    }
}

/// The `video` interface of a superseded contract (`$version`: the module of its frozen bindings):
/// each function is the current one's, its records copied across.
macro_rules! previous_video_interface {
    ($module:ident, $version:ident) => {
        mod $module {
            use super::*;
            use crate::contract::$version::mmgate::modality::video as old;

            fn error(e: VideoError) -> old::VideoError {
                match e {
                    VideoError::InvalidMedia(m) => old::VideoError::InvalidMedia(m),
                    VideoError::Unsupported(m) => old::VideoError::Unsupported(m),
                    VideoError::LimitExceeded(m) => old::VideoError::LimitExceeded(m),
                    VideoError::BadRequest(m) => old::VideoError::BadRequest(m),
                    VideoError::Internal(m) => old::VideoError::Internal(m),
                }
            }

            impl old::Host for VideoView<'_> {}

            impl old::HostVideoDecoder for VideoView<'_> {
                fn open(&mut self, data: Vec<u8>) -> Result<Resource<HostVideo>, old::VideoError> {
                    HostVideoDecoder::open(self, data).map_err(error)
                }

                fn info(&mut self, handle: Resource<HostVideo>) -> old::VideoInfo {
                    let info = HostVideoDecoder::info(self, handle);
                    old::VideoInfo {
                        container: info.container,
                        codec: info.codec,
                        width: info.width,
                        height: info.height,
                        rotation: info.rotation,
                        fps: info.fps,
                        frame_count: info.frame_count,
                        duration_seconds: info.duration_seconds,
                    }
                }

                fn keyframes(&mut self, handle: Resource<HostVideo>) -> Vec<u64> {
                    HostVideoDecoder::keyframes(self, handle)
                }

                fn frame(
                    &mut self,
                    handle: Resource<HostVideo>,
                    index: u64,
                ) -> Result<old::Frame, old::VideoError> {
                    let frame = HostVideoDecoder::frame(self, handle, index).map_err(error)?;
                    Ok(old::Frame {
                        index: frame.index,
                        timestamp: frame.timestamp,
                        width: frame.width,
                        height: frame.height,
                        rgb: frame.rgb,
                    })
                }

                fn frames_decoded(&mut self, handle: Resource<HostVideo>) -> u64 {
                    HostVideoDecoder::frames_decoded(self, handle)
                }

                fn drop(&mut self, handle: Resource<HostVideo>) -> wasmtime::Result<()> {
                    HostVideoDecoder::drop(self, handle)
                }
            }
        }
    };
}

previous_video_interface!(v0_4_video, v0_4);
previous_video_interface!(v0_3_video, v0_3);
previous_video_interface!(v0_2_video, v0_2);
