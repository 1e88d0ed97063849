//! Image operations shared by image-like plugins, on packed RGB8 buffers (row-major, 3 bytes a pixel).
//!
//! The resampler reproduces Pillow's `Image.resize(..., BICUBIC | BILINEAR)` on 8-bit images, because
//! that is what HF processors run: a separable convolution (horizontal pass, then vertical) whose
//! support widens with the downscale factor (so downsampling is antialiased), Keys' cubic with
//! a = -0.5 or the triangle filter, weights normalised per output pixel then turned into 22-bit fixed
//! point, and each pass rounded and clamped back to u8.

/// Bytes per RGB pixel.
const CHANNELS: usize = 3;
/// Pillow's fixed-point precision for 8-bit resampling (32 - 8 - 2).
const PRECISION_BITS: u32 = 22;

/// A resampling filter, as Pillow defines it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filter {
    /// `Image.BILINEAR` (2): the triangle filter, support 1.
    Bilinear,
    /// `Image.BICUBIC` (3): Keys' cubic with a = -0.5, support 2.
    Bicubic,
}

impl Filter {
    /// The filter for a PIL resample code (as HF configs store it), if it is one this crate has.
    pub fn from_pil_code(code: u32) -> Option<Filter> {
        match code {
            2 => Some(Filter::Bilinear),
            3 => Some(Filter::Bicubic),
            _ => None,
        }
    }

    /// Support radius at scale 1.
    fn support(self) -> f64 {
        match self {
            Filter::Bilinear => 1.0,
            Filter::Bicubic => 2.0,
        }
    }

    fn weight(self, x: f64) -> f64 {
        match self {
            Filter::Bilinear => {
                let x = x.abs();
                if x < 1.0 { 1.0 - x } else { 0.0 }
            }
            Filter::Bicubic => bicubic(x),
        }
    }
}

/// A packed RGB8 image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage {
    pub width: usize,
    pub height: usize,
    /// `width * height * 3` bytes.
    pub data: Vec<u8>,
}

fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// For each output index along one axis: the first input index, how many taps it has, and the
/// fixed-point weights.
struct AxisWeights {
    starts: Vec<usize>,
    counts: Vec<usize>,
    /// `ksize` weights per output index (zero-padded past its count).
    weights: Vec<i32>,
    ksize: usize,
}

impl AxisWeights {
    /// The first input index and the weights of output index `i`.
    #[inline]
    fn taps(&self, i: usize) -> (usize, &[i32]) {
        let row = i * self.ksize;
        (self.starts[i], &self.weights[row..row + self.counts[i]])
    }
}

fn axis_weights(in_size: usize, out_size: usize, filter: Filter) -> AxisWeights {
    let scale = in_size as f64 / out_size as f64;
    let filter_scale = scale.max(1.0);
    let support = filter.support() * filter_scale;
    // Pillow multiplies by the reciprocal; dividing instead can differ in the last bit.
    let inverse_scale = 1.0 / filter_scale;
    let ksize = support.ceil() as usize * 2 + 1;
    let mut starts = Vec::with_capacity(out_size);
    let mut counts = Vec::with_capacity(out_size);
    let mut weights = vec![0i32; out_size * ksize];
    let mut row = vec![0f64; ksize];
    for (xx, kk) in weights.chunks_exact_mut(ksize).enumerate() {
        let center = (xx as f64 + 0.5) * scale;
        // Pillow truncates towards zero here; both values are >= -0.5 + 0.5 so `as` matches.
        let xmin = ((center - support + 0.5).max(0.0)) as usize;
        let xmax = (((center + support + 0.5) as usize).min(in_size))
            .saturating_sub(xmin)
            .min(ksize);
        let mut total = 0.0;
        for (x, w) in row.iter_mut().enumerate().take(xmax) {
            *w = filter.weight((x as f64 + xmin as f64 - center + 0.5) * inverse_scale);
            total += *w;
        }
        for (x, k) in kk.iter_mut().enumerate().take(xmax) {
            let w = if total != 0.0 { row[x] / total } else { 0.0 };
            let fixed = w * f64::from(1u32 << PRECISION_BITS);
            *k = if fixed < 0.0 {
                (fixed - 0.5) as i32
            } else {
                (fixed + 0.5) as i32
            };
        }
        starts.push(xmin);
        counts.push(xmax);
    }
    AxisWeights {
        starts,
        counts,
        weights,
        ksize,
    }
}

