//! Idefics3 and SmolVLM (served in front of an engine that runs them): an image split into a grid
//! of tiles beside a global view, each `image_seq_len` `<image>` tokens. As transformers'
//! `Idefics3Processor` and vLLM write it in place of the template's `<image>`: each tile as
//! `<fake_token_around_image><row_R_col_C>` and its tokens, a newline after each row, then a blank
//! line and the global view as `<fake_token_around_image><global-img>`, its tokens and
//! `<fake_token_around_image>`; an image that is not split is the global view alone. The grid is
//! the image plugin's plan (`tile_grid` in its choices).

use std::path::Path;
use std::sync::Arc;

use super::{
    Family, FamilyModel, ImagePrompt, PlannedItem, PromptPiece, UpstreamImageModel, WrittenImages,
    processor_count,
};
use crate::error::{Error, Result};
use crate::models::config::ConfigFile;

const FAKE_IMAGE_TOKEN: &str = "<fake_token_around_image>";
const GLOBAL_IMAGE_TAG: &str = "<global-img>";

pub(super) struct Idefics3Family;

impl Family for Idefics3Family {
    fn model_types(&self) -> &'static [&'static str] {
        &["idefics3", "smolvlm"]
    }

    /// A tile's tokens go into the processor config: the processor's `image_seq_len`, else the
    /// tower's patches of a tile shuffled by `scale_factor`.
    fn read(&self, dir: &Path) -> Result<Arc<dyn FamilyModel>> {
        let file = ConfigFile::read_of_types(dir, self.model_types())?;
        let smolvlm = file.model_type() == Some("smolvlm");
        let tokens_per_tile = match processor_count(dir, "image_seq_len")? {
            Some(n) => n,
            None => {
                let root = file.root();
                let (image, patch) = match root.sub("vision_config", "vision_config") {
                    Some(vision) => (
                        vision.usize_or(&["image_size"], Some(364))?,
                        vision.usize_or(&["patch_size"], Some(14))?,
                    ),
                    None => (364, 14),
                };
                let scale = root.usize_or(&["scale_factor"], Some(2))?;
                if patch == 0 || scale == 0 || image < patch * scale {
                    return Err(file.error(format!(
                        "a tile of {image} px in patches of {patch} px, shuffled by {scale}"
                    )));
                }
                (image / patch).pow(2) / scale.pow(2)
            }
        };
        let mut settings = serde_json::Map::new();
        settings.insert("image_seq_len".into(), tokens_per_tile.into());
        let image = UpstreamImageModel::read(
            &file,
            if smolvlm { 8192 } else { 10_240 },
            &["image_token_id"],
            if smolvlm { 49_190 } else { 128_257 },
            settings,
        )?;
        Ok(Arc::new(WrittenImages {
            model: image,
            prompt: Idefics3Prompt { tokens_per_tile },
        }))
    }
}

/// The tiles row by row, then the global view.
struct Idefics3Prompt {
    tokens_per_tile: usize,
}

impl ImagePrompt for Idefics3Prompt {
    fn write(&self, item: &PlannedItem, id: u32) -> Result<Vec<PromptPiece>> {
        let grid = match item.choices.get("tile_grid") {
            None => None,
            Some(value) => Some(serde_json::from_value::<[usize; 2]>(value.clone()).map_err(
                |_| {
                    Error::Input(format!(
                        "an image plan's tile grid {value} is not [rows, columns]"
                    ))
                },
            )?),
        };
        let views = grid.map_or(1, |[rows, columns]| rows * columns + 1);
        if item.tokens != views * self.tokens_per_tile {
            return Err(Error::Input(format!(
                "an image of {} tokens is not {views} views of {} tokens",
                item.tokens, self.tokens_per_tile
            )));
        }
        let view = PromptPiece::Tokens {
            id,
            count: self.tokens_per_tile,
        };
        let mut pieces = Vec::new();
        if let Some([rows, columns]) = grid {
            for row in 1..=rows {
                for column in 1..=columns {
                    pieces.push(PromptPiece::Text(format!(
                        "{FAKE_IMAGE_TOKEN}<row_{row}_col_{column}>"
                    )));
                    pieces.push(view.clone());
                }
                pieces.push(PromptPiece::Text("\n".into()));
            }
            pieces.push(PromptPiece::Text("\n".into()));
        }
        pieces.push(PromptPiece::Text(format!(
            "{FAKE_IMAGE_TOKEN}{GLOBAL_IMAGE_TAG}"
        )));
        pieces.push(view);
        pieces.push(PromptPiece::Text(FAKE_IMAGE_TOKEN.into()));
        Ok(pieces)
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
        let config = r#"{"model_type": "idefics3", "image_token_id": 7, "scale_factor": 2,
            "vision_config": {"image_size": 56, "patch_size": 14},
            "text_config": {"max_position_embeddings": 4096}}"#;
        std::fs::write(dir.path().join("config.json"), config).unwrap();
        let model = super::super::read(dir.path()).unwrap();
        assert_eq!(model.processor_settings()["image_seq_len"], 4);
        let item = PlannedItem {
            kind: MediaKind::Image,
            tokens: 3 * 4,
            choices: serde_json::json!({"tile_grid": [2, 1]}),
        };
        let pieces = model.item_prompt(&item).unwrap().unwrap();
        let text = |s: &str| PromptPiece::Text(s.into());
        let view = PromptPiece::Tokens { id: 7, count: 4 };
        assert_eq!(
            pieces,
            [
                text("<fake_token_around_image><row_1_col_1>"),
                view.clone(),
                text("\n"),
                text("<fake_token_around_image><row_2_col_1>"),
                view.clone(),
                text("\n"),
                text("\n"),
                text("<fake_token_around_image><global-img>"),
                view.clone(),
                text("<fake_token_around_image>"),
            ]
        );
        // Not split: the global view alone; a count that is not whole views is refused.
        let whole = PlannedItem::counted(MediaKind::Image, 4);
        assert_eq!(model.item_prompt(&whole).unwrap().unwrap().len(), 3);
        assert!(
            model
                .item_prompt(&PlannedItem::counted(MediaKind::Image, 8))
                .is_err()
        );
    }
}
