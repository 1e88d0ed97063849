//! The built-in image plugin.
//!
//! Processors (chosen by `image_processor_type` in the model's `preprocessor_config.json`):
//! - Qwen2-VL / Qwen2.5-VL: `smart_resize` within min/max pixels, bicubic, CLIP mean/std, 14-px
//!   patches, temporal patch 2, 2x2 merge → `pixel_values` [t·h·w, 1176] f32 and `image_grid_thw`.
//! - Fixed-size CLIP / SigLIP: resize (shortest edge or exact size), optional centre crop, normalise →
//!   `pixel_values` [1, 3, H, W] f32.

mod processor;

use std::io::Cursor;

use image::{ImageFormat, ImageReader, Limits};
use mmgate_plugin_sdk::imageops::RgbImage;
use mmgate_plugin_sdk::*;

use processor::{Choices, Processor};

/// Pillow's default `Image.MAX_IMAGE_PIXELS`: larger images are treated as decompression bombs.
const MAX_IMAGE_PIXELS: u64 = 89_478_485;
/// Cap on what the decoder may allocate beyond the pixel buffer.
const MAX_DECODE_ALLOC: u64 = 512 << 20;

struct ImagePlugin;

const MIME_TYPES: &[&str] = &[
    "image/png",
    "image/jpeg",
    "image/webp",
    "image/gif",
    "image/bmp",
    "image/tiff",
];

fn reader(data: &[u8]) -> PluginResult<ImageReader<Cursor<&[u8]>>> {
    if data.is_empty() {
        return Err(PluginError::invalid("the image is empty (0 bytes)"));
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
            "image format {other:?} is not supported (PNG, JPEG, WebP, GIF, BMP, TIFF are)"
        ))),
        None => Err(PluginError::invalid(
            "not an image: the bytes match no known image format",
        )),
    }
}

fn format_name(format: Option<ImageFormat>) -> String {
    format
        .map(|f| {
            f.extensions_str()
                .first()
                .copied()
                .unwrap_or("image")
                .to_owned()
        })
        .unwrap_or_else(|| "unknown".to_owned())
}

fn check_pixels(width: u32, height: u32) -> PluginResult<()> {
    let pixels = u64::from(width) * u64::from(height);
    if width == 0 || height == 0 {
        return Err(PluginError::invalid(format!(
            "the image is {width}x{height}: it has no pixels"
        )));
    }
    if pixels > MAX_IMAGE_PIXELS {
        return Err(PluginError::limit(format!(
            "the image is {width}x{height} = {pixels} pixels, more than the limit of \
             {MAX_IMAGE_PIXELS} (a possible decompression bomb)"
        )));
    }
    Ok(())
}

fn decode_rgb(data: &[u8]) -> PluginResult<RgbImage> {
    // The header is read twice (a cheap second parse) because the reader is consumed by either step.
    let (width, height) = reader(data)?
        .into_dimensions()
        .map_err(|e| PluginError::invalid(format!("cannot read the image header: {e}")))?;
    check_pixels(width, height)?;
    let mut reader = reader(data)?;
    let mut limits = Limits::default();
    limits.max_image_width = Some(width);
    limits.max_image_height = Some(height);
    limits.max_alloc = Some(MAX_DECODE_ALLOC);
    reader.limits(limits);
    let decoded = reader
        .decode()
        .map_err(|e| PluginError::invalid(format!("cannot decode the image: {e}")))?;
    // Pillow's convert("RGB"): alpha is dropped, grey is replicated, palettes are expanded.
    let rgb = decoded.into_rgb8();
    Ok(RgbImage {
        width: rgb.width() as usize,
        height: rgb.height() as usize,
        data: rgb.into_raw(),
    })
}

impl Plugin for ImagePlugin {
    fn describe() -> Descriptor {
        Descriptor {
            name: "image".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            description:
                "decode images; Qwen2-VL smart resize + patchify, or fixed-size CLIP/SigLIP".into(),
            modalities: vec!["image".into()],
            mime_types: MIME_TYPES.iter().map(|m| (*m).to_owned()).collect(),
            processor_types: processor::SUPPORTED
                .iter()
                .map(|p| (*p).to_owned())
                .collect(),
        }
    }

    fn probe(media: Media) -> PluginResult<MediaInfo> {
        let reader = reader(&media.data)?;
        let format = format_name(reader.format());
        let (width, height) = reader
            .into_dimensions()
            .map_err(|e| PluginError::invalid(format!("cannot read the image header: {e}")))?;
        check_pixels(width, height)?;
        let mut info = MediaInfo::new("image", format);
        info.width = Some(width);
        info.height = Some(height);
        Ok(info)
    }

    fn plan(info: MediaInfo, budget: Budget, config: ProcessorConfig) -> PluginResult<TokenPlan> {
        let processor = Processor::from_config(&config)?;
        let (Some(width), Some(height)) = (info.width, info.height) else {
            return Err(PluginError::invalid("the probe found no image dimensions"));
        };
        processor.plan(width as usize, height as usize, budget.max_tokens)
    }

    fn preprocess(
        media: Media,
        plan: TokenPlan,
        config: ProcessorConfig,
    ) -> PluginResult<Vec<Tensor>> {
        let processor = Processor::from_config(&config)?;
        let choices: Choices = plan.choices()?;
        let image = decode_rgb(&media.data)?;
        processor.preprocess(&image, &choices)
    }
}

mmgate_plugin_sdk::export_plugin!(ImagePlugin);
