//! Llama 4 (served in front of an engine that runs it): an image is tiles of the tower's patches
//! pixel-shuffled, and a global view when there is more than one tile. As transformers'
//! `Llama4Processor` and vLLM write it in place of the template's `<|image|>`: `<|image_start|>`,
//! each row of tiles as their `<|patch|>` runs joined by `<|tile_x_separator|>` and ended by
//! `<|tile_y_separator|>`, then `<|image|>` and the global view's run, `<|image_end|>`; one tile is
//! `<|image_start|><|image|>`, its run, `<|image_end|>`. The grid is the image plugin's plan
//! (`tile_grid` in its choices).

use std::path::Path;
use std::sync::Arc;

use super::{
    Family, FamilyModel, ImagePrompt, PlannedItem, PromptPiece, UpstreamImageModel, WrittenImages,
};
use crate::error::{Error, Result};
use crate::models::config::ConfigFile;

pub(super) struct Llama4Family;

impl Family for Llama4Family {
    fn model_types(&self) -> &'static [&'static str] {
        &["llama4"]
    }

    /// The tower's patch size and pixel shuffle, with which the processor counts a tile's
    /// tokens, go into the processor config.
    fn read(&self, dir: &Path) -> Result<Arc<dyn FamilyModel>> {
        let file = ConfigFile::read_of_type(dir, "llama4")?;
        let root = file.root();
        let (patch, shuffle) = match root.sub("vision_config", "vision_config") {
            Some(vision) => (
                vision.usize_or(&["patch_size"], Some(14))?,
                vision.f32_or("pixel_shuffle_ratio", 0.5)?,
            ),
            None => (14, 0.5),
        };
        let mut settings = serde_json::Map::new();
        settings.insert("patch_size".into(), patch.into());
        settings.insert("pixel_shuffle_ratio".into(), f64::from(shuffle).into());
        let image = UpstreamImageModel::read(
            &file,
            10_485_760,
            &["image_token_index", "image_token_id"],
            200_092,
            settings,
        )?;
        Ok(Arc::new(WrittenImages {
            model: image,
            prompt: Llama4Prompt,
        }))
    }
}

/// The canvas's tiles row by row, then the global view.
struct Llama4Prompt;

impl ImagePrompt for Llama4Prompt {
    fn write(&self, item: &PlannedItem, _image_token: u32) -> Result<Vec<PromptPiece>> {
        let grid = item.choices.get("tile_grid").cloned().unwrap_or_default();
        let Ok([rows, columns]) = serde_json::from_value::<[usize; 2]>(grid.clone()) else {
            return Err(Error::Input(format!(
                "a Llama 4 image plan's tile grid {grid} is not [rows, columns]"
            )));
        };
        let tiles = rows * columns;
        let views = if tiles > 1 { tiles + 1 } else { 1 };
        if item.tokens == 0 || !item.tokens.is_multiple_of(views) {
            return Err(Error::Input(format!(
                "an image of {} tokens is not {views} views",
                item.tokens
            )));
        }
        // `<|patch|>` is spelled as text: it is not the placeholder the template writes.
        let run = "<|patch|>".repeat(item.tokens / views);
        let mut text = String::from("<|image_start|>");
        if tiles > 1 {
            for _ in 0..rows {
                let row = vec![run.as_str(); columns];
                text.push_str(&row.join("<|tile_x_separator|>"));
                text.push_str("<|tile_y_separator|>");
            }
        }
        text.push_str("<|image|>");
        text.push_str(&run);
        text.push_str("<|image_end|>");
        Ok(vec![PromptPiece::Text(text)])
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::families::MediaKind;

    #[test]
    fn tiles_are_spelled_row_by_row_before_the_global_view() {
        let dir = tempfile::tempdir().unwrap();
        let config = r#"{"model_type": "llama4", "image_token_index": 9,
            "vision_config": {"patch_size": 14, "pixel_shuffle_ratio": 0.5},
            "text_config": {"max_position_embeddings": 4096}}"#;
        std::fs::write(dir.path().join("config.json"), config).unwrap();
        let model = super::super::read(dir.path()).unwrap();
        assert_eq!(model.processor_settings()["pixel_shuffle_ratio"], 0.5);
        let item = PlannedItem {
            kind: MediaKind::Image,
            tokens: 3 * 2,
            choices: serde_json::json!({"tile_grid": [1, 2]}),
        };
        let pieces = model.item_prompt(&item).unwrap().unwrap();
        let p = "<|patch|><|patch|>";
        assert_eq!(
            pieces,
            [PromptPiece::Text(format!(
                "<|image_start|>{p}<|tile_x_separator|>{p}<|tile_y_separator|><|image|>{p}<|image_end|>"
            ))]
        );
        let one = PlannedItem {
            kind: MediaKind::Image,
            tokens: 2,
            choices: serde_json::json!({"tile_grid": [1, 1]}),
        };
        assert_eq!(
            model.item_prompt(&one).unwrap().unwrap(),
            [PromptPiece::Text(format!(
                "<|image_start|><|image|>{p}<|image_end|>"
            ))]
        );
        assert!(
            model
                .item_prompt(&PlannedItem::counted(MediaKind::Image, 2))
                .is_err()
        );
    }
}
