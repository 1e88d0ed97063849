//! LLaVA-1.5, LLaVA-NeXT and LLaVA-OneVision (served in front of an engine that runs them), which
//! share their tower's settings and their `<image>` run. LLaVA-1.5's image is one CLIP view, its
//! tokens the tower's patches (`CLIPImageProcessor`: a fixed count). LLaVA-NeXT's is fitted
//! into the best of the model's `image_grid_pinpoints` and tiled, its tokens one run of `<image>`
//! (the base view, the tiles without their padding, a newline token per row; OneVision pools the
//! tiles down to about nine views' worth); the image plugin plans and counts them ("anyres"), with
//! the vision tower's patch size, class token and feature strategy, which are the model's.
//! OneVision's videos are a run of `<video>` (each frame's pooled features and a newline), which
//! the video plugin plans and counts.

use std::path::Path;
use std::sync::Arc;

use super::{Family, FamilyModel, UpstreamImageModel};
use crate::error::Result;
use crate::models::config::ConfigFile;

pub(super) struct LlavaFamily;

impl Family for LlavaFamily {
    fn model_types(&self) -> &'static [&'static str] {
        &["llava", "llava_next", "llava_onevision"]
    }

    /// The tower's patch size, whether it has a class token (CLIP does, SigLIP not) and whether
    /// the features keep it, with which `LlavaProcessor`, `LlavaNextProcessor` and
    /// `LlavaOnevisionProcessor` count, go into the processor config.
    fn read(&self, dir: &Path) -> Result<Arc<dyn FamilyModel>> {
        let file = ConfigFile::read_of_types(dir, self.model_types())?;
        let onevision = file.model_type() == Some("llava_onevision");
        let root = file.root();
        let vision = root.sub("vision_config", "vision_config");
        let patch_size = match &vision {
            Some(vision) => vision.usize_or(&["patch_size"], Some(14))?,
            None => 14,
        };
        let tower = vision
            .as_ref()
            .and_then(|v| v.get("model_type"))
            .and_then(|v| v.as_str())
            .unwrap_or(if onevision {
                "siglip_vision_model"
            } else {
                "clip_vision_model"
            });
        let class_token = !tower.starts_with("siglip");
        let strategy = root
            .get("vision_feature_select_strategy")
            .and_then(|v| v.as_str())
            .unwrap_or(if onevision { "full" } else { "default" });
        let mut settings = serde_json::Map::new();
        settings.insert("patch_size".into(), patch_size.into());
        settings.insert("vision_feature_select_strategy".into(), strategy.into());
        settings.insert(
            "num_additional_image_tokens".into(),
            usize::from(class_token).into(),
        );
        let model = UpstreamImageModel::read(
            &file,
            if onevision { 32_768 } else { 4096 },
            &["image_token_index", "image_token_id"],
            if onevision { 151_646 } else { 32_000 },
            settings,
        )?;
        // OneVision takes videos: frames of the tower's size, pooled (the video plugin counts).
        let model = match onevision {
            true => model.with_videos(&file, &["video_token_index", "video_token_id"], 151_647)?,
            false => model,
        };
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
        assert_eq!(settings["num_additional_image_tokens"], 1);
        assert_eq!(model.placeholder(MediaKind::Video), None);
    }

    #[test]
    fn onevision_towers_are_siglip_and_keep_every_feature() {
        let dir = tempfile::tempdir().unwrap();
        let config = r#"{"model_type": "llava_onevision", "image_token_index": 5,
            "vision_config": {"model_type": "siglip_vision_model", "patch_size": 14}}"#;
        std::fs::write(dir.path().join("config.json"), config).unwrap();
        let model = super::super::read(dir.path()).unwrap();
        let settings = model.processor_settings();
        assert_eq!(settings["vision_feature_select_strategy"], "full");
        assert_eq!(settings["num_additional_image_tokens"], 0);
        assert_eq!(model.placeholder(MediaKind::Image), Some(5));
        assert_eq!(model.placeholder(MediaKind::Video), Some(151_647));
        assert_eq!(model.media_kinds(), [MediaKind::Image, MediaKind::Video]);
    }

    /// LLaVA-1.5 (`llava`): a CLIP tower whose class token the default strategy drops, Vicuna's
    /// context and `<image>` at 32000 unless the config says otherwise.
    #[test]
    fn llava_1_5_is_read_as_its_hub_checkpoints_say() {
        let dir = tempfile::tempdir().unwrap();
        let config = r#"{"model_type": "llava", "image_token_index": 32000,
            "vision_feature_select_strategy": "default",
            "vision_config": {"model_type": "clip_vision_model", "patch_size": 14},
            "text_config": {"model_type": "llama"}}"#;
        std::fs::write(dir.path().join("config.json"), config).unwrap();
        let model = super::super::read(dir.path()).unwrap();
        assert_eq!(model.placeholder(MediaKind::Image), Some(32_000));
        assert_eq!(model.context_length(), 4096);
        let settings = model.processor_settings();
        assert_eq!(settings["patch_size"], 14);
        assert_eq!(settings["vision_feature_select_strategy"], "default");
        assert_eq!(settings["num_additional_image_tokens"], 1);
        assert_eq!(model.media_kinds(), [MediaKind::Image]);
    }
}
