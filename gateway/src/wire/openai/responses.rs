//! OpenAI's Responses API on the wire: a request's input translated to the chat completion it
//! means (the route every model already serves), and the JSON of responses and of their stream's
//! events. Parsing and shapes only; [`crate::api`] runs them.

use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::Invalid;
use crate::media::sniff::sniff_base64;

/// The fields of a Responses request this gateway reads (`model` and `user` are read when
/// routing; tools and reasoning are not served).
#[derive(Debug, Deserialize)]
pub struct ResponsesRequest {
    pub model: String,
    pub input: Input,
    #[serde(default)]
    pub instructions: Option<String>,
    #[serde(default)]
    pub max_output_tokens: Option<u64>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub stream: bool,
    /// Whether the response is kept for `previous_response_id` and `GET` (OpenAI's default: yes).
    #[serde(default = "kept")]
    pub store: bool,
    #[serde(default)]
    pub previous_response_id: Option<String>,
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub metadata: Option<Map<String, Value>>,
}

fn kept() -> bool {
    true
}

/// `input`: a user's text, or a list of items.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Input {
    Text(String),
    Items(Vec<Value>),
}

/// The roles an input message may have.
const ROLES: [&str; 4] = ["user", "assistant", "system", "developer"];

impl ResponsesRequest {
    /// The conversation this request continues: `history` (an earlier turn's messages), then
    /// its input as chat messages, each content part the chat part that means the same; the
    /// Responses parameter at fault otherwise. What a stored response keeps (with its answer).
    ///
    /// The input is taken, not copied: each item is dropped once it is a message, so a large
    /// input is held once rather than twice.
    pub fn conversation(&mut self, history: Vec<Value>) -> Result<Vec<Value>, Invalid> {
        let mut messages = history;
        match std::mem::replace(&mut self.input, Input::Text(String::new())) {
            Input::Text(text) => messages.push(json!({"role": "user", "content": text})),
            Input::Items(items) => {
                for (index, item) in items.into_iter().enumerate() {
                    messages.push(message(index, &item)?);
                }
            }
        }
        Ok(messages)
    }

    /// The chat completion this request means: its `instructions` (which a follow-up does not
    /// inherit) as the system message, then `conversation`.
    pub fn chat_body(&self, conversation: &[Value]) -> Value {
        let instructions = self
            .instructions
            .iter()
            .map(|text| json!({"role": "system", "content": text}));
        let messages: Vec<Value> = instructions.chain(conversation.iter().cloned()).collect();
        let mut body = json!({"model": self.model, "messages": messages, "stream": self.stream});
        if self.stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        let optional = [
            ("max_tokens", self.max_output_tokens.map(Value::from)),
            ("temperature", self.temperature.map(Value::from)),
            ("top_p", self.top_p.map(Value::from)),
            ("user", self.user.clone().map(Value::from)),
        ];
        for (name, value) in optional {
            if let Some(value) = value {
                body[name] = value;
            }
        }
        body
    }
}

fn invalid(param: &'static str, message: String) -> Invalid {
    Invalid { param, message }
}

/// One input item as a chat message: messages only (`type` `message`, or none).
fn message(index: usize, item: &Value) -> Result<Value, Invalid> {
    let kind = item
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("message");
    if kind != "message" {
        return Err(invalid(
            "input",
            format!("input[{index}] is a {kind:?} item: only messages are served here"),
        ));
    }
    let role = item.get("role").and_then(Value::as_str).unwrap_or_default();
    if !ROLES.contains(&role) {
        return Err(invalid(
            "input",
            format!("input[{index}].role must be one of {ROLES:?}, not {role:?}"),
        ));
    }
    let content = match item.get("content") {
        Some(Value::String(text)) => Value::from(text.as_str()),
        Some(Value::Array(parts)) => Value::Array(
            parts
                .iter()
                .enumerate()
                .map(|(at, part)| chat_part(index, at, part))
                .collect::<Result<_, _>>()?,
        ),
        _ => {
            return Err(invalid(
                "input",
                format!("input[{index}].content must be a string or a list of parts"),
            ));
        }
    };
    Ok(json!({"role": role, "content": content}))
}

