use std::io::Write;
use std::sync::Once;
use std::time::{Duration, Instant};

use ffmpeg::codec::discard::Discard;
use ffmpeg::codec::packet::side_data::Type as SideDataType;
use ffmpeg::format::Pixel;
use ffmpeg::software::scaling;
use ffmpeg::util::frame;
use ffmpeg::{Packet, Rational, codec, format, media};
use ffmpeg_next as ffmpeg;

use crate::error::VideoError;
use crate::index::{FrameIndex, PacketEntry};
use crate::limits::Limits;
use crate::rotate::{display_matrix_rotation, rotate_rgb};

/// What the header and the packet index say about a video.
#[derive(Debug, Clone, PartialEq)]
pub struct VideoInfo {
    /// Demuxer name, e.g. `mp4`, `matroska`, `avi`.
    pub container: String,
    /// Codec name, e.g. `h264`, `vp9`, `mjpeg`.
    pub codec: String,
    /// Width of a frame as displayed (after rotation).
    pub width: u32,
    /// Height of a frame as displayed.
    pub height: u32,
    /// Clockwise rotation applied to every frame (0, 90, 180, 270).
    pub rotation: u32,
    /// Average frame rate (what decord's `get_avg_fps` reports).
    pub fps: f64,
    /// Frames in the stream, counted from its packets (exact, not estimated from the duration).
    pub frame_count: u64,
    /// Duration in seconds.
    pub duration_seconds: f64,
}

/// One decoded frame, packed RGB, upright.
#[derive(Debug, Clone)]
pub struct Frame {
    /// Its index in presentation order.
    pub index: u64,
    /// Seconds from the first frame.
    pub timestamp: f64,
    pub width: u32,
    pub height: u32,
    /// `width × height × 3` bytes, row-major.
    pub rgb: Vec<u8>,
    /// Whether the decoder produced exactly this frame (false: the next one it had, when the stream
    /// lacks the frame the index promised).
    pub exact: bool,
}

/// An opened, indexed video. Decoding state moves forward; asking for an earlier frame seeks back.
pub struct Video {
    input: format::context::Input,
    // The anonymous in-memory file FFmpeg reads; dropped (and freed) with the video.
    _file: memfd::Memfd,
    stream: usize,
    time_base: Rational,
    decoder: codec::decoder::Video,
    index: FrameIndex,
    info: VideoInfo,
    limits: Limits,
    /// Time spent indexing and decoding so far (bounded by `limits.max_decode_ms`).
    spent: Duration,
    decoded: u64,
    /// Timestamp of the last frame the decoder returned since the last seek, if any.
    last_pts: Option<i64>,
    /// Whether the demuxer has run out (the decoder was told so and is draining).
    drained: bool,
    /// Whether the demuxer is positioned for decoding (false right after indexing).
    positioned: bool,
    /// What the decoder currently discards (see [`Video::frame`]).
    discard: Discard,
}

fn init_ffmpeg() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        if let Err(e) = ffmpeg::init() {
            tracing::error!("FFmpeg failed to initialise: {e}");
        }
        // FFmpeg's own log goes to stderr; every failure reaches callers as a VideoError instead.
        ffmpeg::util::log::set_level(ffmpeg::util::log::Level::Fatal);
    });
}

/// Demuxers that read still images: such an upload is an image with a video's name.
fn is_image_demuxer(name: &str) -> bool {
    name.starts_with("image2") || name.ends_with("_pipe") || name == "gif" || name == "webp"
}

fn seconds(ts: i64, time_base: Rational) -> f64 {
    ts as f64 * f64::from(time_base.numerator()) / f64::from(time_base.denominator().max(1))
}

fn rational(r: Rational) -> Option<f64> {
    (r.numerator() > 0 && r.denominator() > 0)
        .then(|| f64::from(r.numerator()) / f64::from(r.denominator()))
}

