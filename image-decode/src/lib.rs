//! JPEG decoding for mmgate's plugin host, with libjpeg-turbo: the library Pillow decodes with, so
//! the pixels are Pillow's to the bit (its defaults: the accurate integer IDCT and "fancy" chroma
//! upsampling), at native speed with its SIMD kernels — faster than the same algorithm compiled to
//! WebAssembly, where the image plugins would otherwise decode.
//!
//! Everything a file controls is bounded before anything is allocated for it: the header's
//! dimensions against [`Limits`] (the host's, narrowed by the caller's), the progressive scans, the
//! decoder's working memory. Every failure is an [`ImageError`]; nothing panics.
//!
//! What it decodes is what Pillow turns into RGB the same way: 8-bit lossy JPEGs in YCbCr, RGB or
//! greyscale (greyscale replicated into the three channels, as `convert("RGB")` does). Others
//! (CMYK/YCCK, 12-bit, lossless) are [`ImageError::Unsupported`]: a caller with a decoder of its own
//! for them falls back to it.
//!
//! [`decode_jpeg_resized`] also resizes the decoded image as Pillow's `Image.resize` does, byte for
//! byte, with the plugins' own resampler (`mmgate-resample`) built natively.

mod turbo;

pub use mmgate_resample::Filter;

use serde::{Deserialize, Serialize};

/// Why an image could not be decoded. Each case maps to a client-facing class: the upload's fault
/// (invalid, unsupported, over a limit) or ours (internal).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ImageError {
    /// The bytes are not a complete JPEG (empty, truncated, corrupt).
    #[error("{0}")]
    InvalidMedia(String),
    /// A JPEG this decoder leaves to others: CMYK/YCCK, 12-bit, lossless.
    #[error("{0}")]
    Unsupported(String),
    /// Over a limit (bytes, width, height, pixels, progressive scans, decoder memory).
    #[error("{0}")]
    LimitExceeded(String),
    /// Not the upload's fault (the decoder could not be created, say).
    #[error("{0}")]
    Internal(String),
}

/// What one decode may cost. The host's limits are the defaults; a caller (a plugin) narrows them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Most bytes of an encoded image.
    pub max_bytes: usize,
    /// Widest image, in pixels.
    pub max_width: u32,
    /// Tallest image, in pixels.
    pub max_height: u32,
    /// Most pixels (width × height): Pillow's decompression-bomb limit by default.
    pub max_pixels: u64,
    /// Most scans of a progressive JPEG: each walks every coefficient, so an unbounded count would
    /// let a small file burn the CPU (real encoders write about ten).
    pub max_scans: u32,
    /// Most megabytes the decoder may allocate for itself beyond the output (a progressive JPEG's
    /// coefficients: about 6 bytes a pixel).
    pub max_decoder_memory_mb: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_bytes: 64 << 20,
            max_width: 65_500,
            max_height: 65_500,
            max_pixels: 89_478_485,
            max_scans: 1000,
            // 89 MP of progressive coefficients, with room for the rest.
            max_decoder_memory_mb: 640,
        }
    }
}

impl Limits {
    /// The tighter of each pair: what the host allows and what the caller asked for.
    pub fn narrowed(&self, other: &Limits) -> Limits {
        Limits {
            max_bytes: self.max_bytes.min(other.max_bytes),
            max_width: self.max_width.min(other.max_width),
            max_height: self.max_height.min(other.max_height),
            max_pixels: self.max_pixels.min(other.max_pixels),
            max_scans: self.max_scans.min(other.max_scans),
            max_decoder_memory_mb: self.max_decoder_memory_mb.min(other.max_decoder_memory_mb),
        }
    }
}

/// A decoded image: packed 8-bit RGB, row-major.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage {
    pub width: u32,
    pub height: u32,
    /// `width * height * 3` bytes.
    pub rgb: Vec<u8>,
}

/// Decodes the JPEG in `data` into RGB as Pillow would, within `limits`.
pub fn decode_jpeg(data: &[u8], limits: &Limits) -> Result<RgbImage, ImageError> {
    decode(data, limits, |header| Ok(0..header.height)).map(|decoded| decoded.image)
}

