//! Reading audio with symphonia: header-only probing with limits, then a bounded decode to mono.
//!
//! Formats: WAV (8/16/24/32-bit PCM, float), MP3, FLAC, Ogg Vorbis, AAC-LC in MP4/M4A. The container
//! is recognised from the bytes; the client's MIME type is only a hint.

use std::io::Cursor;

use mmgate_plugin_sdk::*;
use symphonia::core::audio::conv::FromSample;
use symphonia::core::audio::sample::Sample;
use symphonia::core::audio::{Audio, AudioBuffer, GenericAudioBufferRef};
use symphonia::core::codecs::audio::{AudioDecoder, AudioDecoderOptions};
use symphonia::core::errors::Error as SymphoniaError;
use symphonia::core::formats::probe::Hint;
use symphonia::core::formats::{FormatOptions, FormatReader, TrackType};
use symphonia::core::io::MediaSourceStream;
use symphonia::core::meta::MetadataOptions;

use crate::mp4::{self, Edit};

/// Largest encoded file accepted: 10 minutes of 48 kHz stereo 24-bit WAV is 173 MB; the gateway's
/// own upload limit (25 MB by default, like OpenAI's) is far below this.
pub const MAX_AUDIO_BYTES: usize = 192 << 20;
/// Longest audio accepted, in seconds (10 minutes = 20 chunks of 30 s).
pub const MAX_DURATION_SECONDS: f64 = 600.0;
/// Most channels accepted (7.1 surround is 8).
pub const MAX_CHANNELS: u32 = 16;
/// Sample rates outside this range are not real audio.
pub const SAMPLE_RATES: std::ops::RangeInclusive<u32> = 1_000..=384_000;

pub const MIME_TYPES: &[&str] = &[
    "audio/wav",
    "audio/x-wav",
    "audio/wave",
    "audio/vnd.wave",
    "audio/mpeg",
    "audio/mp3",
    "audio/flac",
    "audio/x-flac",
    "audio/ogg",
    "audio/vorbis",
    "audio/mp4",
    "audio/m4a",
    "audio/x-m4a",
    "audio/aac",
];

/// What `probe` learns without decoding.
#[derive(Debug, Clone, PartialEq)]
pub struct Header {
    /// `container/codec`, e.g. `wave/pcm_s16le`, `mp3/mp3`, `mp4/aac`.
    pub format: String,
    pub codec: String,
    pub sample_rate: u32,
    pub channels: u32,
    /// Frames (samples per channel) of audio, after any gapless trim.
    pub frames: u64,
}

impl Header {
    pub fn duration_seconds(&self) -> f64 {
        self.frames as f64 / f64::from(self.sample_rate)
    }
}

/// An opened audio track whose header passed the limits: what both `probe` and the decode need.
struct Stream<'a> {
    reader: Box<dyn FormatReader + 'a>,
    track_id: u32,
    decoder: Box<dyn AudioDecoder>,
    format: String,
    codec: String,
    sample_rate: u32,
    channels: u32,
    /// The length the container records, if it does (before any edit).
    frames: Option<u64>,
    /// The MP4 edit list's trim, applied after decoding (symphonia's MP4 reader does not).
    edit: Option<Edit>,
}

/// Frames of the longest audio accepted at `sample_rate`: longer is refused, whatever a header says.
fn max_frames(sample_rate: u32) -> u64 {
    (MAX_DURATION_SECONDS * f64::from(sample_rate)) as u64
}

