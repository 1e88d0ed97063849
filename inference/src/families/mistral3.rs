//! Mistral 3 (and Pixtral's vision in it; served in front of an engine that runs it): an image at
//! its own resolution, a row of `[IMG]` tokens per row of merged patches, each row ended by
//! `[IMG_BREAK]` and the last by `[IMG_END]`. The image plugin plans the size and counts all of
//! them (rows × (columns + 1)); the prompt holds them in place of the template's one `[IMG]`, and
//! no text around them merges with its neighbours (they are special tokens).

use std::path::Path;
use std::sync::Arc;

use super::{Family, FamilyModel, MediaKind, upstream_context};
use crate::error::Result;
use crate::models::config::ConfigFile;

pub(super) struct Mistral3Family;

impl Family for Mistral3Family {
    fn model_types(&self) -> &'static [&'static str] {
        &["mistral3"]
    }

    fn read(&self, dir: &Path) -> Result<Arc<dyn FamilyModel>> {
        let file = ConfigFile::read_of_type(dir, "mistral3")?;
        let root = file.root();
        let context = upstream_context(&file, 131_072)?;
        let image_token = root.usize_or(&["image_token_index", "image_token_id"], Some(10))?;
        let spatial_merge_size = root.usize_or(&["spatial_merge_size"], Some(2))?;
        if spatial_merge_size == 0 {
            return Err(file.error("spatial_merge_size must be positive".into()));
        }
        Ok(Arc::new(Mistral3Model {
            context,
            image_token: u32::try_from(image_token).map_err(|_| {
                file.error(format!("image_token_index {image_token} is not a token id"))
            })?,
            spatial_merge_size,
        }))
    }
}

struct Mistral3Model {
    context: usize,
    image_token: u32,
    spatial_merge_size: usize,
}

impl FamilyModel for Mistral3Model {
    fn context_length(&self) -> usize {
        self.context
    }

    fn media_kinds(&self) -> &'static [MediaKind] {
        &[MediaKind::Image]
    }

    fn placeholder(&self, kind: MediaKind) -> Option<u32> {
        (kind == MediaKind::Image).then_some(self.image_token)
    }

    /// transformers' `PixtralProcessor` sizes images in tokens of `patch_size ×
    /// spatial_merge_size` pixels; the merge is the model's.
    fn processor_settings(&self) -> serde_json::Map<String, serde_json::Value> {
        let mut settings = serde_json::Map::new();
        settings.insert("spatial_merge_size".into(), self.spatial_merge_size.into());
        settings
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

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
        assert!(model.item_prompt(MediaKind::Image, 12).unwrap().is_none());
    }
}
