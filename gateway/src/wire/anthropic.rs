//! Anthropic's Messages API on the wire: a request translated to the chat completion it means (the
//! route every model already serves), and the JSON of messages, of their stream's events and of
//! errors in Anthropic's shape. Parsing and shapes only; [`crate::api`] runs them.
//!
//! The translation follows vLLM's own `/v1/messages` where both serve a block (the system prompt's
//! blocks joined, a lone text block sent as a string), so that a request means the same prompt
//! whichever of the two serves it.

use http::StatusCode;
use serde::Deserialize;
use serde_json::{Value, json};

use super::openai::Invalid;
use crate::media::sniff::sniff_base64;

/// The paths this API answers on: their errors take its shape.
pub const MESSAGES: &str = "/v1/messages";
pub const COUNT_TOKENS: &str = "/v1/messages/count_tokens";

/// Whether `path` is one of this API's (its errors are written in its shape).
pub fn owns(path: &str) -> bool {
    path == MESSAGES || path.starts_with("/v1/messages/")
}

/// The fields of a Messages request this gateway reads.
#[derive(Debug, Deserialize)]
pub struct MessagesRequest {
    pub model: String,
    /// Required by `/v1/messages` (as Anthropic requires it), optional for `count_tokens`.
    #[serde(default)]
    pub max_tokens: Option<u64>,
    pub messages: Vec<Value>,
    #[serde(default)]
    pub system: Option<Value>,
    #[serde(default)]
    pub stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub top_k: Option<i64>,
    #[serde(default)]
    pub metadata: Option<Metadata>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    #[serde(default)]
    pub thinking: Option<Value>,
}

#[derive(Debug, Deserialize)]
pub struct Metadata {
    #[serde(default)]
    pub user_id: Option<String>,
}

/// Why a request cannot be served as it is.
#[derive(Debug, PartialEq)]
pub enum Refusal {
    /// Not a valid request (400).
    Invalid(Invalid),
    /// A valid block this gateway does not serve (415).
    Unsupported(String),
}

impl From<Invalid> for Refusal {
    fn from(invalid: Invalid) -> Refusal {
        Refusal::Invalid(invalid)
    }
}

fn invalid(param: &'static str, message: String) -> Refusal {
    Refusal::Invalid(Invalid { param, message })
}

impl MessagesRequest {
    /// The chat completion this request means (`stream` as asked), or why it cannot be served.
    pub fn chat_body(&self) -> Result<Value, Refusal> {
        self.check_served()?;
        if self.messages.is_empty() {
            return Err(invalid(
                "messages",
                "messages: at least one message is required".into(),
            ));
        }
        let mut messages = Vec::with_capacity(self.messages.len() + 1);
        if let Some(system) = &self.system {
            messages.push(json!({"role": "system", "content": system_text(system)?}));
        }
        for (index, message) in self.messages.iter().enumerate() {
            messages.push(chat_message(index, message)?);
        }
        let mut body = json!({"model": self.model, "messages": messages, "stream": self.stream});
        if self.stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        let optional = [
            ("max_tokens", self.max_tokens.map(Value::from)),
            ("temperature", self.temperature.map(Value::from)),
            ("top_p", self.top_p.map(Value::from)),
            ("top_k", self.top_k.map(Value::from)),
            ("stop", self.stop_sequences.clone().map(Value::from)),
            (
                "user",
                (self.metadata.as_ref()).and_then(|m| m.user_id.clone().map(Value::from)),
            ),
        ];
        for (name, value) in optional {
            if let Some(value) = value {
                body[name] = value;
            }
        }
        Ok(body)
    }