// Accumulators are i32 as in Pillow: with weights normalised to 2^22, |sum| < 2^31 for u8 input.
#[inline]
fn clip8(acc: i32) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}

const ROUNDING: i32 = 1 << (PRECISION_BITS - 1);

fn resample_horizontal(src: &RgbImage, out_width: usize, filter: Filter) -> RgbImage {
    let axis = axis_weights(src.width, out_width, filter);
    let mut data = vec![0u8; out_width * src.height * CHANNELS];
    let in_row = src.width * CHANNELS;
    // Each source row is padded to 4 bytes a pixel first, so a tap is one 4-lane multiply-add.
    let mut padded = vec![[0u8; 4]; src.width];
    for (y, out_row) in data.chunks_exact_mut(out_width * CHANNELS).enumerate() {
        let row = &src.data[y * in_row..(y + 1) * in_row];
        for (p, s) in padded.iter_mut().zip(row.chunks_exact(CHANNELS)) {
            p[..CHANNELS].copy_from_slice(s);
        }
        for (xx, out) in out_row.chunks_exact_mut(CHANNELS).enumerate() {
            let (start, kk) = axis.taps(xx);
            let pixel = kernels::horizontal(&padded[start..], kk);
            out.copy_from_slice(&pixel[..CHANNELS]);
        }
    }
    RgbImage {
        width: out_width,
        height: src.height,
        data,
    }
}

fn resample_vertical(src: &RgbImage, out_height: usize, filter: Filter) -> RgbImage {
    let axis = axis_weights(src.height, out_height, filter);
    let row_len = src.width * CHANNELS;
    let mut data = vec![0u8; row_len * out_height];
    for (yy, out_row) in data.chunks_exact_mut(row_len).enumerate() {
        let (start, kk) = axis.taps(yy);
        let rows = &src.data[start * row_len..(start + kk.len()) * row_len];
        // Column blocks with their sums in registers: each tap row is read once per block and no
        // accumulator row goes through memory.
        let mut blocks = out_row.chunks_exact_mut(kernels::BLOCK);
        for (block, out) in (&mut blocks).enumerate() {
            kernels::vertical(rows, row_len, block * kernels::BLOCK, kk, out);
        }
        let x = row_len - blocks.into_remainder().len();
        for (i, o) in out_row[x..].iter_mut().enumerate() {
            let mut acc = ROUNDING;
            for (&k, row) in kk.iter().zip(rows.chunks_exact(row_len)) {
                acc += i32::from(row[x + i]) * k;
            }
            *o = clip8(acc);
        }
    }
    RgbImage {
        width: src.width,
        height: out_height,
        data,
    }
}

/// The inner loops of the two resize passes (Pillow's i32 sums of u8 × fixed-point weight products,
/// rounded and clamped) and of the patch layout (splitting RGB rows into channels, moving runs).
/// Built for wasm with SIMD, each sum runs four (horizontal: R, G, B and a pad byte) or sixteen
/// (vertical: adjacent bytes of a row) lanes at a time; elsewhere they are plain loops. The compiler
/// does not vectorise these by itself for wasm (it leaves them scalar), so the SIMD is written out.
/// Both compute exactly the same results.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
mod kernels {
    use super::{PRECISION_BITS, ROUNDING};
    use core::arch::wasm32::*;

    /// Output bytes one call of [`vertical`] produces.
    pub const BLOCK: usize = 16;

