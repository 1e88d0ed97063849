//! The few calls of TurboJPEG's C API (libjpeg-turbo 3) the decoder needs, behind a safe handle.
//! TurboJPEG rather than the libjpeg API: it catches libjpeg's fatal errors itself (libjpeg's
//! default is `exit()`, its alternative a `longjmp` that Rust cannot take), and it reports warnings
//! apart from errors, which this decoder needs to treat them as Pillow does.
#![allow(unsafe_code)]

use std::ffi::{CStr, c_int};

use turbojpeg_sys as tj;

use crate::{Colorspace, Header, ImageError, Limits};

/// The beginnings of libjpeg-turbo's warning messages (`JWRN_*` in its `jerror.h`): after any of
/// these the decoder carries on to the end of the image.
const WARNINGS: [&str; 7] = [
    "Corrupt JPEG data",
    "Premature end of JPEG file",
    "Warning: unknown JFIF revision number",
    "Unknown Adobe color transform code",
    "Inconsistent progression sequence",
    "Invalid SOS parameters for sequential JPEG",
    "Application transferred too many scanlines",
];

/// The beginnings of the messages of a limit being hit: the scan limit and the pixel limit
/// (TurboJPEG's own), libjpeg's largest dimension, and the memory limit (libjpeg asks for a backing
/// store, which this build has none of, or fails to allocate).
const LIMITS: [&str; 5] = [
    "Progressive JPEG image has more than",
    "Image is too large",
    "Maximum supported image dimension",
    "Backing store not supported",
    "Insufficient memory",
];

fn is_warning(message: &str) -> bool {
    WARNINGS.iter().any(|w| message.starts_with(w))
}

/// One TurboJPEG decompressor, destroyed when dropped.
pub(crate) struct Decoder {
    handle: tj::tjhandle,
}

impl Drop for Decoder {
    fn drop(&mut self) {
        // SAFETY: `handle` came from `tj3Init`, is not null and is destroyed only here.
        unsafe { tj::tj3Destroy(self.handle) }
    }
}

fn param(value: impl TryInto<c_int>, name: &str) -> Result<c_int, ImageError> {
    value
        .try_into()
        .map_err(|_| ImageError::Internal(format!("the decoder's {name} is out of range")))
}

impl Decoder {
    pub(crate) fn new(limits: &Limits) -> Result<Decoder, ImageError> {
        // SAFETY: no preconditions; a null handle means failure and is not kept.
        let handle = unsafe { tj::tj3Init(tj::TJINIT_TJINIT_DECOMPRESS as c_int) };
        if handle.is_null() {
            return Err(ImageError::Internal("cannot create a JPEG decoder".into()));
        }
        let mut decoder = Decoder { handle };
        decoder.set(
            tj::TJPARAM_TJPARAM_SCANLIMIT,
            param(limits.max_scans, "scan limit")?,
        )?;
        decoder.set(
            tj::TJPARAM_TJPARAM_MAXMEMORY,
            param(limits.max_decoder_memory_mb, "memory limit")?,
        )?;
        // The decoder's own check of the pixel count (the header is checked again by the caller):
        // 0 would mean no limit, so an over-large limit is clamped rather than wrapped.
        let max_pixels = c_int::try_from(limits.max_pixels)
            .unwrap_or(c_int::MAX)
            .max(1);
        decoder.set(tj::TJPARAM_TJPARAM_MAXPIXELS, max_pixels)?;
        Ok(decoder)
    }

    fn set(&mut self, parameter: tj::TJPARAM, value: c_int) -> Result<(), ImageError> {
        // SAFETY: a live handle; TurboJPEG validates the parameter and value.
        if unsafe { tj::tj3Set(self.handle, parameter as c_int, value) } != 0 {
            return Err(ImageError::Internal(format!(
                "cannot set the JPEG decoder's parameter {parameter}: {}",
                self.message()
            )));
        }
        Ok(())
    }

    fn get(&mut self, parameter: tj::TJPARAM) -> c_int {
        // SAFETY: a live handle; an unknown parameter answers -1.
        unsafe { tj::tj3Get(self.handle, parameter as c_int) }
    }

    fn message(&mut self) -> String {
        // SAFETY: a live handle; TurboJPEG returns a NUL-terminated string it owns, valid until the
        // handle's next call, copied here before that.
        let text = unsafe { tj::tj3GetErrorStr(self.handle) };
        if text.is_null() {
            return "unknown error".into();
        }
        // SAFETY: not null, NUL-terminated (above).
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    }

    /// Whether the last failure was only a warning: the image was decoded whole (libjpeg's
    /// "corrupt data" notes, which Pillow ignores too). TurboJPEG's own code says "warning" for any
    /// failure once a warning was seen, even an error that stopped the decode after it; the message
    /// tells them apart, since an error overwrites it and later warnings do not.
    fn only_warned(&mut self) -> bool {
        // SAFETY: a live handle.
        let code = unsafe { tj::tj3GetErrorCode(self.handle) };
        code == tj::TJERR_TJERR_WARNING as c_int && is_warning(&self.message())
    }

