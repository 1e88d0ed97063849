//! Which frames, at what size: qwen-vl-utils' rules (`smart_nframes`, its `smart_resize` variant,
//! `torch.linspace(...).round()`), transformers' `Qwen3VLVideoProcessor` rules (`sample_frames`,
//! `np.linspace(...).round()`, its video `smart_resize` over all the frames), and the budget cuts on
//! top of them (frames first, then resolution).

use serde::{Deserialize, Serialize};

/// qwen-vl-utils' FRAME_FACTOR: frames come in pairs (Qwen2-VL's temporal patch).
pub const FRAME_FACTOR: usize = 2;

/// How frames are chosen.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    /// `fps` frames a second (qwen-vl-utils' default, 2), between `min_frames` and `max_frames`.
    Fps,
    /// A fixed number of frames spread evenly (qwen-vl-utils' `nframes`).
    Uniform,
    /// The keyframes the encoder placed (at scene cuts and regular intervals), spread evenly when there
    /// are more than the budget allows.
    Keyframes,
}

/// Python's `round`: halves to the even neighbour.
fn round_half_even(x: f64) -> f64 {
    x.round_ties_even()
}

pub fn round_by_factor(n: f64, factor: usize) -> usize {
    (round_half_even(n / factor as f64) * factor as f64) as usize
}

pub fn ceil_by_factor(n: f64, factor: usize) -> usize {
    ((n / factor as f64).ceil() * factor as f64) as usize
}

pub fn floor_by_factor(n: f64, factor: usize) -> usize {
    ((n / factor as f64).floor() * factor as f64).max(0.0) as usize
}

/// qwen-vl-utils' `smart_nframes` for the fps rule: `total / video_fps * fps` frames, clamped to
/// [`min_frames`, min(`max_frames`, total)], floored to an even count.
pub fn fps_frame_count(
    total: usize,
    video_fps: f64,
    fps: f64,
    min_frames: usize,
    max_frames: usize,
) -> usize {
    let min_frames = ceil_by_factor(min_frames as f64, FRAME_FACTOR);
    let max_frames = floor_by_factor(max_frames.min(total) as f64, FRAME_FACTOR);
    let n = total as f64 / video_fps * fps;
    let n = n
        .max(min_frames as f64)
        .min(max_frames as f64)
        .min(total as f64);
    floor_by_factor(n, FRAME_FACTOR)
}

/// `torch.linspace(start, end, n).round().long()`: float32 arithmetic as PyTorch's CPU kernel does it
/// (the first half counts up from `start`, the second half down from `end`), rounded half to even.
pub fn linspace_indices(start: u64, end: u64, n: usize) -> Vec<u64> {
    match n {
        0 => Vec::new(),
        1 => vec![start],
        _ => {
            let (s, e) = (start as f32, end as f32);
            let step = (e - s) / (n - 1) as f32;
            let halfway = n / 2;
            (0..n)
                .map(|i| {
                    let v = if i < halfway {
                        s + step * i as f32
                    } else {
                        e - step * (n - i - 1) as f32
                    };
                    v.round_ties_even().max(0.0) as u64
                })
                .collect()
        }
    }
}

/// qwen-vl-utils' `smart_resize` (its own variant of Qwen2-VL's: sides at least `factor`, no floor
/// at `factor` when shrinking, and a fractional `max_pixels`, which videos get). Returns (h, w).
pub fn smart_resize(
    height: usize,
    width: usize,
    factor: usize,
    min_pixels: f64,
    max_pixels: f64,
) -> Result<(usize, usize), String> {
    let (h, w) = (height as f64, width as f64);
    let ratio = h.max(w) / h.min(w).max(1.0);
    if ratio > 200.0 {
        return Err(format!(
            "absolute aspect ratio must be smaller than 200, got {ratio}"
        ));
    }
    let mut h_bar = factor.max(round_by_factor(h, factor));
    let mut w_bar = factor.max(round_by_factor(w, factor));
    if (h_bar * w_bar) as f64 > max_pixels {
        let beta = (h * w / max_pixels).sqrt();
        h_bar = floor_by_factor(h / beta, factor);
        w_bar = floor_by_factor(w / beta, factor);
    } else if ((h_bar * w_bar) as f64) < min_pixels {
        let beta = (min_pixels / (h * w)).sqrt();
        h_bar = ceil_by_factor(h * beta, factor);
        w_bar = ceil_by_factor(w * beta, factor);
    }
    if h_bar == 0 || w_bar == 0 {
        return Err(format!(
            "a {width}x{height} frame cannot be sized for this model"
        ));
    }
    Ok((h_bar, w_bar))
}