/// Rows `rows` (top to bottom, `rows.start < rows.end <= height`) of the JPEG in `data`, decoded
/// into RGB exactly as [`decode_jpeg`] decodes them in the whole image: the full width, `rows.len()`
/// rows high. The rows above are entropy-decoded (a JPEG cannot be entered in the middle) but not
/// transformed, upsampled or converted; those below are not read at all. So several callers can
/// share one large image out as bands, each paying for its own rows and the entropy decoding before
/// them. The file is checked for completeness as a whole decode checks it, and the whole image's
/// size against `limits`.
pub fn decode_jpeg_rows(
    data: &[u8],
    limits: &Limits,
    rows: std::ops::Range<u32>,
) -> Result<RgbImage, ImageError> {
    decode(data, limits, |_| Ok(rows)).map(|decoded| decoded.image)
}

/// How [`decode_jpeg_resized`] resizes: to `width` x `height` with `filter`, and of the resized
/// image only rows `rows`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resize {
    pub width: u32,
    pub height: u32,
    pub filter: Filter,
    pub rows: std::ops::Range<u32>,
}

/// The JPEG in `data` decoded as [`decode_jpeg`] decodes it, resized as Pillow's
/// `Image.resize((width, height), filter)` resizes it (the image as decoded when it is that size
/// already): of the resized image, rows `resize.rows`, each exactly that row of the whole resize.
/// Only the source rows those rows read are decoded (as [`decode_jpeg_rows`] decodes a band).
/// `limits` bound the resized image as well as the JPEG. [`ImageError::Unsupported`] where this
/// CPU runs the resize without SIMD (no AVX2): slower there than a plugin's own Wasm build of it,
/// so a plugin should resize itself.
pub fn decode_jpeg_resized(
    data: &[u8],
    limits: &Limits,
    resize: &Resize,
) -> Result<RgbImage, ImageError> {
    if !mmgate_resample::simd_kernels() {
        return Err(ImageError::Unsupported(
            "this host resizes without SIMD (no AVX2): the plugin's own resize is faster".into(),
        ));
    }
    let Resize {
        width,
        height,
        filter,
        ref rows,
    } = *resize;
    let Decoded {
        image: source,
        header,
        rows: read,
    } = decode(data, limits, |header| {
        check_resized((width, height), limits)?;
        check_rows(rows, height)?;
        let out_rows = rows.start as usize..rows.end as usize;
        let read =
            mmgate_resample::source_rows(header.height as usize, height as usize, filter, out_rows);
        // Within the source's height, so within u32.
        Ok(read.start as u32..read.end as u32)
    })?;
    if (source.width, header.height) == (width, height) {
        return Ok(source);
    }
    let source_rows = mmgate_resample::Rows {
        rgb: &source.rgb,
        width: source.width as usize,
        first_row: read.start as usize,
        image_height: header.height as usize,
    };
    let mut resized = mmgate_resample::Resized::new(
        source_rows,
        width as usize,
        height as usize,
        filter,
        rows.start as usize,
    );
    let mut rgb = Vec::with_capacity(width as usize * rows.len() * 3);
    for _ in rows.clone() {
        match resized.next_row() {
            Some(row) => rgb.extend_from_slice(row),
            None => break,
        }
    }
    Ok(RgbImage {
        width,
        height: rows.end - rows.start,
        rgb,
    })
}

fn check_rows(rows: &std::ops::Range<u32>, height: u32) -> Result<(), ImageError> {
    if rows.start >= rows.end || rows.end > height {
        return Err(ImageError::InvalidMedia(format!(
            "rows {}..{} are not within the image's {height} rows",
            rows.start, rows.end
        )));
    }
    Ok(())
}

/// Rows of a decoded image.
struct Decoded {
    /// The rows, at full width.
    image: RgbImage,
    /// The whole image's header.
    header: Header,
    /// Which rows of the whole image `image` holds.
    rows: std::ops::Range<u32>,
}

/// The image's rows that `choose_rows` picks once the header is read: everything a file controls
/// checked before anything is decoded.
fn decode(
    data: &[u8],
    limits: &Limits,
    choose_rows: impl FnOnce(&Header) -> Result<std::ops::Range<u32>, ImageError>,
) -> Result<Decoded, ImageError> {
    if data.is_empty() {
        return Err(ImageError::InvalidMedia(
            "the image is empty (0 bytes)".into(),
        ));
    }
    if data.len() > limits.max_bytes {
        return Err(ImageError::LimitExceeded(format!(
            "the image is {} bytes, more than the limit of {}",
            data.len(),
            limits.max_bytes
        )));
    }
    check_complete(data)?;
    let mut decoder = turbo::Decoder::new(limits)?;
    let header = decoder.header(data)?;
    header.check(limits)?;
    let rows = choose_rows(&header)?;
    check_rows(&rows, header.height)?;
    let rgb = decoder.decode_rgb_rows(data, &header, rows.clone())?;
    Ok(Decoded {
        image: RgbImage {
            width: header.width,
            height: rows.end - rows.start,
            rgb,
        },
        header,
        rows,
    })
}