/// A Responses content part as the chat part that means the same.
fn chat_part(index: usize, at: usize, part: &Value) -> Result<Value, Invalid> {
    let here = || format!("input[{index}].content[{at}]");
    let text = |field: &str| {
        part.get(field)
            .and_then(Value::as_str)
            .ok_or_else(|| invalid("input", format!("{} has no {field}", here())))
    };
    let kind = part.get("type").and_then(Value::as_str).unwrap_or_default();
    match kind {
        "input_text" | "output_text" | "text" => Ok(json!({"type": "text", "text": text("text")?})),
        "input_image" => {
            if let Some(url) = part.get("image_url").and_then(Value::as_str) {
                Ok(json!({"type": "image_url", "image_url": {"url": url}}))
            } else if let Some(id) = part.get("file_id").and_then(Value::as_str) {
                Ok(json!({"type": "file", "file": {"file_id": id}}))
            } else {
                Err(invalid(
                    "input",
                    format!("{} (input_image) needs image_url or file_id", here()),
                ))
            }
        }
        "input_audio" => {
            let audio = &part["input_audio"];
            let data = audio
                .get("data")
                .and_then(Value::as_str)
                .ok_or_else(|| invalid("input", format!("{} (input_audio) has no data", here())))?;
            let mut input_audio = json!({"data": data});
            if let Some(format) = audio.get("format").and_then(Value::as_str) {
                input_audio["format"] = Value::from(format);
            }
            Ok(json!({"type": "input_audio", "input_audio": input_audio}))
        }
        "input_file" => {
            if let Some(id) = part.get("file_id").and_then(Value::as_str) {
                Ok(json!({"type": "file", "file": {"file_id": id}}))
            } else if let Some(data) = part.get("file_data").and_then(Value::as_str) {
                file_data_part(data).map_err(|why| invalid("input", format!("{}: {why}", here())))
            } else if let Some(url) = part.get("file_url").and_then(Value::as_str) {
                Err(invalid(
                    "input",
                    format!(
                        "{}: file_url ({url:.64}) is not fetched here: send the medium as \
                         input_image's image_url, or its bytes as file_data",
                        here()
                    ),
                ))
            } else {
                Err(invalid(
                    "input",
                    format!("{} (input_file) needs file_id or file_data", here()),
                ))
            }
        }
        other => Err(invalid(
            "input",
            format!(
                "{} has type {other:?}: parts may be input_text, input_image, input_file or \
                 input_audio",
                here()
            ),
        )),
    }
}

/// An `input_file`'s inline bytes (a base64 data URL, or bare base64) as the chat part of the
/// medium they hold, told by their magic numbers: a file's declared type is not trusted.
fn file_data_part(data: &str) -> Result<Value, String> {
    let payload = match data.strip_prefix("data:") {
        Some(rest) => match rest.split_once(',') {
            Some((header, payload)) if header.ends_with(";base64") => payload,
            _ => return Err("file_data must be base64 (data:<type>;base64,<payload>)".into()),
        },
        None => data,
    };
    let mime = sniff_base64(payload)
        .map_err(|e| format!("file_data is not base64: {e}"))?
        .ok_or("file_data holds no image, video, audio or PDF this gateway recognises")?;
    let url = format!("data:{mime};base64,{payload}");
    if mime == "application/pdf" {
        // A document: chat's file part takes it to the document plugin.
        return Ok(json!({"type": "file", "file": {"file_data": url}}));
    }
    let field = match mime.split('/').next() {
        Some("image") => "image_url",
        Some("video") => "video_url",
        Some("audio") => "audio_url",
        _ => {
            return Err(format!(
                "file_data holds {mime}: not an image, a video or audio"
            ));
        }
    };
    Ok(json!({"type": field, field: {"url": url}}))
}

/// What a finished generation is, for a response's `status` and `incomplete_details`.
pub fn completion_state(finish_reason: &str) -> (&'static str, Value) {
    match finish_reason {
        "length" => ("incomplete", json!({"reason": "max_output_tokens"})),
        _ => ("completed", Value::Null),
    }
}

/// A chat completion's `usage` in the Responses API's terms (its `media` account kept).
pub fn usage(chat_usage: &Value) -> Value {
    let input = chat_usage["prompt_tokens"].as_u64().unwrap_or(0);
    let output = chat_usage["completion_tokens"].as_u64().unwrap_or(0);
    let mut usage = json!({
        "input_tokens": input,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input + output,
    });
    if let Some(media) = chat_usage.get("media") {
        usage["media"] = media.clone();
    }
    usage
}

/// The response object, as created (`in_progress`, no output) and as finished.
pub struct ResponseObject<'r> {
    pub id: &'r str,
    pub message_id: &'r str,
    pub created_at: u64,
    /// The model's name as the client asked for it.
    pub model: &'r str,
    pub request: &'r ResponsesRequest,
}

impl ResponseObject<'_> {
    /// The object with `status`, the output `text` (none while in progress) and `usage`.
    pub fn json(&self, status: &str, text: Option<&str>, usage: Option<Value>) -> Value {
        let output = match text {
            Some(text) => vec![self.message(text, "completed")],
            None => Vec::new(),
        };
        let r = self.request;
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": null,
            "incomplete_details": null,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": false,
            "previous_response_id": r.previous_response_id,
            "store": r.store,
            "temperature": r.temperature,
            "top_p": r.top_p,
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto",
            "tools": [],
            "truncation": "disabled",
            "usage": usage,
            "user": r.user,
            "metadata": r.metadata.clone().unwrap_or_default(),
        })
    }

    /// The finished object: `text` generated until `finish_reason`, with `chat_usage`.
    pub fn finished(&self, text: &str, finish_reason: &str, chat_usage: &Value) -> Value {
        let (status, details) = completion_state(finish_reason);
        let mut object = self.json(status, Some(text), Some(usage(chat_usage)));
        object["incomplete_details"] = details;
        object
    }

    /// The assistant message holding `text`.
    pub fn message(&self, text: &str, status: &str) -> Value {
        let content: Vec<Value> = if status == "in_progress" {
            Vec::new()
        } else {
            vec![output_text(text)]
        };
        json!({"type": "message", "id": self.message_id, "status": status, "role": "assistant",
               "content": content})
    }
}

