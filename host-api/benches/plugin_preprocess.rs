//! A built-in plugin through the host, timed on one core: probe + plan + preprocess, each in a fresh
//! store as the gateway runs them. Separately: expanding 8-bit samples to their f32 values, which
//! the encoder does when it packs a batch (it is not preprocessing, but it is printed so that a
//! comparison with processors that emit floats can count it).
//!
//!     cargo bench -p mmgate-host --bench plugin_preprocess -- MODALITY FILE CONFIG.json ITERATIONS
//!
//! Prints one JSON line: {"file", "wasm_ms_median", "expand_ms_median", "expand_blocks_ms_median",
//! "tokens"} (expanded whole into fresh memory, and a block at a time as the encoder does), and for a
//! JPEG "jpeg_decode_ms_median": the host's libjpeg-turbo decode of the file alone, as the plugin's
//! call makes it (the floor under any processor that decodes with libjpeg-turbo). The scripts in
//! `bench/` run it beside the same code built natively (`plugins/native-bench`) and HF's processors,
//! and print the ratios.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{Run, builtin, median_ms};
use mmgate_host::{Budget, Media, SandboxLimits};

fn main() {
    let Some(Run {
        modality,
        file,
        media,
        config,
        iterations,
    }) = Run::from_args("plugin_preprocess")
    else {
        return;
    };
    let plugin = &builtin(&modality, SandboxLimits::default());
    let budget = Budget {
        max_tokens: u32::MAX,
    };
    let run = || {
        let info = plugin.probe(&media).unwrap();
        let plan = plugin.plan(&info, budget, &config).unwrap();
        let tensors = plugin.preprocess(&media, &plan, &config).unwrap();
        (plan.tokens, tensors)
    };
    let (tokens, tensors) = run();
    // What the encoder does with 8-bit samples when it packs them into its batch.
    let expand = || {
        let mut values = Vec::new();
        for t in tensors.iter().filter(|t| t.dtype == mmgate_host::Dtype::U8) {
            let samples = mmgate_host::ByteSamples::from_tensors(&tensors, &t.name).unwrap();
            samples.unwrap().map_into(&mut values);
        }
        values
    };
    // What the encoder does: the same values, a block of 2^20 at a time into one reused buffer
    // (its patch embedding's input), so that no memory is freshly touched.
    let mut block = vec![0f32; 1 << 20];
    let expand_blocks = || {
        for t in tensors.iter().filter(|t| t.dtype == mmgate_host::Dtype::U8) {
            let samples = mmgate_host::ByteSamples::from_tensors(&tensors, &t.name)
                .unwrap()
                .unwrap();
            let mut at = 0;
            while at < samples.len() {
                let n = (samples.len() - at).min(block.len());
                samples.map_range_into(at, &mut block[..n]);
                std::hint::black_box(&block);
                at += n;
            }
        }
    };
    let frames = (modality == "video").then(|| frames_decoded(&media.data, &config, plugin));
    let preprocess_ms = median_ms(iterations, run);
    let jpeg_decode = media.data.starts_with(&[0xFF, 0xD8]).then(|| {
        let limits = mmgate_image_decode::Limits::default();
        let decode_ms = median_ms(iterations, || {
            mmgate_image_decode::decode_jpeg(&media.data, &limits).unwrap()
        });
        format!(", \"jpeg_decode_ms_median\": {decode_ms:.3}")
    });
    let expand_ms = median_ms(iterations, expand);
    let expand_blocks_ms = median_ms(iterations, expand_blocks);
    let frames = frames
        .map(|(sampled, decoded)| {
            format!(", \"frames_sampled\": {sampled}, \"frames_decoded\": {decoded}")
        })
        .unwrap_or_default();
    let jpeg_decode = jpeg_decode.unwrap_or_default();
    println!(
        "{{\"file\": {file:?}, \"wasm_ms_median\": {:.3}, \"expand_ms_median\": {:.3}, \"expand_blocks_ms_median\": {:.3}, \"tokens\": {tokens}{frames}{jpeg_decode}}}",
        preprocess_ms, expand_ms, expand_blocks_ms
    );
}

/// For a video: the frames the plan sampled, and how many the host's decoder decoded to get them
/// (the same decoder, asked for the same frames in the same order).
fn frames_decoded(data: &[u8], config: &str, plugin: &mmgate_host::LoadedPlugin) -> (usize, u64) {
    let media = Media {
        data: data.to_vec(),
        mime_type: None,
    };
    let info = plugin.probe(&media).unwrap();
    let budget = Budget {
        max_tokens: u32::MAX,
    };
    let plan = plugin.plan(&info, budget, config).unwrap();
    let choices: serde_json::Value = serde_json::from_str(&plan.choices).unwrap();
    let indices: Vec<u64> = choices["frame_indices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i.as_u64().unwrap())
        .collect();
    let mut video =
        mmgate_video_decode::Video::open(data, mmgate_video_decode::Limits::default()).unwrap();
    for &index in &indices {
        video.frame(index, None).unwrap();
    }
    (indices.len(), video.frames_decoded())
}