    /// Lanes 0..4 of `v`, clamped to u8 after the fixed-point shift (the saturating narrows are
    /// Pillow's clip to 0..=255).
    #[inline]
    fn narrow(a: v128, b: v128, c: v128, d: v128) -> v128 {
        let shift = |v| i32x4_shr(v, PRECISION_BITS);
        u8x16_narrow_i16x8(
            i16x8_narrow_i32x4(shift(a), shift(b)),
            i16x8_narrow_i32x4(shift(c), shift(d)),
        )
    }

    /// One output pixel: Σ_j kk[j] · pixels[j], per channel.
    #[inline]
    pub fn horizontal(pixels: &[[u8; 4]], kk: &[i32]) -> [u8; 4] {
        let mut acc = i32x4_splat(ROUNDING);
        for (&k, px) in kk.iter().zip(pixels) {
            let bytes = u32x4_splat(u32::from_le_bytes(*px));
            let wide = u32x4_extend_low_u16x8(u16x8_extend_low_u8x16(bytes));
            acc = i32x4_add(acc, i32x4_mul(wide, i32x4_splat(k)));
        }
        let packed = narrow(acc, acc, acc, acc);
        u32x4_extract_lane::<0>(packed).to_le_bytes()
    }

    #[inline]
    fn load16(bytes: &[u8]) -> v128 {
        let half = |i: usize| {
            let mut word = [0u8; 8];
            word.copy_from_slice(&bytes[i..i + 8]);
            u64::from_le_bytes(word)
        };
        u64x2(half(0), half(8))
    }

    /// `out` (16 bytes) = Σ_j kk[j] · rows[j][x..x + 16], rows being `row_len` apart.
    #[inline]
    pub fn vertical(rows: &[u8], row_len: usize, x: usize, kk: &[i32], out: &mut [u8]) {
        let mut acc = [i32x4_splat(ROUNDING); 4];
        for (&k, row) in kk.iter().zip(rows.chunks_exact(row_len)) {
            let bytes = load16(&row[x..x + BLOCK]);
            let (low, high) = (
                u16x8_extend_low_u8x16(bytes),
                u16x8_extend_high_u8x16(bytes),
            );
            let k = i32x4_splat(k);
            let lanes = [
                u32x4_extend_low_u16x8(low),
                u32x4_extend_high_u16x8(low),
                u32x4_extend_low_u16x8(high),
                u32x4_extend_high_u16x8(high),
            ];
            for (a, v) in acc.iter_mut().zip(lanes) {
                *a = i32x4_add(*a, i32x4_mul(v, k));
            }
        }
        store16(narrow(acc[0], acc[1], acc[2], acc[3]), out);
    }

    /// Splits packed RGB `row` into its three channel rows, 16 pixels (three loads, six shuffles)
    /// at a time.
    pub fn deinterleave_rgb(row: &[u8], planar: &mut [Vec<u8>; 3]) {
        let [r, g, b] = planar;
        let pixels = row.len() / 3;
        let whole = pixels - pixels % BLOCK;
        for x in (0..whole).step_by(BLOCK) {
            let at = 3 * x;
            let (p0, p1, p2) = (
                load16(&row[at..]),
                load16(&row[at + 16..]),
                load16(&row[at + 32..]),
            );
            let red = i8x16_shuffle::<0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 17, 20, 23, 26, 29>(
                i8x16_shuffle::<0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 0, 0, 0, 0, 0>(p0, p1),
                p2,
            );
            let green = i8x16_shuffle::<0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 18, 21, 24, 27, 30>(
                i8x16_shuffle::<1, 4, 7, 10, 13, 16, 19, 22, 25, 28, 31, 0, 0, 0, 0, 0>(p0, p1),
                p2,
            );
            let blue = i8x16_shuffle::<0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 19, 22, 25, 28, 31>(
                i8x16_shuffle::<2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 0, 0, 0, 0, 0, 0>(p0, p1),
                p2,
            );
            store16(red, &mut r[x..x + BLOCK]);
            store16(green, &mut g[x..x + BLOCK]);
            store16(blue, &mut b[x..x + BLOCK]);
        }
        for (x, px) in row.chunks_exact(3).enumerate().skip(whole) {
            (r[x], g[x], b[x]) = (px[0], px[1], px[2]);
        }
    }

