//! Mistral 3 (and Pixtral's vision in it; served in front of an engine that runs it): an image at
//! its own resolution, a row of `[IMG]` tokens per row of merged patches, each row ended by
//! `[IMG_BREAK]` and the last by `[IMG_END]`. The image plugin plans the size and counts all of
//! them (rows × (columns + 1)); the prompt holds them in place of the template's one `[IMG]`, and
//! no text around them merges with its neighbours (they are special tokens).

use std::path::Path;
use std::sync::Arc;

use super::{Family, FamilyModel, UpstreamImageModel};
use crate::error::Result;
use crate::models::config::ConfigFile;

pub(super) struct Mistral3Family;

impl Family for Mistral3Family {
    fn model_types(&self) -> &'static [&'static str] {
        &["mistral3"]
    }

    /// transformers' `PixtralProcessor` sizes images in tokens of `patch_size ×
    /// spatial_merge_size` pixels; the merge is the model's, which the processor config gets.
    fn read(&self, dir: &Path) -> Result<Arc<dyn FamilyModel>> {
        let file = ConfigFile::read_of_type(dir, "mistral3")?;
        let spatial_merge_size = file.root().usize_or(&["spatial_merge_size"], Some(2))?;
        if spatial_merge_size == 0 {
            return Err(file.error("spatial_merge_size must be positive".into()));
        }
        let mut settings = serde_json::Map::new();
        settings.insert("spatial_merge_size".into(), spatial_merge_size.into());
        let model = UpstreamImageModel::read(
            &file,
            131_072,
            &["image_token_index", "image_token_id"],
            10,
            settings,
        )?;
        Ok(Arc::new(model))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use crate::families::{MediaKind, PlannedItem};

    #[test]
    fn the_image_token_and_the_merge_come_from_the_config() {
        let dir = tempfile::tempdir().unwrap();
        let config = r#"{"model_type": "mistral3", "image_token_index": 10,
            "spatial_merge_size": 2, "text_config": {"max_position_embeddings": 2048}}"#;
        std::fs::write(dir.path().join("config.json"), config).unwrap();
        let model = super::super::read(dir.path()).unwrap();
        assert_eq!(model.context_length(), 2048);
        assert_eq!(model.placeholder(MediaKind::Image), Some(10));
        assert_eq!(model.placeholder(MediaKind::Audio), None);
        assert_eq!(model.processor_settings()["spatial_merge_size"], 2);
        assert!(
            model
                .item_prompt(&PlannedItem::counted(MediaKind::Image, 12))
                .unwrap()
                .is_none()
        );
    }
}