    /// Tools and extended thinking are not served: refused, not ignored (a client relying on them
    /// would otherwise get an answer that silently lacks them).
    fn check_served(&self) -> Result<(), Refusal> {
        if self.tools.as_ref().is_some_and(|tools| !tools.is_empty()) {
            return Err(invalid(
                "tools",
                "tools: tool use is not served by this gateway".into(),
            ));
        }
        if self.tool_choice.is_some() {
            return Err(invalid(
                "tool_choice",
                "tool_choice: tool use is not served by this gateway".into(),
            ));
        }
        match self.thinking.as_ref().map(|t| t["type"].as_str()) {
            None | Some(Some("disabled")) => Ok(()),
            Some(_) => Err(invalid(
                "thinking",
                "thinking: extended thinking is not served by this gateway (only {\"type\": \
                 \"disabled\"})"
                    .into(),
            )),
        }
    }
}

/// `system`: a string, or text blocks (joined as vLLM joins them).
fn system_text(system: &Value) -> Result<String, Refusal> {
    match system {
        Value::String(text) => Ok(text.clone()),
        Value::Array(blocks) => blocks
            .iter()
            .enumerate()
            .map(|(at, block)| match block["type"].as_str() {
                Some("text") => block["text"].as_str().map(str::to_owned).ok_or_else(|| {
                    invalid("system", format!("system.{at}.text: a string is required"))
                }),
                other => Err(invalid(
                    "system",
                    format!("system.{at}: only text blocks may stand here, not {other:?}"),
                )),
            })
            .collect(),
        _ => Err(invalid(
            "system",
            "system: a string or a list of text blocks is required".into(),
        )),
    }
}

/// One message as a chat message: `user` or `assistant`, its content a string or blocks.
fn chat_message(index: usize, message: &Value) -> Result<Value, Refusal> {
    let role = message["role"].as_str().unwrap_or_default();
    if !matches!(role, "user" | "assistant") {
        return Err(invalid(
            "messages",
            format!("messages.{index}.role: must be \"user\" or \"assistant\", not {role:?}"),
        ));
    }
    let content = match &message["content"] {
        Value::String(text) => Value::from(text.as_str()),
        Value::Array(blocks) => {
            let mut parts = Vec::with_capacity(blocks.len());
            for (at, block) in blocks.iter().enumerate() {
                let here = format!("messages.{index}.content.{at}");
                chat_parts(&here, role, block, &mut parts)?;
            }
            // A lone text block is sent as a string, as vLLM sends it: templates may differ.
            match parts.as_slice() {
                [part] if part["type"] == "text" => part["text"].clone(),
                _ => Value::Array(parts),
            }
        }
        _ => {
            return Err(invalid(
                "messages",
                format!("messages.{index}.content: a string or a list of blocks is required"),
            ));
        }
    };
    Ok(json!({"role": role, "content": content}))
}

/// A content block as the chat parts that mean the same, appended to `parts`.
fn chat_parts(
    here: &str,
    role: &str,
    block: &Value,
    parts: &mut Vec<Value>,
) -> Result<(), Refusal> {
    let kind = block["type"].as_str().unwrap_or_default();
    if role == "assistant" && kind != "text" {
        return Err(invalid(
            "messages",
            format!("{here}: an assistant message holds only text blocks here, not {kind:?}"),
        ));
    }
    match kind {
        "text" => {
            let text = block["text"]
                .as_str()
                .ok_or_else(|| invalid("messages", format!("{here}.text: a string is required")))?;
            parts.push(json!({"type": "text", "text": text}));
        }
        "image" => parts.push(image_part(here, &block["source"])?),
        "document" => document_parts(here, &block["source"], parts)?,
        "tool_use" | "tool_result" | "server_tool_use" | "web_search_tool_result" => {
            return Err(invalid(
                "messages",
                format!("{here}: {kind} blocks are not served: this gateway does not serve tools"),
            ));
        }
        "thinking" | "redacted_thinking" => {
            return Err(invalid(
                "messages",
                format!("{here}: {kind} blocks are not served: this gateway does not think"),
            ));
        }
        other => {
            return Err(invalid(
                "messages",
                format!(
                    "{here}.type: {other:?} is not a block served here (text, image, document)"
                ),
            ));
        }
    }
    Ok(())
}

