//! InternVL 2.5 / 3 as transformers ships them (`InternVLForConditionalGeneration`, served in front
//! of an engine that runs it): an image is tiles of `image_seq_length` `<IMG_CONTEXT>` tokens each
//! (the image plugin plans how many), written between `<img>` and `</img>` in place of the chat
//! template's one `<IMG_CONTEXT>`, as `InternVLProcessor` and vLLM write it.

use std::path::Path;
use std::sync::Arc;

use super::{
    Family, FamilyModel, ImagePrompt, PlannedItem, PromptPiece, UpstreamImageModel, WrittenImages,
    json_file, processor_count,
};
use crate::error::Result;
use crate::models::config::ConfigFile;

pub(super) struct InternVlFamily;

impl Family for InternVlFamily {
    fn model_types(&self) -> &'static [&'static str] {
        &["internvl"]
    }

    /// The tokens a tile makes go into the processor config: `InternVLProcessor` takes them from
    /// `processor_config.json`, else the tower's patches of a tile, pixel-shuffled.
    fn read(&self, dir: &Path) -> Result<Arc<dyn FamilyModel>> {
        let file = ConfigFile::read_of_type(dir, "internvl")?;
        let tokens_per_tile = match processor_count(dir, "image_seq_length")? {
            Some(n) => n,
            None => tower_tokens_per_tile(&file)?,
        };
        let mut settings = serde_json::Map::new();
        settings.insert("image_seq_length".into(), tokens_per_tile.into());
        let image = UpstreamImageModel::read(
            &file,
            32_768,
            &["image_token_id", "image_token_index"],
            151_667,
            settings,
        )?;
        let specials = tokenizer_specials(dir)?;
        let special = |key: &str, default: &str| {
            specials
                .as_ref()
                .and_then(|s| s.get(key))
                .and_then(|v| v.as_str())
                .unwrap_or(default)
                .to_owned()
        };
        Ok(Arc::new(WrittenImages {
            model: image,
            prompt: InternVlPrompt {
                start_image: special("start_image_token", "<img>"),
                end_image: special("end_image_token", "</img>"),
            },
        }))
    }
}

/// `(image_size / patch_size)² · downsample_ratio²`, as InternVL's configs define a tile's tokens.
fn tower_tokens_per_tile(file: &ConfigFile) -> Result<usize> {
    let root = file.root();
    let side = |key: &str, default: usize| -> Result<usize> {
        let Some(vision) = root.sub("vision_config", "vision_config") else {
            return Ok(default);
        };
        match vision.get(key) {
            Some(serde_json::Value::Array(sides)) => sides
                .first()
                .and_then(|v| v.as_u64())
                .map(|n| n as usize)
                .ok_or_else(|| file.error(format!("vision_config.{key} is not a size"))),
            _ => vision.usize_or(&[key], Some(default)),
        }
    };
    let (image, patch) = (side("image_size", 448)?, side("patch_size", 14)?);
    let ratio = root.f32_or("downsample_ratio", 0.5)?;
    if patch == 0 || image < patch || !(ratio > 0.0 && ratio <= 1.0) {
        return Err(file.error(format!(
            "vision_config: a tile of {image} px in patches of {patch} px, downsampled by {ratio}"
        )));
    }
    let patches = (image / patch) as f64;
    Ok(((patches * f64::from(ratio)).powi(2)) as usize)
}

/// `tokenizer_config.json`'s `extra_special_tokens`, where transformers 5 keeps the image tokens'
/// names.
fn tokenizer_specials(dir: &Path) -> Result<Option<serde_json::Value>> {
    Ok(json_file(dir, "tokenizer_config.json")?
        .and_then(|mut v| v.get_mut("extra_special_tokens").map(|v| v.take())))
}

/// `<img>`, the tiles' tokens, `</img>`.
struct InternVlPrompt {
    start_image: String,
    end_image: String,
}

impl ImagePrompt for InternVlPrompt {
    fn write(&self, item: &PlannedItem, image_token: u32) -> Result<Vec<PromptPiece>> {
        Ok(vec![
            PromptPiece::Text(self.start_image.clone()),
            PromptPiece::Tokens {
                id: image_token,
                count: item.tokens,
            },
            PromptPiece::Text(self.end_image.clone()),
        ])
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::families::MediaKind;

    fn write(dir: &Path, name: &str, text: &str) {
        std::fs::write(dir.join(name), text).unwrap();
    }

    #[test]
    fn tokens_a_tile_come_from_the_processor_else_the_tower() {
        let dir = tempfile::tempdir().unwrap();
        let config = r#"{"model_type": "internvl", "image_token_id": 9, "downsample_ratio": 0.5,
            "vision_config": {"image_size": [56, 56], "patch_size": [14, 14]},
            "text_config": {"max_position_embeddings": 4096}}"#;
        write(dir.path(), "config.json", config);
        let model = super::super::read(dir.path()).unwrap();
        assert_eq!(model.context_length(), 4096);
        assert_eq!(model.placeholder(MediaKind::Image), Some(9));
        assert_eq!(model.processor_settings()["image_seq_length"], 4);
        let prompt = model
            .item_prompt(&PlannedItem::counted(MediaKind::Image, 8))
            .unwrap()
            .unwrap();
        assert_eq!(
            prompt,
            [
                PromptPiece::Text("<img>".into()),
                PromptPiece::Tokens { id: 9, count: 8 },
                PromptPiece::Text("</img>".into()),
            ]
        );
        write(
            dir.path(),
            "processor_config.json",
            r#"{"image_seq_length": 64}"#,
        );
        write(
            dir.path(),
            "tokenizer_config.json",
            r#"{"extra_special_tokens": {"start_image_token": "<s_img>"}}"#,
        );
        let model = super::super::read(dir.path()).unwrap();
        assert_eq!(model.processor_settings()["image_seq_length"], 64);
        let prompt = model
            .item_prompt(&PlannedItem::counted(MediaKind::Image, 1))
            .unwrap()
            .unwrap();
        assert_eq!(prompt[0], PromptPiece::Text("<s_img>".into()));
        write(
            dir.path(),
            "processor_config.json",
            r#"{"image_seq_length": 0}"#,
        );
        assert!(super::super::read(dir.path()).is_err());
    }
}
