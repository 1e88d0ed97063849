//! Media planned here for a model whose server runs its own processor (`media = "preprocess"`),
//! in the wire form that server reads as the item the plan chose:
//! - an image: an `image_url` data URL of the file (the original bytes, or a PNG at its planned
//!   size);
//! - audio: an `input_audio` part, a 16 kHz mono WAV (OpenAI's form; vLLM and transformers' server
//!   take it);
//! - a video: a `video_url` data URL of type `video/jpeg` whose data is the chosen frames' base64,
//!   comma-separated: vLLM's form for a video given as its frames (its `VideoMediaIO` loads each
//!   with PIL, which reads the PNGs whatever the declared type), so it samples nothing more.

use base64::Engine as _;
use mmgate_host::{Media, ReducedItem};
use serde_json::{Value, json};

use crate::media::sniff::sniff_mime_type;
use mmgate_inference::families::MediaKind;

/// The part that carries `item` (a `kind` item reduced to files) upstream; `None` when the files
/// are not what that kind goes as (an image or audio item is one file).
pub fn part(kind: MediaKind, item: &ReducedItem) -> Option<Value> {
    let b64 = |file: &Media| base64::engine::general_purpose::STANDARD.encode(&file.data);
    Some(match (kind, &item.files[..]) {
        (MediaKind::Image, [file]) => {
            let mime = file
                .mime_type
                .as_deref()
                .or_else(|| sniff_mime_type(&file.data))
                .unwrap_or("application/octet-stream");
            json!({"type": "image_url", "image_url": {"url": format!("data:{mime};base64,{}", b64(file))}})
        }
        (MediaKind::Audio, [file]) => {
            json!({"type": "input_audio", "input_audio": {"data": b64(file), "format": "wav"}})
        }
        (MediaKind::Video, frames @ [_, ..]) => {
            let frames: Vec<String> = frames.iter().map(b64).collect();
            json!({"type": "video_url", "video_url": {"url": format!("data:video/jpeg;base64,{}", frames.join(","))}})
        }
        _ => return None,
    })
}

/// `choices`, a `kind` item's plan, as the server reads it back from [`part`]: vLLM takes a video
/// sent as its frames as frames 0, 1, 2, … at one a second (its default when it is not told the
/// source's rate; telling it per request needs `--trust-request-mm-kwargs`), and a family that
/// writes each temporal patch's time into the prompt (Qwen3-VL) writes those. The count follows
/// what the server will write; `media = "ec"` sends the true times.
pub fn choices_as_read(kind: MediaKind, mut choices: Value) -> Value {
    if kind != MediaKind::Video {
        return choices;
    }
    if let Some(frames) = choices.get("frame_indices").and_then(Value::as_array) {
        let numbered: Vec<Value> = (0..frames.len() as u64).map(Value::from).collect();
        choices["frame_indices"] = numbered.into();
        choices["source_fps_bits"] = 1f64.to_bits().into();
    }
    choices
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn file(data: &[u8], mime: &str) -> Media {
        Media {
            data: data.to_vec(),
            mime_type: Some(mime.into()),
        }
    }

    #[test]
    fn each_kind_goes_in_the_form_its_servers_read() {
        let one = |f: Media| ReducedItem {
            files: vec![f],
            timestamps: vec![0.0],
        };
        let image = part(MediaKind::Image, &one(file(b"png!", "image/png"))).unwrap();
        assert_eq!(image["image_url"]["url"], "data:image/png;base64,cG5nIQ==");
        let audio = part(MediaKind::Audio, &one(file(b"RIFF", "audio/wav"))).unwrap();
        assert_eq!(audio["type"], "input_audio");
        assert_eq!(audio["input_audio"]["format"], "wav");
        let frames = ReducedItem {
            files: vec![file(b"a", "image/png"), file(b"b", "image/png")],
            timestamps: vec![0.0, 0.5],
        };
        let video = part(MediaKind::Video, &frames).unwrap();
        assert_eq!(
            video["video_url"]["url"],
            "data:video/jpeg;base64,YQ==,Yg=="
        );
        // A video's frames are read as numbered at one a second, whatever the source's rate.
        let choices = json!({"frame_indices": [0, 15, 30, 45], "source_fps_bits": 30f64.to_bits(),
                             "width": 64});
        assert_eq!(
            choices_as_read(MediaKind::Video, choices.clone()),
            json!({"frame_indices": [0, 1, 2, 3], "source_fps_bits": 1f64.to_bits(), "width": 64})
        );
        assert_eq!(choices_as_read(MediaKind::Image, choices.clone()), choices);
        // An image or an audio clip is one file: two are not sent as anything.
        assert!(part(MediaKind::Image, &frames).is_none());
        assert!(part(MediaKind::Audio, &frames).is_none());
    }
}
