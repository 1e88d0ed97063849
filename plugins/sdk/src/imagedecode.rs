//! Reading images (feature `image`): header-only probing with limits, bounded decoding, and the
//! conversion to RGB that HF processors apply (transformers' `convert_to_rgb`: transparency composited
//! onto white, then Pillow's `convert("RGB")`). Every image plugin needs exactly this, so it lives here
//! once: JPEG, PNG, WebP, GIF (first frame), BMP and TIFF.
//!
//! ```ignore
//! let info = imagedecode::probe(&media.data)?.media_info(); // header only; limits checked
//! let (width, height) = imagedecode::dimensions(&info)?;     // in `plan`
//! let image = imagedecode::decode_rgb(&media.data)?; // bounded decode, RGB8
//! ```

use std::io::Cursor;

use crate::imageops::{Filter, RgbImage};
use crate::{MediaInfo, PluginError, PluginResult};
use image::{DynamicImage, ImageFormat, ImageReader, Limits};

/// Pillow's default `Image.MAX_IMAGE_PIXELS`: larger images are treated as decompression bombs.
pub const MAX_IMAGE_PIXELS: u64 = 89_478_485;
/// Largest encoded image accepted (a 89 MP PNG of noise is ~270 MB; real uploads are far smaller).
pub const MAX_IMAGE_BYTES: usize = 64 << 20;
/// Longest side over shortest side; Qwen2-VL's `smart_resize` refuses more than this.
pub const MAX_ASPECT_RATIO: f64 = 200.0;
/// What a decoder may allocate beyond the pixels themselves (ICC profiles, metadata, scratch).
const MAX_DECODE_OVERHEAD: u64 = 64 << 20;

/// The MIME types [`decode_rgb`] reads.
pub const MIME_TYPES: &[&str] = &[
    "image/png",
    "image/jpeg",
    "image/webp",
    "image/gif",
    "image/bmp",
    "image/tiff",
];

/// What `probe` learns from the header alone.
pub struct Header {
    pub format: &'static str,
    pub width: u32,
    pub height: u32,
}

fn reader(data: &[u8]) -> PluginResult<ImageReader<Cursor<&[u8]>>> {
    if data.is_empty() {
        return Err(PluginError::invalid("the image is empty (0 bytes)"));
    }
    if data.len() > MAX_IMAGE_BYTES {
        return Err(PluginError::limit(format!(
            "the image is {} bytes, more than the limit of {MAX_IMAGE_BYTES}",
            data.len()
        )));
    }
    let reader = ImageReader::new(Cursor::new(data))
        .with_guessed_format()
        .map_err(|e| PluginError::invalid(format!("cannot read the image: {e}")))?;
    match reader.format() {
        Some(
            ImageFormat::Png
            | ImageFormat::Jpeg
            | ImageFormat::WebP
            | ImageFormat::Gif
            | ImageFormat::Bmp
            | ImageFormat::Tiff,
        ) => Ok(reader),
        Some(other) => Err(PluginError::unsupported(format!(
            "image format {other:?} is not supported (PNG, JPEG, WebP, GIF, BMP and TIFF are)"
        ))),
        None => Err(PluginError::invalid(
            "not an image: the bytes match no supported image format",
        )),
    }
}

fn format_name(format: Option<ImageFormat>) -> &'static str {
    match format {
        Some(ImageFormat::Png) => "png",
        Some(ImageFormat::Jpeg) => "jpeg",
        Some(ImageFormat::WebP) => "webp",
        Some(ImageFormat::Gif) => "gif",
        Some(ImageFormat::Bmp) => "bmp",
        Some(ImageFormat::Tiff) => "tiff",
        _ => "unknown",
    }
}

fn check_dimensions(width: u32, height: u32) -> PluginResult<()> {
    if width == 0 || height == 0 {
        return Err(PluginError::invalid(format!(
            "the image is {width}x{height}: it has no pixels"
        )));
    }
    let pixels = u64::from(width) * u64::from(height);
    if pixels > MAX_IMAGE_PIXELS {
        return Err(PluginError::limit(format!(
            "the image is {width}x{height} = {pixels} pixels, more than the limit of \
             {MAX_IMAGE_PIXELS} (a possible decompression bomb)"
        )));
    }
    let aspect = f64::from(width.max(height)) / f64::from(width.min(height));
    if aspect > MAX_ASPECT_RATIO {
        return Err(PluginError::limit(format!(
            "the image is {width}x{height}: its aspect ratio {aspect:.1} is more than \
             {MAX_ASPECT_RATIO}"
        )));
    }
    Ok(())
}