fn open(data: &[u8]) -> PluginResult<Stream<'_>> {
    if data.is_empty() {
        return Err(PluginError::invalid("the audio file is empty (0 bytes)"));
    }
    if data.len() > MAX_AUDIO_BYTES {
        return Err(PluginError::limit(format!(
            "the audio file is {} bytes, more than the limit of {MAX_AUDIO_BYTES}",
            data.len()
        )));
    }
    let source = MediaSourceStream::new(Box::new(Cursor::new(data)), Default::default());
    let reader = symphonia::default::get_probe()
        .probe(
            &Hint::new(),
            source,
            FormatOptions::default(),
            MetadataOptions::default(),
        )
        .map_err(|e| match e {
            SymphoniaError::Unsupported(_) => PluginError::unsupported(
                "not a supported audio file: WAV, MP3, FLAC, Ogg Vorbis and AAC in MP4/M4A are",
            ),
            other => PluginError::invalid(format!("cannot read the audio container: {other}")),
        })?;
    let track = reader
        .default_track(TrackType::Audio)
        .ok_or_else(|| PluginError::invalid("the file has no audio track"))?;
    let params = track
        .codec_params
        .as_ref()
        .and_then(|p| p.audio())
        .ok_or_else(|| PluginError::invalid("the audio track has no codec parameters"))?;
    // Fails here, before anything else is read, when the codec is one we cannot decode.
    let decoder = symphonia::default::get_codecs()
        .make_audio_decoder(params, &AudioDecoderOptions::default())
        .map_err(|e| {
            PluginError::unsupported(format!(
                "the audio codec is not supported ({e}): PCM, MP3, FLAC, Vorbis and AAC-LC are"
            ))
        })?;
    let codec = symphonia::default::get_codecs()
        .get_audio_decoder(params.codec)
        .map_or("unknown", |d| d.codec.info.short_name)
        .to_owned();
    let sample_rate = params
        .sample_rate
        .ok_or_else(|| PluginError::invalid("the audio track does not say its sample rate"))?;
    if !SAMPLE_RATES.contains(&sample_rate) {
        return Err(PluginError::invalid(format!(
            "sample rate {sample_rate} Hz is not plausible audio ({}..={} Hz accepted)",
            SAMPLE_RATES.start(),
            SAMPLE_RATES.end()
        )));
    }
    let channels = params
        .channels
        .as_ref()
        .map(|c| c.count() as u32)
        .ok_or_else(|| PluginError::invalid("the audio track does not say its channel count"))?;
    if channels == 0 {
        return Err(PluginError::invalid("the audio track has no channels"));
    }
    if channels > MAX_CHANNELS {
        return Err(PluginError::limit(format!(
            "{channels} audio channels, more than the limit of {MAX_CHANNELS}"
        )));
    }
    let container = match reader.format_info().short_name {
        "isomp4" => "mp4",
        other => other,
    };
    let edit = if container == "mp4" {
        mp4::audio_edit(data, sample_rate)
    } else {
        None
    };
    Ok(Stream {
        format: format!("{container}/{codec}"),
        codec,
        track_id: track.id,
        frames: track.num_frames,
        reader,
        decoder,
        sample_rate,
        channels,
        edit,
    })
}

/// Read the header: container, codec, rate, channels and length, with the limits applied. The
/// length comes from the container when it records it; otherwise the packets are walked (demuxed,
/// not decoded) and their durations summed.
pub fn probe(data: &[u8]) -> PluginResult<Header> {
    let mut stream = open(data)?;
    let mut frames = match stream.frames {
        Some(frames) => frames,
        None => count_frames(
            stream.reader.as_mut(),
            stream.track_id,
            max_frames(stream.sample_rate),
        )?,
    };
    if let Some(edit) = stream.edit {
        frames = frames.saturating_sub(edit.skip).min(edit.keep);
    }
    let header = Header {
        format: stream.format,
        codec: stream.codec,
        sample_rate: stream.sample_rate,
        channels: stream.channels,
        frames,
    };
    check_duration(header.duration_seconds())?;
    if frames == 0 {
        return Err(PluginError::invalid("the audio track has no samples"));
    }
    Ok(header)
}

/// The duration limit, as `probe` and `plan` apply it.
pub fn check_duration(seconds: f64) -> PluginResult<()> {
    if seconds > MAX_DURATION_SECONDS {
        return Err(PluginError::limit(format!(
            "the audio is {seconds:.1} s long, more than the limit of {MAX_DURATION_SECONDS} s"
        )));
    }
    Ok(())
}

