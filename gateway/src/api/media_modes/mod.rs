//! What an upstream model's servers get of a request's media: the model's `media` setting, chosen
//! when the model is loaded, one module per dialect — [`forward`] (the media as they came, URLs and
//! uploads inlined), [`preprocess`] (each item as planned here, the token count a promise the
//! server keeps), [`embed`] (images encoded here and sent as embeddings) and [`ec`] (encoded here
//! and handed to vLLM through its EC connector).

mod ec;
mod embed;
mod forward;
pub(super) mod preprocess;

use bytes::Bytes;
use http::{HeaderValue, StatusCode};
use serde_json::{Value, json};

use super::request::invalid_json;
use crate::error::ApiError;
use crate::media::account::{self, MediaAccount};
use crate::metrics::Metrics;
use crate::model::LocalModel;
use crate::prepare::items::ChatServices;
use crate::upstream::{ReplyAdditions, UpstreamPool, inline};
use crate::wire::openai::parts::{self, Rewrite};
use mmgate_inference::prompt::PromptModel;

/// The reply header that carries the media accounts of a request whose media were planned or
/// encoded here for an upstream model (the reply itself is the upstream's).
const MEDIA_HEADER: &str = "x-mmgate-media";

/// The reply header that says how many prompt tokens this gateway planned for a request whose
/// media it planned (or encoded) for an upstream model: the upstream's `usage.prompt_tokens` must
/// equal it.
pub(super) const PROMPT_TOKENS_HEADER: &str = "x-mmgate-prompt-tokens";

/// Rewrites the body's media parts with each item's rewrite (`rewrites`, one per account, in
/// order): a document's pages, the items of one part, go together in that part's place.
fn rewrite_parts(value: &mut Value, rewrites: Vec<Rewrite>, accounts: &[MediaAccount]) {
    let mut per_part = Vec::with_capacity(rewrites.len());
    let mut pages: Option<(usize, Vec<Value>)> = None;
    for (rewrite, account) in rewrites.into_iter().zip(accounts) {
        let Some(document) = account.page.as_ref().map(|p| p.document) else {
            per_part.extend(pages.take().map(|(_, parts)| Rewrite::Many(parts)));
            per_part.push(rewrite);
            continue;
        };
        if pages.as_ref().is_some_and(|(d, _)| *d != document) {
            per_part.extend(pages.take().map(|(_, parts)| Rewrite::Many(parts)));
        }
        let (_, parts) = pages.get_or_insert_with(|| (document, Vec::new()));
        match rewrite {
            Rewrite::Replace(part) => parts.push(part),
            Rewrite::Many(more) => parts.extend(more),
            // A page dropped leaves; a page has no part of its own to keep.
            Rewrite::Drop | Rewrite::Keep => {}
        }
    }
    per_part.extend(pages.map(|(_, parts)| Rewrite::Many(parts)));
    parts::rewrite(value, per_part);
}

fn prompt_tokens_header(tokens: usize) -> (&'static str, HeaderValue) {
    (PROMPT_TOKENS_HEADER, HeaderValue::from(tokens))
}

/// The headers of a request whose media were encoded here: the accounts, and the promise unless
/// an item was dropped after its encoding failed (its chat template's text around it is then
/// counted only upstream).
fn encoded_headers(
    accounts: &[MediaAccount],
    prompt_tokens: usize,
    dropped_here: bool,
) -> Vec<(&'static str, HeaderValue)> {
    let mut headers: Vec<_> = accounts_header(accounts).into_iter().collect();
    if !dropped_here {
        headers.push(prompt_tokens_header(prompt_tokens));
    }
    headers
}

/// The media kinds a model's prompts take, by name (`modalities` of `GET /v1/models`).
pub fn modalities(prompt: &PromptModel) -> Value {
    json!(
        prompt
            .media_kinds()
            .iter()
            .map(|k| k.name())
            .collect::<Vec<_>>()
    )
}

/// What an upstream model's servers get of a request's media (the config's `media`).
// One per served model, made at start and never moved after: boxing would only add a pointer hop.
#[allow(clippy::large_enum_variant)]
pub enum UpstreamMedia {
    /// The media as they came (URLs and uploads inlined).
    Forward,
    /// The media as planned here for this prompt side of the model (no weights loaded).
    Preprocess(PromptModel),
    /// Images encoded here, by this model's encoders, and sent as embeddings; a request with
    /// media that have no embeddings form (video, audio) is planned here as `Preprocess` plans it,
    /// with `planned`, the prompt side of the model's server.
    Embed {
        model: LocalModel,
        planned: PromptModel,
    },
    /// Media encoded here and written where vLLM's EC connector reads them; a request with an
    /// item its consumer cannot place from metadata is planned as `Preprocess` plans it.
    Ec { ec: EcMedia, planned: PromptModel },
}

pub use ec::EcMedia;

