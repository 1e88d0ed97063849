//! Media sent upstream as embeddings: a request's images are encoded here and its media parts
//! become vLLM's `image_embeds` parts (base64 `torch.save` files of the embeddings and of the grid),
//! so the upstream engine spends nothing on preprocessing or the vision encoder.

use base64::Engine as _;
use mmgate_host::{Dtype, Tensor};
use mmgate_inference::rope::Grid;
use serde_json::{Value, json};

use crate::torchfile::{self, TorchFileError};

/// What becomes of the request's media parts, in the order they appear.
pub enum Rewrite {
    /// Encoded: the embeddings (`[tokens, hidden]`) and the grid that places them.
    Embeddings {
        features: std::sync::Arc<Vec<f32>>,
        hidden: usize,
        grid: Grid,
    },
    /// Dropped by the model's encode-error policy: the part leaves the request.
    Drop,
}

/// Whether the request is encoded here: it has media and all of them are images (image URLs,
/// uploads, or embeddings already). Video and audio have no embeddings form upstream engines take,
/// so a request holding any goes upstream as it came and the upstream processes all its media.
pub fn encode_here(body: &Value) -> bool {
    let mut any = false;
    for part in media_parts(body) {
        match part.get("type").and_then(Value::as_str) {
            Some("image_url" | "file" | "image_embeds") => any = true,
            _ => return false,
        }
    }
    any
}

/// The request's media parts, in the order chat processing takes them.
fn media_parts(body: &Value) -> impl Iterator<Item = &Value> {
    body.get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|m| m.get("content").and_then(Value::as_array))
        .flatten()
        .filter(|part| is_media(part))
}

/// Every part but text is media (parts of unknown types never get this far: parsing the request
/// refused them).
fn is_media(part: &Value) -> bool {
    part.get("type")
        .and_then(Value::as_str)
        .is_some_and(|t| t != "text")
}

/// Replaces the body's media parts, in order, as `rewrites` say.
pub fn rewrite(body: &mut Value, rewrites: Vec<Rewrite>) -> Result<(), TorchFileError> {
    let mut rewrites = rewrites.into_iter();
    let messages = body
        .get_mut("messages")
        .and_then(Value::as_array_mut)
        .into_iter()
        .flatten();
    for message in messages {
        let Some(parts) = message.get_mut("content").and_then(Value::as_array_mut) else {
            continue;
        };
        let mut kept = Vec::with_capacity(parts.len());
        for part in parts.drain(..) {
            if !is_media(&part) {
                kept.push(part);
                continue;
            }
            match rewrites.next() {
                Some(Rewrite::Embeddings {
                    features,
                    hidden,
                    grid,
                }) => kept.push(embeds_part(&features, hidden, grid)?),
                Some(Rewrite::Drop) => {}
                None => kept.push(part),
            }
        }
        *parts = kept;
    }
    Ok(())
}

/// An `image_embeds` part as vLLM's OpenAI server takes it for Qwen2-VL.
fn embeds_part(features: &[f32], hidden: usize, grid: Grid) -> Result<Value, TorchFileError> {
    let b64 = |t: &Tensor| {
        torchfile::write(t).map(|f| base64::engine::general_purpose::STANDARD.encode(f))
    };
    let tokens = features.len() / hidden.max(1);
    let embeddings = Tensor {
        name: "image_embeds".into(),
        dtype: Dtype::F32,
        shape: vec![tokens as u64, hidden as u64],
        data: features.iter().flat_map(|v| v.to_le_bytes()).collect(),
    };
    let thw = Tensor {
        name: "image_grid_thw".into(),
        dtype: Dtype::I64,
        shape: vec![3],
        data: [grid.t, grid.h, grid.w]
            .iter()
            .flat_map(|&d| (d as i64).to_le_bytes())
            .collect(),
    };
    Ok(json!({
        "type": "image_embeds",
        "image_embeds": {
            "image_embeds": b64(&embeddings)?,
            "image_grid_thw": b64(&thw)?,
        },
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_image_requests_are_encoded_here() {
        let with =
            |parts: Value| json!({"model": "m", "messages": [{"role": "user", "content": parts}]});
        let text = json!({"type": "text", "text": "hi"});
        let image =
            json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,aGk="}});
        let video = json!({"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}});
        assert!(!encode_here(&with(json!([text]))));
        assert!(!encode_here(
            &json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        ));
        assert!(encode_here(&with(json!([text, image]))));
        assert!(!encode_here(&with(json!([image, video]))));
    }

    #[test]
    fn media_parts_become_embeds_in_order_and_dropped_ones_leave() {
        let image = |n: u8| json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{n}")}});
        let mut body = json!({"model": "m", "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [image(1), {"type": "text", "text": "and"}, image(2)]},
        ]});
        let grid = Grid { t: 1, h: 2, w: 2 };
        let features = std::sync::Arc::new(vec![0.5f32; 8]);
        rewrite(
            &mut body,
            vec![
                Rewrite::Drop,
                Rewrite::Embeddings {
                    features,
                    hidden: 8,
                    grid,
                },
            ],
        )
        .unwrap();
        let parts = body["messages"][1]["content"].as_array().unwrap();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0]["type"], "text");
        assert_eq!(parts[1]["type"], "image_embeds");
        let read = |field: &str| {
            let b64 = parts[1]["image_embeds"][field].as_str().unwrap();
            let file = base64::engine::general_purpose::STANDARD
                .decode(b64)
                .unwrap();
            torchfile::read(&file, field, 1 << 20).unwrap()
        };
        let embeds = read("image_embeds");
        assert_eq!((embeds.dtype, embeds.shape), (Dtype::F32, vec![1, 8]));
        let thw = read("image_grid_thw");
        assert_eq!(thw.shape, vec![3]);
        assert_eq!(body["messages"][0]["content"], "be brief");
    }
}