/// Sum packet durations without decoding; stops as soon as the duration limit is passed.
fn count_frames(
    reader: &mut dyn FormatReader,
    track_id: u32,
    max_frames: u64,
) -> PluginResult<u64> {
    let mut frames = 0u64;
    while let Some(packet) = next_packet(reader)? {
        if packet.track_id == track_id {
            frames = frames.saturating_add(packet.dur.get());
            if frames > max_frames {
                break;
            }
        }
    }
    Ok(frames)
}

fn next_packet(
    reader: &mut dyn FormatReader,
) -> PluginResult<Option<symphonia::core::packet::Packet>> {
    match reader.next_packet() {
        Ok(packet) => Ok(packet),
        // A stream that ends mid-packet ends there, as every player treats it.
        Err(SymphoniaError::IoError(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            Ok(None)
        }
        Err(e) => Err(PluginError::invalid(format!(
            "cannot read the audio stream: {e}"
        ))),
    }
}

/// Append the mean of `buffer`'s channels to `out`, converting samples to f32 as symphonia does
/// (`i16 / 32768`, `(u8 − 128) / 128`, ...), straight from the decoder's planes.
fn mix_to_mono(buffer: &GenericAudioBufferRef<'_>, out: &mut Vec<f32>) {
    fn mix<S: Sample>(buffer: &AudioBuffer<S>, out: &mut Vec<f32>)
    where
        f32: FromSample<S>,
    {
        let start = out.len();
        let planes = buffer.num_planes();
        if let Some(first) = buffer.plane(0) {
            out.extend(first.iter().map(|&s| f32::from_sample(s)));
        }
        for plane in (1..planes).filter_map(|ch| buffer.plane(ch)) {
            for (o, &s) in out[start..].iter_mut().zip(plane) {
                *o += f32::from_sample(s);
            }
        }
        if planes > 1 {
            let scale = 1.0 / planes as f32;
            out[start..].iter_mut().for_each(|o| *o *= scale);
        }
    }
    match buffer {
        GenericAudioBufferRef::U8(b) => mix(b, out),
        GenericAudioBufferRef::U16(b) => mix(b, out),
        GenericAudioBufferRef::U24(b) => mix(b, out),
        GenericAudioBufferRef::U32(b) => mix(b, out),
        GenericAudioBufferRef::S8(b) => mix(b, out),
        GenericAudioBufferRef::S16(b) => mix(b, out),
        GenericAudioBufferRef::S24(b) => mix(b, out),
        GenericAudioBufferRef::S32(b) => mix(b, out),
        GenericAudioBufferRef::F32(b) => mix(b, out),
        GenericAudioBufferRef::F64(b) => mix(b, out),
    }
}

/// Whether codec `codec` (a `Header::codec`) decodes each packet from its bytes alone, carrying
/// nothing from one packet to the next: PCM and FLAC (whose frames are self-contained), not MP3,
/// AAC or Vorbis (overlapping transforms, MP3's bit reservoir).
pub fn decodes_packets_alone(codec: &str) -> bool {
    codec.starts_with("pcm") || codec == "flac"
}

/// A packet's frames: raw 16-bit PCM, or what the codec's decoder made.
enum Frames<'a> {
    S16le(&'a [u8]),
    Decoded(GenericAudioBufferRef<'a>),
}

/// Append the mean of interleaved little-endian 16-bit frames of `channels` to `out`: what
/// symphonia's PCM decoder and [`mix_to_mono`] make of them, value for value (each sample
/// `s / 32768`, channels added in order, then scaled by `1 / channels`), without the decoder's
/// generic sample reader, which in Wasm took a large share of a 30 s clip's whole time.
fn mix_s16le_to_mono(data: &[u8], channels: usize, out: &mut Vec<f32>) {
    // Samples as two-byte arrays, not slices: no bounds check per byte, so a mono loop is a
    // vector loop (eight samples widened and converted a SIMD128 step in Wasm).
    let sample = |b: &[u8; 2]| f32::from(i16::from_le_bytes(*b)) / 32_768.0;
    let (samples, _) = data.as_chunks::<2>();
    if channels == 1 {
        out.extend(samples.iter().map(sample));
        return;
    }
    let scale = 1.0 / channels as f32;
    // The channels in order from zero: a sum that starts at the first (no sample is −0.0).
    out.extend(
        samples
            .chunks_exact(channels)
            .map(|frame| frame.iter().map(sample).sum::<f32>() * scale),
    );
}

/// Decoded audio: one channel (the mean of all channels) at the file's own rate, all of it or a
/// range of it.
pub struct MonoAudio {
    pub samples: Vec<f32>,
    pub sample_rate: u32,
    /// Index of `samples[0]` in the whole clip.
    pub offset: u64,
    /// The clip's length, when the decode reached its end.
    pub clip_len: Option<u64>,
}

/// Decode the whole audio track to mono f32 (the channel mean, as librosa's `to_mono`).
pub fn decode_mono(data: &[u8]) -> PluginResult<MonoAudio> {
    decode_mono_range(data, 0..u64::MAX)
}

/// Decode the audio track to mono f32 and keep the samples in `range` of the clip (what
/// [`decode_mono`] gives, sliced: every packet is decoded from the start, as codecs carry state
/// from one packet to the next and a skipped corrupt packet moves everything after it, but only
/// the range is mixed and kept, and decoding stops at its end). Bounded: a file whose packets run
/// past the duration limit (its header lied) is refused while decoding.
pub fn decode_mono_range(data: &[u8], range: std::ops::Range<u64>) -> PluginResult<MonoAudio> {
    decode_mono_range_with(data, range, true)
}

/// [`decode_mono_range`], with 16-bit PCM mixed from the packets' bytes (`raw_s16le`) or decoded
/// by symphonia like every other codec (the reference the fast path is tested against).
fn decode_mono_range_with(
    data: &[u8],
    range: std::ops::Range<u64>,
    raw_s16le: bool,
) -> PluginResult<MonoAudio> {
    let Stream {
        mut reader,
        track_id,
        mut decoder,
        sample_rate,
        channels,
        frames,
        edit,
        codec,
        ..
    } = open(data)?;
    let stateless = decodes_packets_alone(&codec);
    let s16le = raw_s16le && codec == "pcm_s16le";
    let max_frames = max_frames(sample_rate);
    let channels = channels as usize;
    // The clip's samples are the decoder's after the MP4 edit's skip, at most `keep` of them.
    let (skip, keep) = edit.map_or((0, u64::MAX), |e| (e.skip, e.keep));
    let wanted = range.start.saturating_add(skip)..range.end.min(keep).saturating_add(skip);
    let capacity = frames
        .unwrap_or(0)
        .min(max_frames)
        .min(wanted.end.saturating_sub(wanted.start));
    let mut samples: Vec<f32> = Vec::with_capacity(capacity as usize);
    // Decoded samples so far, and whether the stream ended before the range did.
    let mut position = 0u64;
    let mut ended = true;
    let (mut packets, mut bad_packets) = (0usize, 0usize);
    while let Some(packet) = next_packet(reader.as_mut())? {
        if packet.track_id != track_id {
            continue;
        }
        packets += 1;
        // Such a packet decodes to its duration in frames, from its own bytes alone: one wholly
        // before the range need not be decoded to know where the next begins.
        let packet_end = position.saturating_add(packet.dur.get());
        if stateless && packet_end <= wanted.start {
            position = packet_end;
            continue;
        }
        // 16-bit PCM, the commonest WAV, is mixed straight from the packet's bytes (see
        // `mix_s16le_to_mono`); anything else goes through the codec's decoder.
        let frame_bytes = 2 * channels;
        let raw_s16 = s16le
            && packet.trim_start.get() == 0
            && packet.trim_end.get() == 0
            && !packet.data.is_empty()
            && packet.data.len().is_multiple_of(frame_bytes);
        let frames = if raw_s16 {
            Frames::S16le(&packet.data)
        } else {
            match decoder.decode(&packet) {
                Ok(decoded) => Frames::Decoded(decoded),
                // A corrupt packet is skipped (what players and FFmpeg do); a file of nothing
                // else is refused below.
                Err(SymphoniaError::DecodeError(_) | SymphoniaError::IoError(_)) => {
                    bad_packets += 1;
                    continue;
                }
                Err(e) => {
                    return Err(PluginError::invalid(format!(
                        "cannot decode the audio: {e}"
                    )));
                }
            }
        };
        let packet_frames = match &frames {
            Frames::S16le(data) => (data.len() / frame_bytes) as u64,
            Frames::Decoded(decoded) => {
                let packet_channels = decoded.spec().channels().count();
                if packet_channels != channels {
                    return Err(PluginError::invalid(format!(
                        "the channel count changes mid-stream ({channels} → {packet_channels})"
                    )));
                }
                decoded.frames() as u64
            }
        };
        let span = position..position + packet_frames;
        position = span.end;
        if position > max_frames {
            return Err(PluginError::limit(format!(
                "the audio runs past the limit of {MAX_DURATION_SECONDS} s while decoding"
            )));
        }
        if span.end <= wanted.start {
            continue;
        }
        let kept_from = samples.len();
        match &frames {
            Frames::S16le(data) => mix_s16le_to_mono(data, channels, &mut samples),
            Frames::Decoded(decoded) => mix_to_mono(decoded, &mut samples),
        }
        // Of this packet, drop what lies before the range and after it.
        let head = wanted.start.saturating_sub(span.start).min(packet_frames) as usize;
        samples.drain(kept_from..kept_from + head);
        if span.end >= wanted.end {
            samples.truncate(wanted.end.saturating_sub(wanted.start) as usize);
            ended = false;
            break;
        }
    }
    // The host's log exists only inside the sandbox (the native benchmark build has no host).
    #[cfg(target_arch = "wasm32")]
    if bad_packets > 0 {
        log::warn(&format!(
            "skipped {bad_packets} of {packets} corrupt audio packets"
        ));
    }
    let clip_len = position.saturating_sub(skip).min(keep);
    // Known when the stream ended, or when the edit's `keep` ended the clip before the range did.
    let known = ended || position.saturating_sub(skip) >= keep;
    if ended && clip_len == 0 {
        return Err(PluginError::invalid(if bad_packets > 0 {
            format!("none of the {packets} audio packets could be decoded")
        } else {
            "the audio stream holds no samples".to_owned()
        }));
    }
    Ok(MonoAudio {
        samples,
        sample_rate,
        offset: range.start,
        clip_len: known.then_some(clip_len),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sixteen_bit_pcm_mixed_from_its_bytes_is_what_the_decoder_gives() {
        for name in [
            "speech-16k-s16.wav",
            "stereo-16k-s16.wav",
            "speech-44k1-stereo-s16.wav",
            "tone-8k-s16.wav",
        ] {
            let data = std::fs::read(format!(
                "{}/../../tests/fixtures/audio/clips/{name}",
                env!("CARGO_MANIFEST_DIR")
            ))
            .unwrap();
            for range in [0..u64::MAX, 1_000..20_000, 7..8] {
                let fast = decode_mono_range_with(&data, range.clone(), true).unwrap();
                let reference = decode_mono_range_with(&data, range.clone(), false).unwrap();
                assert!(!fast.samples.is_empty(), "{name}");
                assert!(
                    fast.samples == reference.samples && fast.clip_len == reference.clip_len,
                    "{name} {range:?}"
                );
            }
        }
    }
}
