//! The OpenAI chat completions wire format: what a request may hold, and the JSON of replies and
//! stream chunks. Parsing only; what a request means is decided in [`crate::prepare::gather`].

use serde::Deserialize;
use serde_json::{Value, json};

use mmgate_inference::families::MediaKind;

pub mod parts;
pub mod responses;
pub mod shape;

/// The fields the native core uses (`model` and `user` are read when routing).
#[derive(Debug, Deserialize)]
pub struct ChatCompletionRequest {
    pub messages: Vec<Message>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// `max_completion_tokens` is the newer name of `max_tokens`.
    #[serde(default, alias = "max_completion_tokens")]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    /// vLLM's extension; 0 or -1 is off.
    #[serde(default)]
    pub top_k: Option<i64>,
    /// Signed, as OpenAI takes it.
    #[serde(default)]
    pub seed: Option<i64>,
    #[serde(default)]
    pub stop: Option<OneOrMany>,
    #[serde(default)]
    pub n: Option<u32>,
}

/// The roles a message may have, as OpenAI's API takes them.
const ROLES: [&str; 6] = [
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "function",
];

/// The `input_audio.format`s taken: OpenAI's (`wav`, `mp3`) and the other containers the audio
/// plugin decodes.
pub const INPUT_AUDIO_FORMATS: [&str; 8] =
    ["wav", "mp3", "flac", "ogg", "opus", "m4a", "aac", "webm"];

/// A request that is well formed JSON but not a valid chat completion request: the field at
/// fault (OpenAI's `param`) and why.
#[derive(Debug, PartialEq)]
pub struct Invalid {
    pub param: &'static str,
    pub message: String,
}

