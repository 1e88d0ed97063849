//! MP4 edit lists: the gapless trim symphonia's MP4 reader leaves undone.
//!
//! AAC encoders prepend priming samples (1024 for FFmpeg's and Apple's) and pad the last frame; the
//! track's edit list (`moov/trak/edts/elst`) says which span is the real audio. Without it, every
//! M4A clip would start with 64 ms of codec warm-up at 16 kHz and end with padding, and its length
//! (so its Qwen2-Audio token count) would be off. FFmpeg applies the same edit.

/// The span of decoded frames that is the real audio.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Edit {
    /// Frames to drop at the start (the encoder's priming).
    pub skip: u64,
    /// Frames to keep after those.
    pub keep: u64,
}

/// A bounds-checked reader over untrusted bytes: every read is `None` past the end.
struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn u32(&self, at: usize) -> Option<u32> {
        Some(u32::from_be_bytes(self.0.get(at..at + 4)?.try_into().ok()?))
    }
    fn u64(&self, at: usize) -> Option<u64> {
        Some(u64::from_be_bytes(self.0.get(at..at + 8)?.try_into().ok()?))
    }
}

/// The boxes directly inside `data[start..end]`: (type, payload range).
fn boxes(data: &[u8], start: usize, end: usize) -> impl Iterator<Item = ([u8; 4], usize, usize)> {
    let bytes = Bytes(data);
    let mut at = start;
    std::iter::from_fn(move || {
        let size = bytes.u32(at)? as usize;
        let kind: [u8; 4] = data.get(at + 4..at + 8)?.try_into().ok()?;
        let (header, size) = match size {
            1 => (16, usize::try_from(bytes.u64(at + 8)?).ok()?),
            0 => (8, end - at),
            n => (8, n),
        };
        let box_end = at.checked_add(size)?;
        if size < header || box_end > end {
            return None;
        }
        let payload = (at + header, box_end);
        at = box_end;
        Some((kind, payload.0, payload.1))
    })
}

fn child(data: &[u8], parent: (usize, usize), kind: &[u8; 4]) -> Option<(usize, usize)> {
    boxes(data, parent.0, parent.1)
        .find(|(k, _, _)| k == kind)
        .map(|(_, s, e)| (s, e))
}

/// The timescale of an `mvhd` or `mdhd` box (same layout up to it).
fn timescale(data: &[u8], header: (usize, usize)) -> Option<u64> {
    let version = *data.get(header.0)?;
    let at = header.0 + if version == 1 { 20 } else { 12 };
    Bytes(data).u32(at).map(u64::from).filter(|&t| t > 0)
}

