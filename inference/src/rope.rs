//! Rotary position tables: the LLM's (multimodal) RoPE and the vision tower's 2-D RoPE, computed on
//! the host in f32 exactly as transformers computes them, plus Qwen2-VL's `get_rope_index`, which
//! gives every prompt token its (temporal, height, width) position.

use crate::error::{Error, Result};

/// `1 / theta^(2i / dim)` for `i < dim / 2`, in f32 as PyTorch computes it.
pub fn inv_freq(dim: usize, theta: f32) -> Vec<f32> {
    (0..dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f32 / dim as f32))
        .collect()
}

/// Which position component (0 temporal, 1 height, 2 width) turns each of `half` frequencies.
///
/// `sections` is M-RoPE's `mrope_section` (e.g. `[16, 24, 24]`), `None` for plain RoPE (all
/// temporal). Contiguous (Qwen2-VL): the first 16 frequencies turn by the temporal position, the
/// next 24 by the height, the last 24 by the width. Interleaved (Qwen3-VL's `mrope_interleaved`):
/// frequency j turns by the height when j % 3 == 1 and j < 3 · sections\[1\], by the width when
/// j % 3 == 2 and j < 3 · sections\[2\], by the temporal position otherwise.
pub fn frequency_components(
    half: usize,
    sections: Option<&[usize]>,
    interleaved: bool,
) -> Result<Vec<usize>> {
    let Some(sections) = sections else {
        return Ok(vec![0; half]);
    };
    if sections.iter().sum::<usize>() != half || sections.is_empty() || sections.len() > 3 {
        return Err(Error::Input(format!(
            "rope sections {sections:?} for {half} frequencies"
        )));
    }
    if !interleaved {
        return Ok(sections
            .iter()
            .enumerate()
            .flat_map(|(c, &n)| std::iter::repeat_n(c, n))
            .collect());
    }
    let limit = |c: usize| sections.get(c).map_or(0, |&n| 3 * n);
    Ok((0..half)
        .map(|j| match j % 3 {
            1 if j < limit(1) => 1,
            2 if j < limit(2) => 2,
            _ => 0,
        })
        .collect())
}

/// cos/sin tables `[rows, head_dim]` for positions with up to three components, `component[i]`
/// saying which turns frequency i (see [`frequency_components`]). Each half of the table repeats
/// the frequencies (PyTorch's `cat((freqs, freqs))`).
pub fn tables(
    positions: &[[i64; 3]],
    inv_freq: &[f32],
    component: &[usize],
) -> Result<(Vec<f32>, Vec<f32>)> {
    let half = inv_freq.len();
    if component.len() != half || component.iter().any(|&c| c > 2) {
        return Err(Error::Input(format!(
            "rope components {component:?} for {half} frequencies"
        )));
    }
    let dim = 2 * half;
    let mut cos = vec![0.0f32; positions.len() * dim];
    let mut sin = vec![0.0f32; positions.len() * dim];
    for (r, pos) in positions.iter().enumerate() {
        for i in 0..half {
            let angle = pos[component[i]] as f32 * inv_freq[i];
            let (s, c) = angle.sin_cos();
            cos[r * dim + i] = c;
            cos[r * dim + half + i] = c;
            sin[r * dim + i] = s;
            sin[r * dim + half + i] = s;
        }
    }
    Ok((cos, sin))
}

/// A media item's patch grid as the vision tower sees it: temporal patches × height × width patches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grid {
    pub t: usize,
    pub h: usize,
    pub w: usize,
}

impl Grid {
    pub fn patches(&self) -> usize {
        self.t * self.h * self.w
    }

    /// LLM tokens after the `merge × merge` patch merger.
    pub fn tokens(&self, merge: usize) -> usize {
        self.patches() / (merge * merge)
    }
}