impl Video {
    /// Open and index a video from its bytes. Nothing is decoded yet.
    pub fn open(bytes: &[u8], limits: Limits) -> Result<Video, VideoError> {
        init_ffmpeg();
        let started = Instant::now();
        if bytes.is_empty() {
            return Err(VideoError::InvalidMedia(
                "the video is empty (0 bytes)".into(),
            ));
        }
        if bytes.len() > limits.max_bytes {
            return Err(VideoError::LimitExceeded(format!(
                "the video is {} bytes; the limit is {}",
                bytes.len(),
                limits.max_bytes
            )));
        }
        let file = memfd::MemfdOptions::default()
            .close_on_exec(true)
            .create("mmgate-video")
            .map_err(|e| VideoError::Internal(format!("cannot create an in-memory file: {e}")))?;
        file.as_file()
            .write_all(bytes)
            .map_err(|e| VideoError::Internal(format!("cannot fill the in-memory file: {e}")))?;
        let path = format!(
            "/proc/self/fd/{}",
            std::os::fd::AsRawFd::as_raw_fd(file.as_file())
        );
        let input = format::input(&path)
            .map_err(|e| VideoError::InvalidMedia(format!("not a video FFmpeg can read: {e}")))?;

        let container = input
            .format()
            .name()
            .split(',')
            .next()
            .unwrap_or("")
            .to_owned();
        if is_image_demuxer(input.format().name()) {
            return Err(VideoError::InvalidMedia(format!(
                "this is a still image ({container}), not a video"
            )));
        }
        let stream = input.streams().best(media::Type::Video).ok_or_else(|| {
            VideoError::InvalidMedia(format!("the {container} file has no video stream"))
        })?;
        let stream_index = stream.index();
        let time_base = stream.time_base();
        if time_base.numerator() <= 0 || time_base.denominator() <= 0 {
            return Err(VideoError::InvalidMedia(
                "the video stream has no time base".into(),
            ));
        }
        let rotation = stream
            .side_data()
            .find(|d| d.kind() == SideDataType::DisplayMatrix)
            .and_then(|d| display_matrix_rotation(d.data()))
            .unwrap_or(0);
        let header_fps = rational(stream.avg_frame_rate()).or_else(|| rational(stream.rate()));
        let header_duration = (stream.duration() > 0)
            .then(|| seconds(stream.duration(), time_base))
            .or_else(|| (input.duration() > 0).then(|| input.duration() as f64 / 1e6));
        let parameters = stream.parameters();

        let codec_id = parameters.id();
        let mut context = codec::context::Context::from_parameters(parameters)
            .map_err(|e| VideoError::InvalidMedia(format!("bad codec parameters: {e}")))?;
        if limits.decoder_threads != 1 {
            context.set_threading(codec::threading::Config {
                kind: codec::threading::Type::Frame,
                count: limits.decoder_threads,
                safe: false,
            });
        }
        let decoder = match context.decoder().video() {
            Ok(decoder) => decoder,
            Err(ffmpeg::Error::DecoderNotFound) => {
                return Err(VideoError::Unsupported(format!(
                    "no decoder for the {} codec",
                    codec_id.name()
                )));
            }
            Err(e) => {
                return Err(VideoError::Unsupported(format!(
                    "cannot decode the {} stream: {e}",
                    codec_id.name()
                )));
            }
        };
        let (coded_w, coded_h) = (decoder.width(), decoder.height());
        if coded_w == 0 || coded_h == 0 {
            return Err(VideoError::InvalidMedia(
                "the video stream has no frame size".into(),
            ));
        }
        check_pixels(coded_w, coded_h, &limits)?;
        if let Some(d) = header_duration {
            check_duration(d, &limits)?;
        }

        let mut video = Video {
            input,
            _file: file,
            stream: stream_index,
            time_base,
            decoder,
            index: FrameIndex::default(),
            info: VideoInfo {
                container,
                codec: codec_id.name().to_owned(),
                width: if rotation % 180 == 90 {
                    coded_h
                } else {
                    coded_w
                },
                height: if rotation % 180 == 90 {
                    coded_w
                } else {
                    coded_h
                },
                rotation,
                fps: 0.0,
                frame_count: 0,
                duration_seconds: 0.0,
            },
            limits,
            spent: Duration::ZERO,
            decoded: 0,
            last_pts: None,
            drained: false,
            positioned: false,
            discard: Discard::Default,
        };
        video.build_index(started)?;
        let count = video.index.len();
        let span = match (video.index.first_pts(), video.index.last_pts()) {
            (Some(first), Some(last)) => seconds(last - first, time_base),
            _ => 0.0,
        };
        let fps = header_fps
            .or_else(|| (span > 0.0).then(|| (count.saturating_sub(1)) as f64 / span))
            .unwrap_or(0.0);
        let duration = header_duration.unwrap_or(if fps > 0.0 { count as f64 / fps } else { span });
        check_duration(duration, &video.limits)?;
        if fps <= 0.0 {
            return Err(VideoError::InvalidMedia(
                "the video stream has no frame rate".into(),
            ));
        }
        video.info.fps = fps;
        video.info.frame_count = count;
        video.info.duration_seconds = duration;
        video.spent = started.elapsed();
        Ok(video)
    }

    pub fn info(&self) -> &VideoInfo {
        &self.info
    }

    /// Frame indices of the keyframes, ascending.
    pub fn keyframe_indices(&self) -> Vec<u64> {
        self.index.keyframe_indices()
    }