/// An image block's source as a chat image part.
fn image_part(here: &str, source: &Value) -> Result<Value, Refusal> {
    match source["type"].as_str() {
        Some("base64") => {
            let (mime, data) = base64_source(here, source)?;
            Ok(
                json!({"type": "image_url", "image_url": {"url": format!("data:{mime};base64,{data}")}}),
            )
        }
        Some("url") => {
            let url = source["url"].as_str().ok_or_else(|| {
                invalid(
                    "messages",
                    format!("{here}.source.url: a string is required"),
                )
            })?;
            Ok(json!({"type": "image_url", "image_url": {"url": url}}))
        }
        Some("file") => Ok(file_part(here, source)?),
        other => Err(invalid(
            "messages",
            format!("{here}.source.type: {other:?} is not base64, url or file"),
        )),
    }
}

/// A document block's source as chat parts: text as text, an image or a PDF by what its bytes
/// are (a declared type is not trusted).
fn document_parts(here: &str, source: &Value, parts: &mut Vec<Value>) -> Result<(), Refusal> {
    match source["type"].as_str() {
        Some("text") => {
            let text = source["data"].as_str().ok_or_else(|| {
                invalid(
                    "messages",
                    format!("{here}.source.data: a string is required"),
                )
            })?;
            parts.push(json!({"type": "text", "text": text}));
        }
        Some("content") => match &source["content"] {
            Value::String(text) => parts.push(json!({"type": "text", "text": text})),
            Value::Array(blocks) => {
                for (at, block) in blocks.iter().enumerate() {
                    let inner = format!("{here}.source.content.{at}");
                    match block["type"].as_str() {
                        Some("text" | "image") => chat_parts(&inner, "user", block, parts)?,
                        other => {
                            return Err(invalid(
                                "messages",
                                format!(
                                    "{inner}.type: a document's content holds text and image blocks, not {other:?}"
                                ),
                            ));
                        }
                    }
                }
            }
            _ => {
                return Err(invalid(
                    "messages",
                    format!("{here}.source.content: a string or a list of blocks is required"),
                ));
            }
        },
        Some("base64") => {
            let (mime, data) = base64_source(here, source)?;
            let sniffed = sniff_base64(data)
                .map_err(|e| invalid("messages", format!("{here}.source.data: not base64: {e}")))?;
            match sniffed {
                Some(image) if image.starts_with("image/") => parts.push(
                    json!({"type": "image_url", "image_url": {"url": format!("data:{image};base64,{data}")}}),
                ),
                // Rendered page by page by the document plugin, as chat's file part is.
                Some(pdf @ "application/pdf") => parts.push(
                    json!({"type": "file", "file": {"file_data": format!("data:{pdf};base64,{data}")}}),
                ),
                Some(other) => return Err(unsupported_document(here, other)),
                None => return Err(unsupported_document(here, mime)),
            }
        }
        Some("file") => parts.push(file_part(here, source)?),
        Some("url") => {
            return Err(invalid(
                "messages",
                format!(
                    "{here}.source: documents are not fetched by URL here; send their bytes \
                     (base64) or upload them (file)"
                ),
            ));
        }
        other => {
            return Err(invalid(
                "messages",
                format!("{here}.source.type: {other:?} is not base64, text, content, file or url"),
            ));
        }
    }
    Ok(())
}

fn unsupported_document(here: &str, what: &str) -> Refusal {
    Refusal::Unsupported(format!(
        "{here}: a document of {what} is not served: documents are PDFs, images, or text (a \
         text source)"
    ))
}

/// A `base64` source's declared media type and its payload.
fn base64_source<'s>(here: &str, source: &'s Value) -> Result<(&'s str, &'s str), Refusal> {
    let mime = source["media_type"].as_str().ok_or_else(|| {
        invalid(
            "messages",
            format!("{here}.source.media_type: a string is required"),
        )
    })?;
    let data = source["data"].as_str().ok_or_else(|| {
        invalid(
            "messages",
            format!("{here}.source.data: a string is required"),
        )
    })?;
    Ok((mime, data))
}