/// The vision tower's rotary tables: per patch, the (row, column) of the patch in its frame, in the
/// block-major order of the patches (`merge × merge` blocks, row by row), repeated for each frame.
/// Half the rotary frequencies follow the row, half the column.
pub fn vision_tables(
    grids: &[Grid],
    merge: usize,
    head_dim: usize,
    theta: f32,
) -> Result<(Vec<f32>, Vec<f32>)> {
    // Half of head_dim's frequencies follow the row, half the column, each the same ladder of
    // `head_dim / 4` frequencies (transformers' axial rope: `cat(freqs_h, freqs_w)`).
    let ladder = inv_freq(head_dim / 2, theta);
    let freqs: Vec<f32> = ladder.iter().chain(&ladder).copied().collect();
    let mut positions = Vec::new();
    for g in grids {
        if merge == 0 || g.h % merge != 0 || g.w % merge != 0 {
            return Err(Error::Input(format!(
                "grid {g:?} is not a multiple of the {merge}x{merge} merge"
            )));
        }
        let mut frame = Vec::with_capacity(g.h * g.w);
        for bh in 0..g.h / merge {
            for bw in 0..g.w / merge {
                for ih in 0..merge {
                    for iw in 0..merge {
                        frame.push([(bh * merge + ih) as i64, (bw * merge + iw) as i64, 0]);
                    }
                }
            }
        }
        for _ in 0..g.t {
            positions.extend_from_slice(&frame);
        }
    }
    let components =
        frequency_components(2 * ladder.len(), Some(&[ladder.len(), ladder.len()]), false)?;
    tables(&positions, &freqs, &components)
}

/// Where the media items of a prompt are: the placeholder token and the grid of each item, in order.
#[derive(Debug, Clone, PartialEq)]
pub struct MediaSpan {
    pub token: u32,
    pub grid: Grid,
    /// Temporal position step per temporal patch, truncated after multiplying: 1 for Qwen2-VL and
    /// for images; `tokens_per_second · second_per_grid_t` for Qwen2.5-VL videos, so that positions
    /// follow real time.
    pub time_interval: f32,
    /// A piece of the previous span's item (a video made in parts): its block continues that one's,
    /// from the same start, its temporal patches numbered from this one; `None`: a block of its own.
    pub continues_at: Option<usize>,
}

