//! A request's content parts as untyped JSON, for the routes that pass a request on rather than
//! parse it: the media parts found in the order chat processing takes them, what each carries, and
//! each replaced, dropped or kept as the route that served the model decided. The part types and
//! the media kinds they carry are written here once.

use serde_json::Value;

use super::ByteSource;
use mmgate_inference::families::MediaKind;

/// The part type (and its field) that carries a URL of each kind: OpenAI's `image_url`, vLLM's
/// `video_url` and `audio_url`.
const URL_PARTS: [(MediaKind, &str); 3] = [
    (MediaKind::Image, "image_url"),
    (MediaKind::Video, "video_url"),
    (MediaKind::Audio, "audio_url"),
];

/// The part type that carries a URL of `kind`.
pub fn url_part_type(kind: MediaKind) -> &'static str {
    URL_PARTS
        .iter()
        .find(|(k, _)| *k == kind)
        .map_or("image_url", |(_, name)| name)
}

/// A URL part of `kind` (`{"type": "image_url", "image_url": {"url": ...}}`).
pub fn url_part(kind: MediaKind, url: String) -> Value {
    let field = url_part_type(kind);
    serde_json::json!({"type": field, field: {"url": url}})
}

/// What a media part carries, as found in an untyped request.
#[derive(Debug, PartialEq)]
pub enum Carried {
    /// Its bytes are in the request already (base64, about `bytes` decoded).
    Inline { kind: MediaKind, bytes: usize },
    /// Embeddings (`image_embeds`): no media bytes.
    Embeddings,
    /// A URL or an upload: its bytes are elsewhere. An upload's kind is what its bytes are.
    Elsewhere {
        kind: Option<MediaKind>,
        source: ByteSource,
    },
}

/// What a part carries, if it is media this gateway knows.
pub fn carried(part: &Value) -> Option<Carried> {
    let name = part.get("type")?.as_str()?;
    let kind = match name {
        "input_audio" => {
            let data = part["input_audio"]["data"].as_str().unwrap_or_default();
            return Some(Carried::Inline {
                kind: MediaKind::Audio,
                bytes: data.len() / 4 * 3,
            });
        }
        "file" => {
            let file = &part["file"];
            let source = match (file["file_id"].as_str(), file["file_data"].as_str()) {
                (Some(id), None) => ByteSource::File(id.to_owned()),
                (None, Some(data)) => ByteSource::from_file_data(data),
                _ => return None, // the upstream's to judge, as a part this gateway does not know
            };
            // Its kind is what its bytes are, inline or uploaded.
            return Some(Carried::Elsewhere { kind: None, source });
        }
        "image_embeds" => return Some(Carried::Embeddings),
        // Text, and types this gateway does not know: the upstream's to judge.
        other => URL_PARTS.iter().find(|(_, n)| *n == other)?.0,
    };
    let value = &part[name];
    let url = value.as_str().or_else(|| value["url"].as_str())?;
    Some(match url.strip_prefix("data:") {
        Some(data) => Carried::Inline {
            kind,
            bytes: data.split_once(',').map_or(0, |(_, b64)| b64.len() / 4 * 3),
        },
        None => Carried::Elsewhere {
            kind: Some(kind),
            source: ByteSource::Url(url.to_owned()),
        },
    })
}

/// What becomes of one media part.
pub enum Rewrite {
    /// The part goes as this one instead (embeddings, media as planned).
    Replace(Value),
    /// The part leaves the request (the model's encode-error policy dropped it).
    Drop,
    /// The part goes as it came.
    Keep,
    /// The part goes as these parts (a document's pages).
    Many(Vec<Value>),
}

/// The request's media parts, in the order chat processing takes them.
pub fn media_parts(body: &Value) -> impl Iterator<Item = &Value> {
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

/// Replaces the body's media parts, in order, as `rewrites` say (parts past the end are kept).
pub fn rewrite(body: &mut Value, rewrites: Vec<Rewrite>) {
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
                Some(Rewrite::Replace(new)) => kept.push(new),
                Some(Rewrite::Many(new)) => kept.extend(new),
                Some(Rewrite::Drop) => {}
                Some(Rewrite::Keep) | None => kept.push(part),
            }
        }
        *parts = kept;
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn parts_say_where_their_bytes_are() {
        let found = |part: Value| carried(&part);
        assert!(matches!(
            found(json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}})),
            Some(Carried::Inline {
                kind: MediaKind::Image,
                bytes: 3
            })
        ));
        assert!(matches!(
            found(json!({"type": "video_url", "video_url": {"url": "http://h/v.mp4"}})),
            Some(Carried::Elsewhere { kind: Some(MediaKind::Video), source: ByteSource::Url(u) }) if u == "http://h/v.mp4"
        ));
        assert!(matches!(
            found(json!({"type": "image_url", "image_url": "https://h/a.png"})),
            Some(Carried::Elsewhere {
                kind: Some(MediaKind::Image),
                ..
            })
        ));
        assert!(matches!(
            found(json!({"type": "file", "file": {"file_id": "file-1"}})),
            Some(Carried::Elsewhere { kind: None, source: ByteSource::File(id) }) if id == "file-1"
        ));
        assert!(matches!(
            found(json!({"type": "file", "file": {"file_data": "data:image/png;base64,AAAA", "filename": "a.png"}})),
            Some(Carried::Elsewhere { kind: None, source: ByteSource::Base64 { data, .. } }) if data == "AAAA"
        ));
        assert!(matches!(
            found(json!({"type": "file", "file": {"file_data": "AAAA"}})),
            Some(Carried::Elsewhere {
                kind: None,
                source: ByteSource::Base64 {
                    mime_type: None,
                    ..
                }
            })
        ));
        assert!(matches!(
            found(
                json!({"type": "input_audio", "input_audio": {"data": "AAAAAAAA", "format": "wav"}})
            ),
            Some(Carried::Inline {
                kind: MediaKind::Audio,
                bytes: 6
            })
        ));
        assert!(matches!(
            found(json!({"type": "image_embeds", "image_embeds": "x"})),
            Some(Carried::Embeddings)
        ));
        assert!(found(json!({"type": "text", "text": "https://example.com"})).is_none());
        assert!(found(json!({"type": "future_part"})).is_none());
    }

    #[test]
    fn media_parts_are_rewritten_in_order_and_dropped_ones_leave() {
        let image = |n: u8| json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{n}")}});
        let mut body = json!({"model": "m", "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [image(1), {"type": "text", "text": "and"}, image(2)]},
            {"role": "user", "content": [image(3), image(4)]},
        ]});
        assert_eq!(media_parts(&body).count(), 4);
        rewrite(
            &mut body,
            vec![
                Rewrite::Drop,
                Rewrite::Replace(json!({"type": "x"})),
                Rewrite::Keep,
            ],
        );
        assert_eq!(body["messages"][0]["content"], "be brief");
        assert_eq!(
            body["messages"][1]["content"],
            json!([{"type": "text", "text": "and"}, {"type": "x"}])
        );
        assert_eq!(body["messages"][2]["content"], json!([image(3), image(4)]));
    }
}