    fn failure(&mut self) -> ImageError {
        let message = self.message();
        let limit = LIMITS.iter().any(|m| message.starts_with(m));
        let text = format!("cannot decode the jpeg image: {message}");
        if limit {
            ImageError::LimitExceeded(text)
        } else {
            ImageError::InvalidMedia(text)
        }
    }

    pub(crate) fn header(&mut self, data: &[u8]) -> Result<Header, ImageError> {
        // SAFETY: a live handle; `data` is valid for `data.len()` bytes for the whole call.
        let status =
            unsafe { tj::tj3DecompressHeader(self.handle, data.as_ptr(), data.len() as _) };
        if status != 0 && !self.only_warned() {
            return Err(self.failure());
        }
        let dimension = |v: c_int| u32::try_from(v).unwrap_or(0);
        let colorspace = match self.get(tj::TJPARAM_TJPARAM_COLORSPACE) as u32 {
            tj::TJCS_TJCS_YCbCr => Colorspace::YCbCr,
            tj::TJCS_TJCS_RGB => Colorspace::Rgb,
            tj::TJCS_TJCS_GRAY => Colorspace::Gray,
            tj::TJCS_TJCS_CMYK => Colorspace::Cmyk,
            tj::TJCS_TJCS_YCCK => Colorspace::Ycck,
            other => {
                return Err(ImageError::Unsupported(format!(
                    "JPEG colour space {other} is not supported"
                )));
            }
        };
        Ok(Header {
            width: dimension(self.get(tj::TJPARAM_TJPARAM_JPEGWIDTH)),
            height: dimension(self.get(tj::TJPARAM_TJPARAM_JPEGHEIGHT)),
            colorspace,
            precision: dimension(self.get(tj::TJPARAM_TJPARAM_PRECISION)),
            lossless: self.get(tj::TJPARAM_TJPARAM_LOSSLESS) == 1,
        })
    }

    /// Decodes rows `rows` (within the header's height, not empty) of the image whose header this
    /// handle read last (from the same `data`) into a new buffer of `width * rows * 3` bytes.
    /// (Zeroed, so that no byte is ever exposed unwritten if a decode stops half-way; see
    /// [`zeroed`].) Rows other than all use TurboJPEG's cropping
    /// region, which skips the rows above with `jpeg_skip_scanlines` (their
    /// entropy decoding only; with the context rows fancy upsampling needs, so the band's pixels
    /// are the whole image's) and stops after the last row.
    pub(crate) fn decode_rgb_rows(
        &mut self,
        data: &[u8],
        header: &Header,
        rows: std::ops::Range<u32>,
    ) -> Result<Vec<u8>, ImageError> {
        let height = rows.end.saturating_sub(rows.start);
        if rows.start != 0 || height != header.height {
            let region = tj::tjregion {
                x: 0,
                y: param(rows.start, "first row")?,
                w: 0,
                h: param(height, "row count")?,
            };
            // SAFETY: a live handle; TurboJPEG checks the region against the header it read last.
            if unsafe { tj::tj3SetCroppingRegion(self.handle, region) } != 0 {
                return Err(ImageError::Internal(format!(
                    "cannot set the rows to decode: {}",
                    self.message()
                )));
            }
        }
        let pitch = param(u64::from(header.width) * 3, "row pitch")?;
        let len = usize::try_from(u64::from(header.width) * u64::from(height) * 3)
            .map_err(|_| ImageError::Internal("the image does not fit in memory".into()))?;
        let mut rgb = zeroed(len)?;
        // SAFETY: a live handle; `data` is valid for reading `data.len()` bytes; `rgb` holds
        // `len` = `pitch * height` bytes, which is what TurboJPEG writes for the width in
        // `data`'s header (the one `header` was read from, at scaling factor 1) and the rows of
        // its cropping region (all of them when none was set).
        let status = unsafe {
            tj::tj3Decompress8(
                self.handle,
                data.as_ptr(),
                data.len() as _,
                rgb.as_mut_ptr(),
                pitch,
                tj::TJPF_TJPF_RGB as c_int,
            )
        };
        if status != 0 && !self.only_warned() {
            return Err(self.failure());
        }
        Ok(rgb)
    }
}

/// A buffer of `len` zero bytes, or a limit error where it cannot be had. Allocated zeroed rather
/// than filled: a large buffer comes from the system in pages already zeroed, which the allocator
/// knows and then writes nothing (filling a 12 MP image's 36 MB cost a pass of its own).
fn zeroed(len: usize) -> Result<Vec<u8>, ImageError> {
    let cannot = || ImageError::LimitExceeded(format!("cannot allocate {len} bytes for the image"));
    if len == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(len).map_err(|_| cannot())?;
    // SAFETY: `layout` has a non-zero size.
    let data = unsafe { std::alloc::alloc_zeroed(layout) };
    if data.is_null() {
        return Err(cannot());
    }
    // SAFETY: `data` was allocated by the global allocator with `layout` (u8's alignment, `len`
    // bytes), all of them initialised (zero); the Vec takes ownership with capacity `len`.
    Ok(unsafe { Vec::from_raw_parts(data, len, len) })
}
