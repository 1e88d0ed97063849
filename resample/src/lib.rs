//! Pillow's `Image.resize(..., BICUBIC | BILINEAR)` on 8-bit RGB, because that is what HF
//! processors run: a separable convolution (horizontal pass, then vertical) whose support widens with
//! the downscale factor (so downsampling is antialiased), Keys' cubic with a = -0.5 or the triangle
//! filter, weights normalised per output pixel then turned into 22-bit fixed point, and each pass
//! rounded and clamped back to u8.
//!
//! [`Resized`] streams the result row by row: each output row is made from the few source rows
//! under its vertical filter, horizontally resampled once each into a ring of rows. Pillow resamples
//! the whole image horizontally first; row by row gives the same bytes without holding either pass's
//! full-size image (for a photo, megabytes written once and read once).
//!
//! Built twice: into the image plugins, in Wasm with SIMD128, and into the host, which runs it
//! natively for contract 0.5.1's `image.decode-jpeg-resized` with AVX2 where the CPU has it
//! (see `kernels`). Every backend makes the same bytes.

mod fixed;
mod kernels;
mod weights;

use kernels::{Kernels, lanes};
use weights::{AxisWeights, axis_weights};

pub use weights::{Filter, bicubic};

/// Bytes per RGB pixel.
pub(crate) const CHANNELS: usize = 3;

/// Whether this build runs the passes with SIMD kernels: always in Wasm (SIMD128), natively on a
/// CPU with AVX2. Natively without them the plain loops are slower than the Wasm build, so a host
/// should leave resizing to its plugins there.
pub fn simd_kernels() -> bool {
    match Kernels::detect() {
        Kernels::Lanes => cfg!(all(target_arch = "wasm32", target_feature = "simd128")),
        #[cfg(target_arch = "x86_64")]
        Kernels::Avx2(_) => true,
    }
}

/// Packed RGB rows of an image: all of it, or a band of its rows.
#[derive(Debug, Clone, Copy)]
pub struct Rows<'a> {
    /// `width * 3` bytes a row.
    pub rgb: &'a [u8],
    pub width: usize,
    /// The image row `rgb`'s first row is.
    pub first_row: usize,
    /// The whole image's height (the resize's filters are the whole image's).
    pub image_height: usize,
}

impl<'a> Rows<'a> {
    /// All `height` rows of an image.
    pub fn whole(rgb: &'a [u8], width: usize, height: usize) -> Self {
        Rows {
            rgb,
            width,
            first_row: 0,
            image_height: height,
        }
    }
}

/// `src` resized to `width` x `height` (`width * height * 3` bytes), as Pillow's
/// `Image.resize((width, height), filter)`.
pub fn resize(src: Rows<'_>, width: usize, height: usize, filter: Filter) -> Vec<u8> {
    let mut data = Vec::with_capacity(width * height * CHANNELS);
    let mut rows = Resized::new(src, width, height, filter, 0);
    while let Some(row) = rows.next_row() {
        data.extend_from_slice(row);
    }
    data
}

/// The rows of `src` resized to `width` x `height`, one at a time (see the module docs).
pub struct Resized<'a> {
    /// The source rows at hand: all of the image, or a band of it.
    src: Rows<'a>,
    width: usize,
    height: usize,
    horizontal: Option<AxisWeights>,
    vertical: Option<AxisWeights>,
    /// Horizontally resampled source rows (when both passes run): source row `r` lives in slot
    /// `r % ksize` of the vertical weights. A vertical window is at most `ksize` consecutive rows,
    /// so the rows it needs never share a slot.
    ring: Vec<u8>,
    /// Source rows below this have been resampled into the ring (or are never needed again).
    resampled_to: usize,
    /// A source row widened to a lane a channel, so a horizontal tap is one 4-lane multiply-add.
    padded: Vec<lanes::Wide>,
    /// The output row handed out last.
    row: Vec<u8>,
    kernels: Kernels,
    next: usize,
}

