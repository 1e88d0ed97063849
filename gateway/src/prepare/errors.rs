//! The errors of a natively planned request, OpenAI-shaped: what the client sent (4xx), what the
//! model or its plugins could not do (5xx).

use http::StatusCode;

use crate::error::ApiError;

/// Item `item`'s plugin call failed.
pub(crate) fn plugin_failed(item: usize, error: &mmgate_host::CallError) -> ApiError {
    let mut api = ApiError::from(error);
    api.message = format!("media item {item}: {}", api.message);
    api
}

/// A plugin's output for item `index` that the model's encoder cannot take.
pub(crate) fn unencodable(index: usize, e: &anyhow::Error) -> ApiError {
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "plugin_output_mismatch",
        format!("media item {index}: {e:#}"),
    )
}

pub(crate) fn invalid(param: &'static str, message: impl Into<String>) -> ApiError {
    let mut error = ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", message);
    error.param = Some(param);
    error
}

/// A medium of a kind its part, or the model, does not take: one code whatever the part's type.
pub(crate) fn unsupported_media(message: String) -> ApiError {
    let mut error = ApiError::new(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported_media",
        message,
    );
    error.param = Some("messages");
    error
}

pub(crate) fn internal(message: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal_error", message)
}

pub(crate) fn context_exceeded(message: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, "context_length_exceeded", message)
}

/// The answer to an `image_embeds` part for a model that does not take them.
pub fn embeds_refused(model: &str) -> ApiError {
    let mut error = ApiError::new(
        StatusCode::BAD_REQUEST,
        "image_embeds_not_accepted",
        format!(
            "model {model} does not take image_embeds parts: send the image itself (its operator can allow embeddings with accept_image_embeds = true)"
        ),
    );
    error.param = Some("messages");
    error
}

pub(crate) fn too_large(index: usize, bytes: usize, limit: usize) -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "media_too_large",
        format!("media item {index} is {bytes} bytes; the limit is {limit}"),
    )
}
