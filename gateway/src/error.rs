//! One mapping from everything that can go wrong in a request to an OpenAI-shaped JSON error:
//! `{"error": {"message", "type", "param", "code"}}` with the right HTTP status.

use http::StatusCode;
use mmgate_host::{CallError, PluginError};
use serde_json::json;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    /// OpenAI's `type`: `invalid_request_error`, `server_error`, ...
    pub kind: &'static str,
    /// A stable machine-readable code.
    pub code: &'static str,
    pub message: String,
    /// The request field at fault, when there is one.
    pub param: Option<&'static str>,
    /// Seconds after which a retry may succeed (`Retry-After`), for 429 and 503 answers.
    pub retry_after: Option<u64>,
    /// The methods the path takes (`Allow`), for 405 answers.
    pub allow: Option<&'static str>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        let kind = if status.is_server_error() {
            "server_error"
        } else {
            "invalid_request_error"
        };
        ApiError {
            status,
            kind,
            code,
            message: message.into(),
            param: None,
            retry_after: None,
            allow: None,
        }
    }

    pub fn not_found(path: &str) -> ApiError {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no route for {path}"),
        )
    }

    /// A request for a model this gateway does not serve.
    pub fn model_not_found(model: &str) -> ApiError {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "model_not_found",
            format!("the model {model:?} does not exist"),
        )
    }

    /// `method` on `path`, which takes only the methods `allow` lists (RFC 9110: a 405 says which).
    pub fn method_not_allowed(method: &str, path: &str, allow: &'static str) -> ApiError {
        let mut error = ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            format!("{method} is not allowed on {path}; it takes {allow}"),
        );
        error.allow = Some(allow);
        error
    }

    pub fn body(&self) -> Vec<u8> {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
        .to_string()
        .into_bytes()
    }
}

/// The `Retry-After` of a plugin call stopped by its deadline.
const SERVER_BUSY_RETRY_SECONDS: u64 = 2;

impl From<&CallError> for ApiError {
    fn from(error: &CallError) -> ApiError {
        let message = error.to_string();
        match error {
            CallError::Plugin(plugin_error) => match plugin_error {
                PluginError::Unsupported(_) => ApiError::new(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "unsupported_media",
                    message,
                ),
                PluginError::InvalidMedia(_) => {
                    ApiError::new(StatusCode::BAD_REQUEST, "invalid_media", message)
                }
                PluginError::OverBudget(_) => {
                    ApiError::new(StatusCode::BAD_REQUEST, "context_length_exceeded", message)
                }
                PluginError::LimitExceeded(_) => {
                    ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "media_too_large", message)
                }
                PluginError::Internal(_) => {
                    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "plugin_error", message)
                }
            },
            // The media's cost is bounded by the limits (checked on what the client sent): a call
            // that still ran out of time is a stuck plugin or a server too busy, never the
            // client's fault; a retry may well succeed.
            CallError::Deadline(_) => {
                let mut api =
                    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_busy", message);
                api.retry_after = Some(SERVER_BUSY_RETRY_SECONDS);
                api
            }
            CallError::Memory { .. } | CallError::OutputTooLarge { .. } => {
                ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "media_too_large", message)
            }
            CallError::Overloaded { .. } => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "overloaded", message)
            }
            CallError::Trap(_) | CallError::Contract(_) | CallError::Host(_) => {
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "plugin_failed", message)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plugin_errors_map_to_client_statuses_and_crashes_to_server_errors() {
        let invalid = CallError::Plugin(PluginError::InvalidMedia("truncated".into()));
        assert_eq!(ApiError::from(&invalid).status, StatusCode::BAD_REQUEST);
        let trap = CallError::Trap("unreachable".into());
        let api = ApiError::from(&trap);
        assert_eq!(api.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(api.kind, "server_error");
        let body: serde_json::Value = serde_json::from_slice(&api.body()).unwrap();
        assert_eq!(body["error"]["code"], "plugin_failed");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("unreachable")
        );
    }

    #[test]
    fn a_deadline_is_the_servers_status_with_a_retry() {
        let passed = CallError::Deadline(mmgate_host::DeadlinePassed {
            plugin: "video".into(),
            call: "preprocess-part",
            clock: mmgate_host::DeadlineClock::PluginCpu,
            limit: std::time::Duration::from_secs(10),
            spent: std::time::Duration::from_millis(10_004),
        });
        let api = ApiError::from(&passed);
        assert_eq!(api.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!((api.code, api.retry_after), ("server_busy", Some(2)));
        assert!(
            api.message.contains("video") && api.message.contains("preprocess-part"),
            "{}",
            api.message
        );
    }
}