/// Qwen2-VL's 3-D positions for a prompt: text tokens advance all three components together; the
/// `t·h·w / merge²` placeholder tokens of a media item get (start + ⌊t·interval⌋, start + row,
/// start + col) over its merged grid; text after it continues from one past the largest position
/// the item used. Returns the positions and the delta to add to a plain counter for tokens
/// generated afterwards.
///
/// "One past the largest position" is the rule the Qwen2-VL and Qwen2.5-VL authors wrote (and
/// vLLM follows). transformers 5 continues text from `start + max(h, w)` instead, which differs
/// only when an item's temporal positions reach past its spatial ones (long videos, or Qwen2.5-VL's
/// time-scaled ones) while its generated tokens still continue from the largest position; the
/// parity fixtures stay in the range where both agree.
///
/// Media items are consumed in order as their placeholder tokens appear; an item's placeholders must
/// be contiguous and their count must match its grid.
pub fn mrope_positions(
    ids: &[u32],
    media: &[MediaSpan],
    merge: usize,
) -> Result<(Vec<[i64; 3]>, i64)> {
    let mut positions = Vec::with_capacity(ids.len());
    let mut next = 0i64;
    // Where the last block started, for the pieces that continue it.
    let mut block_start = 0i64;
    let mut items = media.iter();
    let mut i = 0;
    while i < ids.len() {
        let token = ids[i];
        let is_placeholder = media.iter().any(|m| m.token == token);
        if !is_placeholder {
            positions.push([next; 3]);
            next += 1;
            i += 1;
            continue;
        }
        let item = items.next().ok_or_else(|| {
            Error::Input(format!(
                "placeholder token {token} at {i} has no media item left"
            ))
        })?;
        if item.token != token {
            return Err(Error::Input(format!(
                "placeholder {token} at {i}, but the next media item uses token {}",
                item.token
            )));
        }
        let (t, h, w) = (item.grid.t, item.grid.h / merge, item.grid.w / merge);
        let count = t * h * w;
        if ids.len() < i + count || ids[i..i + count].iter().any(|&x| x != token) {
            return Err(Error::Input(format!(
                "media item at {i} needs {count} contiguous placeholder tokens"
            )));
        }
        let (start, first_t) = match item.continues_at {
            Some(first_t) => (block_start, first_t),
            None => (next, 0),
        };
        block_start = start;
        let mut last = next - 1;
        for ti in first_t..first_t + t {
            for hi in 0..h {
                for wi in 0..w {
                    // PyTorch: `(arange(t) * interval).long()`, in f32, truncating.
                    let p = [
                        start + (ti as f32 * item.time_interval) as i64,
                        start + hi as i64,
                        start + wi as i64,
                    ];
                    last = last.max(p[0]).max(p[1]).max(p[2]);
                    positions.push(p);
                }
            }
        }
        next = last + 1;
        i += count;
    }
    if items.next().is_some() {
        return Err(Error::Input(
            "more media items than placeholder runs in the prompt".into(),
        ));
    }
    let delta = next - ids.len() as i64;
    Ok((positions, delta))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_after_a_long_video_continues_past_its_last_temporal_position() {
        // 6 temporal patches of a 2x2 merged grid: temporal positions reach start + 5, beyond the
        // spatial extent, and the following text continues after them (Qwen2-VL's rule, also vLLM's).
        let media = [MediaSpan {
            token: 9,
            grid: Grid { t: 6, h: 4, w: 4 },
            time_interval: 1.0,
            continues_at: None,
        }];
        let mut ids = vec![1, 2];
        ids.extend(std::iter::repeat_n(9, 24));
        ids.push(3);
        let (pos, delta) = mrope_positions(&ids, &media, 2).unwrap();
        assert_eq!(pos[2], [2, 2, 2]);
        assert_eq!(pos[25], [7, 3, 3]);
        assert_eq!(pos[26], [8, 8, 8]);
        assert_eq!(delta, 9 - 27);
    }

    #[test]
    fn qwen2_5_vl_video_positions_follow_time_and_truncate_after_scaling() {
        // The Qwen2.5-VL authors' example: 3 temporal patches of a 2x2 merged grid at interval 50
        // (25 tokens/s, 2 frames per patch, 1 fps); text continues from the largest position + 1.
        let media = [MediaSpan {
            token: 9,
            grid: Grid { t: 3, h: 4, w: 4 },
            time_interval: 50.0,
            continues_at: None,
        }];
        let mut ids = vec![9; 12];
        ids.push(1);
        let (pos, delta) = mrope_positions(&ids, &media, 2).unwrap();
        let temporal: Vec<i64> = pos[..12].iter().map(|p| p[0]).collect();
        assert_eq!(temporal, [0, 0, 0, 0, 50, 50, 50, 50, 100, 100, 100, 100]);
        assert_eq!(pos[12], [101; 3]);
        assert_eq!(delta, 102 - 13);
        // A fractional interval is truncated per patch, not per step: 0, 1.5, 3.0 -> 0, 1, 3.
        let media = [MediaSpan {
            token: 9,
            grid: Grid { t: 3, h: 2, w: 2 },
            time_interval: 1.5,
            continues_at: None,
        }];
        let (pos, _) = mrope_positions(&[9, 9, 9], &media, 2).unwrap();
        assert_eq!(pos.iter().map(|p| p[0]).collect::<Vec<_>>(), [0, 1, 3]);
    }

    #[test]
    fn a_video_in_pieces_has_the_whole_videos_positions() {
        let span = |t, continues_at| MediaSpan {
            token: 9,
            grid: Grid { t, h: 4, w: 6 },
            time_interval: 1.5,
            continues_at,
        };
        let mut ids = vec![1, 2];
        ids.extend(std::iter::repeat_n(9, 5 * 6));
        ids.extend([3, 4]);
        let whole = mrope_positions(&ids, &[span(5, None)], 2).unwrap();
        let pieces = [span(2, None), span(1, Some(2)), span(2, Some(3))];
        assert_eq!(mrope_positions(&ids, &pieces, 2).unwrap(), whole);
    }

    #[test]
    fn placeholder_counts_must_match_the_grids() {
        let media = [MediaSpan {
            token: 9,
            grid: Grid { t: 1, h: 4, w: 4 },
            time_interval: 1.0,
            continues_at: None,
        }];
        assert!(mrope_positions(&[1, 9, 9, 9, 2], &media, 2).is_err());
        assert!(mrope_positions(&[1, 2], &media, 2).is_err());
        assert!(mrope_positions(&[1, 9, 9, 9, 9, 9, 9, 9, 9], &media, 2).is_err());
    }
}
