//! Qwen2-VL's patch layout, as raw bytes: HF reshapes a temporal group of frames to
//! (t, tp, C, gh/m, m, p, gw/m, m, p) and transposes it (0,3,6,4,7,2,1,5,8), i.e. the patches are
//! ordered by merge block (row-major), then within the block, and each patch row holds its channels,
//! then its frames, then the patch's pixels.
//!
//! Patches are written in that order, one whole patch row at a time, each gathered straight from
//! the packed RGB rows (a patch's run of pixels split into its channels at once): in the wasm build
//! by SIMD shuffles stored directly into the output, elsewhere through a small scratch row. The image is
//! read once and the output written once, front to back, and never zero-filled first (a zeroed
//! buffer costs a full extra pass in wasm, whose allocator clears even fresh memory). (Splitting
//! each band into channel planes first, then gathering runs from the planes, cost more.)

use std::mem::MaybeUninit;

use super::{CHANNELS, RgbImage, kernels};
use mmgate_resample::{Filter, Resized, Rows};

/// Qwen2-VL's patch layout of one image repeated over `temporal` frames (HF: `np.tile` of a single
/// image to `temporal_patch_size` frames). See [`qwen2vl_frame_patches`].
pub fn qwen2vl_patch_bytes(
    image: &RgbImage,
    patch: usize,
    merge: usize,
    temporal: usize,
) -> Vec<u8> {
    let mut out = Vec::new();
    qwen2vl_frame_patches(&vec![image; temporal], patch, merge, &mut out);
    out
}

/// [`qwen2vl_patch_bytes`] of `image` resized (as [`RgbImage::resize`]) to `width` x `height`,
/// streamed: each band of resized rows is laid out as soon as it is complete, so the resized image
/// is never held whole.
pub fn qwen2vl_resized_patch_bytes(
    image: &RgbImage,
    (width, height): (usize, usize),
    filter: Filter,
    (patch, merge, temporal): (usize, usize, usize),
) -> Vec<u8> {
    qwen2vl_resized_patch_bytes_of_rows(
        image,
        (0, image.height),
        (width, height),
        filter,
        (patch, merge, temporal),
        0..height,
    )
}

/// [`qwen2vl_resized_patch_bytes`] of output rows `out_rows` only (whole bands of `merge * patch`
/// rows), from `rows`: the source image's rows from `src_first_row` on, of its `src_height`
/// (at least the rows [`source_rows`](super::resample::source_rows) names for `out_rows`). The
/// result is that range of the whole's bytes: a large image can be made in bands of rows, each
/// from only the rows it reads.
pub fn qwen2vl_resized_patch_bytes_of_rows(
    rows: &RgbImage,
    (src_first_row, src_height): (usize, usize),
    (width, height): (usize, usize),
    filter: Filter,
    (patch, merge, temporal): (usize, usize, usize),
    out_rows: std::ops::Range<usize>,
) -> Vec<u8> {
    if (width, height) == (rows.width, src_height) && out_rows.len() == rows.height {
        return qwen2vl_patch_bytes(rows, patch, merge, temporal);
    }
    let mut writer = PatchWriter::new(width, patch, merge, temporal);
    let mut out = Vec::with_capacity(writer.bytes_for(out_rows.len()));
    let band_len = writer.band_rows() * width * CHANNELS;
    let mut band = Vec::with_capacity(band_len);
    let source = Rows {
        rgb: &rows.data,
        width: rows.width,
        first_row: src_first_row,
        image_height: src_height,
    };
    let mut rows = Resized::new(source, width, height, filter, out_rows.start);
    for _ in 0..out_rows.len() / writer.band_rows() {
        band.clear();
        for _ in 0..writer.band_rows() {
            if let Some(row) = rows.next_row() {
                band.extend_from_slice(row);
            }
        }
        writer.append_band(&vec![band.as_slice(); temporal], &mut out);
    }
    out
}