    /// `dst[..len] = run[..len]`, with one 16-byte move when that may spill past `len` (wasm's
    /// `memory.copy` is a call out of the sandbox: too dear for runs of 14 bytes), else with two
    /// overlapping 8-byte ones for 8 <= len <= 16.
    #[inline]
    pub fn copy_run(run: &[u8], len: usize, dst: &mut [u8], may_spill: bool) {
        if len <= BLOCK && run.len() >= BLOCK && dst.len() >= BLOCK && may_spill {
            store16(load16(run), dst);
        } else if (8..=BLOCK).contains(&len) {
            let tail = len - 8;
            let (head, end) = (load8(&run[..8]), load8(&run[tail..len]));
            dst[..8].copy_from_slice(&head);
            dst[tail..len].copy_from_slice(&end);
        } else {
            dst[..len].copy_from_slice(&run[..len]);
        }
    }

    #[inline]
    fn load8(bytes: &[u8]) -> [u8; 8] {
        let mut word = [0u8; 8];
        word.copy_from_slice(&bytes[..8]);
        word
    }

    #[inline]
    fn store16(v: v128, out: &mut [u8]) {
        out[..8].copy_from_slice(&u64x2_extract_lane::<0>(v).to_le_bytes());
        out[8..16].copy_from_slice(&u64x2_extract_lane::<1>(v).to_le_bytes());
    }
}

#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
mod kernels {
    use super::{ROUNDING, clip8};

    pub const BLOCK: usize = 16;

    #[inline]
    pub fn horizontal(pixels: &[[u8; 4]], kk: &[i32]) -> [u8; 4] {
        let mut acc = [ROUNDING; 4];
        for (&k, px) in kk.iter().zip(pixels) {
            for (a, &p) in acc.iter_mut().zip(px) {
                *a += i32::from(p) * k;
            }
        }
        acc.map(clip8)
    }

    #[inline]
    pub fn vertical(rows: &[u8], row_len: usize, x: usize, kk: &[i32], out: &mut [u8]) {
        let mut acc = [ROUNDING; BLOCK];
        for (&k, row) in kk.iter().zip(rows.chunks_exact(row_len)) {
            for (a, &p) in acc.iter_mut().zip(&row[x..x + BLOCK]) {
                *a += i32::from(p) * k;
            }
        }
        for (o, a) in out.iter_mut().zip(acc) {
            *o = clip8(a);
        }
    }

    #[inline]
    pub fn copy_run(run: &[u8], len: usize, dst: &mut [u8], _may_spill: bool) {
        dst[..len].copy_from_slice(&run[..len]);
    }

    pub fn deinterleave_rgb(row: &[u8], planar: &mut [Vec<u8>; 3]) {
        let [r, g, b] = planar;
        for (((px, r), g), b) in row.chunks_exact(3).zip(r).zip(g).zip(b) {
            (*r, *g, *b) = (px[0], px[1], px[2]);
        }
    }
}

