//! `media = "forward"`: the media go as they came, but for what this gateway must vouch for — every
//! http(s) URL is fetched and every upload read here and sent as a data URL (see [`inline`]), so
//! the SSRF guard, byte limits and file store apply whichever route serves the model.

use serde_json::Value;

use super::ModeCall;
use crate::error::ApiError;
use crate::upstream::inline;

/// The request with its URLs and uploads inlined, and whether anything changed.
pub async fn prepare(call: &ModeCall<'_>, mut value: Value) -> Result<(Value, bool), ApiError> {
    let inlined = inline::inline_media(&mut value, call.pool, &call.services).await?;
    Ok((value, inlined))
}