    /// Frames decoded so far, counting those decoded only to reach a wanted one.
    pub fn frames_decoded(&self) -> u64 {
        self.decoded
    }

    /// Demux every packet of the video stream once: the exact frame count and each frame's timestamp.
    fn build_index(&mut self, started: Instant) -> Result<(), VideoError> {
        let mut packets = Vec::new();
        let mut order = 0i64;
        loop {
            // A packet per read: `av_read_frame` fills a packet without freeing what it held, so
            // reading into one packet again leaks the buffer of the one before (~100 KB a video).
            let mut packet = Packet::empty();
            match packet.read(&mut self.input) {
                Ok(()) => {}
                Err(ffmpeg::Error::Eof) => break,
                // A read error after some packets is a truncated file: index what is there.
                Err(e) if !packets.is_empty() => {
                    tracing::debug!("video index stops at a read error: {e}");
                    break;
                }
                Err(e) => {
                    return Err(VideoError::InvalidMedia(format!(
                        "cannot read the video: {e}"
                    )));
                }
            }
            if packet.stream() != self.stream {
                continue;
            }
            let pts = packet.pts().or(packet.dts()).unwrap_or(order);
            order += 1;
            packets.push(PacketEntry {
                pts,
                key: packet.is_key(),
            });
            if packets.len() as u64 > self.limits.max_indexed_frames {
                return Err(VideoError::LimitExceeded(format!(
                    "the video has more than {} frames",
                    self.limits.max_indexed_frames
                )));
            }
            if packets.len() % 256 == 0 && started.elapsed() > self.limits.max_decode_time() {
                return Err(self.time_limit());
            }
        }
        if packets.is_empty() {
            return Err(VideoError::InvalidMedia(
                "the video stream has no frames".into(),
            ));
        }
        self.index = FrameIndex::new(packets);
        Ok(())
    }

    fn time_limit(&self) -> VideoError {
        VideoError::TimedOut(format!(
            "decoding took longer than {} ms",
            self.limits.max_decode_ms
        ))
    }

    /// Decode frame `index` (in presentation order). Frames are cheapest asked for in ascending order:
    /// decoding goes on from the last one, or seeks to the keyframe before the target when that is
    /// nearer. `deadline` bounds this call on top of the video's own time limit.
    ///
    /// Frames before the target that no other frame references (most B-frames) are not decoded at
    /// all: nothing can ask for them later without seeking back. Should that ever cost the target
    /// itself (a decoder applying the setting a packet late), the frame is decoded again from its
    /// keyframe with nothing skipped.
    pub fn frame(&mut self, index: u64, deadline: Option<Instant>) -> Result<Frame, VideoError> {
        let started = Instant::now();
        let mut result = self.decode_frame(index, started, deadline, true);
        if matches!(result, Ok(ref frame) if !frame.exact) {
            self.positioned = false;
            result = self.decode_frame(index, started, deadline, false);
        }
        self.spent += started.elapsed();
        result
    }

    fn set_discard(&mut self, discard: Discard) {
        if self.discard != discard {
            self.decoder.skip_frame(discard);
            self.discard = discard;
        }
    }

    fn decode_frame(
        &mut self,
        index: u64,
        started: Instant,
        deadline: Option<Instant>,
        skip_unreferenced: bool,
    ) -> Result<Frame, VideoError> {
        let target = self.index.pts(index).ok_or_else(|| {
            VideoError::BadRequest(format!(
                "frame {index} does not exist: the video has {} frames",
                self.index.len()
            ))
        })?;
        let keyframe = self.index.keyframe_before(target);
        let decode_on = self.positioned
            && match self.last_pts {
                // Go on when the target is ahead and no keyframe lies between: seeking gains nothing.
                Some(last) => last < target && keyframe.is_none_or(|k| k <= last),
                None => !self.drained,
            };
        if !decode_on {
            self.seek(keyframe.or(self.index.first_pts()).unwrap_or(0))?;
        }
        let budget = self.limits.max_decode_time().saturating_sub(self.spent);
        let mut picture = frame::Video::empty();
        loop {
            while self.decoder.receive_frame(&mut picture).is_ok() {
                self.decoded += 1;
                if self.decoded > self.limits.max_decoded_frames {
                    return Err(VideoError::LimitExceeded(format!(
                        "more than {} frames decoded",
                        self.limits.max_decoded_frames
                    )));
                }
                let Some(pts) = picture.timestamp().or(picture.pts()) else {
                    continue;
                };
                self.last_pts = Some(pts);
                if pts >= target {
                    let mut frame = self.to_rgb(&picture, index)?;
                    frame.exact = pts == target;
                    return Ok(frame);
                }
            }
            if started.elapsed() > budget {
                return Err(self.time_limit());
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(VideoError::TimedOut(
                    "the call's deadline passed while decoding".into(),
                ));
            }
            if self.drained {
                return Err(VideoError::InvalidMedia(format!(
                    "frame {index} could not be decoded: the stream ends before it"
                )));
            }
            // A packet per read (see `build_index`).
            let mut packet = Packet::empty();
            match packet.read(&mut self.input) {
                Ok(()) if packet.stream() == self.stream => {
                    let before_target = packet.pts().is_some_and(|p| p < target);
                    self.set_discard(if skip_unreferenced && before_target {
                        Discard::NonReference
                    } else {
                        Discard::Default
                    });
                    // A corrupt packet loses its frame, not the video: decoding goes on with the next.
                    if let Err(e) = self.decoder.send_packet(&packet) {
                        tracing::debug!("video packet rejected by the decoder: {e}");
                    }
                }
                Ok(()) => {}
                Err(_) => {
                    // End of file or a truncated one: let the decoder give what it still holds.
                    let _ = self.decoder.send_eof();
                    self.drained = true;
                }
            }
        }
    }