/// The source rows output rows `out_rows` of an image `src_height` rows high resized to `height`
/// rows read (all their vertical filters' taps): what a band of the output needs decoded.
pub fn source_rows(
    src_height: usize,
    height: usize,
    filter: Filter,
    out_rows: std::ops::Range<usize>,
) -> std::ops::Range<usize> {
    if height == src_height || out_rows.is_empty() {
        return out_rows;
    }
    let vertical = axis_weights(src_height, height, filter);
    let first = vertical.starts[out_rows.start];
    let end = out_rows
        .map(|y| vertical.starts[y] + vertical.counts[y])
        .max()
        .unwrap_or(first);
    first..end
}

impl<'a> Resized<'a> {
    /// Output rows from `first_out_row` on of the image `src` is rows of, resized to `width` x
    /// `height`: `src` holds at least the rows [`source_rows`] names for the rows asked for. Each
    /// row is the whole resize's, byte for byte (the filters are the whole image's; a row reads
    /// the same source rows).
    pub fn new(
        src: Rows<'a>,
        width: usize,
        height: usize,
        filter: Filter,
        first_out_row: usize,
    ) -> Self {
        Self::with_kernels(
            src,
            (width, height),
            filter,
            first_out_row,
            Kernels::detect(),
        )
    }

    fn with_kernels(
        src: Rows<'a>,
        (width, height): (usize, usize),
        filter: Filter,
        first_out_row: usize,
        kernels: Kernels,
    ) -> Self {
        let src_height = src.image_height;
        let horizontal =
            (width != src.width).then(|| kernels.prepared(axis_weights(src.width, width, filter)));
        let vertical = (height != src_height).then(|| axis_weights(src_height, height, filter));
        let ring_rows = match (&horizontal, &vertical) {
            (Some(_), Some(v)) => v.ksize,
            _ => 0,
        };
        Resized {
            src,
            width,
            height,
            ring: vec![0; ring_rows * width * CHANNELS],
            resampled_to: 0,
            // Zero pixels past the row's end: a tap there has weight zero too, so every output
            // pixel can run the kernel's full size (see `horizontal_row`), rounded up to a
            // whole pair of taps for the AVX2 kernel.
            padded: match &horizontal {
                Some(h) => vec![lanes::WIDE_ZERO; src.width + h.ksize + 1],
                None => Vec::new(),
            },
            row: vec![0; width * CHANNELS],
            next: first_out_row,
            kernels,
            horizontal,
            vertical,
        }
    }

