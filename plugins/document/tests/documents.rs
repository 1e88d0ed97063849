//! The plugin's own code run natively on the committed fixtures (tests/fixtures/documents, made by
//! its make.py): pages rendered at exactly the asked size match pdfium's render of the same page
//! at that size, and every hostile file is a typed error, never a panic (a trap in the sandbox).

use mmgate_document_plugin::{DocumentPlugin, PageRender, open, page_sizes, render_page};
use mmgate_plugin_sdk::{Budget, Media, Plugin, PluginError};

fn fixtures() -> String {
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/documents"
    )
    .to_owned()
}

fn read(name: &str) -> Vec<u8> {
    std::fs::read(format!("{}/{name}", fixtures())).expect("a fixture (tests/fixtures/documents)")
}

fn decode_png(data: &[u8]) -> (usize, usize, Vec<u8>) {
    let mut reader = png::Decoder::new(std::io::Cursor::new(data))
        .read_info()
        .expect("a PNG");
    let mut buf = vec![0; reader.output_buffer_size().expect("a size")];
    let info = reader.next_frame(&mut buf).expect("a frame");
    assert_eq!(info.color_type, png::ColorType::Rgb);
    buf.truncate(info.buffer_size());
    (info.width as usize, info.height as usize, buf)
}

/// Mean absolute difference per channel, in 1/255.
fn mean_abs_diff(a: &[u8], b: &[u8]) -> f64 {
    assert_eq!(a.len(), b.len());
    let sum: u64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| u64::from(x.abs_diff(y)))
        .sum();
    sum as f64 / a.len() as f64
}

#[test]
fn pages_match_pdfium_at_the_same_pixel_size() {
    let cases: serde_json::Value = serde_json::from_slice(&read("cases.json")).expect("cases.json");
    let cases = cases["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 5, "text, photo, slide, rotated, scanned");
    for case in cases {
        let name = case["name"].as_str().expect("a name");
        let render = PageRender {
            page: 1,
            width: case["width"].as_u64().expect("a width") as u32,
            height: case["height"].as_u64().expect("a height") as u32,
        };
        let pdf = open(read(&format!("{name}.pdf"))).expect("the fixture opens");
        let ours = render_page(&pdf, &render).expect("the page renders");
        let (width, height, reference) = decode_png(&read(&format!("pdfium/{name}.png")));
        assert_eq!((ours.width, ours.height), (width, height), "{name}");
        let mad = mean_abs_diff(&ours.data, &reference);
        println!("{name}: {width}x{height}, mean absolute difference {mad:.2}/255");
        assert!(mad <= 10.0, "{name}: {mad:.2}/255 from pdfium's render");
    }
}

#[test]
fn a_probe_gives_each_pages_size_and_reduce_makes_pngs_of_the_planned_sizes() {
    let media = || Media {
        data: read("three-pages.pdf"),
        mime_type: None,
    };
    let info = DocumentPlugin::probe(media()).expect("the probe");
    assert_eq!(
        (info.modality.as_str(), info.frame_count),
        ("document", Some(3))
    );
    let pdf = open(read("three-pages.pdf")).expect("opens");
    let sizes = page_sizes(&pdf).expect("sizes");
    assert_eq!(sizes[1].width, 960.0, "the slide is 960 points wide");
    let config = r#"{"mmgate_document_pages": [{"page": 2, "width": 448, "height": 252}, {"page": 3, "width": 300, "height": 388}]}"#;
    let plan = DocumentPlugin::plan(info.clone(), Budget { max_tokens: 0 }, config.into())
        .expect("the plan");
    let made = DocumentPlugin::reduce(media(), plan, config.into()).expect("the pages");
    let sizes: Vec<(usize, usize)> = made
        .files
        .iter()
        .map(|f| {
            let (w, h, _) = decode_png(&f.data);
            (w, h)
        })
        .collect();
    assert_eq!(sizes, vec![(448, 252), (300, 388)]);

    // Pages that do not exist, and sizes over the limits, are refused at the plan.
    for bad in [
        r#"{"mmgate_document_pages": [{"page": 4, "width": 10, "height": 10}]}"#,
        r#"{"mmgate_document_pages": [{"page": 0, "width": 10, "height": 10}]}"#,
        r#"{"mmgate_document_pages": [{"page": 1, "width": 9000, "height": 10}]}"#,
        r#"{"mmgate_document_pages": [{"page": 1, "width": 5000, "height": 5000}]}"#,
    ] {
        let refused = DocumentPlugin::plan(info.clone(), Budget { max_tokens: 0 }, bad.into());
        assert!(
            matches!(
                refused,
                Err(PluginError::InvalidMedia(_) | PluginError::LimitExceeded(_))
            ),
            "{bad}: {refused:?}"
        );
    }
}

#[test]
fn hostile_documents_are_typed_errors() {
    let probe = |name: &str| {
        DocumentPlugin::probe(Media {
            data: read(name),
            mime_type: Some("application/pdf".into()),
        })
    };
    match probe("bad/encrypted.pdf") {
        Err(PluginError::InvalidMedia(m)) => assert!(m.contains("encrypted"), "{m}"),
        other => panic!("encrypted: {other:?}"),
    }
    match probe("bad/not-a-pdf.pdf") {
        Err(PluginError::InvalidMedia(m)) => assert!(m.contains("%PDF-"), "{m}"),
        other => panic!("not a PDF: {other:?}"),
    }
    for name in ["bad/truncated.pdf", "bad/bad-xref.pdf"] {
        // Readers rebuild a broken cross-reference table from the objects when they can.
        match probe(name) {
            Ok(info) => assert_eq!(info.frame_count, Some(1), "{name}"),
            Err(PluginError::InvalidMedia(m)) => assert!(m.contains("malformed"), "{name}: {m}"),
            other => panic!("{name}: {other:?}"),
        }
    }
    // A page box of 14400 x 200000 points (and a user unit) is only numbers until rendered:
    // rendered at a bounded size, it is scaled down.
    let info = probe("bad/huge-box.pdf").expect("the probe");
    assert_eq!(info.frame_count, Some(1));
    let pdf = open(read("bad/huge-box.pdf")).expect("opens");
    let page = render_page(
        &pdf,
        &PageRender {
            page: 1,
            width: 56,
            height: 768,
        },
    )
    .expect("renders");
    assert_eq!((page.width, page.height), (56, 768));
}

/// Mutated copies of the fixtures (bytes overwritten, truncated, stretches of noise) through
/// probe, plan and a small render: a result or a typed error, never a panic (a trap in the
/// sandbox: a 500 for the client instead of a clear 4xx).
#[test]
fn mutated_documents_never_panic() {
    let documents: Vec<Vec<u8>> = ["text.pdf", "slide.pdf", "rotated.pdf", "three-pages.pdf"]
        .iter()
        .map(|name| read(name))
        .collect();
    // xorshift64: deterministic, so a failure reproduces.
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let mut random = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state as usize
    };
    let config = r#"{"mmgate_document_pages": [{"page": 1, "width": 48, "height": 64}]}"#;
    let (mut rendered, mut refused) = (0, 0);
    for i in 0..300 {
        let mut data = documents[i % documents.len()].clone();
        match random() % 3 {
            0 => {
                for _ in 0..1 + random() % 20 {
                    let at = random() % data.len();
                    data[at] = random() as u8;
                }
            }
            1 => data.truncate((random() % data.len()).max(1)),
            _ => {
                let at = random() % data.len();
                let len = (random() % 512).min(data.len() - at);
                for byte in &mut data[at..at + len] {
                    *byte = random() as u8;
                }
            }
        }
        let media = || Media {
            data: data.clone(),
            mime_type: None,
        };
        let made = DocumentPlugin::probe(media())
            .and_then(|info| DocumentPlugin::plan(info, Budget { max_tokens: 0 }, config.into()))
            .and_then(|plan| DocumentPlugin::reduce(media(), plan, config.into()));
        match made {
            Ok(_) => rendered += 1,
            Err(_) => refused += 1,
        }
    }
    println!("{rendered} rendered, {refused} refused");
    assert!(
        rendered > 0 && refused > 0,
        "{rendered} rendered, {refused} refused"
    );
}

