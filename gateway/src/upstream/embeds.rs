//! Media sent upstream as embeddings: a request's images are encoded here and its media parts
//! become vLLM's `image_embeds` parts (base64 `torch.save` files of the embeddings and of the grid),
//! so the upstream engine spends nothing on preprocessing or the vision encoder.

use base64::Engine as _;
use mmgate_host::{Dtype, Tensor};
use mmgate_inference::rope::Grid;
use serde_json::{Value, json};

use crate::wire::openai::parts;
use crate::wire::torchfile::{self, TorchFileError};
use mmgate_inference::families::MediaKind;

/// Whether the request is encoded here: it has media and all of them are images (image URLs,
/// uploads, or embeddings already). Video and audio have no embeddings form upstream engines take,
/// so a request holding any goes upstream as it came and the upstream processes all its media.
pub fn encode_here(body: &Value) -> bool {
    let mut any = false;
    for part in parts::media_parts(body) {
        match part.get("type").and_then(Value::as_str) {
            Some("file" | "image_embeds") => any = true,
            Some(name) if name == parts::url_part_type(MediaKind::Image) => any = true,
            _ => return false,
        }
    }
    any
}

/// An `image_embeds` part as vLLM's OpenAI server takes it for Qwen2-VL: the embeddings
/// (`[tokens, hidden]`) and the grid that places them.
pub fn part(features: &[f32], hidden: usize, grid: Grid) -> Result<Value, TorchFileError> {
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
    #![allow(clippy::unwrap_used)]

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
    fn an_embeds_part_carries_the_embeddings_and_their_grid_as_torch_files() {
        let part = part(&[0.5f32; 8], 8, Grid { t: 1, h: 2, w: 2 }).unwrap();
        assert_eq!(part["type"], "image_embeds");
        let read = |field: &str| {
            let b64 = part["image_embeds"][field].as_str().unwrap();
            let file = base64::engine::general_purpose::STANDARD
                .decode(b64)
                .unwrap();
            torchfile::read(&file, field, 1 << 20).unwrap()
        };
        let embeds = read("image_embeds");
        assert_eq!((embeds.dtype, embeds.shape), (Dtype::F32, vec![1, 8]));
        assert_eq!(read("image_grid_thw").shape, vec![3]);
    }
}
