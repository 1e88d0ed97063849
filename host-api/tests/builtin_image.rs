//! The built-in image plugin through the real host: probe, plan within a budget, preprocess.
//! (Pixel parity with HF transformers is the image issue's fixture suite; this checks the contract.)

use crate::common;

use std::sync::Arc;

use mmgate_host::{Budget, CallError, Dtype, Media, PluginError, SandboxLimits};

/// A `width` x `height` 24-bit BMP with a gradient, written by hand so the test needs no encoder.
fn bmp(width: u32, height: u32) -> Vec<u8> {
    let row = (width * 3).div_ceil(4) * 4;
    let size = 54 + row * height;
    let mut out = Vec::new();
    out.extend_from_slice(b"BM");
    out.extend_from_slice(&size.to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&54u32.to_le_bytes());
    out.extend_from_slice(&40u32.to_le_bytes());
    out.extend_from_slice(&width.to_le_bytes());
    out.extend_from_slice(&height.to_le_bytes());
    out.extend_from_slice(&1u16.to_le_bytes());
    out.extend_from_slice(&24u16.to_le_bytes());
    out.extend_from_slice(&[0; 24]);
    for y in 0..height {
        let mut line: Vec<u8> = (0..width)
            .flat_map(|x| [(x * 255 / width) as u8, (y * 255 / height) as u8, 128])
            .collect();
        line.resize(row as usize, 0);
        out.extend_from_slice(&line);
    }
    out
}

const QWEN2_VL: &str = r#"{"image_processor_type": "Qwen2VLImageProcessor",
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
    "merge_size": 2}"#;

fn image_plugin_with(limits: SandboxLimits) -> Arc<mmgate_host::LoadedPlugin> {
    common::builtin_plugin_with("image", limits)
}

fn image_plugin() -> Arc<mmgate_host::LoadedPlugin> {
    common::builtin_plugin("image")
}

fn media(data: Vec<u8>) -> Media {
    Media {
        data,
        mime_type: None,
    }
}

/// Probe, plan with room for any size, preprocess: a request's whole path. The probe must pass.
fn preprocess_qwen2_vl(
    plugin: &mmgate_host::LoadedPlugin,
    media: &Media,
) -> Result<Vec<mmgate_host::Tensor>, CallError> {
    let info = plugin.probe(media).unwrap();
    let budget = Budget {
        max_tokens: u32::MAX,
    };
    let plan = plugin.plan(&info, budget, QWEN2_VL)?;
    plugin.preprocess(media, &plan, QWEN2_VL)
}

/// The error of a call that must fail (a success would print megabytes of tensors in `unwrap_err`).
fn failure<T>(result: Result<T, CallError>, what: &str) -> CallError {
    match result {
        Ok(_) => panic!("{what}: expected an error"),
        Err(error) => error,
    }
}

#[test]
fn qwen2_vl_plan_and_tensors_agree() {
    let plugin = image_plugin();
    let media = Media {
        data: bmp(30, 20),
        mime_type: Some("image/bmp".into()),
    };
    let info = plugin.probe(&media).unwrap();
    assert_eq!((info.width, info.height), (Some(30), Some(20)));
    assert_eq!(info.format, "bmp");

    // 30x20 is below min_pixels: smart_resize scales up to 84x56 → (56/28)·(84/28) = 6 tokens.
    let plan = plugin
        .plan(&info, Budget { max_tokens: 1000 }, QWEN2_VL)
        .unwrap();
    assert_eq!(plan.tokens, 6);
    assert!(!plan.reduced);
    let tensors = plugin.preprocess(&media, &plan, QWEN2_VL).unwrap();
    let names: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "pixel_values",
            "pixel_values_table",
            "pixel_values_repeats",
            "image_grid_thw"
        ]
    );
    // The samples travel as u8 and become the encoder's floats through the table; each channel
    // run travels once and stands for HF's two temporal copies.
    let pixel_values = &tensors[0];
    assert_eq!(pixel_values.dtype, Dtype::U8);
    assert_eq!(pixel_values.shape, vec![24, 3 * 14 * 14]);
    // grid 1 x 4 x 6 patches of 3·2·14·14 values; tokens = patches / 4.
    let floats = mmgate_host::f32_values(&tensors, "pixel_values").unwrap();
    assert_eq!(floats.len(), 24 * 1176);
    assert!(floats.iter().all(|v| v.is_finite() && v.abs() < 3.0));
    let as_hf = mmgate_host::with_f32_values(&tensors).unwrap();
    assert_eq!(as_hf[0].shape, vec![24, 1176]);
    for row in floats.chunks_exact(1176) {
        for channel in row.chunks_exact(2 * 196) {
            assert_eq!(
                channel[..196],
                channel[196..],
                "the temporal copies are equal"
            );
        }
    }
    let grid = &tensors[3];
    assert_eq!(grid.name, "image_grid_thw");
    let thw: Vec<i64> = grid
        .data
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(thw, vec![1, 4, 6]);
    assert_eq!(thw.iter().product::<i64>() / 4, i64::from(plan.tokens));
}