/// [`qwen2vl_resized_patch_bytes_of_rows`] of one temporal slot, from rows the caller is done
/// with. Where no resize is needed the patches are laid out in the rows' own buffer, a band at a
/// time: a band's patches are exactly as many bytes as its rows, so each band's rows are copied
/// aside (a few hundred KB, which the layout then reads from cache) and its patches written over
/// them. No second buffer of the image's size is touched: in a sandbox, whose touched memory is
/// zeroed for the next call, that is 36 MB less to clear for a 12 MP photo. Otherwise (a resize)
/// as [`qwen2vl_resized_patch_bytes_of_rows`].
pub fn qwen2vl_resized_patch_bytes_reusing(
    rows: RgbImage,
    (src_first_row, src_height): (usize, usize),
    (width, height): (usize, usize),
    filter: Filter,
    (patch, merge): (usize, usize),
    out_rows: std::ops::Range<usize>,
) -> Vec<u8> {
    let unresized = (width, height) == (rows.width, src_height) && out_rows.len() == rows.height;
    let block = patch * merge;
    let whole_blocks = width.is_multiple_of(block) && rows.height.is_multiple_of(block);
    if !(unresized && whole_blocks) {
        return qwen2vl_resized_patch_bytes_of_rows(
            &rows,
            (src_first_row, src_height),
            (width, height),
            filter,
            (patch, merge, 1),
            out_rows,
        );
    }
    let mut writer = PatchWriter::new(width, patch, merge, 1);
    let band_len = writer.band_rows() * width * CHANNELS;
    let bands = rows.height / writer.band_rows();
    let mut data = rows.data;
    let mut band = Vec::with_capacity(band_len);
    for rows in data.chunks_exact_mut(band_len) {
        band.clear();
        band.extend_from_slice(rows);
        // SAFETY: `u8` and `MaybeUninit<u8>` have the same layout, and only initialised bytes
        // are written through the view.
        let view = unsafe { &mut *(rows as *mut [u8] as *mut [MaybeUninit<u8>]) };
        // Whole merge blocks across: a band's patches are exactly its rows' bytes.
        writer.write_band(&[band.as_slice()], view);
    }
    data.truncate(bands * band_len);
    data
}

/// Qwen2-VL's patch layout of one temporal group of frames (a video's `temporal_patch_size`
/// consecutive frames, all the same size), appended to `out` as rows of
/// `3 * frames.len() * patch * patch` raw bytes.
///
/// Frames must have dimensions divisible by `patch * merge`. A frame may repeat (the same
/// reference twice, as an image's temporal copies are). Give `out` the
/// capacity of all the groups it will take, so it is allocated once.
pub fn qwen2vl_frame_patches(frames: &[&RgbImage], patch: usize, merge: usize, out: &mut Vec<u8>) {
    let Some(first) = frames.first() else {
        return;
    };
    let mut writer = PatchWriter::new(first.width, patch, merge, frames.len());
    out.reserve(writer.bytes_for(first.height));
    let band_len = writer.band_rows() * first.width * CHANNELS;
    for band in 0..first.height / writer.band_rows() {
        let bands: Vec<&[u8]> = frames
            .iter()
            .map(|f| &f.data[band * band_len..(band + 1) * band_len])
            .collect();
        writer.append_band(&bands, out);
    }
}

/// Lays out bands of `merge * patch` image rows (one band per temporal slot) as patch rows.
struct PatchWriter {
    width: usize,
    patch: usize,
    merge: usize,
    temporal: usize,
    /// One patch row being gathered, plus room for a wide store past its end.
    scratch: Vec<u8>,
}

impl PatchWriter {
    fn new(width: usize, patch: usize, merge: usize, temporal: usize) -> Self {
        let row_len = CHANNELS * temporal * patch * patch;
        PatchWriter {
            width,
            patch,
            merge,
            temporal,
            scratch: vec![0; row_len + kernels::BLOCK],
        }
    }

    fn band_rows(&self) -> usize {
        self.merge * self.patch
    }

    fn row_len(&self) -> usize {
        CHANNELS * self.temporal * self.patch * self.patch
    }

    /// Bytes of the patches of a `height`-row image.
    fn bytes_for(&self, height: usize) -> usize {
        let grid = (height / self.band_rows() * self.merge) * (self.width / self.patch);
        grid * self.row_len()
    }

    /// Appends the patch rows of one band (see [`Self::write_band`]).
    fn append_band(&mut self, bands: &[&[u8]], out: &mut Vec<u8>) {
        let len = self.bytes_for(self.band_rows());
        out.reserve(len);
        let written = self.write_band(bands, &mut out.spare_capacity_mut()[..len]);
        // SAFETY: `write_band` wrote the first `written` bytes after the old length.
        unsafe { out.set_len(out.len() + written) };
    }

