//! PaddleOCR-VL (served in front of an engine that runs it): Qwen2-VL's patches (14 px, merged 2×2,
//! one frame a temporal patch) sized by PaddleOCR's own first step and limits, which the image
//! plugin follows (`PaddleOCRVLImageProcessor`); an image is one run of `<|IMAGE_PLACEHOLDER|>`
//! in place of the one the chat template writes, as transformers' `PaddleOCRVLProcessor` and vLLM
//! expand it.

use std::path::Path;
use std::sync::Arc;

use super::{Family, FamilyModel, UpstreamImageModel};
use crate::error::Result;
use crate::models::config::ConfigFile;

pub(super) struct PaddleOcrVlFamily;

impl Family for PaddleOcrVlFamily {
    fn model_types(&self) -> &'static [&'static str] {
        &["paddleocr_vl"]
    }

    fn read(&self, dir: &Path) -> Result<Arc<dyn FamilyModel>> {
        let file = ConfigFile::read_of_type(dir, "paddleocr_vl")?;
        let model = UpstreamImageModel::read(
            &file,
            131_072,
            &["image_token_id"],
            100_295,
            serde_json::Map::new(),
        )?;
        Ok(Arc::new(model))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use crate::families::MediaKind;

    /// The Hub's token id and context (PaddlePaddle/PaddleOCR-VL's config.json keys).
    #[test]
    fn the_image_token_and_the_context_come_from_the_config() {
        let dir = tempfile::tempdir().unwrap();
        let config = r#"{"model_type": "paddleocr_vl", "image_token_id": 100295,
            "text_config": {"max_position_embeddings": 131072}}"#;
        std::fs::write(dir.path().join("config.json"), config).unwrap();
        let model = super::super::read(dir.path()).unwrap();
        assert_eq!(model.context_length(), 131_072);
        assert_eq!(model.placeholder(MediaKind::Image), Some(100_295));
        assert_eq!(model.media_kinds(), [MediaKind::Image]);
    }
}
