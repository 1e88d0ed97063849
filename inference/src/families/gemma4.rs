//! Gemma 4 (served in front of an engine that runs it): each image is resized, aspect kept, to
//! `max_soft_tokens` pooled cells or fewer (the image plugin's `Gemma4ImageProcessor`), and its
//! soft tokens stand between `<|image>` and `<image|>` in place of the `<|image|>` the chat
//! template writes, as transformers' `Gemma4Processor` and vLLM's `gemma4_mm` expand it.
//!
//! vLLM counts with the vision tower's `default_output_length` unless the request's processor
//! kwargs say otherwise; it goes into the processor config as `max_soft_tokens`, with the tower's
//! patch and pooling sizes, so the plan counts as the engine does.

use std::path::Path;
use std::sync::Arc;

use super::{
    Family, FamilyModel, ImagePrompt, PlannedItem, PromptPiece, UpstreamImageModel, WrittenImages,
};
use crate::error::Result;
use crate::models::config::{ConfigFile, Section};

pub(super) struct Gemma4Family;

impl Family for Gemma4Family {
    fn model_types(&self) -> &'static [&'static str] {
        &["gemma4"]
    }

    fn read(&self, dir: &Path) -> Result<Arc<dyn FamilyModel>> {
        let file = ConfigFile::read_of_type(dir, "gemma4")?;
        let root = file.root();
        let mut settings = serde_json::Map::new();
        if let Some(vision) = root.sub("vision_config", "vision_config") {
            for (from, to) in [
                ("default_output_length", "max_soft_tokens"),
                ("patch_size", "patch_size"),
                ("pooling_kernel_size", "pooling_kernel_size"),
            ] {
                if let Some(value) = vision.get(from) {
                    settings.insert(to.into(), value.clone());
                }
            }
        }
        let prompt = Gemma4Prompt {
            start_of_image: token(&root, "boi_token_id", 255_999)?,
            end_of_image: token(&root, "eoi_token_id", 258_882)?,
        };
        let model =
            UpstreamImageModel::read(&file, 131_072, &["image_token_id"], 258_880, settings)?;
        Ok(Arc::new(WrittenImages { model, prompt }))
    }
}

fn token(root: &Section<'_>, key: &str, default: usize) -> Result<u32> {
    let id = root.usize_or(&[key], Some(default))?;
    u32::try_from(id).map_err(|_| root.err(format!("{key} {id} is not a token id")))
}

/// An image's soft tokens between its begin and end tokens.
struct Gemma4Prompt {
    start_of_image: u32,
    end_of_image: u32,
}

impl ImagePrompt for Gemma4Prompt {
    fn write(&self, item: &PlannedItem, image_token: u32) -> Result<Vec<PromptPiece>> {
        Ok(vec![
            PromptPiece::Tokens {
                id: self.start_of_image,
                count: 1,
            },
            PromptPiece::Tokens {
                id: image_token,
                count: item.tokens,
            },
            PromptPiece::Tokens {
                id: self.end_of_image,
                count: 1,
            },
        ])
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use crate::families::{MediaKind, PlannedItem, PromptPiece};

    /// The Hub's token ids and the tower's settings (google/gemma-4-*'s config.json keys).
    #[test]
    fn the_tower_settings_reach_the_processor_config_and_images_are_set_off() {
        let dir = tempfile::tempdir().unwrap();
        let config = r#"{"model_type": "gemma4", "boi_token_id": 255999, "eoi_token_id": 258882,
            "image_token_id": 258880, "text_config": {"max_position_embeddings": 131072},
            "vision_config": {"default_output_length": 280, "patch_size": 16,
                "pooling_kernel_size": 3}}"#;
        std::fs::write(dir.path().join("config.json"), config).unwrap();
        let model = super::super::read(dir.path()).unwrap();
        assert_eq!(model.placeholder(MediaKind::Image), Some(258_880));
        assert_eq!(model.context_length(), 131_072);
        let settings = model.processor_settings();
        assert_eq!(settings["max_soft_tokens"], 280);
        assert_eq!(settings["pooling_kernel_size"], 3);
        let pieces = model
            .item_prompt(&PlannedItem::counted(MediaKind::Image, 266))
            .unwrap()
            .unwrap();
        let ids: Vec<(u32, usize)> = pieces
            .iter()
            .map(|p| match p {
                PromptPiece::Tokens { id, count } => (*id, *count),
                PromptPiece::Text(_) => panic!("no text around a Gemma 4 image"),
            })
            .collect();
        assert_eq!(ids, [(255_999, 1), (258_880, 266), (258_882, 1)]);
    }
}