/// A resize's output within `limits`, as an image's size is.
fn check_resized((width, height): (u32, u32), limits: &Limits) -> Result<(), ImageError> {
    let pixels = u64::from(width) * u64::from(height);
    if pixels == 0
        || width > limits.max_width
        || height > limits.max_height
        || pixels > limits.max_pixels
    {
        return Err(ImageError::LimitExceeded(format!(
            "a resize to {width}x{height} is outside the limits (1x1 to {}x{}, {} pixels)",
            limits.max_width, limits.max_height, limits.max_pixels
        )));
    }
    Ok(())
}

/// JPEG decoders fill a truncated scan with grey (libjpeg only warns); Pillow refuses such files
/// ("image file is truncated"), and so does this: the entropy-coded data must be followed by an
/// end-of-image marker. (Inside the scan, 0xFF bytes are stuffed, so 0xFF 0xD9 can only be a marker;
/// an EXIF thumbnail's own EOI comes before the first start-of-scan and does not count.)
fn check_complete(data: &[u8]) -> Result<(), ImageError> {
    let first_scan = data.windows(2).position(|w| w == [0xFF, 0xDA]);
    let last_eoi = data.windows(2).rposition(|w| w == [0xFF, 0xD9]);
    match (first_scan, last_eoi) {
        (Some(scan), Some(eoi)) if eoi > scan => Ok(()),
        _ => Err(ImageError::InvalidMedia(
            "the JPEG is truncated: its data ends before the end-of-image marker".into(),
        )),
    }
}

/// What the header says, before anything is decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub width: u32,
    pub height: u32,
    pub colorspace: Colorspace,
    pub precision: u32,
    pub lossless: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Colorspace {
    YCbCr,
    Rgb,
    Gray,
    Cmyk,
    Ycck,
}

impl Header {
    fn check(&self, limits: &Limits) -> Result<(), ImageError> {
        let (width, height) = (self.width, self.height);
        if width == 0 || height == 0 {
            return Err(ImageError::InvalidMedia(format!(
                "the image is {width}x{height}: it has no pixels"
            )));
        }
        let pixels = u64::from(width) * u64::from(height);
        if width > limits.max_width || height > limits.max_height || pixels > limits.max_pixels {
            return Err(ImageError::LimitExceeded(format!(
                "the image is {width}x{height} = {pixels} pixels, over the limits \
                 ({}x{}, {} pixels)",
                limits.max_width, limits.max_height, limits.max_pixels
            )));
        }
        if matches!(self.colorspace, Colorspace::Cmyk | Colorspace::Ycck) {
            return Err(ImageError::Unsupported(
                "CMYK and YCCK JPEGs are left to the plugin's decoder".into(),
            ));
        }
        if self.precision != 8 || self.lossless {
            return Err(ImageError::Unsupported(format!(
                "{}-bit{} JPEGs are left to the plugin's decoder (8-bit lossy ones are decoded here)",
                self.precision,
                if self.lossless { " lossless" } else { "" }
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_narrow_to_the_tighter_of_each() {
        let host = Limits::default();
        let plugin = Limits {
            max_pixels: 1000,
            max_scans: 5000,
            ..Limits::default()
        };
        let both = host.narrowed(&plugin);
        assert_eq!(both.max_pixels, 1000);
        assert_eq!(both.max_scans, host.max_scans);
    }

    #[test]
    fn empty_and_truncated_files_are_invalid() {
        let limits = Limits::default();
        assert!(matches!(
            decode_jpeg(&[], &limits),
            Err(ImageError::InvalidMedia(_))
        ));
        let start_of_scan_only = [0xFF, 0xD8, 0xFF, 0xDA, 0, 0];
        assert!(matches!(
            decode_jpeg(&start_of_scan_only, &limits),
            Err(ImageError::InvalidMedia(_))
        ));
    }
}