/// transformers' `Qwen3VLVideoProcessor.sample_frames` for the fps rule: `int(total / video_fps ×
/// fps)` frames, clamped to [`min_frames`, min(`max_frames`, total)]; no rounding to pairs (the
/// processor pads the last temporal patch with the last frame).
pub fn qwen3_frame_count(
    total: usize,
    video_fps: f64,
    fps: f64,
    min_frames: usize,
    max_frames: usize,
) -> usize {
    let n = (total as f64 / video_fps * fps).max(0.0) as usize;
    n.max(min_frames).min(max_frames).min(total)
}

/// `np.linspace(start, end, n).round().astype(int)`: float64, `i · step + start` with the last
/// exactly `end`, rounded half to even.
pub fn numpy_linspace_indices(start: u64, end: u64, n: usize) -> Vec<u64> {
    match n {
        0 => Vec::new(),
        1 => vec![start],
        _ => {
            let (s, e) = (start as f64, end as f64);
            let step = (e - s) / (n - 1) as f64;
            (0..n)
                .map(|i| {
                    let v = if i == n - 1 { e } else { i as f64 * step + s };
                    v.round_ties_even().max(0.0) as u64
                })
                .collect()
        }
    }
}

/// transformers' Qwen3-VL video `smart_resize`: sides a multiple of `factor`, the pixels of all
/// `frames` (rounded to whole temporal patches) between `min_pixels` and `max_pixels`; frames
/// narrower than `factor` are first scaled up. Returns (h, w).
pub fn qwen3_smart_resize(
    frames: usize,
    height: usize,
    width: usize,
    temporal: usize,
    factor: usize,
    min_pixels: f64,
    max_pixels: f64,
) -> Result<(usize, usize), String> {
    if frames < temporal {
        return Err(format!(
            "{frames} frame(s) is fewer than a temporal patch of {temporal}"
        ));
    }
    let (mut height, mut width) = (height.max(1), width.max(1));
    if height < factor || width < factor {
        let scale = (factor as f64 / height as f64).max(factor as f64 / width as f64);
        height = (height as f64 * scale) as usize;
        width = (width as f64 * scale) as usize;
    }
    let (h, w) = (height as f64, width as f64);
    let ratio = h.max(w) / h.min(w).max(1.0);
    if ratio > 200.0 {
        return Err(format!(
            "absolute aspect ratio must be smaller than 200, got {ratio}"
        ));
    }
    let mut h_bar = round_by_factor(h, factor);
    let mut w_bar = round_by_factor(w, factor);
    let t_bar = round_by_factor(frames as f64, temporal);
    let all = |h: usize, w: usize| (t_bar * h * w) as f64;
    let f = factor as f64;
    if all(h_bar, w_bar) > max_pixels {
        let beta = (frames as f64 * h * w / max_pixels).sqrt();
        h_bar = factor.max(((h / beta / f).floor() * f) as usize);
        w_bar = factor.max(((w / beta / f).floor() * f) as usize);
    } else if all(h_bar, w_bar) < min_pixels {
        let beta = (min_pixels / (frames as f64 * h * w)).sqrt();
        h_bar = ((h * beta / f).ceil() * f) as usize;
        w_bar = ((w * beta / f).ceil() * f) as usize;
    }
    if h_bar == 0 || w_bar == 0 {
        return Err(format!(
            "a {width}x{height} frame cannot be sized for this model"
        ));
    }
    Ok((h_bar, w_bar))
}

/// At most `count` of `items`, spread evenly (by linspace over their positions).
pub fn evenly(items: &[u64], count: usize) -> Vec<u64> {
    if count >= items.len() {
        return items.to_vec();
    }
    linspace_indices(0, items.len() as u64 - 1, count)
        .into_iter()
        .filter_map(|i| items.get(i as usize).copied())
        .collect()
}

