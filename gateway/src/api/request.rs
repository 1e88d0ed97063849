//! A chat completion request's body parsed, off the connection's thread when it is large.

use bytes::Bytes;
use http::StatusCode;

use crate::config::RequestLimits;
use crate::error::ApiError;
use crate::native::prompt_text::text_too_large;
use crate::wire::openai::{self, ChatCompletionRequest};

/// The body as a chat completion request, every route's way.
pub fn chat_request(body: &[u8]) -> Result<ChatCompletionRequest, ApiError> {
    serde_json::from_slice(body).map_err(|e| invalid_json(&e))
}

/// Bodies from which size [`parsed_off_thread`] parses on a blocking thread.
const BODY_WORTH_A_THREAD: usize = 1 << 20;

/// [`chat_request`], on a blocking thread for a large body: parsing megabytes holds up every
/// other connection of the thread that serves this one. A body larger than the text limit is
/// first read for its text's size alone (no copy of it): one over the limit is refused before
/// its text is copied out of the body.
pub async fn parsed_off_thread(
    body: Bytes,
    limits: &RequestLimits,
) -> Result<ChatCompletionRequest, ApiError> {
    if body.len() < BODY_WORTH_A_THREAD {
        return chat_request(&body);
    }
    let max_text_bytes = limits.max_text_bytes;
    tokio::task::spawn_blocking(move || {
        if body.len() > max_text_bytes {
            let bytes = openai::text_bytes(&body).map_err(|e| invalid_json(&e))?;
            if bytes > max_text_bytes {
                return Err(text_too_large(bytes, max_text_bytes));
            }
        }
        chat_request(&body)
    })
    .await
    .map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            e.to_string(),
        )
    })?
}

pub fn invalid_json(error: &serde_json::Error) -> ApiError {
    ApiError::new(
        StatusCode::BAD_REQUEST,
        "invalid_request",
        format!("the request body is not a valid chat completion request: {error}"),
    )
}