impl ChatCompletionRequest {
    /// Checks what OpenAI's API checks before a request is served: each message's role, that the
    /// roles which need content have it, that media parts stand only in user messages,
    /// `input_audio`'s format, and `stream_options` only with `stream`.
    pub fn check(&self) -> Result<(), Invalid> {
        let invalid = |param, message: String| Err(Invalid { param, message });
        if self.stream_options.is_some() && !self.stream {
            return invalid(
                "stream_options",
                "stream_options is only allowed when stream is true".into(),
            );
        }
        for (i, message) in self.messages.iter().enumerate() {
            let role = message.role.as_str();
            if !ROLES.contains(&role) {
                return invalid(
                    "messages",
                    format!(
                        "messages[{i}].role is {role:?}; it must be one of {}",
                        ROLES.join(", ")
                    ),
                );
            }
            let Some(content) = &message.content else {
                if matches!(role, "assistant" | "function") {
                    continue;
                }
                return invalid(
                    "messages",
                    format!("messages[{i}]: a {role} message needs content"),
                );
            };
            let Content::Parts(parts) = content else {
                continue;
            };
            for (j, part) in parts.iter().enumerate() {
                if role != "user" && !matches!(part, Part::Text { .. }) {
                    return invalid(
                        "messages",
                        format!(
                            "messages[{i}].content[{j}] is a {} part; a {role} message holds only text parts",
                            part.type_name()
                        ),
                    );
                }
                if let Part::File { file } = part
                    && file.source().is_none()
                {
                    return invalid(
                        "messages",
                        format!(
                            "messages[{i}].content[{j}].file needs one of file_id (an upload) and file_data (its bytes, base64)"
                        ),
                    );
                }
                if let Part::InputAudio { input_audio } = part {
                    let format = input_audio.format.as_deref().unwrap_or_default();
                    if !INPUT_AUDIO_FORMATS.contains(&format.to_ascii_lowercase().as_str()) {
                        return invalid(
                            "messages",
                            format!(
                                "messages[{i}].content[{j}].input_audio.format is {format:?}; it must be one of {}",
                                INPUT_AUDIO_FORMATS.join(", ")
                            ),
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// The seed as the samplers take it: a signed seed's bits, so each seed is its own.
    pub fn sampling_seed(&self) -> Option<u64> {
        self.seed.map(|s| u64::from_ne_bytes(s.to_ne_bytes()))
    }
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Self::One(s) => vec![s],
            Self::Many(v) => v,
        }
    }
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
}

#[derive(Debug)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

/// The UTF-8 bytes of a chat request's text (every message's text, and its text parts), read
/// without copying any of it: what shows a body too large in text before it is parsed in full.
pub fn text_bytes(body: &[u8]) -> Result<usize, serde_json::Error> {
    use std::borrow::Cow;

    #[derive(Deserialize)]
    struct Body<'a> {
        #[serde(borrow, default)]
        messages: Vec<TextOf<'a>>,
    }
    #[derive(Deserialize)]
    struct TextOf<'a> {
        #[serde(borrow, default)]
        content: Option<Texts<'a>>,
    }
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Texts<'a> {
        Text(#[serde(borrow)] Cow<'a, str>),
        Parts(#[serde(borrow)] Vec<PartText<'a>>),
    }
    #[derive(Deserialize)]
    struct PartText<'a> {
        #[serde(borrow, default)]
        text: Option<Cow<'a, str>>,
    }

    let body: Body = serde_json::from_slice(body)?;
    Ok(body
        .messages
        .iter()
        .filter_map(|m| m.content.as_ref())
        .map(|content| match content {
            Texts::Text(text) => text.len(),
            Texts::Parts(parts) => parts
                .iter()
                .filter_map(|p| p.text.as_ref())
                .map(|t| t.len())
                .sum(),
        })
        .sum())
}

impl Message {
    /// The message's text, part by part.
    pub fn texts(&self) -> impl Iterator<Item = &str> {
        let (whole, parts) = match &self.content {
            Some(Content::Text(text)) => (Some(text.as_str()), &[][..]),
            Some(Content::Parts(parts)) => (None, parts.as_slice()),
            None => (None, &[][..]),
        };
        whole
            .into_iter()
            .chain(parts.iter().filter_map(|part| match part {
                Part::Text { text } => Some(text.as_str()),
                _ => None,
            }))
    }
}

/// By hand rather than `untagged`, so that a bad part is named in the error ("content part 2:
/// unknown variant `hologram`") instead of "did not match any variant".
impl<'de> Deserialize<'de> for Content {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        match Value::deserialize(deserializer)? {
            Value::String(text) => Ok(Content::Text(text)),
            Value::Array(parts) => parts
                .into_iter()
                .enumerate()
                .map(|(i, part)| {
                    Part::deserialize(part)
                        .map_err(|e| D::Error::custom(format!("content part {i}: {e}")))
                })
                .collect::<Result<_, _>>()
                .map(Content::Parts),
            _ => Err(D::Error::custom(
                "content must be a string or a list of parts",
            )),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Part {
    Text {
        text: String,
    },
    ImageUrl {
        image_url: UrlRef,
    },
    /// vLLM's extension.
    VideoUrl {
        video_url: UrlRef,
    },
    /// vLLM's extension.
    AudioUrl {
        audio_url: UrlRef,
    },
    InputAudio {
        input_audio: InputAudio,
    },
    File {
        file: FileRef,
    },
    /// vLLM's extension (its `--enable-mm-embeds`): what the model's own vision encoder made of an
    /// image, as another mmgate in front (or a client) sends it.
    ImageEmbeds {
        image_embeds: ImageEmbeds,
    },
}

/// An `image_embeds` part's payload: base64 of `torch.save` files.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum ImageEmbeds {
    /// The embeddings alone, `[tokens, hidden]`.
    Tensor(String),
    /// The embeddings and what the model needs besides: Qwen2-VL places them by their grid, `(3,)`
    /// integers `t, h, w` in patches.
    Fields {
        image_embeds: String,
        #[serde(default)]
        image_grid_thw: Option<String>,
    },
}

#[derive(Debug, Deserialize)]
pub struct UrlRef {
    pub url: String,
    /// OpenAI's `auto` / `low` / `high`; accepted, and the budget decides the size.
    #[serde(default)]
    #[allow(dead_code)]
    pub detail: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct InputAudio {
    /// Base64 audio bytes (not a data URL).
    pub data: String,
    /// `wav`, `mp3`, ...
    #[serde(default)]
    pub format: Option<String>,
}

/// A `file` part's file: an upload of `/v1/files` (`file_id`), or its bytes inline (`file_data`, a
/// base64 data URL or bare base64, as OpenAI's SDK sends them); either way, what it is is told by
/// its bytes.
#[derive(Debug, Deserialize)]
pub struct FileRef {
    #[serde(default)]
    pub file_id: Option<String>,
    #[serde(default)]
    pub file_data: Option<String>,
    /// Accepted; a name says nothing trusted of what the bytes are.
    #[serde(default)]
    #[allow(dead_code)]
    pub filename: Option<String>,
}

impl FileRef {
    /// Where its bytes are: `None` unless exactly one of `file_id` and `file_data` is given.
    pub fn source(&self) -> Option<ByteSource> {
        match (&self.file_id, &self.file_data) {
            (Some(id), None) => Some(ByteSource::File(id.clone())),
            (None, Some(data)) => Some(ByteSource::from_file_data(data)),
            _ => None,
        }
    }
}

/// What a media part carries.
#[derive(Debug)]
pub enum MediaSource {
    /// Media bytes, wherever they are.
    Bytes(ByteSource),
    /// Embeddings encoded elsewhere (base64 `torch.save` files): no plugin, no encoder.
    Embeddings {
        embeddings: String,
        grid: Option<String>,
    },
}

/// Where a media part's bytes are.
#[derive(Debug, PartialEq)]
pub enum ByteSource {
    /// Base64 bytes and the MIME type the client declared.
    Base64 {
        data: String,
        mime_type: Option<String>,
    },
    /// An http(s) URL to fetch.
    Url(String),
    /// An upload in the file store.
    File(String),
    /// A data URL whose payload is not marked base64 (`data:<mime>,<text>`): media must be.
    NotBase64,
}

/// Why a [`ByteSource::NotBase64`] gives no bytes.
pub const NOT_BASE64: &str =
    "the data URL is not base64: media data URLs are data:<mime type>;base64,<payload>";

impl Part {
    /// The part's `type`, as the client wrote it.
    pub fn type_name(&self) -> &'static str {
        match self {
            Part::Text { .. } => "text",
            Part::ImageUrl { .. } => "image_url",
            Part::VideoUrl { .. } => "video_url",
            Part::AudioUrl { .. } => "audio_url",
            Part::InputAudio { .. } => "input_audio",
            Part::File { .. } => "file",
            Part::ImageEmbeds { .. } => "image_embeds",
        }
    }

    /// A media part's kind and source; `None` for text. A `file` part's kind is known only once its
    /// bytes are (it is whatever the upload is).
    pub fn media(&self) -> Option<(Option<MediaKind>, MediaSource)> {
        let url =
            |kind, r: &UrlRef| Some((Some(kind), MediaSource::Bytes(ByteSource::from_url(&r.url))));
        match self {
            Part::Text { .. } => None,
            Part::ImageUrl { image_url } => url(MediaKind::Image, image_url),
            Part::VideoUrl { video_url } => url(MediaKind::Video, video_url),
            Part::AudioUrl { audio_url } => url(MediaKind::Audio, audio_url),
            Part::InputAudio { input_audio } => Some((
                Some(MediaKind::Audio),
                MediaSource::Bytes(ByteSource::Base64 {
                    data: input_audio.data.clone(),
                    mime_type: input_audio
                        .format
                        .as_deref()
                        .map(|f| format!("audio/{}", f.to_ascii_lowercase())),
                }),
            )),
            // `check` refused a part with neither or both: none gets this far.
            Part::File { file } => Some((
                None,
                MediaSource::Bytes(file.source().unwrap_or(ByteSource::NotBase64)),
            )),
            Part::ImageEmbeds { image_embeds } => {
                let (embeddings, grid) = match image_embeds {
                    ImageEmbeds::Tensor(e) => (e.clone(), None),
                    ImageEmbeds::Fields {
                        image_embeds,
                        image_grid_thw,
                    } => (image_embeds.clone(), image_grid_thw.clone()),
                };
                Some((
                    Some(MediaKind::Image),
                    MediaSource::Embeddings { embeddings, grid },
                ))
            }
        }
    }
}

impl ByteSource {
    /// A `file` part's `file_data`: a base64 data URL, or bare base64 (its type told by its bytes).
    pub fn from_file_data(data: &str) -> ByteSource {
        if data.starts_with("data:") {
            return ByteSource::from_url(data);
        }
        ByteSource::Base64 {
            data: data.to_owned(),
            mime_type: None,
        }
    }

    /// A data URL (`data:<mime>;base64,<payload>`) keeps its payload undecoded; anything else is
    /// a URL to fetch (its scheme is checked when it is fetched).
    pub fn from_url(url: &str) -> ByteSource {
        let data_url = url.strip_prefix("data:").and_then(|rest| {
            let (header, payload) = rest.split_once(',')?;
            let mime = header.strip_suffix(";base64")?;
            Some(ByteSource::Base64 {
                data: payload.to_owned(),
                mime_type: (!mime.is_empty()).then(|| mime.to_ascii_lowercase()),
            })
        });
        match data_url {
            Some(source) => source,
            None if url.starts_with("data:") => ByteSource::NotBase64,
            None => ByteSource::Url(url.to_owned()),
        }
    }
}

/// Why a data URL's payload gave no bytes.
#[derive(Debug, PartialEq, thiserror::Error)]
pub enum PayloadError {
    /// Its decoded size (from the encoded length, before decoding) is over the limit.
    #[error("{0} bytes decoded, more than the limit")]
    TooLarge(usize),
    /// It is not base64.
    #[error("{0}")]
    NotBase64(String),
}

/// The bytes of a data URL's base64 payload, at most `limit` of them: checked from the encoded
/// length before anything is decoded (a payload over the limit costs no allocation).
pub fn decode_payload(data: &str, limit: usize) -> Result<Vec<u8>, PayloadError> {
    use base64::Engine as _;
    let decoded = data.len() / 4 * 3;
    if decoded > limit {
        return Err(PayloadError::TooLarge(decoded));
    }
    base64::engine::general_purpose::STANDARD
        .decode(data.trim())
        .map_err(|e| PayloadError::NotBase64(e.to_string()))
}

/// The reply's `usage`.
pub fn usage_json(prompt: usize, completion: usize, media: &[Value]) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "media": media,
    })
}