#[test]
fn over_budget_says_what_the_smallest_size_needs() {
    let plugin = image_plugin();
    let media = Media {
        data: bmp(30, 20),
        mime_type: None,
    };
    let info = plugin.probe(&media).unwrap();
    let error = plugin
        .plan(&info, Budget { max_tokens: 2 }, QWEN2_VL)
        .unwrap_err();
    assert!(
        matches!(&error, CallError::Plugin(PluginError::OverBudget(o)) if o.needed_tokens == 6 && o.budget_tokens == 2),
        "{error:?}"
    );
}

fn bmp_header(width: u32, height: u32) -> Vec<u8> {
    let mut header = bmp(1, 1);
    header[18..22].copy_from_slice(&width.to_le_bytes());
    header[22..26].copy_from_slice(&height.to_le_bytes());
    header
}

#[test]
fn unknown_processor_types_are_unsupported() {
    let plugin = image_plugin();
    let media = Media {
        data: bmp(8, 8),
        mime_type: None,
    };
    let info = plugin.probe(&media).unwrap();
    let error = plugin
        .plan(
            &info,
            Budget { max_tokens: 100 },
            r#"{"image_processor_type": "MysteryProcessor"}"#,
        )
        .unwrap_err();
    assert!(
        matches!(&error, CallError::Plugin(PluginError::Unsupported(m)) if m.contains("MysteryProcessor")),
        "{error:?}"
    );
}

fn bad_image(name: &str) -> Media {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/image/bad")
        .join(name);
    media(std::fs::read(path).unwrap())
}

#[test]
fn hostile_image_files_get_typed_errors() {
    let plugin = image_plugin();
    type Expected = fn(&PluginError) -> bool;
    let refused_at_probe: [(Media, Expected); 5] = [
        (
            bad_image("empty.png"),
            |e| matches!(e, PluginError::InvalidMedia(m) if m.contains("empty")),
        ),
        (
            bad_image("text.png"),
            |e| matches!(e, PluginError::InvalidMedia(m) if m.contains("not an image")),
        ),
        (
            bad_image("header-30000x30000.png"),
            |e| matches!(e, PluginError::LimitExceeded(m) if m.contains("900000000 pixels")),
        ),
        // A BMP header claiming 20000 x 20000 pixels (400 MP): refused before any decoding.
        (media(bmp_header(20_000, 20_000)), |e| {
            matches!(e, PluginError::LimitExceeded(_))
        }),
        // 500:1 is past the aspect-ratio limit.
        (
            media(bmp_header(1000, 2)),
            |e| matches!(e, PluginError::LimitExceeded(m) if m.contains("aspect ratio")),
        ),
    ];
    for (item, expected) in refused_at_probe {
        match plugin.probe(&item) {
            Err(CallError::Plugin(e)) => assert!(expected(&e), "{e:?}"),
            other => panic!("expected a typed plugin error, got {other:?}"),
        }
    }

    // Headers intact, pixel data cut off: the probe passes, decoding refuses them. (For JPEG a
    // decoder alone would fill the missing part with grey; Pillow refuses it, and so does the plugin.)
    let mut truncated_bmp = bmp(64, 64);
    truncated_bmp.truncate(200);
    for (item, reason) in [
        (bad_image("truncated.jpg"), "truncated"),
        (media(truncated_bmp), "cannot decode"),
    ] {
        let error = failure(preprocess_qwen2_vl(&plugin, &item), reason);
        assert!(
            matches!(&error, CallError::Plugin(PluginError::InvalidMedia(m)) if m.contains(reason)),
            "{error:?}"
        );
    }
}