    /// The next output row (`width * 3` bytes), or `None` after the last.
    pub fn next_row(&mut self) -> Option<&[u8]> {
        let y = self.next;
        if y >= self.height {
            return None;
        }
        self.next += 1;
        let Resized {
            src,
            width,
            horizontal,
            vertical,
            ring,
            resampled_to,
            padded,
            row,
            kernels,
            ..
        } = self;
        let stride = src.width * CHANNELS;
        let src_row = |r: usize| {
            let r = r - src.first_row;
            &src.rgb[r * stride..(r + 1) * stride]
        };
        let out_len = *width * CHANNELS;
        let Some(vertical) = vertical else {
            return Some(match horizontal {
                Some(horizontal) => {
                    kernels.horizontal_row(src_row(y), horizontal, padded, row);
                    row
                }
                None => src_row(y),
            });
        };
        let (start, kk) = vertical.taps(y);
        let window = start..start + kk.len();
        let rows: Vec<&[u8]> = match horizontal {
            Some(horizontal) => {
                for r in window.start.max(*resampled_to)..window.end {
                    let slot = r % vertical.ksize;
                    let dst = &mut ring[slot * out_len..(slot + 1) * out_len];
                    kernels.horizontal_row(src_row(r), horizontal, padded, dst);
                }
                *resampled_to = (*resampled_to).max(window.end);
                window
                    .map(|r| &ring[(r % vertical.ksize) * out_len..][..out_len])
                    .collect()
            }
            None => window.map(src_row).collect(),
        };
        kernels.vertical_row(&rows, kk, row);
        Some(row)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixed::{PRECISION_BITS, ROUNDING, clip8};

    /// A test image: `width * height * 3` bytes of a pattern with no runs.
    fn image(width: usize, height: usize) -> Vec<u8> {
        (0..width * height * CHANNELS)
            .map(|i| ((i * 7919 + i / 97) % 251) as u8)
            .collect()
    }

    /// Pillow's order written out plainly: the whole image horizontally, then vertically, each
    /// output byte one scalar sum.
    fn two_pass(
        src: &[u8],
        (src_width, src_height): (usize, usize),
        (width, height): (usize, usize),
        filter: Filter,
    ) -> Vec<u8> {
        let h = axis_weights(src_width, width, filter);
        let mut mid = Vec::new();
        for y in 0..src_height {
            for x in 0..width {
                let (start, kk) = h.taps(x);
                for c in 0..CHANNELS {
                    let acc = kk.iter().enumerate().fold(ROUNDING, |acc, (j, &k)| {
                        acc + i32::from(src[(y * src_width + start + j) * CHANNELS + c]) * k
                    });
                    mid.push(if width == src_width {
                        src[(y * src_width + x) * CHANNELS + c]
                    } else {
                        clip8(acc)
                    });
                }
            }
        }
        if height == src_height {
            return mid;
        }
        let v = axis_weights(src_height, height, filter);
        let row = width * CHANNELS;
        let mut out = Vec::new();
        for y in 0..height {
            let (start, kk) = v.taps(y);
            for i in 0..row {
                let acc = kk.iter().enumerate().fold(ROUNDING, |acc, (j, &k)| {
                    acc + i32::from(mid[(start + j) * row + i]) * k
                });
                out.push(clip8(acc));
            }
        }
        out
    }

    /// Every backend this CPU runs.
    fn every_kernels() -> Vec<Kernels> {
        let mut all = vec![Kernels::Lanes];
        if Kernels::detect() != Kernels::Lanes {
            all.push(Kernels::detect());
        }
        all
    }

    /// Row by row through the ring gives the bytes of the two full passes, with every backend
    /// this CPU runs: up and down, one axis or both, steep downscales whose windows are wide (and
    /// whose kernel sizes are not unrolled), rows narrower than a SIMD block, odd pixel counts.
    #[test]
    fn streamed_rows_are_the_two_passes() {
        for ((w, h), (ow, oh)) in [
            ((40, 30), (56, 28)),
            ((40, 30), (40, 17)),
            ((40, 30), (13, 30)),
            ((97, 61), (23, 9)),
            ((5, 200), (3, 11)),
            ((64, 48), (64, 48)),
            ((3, 3), (17, 29)),
            ((1280, 96), (1288, 95)),
            ((301, 77), (151, 70)),
            ((300, 40), (201, 40)),
        ] {
            let src = image(w, h);
            for filter in [Filter::Bicubic, Filter::Bilinear] {
                let expected = two_pass(&src, (w, h), (ow, oh), filter);
                for kernels in every_kernels() {
                    let mut rows = Resized::with_kernels(
                        Rows::whole(&src, w, h),
                        (ow, oh),
                        filter,
                        0,
                        kernels,
                    );
                    let mut resized = Vec::new();
                    while let Some(row) = rows.next_row() {
                        resized.extend_from_slice(row);
                    }
                    assert!(
                        resized == expected,
                        "{w}x{h} -> {ow}x{oh} {filter:?} {kernels:?}"
                    );
                }
                assert!(resize(Rows::whole(&src, w, h), ow, oh, filter) == expected);
            }
        }
    }

    /// A constant image stays that constant, clamped sums and all.
    #[test]
    fn constant_image_stays_constant() {
        let src = [10u8, 200, 77].repeat(50 * 30);
        let resized = resize(Rows::whole(&src, 50, 30), 17, 61, Filter::Bicubic);
        assert!(resized.chunks_exact(3).all(|p| p == [10, 200, 77]));
    }

    #[test]
    fn weights_sum_to_one_in_fixed_point() {
        for (input, output) in [(100, 37), (37, 100), (1000, 28), (3, 3)] {
            let axis = axis_weights(input, output, Filter::Bicubic);
            for i in 0..output {
                let (_, kk) = axis.taps(i);
                let sum: i64 = kk.iter().map(|&k| i64::from(k)).sum();
                assert!(
                    (sum - (1 << PRECISION_BITS)).abs() <= axis.ksize as i64,
                    "{sum}"
                );
            }
        }
    }
}