/// Reads the header only and applies every limit that does not need the pixels.
pub fn probe(data: &[u8]) -> PluginResult<Header> {
    let reader = reader(data)?;
    let format = format_name(reader.format());
    let (width, height) = reader
        .into_dimensions()
        .map_err(|e| PluginError::invalid(format!("cannot read the {format} header: {e}")))?;
    check_dimensions(width, height)?;
    Ok(Header {
        format,
        width,
        height,
    })
}

impl Header {
    /// The `media-info` a plugin's `probe` returns for this image.
    pub fn media_info(&self) -> MediaInfo {
        let mut info = MediaInfo::new("image", self.format);
        info.width = Some(self.width);
        info.height = Some(self.height);
        info
    }
}

/// The image's width and height from the `media-info` its `probe` returned (for `plan`).
pub fn dimensions(info: &MediaInfo) -> PluginResult<(u32, u32)> {
    match (info.width, info.height) {
        (Some(width @ 1..), Some(height @ 1..)) => Ok((width, height)),
        _ => Err(PluginError::invalid(
            "the media info has no image dimensions (was it probed by an image plugin?)",
        )),
    }
}

/// Decodes the whole image (the first frame of an animation) into RGB as HF processors see it.
pub fn decode_rgb(data: &[u8]) -> PluginResult<RgbImage> {
    decode_probed(data, &probe(data)?)
}

/// [`decode_rgb`] of an image whose header [`probe`] has read: a JPEG by the host where it
/// decodes it, else here.
fn decode_probed(data: &[u8], header: &Header) -> PluginResult<RgbImage> {
    if header.format == "jpeg"
        && let Some(image) = decode_jpeg_in_host(data, header, HostDecode::Whole)?
    {
        return Ok(image);
    }
    decode_here(data, header)
}

/// The whole image decoded by the plugin's own decoders.
fn decode_here(data: &[u8], header: &Header) -> PluginResult<RgbImage> {
    if header.format == "jpeg" {
        // The host checks completeness itself; the plugin's own decoder needs the check here.
        check_jpeg_complete(data)?;
        return decode_jpeg(data, header);
    }
    decode_other(data, header)
}

/// [`decode_rgb`]'s image resized to `width` x `height` as [`RgbImage::into_resized`] resizes it
/// (Pillow's resize, byte for byte). A JPEG the host decodes is resized there too (contract
/// 0.5.1's `decode-jpeg-resized`: the same resize, natively with SIMD), so only the resized image
/// crosses into the sandbox; any other image, or a JPEG the host leaves to the plugin (or a host
/// without a resize faster than the plugin's own), is decoded and resized here.
pub fn decode_rgb_resized(
    data: &[u8],
    (width, height): (usize, usize),
    filter: Filter,
) -> PluginResult<RgbImage> {
    let header = probe(data)?;
    if header.format == "jpeg"
        && let Some(image) = decode_jpeg_in_host(
            data,
            &header,
            HostDecode::Resized(width, height, filter, 0..height),
        )?
    {
        return Ok(image);
    }
    Ok(decode_probed(data, &header)?.into_resized(width, height, filter))
}

/// Rows of an image: `rows` holds its rows `first_row..first_row + rows.height`, of its
/// `image_height`.
pub struct ImageRows {
    pub rows: RgbImage,
    pub first_row: usize,
    pub image_height: usize,
}

/// What output rows `out_rows` of the image resized to `width` x `height` are made from, for a
/// plugin making a large image in bands of rows: a JPEG the host decodes and resizes gives those
/// resized rows themselves (0.5.1's `decode-jpeg-resized`, decoding only the source rows they
/// read); otherwise the source rows they read ([`source_rows`](crate::imageops::source_rows),
/// decoded as [`decode_rgb_rows`] decodes them) for the plugin's own resize, which makes the same
/// bytes. `header` is what [`probe`] read of `data`.
pub fn decode_rgb_resized_rows(
    data: &[u8],
    header: &Header,
    (width, height): (usize, usize),
    filter: Filter,
    out_rows: std::ops::Range<usize>,
) -> PluginResult<ImageRows> {
    if out_rows.start >= out_rows.end || out_rows.end > height {
        return Err(PluginError::internal(format!(
            "rows {}..{} are not within the resized image's {height} rows",
            out_rows.start, out_rows.end
        )));
    }
    if header.format == "jpeg"
        && let Some(rows) = decode_jpeg_in_host(
            data,
            header,
            HostDecode::Resized(width, height, filter, out_rows.clone()),
        )?
    {
        return Ok(ImageRows {
            rows,
            first_row: out_rows.start,
            image_height: height,
        });
    }
    let source_height = header.height as usize;
    let read = crate::imageops::source_rows(source_height, height, filter, out_rows);
    Ok(ImageRows {
        first_row: read.start,
        rows: decode_rgb_rows(data, header, read)?,
        image_height: source_height,
    })
}

