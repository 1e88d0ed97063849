//! The host's decoder gives the pixels Pillow gives: byte for byte those of the plugins' own
//! decoder, which the image parity fixtures hold to Pillow's (`tests/fixtures/image`), on the
//! fixtures' JPEGs and on JPEGs made here in every layout an encoder writes (chroma subsamplings,
//! odd sizes whose last block row and column are partial, progressive, arithmetic-coded, restart
//! markers, greyscale, RGB).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use libjpeg_turbo_rs::{ColorSpace, Decoder, Encoder, PixelFormat, Subsampling};
use mmgate_image_decode::{ImageError, Limits, decode_jpeg, decode_jpeg_rows};

fn reference(data: &[u8]) -> Vec<u8> {
    let mut decoder = Decoder::new(data).unwrap();
    decoder.set_output_format(PixelFormat::Rgb);
    decoder.decode_image().unwrap().data
}

fn assert_same_pixels(name: &str, data: &[u8]) {
    let ours = decode_jpeg(data, &Limits::default()).unwrap_or_else(|e| panic!("{name}: {e}"));
    let theirs = reference(data);
    assert_eq!(ours.rgb.len(), theirs.len(), "{name}");
    let differing = ours.rgb.iter().zip(&theirs).filter(|(a, b)| a != b).count();
    assert_eq!(
        differing,
        0,
        "{name}: {differing} of {} samples differ",
        theirs.len()
    );
}

/// A picture with edges, gradients and noise, so every coefficient band carries something.
fn scene(width: usize, height: usize) -> Vec<u8> {
    let mut state = 0x2545_f491_u32;
    let mut rgb = Vec::with_capacity(width * height * 3);
    for y in 0..height {
        for x in 0..width {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            let noise = (state % 24) as usize;
            let stripe = if (x / 7 + y / 5) % 2 == 0 { 60 } else { 0 };
            rgb.push(((x * 255 / width.max(1)) + noise).min(255) as u8);
            rgb.push(((y * 255 / height.max(1)) + stripe).min(255) as u8);
            rgb.push((((x + y) * 3) % 256) as u8);
        }
    }
    rgb
}

#[test]
fn the_fixture_jpegs_decode_to_the_reference_pixels() {
    let images = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/image/images");
    let mut decoded = 0;
    for entry in std::fs::read_dir(images).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "jpg") {
            continue;
        }
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let data = std::fs::read(&path).unwrap();
        if name.contains("cmyk") {
            // Left to the plugin's decoder (Pillow's own CMYK inversion).
            assert!(
                matches!(
                    decode_jpeg(&data, &Limits::default()),
                    Err(ImageError::Unsupported(_))
                ),
                "{name}"
            );
            continue;
        }
        assert_same_pixels(&name, &data);
        decoded += 1;
    }
    assert!(decoded >= 5, "only {decoded} fixture JPEGs");
}

#[test]
fn encoder_layouts_decode_to_the_reference_pixels() {
    let subsamplings = [
        Subsampling::S444,
        Subsampling::S422,
        Subsampling::S420,
        Subsampling::S440,
        Subsampling::S411,
    ];
    for (width, height) in [(1, 1), (17, 9), (64, 48), (203, 117)] {
        let pixels = scene(width, height);
        for subsampling in subsamplings {
            for (progressive, arithmetic, restart) in [
                (false, false, 0),
                (true, false, 0),
                (false, true, 0),
                (false, false, 2),
            ] {
                let data = Encoder::new(&pixels, width, height, PixelFormat::Rgb)
                    .quality(85)
                    .subsampling(subsampling)
                    .progressive(progressive)
                    .arithmetic(arithmetic)
                    .restart_blocks(restart)
                    .encode()
                    .unwrap();
                let name = format!(
                    "{width}x{height} {subsampling:?} progressive={progressive} \
                     arithmetic={arithmetic} restart={restart}"
                );
                assert_same_pixels(&name, &data);
            }
        }
        let grey = Encoder::new(&pixels, width, height, PixelFormat::Rgb)
            .grayscale_from_color(true)
            .encode()
            .unwrap();
        assert_same_pixels(&format!("{width}x{height} grey"), &grey);
        let rgb = Encoder::new(&pixels, width, height, PixelFormat::Rgb)
            .colorspace(ColorSpace::Rgb)
            .encode()
            .unwrap();
        assert_same_pixels(&format!("{width}x{height} RGB colour space"), &rgb);
    }
}

