//! The image processors: [`ImageProcessor`], which each family implements in a file of its own
//! (reading its own settings from the checkpoint's `preprocessor_config.json`), and [`TABLE`], from
//! the processor class a config names to the family that implements it. A new image family is its
//! file here, its line in the table and its tests.

mod config;
mod fixed;
mod gemma3;
mod gemma4;
mod idefics3;
mod internvl;
mod llama4;
mod llava_next;
mod pixtral;
mod qwen2_vl;

use std::ops::Range;

use mmgate_plugin_sdk::imagedecode::ImageRows;
use mmgate_plugin_sdk::imageops::{Filter, RgbImage};
use mmgate_plugin_sdk::*;
use serde_json::Value;

pub use crate::choices::Choices;

/// One family's image processor, made from its config: the plan of an image's tokens, the image a
/// model server is sent for a plan, and the tensors it makes. A processor that only plans and
/// counts (the engine makes its tensors) keeps the default [`Self::preprocess`].
pub trait ImageProcessor {
    /// The plan of a `width`×`height` image within `budget` tokens. `jpeg`: the image is a JPEG,
    /// whose rows the host decodes a band at a time (only such an image is made in bands: any
    /// other is decoded whole for each band).
    fn plan(&self, width: usize, height: usize, jpeg: bool, budget: u32)
    -> PluginResult<TokenPlan>;

    /// The size and filter the whole image is resized to before anything else, by both
    /// [`Self::preprocess`] and [`Self::reduced_image`], where they begin so: the caller then
    /// decodes it at that size at once (a JPEG's resize runs in the host) and the resize here
    /// finds it done. `None` where the first step is something else (crops of the image as it
    /// came, tiles) or none.
    fn whole_resize(&self, choices: &Choices) -> Option<(usize, usize, Filter)>;

    /// Whether an image its plan keeps at the processor's own size is still sent to a model
    /// server resized to it (where the server would otherwise decode far more pixels than it
    /// keeps).
    fn sends_resized(&self, _width: usize, _height: usize, _choices: &Choices) -> bool {
        false
    }

    /// The image a reduced plan chose, as the model's server is sent it so that its own processor
    /// makes what the plan counted.
    fn reduced_image(&self, image: RgbImage, choices: &Choices) -> PluginResult<RgbImage>;

    /// The tensors of a planned image.
    fn preprocess(&self, _image: RgbImage, _choices: &Choices) -> PluginResult<Vec<Tensor>> {
        Err(PluginError::unsupported(
            "this model's images are planned here for an engine that makes their tensors: this \
             plugin counts their tokens but does not make them",
        ))
    }

    /// How many bands of rows a planned image is made in (contract 0.4's parts): 1, whole,
    /// unless the family lays its tensors out so that a band of rows is a run of the whole's.
    fn parts(&self, _choices: &Choices) -> PluginResult<usize> {
        Ok(1)
    }

    /// The output rows of band `index` of `parts`.
    fn band(&self, _choices: &Choices, _parts: usize, _index: usize) -> PluginResult<Range<usize>> {
        Err(PluginError::internal("this family's images are made whole"))
    }

    /// The tensors of the band of output rows `band`, made from `rows` (the source image's rows,
    /// or the resized image's, that the band reads): the bands' tensors in order join into the
    /// whole's.
    fn preprocess_band(
        &self,
        _rows: ImageRows,
        _choices: &Choices,
        _band: Range<usize>,
    ) -> PluginResult<Vec<Tensor>> {
        Err(PluginError::internal("this family's images are made whole"))
    }
}

/// What makes a family's processor from the config the table parsed.
type Make = fn(&Value) -> PluginResult<Box<dyn ImageProcessor>>;