/// A 50 kB PNG that inflates to 48 MB of pixels, under a 64 MiB sandbox: the decode is stopped by the
/// memory cap (a typed error, nothing allocated past it) and the same plugin serves the next image.
#[test]
fn decompression_bombs_stop_at_the_memory_cap() {
    let plugin = image_plugin_with(SandboxLimits {
        memory_bytes: 64 << 20,
        ..SandboxLimits::default()
    });
    let bomb = bad_image("bomb-4000x4000.png");
    let info = plugin.probe(&bomb).unwrap();
    assert_eq!((info.width, info.height), (Some(4000), Some(4000)));
    let error = failure(preprocess_qwen2_vl(&plugin, &bomb), "the bomb");
    assert!(
        matches!(error, CallError::Memory { limit } if limit == 64 << 20),
        "{error:?}"
    );
    assert_eq!(
        preprocess_qwen2_vl(&plugin, &media(bmp(30, 20)))
            .unwrap()
            .len(),
        4
    );
}

/// `plan` trusts nothing in the media info it is handed: no or zero dimensions are a typed error,
/// not a trap.
#[test]
fn plan_refuses_media_info_without_dimensions() {
    let plugin = image_plugin();
    let mut info = plugin.probe(&media(bmp(8, 8))).unwrap();
    for (width, height) in [(None, Some(8)), (Some(0), Some(8)), (Some(8), Some(0))] {
        info.width = width;
        info.height = height;
        let error = plugin
            .plan(&info, Budget { max_tokens: 100 }, QWEN2_VL)
            .unwrap_err();
        assert!(
            matches!(&error, CallError::Plugin(PluginError::InvalidMedia(_))),
            "{width:?}x{height:?}: {error:?}"
        );
    }
}

/// JPEGs are decoded by the host (contract 0.3.1's `image.decode-jpeg`, libjpeg-turbo) under the
/// host's limits as well as the plugin's: a host that allows fewer pixels than a JPEG has refuses it
/// with its own limit (413), though the plugin's probe admitted it; other formats, and CMYK JPEGs,
/// which the host leaves to the plugin, are decoded in the sandbox as before.
#[test]
fn jpegs_are_decoded_by_the_host_within_its_limits() {
    let strict_host = image_plugin_with(SandboxLimits {
        image: mmgate_image_decode::Limits {
            max_pixels: 100 * 100,
            ..mmgate_image_decode::Limits::default()
        },
        ..SandboxLimits::default()
    });
    let fixture = |name: &str| {
        let path = common::fixtures_dir("image").join("images").join(name);
        media(std::fs::read(path).unwrap())
    };
    let photo = fixture("photo-640x480.jpg");
    let error = failure(preprocess_qwen2_vl(&strict_host, &photo), "the photo");
    assert!(
        matches!(&error, CallError::Plugin(PluginError::LimitExceeded(m)) if m.contains("over the limits")),
        "{error:?}"
    );
    assert!(preprocess_qwen2_vl(&strict_host, &fixture("jpeg-cmyk.jpg")).is_ok());
    assert!(preprocess_qwen2_vl(&strict_host, &media(bmp(300, 200))).is_ok());
    assert!(preprocess_qwen2_vl(&image_plugin(), &photo).is_ok());
}