/// Every band of rows is those rows of the whole image, byte for byte, in every layout: bands
/// starting and ending inside an MCU row and on its edges, where chroma upsampling reads the rows
/// around them (4:2:0 and 4:4:0 "fancy" upsampling), after progressive and restart-marked scans.
#[test]
fn bands_of_rows_are_the_whole_images_rows() {
    let (width, height) = (203, 117);
    let pixels = scene(width, height);
    let layouts = [
        (Subsampling::S444, false, 0),
        (Subsampling::S422, false, 0),
        (Subsampling::S420, false, 0),
        (Subsampling::S440, false, 0),
        (Subsampling::S411, false, 0),
        (Subsampling::S420, true, 0),
        (Subsampling::S420, false, 2),
    ];
    for (subsampling, progressive, restart) in layouts {
        let data = Encoder::new(&pixels, width, height, PixelFormat::Rgb)
            .quality(85)
            .subsampling(subsampling)
            .progressive(progressive)
            .restart_blocks(restart)
            .encode()
            .unwrap();
        let whole = decode_jpeg(&data, &Limits::default()).unwrap();
        let row = width * 3;
        for start in [0, 1, 7, 8, 15, 16, 17, 31, 32, 33, 56, 100, 116] {
            for end in [start + 1, start + 15, start + 16, start + 28, height] {
                let end = end.min(height);
                let band = decode_jpeg_rows(&data, &Limits::default(), start as u32..end as u32)
                    .unwrap_or_else(|e| panic!("{subsampling:?} rows {start}..{end}: {e}"));
                assert_eq!(
                    (band.width, band.height),
                    (width as u32, (end - start) as u32)
                );
                assert!(
                    band.rgb == whole.rgb[start * row..end * row],
                    "{subsampling:?} progressive={progressive} restart={restart}: rows \
                     {start}..{end} differ from the whole image's"
                );
            }
        }
        for rows in [0..0, 5..5, 100..118, 117..118] {
            assert!(
                matches!(
                    decode_jpeg_rows(&data, &Limits::default(), rows.clone()),
                    Err(ImageError::InvalidMedia(_))
                ),
                "{rows:?}"
            );
        }
        // A band of a truncated file is refused as the whole is, whichever rows it asks for.
        let truncated = &data[..data.len() / 2];
        assert!(matches!(
            decode_jpeg_rows(truncated, &Limits::default(), 0..10),
            Err(ImageError::InvalidMedia(_))
        ));
    }
}

#[test]
fn limits_are_applied_before_decoding() {
    let pixels = scene(64, 48);
    let data = Encoder::new(&pixels, 64, 48, PixelFormat::Rgb)
        .encode()
        .unwrap();
    let small = Limits {
        max_pixels: 64 * 48 - 1,
        ..Limits::default()
    };
    assert!(matches!(
        decode_jpeg(&data, &small),
        Err(ImageError::LimitExceeded(_))
    ));
    let narrow = Limits {
        max_width: 63,
        ..Limits::default()
    };
    assert!(matches!(
        decode_jpeg(&data, &narrow),
        Err(ImageError::LimitExceeded(_))
    ));
    let short = Limits {
        max_bytes: data.len() - 1,
        ..Limits::default()
    };
    assert!(matches!(
        decode_jpeg(&data, &short),
        Err(ImageError::LimitExceeded(_))
    ));
    let progressive = Encoder::new(&pixels, 64, 48, PixelFormat::Rgb)
        .progressive(true)
        .encode()
        .unwrap();
    let few_scans = Limits {
        max_scans: 2,
        ..Limits::default()
    };
    assert!(matches!(
        decode_jpeg(&progressive, &few_scans),
        Err(ImageError::LimitExceeded(_))
    ));
}

/// Damage inside the entropy-coded data is only a warning to libjpeg, which decodes on; Pillow
/// hands such an image over, and so does the host.
#[test]
fn damaged_scans_decode_as_pillow_decodes_them() {
    let pixels = scene(64, 48);
    let mut data = Encoder::new(&pixels, 64, 48, PixelFormat::Rgb)
        .encode()
        .unwrap();
    let scan = data.windows(2).position(|w| w == [0xFF, 0xDA]).unwrap();
    let middle = scan + (data.len() - scan) / 2;
    // A restart marker in a scan that has none: libjpeg warns ("premature end of data segment")
    // and fills the rest of the scan.
    data[middle..middle + 2].copy_from_slice(&[0xFF, 0xD3]);
    let image = decode_jpeg(&data, &Limits::default()).unwrap();
    assert_eq!(
        (image.width, image.height, image.rgb.len()),
        (64, 48, 64 * 48 * 3)
    );
}