/// Each processor class this plugin implements and the family that does. HF's PIL (`...Pil`) and
/// torchvision (`...Fast`) variants of a class compute the same thing and are accepted too.
const TABLE: &[(&str, Make)] = &[
    ("Qwen2VLImageProcessor", qwen2_vl::qwen2_vl),
    ("Qwen2_5_VLImageProcessor", qwen2_vl::qwen2_vl),
    ("Glm4vImageProcessor", qwen2_vl::glm4v),
    ("PaddleOCRVLImageProcessor", qwen2_vl::paddleocr_vl),
    ("CLIPImageProcessor", fixed::clip),
    ("CLIPFeatureExtractor", fixed::clip),
    ("SiglipImageProcessor", fixed::siglip),
    ("Gemma3ImageProcessor", gemma3::make),
    ("Gemma4ImageProcessor", gemma4::make),
    ("PixtralImageProcessor", pixtral::make),
    ("LlavaNextImageProcessor", llava_next::llava_next),
    ("LlavaOnevisionImageProcessor", llava_next::llava_onevision),
    ("GotOcr2ImageProcessor", internvl::make),
    ("Idefics3ImageProcessor", idefics3::make),
    ("SmolVLMImageProcessor", idefics3::make),
    ("Llama4ImageProcessor", llama4::make),
];

/// The processor classes this plugin implements, as its descriptor lists them.
pub fn supported() -> Vec<&'static str> {
    TABLE.iter().map(|(class, _)| *class).collect()
}

/// The processor `json` (a `preprocessor_config.json`) configures.
pub fn for_config(json: &str) -> PluginResult<Box<dyn ImageProcessor>> {
    let config: Value = parse_config(json)?;
    let named = |key: &str| config.get(key).and_then(Value::as_str);
    // Checkpoints saved before image processors existed name the class as a feature extractor.
    let class = named("image_processor_type")
        .or_else(|| named("feature_extractor_type"))
        .ok_or_else(|| {
            PluginError::unsupported(
                "processor config names no image_processor_type (or feature_extractor_type)",
            )
        })?;
    let base = class.strip_suffix("Pil").unwrap_or(class);
    let base = base.strip_suffix("Fast").unwrap_or(base);
    let Some((_, make)) = TABLE.iter().find(|(supported, _)| *supported == base) else {
        return Err(PluginError::unsupported(format!(
            "image processor type {class:?} is not supported (supported: {})",
            supported().join(", ")
        )));
    };
    // Every plan here is of a resized image.
    if config.get("do_resize") == Some(&Value::Bool(false)) {
        return Err(PluginError::unsupported(
            "processor config: do_resize = false is not supported",
        ));
    }
    make(&config)
}

/// A family's processor, or why its config makes none.
fn boxed<P: ImageProcessor + 'static>(
    made: PluginResult<P>,
) -> PluginResult<Box<dyn ImageProcessor>> {
    Ok(Box::new(made?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tokens a config naming only `class` plans for a 640x480 JPEG (its defaults), or the
    /// error it is refused with.
    fn planned(class: &str) -> Result<u32, String> {
        let config = format!(r#"{{"image_processor_type": "{class}"}}"#);
        let processor = for_config(&config).map_err(|e| format!("{e:?}"))?;
        let plan = processor
            .plan(640, 480, true, u32::MAX)
            .map_err(|e| format!("{e:?}"))?;
        Ok(plan.tokens)
    }

    /// Each class's `Fast` and `Pil` variants are the same processor; a class whose processor
    /// has defaults for every size plans on them; an unknown class, a config naming none and one
    /// without resizing are refused.
    #[test]
    fn the_table_makes_each_class_and_its_variants() {
        let mut on_defaults = 0;
        for class in supported() {
            let base = planned(class);
            for variant in [format!("{class}Fast"), format!("{class}Pil")] {
                assert_eq!(planned(&variant), base, "{variant}");
            }
            on_defaults += usize::from(base.is_ok());
        }
        // All but CLIP's, SigLIP's and the LLaVA anyres classes (sizes and resolutions needed).
        assert_eq!(on_defaults, supported().len() - 5);
        assert!(planned("NoSuchImageProcessor").is_err());
        assert!(for_config(r#"{"min_pixels": 3136}"#).is_err());
        let unresized =
            for_config(r#"{"image_processor_type": "Qwen2VLImageProcessor", "do_resize": false}"#);
        assert!(unresized.is_err());
    }
}
