//! A model directory's `generation_config.json`: the ids that end a generation and the sampling
//! defaults its authors chose. Engines apply both (transformers always; vLLM with its default
//! `--generation-config auto`), so a gateway serving the same checkpoint must too: a Qwen2-VL
//! checkpoint lists `<|endoftext|>` and `<|im_end|>` there, and one that stopped at only one of them
//! would run on where the engine stops.

use std::path::Path;

use serde_json::Value;

use super::config::Section;
use crate::error::{Error, Result};

/// What `generation_config.json` says; everything empty when the file is absent.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationConfig {
    /// Every id that ends a generation (`eos_token_id`: one id or a list).
    pub eos_token_ids: Vec<u32>,
    /// `do_sample`: `false` means greedy unless the request asks otherwise.
    pub do_sample: Option<bool>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
}

impl GenerationConfig {
    /// Reads `dir/generation_config.json`; a missing file is no defaults, a malformed one an error.
    pub fn read(dir: &Path) -> Result<GenerationConfig> {
        let path = dir.join("generation_config.json");
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(GenerationConfig::default());
            }
            Err(e) => {
                return Err(Error::Config {
                    path,
                    reason: e.to_string(),
                });
            }
        };
        let value: Value = serde_json::from_str(&text).map_err(|e| Error::Config {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        let root = Section {
            path: &path,
            name: "",
            value: &value,
        };
        let number = |key: &str| -> Result<Option<f64>> {
            match root.get(key) {
                None => Ok(None),
                Some(v) => v
                    .as_f64()
                    .map(Some)
                    .ok_or_else(|| root.err(format!("{key} must be a number"))),
            }
        };
        let do_sample = match root.get("do_sample") {
            None => None,
            Some(v) => Some(
                v.as_bool()
                    .ok_or_else(|| root.err("do_sample must be true or false".into()))?,
            ),
        };
        let top_k = number("top_k")?
            .map(|k| {
                if k >= 0.0 && k.fract() == 0.0 {
                    Ok(k as usize)
                } else {
                    Err(root.err("top_k must be a whole number".into()))
                }
            })
            .transpose()?;
        Ok(GenerationConfig {
            eos_token_ids: root.token_ids("eos_token_id")?,
            do_sample,
            temperature: number("temperature")?.map(|t| t as f32),
            top_p: number("top_p")?.map(|p| p as f32),
            top_k,
        })
    }

    /// The temperature a request that names none gets: greedy when the checkpoint does not sample,
    /// else its own temperature, else `fallback`.
    pub fn default_temperature(&self, fallback: f32) -> f32 {
        if self.do_sample == Some(false) {
            0.0
        } else {
            self.temperature.unwrap_or(fallback)
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn read(json: &str) -> Result<GenerationConfig> {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("generation_config.json"), json).unwrap();
        GenerationConfig::read(dir.path())
    }

    #[test]
    fn every_eos_id_and_the_sampling_defaults_are_read() {
        let config = read(
            r#"{"bos_token_id": 1, "eos_token_id": [2, 0], "do_sample": true, "temperature": 0.01,
                "top_p": 0.001, "top_k": 1, "transformers_version": "4.57.1"}"#,
        )
        .unwrap();
        assert_eq!(config.eos_token_ids, [2, 0]);
        assert_eq!(
            (config.temperature, config.top_p, config.top_k),
            (Some(0.01), Some(0.001), Some(1))
        );
        assert_eq!(config.default_temperature(1.0), 0.01);
        assert_eq!(read(r#"{"eos_token_id": 7}"#).unwrap().eos_token_ids, [7]);
        let greedy = read(r#"{"do_sample": false, "temperature": 0.7}"#).unwrap();
        assert_eq!(greedy.default_temperature(1.0), 0.0);
        assert_eq!(read("{}").unwrap().default_temperature(1.0), 1.0);
    }

    #[test]
    fn a_missing_file_is_no_defaults_and_a_malformed_one_an_error() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            GenerationConfig::read(dir.path()).unwrap(),
            GenerationConfig::default()
        );
        for bad in [
            "{",
            r#"{"eos_token_id": "x"}"#,
            r#"{"top_k": 1.5}"#,
            r#"{"do_sample": 1}"#,
        ] {
            assert!(read(bad).is_err(), "{bad}");
        }
    }
}
