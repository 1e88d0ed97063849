//! A chat completion request's body parsed, off the connection's thread when it is large.

use bytes::Bytes;
use http::StatusCode;

use crate::config::RequestLimits;
use crate::error::ApiError;
use crate::prepare::prompt_text::text_too_large;
use crate::wire::openai::shape::{self, ShapeError};
use crate::wire::openai::{self, ChatCompletionRequest};

/// The body as a chat completion request, every route's way.
pub fn chat_request(body: &[u8]) -> Result<ChatCompletionRequest, ApiError> {
    serde_json::from_slice(body).map_err(|e| invalid_json(&e))
}

/// Bodies from which size [`off_thread_if_large`] works on a blocking thread.
const BODY_WORTH_A_THREAD: usize = 1 << 20;

/// [`chat_request`], on a blocking thread for a large body: parsing megabytes holds up every
/// other connection of the thread that serves this one. A body larger than the text limit is
/// first read for its text's size alone (no copy of it): one over the limit is refused before
/// its text is copied out of the body.
pub async fn parsed_off_thread(
    body: Bytes,
    limits: &RequestLimits,
) -> Result<ChatCompletionRequest, ApiError> {
    let max_text_bytes = limits.max_text_bytes;
    off_thread_if_large(&body, move |body| {
        if body.len() > max_text_bytes {
            let bytes = openai::text_bytes(&body).map_err(|e| invalid_json(&e))?;
            if bytes > max_text_bytes {
                return Err(text_too_large(bytes, max_text_bytes));
            }
        }
        chat_request(&body)
    })
    .await
}

/// Runs `work` on a blocking thread when `body` is large enough that it would hold up the other
/// connections of the thread that serves this one, else here.
pub async fn off_thread_if_large<T: Send + 'static>(
    body: &Bytes,
    work: impl FnOnce(Bytes) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    if body.len() < BODY_WORTH_A_THREAD {
        return work(body.clone());
    }
    let body = body.clone();
    tokio::task::spawn_blocking(move || work(body))
        .await
        .map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal_error",
                e.to_string(),
            )
        })?
}

/// Refuses a body whose `list` (chat's `messages`, the Responses API's `input`) holds more items or
/// parts than the limits allow, counted before anything of it is built. A body that is not JSON is
/// refused with `not_json`'s error.
pub async fn checked_shape(
    body: &Bytes,
    list: &'static str,
    limits: &RequestLimits,
    not_json: fn(&serde_json::Error) -> ApiError,
) -> Result<(), ApiError> {
    let limits = limits.shape();
    off_thread_if_large(body, move |body| {
        shape::check(&body, list, limits).map_err(|e| shape_error(e, list, not_json))
    })
    .await
}

/// The answer to a shape over its limits.
pub fn shape_error(
    error: ShapeError,
    list: &'static str,
    not_json: fn(&serde_json::Error) -> ApiError,
) -> ApiError {
    let code = match &error {
        ShapeError::Json(e) => return not_json(e),
        ShapeError::TooManyMessages { .. } => "too_many_messages",
        ShapeError::TooManyParts { .. } => "too_many_content_parts",
    };
    let mut api = ApiError::new(StatusCode::BAD_REQUEST, code, error.to_string());
    api.param = Some(list);
    api
}

pub fn invalid_json(error: &serde_json::Error) -> ApiError {
    ApiError::new(
        StatusCode::BAD_REQUEST,
        "invalid_request",
        format!("the request body is not a valid chat completion request: {error}"),
    )
}