/// Rows `rows` of the image (top to bottom, within its height) at full width: exactly those rows
/// of [`decode_rgb`]'s image. For a plugin making a large image in bands of rows: a JPEG the host
/// decodes (contract 0.4.1's `decode-jpeg-rows`) costs only its band and the entropy decoding
/// above it; any other image (or JPEG the host leaves to the plugin) is decoded whole and cut.
/// `header` is what [`probe`] read of `data` (a caller choosing rows has it already).
pub fn decode_rgb_rows(
    data: &[u8],
    header: &Header,
    rows: std::ops::Range<usize>,
) -> PluginResult<RgbImage> {
    if rows.start >= rows.end || rows.end > header.height as usize {
        return Err(PluginError::internal(format!(
            "rows {}..{} are not within the image's {} rows",
            rows.start, rows.end, header.height
        )));
    }
    if header.format == "jpeg"
        && let Some(image) = decode_jpeg_in_host(data, header, HostDecode::Rows(rows.clone()))?
    {
        return Ok(image);
    }
    let whole = decode_here(data, header)?;
    let row = whole.width * 3;
    // The decoder's own height may fall short of the header's (checked for other formats only).
    let band = whole
        .data
        .get(rows.start * row..rows.end * row)
        .ok_or_else(|| {
            PluginError::invalid("the image decodes to fewer rows than its header says")
        })?;
    Ok(RgbImage {
        width: whole.width,
        height: rows.len(),
        data: band.to_vec(),
    })
}

/// An image that is not a JPEG, with the `image` crate's decoder.
fn decode_other(data: &[u8], header: &Header) -> PluginResult<RgbImage> {
    let mut reader = reader(data)?;
    // The header's dimensions are the most the decoder may produce, and its allocations are bounded
    // by twice the largest pixel buffer those dimensions need (16-bit RGBA) plus a fixed overhead.
    // The sandbox's memory cap bounds it all again.
    let mut limits = Limits::default();
    limits.max_image_width = Some(header.width);
    limits.max_image_height = Some(header.height);
    limits.max_alloc = Some(decode_memory_cap(header));
    reader.limits(limits);
    let decoded = reader.decode().map_err(|e| {
        PluginError::invalid(format!("cannot decode the {} image: {e}", header.format))
    })?;
    let image = to_rgb(decoded)?;
    // A decoder that answers other dimensions than its header said would break every row range.
    if (image.width, image.height) != (header.width as usize, header.height as usize) {
        return Err(PluginError::invalid(format!(
            "the {} image decodes to {}x{}, not the {}x{} its header says",
            header.format, image.width, image.height, header.width, header.height
        )));
    }
    Ok(image)
}

fn decode_memory_cap(header: &Header) -> u64 {
    u64::from(header.width) * u64::from(header.height) * 16 + MAX_DECODE_OVERHEAD
}

/// More scans than any real progressive JPEG has (encoders write ~10); each scan walks every
/// coefficient, so an unbounded count would let a small file burn the CPU.
const MAX_JPEG_SCANS: usize = 1000;

/// What a plugin asks the host's JPEG decoder for.
// Natively there is no host to ask (see the stub below).
#[cfg_attr(not(target_arch = "wasm32"), allow(dead_code))]
enum HostDecode {
    /// The whole image (0.3.1's `decode-jpeg`).
    Whole,
    /// Only these rows (0.4.1's `decode-jpeg-rows`).
    Rows(std::ops::Range<usize>),
    /// Rows of the image resized to a width and height (0.5.1's `decode-jpeg-resized`).
    Resized(usize, usize, Filter, std::ops::Range<usize>),
}

