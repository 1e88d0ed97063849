//! The built-in document plugin through the host, timed on one core: page 1 of a PDF rendered at
//! an exact size (`reduce`: the page drawn and encoded as the PNG the image plugin then takes),
//! each call in a fresh store as the gateway makes it; and the probe (page count and sizes).
//!
//!     cargo bench -p mmgate-host --bench plugin_document -- document FILE CONFIG.json ITERATIONS
//!
//! CONFIG.json names the page and size as the gateway does:
//! `{"mmgate_document_pages": [{"page": 1, "width": W, "height": H}]}`.
//!
//! Prints one JSON line: {"file", "wasm_render_ms_median", "probe_ms_median", "png_bytes"}.
//! `bench/documents.py` runs it beside pdfium and MuPDF rendering the same page at the same size.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{Run, builtin, median_ms};
use mmgate_host::{Budget, SandboxLimits};

fn main() {
    let Some(Run {
        modality,
        file,
        media,
        config,
        iterations,
    }) = Run::from_args("plugin_document")
    else {
        return;
    };
    // `document`: the argument is kept so that every plugin benchmark reads one command line.
    let plugin = &builtin(&modality, SandboxLimits::default());
    let info = plugin.probe(&media).unwrap();
    let plan = plugin
        .plan(&info, Budget { max_tokens: 0 }, &config)
        .unwrap();
    let render = || plugin.reduce(&media, &plan, &config).unwrap();
    let png_bytes = render().files[0].data.len();
    let render_ms = median_ms(iterations, render);
    let probe_ms = median_ms(iterations, || plugin.probe(&media).unwrap());
    println!(
        "{{\"file\": {file:?}, \"wasm_render_ms_median\": {render_ms:.3}, \"probe_ms_median\": {probe_ms:.3}, \"png_bytes\": {png_bytes}}}"
    );
}