/// The edit of the first sound track of an MP4 file, in frames at `sample_rate`; `None` when the
/// file has no usable edit list (then the decoded frames are taken as they are).
pub fn audio_edit(data: &[u8], sample_rate: u32) -> Option<Edit> {
    let moov = boxes(data, 0, data.len())
        .find(|(k, _, _)| k == b"moov")
        .map(|(_, s, e)| (s, e))?;
    let movie_timescale = timescale(data, child(data, moov, b"mvhd")?)?;
    let bytes = Bytes(data);
    boxes(data, moov.0, moov.1)
        .filter(|(k, _, _)| k == b"trak")
        .find_map(|(_, start, end)| {
            let trak = (start, end);
            let mdia = child(data, trak, b"mdia")?;
            let hdlr = child(data, mdia, b"hdlr")?;
            if data.get(hdlr.0 + 8..hdlr.0 + 12)? != b"soun" {
                return None;
            }
            let media_timescale = timescale(data, child(data, mdia, b"mdhd")?)?;
            let elst = child(data, child(data, trak, b"edts")?, b"elst")?;
            let version = *data.get(elst.0)?;
            let count = bytes.u32(elst.0 + 4)? as usize;
            let entry_size = if version == 1 { 20 } else { 12 };
            (0..count.min(64)).find_map(|i| {
                let at = elst.0 + 8 + i * entry_size;
                let (duration, media_time) = if version == 1 {
                    (bytes.u64(at)?, bytes.u64(at + 8)? as i64)
                } else {
                    (
                        u64::from(bytes.u32(at)?),
                        i64::from(bytes.u32(at + 4)? as i32),
                    )
                };
                // media_time −1 is an empty edit (a pause before the track): not audio to trim.
                let media_time = u64::try_from(media_time).ok()?;
                let rate = u128::from(sample_rate);
                let rescale = |value: u64, timescale: u64| -> Option<u64> {
                    let t = u128::from(timescale);
                    u64::try_from((u128::from(value) * rate + t / 2) / t).ok()
                };
                Some(Edit {
                    skip: rescale(media_time, media_timescale)?,
                    keep: rescale(duration, movie_timescale)?,
                })
            })
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mp4_box(kind: &[u8; 4], payload: &[u8]) -> Vec<u8> {
        let mut out = ((payload.len() + 8) as u32).to_be_bytes().to_vec();
        out.extend_from_slice(kind);
        out.extend_from_slice(payload);
        out
    }

    /// A skeleton M4A: mvhd (timescale 1000), one sound trak with mdhd (timescale 16000) and an
    /// edit list of `edits` (duration in ms, media time in samples).
    fn m4a(edits: &[(u32, i32)]) -> Vec<u8> {
        let mut mvhd = vec![0u8; 12];
        mvhd.extend_from_slice(&1000u32.to_be_bytes());
        mvhd.extend_from_slice(&[0; 4]);
        let mut mdhd = vec![0u8; 12];
        mdhd.extend_from_slice(&16_000u32.to_be_bytes());
        mdhd.extend_from_slice(&[0; 4]);
        let mut hdlr = vec![0u8; 8];
        hdlr.extend_from_slice(b"soun");
        let mut elst = vec![0u8; 4];
        elst.extend_from_slice(&(edits.len() as u32).to_be_bytes());
        for &(duration, media_time) in edits {
            elst.extend_from_slice(&duration.to_be_bytes());
            elst.extend_from_slice(&media_time.to_be_bytes());
            elst.extend_from_slice(&0x0001_0000u32.to_be_bytes());
        }
        let mdia = [mp4_box(b"mdhd", &mdhd), mp4_box(b"hdlr", &hdlr)].concat();
        let trak = [
            mp4_box(b"edts", &mp4_box(b"elst", &elst)),
            mp4_box(b"mdia", &mdia),
        ]
        .concat();
        let moov = [mp4_box(b"mvhd", &mvhd), mp4_box(b"trak", &trak)].concat();
        [mp4_box(b"ftyp", b"M4A \0\0\0\0"), mp4_box(b"moov", &moov)].concat()
    }

    #[test]
    fn reads_priming_and_duration() {
        assert_eq!(
            audio_edit(&m4a(&[(3205, 1024)]), 16_000),
            Some(Edit {
                skip: 1024,
                keep: 51_280
            })
        );
        // At another output rate both are rescaled, rounding to nearest.
        assert_eq!(
            audio_edit(&m4a(&[(3205, 1024)]), 44_100),
            Some(Edit {
                skip: 2822,
                keep: 141_341
            })
        );
    }

    #[test]
    fn empty_edits_are_skipped() {
        assert_eq!(
            audio_edit(&m4a(&[(500, -1), (1000, 2048)]), 16_000),
            Some(Edit {
                skip: 2048,
                keep: 16_000
            })
        );
    }

    #[test]
    fn malformed_or_missing_boxes_give_none() {
        let file = m4a(&[(3205, 1024)]);
        for cut in 0..file.len() {
            // Any truncation either still parses (cut inside trailing data) or gives None; it
            // never panics or reads out of bounds.
            let _ = audio_edit(&file[..cut], 16_000);
        }
        assert_eq!(audio_edit(&m4a(&[]), 16_000), None);
        assert_eq!(audio_edit(b"RIFF\0\0\0\0WAVE", 16_000), None);
    }
}