/// A page's text layer comes in reading order; a scanned page has none; a plan may ask for the
/// text alone.
#[test]
fn a_pages_text_layer_is_its_lines_in_reading_order() {
    let text = |name: &str| {
        let pdf = open(read(name)).expect("opens");
        mmgate_document_plugin::page_text(&pdf, 1).expect("the text")
    };
    let report = text("text.pdf");
    let first = report.lines().next().unwrap_or_default();
    assert_eq!(first, "Quarterly report", "{report}");
    assert!(
        report.contains("Multimodal gateways turn documents into the images"),
        "{report}"
    );
    assert_eq!(
        report,
        text("rotated.pdf"),
        "rotation does not change the text"
    );
    let slide = text("slide.pdf");
    assert!(slide.starts_with("Architecture"), "{slide}");
    assert!(
        slide.contains("Gateway") && slide.contains("Engine"),
        "{slide}"
    );
    assert_eq!(text("scanned.pdf"), "", "a scan has no text layer");

    let media = || Media {
        data: read("three-pages.pdf"),
        mime_type: None,
    };
    let info = DocumentPlugin::probe(media()).expect("the probe");
    let config = r#"{"mmgate_document_pages": [{"page": 1, "width": 1, "height": 1}, {"page": 2, "width": 1, "height": 1}], "mmgate_document_text": true, "mmgate_document_pixels": false}"#;
    let plan = DocumentPlugin::plan(info, Budget { max_tokens: 0 }, config.into()).expect("plan");
    let made = DocumentPlugin::reduce(media(), plan, config.into()).expect("the text");
    let kinds: Vec<Option<&str>> = made.files.iter().map(|f| f.mime_type.as_deref()).collect();
    assert_eq!(kinds, vec![Some("text/plain; charset=utf-8"); 2]);
    assert!(String::from_utf8_lossy(&made.files[1].data).starts_with("Architecture"));
}