impl RgbImage {
    /// Resize like Pillow's `Image.resize((width, height), filter)` on an RGB image (which, like
    /// this, returns a copy when the size does not change).
    pub fn resize(&self, width: usize, height: usize, filter: Filter) -> RgbImage {
        let mut image = if width != self.width {
            resample_horizontal(self, width, filter)
        } else {
            self.clone()
        };
        if height != self.height {
            image = resample_vertical(&image, height, filter);
        }
        image
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
}

/// Qwen2-VL's patch layout of one image repeated over `temporal` frames (HF: `np.tile` of a single
/// image to `temporal_patch_size` frames), as raw bytes. See [`qwen2vl_frame_patches`].
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

/// Qwen2-VL's patch layout of one temporal group of frames (a video's `temporal_patch_size`
/// consecutive frames, all the same size), appended to `out` as rows of
/// `3 * frames.len() * patch * patch` raw bytes: reshape (t, tp, C, gh/m, m, p, gw/m, m, p) →
/// transpose (0,3,6,4,7,2,1,5,8), i.e. per patch: channel, then frame, then the patch's pixels.
///
/// Frames must have dimensions divisible by `patch * merge`. A frame repeated (the same reference
/// twice, as an image's temporal copies are) is read once and written twice. Give `out` the
/// capacity of all the groups it will take (an empty one is allocated zeroed, which is cheapest).
pub fn qwen2vl_frame_patches(frames: &[&RgbImage], patch: usize, merge: usize, out: &mut Vec<u8>) {
    let Some(first_frame) = frames.first() else {
        return;
    };
    let (width, height) = (first_frame.width, first_frame.height);
    let (gh, gw) = (height / patch, width / patch);
    let plane = patch * patch;
    let row_len = CHANNELS * frames.len() * plane;
    let base = out.len();
    let added = gh * gw * row_len;
    if out.capacity() == 0 {
        // `vec!` of zeros asks the allocator for zeroed memory, which fresh pages already are.
        *out = vec![0; added];
    } else {
        out.resize(base + added, 0);
    }
    let patches = &mut out[base..];
    // Image row by image row: the row is split into its three channel rows once (sequential reads,
    // SIMD in the wasm build), then each patch's `patch`-long runs go where the layout puts them.
    // A patch row's output (`gw` patches) stays in cache while its `patch` image rows are written.
    let mut planar = [vec![0u8; width], vec![0u8; width], vec![0u8; width]];
    for (t, frame) in frames.iter().enumerate() {
        if t > 0 && std::ptr::eq(*frame, frames[t - 1]) {
            continue;
        }
        // This frame fills its own slot and those of the copies of it that follow.
        let copies = frames[t + 1..]
            .iter()
            .take_while(|f| std::ptr::eq(**f, *frame))
            .count();
        let slots = t..=t + copies;
        for y in 0..gh * patch {
            let (grid_y, y_in_patch) = (y / patch, y % patch);
            let may_spill = y_in_patch + 1 < patch;
            let row = &frame.data[y * width * CHANNELS..(y + 1) * width * CHANNELS];
            kernels::deinterleave_rgb(row, &mut planar);
            // Patches are ordered by merge block (row-major), then within the block.
            let block_row = (grid_y / merge) * (gw / merge) * merge * merge;
            let row_in_block = (grid_y % merge) * merge;
            for grid_x in 0..gw {
                let index =
                    block_row + (grid_x / merge) * merge * merge + row_in_block + grid_x % merge;
                let dst = &mut patches[index * row_len..(index + 1) * row_len];
                for (c, channel) in planar.iter().enumerate() {
                    let run = &channel[grid_x * patch..];
                    for slot in slots.clone() {
                        let at = (c * frames.len() + slot) * plane + y_in_patch * patch;
                        // Spilling past the run is fine while the next image row will
                        // overwrite it: each run is moved in one wide store.
                        kernels::copy_run(run, patch, &mut dst[at..], may_spill);
                    }
                }
            }
        }
    }
}

/// Resize as torchvision's `F.resize(uint8 tensor, size, BICUBIC, antialias=True)` does (what
/// qwen-vl-utils runs on video frames): PyTorch's separable antialiased bicubic (Keys a = -0.5, support
/// widened by the downscale factor, weights normalised per output pixel) computed in f32 with no
/// rounding between the passes (width first, then height; an unchanged axis is skipped), then clamped
/// and rounded half to even back to u8. Unlike Pillow's 8-bit path there is no fixed point.
pub fn resize_like_torchvision(image: &RgbImage, width: usize, height: usize) -> RgbImage {
    if (image.width, image.height) == (width, height) {
        return image.clone();
    }
    let mut plane: Vec<f32> = image.data.iter().map(|&v| f32::from(v)).collect();
    let (mut w, h) = (image.width, image.height);
    if w != width {
        let axis = float_axis_weights(w, width);
        let mut next = vec![0f32; width * h * CHANNELS];
        for y in 0..h {
            let src = &plane[y * w * CHANNELS..(y + 1) * w * CHANNELS];
            let dst = &mut next[y * width * CHANNELS..(y + 1) * width * CHANNELS];
            for (x, out) in dst.chunks_exact_mut(CHANNELS).enumerate() {
                let (start, weights) = axis.taps(x);
                let mut acc = [0f32; CHANNELS];
                for (k, &wk) in weights.iter().enumerate() {
                    let p = &src[(start + k) * CHANNELS..(start + k + 1) * CHANNELS];
                    for c in 0..CHANNELS {
                        acc[c] += p[c] * wk;
                    }
                }
                out.copy_from_slice(&acc);
            }
        }
        plane = next;
        w = width;
    }
    if h != height {
        let axis = float_axis_weights(h, height);
        let row = w * CHANNELS;
        let mut next = vec![0f32; row * height];
        for (y, dst) in next.chunks_exact_mut(row).enumerate() {
            let (start, weights) = axis.taps(y);
            for (k, &wk) in weights.iter().enumerate() {
                let src = &plane[(start + k) * row..(start + k + 1) * row];
                for (d, &s) in dst.iter_mut().zip(src) {
                    *d += s * wk;
                }
            }
        }
        plane = next;
    }
    RgbImage {
        width,
        height,
        data: plane
            .iter()
            .map(|&v| v.clamp(0.0, 255.0).round_ties_even() as u8)
            .collect(),
    }
}

/// PyTorch's `_compute_indices_weights_aa` for bicubic: per output index, the first input index and
/// the normalised f32 weights.
struct FloatAxisWeights {
    starts: Vec<usize>,
    lens: Vec<usize>,
    ksize: usize,
    weights: Vec<f32>,
}

impl FloatAxisWeights {
    fn taps(&self, i: usize) -> (usize, &[f32]) {
        let row = &self.weights[i * self.ksize..i * self.ksize + self.lens[i]];
        (self.starts[i], row)
    }
}

fn float_axis_weights(in_size: usize, out_size: usize) -> FloatAxisWeights {
    // PyTorch computes these in the tensor's scalar type (f32 here).
    let scale = in_size as f32 / out_size as f32;
    let support = if scale >= 1.0 { 2.0 * scale } else { 2.0 };
    let inverse = if scale >= 1.0 { 1.0 / scale } else { 1.0 };
    let ksize = support.ceil() as usize * 2 + 1;
    let mut starts = Vec::with_capacity(out_size);
    let mut lens = Vec::with_capacity(out_size);
    let mut weights = vec![0f32; out_size * ksize];
    for (i, row) in weights.chunks_exact_mut(ksize).enumerate() {
        let center = scale * (i as f32 + 0.5);
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
        let len = xmax.saturating_sub(xmin).min(ksize);
        let mut total = 0f32;
        for (j, w) in row.iter_mut().enumerate().take(len) {
            *w = bicubic(f64::from((j as f32 + xmin as f32 - center + 0.5) * inverse)) as f32;
            total += *w;
        }
        if total != 0.0 {
            for w in row.iter_mut().take(len) {
                *w /= total;
            }
        }
        starts.push(xmin);
        lens.push(len);
    }
    FloatAxisWeights {
        starts,
        lens,
        ksize,
        weights,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn constant_image_stays_constant() {
        let image = RgbImage {
            width: 50,
            height: 30,
            data: [10u8, 200, 77].repeat(50 * 30),
        };
        let resized = image.resize(17, 61, Filter::Bicubic);
        assert!(resized.data.chunks_exact(3).all(|p| p == [10, 200, 77]));
    }
}