/// An `output_text` content part.
pub fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": []})
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine as _;

    fn request(body: Value) -> ResponsesRequest {
        serde_json::from_value(body).unwrap()
    }

    #[test]
    fn a_string_input_is_one_user_message_after_the_instructions() {
        let mut r = request(json!({"model": "m", "input": "hi", "instructions": "be brief"}));
        let conversation = r.conversation(Vec::new()).unwrap();
        assert_eq!(conversation, vec![json!({"role": "user", "content": "hi"})]);
        assert_eq!(
            r.chat_body(&conversation)["messages"],
            json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
        );
    }

    #[test]
    fn media_parts_become_the_chat_parts_that_mean_the_same() {
        let png = base64::engine::general_purpose::STANDARD.encode(b"\x89PNG\r\n\x1a\n0000IHDR");
        let mut r = request(json!({"model": "m", "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "look"},
            {"type": "input_image", "image_url": "https://example.com/a.jpg"},
            {"type": "input_image", "file_id": "file-1"},
            {"type": "input_file", "file_id": "file-2"},
            {"type": "input_file", "file_data": format!("data:application/octet-stream;base64,{png}")},
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        ]}]}));
        let parts = r.conversation(Vec::new()).unwrap()[0]["content"].clone();
        assert_eq!(parts[0], json!({"type": "text", "text": "look"}));
        assert_eq!(parts[1]["image_url"]["url"], "https://example.com/a.jpg");
        assert_eq!(
            parts[2],
            json!({"type": "file", "file": {"file_id": "file-1"}})
        );
        assert_eq!(
            parts[3],
            json!({"type": "file", "file": {"file_id": "file-2"}})
        );
        // The bytes decide the type, not what the client declared.
        assert_eq!(
            parts[4]["image_url"]["url"],
            format!("data:image/png;base64,{png}")
        );
        assert_eq!(parts[5]["input_audio"]["format"], "wav");
    }

    #[test]
    fn unknown_items_parts_and_files_are_refused_with_their_place() {
        for (input, said) in [
            (
                json!([{"type": "function_call", "name": "f"}]),
                "input[0] is a \"function_call\"",
            ),
            (json!([{"role": "robot", "content": "x"}]), "input[0].role"),
            (
                json!([{"role": "user", "content": [{"type": "input_video"}]}]),
                "input[0].content[0]",
            ),
            (
                json!([{"role": "user", "content": [{"type": "input_file", "file_data": "AAAAAAAA"}]}]),
                "recognises",
            ),
            (
                json!([{"role": "user", "content": [{"type": "input_image"}]}]),
                "needs image_url or file_id",
            ),
            (json!([{"role": "user", "content": 7}]), "string or a list"),
            // Not base64, multi-byte characters across the sniffed prefix's end: refused, no panic.
            (
                json!([{"role": "user", "content": [
                    {"type": "input_file", "file_data": format!("a{}", "é".repeat(3000))}]}]),
                "not base64",
            ),
        ] {
            let mut r = request(json!({"model": "m", "input": input}));
            let error = r.conversation(Vec::new()).unwrap_err();
            assert_eq!(error.param, "input");
            assert!(error.message.contains(said), "{}", error.message);
        }
    }

    #[test]
    fn the_chat_body_carries_the_history_and_the_sampling() {
        let mut r = request(
            json!({"model": "m", "input": "again", "max_output_tokens": 5,
                   "instructions": "be brief", "temperature": 0.5, "stream": true}),
        );
        let history = vec![
            json!({"role": "user", "content": "hi"}),
            json!({"role": "assistant", "content": "hello"}),
        ];
        let conversation = r.conversation(history.clone()).unwrap();
        // What is kept for the next turn holds no instructions (a follow-up brings its own) ...
        assert_eq!(conversation[..2], history[..]);
        assert_eq!(conversation.len(), 3);
        // ... and what the model sees has them first, before the earlier turns.
        let body = r.chat_body(&conversation);
        assert_eq!(body["messages"][0]["role"], "system");
        assert_eq!(body["messages"][1], history[0]);
        assert_eq!(body["messages"].as_array().unwrap().len(), 4);
        assert_eq!(body["max_tokens"], 5);
        assert_eq!(body["temperature"], 0.5);
        assert_eq!(body["stream_options"]["include_usage"], true);
    }

    #[test]
    fn a_length_stop_is_an_incomplete_response() {
        let r = request(json!({"model": "m", "input": "x"}));
        let object = ResponseObject {
            id: "resp_1",
            message_id: "msg_1",
            created_at: 0,
            model: "m",
            request: &r,
        };
        let done = object.finished(
            "ab",
            "length",
            &json!({"prompt_tokens": 3, "completion_tokens": 2}),
        );
        assert_eq!(done["status"], "incomplete");
        assert_eq!(done["incomplete_details"]["reason"], "max_output_tokens");
        assert_eq!(done["usage"]["total_tokens"], 5);
        assert_eq!(done["output"][0]["content"][0]["text"], "ab");
    }
}