/// What a mode works with for one request.
pub struct ModeCall<'a> {
    pub pool: &'a UpstreamPool,
    pub services: ChatServices<'a>,
    pub metrics: &'a Metrics,
}

impl UpstreamMedia {
    pub fn name(&self) -> &'static str {
        match self {
            Self::Forward => "forward",
            Self::Preprocess(_) => "preprocess",
            Self::Embed { .. } => "embed",
            Self::Ec { .. } => "ec",
        }
    }

    /// The model whose encoders run here for this mode, if any.
    pub fn encoders(&self) -> Option<&LocalModel> {
        match self {
            Self::Embed { model, .. } => Some(model),
            Self::Ec { ec, .. } => Some(&ec.model),
            Self::Forward | Self::Preprocess(_) => None,
        }
    }

    /// Whether a chat completion `body` can be relayed as it came, unparsed: forwarded media,
    /// nothing to fetch or check, no model name to rewrite.
    pub fn relays_as_it_came(&self, pool: &UpstreamPool, body: &[u8]) -> bool {
        matches!(self, Self::Forward)
            && pool.upstream_model.is_none()
            && !inline::needs_a_look(body, pool.accept_image_embeds)
    }

    /// The request as the upstream's server gets it, and what the answer gains here. A request
    /// the mode has nothing to do for goes as [`forward`] sends it.
    pub async fn prepare(
        &self,
        call: &ModeCall<'_>,
        body: Bytes,
    ) -> Result<(Bytes, ReplyAdditions), ApiError> {
        if self.relays_as_it_came(call.pool, &body) {
            return Ok((body, ReplyAdditions::default()));
        }
        let value: Value = serde_json::from_slice(&body).map_err(|e| invalid_json(&e))?;
        let value = match self {
            Self::Ec { ec, .. } if preprocess::has_media(&value) => {
                match ec::prepare(ec, call, value, body.clone()).await? {
                    ec::Outcome::Carried(value, additions) => {
                        return upstream_body(call, value, additions);
                    }
                    ec::Outcome::NotCarried(value) => value,
                }
            }
            _ => value,
        };
        let (value, additions, changed) = match self {
            Self::Embed { model, .. } if embed::encodes_here(&value) => {
                let (value, additions) = embed::prepare(model, call, value, body.clone()).await?;
                (value, additions, true)
            }
            Self::Embed {
                planned: prompt, ..
            }
            | Self::Ec {
                planned: prompt, ..
            }
            | Self::Preprocess(prompt)
                if preprocess::has_media(&value) =>
            {
                let (value, additions) =
                    preprocess::prepare(prompt, call, value, body.clone()).await?;
                (value, additions, true)
            }
            _ => {
                let (value, inlined) = forward::prepare(call, value).await?;
                (value, ReplyAdditions::default(), inlined)
            }
        };
        if !changed && call.pool.upstream_model.is_none() {
            return Ok((body, ReplyAdditions::default()));
        }
        upstream_body(call, value, additions)
    }

    /// What `GET /v1/models` says of the model's media beside its upstreams.
    pub fn describe(&self, model: &mut Value) {
        model["media"] = json!(self.name());
        match self {
            Self::Embed { model: m, .. } => {
                model["images_encoded_here"] = json!(true);
                model["context_length"] = json!(m.runtime.prompt.context_length);
            }
            Self::Ec { ec, .. } => {
                let prompt = &ec.model.runtime.prompt;
                model["context_length"] = json!(prompt.context_length);
                model["modalities"] = modalities(prompt);
                let (held, pinned) = ec.store.held_bytes();
                model["ec_storage"] =
                    json!({"dir": ec.store.dir(), "held_bytes": held, "pinned_bytes": pinned});
            }
            Self::Preprocess(prompt) => {
                model["context_length"] = json!(prompt.context_length);
                model["modalities"] = modalities(prompt);
            }
            Self::Forward => {}
        }
    }
}

/// The request as it goes upstream: under the upstream's name for the model, serialized.
fn upstream_body(
    call: &ModeCall<'_>,
    mut value: Value,
    additions: ReplyAdditions,
) -> Result<(Bytes, ReplyAdditions), ApiError> {
    if let Some(name) = call.pool.upstream_model.as_deref() {
        value["model"] = Value::String(name.to_owned());
    }
    let body = serde_json::to_vec(&value)
        .map(Bytes::from)
        .map_err(|e| encode_failed(&e.to_string()))?;
    Ok((body, additions))
}

/// The accounts as a header value. A header carries visible ASCII only: accounts that hold
/// anything else are left out.
fn accounts_header(accounts: &[MediaAccount]) -> Option<(&'static str, HeaderValue)> {
    serde_json::to_string(&account::render(accounts))
        .ok()
        .and_then(|a| HeaderValue::from_str(&a).ok())
        .map(|value| (MEDIA_HEADER, value))
}

fn encode_failed(message: &str) -> ApiError {
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "encode_failed",
        message.to_owned(),
    )
}
