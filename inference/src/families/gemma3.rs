//! Gemma 3 (served in front of an engine that runs it): each image is a view of
//! `mm_tokens_per_image` soft tokens between `<start_of_image>` and `<end_of_image>`, set off by
//! blank lines. With pan-and-scan (the engine's `do_pan_and_scan`) an image is its whole view and
//! then its crops, introduced by a sentence of the processor's; the image plugin plans how many
//! views (its tokens are `mm_tokens_per_image` per view).
//!
//! As transformers' `Gemma3Processor` writes a prompt (and vLLM's `gemma3_mm` after it), the chat
//! template's `<start_of_image>` becomes the item's text, and the prompt is tokenized whole: the
//! blank lines merge with the newlines around them.

use std::path::Path;
use std::sync::Arc;

use super::{Family, FamilyModel, MediaKind, PlannedItem, PromptPiece, upstream_context};
use crate::error::{Error, Result};
use crate::models::config::{ConfigFile, Section};

pub(super) struct Gemma3Family;

impl Family for Gemma3Family {
    fn model_types(&self) -> &'static [&'static str] {
        &["gemma3"]
    }

    fn read(&self, dir: &Path) -> Result<Arc<dyn FamilyModel>> {
        let file = ConfigFile::read_of_type(dir, "gemma3")?;
        let root = file.root();
        let context = upstream_context(&file, 131_072)?;
        let model = Gemma3Model {
            context,
            start_of_image: token(&root, "boi_token_index", 255_999)?,
            end_of_image: token(&root, "eoi_token_index", 256_000)?,
            soft_token: token(&root, "image_token_index", 262_144)?,
            tokens_per_view: root.usize_or(&["mm_tokens_per_image"], Some(256))?,
        };
        if model.tokens_per_view == 0 {
            return Err(file.error("mm_tokens_per_image must be positive".into()));
        }
        Ok(Arc::new(model))
    }
}

fn token(root: &Section<'_>, key: &str, default: usize) -> Result<u32> {
    let id = root.usize_or(&[key], Some(default))?;
    u32::try_from(id).map_err(|_| root.err(format!("{key} {id} is not a token id")))
}

struct Gemma3Model {
    context: usize,
    start_of_image: u32,
    end_of_image: u32,
    soft_token: u32,
    tokens_per_view: usize,
}

impl Gemma3Model {
    /// One view: `\n\n<start_of_image>`, its soft tokens, `<end_of_image>\n\n`.
    fn view(&self, pieces: &mut Vec<PromptPiece>) {
        pieces.push(PromptPiece::Text("\n\n".into()));
        pieces.push(PromptPiece::Tokens {
            id: self.start_of_image,
            count: 1,
        });
        pieces.push(PromptPiece::Tokens {
            id: self.soft_token,
            count: self.tokens_per_view,
        });
        pieces.push(PromptPiece::Tokens {
            id: self.end_of_image,
            count: 1,
        });
        pieces.push(PromptPiece::Text("\n\n".into()));
    }
}

impl FamilyModel for Gemma3Model {
    fn context_length(&self) -> usize {
        self.context
    }

    fn media_kinds(&self) -> &'static [MediaKind] {
        &[MediaKind::Image]
    }

    fn placeholder(&self, kind: MediaKind) -> Option<u32> {
        (kind == MediaKind::Image).then_some(self.start_of_image)
    }

    /// One view for an image made whole; with pan-and-scan crops, transformers' sentence: "Here
    /// is the original image <view> and here are some crops to help you see better <view> <view>…".
    fn item_prompt(&self, item: &PlannedItem) -> Result<Option<Vec<PromptPiece>>> {
        if item.kind != MediaKind::Image {
            return Ok(None);
        }
        let tokens = item.tokens;
        if tokens == 0 || !tokens.is_multiple_of(self.tokens_per_view) {
            return Err(Error::Input(format!(
                "an image of {tokens} tokens is not whole views of {} tokens",
                self.tokens_per_view
            )));
        }
        let crops = tokens / self.tokens_per_view - 1;
        let mut pieces = Vec::new();
        if crops == 0 {
            self.view(&mut pieces);
            return Ok(Some(pieces));
        }
        pieces.push(PromptPiece::Text("Here is the original image ".into()));
        self.view(&mut pieces);
        pieces.push(PromptPiece::Text(
            " and here are some crops to help you see better ".into(),
        ));
        for crop in 0..crops {
            if crop > 0 {
                pieces.push(PromptPiece::Text(" ".into()));
            }
            self.view(&mut pieces);
        }
        Ok(Some(pieces))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn model() -> Arc<dyn FamilyModel> {
        let dir = tempfile::tempdir().unwrap();
        let config = r#"{"model_type": "gemma3", "boi_token_index": 6, "eoi_token_index": 7,
            "image_token_index": 8, "mm_tokens_per_image": 16,
            "text_config": {"max_position_embeddings": 4096}}"#;
        std::fs::write(dir.path().join("config.json"), config).unwrap();
        super::super::read(dir.path()).unwrap()
    }

    fn view() -> Vec<PromptPiece> {
        vec![
            PromptPiece::Text("\n\n".into()),
            PromptPiece::Tokens { id: 6, count: 1 },
            PromptPiece::Tokens { id: 8, count: 16 },
            PromptPiece::Tokens { id: 7, count: 1 },
            PromptPiece::Text("\n\n".into()),
        ]
    }

    /// An image is its views as transformers' `Gemma3Processor` writes them: one, or the whole
    /// image and its pan-and-scan crops in the processor's sentence.
    #[test]
    fn an_image_is_written_as_its_views() {
        let gemma = model();
        assert_eq!(gemma.context_length(), 4096);
        assert_eq!(gemma.placeholder(MediaKind::Image), Some(6));
        assert_eq!(gemma.placeholder(MediaKind::Video), None);
        assert!(gemma.native().is_none());
        let one = gemma
            .item_prompt(&PlannedItem::counted(MediaKind::Image, 16))
            .unwrap()
            .unwrap();
        assert_eq!(one, view());
        let three = gemma
            .item_prompt(&PlannedItem::counted(MediaKind::Image, 48))
            .unwrap()
            .unwrap();
        let mut expected = vec![PromptPiece::Text("Here is the original image ".into())];
        expected.extend(view());
        expected.push(PromptPiece::Text(
            " and here are some crops to help you see better ".into(),
        ));
        expected.extend(view());
        expected.push(PromptPiece::Text(" ".into()));
        expected.extend(view());
        assert_eq!(three, expected);
        assert!(
            gemma
                .item_prompt(&PlannedItem::counted(MediaKind::Image, 17))
                .is_err()
        );
        assert!(
            gemma
                .item_prompt(&PlannedItem::counted(MediaKind::Image, 0))
                .is_err()
        );
    }
}
