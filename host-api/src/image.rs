//! The `image` host capability (since contract 0.3.1): JPEG decoding with libjpeg-turbo through
//! `mmgate-image-decode` (and, since 0.5.1, Pillow's resize of the decoded image), within the
//! plugin's limits narrowed by the host's, and not begun once the call's deadline has passed.
//!
//! The capability works on an `ImageView`: its own share of a call and the call's clock, which the
//! call's state lends it when the linker calls in (see [`crate::sandbox`]).

use std::time::Instant;

use mmgate_image_decode::{ImageError as DecodeError, Limits};
use wasmtime::component::HasData;

use crate::call_clock::CallClock;
use crate::contract::mmgate::modality::image::{
    Host, ImageError, ImageLimits, ResampleFilter, Resize, RgbImage,
};

/// What one plugin call holds of this capability: the host's decoder limits.
pub(crate) struct CallImages {
    limits: Limits,
}

impl CallImages {
    pub(crate) fn new(limits: &Limits) -> Self {
        Self {
            limits: limits.clone(),
        }
    }
}

/// What this capability works on in one call, as the call's state lends it: its own share and the
/// call's clock, which decoding is charged to as host work.
pub(crate) struct ImageView<'a> {
    pub(crate) images: &'a CallImages,
    pub(crate) clock: &'a mut CallClock,
}

/// What the linker hands the `image` interfaces of a call: an [`ImageView`] of its state.
pub(crate) struct HasImage;

impl HasData for HasImage {
    type Data<'a> = ImageView<'a>;
}

fn contract_error(error: DecodeError) -> ImageError {
    match error {
        DecodeError::InvalidMedia(m) => ImageError::InvalidMedia(m),
        DecodeError::Unsupported(m) => ImageError::Unsupported(m),
        DecodeError::LimitExceeded(m) => ImageError::LimitExceeded(m),
        DecodeError::Internal(m) => ImageError::Internal(m),
    }
}

impl ImageView<'_> {
    /// The limits of one decode: the plugin's, narrowed by the host's; what the plugin does not
    /// set (bytes, decoder memory) is the host's alone. A decode cannot be interrupted half-way
    /// (its cost is bounded by the limits), so one asked for after the call's wall-clock
    /// deadline is not started, and the call fails for that.
    fn decode_limits(&mut self, limits: ImageLimits) -> Result<Limits, ImageError> {
        if Instant::now() >= self.clock.wall_deadline() {
            self.clock.host_ran_out();
            return Err(ImageError::LimitExceeded(
                "the call's deadline passed before the image was decoded".into(),
            ));
        }
        let host = &self.images.limits;
        let asked = Limits {
            max_width: limits.max_width,
            max_height: limits.max_height,
            max_pixels: limits.max_pixels,
            max_scans: limits.max_scans,
            ..host.clone()
        };
        Ok(host.narrowed(&asked))
    }
}

fn contract_image(image: mmgate_image_decode::RgbImage) -> RgbImage {
    RgbImage {
        width: image.width,
        height: image.height,
        rgb: image.rgb,
    }
}

impl Host for ImageView<'_> {
    fn decode_jpeg(&mut self, data: Vec<u8>, limits: ImageLimits) -> Result<RgbImage, ImageError> {
        let limits = self.decode_limits(limits)?;
        self.clock
            .host_work(|| mmgate_image_decode::decode_jpeg(&data, &limits))
            .map(contract_image)
            .map_err(contract_error)
    }

    fn decode_jpeg_rows(
        &mut self,
        data: Vec<u8>,
        limits: ImageLimits,
        first_row: u32,
        rows: u32,
    ) -> Result<RgbImage, ImageError> {
        let limits = self.decode_limits(limits)?;
        let rows = first_row..first_row.saturating_add(rows);
        self.clock
            .host_work(|| mmgate_image_decode::decode_jpeg_rows(&data, &limits, rows))
            .map(contract_image)
            .map_err(contract_error)
    }

    fn decode_jpeg_resized(
        &mut self,
        data: Vec<u8>,
        limits: ImageLimits,
        to: Resize,
    ) -> Result<RgbImage, ImageError> {
        let limits = self.decode_limits(limits)?;
        let resize = mmgate_image_decode::Resize {
            width: to.width,
            height: to.height,
            filter: match to.filter {
                ResampleFilter::Bilinear => mmgate_image_decode::Filter::Bilinear,
                ResampleFilter::Bicubic => mmgate_image_decode::Filter::Bicubic,
            },
            rows: to.first_row..to.first_row.saturating_add(to.rows),
        };
        self.clock
            .host_work(|| mmgate_image_decode::decode_jpeg_resized(&data, &limits, &resize))
            .map(contract_image)
            .map_err(contract_error)
    }
}

/// The `image` interface of a superseded contract (`$version`: the module of its frozen bindings):
/// the current one's functions, their records copied across; `rows` adds `decode-jpeg-rows`
/// (0.4.1).
macro_rules! previous_image_interface {
    ($module:ident, $version:ident $(, $rows:ident)?) => {
        mod $module {
            use super::*;
            use crate::contract::$version::mmgate::modality::image as old;

            fn limits(limits: old::ImageLimits) -> ImageLimits {
                ImageLimits {
                    max_width: limits.max_width,
                    max_height: limits.max_height,
                    max_pixels: limits.max_pixels,
                    max_scans: limits.max_scans,
                }
            }

            fn answer(answer: Result<RgbImage, ImageError>) -> Result<old::RgbImage, old::ImageError> {
                match answer {
                    Ok(image) => Ok(old::RgbImage {
                        width: image.width,
                        height: image.height,
                        rgb: image.rgb,
                    }),
                    Err(ImageError::InvalidMedia(m)) => Err(old::ImageError::InvalidMedia(m)),
                    Err(ImageError::Unsupported(m)) => Err(old::ImageError::Unsupported(m)),
                    Err(ImageError::LimitExceeded(m)) => Err(old::ImageError::LimitExceeded(m)),
                    Err(ImageError::Internal(m)) => Err(old::ImageError::Internal(m)),
                }
            }

            impl old::Host for ImageView<'_> {
                fn decode_jpeg(
                    &mut self,
                    data: Vec<u8>,
                    given: old::ImageLimits,
                ) -> Result<old::RgbImage, old::ImageError> {
                    answer(Host::decode_jpeg(self, data, limits(given)))
                }

                $(
                fn $rows(
                    &mut self,
                    data: Vec<u8>,
                    given: old::ImageLimits,
                    first_row: u32,
                    rows: u32,
                ) -> Result<old::RgbImage, old::ImageError> {
                    answer(Host::decode_jpeg_rows(self, data, limits(given), first_row, rows))
                }
                )?
            }
        }
    };
}

previous_image_interface!(v0_4_image, v0_4, decode_jpeg_rows);
previous_image_interface!(v0_3_image, v0_3);