#[test]
fn broken_files_are_refused_not_decoded_to_grey() {
    let pixels = scene(64, 48);
    let data = Encoder::new(&pixels, 64, 48, PixelFormat::Rgb)
        .encode()
        .unwrap();
    // Cut inside the scan: Pillow refuses a file that ends before its end-of-image marker.
    let cut = &data[..data.len() / 2];
    assert!(matches!(
        decode_jpeg(cut, &Limits::default()),
        Err(ImageError::InvalidMedia(_))
    ));
    // Not a JPEG at all.
    let png_signature = b"\x89PNG\r\n\x1a\n\xff\xda\xff\xd9";
    assert!(matches!(
        decode_jpeg(png_signature, &Limits::default()),
        Err(ImageError::InvalidMedia(_))
    ));
    let truncated =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/image/bad/truncated.jpg");
    let truncated = std::fs::read(truncated).unwrap();
    assert!(matches!(
        decode_jpeg(&truncated, &Limits::default()),
        Err(ImageError::InvalidMedia(_))
    ));
}

/// A JPEG decoded and resized by the host is the decoded image resized by the plugins' own
/// resampler (the image parity fixtures hold that to Pillow's), enlarged or shrunk, with either
/// filter; at its own size it is the decoded image; a band of its rows is those rows of the whole.
/// The resized size is held to the limits too.
#[test]
fn resized_jpegs_are_the_decoded_pixels_resized() {
    use mmgate_image_decode::{Filter, Resize, decode_jpeg_resized};
    let whole = |(width, height): (u32, u32), filter| Resize {
        width,
        height,
        filter,
        rows: 0..height,
    };
    if !mmgate_resample::simd_kernels() {
        let data = std::fs::read(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../tests/fixtures/image/images/photo-640x480.jpg"),
        )
        .unwrap();
        let refused =
            decode_jpeg_resized(&data, &Limits::default(), &whole((64, 48), Filter::Bicubic));
        assert!(
            matches!(refused, Err(ImageError::Unsupported(_))),
            "{refused:?}"
        );
        return;
    }
    let (width, height) = (173, 91);
    let data = Encoder::new(&scene(width, height), width, height, PixelFormat::Rgb)
        .quality(90)
        .encode()
        .unwrap();
    let decoded = decode_jpeg(&data, &Limits::default()).unwrap();
    for (size, filter) in [
        ((260, 140), Filter::Bicubic),
        ((50, 31), Filter::Bicubic),
        ((174, 90), Filter::Bilinear),
        ((173, 91), Filter::Bicubic),
    ] {
        let resized = decode_jpeg_resized(&data, &Limits::default(), &whole(size, filter)).unwrap();
        let expected = mmgate_resample::resize(
            mmgate_resample::Rows::whole(&decoded.rgb, width, height),
            size.0 as usize,
            size.1 as usize,
            filter,
        );
        assert_eq!((resized.width, resized.height), size);
        assert!(resized.rgb == expected, "{size:?} {filter:?}");
        // Bands of the resized rows, each decoding only the source rows it reads, are the
        // whole's rows; rows outside the resized image are refused.
        let row = size.0 as usize * 3;
        for band in [
            0..1,
            0..size.1 / 3,
            size.1 / 3..size.1 - 1,
            size.1 - 1..size.1,
        ] {
            let to = Resize {
                rows: band.clone(),
                ..whole(size, filter)
            };
            let rows = decode_jpeg_resized(&data, &Limits::default(), &to).unwrap();
            assert_eq!((rows.width, rows.height), (size.0, band.len() as u32));
            let expected = &expected[band.start as usize * row..band.end as usize * row];
            assert!(rows.rgb == expected, "{size:?} {filter:?} rows {band:?}");
        }
        for band in [0..0, size.1..size.1 + 1] {
            let to = Resize {
                rows: band.clone(),
                ..whole(size, filter)
            };
            let refused = decode_jpeg_resized(&data, &Limits::default(), &to)
                .map(|image| (image.width, image.height));
            assert!(
                matches!(refused, Err(ImageError::InvalidMedia(_))),
                "rows {band:?}: {refused:?}"
            );
        }
    }
    let small = Limits {
        max_pixels: 200 * 100,
        ..Limits::default()
    };
    for size in [(0, 10), (201, 100), (300, 70)] {
        let refused = decode_jpeg_resized(&data, &small, &whole(size, Filter::Bicubic))
            .map(|image| (image.width, image.height));
        assert!(
            matches!(&refused, Err(ImageError::LimitExceeded(m)) if m.contains("resize")),
            "{size:?}: {refused:?}"
        );
    }
}