    /// Position the demuxer at the keyframe with timestamp `pts` and reset the decoder.
    fn seek(&mut self, pts: i64) -> Result<(), VideoError> {
        // Without a stream index FFmpeg seeks in microseconds; round down so the demuxer lands on this
        // keyframe or an earlier one, never a later one.
        let micros = (i128::from(pts) * 1_000_000 * i128::from(self.time_base.numerator()))
            .div_euclid(i128::from(self.time_base.denominator()));
        let micros = i64::try_from(micros).unwrap_or(if micros < 0 { i64::MIN } else { i64::MAX });
        if self.input.seek(micros, ..micros).is_err() {
            // Some streams only seek to their start.
            self.input.seek(i64::MIN, ..).map_err(|e| {
                VideoError::InvalidMedia(format!("the video cannot be seeked: {e}"))
            })?;
        }
        self.decoder.flush();
        self.last_pts = None;
        self.drained = false;
        self.positioned = true;
        Ok(())
    }

    fn to_rgb(&self, picture: &frame::Video, index: u64) -> Result<Frame, VideoError> {
        let (w, h) = (picture.width(), picture.height());
        if w == 0 || h == 0 || picture.format() == Pixel::None {
            return Err(VideoError::InvalidMedia(format!(
                "frame {index} decoded to nothing"
            )));
        }
        check_pixels(w, h, &self.limits)?;
        let mut scaler = scaling::Context::get(
            picture.format(),
            w,
            h,
            Pixel::RGB24,
            w,
            h,
            scaling::Flags::BICUBIC,
        )
        .map_err(|e| {
            VideoError::Unsupported(format!(
                "cannot convert {:?} frames to RGB: {e}",
                picture.format()
            ))
        })?;
        let mut rgb_frame = frame::Video::empty();
        scaler
            .run(picture, &mut rgb_frame)
            .map_err(|e| VideoError::Internal(format!("RGB conversion failed: {e}")))?;
        let row = 3 * w as usize;
        let stride = rgb_frame.stride(0);
        let data = rgb_frame.data(0);
        let mut rgb = Vec::with_capacity(row * h as usize);
        for y in 0..h as usize {
            let start = y * stride;
            rgb.extend_from_slice(data.get(start..start + row).ok_or_else(|| {
                VideoError::Internal("the RGB frame is smaller than its size".into())
            })?);
        }
        let (width, height, rgb) = rotate_rgb(rgb, w, h, self.info.rotation);
        let pts = self.last_pts.unwrap_or(0);
        let first = self.index.first_pts().unwrap_or(0);
        Ok(Frame {
            index,
            timestamp: seconds(pts - first, self.time_base).max(0.0),
            width,
            height,
            rgb,
            exact: true,
        })
    }
}

fn check_pixels(w: u32, h: u32, limits: &Limits) -> Result<(), VideoError> {
    let pixels = u64::from(w) * u64::from(h);
    if pixels > limits.max_frame_pixels {
        return Err(VideoError::LimitExceeded(format!(
            "frames are {w}x{h} = {pixels} pixels; the limit is {}",
            limits.max_frame_pixels
        )));
    }
    Ok(())
}

fn check_duration(seconds: f64, limits: &Limits) -> Result<(), VideoError> {
    if !seconds.is_finite() || seconds > limits.max_duration_seconds {
        return Err(VideoError::LimitExceeded(format!(
            "the video lasts {seconds:.1} s; the limit is {:.0} s",
            limits.max_duration_seconds
        )));
    }
    Ok(())
}
