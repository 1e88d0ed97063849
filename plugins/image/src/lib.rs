//! The built-in image plugin: decodes images (JPEG rows and resizes in the host), then plans and
//! makes them as the checkpoint's image processor does. Each processor family lives in a file of
//! `processor/`, chosen by the class the model's `preprocessor_config.json` names
//! (`image_processor_type`) through the table in `processor/mod.rs`; each family's file says what
//! its processor does, what its plan counts and what it makes under a budget.

mod choices;
mod processor;

use mmgate_plugin_sdk::imagedecode as decode;
use mmgate_plugin_sdk::imageops::RgbImage;
use mmgate_plugin_sdk::*;

use processor::{Choices, ImageProcessor};

/// The plugin; public so its code can also run natively (`mmgate_plugin_sdk::run_natively`).
pub struct ImagePlugin;

impl Plugin for ImagePlugin {
    fn describe() -> Descriptor {
        Descriptor::new(
            "image",
            env!("CARGO_PKG_VERSION"),
            "decode images; plan and make them as each listed image processor class does",
            &["image"],
            decode::MIME_TYPES,
            &processor::supported(),
        )
    }

    fn probe(media: Media) -> PluginResult<MediaInfo> {
        Ok(decode::probe(&media.data)?.media_info())
    }

    fn plan(info: MediaInfo, budget: Budget, config: ProcessorConfig) -> PluginResult<TokenPlan> {
        let processor = processor::for_config(&config)?;
        let (width, height) = decode::dimensions(&info)?;
        let jpeg = info.format == "jpeg";
        processor.plan(width as usize, height as usize, jpeg, budget.max_tokens)
    }

    fn preprocess(
        media: Media,
        plan: TokenPlan,
        config: ProcessorConfig,
    ) -> PluginResult<Vec<Tensor>> {
        let processor = processor::for_config(&config)?;
        let choices: Choices = plan.choices()?;
        let image = decode_for(processor.as_ref(), &choices, &media.data)?;
        processor.preprocess(image, &choices)
    }

    /// A large Qwen2-VL image is made in bands of rows on several instances at once (the host
    /// joins them before the vision tower, which attends over the whole image).
    fn parts(plan: TokenPlan, config: ProcessorConfig) -> PluginResult<u32> {
        let processor = processor::for_config(&config)?;
        let parts = processor.parts(&plan.choices()?)?;
        u32::try_from(parts).map_err(|_| PluginError::internal("too many parts"))
    }

    /// Band `index`: only its source rows are decoded (a JPEG's by the host, the rows above it
    /// entropy-decoded only), resized (a JPEG's by the host too) and laid out as that run of the
    /// whole's patches.
    fn preprocess_part(
        media: Media,
        plan: TokenPlan,
        config: ProcessorConfig,
        index: u32,
    ) -> PluginResult<Vec<Tensor>> {
        let processor = processor::for_config(&config)?;
        let choices: Choices = plan.choices()?;
        let parts = processor.parts(&choices)?;
        if parts == 1 && index == 0 {
            return Self::preprocess(media, plan, config);
        }
        let header = decode::probe(&media.data)?;
        let band = processor.band(&choices, parts, index as usize)?;
        let Some((width, height, filter)) = processor.whole_resize(&choices) else {
            return Err(PluginError::internal(
                "an image made in bands has a planned size",
            ));
        };
        let rows = decode::decode_rgb_resized_rows(
            &media.data,
            &header,
            (width, height),
            filter,
            band.clone(),
        )?;
        processor.preprocess_band(rows, &choices, band)
    }

    /// An image whose plan keeps HF's own size goes as it came (the server's processor resizes it
    /// as the plan did), unless the plan shrinks it a lot (see [`ImageProcessor::sends_resized`]); a
    /// reduced one goes at its planned size, as a PNG.
    fn reduce(media: Media, plan: TokenPlan, config: ProcessorConfig) -> PluginResult<ReducedItem> {
        let processor = processor::for_config(&config)?;
        let choices: Choices = plan.choices()?;
        if !plan.reduced {
            let header = decode::probe(&media.data)?;
            let (width, height) = (header.width as usize, header.height as usize);
            if !processor.sends_resized(width, height, &choices) {
                return Ok(ReducedItem::single(media));
            }
        }
        let image = decode_for(processor.as_ref(), &choices, &media.data)?;
        let resized = processor.reduced_image(image, &choices)?;
        Ok(ReducedItem::single(files::png(&resized)?))
    }
}

/// The image as `processor` starts on it for `choices`: already at the size it is first resized
/// to, if any (a JPEG's resize then runs in the host, natively), else as it came.
fn decode_for(
    processor: &dyn ImageProcessor,
    choices: &Choices,
    data: &[u8],
) -> PluginResult<RgbImage> {
    match processor.whole_resize(choices) {
        Some((width, height, filter)) => decode::decode_rgb_resized(data, (width, height), filter),
        None => decode::decode_rgb(data),
    }
}

// Natively (the benchmark's baseline) there is no component to export, and the linker would choke
// on the component-model symbol names.
#[cfg(target_arch = "wasm32")]
mmgate_plugin_sdk::export_plugin!(ImagePlugin);
