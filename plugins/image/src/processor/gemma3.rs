//! Gemma 3's image processor (`Gemma3ImageProcessor`): every view of an image is resized to one
//! fixed size (bilinear, mean and std 0.5) and costs `image_seq_length` tokens. With pan-and-scan
//! on (`do_pan_and_scan`, which vLLM takes from `--mm-processor-kwargs`) an image whose aspect
//! ratio passes `pan_and_scan_min_ratio_to_activate` is also cut into 2 to
//! `pan_and_scan_max_num_crops` crops along its long side, each a view of its own.
//!
//! Under a budget the plan keeps fewer crops: the image goes to the model's server squashed to
//! the aspect ratio for which its pan-and-scan makes that many (n:1; 1:1 at the views' size for
//! none), so the server's processor makes exactly the planned views.

use mmgate_plugin_sdk::imageops::{Filter, Normalize, RgbImage};
use mmgate_plugin_sdk::*;
use serde::Deserialize;
use serde_json::Value;

use super::config::{BaseConfig, SizeConfig, SizeField, positive, read};
use super::{ImageProcessor, boxed};
use crate::choices::{Choices, tokens_u32};

pub fn make(config: &Value) -> PluginResult<Box<dyn ImageProcessor>> {
    boxed(Gemma3::from_config(config))
}

#[derive(Debug, Deserialize)]
struct Config {
    #[serde(flatten)]
    base: BaseConfig,
    size: Option<SizeField>,
    /// Tokens per view, and pan-and-scan (null in checkpoints: the processor's defaults).
    image_seq_length: Option<usize>,
    do_pan_and_scan: Option<bool>,
    pan_and_scan_min_crop_size: Option<usize>,
    pan_and_scan_max_num_crops: Option<usize>,
    pan_and_scan_min_ratio_to_activate: Option<f64>,
}

/// transformers' `Gemma3Processor` defaults for what `preprocessor_config.json` leaves null.
const DEFAULT_MIN_CROP: usize = 256;
const DEFAULT_MAX_CROPS: usize = 4;
const DEFAULT_MIN_RATIO: f64 = 1.2;
const DEFAULT_TOKENS_PER_VIEW: usize = 256;

pub struct PanAndScan {
    pub min_crop: usize,
    pub max_crops: usize,
    pub min_ratio: f64,
}

impl PanAndScan {
    pub fn new(min_crop: Option<usize>, max_crops: Option<usize>, min_ratio: Option<f64>) -> Self {
        Self {
            min_crop: min_crop.unwrap_or(DEFAULT_MIN_CROP),
            max_crops: max_crops.unwrap_or(DEFAULT_MAX_CROPS),
            min_ratio: min_ratio.unwrap_or(DEFAULT_MIN_RATIO),
        }
    }

    /// transformers' `pan_and_scan`: the crops' grid (columns, rows) of a `width`×`height` image
    /// and each crop's size, or `None` when it makes no crops.
    fn grid(&self, width: usize, height: usize) -> Option<((usize, usize), (usize, usize))> {
        let (w, h) = (width as f64, height as f64);
        let along = |long: f64, short: f64| -> Option<usize> {
            if long / short < self.min_ratio {
                return None;
            }
            let ideal = (long / short + 0.5).floor() as usize;
            let fits = (long / self.min_crop as f64).floor() as usize;
            Some(ideal.min(fits).max(2).min(self.max_crops))
        };
        let (columns, rows) = if width >= height {
            (along(w, h)?, 1)
        } else {
            (1, along(h, w)?)
        };
        let crop = (width.div_ceil(columns), height.div_ceil(rows));
        (crop.0.min(crop.1) >= self.min_crop).then_some(((columns, rows), crop))
    }

    fn crops(&self, width: usize, height: usize) -> usize {
        self.grid(width, height).map_or(0, |((c, r), _)| c * r)
    }
}

pub struct Gemma3 {
    pub width: usize,
    pub height: usize,
    pub tokens_per_view: usize,
    pub pan_and_scan: Option<PanAndScan>,
    pub filter: Filter,
    pub normalize: Normalize,
}

impl Gemma3 {
    fn from_config(config: &Value) -> PluginResult<Self> {
        let config: Config = read(config)?;
        let size = match config.size {
            Some(SizeField::Dict(SizeConfig {
                height: Some(h),
                width: Some(w),
                ..
            })) => (positive("size.width", w)?, positive("size.height", h)?),
            None => (896, 896),
            _ => {
                return Err(PluginError::unsupported(
                    "processor config: Gemma 3's size needs height and width",
                ));
            }
        };
        let pan_and_scan = config.do_pan_and_scan.unwrap_or(false).then(|| {
            PanAndScan::new(
                config.pan_and_scan_min_crop_size,
                config.pan_and_scan_max_num_crops,
                config.pan_and_scan_min_ratio_to_activate,
            )
        });
        if let Some(p) = &pan_and_scan {
            positive("pan_and_scan_min_crop_size", p.min_crop)?;
            positive("pan_and_scan_max_num_crops", p.max_crops)?;
        }
        let tokens_per_view = config
            .image_seq_length
            .map(|t| positive("image_seq_length", t))
            .transpose()?;
        Ok(Gemma3::new(
            size,
            tokens_per_view,
            pan_and_scan,
            config.base.filter(Filter::Bilinear)?,
            config.base.normalize([0.5; 3], [0.5; 3]),
        ))
    }