/// A large image is made in bands of rows (contract 0.4's parts), each decoding only its rows (a
/// JPEG's through the host's `decode-jpeg-rows`): the bands' patches in order are the whole's,
/// byte for byte, their grids the whole's but for their heights, which add up; the table and the
/// temporal copies the same. At the planned size (no resize), enlarged and shrunk; a small image,
/// and one of another format (which each band would decode whole), is one part.
#[test]
fn a_large_image_in_bands_is_the_whole_byte_for_byte() {
    use libjpeg_turbo_rs::{Encoder, PixelFormat, Subsampling};
    let (width, height) = (3584, 2688);
    let pixels: Vec<u8> = (0..width * height)
        .flat_map(|i| {
            let (x, y) = (i % width, i / width);
            [
                (x * 7 % 256) as u8,
                (y * 5 % 256) as u8,
                ((x ^ y) % 256) as u8,
            ]
        })
        .collect();
    let jpeg = Encoder::new(&pixels, width, height, PixelFormat::Rgb)
        .quality(90)
        .subsampling(Subsampling::S420)
        .encode()
        .unwrap();
    let photo =
        std::fs::read(common::fixtures_dir("image").join("images/photo-640x480.jpg")).unwrap();
    let config = |min_pixels: usize| {
        QWEN2_VL.replace(
            r#""min_pixels": 3136"#,
            &format!(r#""min_pixels": {min_pixels}"#),
        )
    };
    let plugin = image_plugin();
    for (name, data, config, parts) in [
        (
            "a 3584x2688 JPEG at its own size",
            jpeg.clone(),
            config(3136),
            2,
        ),
        (
            "the 640x480 photo enlarged to 10 MP",
            photo.clone(),
            config(10_000_000),
            2,
        ),
        (
            "a 3584x2688 JPEG shrunk to 5 MP",
            jpeg,
            config(3136).replace("12845056", "5000000"),
            2,
        ),
        // Decoded whole for each band, so made whole.
        ("a 2800x2400 BMP", bmp(2800, 2400), config(3136), 1),
        ("the 640x480 photo", photo, config(3136), 1),
    ] {
        let media = media(data);
        let info = plugin.probe(&media).unwrap();
        let plan = plugin
            .plan(
                &info,
                Budget {
                    max_tokens: u32::MAX,
                },
                &config,
            )
            .unwrap();
        let whole = plugin.preprocess(&media, &plan, &config).unwrap();
        assert_eq!(plugin.parts(&plan, &config).unwrap(), parts, "{name}");
        let bands: Vec<Vec<mmgate_host::Tensor>> = (0..parts)
            .map(|i| plugin.preprocess_part(&media, &plan, &config, i).unwrap())
            .collect();
        let find = |tensors: &[mmgate_host::Tensor], n: &str| {
            tensors.iter().find(|t| t.name == n).unwrap().clone()
        };
        let grid = |t: mmgate_host::Tensor| mmgate_host::le_i64s(&t.data);
        let joined: Vec<u8> = bands
            .iter()
            .flat_map(|b| find(b, "pixel_values").data)
            .collect();
        assert!(
            joined == find(&whole, "pixel_values").data,
            "{name}: the bands' patches are not the whole's"
        );
        let whole_grid = grid(find(&whole, "image_grid_thw"));
        let heights: i64 = bands
            .iter()
            .map(|b| {
                let g = grid(find(b, "image_grid_thw"));
                assert_eq!((g[0], g[2]), (whole_grid[0], whole_grid[2]), "{name}");
                assert!(g[1] > 0 && g[1] % 2 == 0, "{name}: {g:?}");
                g[1]
            })
            .sum();
        assert_eq!(heights, whole_grid[1], "{name}");
        for band in &bands {
            for same in ["pixel_values_table", "pixel_values_repeats"] {
                let (a, b) = (find(band, same), find(&whole, same));
                assert!(
                    (a.dtype, &a.shape, &a.data) == (b.dtype, &b.shape, &b.data),
                    "{name}: {same}"
                );
            }
        }
    }
}