/// A `file` source (an upload of this gateway's Files API) as a chat file part.
fn file_part(here: &str, source: &Value) -> Result<Value, Refusal> {
    let id = source["file_id"].as_str().ok_or_else(|| {
        invalid(
            "messages",
            format!("{here}.source.file_id: a string is required"),
        )
    })?;
    Ok(json!({"type": "file", "file": {"file_id": id}}))
}

/// Anthropic's `stop_reason` (and `stop_sequence`) for a chat completion's finish.
pub fn stop_reason(finish: &str, stop_sequence: Option<&str>) -> (&'static str, Option<String>) {
    match (finish, stop_sequence) {
        ("length", _) => ("max_tokens", None),
        (_, Some(matched)) => ("stop_sequence", Some(matched.to_owned())),
        _ => ("end_turn", None),
    }
}

/// A chat completion's `usage` in this API's terms (its `media` account kept).
pub fn usage(chat_usage: &Value) -> Value {
    let mut usage = json!({
        "input_tokens": chat_usage["prompt_tokens"].as_u64().unwrap_or(0),
        "output_tokens": chat_usage["completion_tokens"].as_u64().unwrap_or(0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    });
    if let Some(media) = chat_usage.get("media") {
        usage["media"] = media.clone();
    }
    usage
}

/// A message object: `text` so far (none while it streams), and how it ended.
pub fn message_json(
    id: &str,
    model: &str,
    text: Option<&str>,
    stop: Option<(&'static str, Option<String>)>,
    usage: Value,
) -> Value {
    let content: Vec<Value> = text
        .map(|text| json!({"type": "text", "text": text}))
        .into_iter()
        .collect();
    let (stop_reason, stop_sequence) = match stop {
        Some((reason, sequence)) => (Value::from(reason), Value::from(sequence)),
        None => (Value::Null, Value::Null),
    };
    json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage,
    })
}

/// Anthropic's error `type` for an answer's status.
pub fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 | 405 | 409 | 415 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ if status.is_client_error() => "invalid_request_error",
        _ => "api_error",
    }
}