    pub fn new(
        size: (usize, usize),
        tokens_per_view: Option<usize>,
        pan_and_scan: Option<PanAndScan>,
        filter: Filter,
        normalize: Normalize,
    ) -> Self {
        Self {
            width: size.0,
            height: size.1,
            tokens_per_view: tokens_per_view.unwrap_or(DEFAULT_TOKENS_PER_VIEW),
            pan_and_scan,
            filter,
            normalize,
        }
    }
}

impl ImageProcessor for Gemma3 {
    fn plan(
        &self,
        width: usize,
        height: usize,
        _jpeg: bool,
        budget: u32,
    ) -> PluginResult<TokenPlan> {
        let native = self
            .pan_and_scan
            .as_ref()
            .map_or(0, |p| p.crops(width, height));
        let tokens = |crops: usize| self.tokens_per_view * (1 + crops);
        let budget_tokens = budget as usize;
        let crops = if tokens(native) <= budget_tokens {
            native
        } else {
            // Fewer crops: pan-and-scan never makes one, so 2 or more, or none.
            let fewer = (2..native)
                .rev()
                .chain([0])
                .find(|&n| tokens(n) <= budget_tokens);
            match fewer {
                Some(n) => n,
                None => {
                    return Err(PluginError::over_budget(
                        tokens_u32(tokens(0))?,
                        budget,
                        format!(
                            "a view of this model's images costs {} tokens",
                            self.tokens_per_view
                        ),
                    ));
                }
            }
        };
        let reduced = crops != native;
        let squashed = reduced.then(|| match crops {
            0 => [self.width, self.height],
            n if width >= height => [n * height, height],
            n => [width, n * width],
        });
        let planned = tokens(crops);
        let reason = match (native, reduced) {
            (0, _) => format!(
                "{width}x{height} → {}x{}: one view, {planned} tokens",
                self.width, self.height
            ),
            (_, false) => format!(
                "{width}x{height}: the whole image and {crops} pan-and-scan crops, each {}x{}: \
                 {planned} tokens",
                self.width, self.height
            ),
            (_, true) => format!(
                "{width}x{height}: {crops} of its {native} pan-and-scan crops kept ({planned} \
                 tokens) to fit the budget of {budget}; all would cost {}",
                tokens(native)
            ),
        };
        let choices = Choices {
            width: self.width,
            height: self.height,
            crop: None,
            grid_thw: None,
            bands: None,
            crops: Some(crops),
            squashed,
            tile_grid: None,
        };
        TokenPlan::new(tokens_u32(planned)?, reduced, reason, &choices)
    }

    fn whole_resize(&self, choices: &Choices) -> Option<(usize, usize, Filter)> {
        choices.squashed.map(|[w, h]| (w, h, self.filter))
    }

    /// The image the model's server is sent for a reduced plan: squashed so that its
    /// pan-and-scan makes the planned crops.
    fn reduced_image(&self, image: RgbImage, choices: &Choices) -> PluginResult<RgbImage> {
        choices.squash(image, self.filter)
    }