/// A non-streamed reply.
pub fn completion_json(
    id: &str,
    created: u64,
    model: &str,
    text: &str,
    finish_reason: &str,
    usage: Value,
) -> Value {
    json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish_reason,
        }],
        "usage": usage,
    })
}

/// One `chat.completion.chunk` of a stream.
pub fn chunk_json(
    id: &str,
    created: u64,
    model: &str,
    delta: Value,
    finish_reason: Option<&str>,
) -> Value {
    json!({
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    })
}

/// The last chunk of a stream with `stream_options.include_usage`: no choices, the usage.
pub fn usage_chunk_json(id: &str, created: u64, model: &str, usage: Value) -> Value {
    json!({
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_bytes_counts_every_messages_text_and_nothing_else() {
        let body = json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": "ab"},
                {"role": "user", "content": [
                    {"type": "text", "text": "c\"d"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGk="}},
                    {"type": "text", "text": "é"},
                ]},
                {"role": "assistant", "content": null},
            ],
        });
        let bytes = text_bytes(body.to_string().as_bytes()).unwrap();
        assert_eq!(bytes, 2 + 3 + 2);
        assert!(text_bytes(b"{\"messages\": [").is_err());
    }

    #[test]
    fn parts_of_every_type_parse_and_say_where_their_bytes_are() {
        let request: ChatCompletionRequest = serde_json::from_value(json!({
            "model": "demo",
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "hi"},
                {"type": "image_url", "image_url": {"url": "data:image/PNG;base64,aGk=", "detail": "low"}},
                {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}},
                {"type": "input_audio", "input_audio": {"data": "aGk=", "format": "wav"}},
                {"type": "file", "file": {"file_id": "file-1"}},
                {"type": "image_embeds", "image_embeds": "ZW1i"},
                {"type": "image_embeds", "image_embeds": {"image_embeds": "ZW1i", "image_grid_thw": "Z3JpZA=="}, "uuid": "x"},
            ]}],
            "max_completion_tokens": 5,
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(request.max_tokens, Some(5));
        let Some(Content::Parts(parts)) = &request.messages[0].content else {
            panic!("parts expected");
        };
        let media: Vec<_> = parts.iter().filter_map(Part::media).collect();
        assert!(matches!(
            &media[0],
            (Some(MediaKind::Image), MediaSource::Bytes(ByteSource::Base64 { data, mime_type: Some(m) }))
                if data == "aGk=" && m == "image/png"
        ));
        assert!(
            matches!(&media[1], (Some(MediaKind::Video), MediaSource::Bytes(ByteSource::Url(u))) if u.starts_with("https"))
        );
        assert!(matches!(
            &media[2],
            (Some(MediaKind::Audio), MediaSource::Bytes(ByteSource::Base64 { mime_type: Some(m), .. })) if m == "audio/wav"
        ));
        assert!(
            matches!(&media[3], (None, MediaSource::Bytes(ByteSource::File(id))) if id == "file-1")
        );
        assert!(matches!(
            &media[4],
            (Some(MediaKind::Image), MediaSource::Embeddings { embeddings, grid: None }) if embeddings == "ZW1i"
        ));
        assert!(matches!(
            &media[5],
            (Some(MediaKind::Image), MediaSource::Embeddings { grid: Some(g), .. }) if g == "Z3JpZA=="
        ));
    }

    #[test]
    fn unknown_part_types_are_refused() {
        let error = serde_json::from_value::<ChatCompletionRequest>(json!({
            "model": "demo",
            "messages": [{"role": "user", "content": [{"type": "hologram", "hologram": {}}]}],
        }))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
        assert!(error.contains("hologram"), "{error}");
    }
}
