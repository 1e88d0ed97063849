//! A request's text: its size checked against the limits before it is tokenized, and the
//! conversation templated into prompt ids (off the connection's thread when it is long).

use http::StatusCode;
use mmgate_inference::prompt::PromptModel;
use mmgate_inference::text::{ChatMessage, ContentPart};

use super::errors::{context_exceeded, internal, invalid};
use crate::config::RequestLimits;
use crate::error::ApiError;
use crate::wire::openai;

/// What tokenizing a request's text costs is bounded before it is paid: all its text together
/// within `max_text_bytes`, and text that surely makes more tokens than the model's context
/// refused after counting only as much as shows that. Counting runs off the threads that serve
/// connections. Gives the text's bytes (documents' text layers count with them).
pub(crate) async fn checked_text(
    prompt: &PromptModel,
    messages: &[openai::Message],
    limits: &RequestLimits,
) -> Result<usize, ApiError> {
    let texts: Vec<&str> = messages.iter().flat_map(|m| m.texts()).collect();
    let bytes: usize = texts.iter().map(|t| t.len()).sum();
    if bytes > limits.max_text_bytes {
        return Err(text_too_large(bytes, limits.max_text_bytes));
    }
    // Short text is counted in full in a moment below; only long text is worth a check first.
    if bytes < TEXT_WORTH_COUNTING_FIRST {
        return Ok(bytes);
    }
    let joined = texts.join("\n");
    let (text, context) = (prompt.text.clone(), prompt.context_length);
    let surely_over =
        tokio::task::spawn_blocking(move || text.surely_longer_than(&joined, context))
            .await
            .map_err(|e| internal(e.to_string()))?
            .map_err(|e| invalid("messages", e.to_string()))?;
    if surely_over {
        return Err(context_exceeded(format!(
            "the messages' text alone is more than {context} tokens, this model's context"
        )));
    }
    Ok(bytes)
}

/// The answer to a request whose messages' text is `bytes`, over `limit`.
pub fn text_too_large(bytes: usize, limit: usize) -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "text_too_large",
        format!("the messages' text is {bytes} bytes; the limit is {limit}"),
    )
}

/// Bytes of text below which [`checked_text`] leaves the count to the tokenizer's full pass.
const TEXT_WORTH_COUNTING_FIRST: usize = 64 << 10;

/// [`prompt_ids`] on a blocking thread, not one serving connections: templating and tokenizing
/// a long conversation takes long enough to hold up every other request on the thread.
pub(crate) async fn prompt_ids_off_thread(
    prompt: &PromptModel,
    messages: Vec<ChatMessage>,
) -> Result<(Vec<ChatMessage>, Vec<u32>), ApiError> {
    let text = prompt.text.clone();
    tokio::task::spawn_blocking(move || {
        let ids = templated_ids(&text, &messages);
        ids.map(|ids| (messages, ids))
    })
    .await
    .map_err(|e| internal(e.to_string()))?
}

/// The conversation templated and tokenized (placeholders not yet expanded).
pub(crate) fn prompt_ids(
    runtime: &PromptModel,
    messages: &[ChatMessage],
) -> Result<Vec<u32>, ApiError> {
    templated_ids(&runtime.text, messages)
}

/// [`prompt_ids`] with the model's text processor alone.
pub(crate) fn templated_ids(
    text: &mmgate_inference::text::TextProcessor,
    messages: &[ChatMessage],
) -> Result<Vec<u32>, ApiError> {
    let templated = text
        .apply_chat_template(messages, true)
        .map_err(|e| invalid("messages", format!("the chat template refused them: {e}")))?;
    text.encode(&templated).map_err(|e| internal(e.to_string()))
}

/// `messages` without the media parts whose item index (their order in the conversation) `drop`
/// picks.
pub(crate) fn without_media(
    messages: &[ChatMessage],
    drop: impl Fn(usize) -> bool,
) -> Vec<ChatMessage> {
    let mut item = 0;
    messages
        .iter()
        .map(|m| ChatMessage {
            role: m.role.clone(),
            content: m
                .content
                .iter()
                .filter(|part| {
                    if matches!(part, ContentPart::Text(_)) {
                        return true;
                    }
                    item += 1;
                    !drop(item - 1)
                })
                .cloned()
                .collect(),
        })
        .collect()
}