/// Most JPEGs are decoded by the host (contract 0.3.1's `image` capability): libjpeg-turbo itself,
/// natively with its SIMD kernels, faster than [`decode_jpeg`] compiled to WebAssembly, and the
/// same pixels. `None` when the host leaves the file to the plugin (CMYK/YCCK, 12-bit,
/// lossless; a resize on a CPU where the host's is no faster), or natively (the benchmark's
/// baseline and unit tests), where there is no host.
#[cfg(target_arch = "wasm32")]
fn decode_jpeg_in_host(
    data: &[u8],
    header: &Header,
    ask: HostDecode,
) -> PluginResult<Option<RgbImage>> {
    use crate::bindings::mmgate::modality::image::{
        self as host, ImageError, ImageLimits, ResampleFilter, Resize,
    };
    let limits = ImageLimits {
        max_width: header.width,
        max_height: header.height,
        max_pixels: MAX_IMAGE_PIXELS,
        max_scans: MAX_JPEG_SCANS as u32,
    };
    let (decoded, width, height) = match ask {
        HostDecode::Whole => (
            host::decode_jpeg(data, limits),
            header.width as usize,
            header.height as usize,
        ),
        // Within the header's height (checked by the caller), so within u32.
        HostDecode::Rows(rows) => (
            host::decode_jpeg_rows(data, limits, rows.start as u32, rows.len() as u32),
            header.width as usize,
            rows.len(),
        ),
        HostDecode::Resized(width, height, filter, rows) => {
            let (Ok(w), Ok(h)) = (u32::try_from(width), u32::try_from(height)) else {
                return Err(PluginError::limit(format!(
                    "a resize to {width}x{height} is too large"
                )));
            };
            // The resized image may be larger than the source: its own size bounds it.
            let limits = ImageLimits {
                max_width: header.width.max(w),
                max_height: header.height.max(h),
                ..limits
            };
            let to = Resize {
                width: w,
                height: h,
                filter: match filter {
                    Filter::Bilinear => ResampleFilter::Bilinear,
                    Filter::Bicubic => ResampleFilter::Bicubic,
                },
                // Within the resized height (checked by the caller), so within u32.
                first_row: rows.start as u32,
                rows: rows.len() as u32,
            };
            (
                host::decode_jpeg_resized(data, limits, to),
                width,
                rows.len(),
            )
        }
    };
    match decoded {
        Ok(image)
            if image.width as usize == width
                && image.height as usize == height
                && image.rgb.len() == width * height * 3 =>
        {
            Ok(Some(RgbImage {
                width,
                height,
                data: image.rgb,
            }))
        }
        Ok(_) => Err(PluginError::internal(
            "the host's decoded image has an unexpected size",
        )),
        Err(ImageError::Unsupported(_)) => Ok(None),
        Err(ImageError::InvalidMedia(m)) => Err(PluginError::invalid(m)),
        Err(ImageError::LimitExceeded(m)) => Err(PluginError::limit(m)),
        Err(ImageError::Internal(m)) => Err(PluginError::internal(m)),
    }
}

#[cfg(not(target_arch = "wasm32"))]
fn decode_jpeg_in_host(
    _data: &[u8],
    _header: &Header,
    _ask: HostDecode,
) -> PluginResult<Option<RgbImage>> {
    Ok(None)
}

/// JPEGs are decoded as libjpeg-turbo (Pillow's decoder) does, to the bit: its accurate integer
/// IDCT, "fancy" (triangle) chroma upsampling and fixed-point YCbCr tables, and Pillow's plain
/// inversion for Adobe CMYK. Other decoders differ by a few levels in a quarter of the samples, which
/// the model would see as noise the reference never had.
fn decode_jpeg(data: &[u8], header: &Header) -> PluginResult<RgbImage> {
    use libjpeg_turbo_rs::{DecodeLimits, Decoder, JpegError, PixelFormat};
    let limits = DecodeLimits {
        max_width: header.width as usize,
        max_height: header.height as usize,
        max_pixels: MAX_IMAGE_PIXELS,
        max_scans: MAX_JPEG_SCANS,
        max_memory: Some(decode_memory_cap(header)),
    };
    let error = |e: JpegError| match e {
        JpegError::LimitExceeded { .. } | JpegError::AllocationFailed { .. } => {
            PluginError::limit(format!("cannot decode the jpeg image: {e}"))
        }
        JpegError::Unsupported(_) => {
            PluginError::unsupported(format!("cannot decode the jpeg image: {e}"))
        }
        _ => PluginError::invalid(format!("cannot decode the jpeg image: {e}")),
    };
    let mut decoder = Decoder::new_with_limits(data, limits).map_err(error)?;
    decoder.set_output_format(PixelFormat::Rgb);
    let image = decoder.decode_image().map_err(error)?;
    if image.precision != 8 {
        return Err(PluginError::unsupported(format!(
            "{}-bit JPEGs are not supported (8-bit are)",
            image.precision
        )));
    }
    if image.data.len() != image.width * image.height * 3 {
        return Err(PluginError::internal(
            "decoded image has an unexpected size",
        ));
    }
    Ok(RgbImage {
        width: image.width,
        height: image.height,
        data: image.data,
    })
}

