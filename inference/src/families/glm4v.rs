//! GLM-4.1V (served in front of an engine that runs it): Qwen2-VL's patches (14 px, merged 2×2)
//! sized by GLM's own rule, which the image plugin follows (`Glm4vImageProcessor`); an image is one
//! run of `<|image|>` between the `<|begin_of_image|>` and `<|end_of_image|>` the chat template
//! writes around its one `<|image|>`, as transformers' `Glm4vProcessor` and vLLM expand it.
//! GLM-4.5V (`glm4v_moe`) has the same tower, processor and prompts before a mixture of experts.

use std::path::Path;
use std::sync::Arc;

use super::{Family, FamilyModel, UpstreamImageModel};
use crate::error::Result;
use crate::models::config::ConfigFile;

pub(super) struct Glm4vFamily;

impl Family for Glm4vFamily {
    fn model_types(&self) -> &'static [&'static str] {
        &["glm4v", "glm4v_moe"]
    }

    fn read(&self, dir: &Path) -> Result<Arc<dyn FamilyModel>> {
        let file = ConfigFile::read_of_types(dir, self.model_types())?;
        let model = UpstreamImageModel::read(
            &file,
            65_536,
            &["image_token_id"],
            151_343,
            serde_json::Map::new(),
        )?;
        Ok(Arc::new(model))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use crate::families::{MediaKind, PlannedItem};

    #[test]
    fn the_image_token_and_the_context_come_from_the_config() {
        let dir = tempfile::tempdir().unwrap();
        let config = r#"{"model_type": "glm4v", "image_token_id": 12,
            "text_config": {"max_position_embeddings": 4096}}"#;
        std::fs::write(dir.path().join("config.json"), config).unwrap();
        let model = super::super::read(dir.path()).unwrap();
        assert_eq!(model.context_length(), 4096);
        assert_eq!(model.placeholder(MediaKind::Image), Some(12));
        assert_eq!(model.placeholder(MediaKind::Video), None);
        assert!(
            model
                .item_prompt(&PlannedItem::counted(MediaKind::Image, 6))
                .unwrap()
                .is_none()
        );
    }

    /// GLM-4.5V's config (`glm4v_moe`, the Hub's keys) is read the same way.
    #[test]
    fn glm4v_moe_is_read_as_glm4v() {
        let dir = tempfile::tempdir().unwrap();
        let config = r#"{"model_type": "glm4v_moe", "image_token_id": 151363,
            "text_config": {"model_type": "glm4v_moe_text", "max_position_embeddings": 65536,
                "n_routed_experts": 128, "use_qk_norm": false}}"#;
        std::fs::write(dir.path().join("config.json"), config).unwrap();
        let model = super::super::read(dir.path()).unwrap();
        assert_eq!(model.context_length(), 65_536);
        assert_eq!(model.placeholder(MediaKind::Image), Some(151_363));
    }
}
