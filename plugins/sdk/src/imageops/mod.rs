//! Image operations shared by image-like plugins, on packed RGB8 buffers (row-major, 3 bytes a pixel):
//! Pillow's resize ([`resample`]), torchvision's ([`resize_like_torchvision`]), Qwen2-VL's patch
//! layout ([`patches`]), tile grids by aspect ratio ([`tiling`]), cropping and normalisation.

mod kernels;
mod lanes;
pub mod patches;
pub mod tiling;
mod torchvision;

/// Pillow's resize: the `mmgate-resample` crate, which the host also runs natively
/// ([`crate::imagedecode::decode_rgb_resized`]).
pub use mmgate_resample as resample;
pub use mmgate_resample::{Filter, Resized, Rows, source_rows};
pub use patches::{
    qwen2vl_frame_patches, qwen2vl_patch_bytes, qwen2vl_resized_patch_bytes,
    qwen2vl_resized_patch_bytes_of_rows, qwen2vl_resized_patch_bytes_reusing,
};
pub use torchvision::{resize_like_torch_uint8, resize_like_torchvision};

/// Bytes per RGB pixel.
const CHANNELS: usize = 3;

/// A packed RGB8 image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage {
    pub width: usize,
    pub height: usize,
    /// `width * height * 3` bytes.
    pub data: Vec<u8>,
}

impl RgbImage {
    /// Resize like Pillow's `Image.resize((width, height), filter)` on an RGB image (which, like
    /// this, returns a copy when the size does not change).
    pub fn resize(&self, width: usize, height: usize, filter: Filter) -> RgbImage {
        RgbImage {
            width,
            height,
            data: mmgate_resample::resize(self.rows(), width, height, filter),
        }
    }

    /// All of the image's rows, as the resampler reads them.
    pub fn rows(&self) -> Rows<'_> {
        Rows::whole(&self.data, self.width, self.height)
    }

    /// [`RgbImage::resize`] that hands the image back as it is, without a copy, when the size does
    /// not change.
    pub fn into_resized(self, width: usize, height: usize, filter: Filter) -> RgbImage {
        if (width, height) == (self.width, self.height) {
            self
        } else {
            self.resize(width, height, filter)
        }
    }

    /// The `width` x `height` window whose top-left corner is (`left`, `top`); parts outside the
    /// image are black, as Pillow's `crop` does.
    pub fn crop(&self, left: isize, top: isize, width: usize, height: usize) -> RgbImage {
        let mut data = vec![0u8; width * height * CHANNELS];
        for y in 0..height {
            let sy = top + y as isize;
            if sy < 0 || sy as usize >= self.height {
                continue;
            }
            for x in 0..width {
                let sx = left + x as isize;
                if sx < 0 || sx as usize >= self.width {
                    continue;
                }
                let s = (sy as usize * self.width + sx as usize) * CHANNELS;
                let d = (y * width + x) * CHANNELS;
                data[d..d + CHANNELS].copy_from_slice(&self.data[s..s + CHANNELS]);
            }
        }
        RgbImage {
            width,
            height,
            data,
        }
    }
}

/// OpenAI CLIP's normalisation (HF's OPENAI_CLIP_MEAN / OPENAI_CLIP_STD), Qwen2-VL's too.
pub const CLIP_MEAN: [f32; 3] = [0.481_454_66, 0.457_827_5, 0.408_210_73];
// Written exactly as HF's OPENAI_CLIP_STD so the two can be compared by eye.
#[allow(clippy::excessive_precision)]
pub const CLIP_STD: [f32; 3] = [0.268_629_54, 0.261_302_58, 0.275_777_11];

/// Per-channel `(x * rescale - mean) / std`, done as HF does it: rescale in f64 then cast to f32,
/// normalise in f32.
#[derive(Debug, Clone, Copy)]
pub struct Normalize {
    pub rescale: f64,
    pub mean: [f32; 3],
    pub std: [f32; 3],
}

impl Normalize {
    /// A lookup table per channel: 256 entries, so normalising is one load per byte.
    pub fn table(&self) -> [[f32; 256]; 3] {
        let mut table = [[0f32; 256]; 3];
        for (c, channel) in table.iter_mut().enumerate() {
            for (v, out) in channel.iter_mut().enumerate() {
                let rescaled = (v as f64 * self.rescale) as f32;
                *out = (rescaled - self.mean[c]) / self.std[c];
            }
        }
        table
    }

    /// [`Normalize::table`] as little-endian bytes, for writing f32 tensors without a second copy.
    pub fn table_le_bytes(&self) -> [[[u8; 4]; 256]; 3] {
        self.table().map(|channel| channel.map(f32::to_le_bytes))
    }

    /// `image` normalised as planar (C, H, W) f32 little-endian bytes, as HF's `pixel_values`
    /// lay out one image: one pass per channel keeps the writes sequential.
    pub fn planar_le_bytes(&self, image: &RgbImage) -> Vec<u8> {
        let table = self.table_le_bytes();
        let mut values = Vec::with_capacity(3 * image.width * image.height);
        for (c, channel) in table.iter().enumerate() {
            values.extend(
                image
                    .data
                    .chunks_exact(3)
                    .map(|px| channel[usize::from(px[c])]),
            );
        }
        values.into_flattened()
    }
}
