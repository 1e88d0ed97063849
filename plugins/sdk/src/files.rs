//! Lossless files for [`crate::Plugin::reduce`]: what a model server that runs its own processor
//! reads back to the very values this plugin planned with (PNG keeps 8-bit pixels, 32-bit float WAV
//! keeps samples), so its processor makes the plan's tokens from the plan's pixels and samples.

use crate::imageops::RgbImage;
use crate::{Media, PluginError, PluginResult, ReducedItem};

/// `image` as a PNG file. Fast compression: the file crosses a local network once, and encoding
/// time is the gateway's cost per item.
pub fn png(image: &RgbImage) -> PluginResult<Media> {
    let internal = |e: png::EncodingError| PluginError::internal(format!("PNG encoding: {e}"));
    let (width, height) = (
        u32::try_from(image.width).map_err(|_| PluginError::internal("image too wide"))?,
        u32::try_from(image.height).map_err(|_| PluginError::internal("image too tall"))?,
    );
    let mut data = Vec::with_capacity(image.data.len() / 2 + 1024);
    {
        let mut encoder = png::Encoder::new(&mut data, width, height);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        encoder.set_compression(png::Compression::Fast);
        let mut writer = encoder.write_header().map_err(internal)?;
        writer.write_image_data(&image.data).map_err(internal)?;
        writer.finish().map_err(internal)?;
    }
    Ok(Media {
        data,
        mime_type: Some("image/png".into()),
    })
}

/// Mono `samples` at `sample_rate` as a 32-bit float WAV file.
pub fn wav(samples: &[f32], sample_rate: u32) -> PluginResult<Media> {
    let internal = |e: hound::Error| PluginError::internal(format!("WAV encoding: {e}"));
    let spec = hound::WavSpec {
        channels: 1,
        sample_rate,
        bits_per_sample: 32,
        sample_format: hound::SampleFormat::Float,
    };
    let mut cursor = std::io::Cursor::new(Vec::with_capacity(samples.len() * 4 + 64));
    {
        let mut writer = hound::WavWriter::new(&mut cursor, spec).map_err(internal)?;
        for &sample in samples {
            writer.write_sample(sample).map_err(internal)?;
        }
        writer.finalize().map_err(internal)?;
    }
    Ok(Media {
        data: cursor.into_inner(),
        mime_type: Some("audio/wav".into()),
    })
}

impl ReducedItem {
    /// One file that begins at the item's start (an image, an audio clip).
    pub fn single(file: Media) -> Self {
        ReducedItem {
            files: vec![file],
            timestamps: vec![0.0],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn png_keeps_every_pixel() {
        let image = RgbImage {
            width: 3,
            height: 2,
            data: (0..18).map(|v| v * 14).collect(),
        };
        let file = png(&image).unwrap_or_else(|e| panic!("{e:?}"));
        let decoder = png::Decoder::new(std::io::Cursor::new(&file.data));
        let mut reader = decoder.read_info().unwrap_or_else(|e| panic!("{e}"));
        let mut out = vec![0; reader.output_buffer_size().unwrap_or(0)];
        let info = reader
            .next_frame(&mut out)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((info.width, info.height), (3, 2));
        assert_eq!(&out[..info.buffer_size()], &image.data[..]);
    }

    #[test]
    fn wav_keeps_every_sample() {
        let samples = [0.0, 0.25, -1.0, 1e-7];
        let file = wav(&samples, 16_000).unwrap_or_else(|e| panic!("{e:?}"));
        let mut reader = hound::WavReader::new(std::io::Cursor::new(file.data))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(reader.spec().sample_rate, 16_000);
        let back: Vec<f32> = reader
            .samples::<f32>()
            .map(|s| s.unwrap_or(f32::NAN))
            .collect();
        assert_eq!(back, samples);
    }
}