    /// Writes the patch rows of one band to the start of `out` (a band's worth: [`Self::bytes_for`]
    /// its rows) and returns how many bytes it wrote, all of them from the start; `bands[t]` is temporal slot t's rows (the same slice
    /// again for a repeated frame). Each patch row is gathered straight from the packed RGB rows,
    /// by [`kernels::write_patch_row`] where it applies (the wasm build, patches of 8 to 16
    /// pixels), else here: a run of up to 16 pixels split into its channels at once and each
    /// channel's run moved to its place in the scratch row with one wide store where the spill
    /// past it lands on bytes written later (the rest of its channel slot), else exactly.
    fn write_band(&mut self, bands: &[&[u8]], out: &mut [MaybeUninit<u8>]) -> usize {
        let (width, patch, merge) = (self.width, self.patch, self.merge);
        let stride = width * CHANNELS;
        let area = patch * patch;
        let slots = bands.len();
        let row_len = self.row_len();
        let mut frames: Vec<&[u8]> = Vec::with_capacity(slots);
        let mut rows_out = out.chunks_exact_mut(row_len);
        let mut written = 0;
        for block in 0..width / (patch * merge) {
            for in_row in 0..merge {
                for in_col in 0..merge {
                    let x = (block * merge + in_col) * patch;
                    let top_left = (in_row * patch) * stride + x * CHANNELS;
                    frames.clear();
                    frames.extend(bands.iter().map(|band| &band[top_left..]));
                    let Some(dst) = rows_out.next() else {
                        return written;
                    };
                    written += row_len;
                    if kernels::write_patch_row(&frames, stride, patch, dst) {
                        continue;
                    }
                    for (t, band) in bands.iter().enumerate() {
                        if t > 0 && std::ptr::eq(*band, bands[t - 1]) {
                            for c in 0..CHANNELS {
                                let from = (c * slots + t - 1) * area;
                                self.scratch.copy_within(from..from + area, from + area);
                            }
                            continue;
                        }
                        for y in 0..patch {
                            let row = (in_row * patch + y) * stride + x * CHANNELS;
                            for x0 in (0..patch).step_by(kernels::BLOCK) {
                                let len = (patch - x0).min(kernels::BLOCK);
                                let channels = split_run(&band[row + x0 * CHANNELS..], len);
                                let in_slot = y * patch + x0;
                                for (c, run) in channels.iter().enumerate() {
                                    let at = (c * slots + t) * area + in_slot;
                                    kernels::copy_run(
                                        run,
                                        len,
                                        &mut self.scratch[at..],
                                        in_slot + kernels::BLOCK <= area,
                                    );
                                }
                            }
                        }
                    }
                    for (dst, &byte) in dst.iter_mut().zip(&self.scratch[..row_len]) {
                        dst.write(byte);
                    }
                }
            }
        }
        written
    }
}

/// The first `len` (at most 16) packed RGB pixels of `px` split into their channels; whole 16-pixel
/// loads where `px` holds them (the pixels past `len` are read and ignored).
#[inline]
fn split_run(px: &[u8], len: usize) -> [[u8; kernels::BLOCK]; CHANNELS] {
    if px.len() >= kernels::BLOCK * CHANNELS {
        return kernels::split_rgb16(px);
    }
    let mut channels = [[0u8; kernels::BLOCK]; CHANNELS];
    for (x, px) in px.chunks_exact(CHANNELS).take(len).enumerate() {
        for (channel, &value) in channels.iter_mut().zip(px) {
            channel[x] = value;
        }
    }
    channels
}

#[cfg(test)]
mod tests {
    use super::*;
    use mmgate_resample::source_rows;