/// JPEG decoders fill a truncated scan with grey (libjpeg only warns); Pillow refuses such files
/// ("image file is truncated"), and so does this: the entropy-coded data must be followed by an
/// end-of-image marker. (Inside the scan, 0xFF bytes are stuffed, so 0xFF 0xD9 can only be a marker;
/// an EXIF thumbnail's own EOI comes before the first start-of-scan and does not count.)
fn check_jpeg_complete(data: &[u8]) -> PluginResult<()> {
    let marker = |m: u8| data.windows(2).position(|w| w == [0xFF, m]);
    let first_scan = marker(0xDA);
    let last_eoi = data.windows(2).rposition(|w| w == [0xFF, 0xD9]);
    match (first_scan, last_eoi) {
        (Some(scan), Some(eoi)) if eoi > scan => Ok(()),
        _ => Err(PluginError::invalid(
            "the JPEG is truncated: its data ends before the end-of-image marker",
        )),
    }
}

/// transformers' `convert_to_rgb` on the image Pillow would have opened: images with an alpha
/// channel are composited onto opaque white; 16-bit samples follow Pillow's modes (16-bit RGB and
/// grey+alpha keep the high byte; 16-bit grey is mode `I;16`, which `convert("RGB")` clips at 255).
fn to_rgb(image: DynamicImage) -> PluginResult<RgbImage> {
    let (width, height) = (image.width() as usize, image.height() as usize);
    let pixels = width * height;
    let mut data = Vec::with_capacity(pixels * 3);
    match image {
        DynamicImage::ImageRgb8(rgb) => data = rgb.into_raw(),
        DynamicImage::ImageRgba8(rgba) => {
            for p in rgba.as_raw().chunks_exact(4) {
                data.extend_from_slice(&over_white([p[0], p[1], p[2]], p[3]));
            }
        }
        DynamicImage::ImageLuma8(grey) => {
            for &v in grey.as_raw() {
                data.extend_from_slice(&[v, v, v]);
            }
        }
        DynamicImage::ImageLumaA8(grey) => {
            for p in grey.as_raw().chunks_exact(2) {
                data.extend_from_slice(&over_white([p[0]; 3], p[1]));
            }
        }
        DynamicImage::ImageRgb16(rgb) => data.extend(rgb.as_raw().iter().map(|&v| high_byte(v))),
        DynamicImage::ImageRgba16(rgba) => {
            for p in rgba.as_raw().chunks_exact(4) {
                let rgb = [high_byte(p[0]), high_byte(p[1]), high_byte(p[2])];
                data.extend_from_slice(&over_white(rgb, high_byte(p[3])));
            }
        }
        DynamicImage::ImageLuma16(grey) => {
            for &v in grey.as_raw() {
                let v = u8::try_from(v).unwrap_or(u8::MAX);
                data.extend_from_slice(&[v, v, v]);
            }
        }
        DynamicImage::ImageLumaA16(grey) => {
            for p in grey.as_raw().chunks_exact(2) {
                data.extend_from_slice(&over_white([high_byte(p[0]); 3], high_byte(p[1])));
            }
        }
        other => {
            return Err(PluginError::unsupported(format!(
                "images with {:?} samples are not supported",
                other.color()
            )));
        }
    }
    if data.len() != pixels * 3 {
        return Err(PluginError::internal(
            "decoded image has an unexpected size",
        ));
    }
    Ok(RgbImage {
        width,
        height,
        data,
    })
}

fn high_byte(v: u16) -> u8 {
    (v >> 8) as u8
}

/// Pillow's `alpha_composite(white, pixel)` for an opaque white background, in its own integer
/// arithmetic (7 extra bits of precision, rounded division by 255) so results match to the bit.
fn over_white(rgb: [u8; 3], alpha: u8) -> [u8; 3] {
    const PRECISION_BITS: u32 = 7;
    if alpha == 0 {
        return [255; 3];
    }
    let a = u32::from(alpha);
    let blend = 255 * (255 - a);
    let out_a255 = a * 255 + blend;
    let coef1 = a * 255 * 255 * (1 << PRECISION_BITS) / out_a255;
    let coef2 = 255 * (1 << PRECISION_BITS) - coef1;
    let div255 = |v: u32| ((v >> 8) + v) >> 8;
    rgb.map(|c| {
        let tmp = u32::from(c) * coef1 + 255 * coef2 + (0x80 << PRECISION_BITS);
        (div255(tmp) >> PRECISION_BITS) as u8
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compositing_keeps_opaque_pixels_and_whitens_clear_ones() {
        assert_eq!(over_white([10, 128, 250], 255), [10, 128, 250]);
        assert_eq!(over_white([10, 128, 250], 0), [255, 255, 255]);
        let half = over_white([0, 0, 0], 128);
        assert!(half.iter().all(|&v| (126..=128).contains(&v)), "{half:?}");
    }
}
