//! LLaVA-NeXT (served in front of an engine that runs it): an image fitted into the best of the
//! model's `image_grid_pinpoints` and tiled, its tokens one run of `<image>` (the base view, the
//! tiles without their padding, a newline token per row); the image plugin plans and counts them
//! ("anyres"), with the vision tower's patch size and feature strategy, which are the model's.

use std::path::Path;
use std::sync::Arc;

use super::{Family, FamilyModel, UpstreamImageModel};
use crate::error::Result;
use crate::models::config::ConfigFile;

pub(super) struct LlavaNextFamily;

impl Family for LlavaNextFamily {
    fn model_types(&self) -> &'static [&'static str] {
        &["llava_next"]
    }

    /// The tower's patch size and whether the base view keeps its class token, with which
    /// `LlavaNextProcessor` counts, go into the processor config.
    fn read(&self, dir: &Path) -> Result<Arc<dyn FamilyModel>> {
        let file = ConfigFile::read_of_type(dir, "llava_next")?;
        let root = file.root();
        let patch_size = match root.sub("vision_config", "vision_config") {
            Some(vision) => vision.usize_or(&["patch_size"], Some(14))?,
            None => 14,
        };
        let strategy = root
            .get("vision_feature_select_strategy")
            .and_then(|v| v.as_str())
            .unwrap_or("default");
        let mut settings = serde_json::Map::new();
        settings.insert("patch_size".into(), patch_size.into());
        settings.insert("vision_feature_select_strategy".into(), strategy.into());
        let model = UpstreamImageModel::read(
            &file,
            4096,
            &["image_token_index", "image_token_id"],
            32_000,
            settings,
        )?;
        Ok(Arc::new(model))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use crate::families::MediaKind;

    #[test]
    fn the_tower_settings_reach_the_processor_config() {
        let dir = tempfile::tempdir().unwrap();
        let config = r#"{"model_type": "llava_next", "image_token_index": 7,
            "vision_feature_select_strategy": "full", "vision_config": {"patch_size": 16},
            "text_config": {"max_position_embeddings": 8192}}"#;
        std::fs::write(dir.path().join("config.json"), config).unwrap();
        let model = super::super::read(dir.path()).unwrap();
        assert_eq!(model.context_length(), 8192);
        assert_eq!(model.placeholder(MediaKind::Image), Some(7));
        let settings = model.processor_settings();
        assert_eq!(settings["patch_size"], 16);
        assert_eq!(settings["vision_feature_select_strategy"], "full");
    }
}