    /// `pixel_values` [views, 3, H, W]: the whole image, then its crops left to right, top to
    /// bottom (of the squashed image when the plan was reduced, as the server sees it).
    fn preprocess(&self, image: RgbImage, choices: &Choices) -> PluginResult<Vec<Tensor>> {
        let image = match choices.squashed {
            Some([w, h]) => image.into_resized(w, h, self.filter),
            None => image,
        };
        let grid = match &self.pan_and_scan {
            Some(p) => p.grid(image.width, image.height),
            None => None,
        };
        let planned = choices.crops.unwrap_or(0);
        let made = grid.map_or(0, |((c, r), _)| c * r);
        if made != planned {
            return Err(PluginError::internal(format!(
                "the plan has {planned} crops, the image makes {made}"
            )));
        }
        let mut views = vec![image.crop(0, 0, image.width, image.height)];
        if let Some(((columns, rows), (crop_w, crop_h))) = grid {
            for row in 0..rows {
                for column in 0..columns {
                    let (left, top) = (column * crop_w, row * crop_h);
                    // numpy's slices stop at the image's edge: the last crop may be narrower.
                    let w = crop_w.min(image.width.saturating_sub(left));
                    let h = crop_h.min(image.height.saturating_sub(top));
                    if w == 0 || h == 0 {
                        // transformers' crop there is empty, and its resize fails on it.
                        return Err(PluginError::unsupported(format!(
                            "pan-and-scan's crop {column},{row} of a {}x{} image is empty: \
                             pan_and_scan_min_crop_size is too small for this image",
                            image.width, image.height
                        )));
                    }
                    views.push(image.crop(left as isize, top as isize, w, h));
                }
            }
        }
        let count = views.len();
        let mut values = Vec::with_capacity(count * 3 * self.width * self.height * 4);
        for view in views {
            let resized = view.into_resized(self.width, self.height, self.filter);
            values.extend(self.normalize.planar_le_bytes(&resized));
        }
        Ok(vec![
            Tensor::from_f32_bytes("pixel_values", &[count, 3, self.height, self.width], values)?,
            Tensor::from_i64("num_crops", &[1], &[planned as i64])?,
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pan_and_scan() -> PanAndScan {
        PanAndScan::new(None, None, None)
    }

    /// transformers' `pan_and_scan` with the processor's defaults (minimum crop 256, at most 4
    /// crops, from an aspect ratio of 1.2), worked by hand from its source.
    #[test]
    fn crops_follow_transformers_pan_and_scan() {
        let p = pan_and_scan();
        for ((w, h), crops) in [
            ((1200, 300), 4),
            ((900, 300), 3),
            ((600, 280), 2),
            ((300, 1000), 3),
            ((640, 480), 2),
            // Four crops of 256x200: under the minimum crop size, so none.
            ((1024, 200), 0),
            ((256, 256), 0),
            ((300, 47), 0),
            ((20, 30), 0),
            // Ratio just under 1.2.
            ((599, 500), 0),
            ((5000, 500), 4),
        ] {
            assert_eq!(p.crops(w, h), crops, "{w}x{h}");
        }
        assert_eq!(p.grid(300, 1000), Some(((1, 3), (300, 334))));
    }

    fn processor(pan_and_scan: Option<PanAndScan>) -> Gemma3 {
        Gemma3::new(
            (224, 224),
            Some(16),
            pan_and_scan,
            Filter::Bilinear,
            Normalize {
                rescale: 1.0 / 255.0,
                mean: [0.5; 3],
                std: [0.5; 3],
            },
        )
    }

    /// Under a budget the plan keeps fewer crops, squashed so that pan-and-scan makes exactly
    /// those; a budget below one view is an over-budget error.
    #[test]
    fn a_budget_keeps_fewer_crops_of_a_squashed_image() {
        let gemma = processor(Some(pan_and_scan()));
        let plan = gemma.plan(1200, 300, false, 1000).unwrap();
        assert_eq!((plan.tokens, plan.reduced), (80, false));
        for (budget, tokens, squashed) in [
            (79, 64, Some([900, 300])),
            (50, 48, Some([600, 300])),
            (47, 16, Some([224, 224])),
            (16, 16, Some([224, 224])),
        ] {
            let plan = gemma.plan(1200, 300, false, budget).unwrap();
            let choices: Choices = plan.choices().unwrap();
            assert_eq!(
                (plan.tokens, choices.squashed),
                (tokens, squashed),
                "{budget}"
            );
            let [w, h] = squashed.unwrap();
            let crops = pan_and_scan().crops(w, h);
            assert_eq!(
                16 * (1 + crops) as u32,
                tokens,
                "{w}x{h} makes the planned crops"
            );
        }
        let portrait = gemma.plan(300, 1000, false, 50).unwrap();
        let choices: Choices = portrait.choices().unwrap();
        assert_eq!(choices.squashed, Some([300, 600]));
        assert!(gemma.plan(1200, 300, false, 15).is_err());
        // Without pan-and-scan every image is one view.
        let plain = processor(None).plan(1200, 300, false, 1000).unwrap();
        assert_eq!((plain.tokens, plain.reduced), (16, false));
    }

    /// The views: the whole image, then its crops, each resized to the views' size.
    #[test]
    fn preprocess_makes_a_view_per_crop() {
        let gemma = processor(Some(pan_and_scan()));
        let image = RgbImage {
            width: 900,
            height: 300,
            data: (0..900 * 300 * 3).map(|i| (i % 251) as u8).collect(),
        };
        let plan = gemma.plan(900, 300, false, 1000).unwrap();
        let tensors = gemma.preprocess(image, &plan.choices().unwrap()).unwrap();
        assert_eq!(tensors[0].shape, [4u64, 3, 224, 224]);
        assert_eq!(tensors[1].name, "num_crops");
    }

    /// An operator's tiny `pan_and_scan_min_crop_size` can ask for crops past a narrow image's
    /// edge (5 px in 4 crops of 2): refused, where the subtraction would have trapped the plugin.
    #[test]
    fn crops_past_the_edge_are_refused() {
        let gemma = processor(Some(PanAndScan::new(Some(1), Some(4), Some(1.2))));
        let plan = gemma.plan(5, 1, false, 1000).unwrap();
        let image = RgbImage {
            width: 5,
            height: 1,
            data: vec![128; 15],
        };
        let err = gemma
            .preprocess(image, &plan.choices().unwrap())
            .unwrap_err();
        assert!(matches!(err, PluginError::Unsupported(_)), "{err:?}");
    }
}