    /// The layout against HF's reshape/transpose written out index by index, on frames wide
    /// enough for the SIMD path and with a remainder, a repeated frame and two distinct ones.
    #[test]
    fn patch_layout_is_hf_transpose() {
        let merge = 2;
        let frame = |seed: u8, width: usize, height: usize| RgbImage {
            width,
            height,
            data: (0..width * height * CHANNELS)
                .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
                .collect(),
        };
        for (patch, width, height) in [(2, 4, 4), (2, 20, 8), (2, 36, 12), (14, 56, 28), (4, 72, 8)]
        {
            let (a, b) = (frame(0, width, height), frame(7, width, height));
            for frames in [vec![&a, &a], vec![&a, &b], vec![&b]] {
                let mut out = vec![9u8];
                qwen2vl_frame_patches(&frames, patch, merge, &mut out);
                let (gh, gw, tp) = (height / patch, width / patch, frames.len());
                let mut expected = vec![9u8];
                for bh in 0..gh / merge {
                    for bw in 0..gw / merge {
                        for mh in 0..merge {
                            for mw in 0..merge {
                                for c in 0..CHANNELS {
                                    for frame in &frames {
                                        for y in 0..patch {
                                            for x in 0..patch {
                                                let py = (bh * merge + mh) * patch + y;
                                                let px = (bw * merge + mw) * patch + x;
                                                expected.push(
                                                    frame.data[(py * width + px) * CHANNELS + c],
                                                );
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
                assert_eq!(out.len(), 1 + gh * gw * CHANNELS * tp * patch * patch);
                assert_eq!(
                    out, expected,
                    "{width}x{height}, patch {patch}, {tp} frames"
                );
            }
            let mut twice = Vec::new();
            qwen2vl_frame_patches(&[&a, &a], patch, merge, &mut twice);
            assert_eq!(qwen2vl_patch_bytes(&a, patch, merge, 2), twice);
        }
    }

    /// A band of output rows made from only the source rows it reads is that band of the whole:
    /// enlarged, shrunk, one axis or neither, bands at the top, in the middle and at the bottom.
    #[test]
    fn bands_of_rows_made_from_their_source_rows_are_the_wholes_bytes() {
        let src = RgbImage {
            width: 70,
            height: 45,
            data: (0..70 * 45 * CHANNELS)
                .map(|i| ((i * 31) % 253) as u8)
                .collect(),
        };
        let (patch, merge, temporal) = (7, 2, 2);
        let band = patch * merge;
        for (width, height) in [(56, 28), (112, 84), (70, 56), (28, 28), (70, 42), (42, 42)] {
            for filter in [Filter::Bicubic, Filter::Bilinear] {
                let whole = qwen2vl_resized_patch_bytes(
                    &src,
                    (width, height),
                    filter,
                    (patch, merge, temporal),
                );
                let per_row = whole.len() / height;
                for first in (0..height).step_by(band) {
                    for end in ((first + band)..=height).step_by(band) {
                        let needed = source_rows(src.height, height, filter, first..end);
                        let rows = rows_of(&src, needed.clone());
                        let made = qwen2vl_resized_patch_bytes_of_rows(
                            &rows,
                            (needed.start, src.height),
                            (width, height),
                            filter,
                            (patch, merge, temporal),
                            first..end,
                        );
                        assert!(
                            made == whole[first * per_row..end * per_row],
                            "{width}x{height} {filter:?}: rows {first}..{end} from {needed:?}"
                        );
                    }
                }
            }
        }
    }

    /// Rows `rows` of `src`, as an image of their own.
    fn rows_of(src: &RgbImage, rows: std::ops::Range<usize>) -> RgbImage {
        let row = src.width * CHANNELS;
        RgbImage {
            width: src.width,
            height: rows.len(),
            data: src.data[rows.start * row..rows.end * row].to_vec(),
        }
    }

    /// Laid out in the rows' own buffer, the patches are those of the borrowing layout: at the
    /// image's own size (in place) and resized, whole and a band of rows.
    #[test]
    fn patches_laid_out_in_the_rows_buffer_are_the_same() {
        let src = RgbImage {
            width: 56,
            height: 42,
            data: (0..56 * 42 * CHANNELS)
                .map(|i| ((i * 37) % 251) as u8)
                .collect(),
        };
        let (patch, merge) = (7, 2);
        for (width, height) in [(56, 42), (28, 28), (70, 56)] {
            for out_rows in [0..height, 14..28] {
                let needed = source_rows(src.height, height, Filter::Bicubic, out_rows.clone());
                let rows = rows_of(&src, needed.clone());
                let borrowed = qwen2vl_resized_patch_bytes_of_rows(
                    &rows,
                    (needed.start, src.height),
                    (width, height),
                    Filter::Bicubic,
                    (patch, merge, 1),
                    out_rows.clone(),
                );
                let reused = qwen2vl_resized_patch_bytes_reusing(
                    rows,
                    (needed.start, src.height),
                    (width, height),
                    Filter::Bicubic,
                    (patch, merge),
                    out_rows.clone(),
                );
                assert!(reused == borrowed, "{width}x{height}, rows {out_rows:?}");
            }
        }
    }

    /// Streaming the resize into the layout is the layout of the resized image.
    #[test]
    fn streamed_patches_are_patches_of_the_resized_image() {
        let src = RgbImage {
            width: 70,
            height: 45,
            data: (0..70 * 45 * CHANNELS)
                .map(|i| ((i * 31) % 253) as u8)
                .collect(),
        };
        for (width, height) in [(56, 28), (112, 84), (70, 56), (28, 28)] {
            let resized = src.resize(width, height, Filter::Bicubic);
            assert_eq!(
                qwen2vl_resized_patch_bytes(&src, (width, height), Filter::Bicubic, (7, 2, 2)),
                qwen2vl_patch_bytes(&resized, 7, 2, 2),
                "{width}x{height}"
            );
        }
    }
}
