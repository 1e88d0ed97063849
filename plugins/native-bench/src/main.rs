//! A built-in plugin's code built natively, timed on one core: the baseline for the sandbox's cost.
//!
//!     cargo run --release -p mmgate-native-bench -- MODALITY FILE CONFIG.json ITERATIONS
//!     cargo run --release -p mmgate-native-bench -- document FILE WIDTHxHEIGHT ITERATIONS
//!
//! Runs the plugin's whole per-item path (probe, plan without a budget, preprocess) on FILE and
//! prints one JSON line: {"file", "native_ms_median", "tokens"}; for a document, page 1 rendered
//! at WIDTHxHEIGHT, alone and with its PNG encoding: {"file", "native_render_ms_median",
//! "native_render_png_ms_median"}. Run by the scripts in `bench/` beside the same plugin through
//! the host (`cargo bench -p mmgate-host --bench plugin_preprocess` / `plugin_document`).

use std::time::Instant;

use mmgate_audio_plugin::AudioPlugin;
use mmgate_image_plugin::ImagePlugin;
use mmgate_plugin_sdk::{PluginResult, Tensor, TokenPlan, run_natively};

type Preprocess = fn(Vec<u8>, &str, u32) -> PluginResult<(TokenPlan, Vec<Tensor>)>;

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().collect();
    let [_, modality, file, config, iterations] = args.as_slice() else {
        return Err("usage: mmgate-native-bench MODALITY FILE CONFIG.json ITERATIONS".into());
    };
    if modality == "document" {
        return document(file, config, iterations);
    }
    let preprocess: Preprocess = match modality.as_str() {
        "image" => run_natively::<ImagePlugin>,
        "audio" => run_natively::<AudioPlugin>,
        other => return Err(format!("no built-in {other} plugin (image, audio)")),
    };
    let data = std::fs::read(file).map_err(|e| format!("{file}: {e}"))?;
    let config = std::fs::read_to_string(config).map_err(|e| format!("{config}: {e}"))?;
    let iterations: usize = iterations
        .parse::<usize>()
        .map_err(|e| format!("{e}"))?
        .max(1);
    let run = || preprocess(data.clone(), &config, u32::MAX).map_err(|e| format!("{e:?}"));
    let (plan, _) = run()?;
    let mut samples = Vec::with_capacity(iterations);
    for _ in 0..iterations {
        let start = Instant::now();
        std::hint::black_box(run()?);
        samples.push(start.elapsed().as_secs_f64() * 1e3);
    }
    samples.sort_by(f64::total_cmp);
    println!(
        "{{\"file\": {file:?}, \"native_ms_median\": {:.3}, \"tokens\": {}}}",
        samples[samples.len() / 2],
        plan.tokens
    );
    Ok(())
}

/// Page 1 of the PDF in `file` rendered natively at `size` (`WIDTHxHEIGHT`), `iterations` times.
fn document(file: &str, size: &str, iterations: &str) -> Result<(), String> {
    use mmgate_document_plugin::{PageRender, open, render_page};
    let data = std::fs::read(file).map_err(|e| format!("{file}: {e}"))?;
    let (width, height) = size.split_once('x').ok_or("a size is WIDTHxHEIGHT")?;
    let render = PageRender {
        page: 1,
        width: width.parse().map_err(|e| format!("{e}"))?,
        height: height.parse().map_err(|e| format!("{e}"))?,
    };
    let iterations: usize = iterations
        .parse::<usize>()
        .map_err(|e| format!("{e}"))?
        .max(1);
    let pdf = open(data).map_err(|e| format!("{e:?}"))?;
    let time = |f: &dyn Fn() -> Result<(), String>| -> Result<f64, String> {
        let mut samples = Vec::with_capacity(iterations);
        for _ in 0..iterations {
            let start = Instant::now();
            f()?;
            samples.push(start.elapsed().as_secs_f64() * 1e3);
        }
        samples.sort_by(f64::total_cmp);
        Ok(samples[samples.len() / 2])
    };
    let page = || render_page(&pdf, &render).map_err(|e| format!("{e:?}"));
    let render_ms = time(&|| page().map(|p| drop(std::hint::black_box(p))))?;
    let png_ms = time(&|| {
        let png = mmgate_plugin_sdk::files::png(&page()?).map_err(|e| format!("{e:?}"))?;
        std::hint::black_box(png);
        Ok(())
    })?;
    println!(
        "{{\"file\": {file:?}, \"native_render_ms_median\": {render_ms:.3}, \"native_render_png_ms_median\": {png_ms:.3}}}"
    );
    Ok(())
}
