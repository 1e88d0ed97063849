//! A client's own processor settings (`processor_config` of `POST /v1/preprocess`) checked before
//! any plugin sees them. A plugin trusts its config as it trusts a checkpoint's: told to make every
//! image at least a billion pixels it tries, and the sandbox stops it with a trap that says nothing
//! of why. Here each size a processor takes is bounded by what any released checkpoint uses, with
//! room to spare, and a setting out of bounds is the client's error, named.

use serde_json::Value;

/// The most pixels a size setting may ask for: Qwen3-VL's video `size.longest_edge` (a pixel
/// count over a clip's frames, 24 Mi) is the largest a released processor config sets.
const MAX_PIXELS: f64 = (1u64 << 25) as f64;

/// Bounds of the numeric settings processors read, by key (wherever the key stands: processors
/// nest them in `size`, `video_preprocessor_config`, ...): the smallest and largest value, and
/// whether it must be a whole number.
const BOUNDS: &[(&str, f64, f64, bool)] = &[
    ("min_pixels", 1.0, MAX_PIXELS, true),
    ("max_pixels", 1.0, MAX_PIXELS, true),
    ("shortest_edge", 1.0, MAX_PIXELS, true),
    ("longest_edge", 1.0, MAX_PIXELS, true),
    ("height", 1.0, 16384.0, true),
    ("width", 1.0, 16384.0, true),
    ("image_size", 1.0, 16384.0, true),
    ("patch_size", 1.0, 1024.0, true),
    ("merge_size", 1.0, 64.0, true),
    ("spatial_merge_size", 1.0, 64.0, true),
    ("temporal_patch_size", 1.0, 64.0, true),
    ("min_patches", 1.0, 1024.0, true),
    ("max_patches", 1.0, 1024.0, true),
    ("max_image_tiles", 1.0, 1024.0, true),
    ("min_frames", 1.0, 16384.0, true),
    ("max_frames", 1.0, 16384.0, true),
    ("num_frames", 1.0, 16384.0, true),
    ("fps", 0.001, 1000.0, false),
    ("sampling_rate", 1000.0, 384_000.0, true),
    ("n_fft", 16.0, 65536.0, true),
    ("hop_length", 1.0, 65536.0, true),
    ("feature_size", 1.0, 1024.0, true),
    ("chunk_length", 1.0, 3600.0, true),
];

/// The deepest a setting may be nested (configs nest two levels: `video_preprocessor_config.size`).
const MAX_DEPTH: usize = 4;

/// Why a client's settings are refused: the setting (a dotted path) and what it must be.
#[derive(Debug, PartialEq, thiserror::Error)]
#[error("processor_config.{path} {why}")]
pub struct InvalidSetting {
    pub path: String,
    pub why: String,
}

/// Checks a client's processor config: an object whose size settings are within [`BOUNDS`], each
/// `min_pixels` at most its `max_pixels`.
pub fn check(config: &Value) -> Result<(), InvalidSetting> {
    if !config.is_object() {
        return Err(InvalidSetting {
            path: String::new(),
            why: "must be an object (a preprocessor_config.json)".into(),
        });
    }
    check_level(config, "", 0)
}

fn check_level(value: &Value, path: &str, depth: usize) -> Result<(), InvalidSetting> {
    let Some(object) = value.as_object() else {
        return Ok(());
    };
    let at = |key: &str| {
        if path.is_empty() {
            key.to_owned()
        } else {
            format!("{path}.{key}")
        }
    };
    if depth > MAX_DEPTH {
        return Err(InvalidSetting {
            path: path.to_owned(),
            why: format!("is nested more than {MAX_DEPTH} levels deep"),
        });
    }
    for (key, value) in object {
        if let Some(&(_, min, max, whole)) = BOUNDS.iter().find(|(name, ..)| name == key) {
            check_number(value, min, max, whole)
                .map_err(|why| InvalidSetting { path: at(key), why })?;
        } else if value.is_object() {
            check_level(value, &at(key), depth + 1)?;
        }
    }
    let pixels = |key| object.get(key).and_then(Value::as_f64);
    if let (Some(min), Some(max)) = (pixels("min_pixels"), pixels("max_pixels"))
        && min > max
    {
        return Err(InvalidSetting {
            path: at("min_pixels"),
            why: format!("is {min}, more than max_pixels ({max})"),
        });
    }
    Ok(())
}

/// `null` is a setting left unset; anything else must be a number within the bounds.
fn check_number(value: &Value, min: f64, max: f64, whole: bool) -> Result<(), String> {
    if value.is_null() {
        return Ok(());
    }
    let kind = if whole { "an integer" } else { "a number" };
    let Some(number) = value.as_f64() else {
        return Err(format!("is {value}; it must be {kind} from {min} to {max}"));
    };
    if !(min..=max).contains(&number) || (whole && number.fract() != 0.0) {
        return Err(format!("is {value}; it must be {kind} from {min} to {max}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn released_configs_pass() {
        for config in [
            json!({"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "merge_size": 2,
                   "temporal_patch_size": 2, "image_processor_type": "Qwen2VLImageProcessor"}),
            json!({"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
                   "video_preprocessor_config": {"fps": 2.0, "size": {"longest_edge": 25165824}}}),
            json!({"size": {"height": 896, "width": 896}, "image_mean": [0.5, 0.5, 0.5]}),
            json!({"feature_size": 128, "sampling_rate": 16000, "n_fft": 400, "hop_length": 160,
                   "chunk_length": 30, "max_pixels": null}),
        ] {
            assert_eq!(check(&config), Ok(()), "{config}");
        }
    }

    #[test]
    fn out_of_bounds_settings_are_named() {
        let refused = |config: Value| check(&config).err().map(|e| e.to_string());
        let message = refused(json!({"min_pixels": 1e9, "max_pixels": 2e9})).unwrap_or_default();
        assert!(
            message.starts_with("processor_config.min_pixels is"),
            "{message}"
        );
        let message = refused(json!({"video_preprocessor_config": {"size": {"longest_edge": -1}}}))
            .unwrap_or_default();
        assert!(
            message.starts_with("processor_config.video_preprocessor_config.size.longest_edge"),
            "{message}"
        );
        for bad in [
            json!({"patch_size": 0}),
            json!({"patch_size": 14.5}),
            json!({"merge_size": "2"}),
            json!({"min_pixels": 4000, "max_pixels": 3000}),
            json!({"fps": 0}),
            json!([1, 2]),
            json!({"a": {"b": {"c": {"d": {"e": {"f": {}}}}}}}),
        ] {
            assert!(refused(bad.clone()).is_some(), "{bad}");
        }
    }
}