/// An error in this API's shape: `{"type": "error", "error": {"type", "message"}}`.
pub fn error_json(status: StatusCode, message: &str) -> Value {
    json!({"type": "error", "error": {"type": error_type(status), "message": message}})
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine as _;

    fn request(body: Value) -> MessagesRequest {
        serde_json::from_value(body).unwrap()
    }

    #[test]
    fn a_request_means_the_chat_completion_vllm_would_make_of_it() {
        let png =
            base64::engine::general_purpose::STANDARD.encode(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR");
        let pdf =
            base64::engine::general_purpose::STANDARD.encode(b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n");
        let body = request(json!({
            "model": "m", "max_tokens": 9, "stream": true,
            "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            "stop_sequences": ["END"], "temperature": 0.5, "top_k": 4,
            "metadata": {"user_id": "u1"}, "thinking": {"type": "disabled"},
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}},
                    {"type": "image", "source": {"type": "url", "url": "https://example.com/a.jpg"}},
                    {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "a note"}},
                    {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": png}},
                    {"type": "image", "source": {"type": "file", "file_id": "file-1"}},
                    {"type": "document", "source": {"type": "base64", "media_type": "image/png", "data": pdf}},
                ]},
            ],
        }))
        .chat_body()
        .unwrap();
        assert_eq!(
            body["messages"][0],
            json!({"role": "system", "content": "Be brief."})
        );
        assert_eq!(
            body["messages"][1],
            json!({"role": "user", "content": "hi"})
        );
        let parts = &body["messages"][3]["content"];
        assert_eq!(
            parts[0]["image_url"]["url"],
            format!("data:image/png;base64,{png}")
        );
        assert_eq!(parts[1]["image_url"]["url"], "https://example.com/a.jpg");
        assert_eq!(parts[2], json!({"type": "text", "text": "a note"}));
        // Declared a PDF, but its bytes are a PNG: an image.
        assert_eq!(parts[3]["type"], "image_url");
        assert_eq!(
            parts[4],
            json!({"type": "file", "file": {"file_id": "file-1"}})
        );
        // Declared a PNG, but its bytes are a PDF: a file the document plugin renders.
        assert_eq!(
            parts[5],
            json!({"type": "file", "file": {"file_data": format!("data:application/pdf;base64,{pdf}")}})
        );
        assert_eq!(body["stop"], json!(["END"]));
        assert_eq!(
            (body["top_k"].clone(), body["user"].clone()),
            (json!(4), json!("u1"))
        );
        assert_eq!(body["stream_options"], json!({"include_usage": true}));
        assert_eq!(body["max_tokens"], 9);
    }

    #[test]
    fn what_is_not_served_is_refused_by_name() {
        let refused = |extra: Value, content: Value| {
            let mut body = json!({"model": "m", "max_tokens": 1,
                                  "messages": [{"role": "user", "content": content}]});
            for (k, v) in extra.as_object().unwrap() {
                body[k] = v.clone();
            }
            request(body).chat_body().unwrap_err()
        };
        let tools = refused(json!({"tools": [{"name": "t"}]}), json!("x"));
        assert!(matches!(
            tools,
            Refusal::Invalid(Invalid { param: "tools", .. })
        ));
        let thinking = refused(
            json!({"thinking": {"type": "enabled", "budget_tokens": 10}}),
            json!("x"),
        );
        assert!(matches!(
            thinking,
            Refusal::Invalid(Invalid {
                param: "thinking",
                ..
            })
        ));
        let tool_result = refused(
            json!({}),
            json!([{"type": "tool_result", "tool_use_id": "a"}]),
        );
        assert!(
            matches!(&tool_result, Refusal::Invalid(i) if i.message.contains("tool_result")),
            "{tool_result:?}"
        );
        let zip = base64::engine::general_purpose::STANDARD.encode(b"PK\x03\x04\x14\0\0\0\x08\0");
        let document = refused(
            json!({}),
            json!([{"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": zip}}]),
        );
        assert!(
            matches!(&document, Refusal::Unsupported(m) if m.contains("application/zip")),
            "{document:?}"
        );
        let role = request(json!({"model": "m", "messages": [{"role": "system", "content": "x"}]}));
        assert!(matches!(
            role.chat_body(),
            Err(Refusal::Invalid(Invalid {
                param: "messages",
                ..
            }))
        ));
        let none = request(json!({"model": "m", "messages": []}));
        assert!(none.chat_body().is_err());
    }

    #[test]
    fn stop_reasons_and_error_types_follow_anthropic() {
        assert_eq!(stop_reason("length", Some("x")), ("max_tokens", None));
        assert_eq!(
            stop_reason("stop", Some("END")),
            ("stop_sequence", Some("END".into()))
        );
        assert_eq!(stop_reason("stop", None), ("end_turn", None));
        assert_eq!(error_type(StatusCode::NOT_FOUND), "not_found_error");
        assert_eq!(
            error_type(StatusCode::UNSUPPORTED_MEDIA_TYPE),
            "invalid_request_error"
        );
        assert_eq!(
            error_type(StatusCode::SERVICE_UNAVAILABLE),
            "overloaded_error"
        );
        assert_eq!(error_type(StatusCode::BAD_GATEWAY), "api_error");
        assert_eq!(
            error_json(StatusCode::UNAUTHORIZED, "no key"),
            json!({"type": "error", "error": {"type": "authentication_error", "message": "no key"}})
        );
        assert!(
            owns("/v1/messages") && owns("/v1/messages/count_tokens") && !owns("/v1/messagesx")
        );
    }
}
