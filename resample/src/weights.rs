//! What a pass multiplies by: Pillow's filters, and for each output index along one axis its
//! first input index and fixed-point weights, exactly as Pillow computes them.

use crate::fixed::PRECISION_BITS;

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

/// Keys' cubic with a = -0.5: Pillow's `BICUBIC` kernel (torchvision's too).
pub fn bicubic(x: f64) -> f64 {
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
pub(crate) struct AxisWeights {
    pub(crate) starts: Vec<usize>,
    pub(crate) counts: Vec<usize>,
    /// `ksize` weights per output index (zero-padded past its count).
    pub(crate) weights: Vec<i32>,
    pub(crate) ksize: usize,
    /// The weights as the AVX2 horizontal pass reads them (built only for it).
    #[cfg(target_arch = "x86_64")]
    pub(crate) paired: Vec<[i32; 8]>,
}

impl AxisWeights {
    /// The first input index and the weights of output index `i`.
    #[inline]
    pub(crate) fn taps(&self, i: usize) -> (usize, &[i32]) {
        let row = i * self.ksize;
        (self.starts[i], &self.weights[row..row + self.counts[i]])
    }
}

pub(crate) fn axis_weights(in_size: usize, out_size: usize, filter: Filter) -> AxisWeights {
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
        #[cfg(target_arch = "x86_64")]
        paired: Vec::new(),
    }
}