/// Pad to an even count with the last item, as qwen-vl-utils pads a list of frames.
pub fn pad_to_pairs(mut items: Vec<u64>) -> Vec<u64> {
    if !items.len().is_multiple_of(FRAME_FACTOR)
        && let Some(&last) = items.last()
    {
        items.push(last);
    }
    items
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fps_rule_matches_qwen_vl_utils() {
        // 3 s at 30 fps: 6 frames; 0.5 s at 10 fps (5 frames): min 4; 4 s at 12 fps: 8.
        assert_eq!(fps_frame_count(90, 30.0, 2.0, 4, 768), 6);
        assert_eq!(fps_frame_count(5, 10.0, 2.0, 4, 768), 4);
        assert_eq!(fps_frame_count(48, 12.0, 2.0, 4, 768), 8);
        // 29.97 fps for 3 s: 90 / 29.97 * 2 = 6.006 → 6.
        assert_eq!(fps_frame_count(90, 30000.0 / 1001.0, 2.0, 4, 768), 6);
        // An hour at 30 fps: capped at 768.
        assert_eq!(fps_frame_count(108_000, 30.0, 2.0, 4, 768), 768);
        // Three frames: max_frames floors to 2.
        assert_eq!(fps_frame_count(3, 30.0, 2.0, 4, 768), 2);
    }

    #[test]
    fn linspace_rounds_like_torch() {
        assert_eq!(linspace_indices(0, 89, 6), vec![0, 18, 36, 53, 71, 89]);
        assert_eq!(linspace_indices(0, 4, 4), vec![0, 1, 3, 4]);
        assert_eq!(linspace_indices(0, 9, 1), vec![0]);
    }

    #[test]
    fn smart_resize_keeps_sides_multiple_of_factor() {
        let (h, w) = smart_resize(1080, 1920, 28, 100_352.0, 602_112.0).unwrap();
        assert_eq!((h, w), (560, 1008));
        let (h, w) = smart_resize(120, 160, 28, 100_352.0, 602_112.0).unwrap();
        assert!(h * w >= 100_352 && h % 28 == 0 && w % 28 == 0);
        assert!(smart_resize(1, 400, 28, 1.0, 1e9).is_err());
    }

    #[test]
    fn qwen3_rules_match_transformers() {
        // int(90 / 30 × 2) = 6; 5 frames at 10 fps: min 4; 3 frames: all 3 (not rounded to pairs).
        assert_eq!(qwen3_frame_count(90, 30.0, 2.0, 4, 768), 6);
        assert_eq!(qwen3_frame_count(5, 10.0, 2.0, 4, 768), 4);
        assert_eq!(qwen3_frame_count(3, 30.0, 2.0, 4, 768), 3);
        // np.linspace(0, 47, 5).round(): 11.75 → 12, 23.5 → 24 (half to even), 35.25 → 35.
        assert_eq!(numpy_linspace_indices(0, 47, 5), vec![0, 12, 24, 35, 47]);
        assert_eq!(numpy_linspace_indices(0, 9, 1), vec![0]);
        // 4 frames of 1080x1920 within 4096..=25165824 pixels in all: 1088x1920 (a multiple of 32).
        let (h, w) = qwen3_smart_resize(4, 1080, 1920, 2, 32, 4096.0, 25_165_824.0).unwrap();
        assert_eq!((h, w), (1088, 1920));
        // Over the bound: scaled down as a whole.
        let (h, w) = qwen3_smart_resize(64, 1080, 1920, 2, 32, 4096.0, 25_165_824.0).unwrap();
        assert!(
            64 * h * w <= 25_165_824 && h % 32 == 0 && w % 32 == 0,
            "{h}x{w}"
        );
        assert!(qwen3_smart_resize(1, 64, 64, 2, 32, 1.0, 1e9).is_err());
    }

    #[test]
    fn keyframes_are_spread_then_padded_to_pairs() {
        assert_eq!(evenly(&[0, 30, 60], 8), vec![0, 30, 60]);
        assert_eq!(evenly(&[0, 10, 20, 30, 40], 2), vec![0, 40]);
        assert_eq!(pad_to_pairs(vec![0, 30, 60]), vec![0, 30, 60, 60]);
        assert_eq!(pad_to_pairs(vec![0, 30]), vec![0, 30]);
    }
}
