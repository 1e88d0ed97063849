//! The built-in image plugin.
//!
//! Processors (chosen by `image_processor_type` in the model's `preprocessor_config.json`):
//! - Qwen2-VL / Qwen2.5-VL: `smart_resize` within min/max pixels, bicubic, CLIP mean/std, 14-px
//!   patches, temporal patch 2, 2x2 merge → `pixel_values` as u8 samples, [h·w, 588]: each channel
//!   run once, with `pixel_values_repeats` = 2 for HF's temporal copies (the host reads them as
//!   HF's [h·w, 1176]), `pixel_values_table` (f32 [3, 256], the normalisation per byte) and
//!   `image_grid_thw`. A large image is made in bands of rows (`parts`), each a run of the
//!   whole's patches with its own grid.
//! - Fixed-size CLIP / SigLIP: resize (shortest edge or exact size), optional centre crop, normalise →
//!   `pixel_values` [1, 3, H, W] f32.
//! - Gemma 3: each view (the image, and its pan-and-scan crops when on) resized to a fixed size →
//!   `pixel_values` [views, 3, H, W] f32 and `num_crops`; under a budget, fewer crops.
//! - Pixtral / Mistral 3: native resolution within a longest edge, in whole tokens →
//!   `pixel_values` [1, 3, H, W] f32 and `image_sizes`; under a budget, a lower longest edge.
//! - LLaVA-NeXT (anyres): planned and counted for an engine that makes the tensors; under a
//!   budget, a smaller image.

mod choices;
mod gemma3;
mod idefics3;
mod internvl;
mod llama4;
mod llava_next;
mod pixtral;
mod processor;

use mmgate_plugin_sdk::imagedecode as decode;
use mmgate_plugin_sdk::imageops::RgbImage;
use mmgate_plugin_sdk::*;

use processor::{Choices, Processor};

/// The plugin; public so its code can also run natively (`mmgate_plugin_sdk::run_natively`).
pub struct ImagePlugin;

impl Plugin for ImagePlugin {
    fn describe() -> Descriptor {
        Descriptor::new(
            "image",
            env!("CARGO_PKG_VERSION"),
            "decode images; Qwen2-VL smart resize + patchify, fixed-size CLIP/SigLIP, Gemma 3, Pixtral",
            &["image"],
            decode::MIME_TYPES,
            processor::SUPPORTED,
        )
    }

    fn probe(media: Media) -> PluginResult<MediaInfo> {
        Ok(decode::probe(&media.data)?.media_info())
    }

    fn plan(info: MediaInfo, budget: Budget, config: ProcessorConfig) -> PluginResult<TokenPlan> {
        let processor = Processor::from_config(&config)?;
        let (width, height) = decode::dimensions(&info)?;
        let jpeg = info.format == "jpeg";
        processor.plan(width as usize, height as usize, jpeg, budget.max_tokens)
    }

    fn preprocess(
        media: Media,
        plan: TokenPlan,
        config: ProcessorConfig,
    ) -> PluginResult<Vec<Tensor>> {
        let processor = Processor::from_config(&config)?;
        let choices: Choices = plan.choices()?;
        let image = decode_for(&processor, &choices, &media.data)?;
        processor.preprocess(image, &choices)
    }

    /// A large Qwen2-VL image is made in bands of rows on several instances at once (the host
    /// joins them before the vision tower, which attends over the whole image).
    fn parts(plan: TokenPlan, config: ProcessorConfig) -> PluginResult<u32> {
        let processor = Processor::from_config(&config)?;
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
        let processor = Processor::from_config(&config)?;
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
            band.rows.clone(),
        )?;
        processor.preprocess_band(rows, &choices, &band)
    }

    /// An image whose plan keeps HF's own size goes as it came (the server's processor resizes it
    /// as the plan did), unless the plan shrinks it a lot (see [`Processor::sends_resized`]); a
    /// reduced one goes at its planned size, as a PNG.
    fn reduce(media: Media, plan: TokenPlan, config: ProcessorConfig) -> PluginResult<ReducedItem> {
        let processor = Processor::from_config(&config)?;
        let choices: Choices = plan.choices()?;
        if !plan.reduced {
            let header = decode::probe(&media.data)?;
            let (width, height) = (header.width as usize, header.height as usize);
            if !processor.sends_resized(width, height, &choices) {
                return Ok(ReducedItem::single(media));
            }
        }
        let image = decode_for(&processor, &choices, &media.data)?;
        let resized = processor.reduced_image(image, &choices)?;
        Ok(ReducedItem::single(files::png(&resized)?))
    }
}

/// The image as `processor` starts on it for `choices`: already at the size it is first resized
/// to, if any (a JPEG's resize then runs in the host, natively), else as it came.
fn decode_for(processor: &Processor, choices: &Choices, data: &[u8]) -> PluginResult<RgbImage> {
    match processor.whole_resize(choices) {
        Some((width, height, filter)) => decode::decode_rgb_resized(data, (width, height), filter),
        None => decode::decode_rgb(data),
    }
}

// Natively (the benchmark's baseline) there is no component to export, and the linker would choke
// on the component-model symbol names.
#[cfg(target_arch = "wasm32")]
mmgate_plugin_sdk::export_plugin!(ImagePlugin);
