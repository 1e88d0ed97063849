//! `POST /v1/chat/completions`: routed by model name to the native core (a JSON reply, or an SSE
//! stream) or to the model's upstream pool (forwarded as it came, or with its images encoded here and
//! sent as embeddings).

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{HeaderValue, StatusCode};
use mmgate_inference::engine::EncodeInput;
use pingora::protocols::http::ServerSession;
use serde::Deserialize;
use serde_json::{Value, json};

use super::io::{EventStream, read_body, write_error, write_json};
use super::{Gateway, Route, UpstreamMedia};
use crate::access::{Access, Tokens};
use crate::config::{EncodeErrorPolicy, RequestLimits};
use crate::error::ApiError;
use crate::keylimits::TokenTally;
use crate::media::account::{self, MediaAccount};
use crate::native::chat::{self, ChatServices, Generation, NativeModel, Prepared, Step};
use crate::store::Caller;
use crate::upstream::{Forwarded, ReplyAdditions, UpstreamPool, embeds, inline, planned};
use crate::wire::openai::parts::{self, Rewrite};
use crate::wire::openai::{self, ChatCompletionRequest};
use mmgate_inference::families::MediaKind;
use mmgate_inference::prompt::PromptModel;

/// The reply header that carries the media accounts of a request whose media were planned or
/// encoded here for an upstream model (the reply itself is the upstream's).
const MEDIA_HEADER: &str = "x-mmgate-media";

/// The reply header that says how many prompt tokens this gateway planned for a request whose
/// media it planned for an upstream model: the upstream's `usage.prompt_tokens` must equal it.
const PROMPT_TOKENS_HEADER: &str = "x-mmgate-prompt-tokens";

/// The accounts as a header value. A header carries visible ASCII only: accounts that hold
/// anything else are left out.
fn accounts_header(accounts: &[MediaAccount]) -> Option<HeaderValue> {
    serde_json::to_string(&account::render(accounts))
        .ok()
        .and_then(|a| HeaderValue::from_str(&a).ok())
}

/// Characters of a requested model's name the access log keeps (a client may send any string).
const MODEL_NAME_LOGGED: usize = 128;

/// Just what routing needs; the rest of the body is left to whoever serves the model.
#[derive(Deserialize)]
struct RoutingFields<'a> {
    /// Borrowed from the body unless it has escapes.
    #[serde(borrow)]
    model: Cow<'a, str>,
    #[serde(default, borrow)]
    user: Option<Cow<'a, str>>,
}

impl Gateway {
    /// Answers a chat completion; what it used is told to `tally` (the caller's tokens per minute).
    pub(super) async fn chat_completions(
        &self,
        session: &mut ServerSession,
        tally: Option<&TokenTally>,
        mut access: Access,
    ) {
        let started = Instant::now();
        let outcome = self.chat_inner(session, tally, &mut access).await;
        let (route, status, code) = match &outcome {
            Ok((route, status)) => (*route, *status, None),
            Err((route, error)) => (*route, error.status, Some(error.code)),
        };
        if let Err((_, error)) = outcome {
            access.failed_with(&error);
            write_error(session, &error).await;
        }
        self.metrics
            .request_done("/v1/chat/completions", route, status, started.elapsed());
        access.log("/v1/chat/completions", route, status, code);
    }

    /// The route taken ("native", "upstream", or "none") and the status answered, or the error to
    /// answer with.
    async fn chat_inner(
        &self,
        session: &mut ServerSession,
        tally: Option<&TokenTally>,
        access: &mut Access,
    ) -> Result<(&'static str, StatusCode), (&'static str, ApiError)> {
        let body = read_body(session, self.limits.max_body_bytes)
            .await
            .map_err(|e| ("none", e))?;
        if let Some(tally) = tally {
            tally.request(body.len());
        }
        let routing: RoutingFields =
            serde_json::from_slice(&body).map_err(|e| ("none", invalid_json(&e)))?;
        access.model = Some(routing.model.chars().take(MODEL_NAME_LOGGED).collect());
        let caller = self.caller(session);
        match self.models.get(routing.model.as_ref()) {
            None => Err((
                "none",
                ApiError::new(
                    StatusCode::NOT_FOUND,
                    "model_not_found",
                    format!("the model {:?} does not exist", routing.model),
                ),
            )),
            Some(Route::Upstream { pool, media }) => {
                let (body, additions) = self
                    .for_upstream(&caller, pool, media, body.clone())
                    .await
                    .map_err(|e| ("upstream", e))?;
                let key = pool.balance_key(&body, routing.user.as_deref());
                let client = self.client_hop(session.client_addr());
                match pool
                    .forward(session, body.clone(), &key, &additions, &client, tally)
                    .await
                {
                    Forwarded::Answered(status) => Ok(("upstream", status)),
                    Forwarded::Failed(error) => Err(("upstream", error)),
                }
            }
            Some(Route::Native(model)) => {
                let request = parsed_off_thread(body, &self.limits)
                    .await
                    .map_err(|e| ("native", e))?;
                self.native(session, &caller, model, request, tally, access)
                    .await
                    .map(|()| ("native", StatusCode::OK))
                    .map_err(|e| ("native", e))
            }
        }
    }

    /// The pool a chat completion (`body`) can be relayed to as it came, and the key that picks a
    /// server: a model served upstream and not encoding here, a request with no media to fetch or
    /// check. `None` for everything else (including bodies that are not JSON: those get their
    /// error from [`Gateway::chat_completions`]).
    pub(super) fn passthrough_pool(&self, body: &[u8]) -> Option<(&UpstreamPool, Option<String>)> {
        let routing: RoutingFields = serde_json::from_slice(body).ok()?;
        match self.models.get(routing.model.as_ref())? {
            Route::Upstream {
                pool,
                media: UpstreamMedia::Forward,
            } if pool.upstream_model.is_none()
                && !inline::needs_a_look(body, pool.accept_image_embeds) =>
            {
                Some((pool, routing.user.map(Cow::into_owned)))
            }
            _ => None,
        }
    }

    fn services<'a>(&'a self, caller: &'a Caller) -> ChatServices<'a> {
        ChatServices {
            caller,
            registry: self.plugins.registry(),
            pool: &self.pool,
            limits: &self.limits,
            files: &self.files,
            fetcher: &self.fetcher,
        }
    }

    /// The request as an upstream model's server gets it, and what the answer gains here, as the
    /// model's `media` says: its images encoded here ([`Self::encode_for_upstream`]), its media
    /// planned here ([`Self::plan_for_upstream`]), or its URLs and uploads fetched and read here
    /// and sent as data URLs ([`inline`]; a request with neither goes as it came, unparsed).
    async fn for_upstream(
        &self,
        caller: &Caller,
        pool: &UpstreamPool,
        media: &UpstreamMedia,
        body: Bytes,
    ) -> Result<(Bytes, ReplyAdditions), ApiError> {
        let forward = matches!(media, UpstreamMedia::Forward);
        let renamed = pool.upstream_model.as_deref();
        if forward && renamed.is_none() && !inline::needs_a_look(&body, pool.accept_image_embeds) {
            return Ok((body, ReplyAdditions::default()));
        }
        let mut value: Value = serde_json::from_slice(&body).map_err(|e| invalid_json(&e))?;
        let (mut value, additions) = match media {
            UpstreamMedia::Embed(model) if embeds::encode_here(&value) => {
                self.encode_for_upstream(caller, model, value, body).await?
            }
            UpstreamMedia::Preprocess(prompt) if parts::media_parts(&value).next().is_some() => {
                self.plan_for_upstream(caller, pool, prompt, value, body)
                    .await?
            }
            _ => {
                let inlined =
                    inline::inline_media(&mut value, pool, &self.services(caller)).await?;
                if !inlined && renamed.is_none() {
                    return Ok((body, ReplyAdditions::default()));
                }
                (value, ReplyAdditions::default())
            }
        };
        if let Some(name) = renamed {
            value["model"] = Value::String(name.to_owned());
        }
        let body = serde_json::to_vec(&value)
            .map(Bytes::from)
            .map_err(|e| encode_failed(&e.to_string()))?;
        Ok((body, additions))
    }

    /// A request (`value`, parsed from `body`) for a model whose server runs its own processor,
    /// with media: planned here as for a native model (limits, the request-wide budget, each
    /// item's plan), each media part replaced by its item as planned ([`planned`]); the accounts
    /// and the prompt's token count go in the answer's headers, and in `usage.media` of a JSON
    /// answer.
    async fn plan_for_upstream(
        &self,
        caller: &Caller,
        pool: &UpstreamPool,
        prompt: &PromptModel,
        mut value: Value,
        body: Bytes,
    ) -> Result<(Value, ReplyAdditions), ApiError> {
        let request = parsed_off_thread(body, &self.limits).await?;
        let planned = chat::plan_for_upstream(
            prompt,
            pool.accept_image_embeds,
            request,
            &self.services(caller),
        )
        .await?;
        self.metrics.media_prepared(&planned.accounts);
        let mut rewrites = Vec::with_capacity(planned.parts.len());
        for (index, (kind, files)) in planned.parts.iter().enumerate() {
            rewrites.push(match files {
                Some(files) => Rewrite::Replace(planned::part(*kind, files).ok_or_else(|| {
                    ApiError::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "plugin_output_mismatch",
                        format!(
                            "media item {index}: its plugin reduced the {} to {} files",
                            kind.name(),
                            files.files.len()
                        ),
                    )
                })?),
                None => Rewrite::Keep,
            });
        }
        parts::rewrite(&mut value, rewrites);
        let mut additions = ReplyAdditions {
            headers: vec![(
                PROMPT_TOKENS_HEADER,
                HeaderValue::from(planned.prompt_tokens),
            )],
            usage_media: Some(Value::Array(account::render(&planned.accounts))),
        };
        if let Some(accounts) = accounts_header(&planned.accounts) {
            additions.headers.push((MEDIA_HEADER, accounts));
        }
        Ok((value, additions))
    }

    /// The request's media fetched, preprocessed and budgeted for `model`, and counted in the metrics.
    async fn prepare(
        &self,
        caller: &Caller,
        model: &NativeModel,
        request: ChatCompletionRequest,
    ) -> Result<Prepared, ApiError> {
        let prepared = chat::prepare(model, request, &self.services(caller)).await?;
        self.metrics.media_prepared(&prepared.media);
        Ok(prepared)
    }

    async fn native(
        &self,
        session: &mut ServerSession,
        caller: &Caller,
        model: &NativeModel,
        request: ChatCompletionRequest,
        tally: Option<&TokenTally>,
        access: &mut Access,
    ) -> Result<(), ApiError> {
        let prepared = self.prepare(caller, model, request).await?;
        let mut used = |usage: &Value| {
            access.tokens = Some(Tokens::of_usage(usage));
            if let (Some(tally), Some(total)) = (tally, usage["total_tokens"].as_u64()) {
                tally.used(total);
            }
        };
        let (stream, include_usage) = (prepared.stream, prepared.include_usage);
        let mut generation = Generation::start(model, prepared)?;
        let id = completion_id();
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let name = model.runtime.prompt.name.as_str();

        if !stream {
            let mut text = String::new();
            loop {
                match generation.next().await? {
                    Step::Text(delta) => text.push_str(&delta),
                    Step::Done { finish, usage } => {
                        used(&usage);
                        let reply =
                            openai::completion_json(&id, created, name, &text, finish, usage);
                        write_json(session, StatusCode::OK, &reply).await;
                        return Ok(());
                    }
                }
            }
        }

        // The first step decides the status: a failure before any token is still a proper error.
        let first = generation.next().await?;
        let Ok(mut events) = EventStream::start(session).await else {
            return Ok(()); // the client is gone; dropping the generation cancels it
        };
        let role = openai::chunk_json(
            &id,
            created,
            name,
            json!({"role": "assistant", "content": ""}),
            None,
        );
        if events.send(&role).await.is_err() {
            return Ok(());
        }
        let mut step: Result<Step, ApiError> = Ok(first);
        loop {
            let sent = match step {
                Ok(Step::Text(delta)) => {
                    let chunk =
                        openai::chunk_json(&id, created, name, json!({"content": delta}), None);
                    events.send(&chunk).await
                }
                Ok(Step::Done { finish, usage }) => {
                    used(&usage);
                    let last = openai::chunk_json(&id, created, name, json!({}), Some(finish));
                    let mut sent = events.send(&last).await;
                    if include_usage && sent.is_ok() {
                        let chunk = openai::usage_chunk_json(&id, created, name, usage);
                        sent = events.send(&chunk).await;
                    }
                    if sent.is_ok() {
                        sent = events.send_raw("[DONE]").await;
                    }
                    if sent.is_ok() {
                        let _ = events.finish().await;
                    }
                    return Ok(());
                }
                Err(error) => {
                    // Mid-stream the status is sent: the error goes as an event, then the stream ends.
                    let body: Value = serde_json::from_slice(&error.body()).unwrap_or(Value::Null);
                    if events.send(&body).await.is_ok() {
                        let _ = events.finish().await;
                    }
                    return Ok(());
                }
            };
            if sent.is_err() {
                // The client left: dropping the generation cancels it in the engine.
                return Ok(());
            }
            step = generation.next().await;
        }
    }

    /// A request (`value`, parsed from `body`) for a model whose LLM runs upstream, with its images
    /// encoded here: preprocessed and budgeted as for a native model, encoded on this model's
    /// encoder devices, and sent on with `image_embeds` parts in place of the images; and the media
    /// accounts (`usage.media` of a native model) for the [`MEDIA_HEADER`] of the reply.
    async fn encode_for_upstream(
        &self,
        caller: &Caller,
        model: &NativeModel,
        mut value: Value,
        body: Bytes,
    ) -> Result<(Value, ReplyAdditions), ApiError> {
        let request = chat_request(&body)?;
        drop(body);
        let prepared = self.prepare(caller, model, request).await?;
        let (items, accounts) = prepared.into_media();

        // Every item goes to the encoder devices at once; they batch what they can.
        let mut encoding = Vec::with_capacity(items.len());
        for item in items {
            let (done, result) = tokio::sync::oneshot::channel();
            model
                .runtime
                .encoders
                .submit_shared(item.input.clone(), item.share_key, move |r| {
                    let _ = done.send(r);
                })
                .map_err(|e| encode_failed(&e.to_string()))?;
            encoding.push((item, result));
        }
        let mut encoding = encoding.into_iter();
        let mut rewrites = Vec::with_capacity(accounts.len());
        for (index, account) in accounts.iter().enumerate() {
            if account.dropped.is_some() {
                rewrites.push(Rewrite::Drop);
                continue;
            }
            let Some((item, result)) = encoding.next() else {
                return Err(encode_failed("a media item was not encoded"));
            };
            let grid = match item.input.as_ref() {
                EncodeInput::Vision { grid, .. }
                | EncodeInput::Embeddings {
                    grid: Some(grid), ..
                } if account.kind == MediaKind::Image => *grid,
                _ => {
                    return Err(ApiError::new(
                        StatusCode::BAD_REQUEST,
                        "invalid_request",
                        format!(
                            "media item {index} is {}: model {} encodes only images for its upstream; send video and audio as video_url, audio_url or input_audio parts",
                            account.kind.name(),
                            model.runtime.prompt.name
                        ),
                    ));
                }
            };
            let failure = match result.await {
                Ok(Ok(features)) => {
                    let part = embeds::part(&features, model.runtime.prompt.embedding_width, grid)
                        .map_err(|e| encode_failed(&e.to_string()))?;
                    rewrites.push(Rewrite::Replace(part));
                    continue;
                }
                Ok(Err(message)) => message,
                Err(_) => "the encoder device stopped".to_owned(),
            };
            if model.on_encode_error == EncodeErrorPolicy::Drop {
                tracing::warn!(item = index, error = %failure, "encoding failed; dropping the media");
                rewrites.push(Rewrite::Drop);
            } else {
                return Err(encode_failed(&format!("media item {index}: {failure}")));
            }
        }
        parts::rewrite(&mut value, rewrites);
        let additions = ReplyAdditions {
            headers: accounts_header(&accounts)
                .map(|a| (MEDIA_HEADER, a))
                .into_iter()
                .collect(),
            usage_media: None,
        };
        Ok((value, additions))
    }

    /// `GET /v1/models`
    pub(super) fn models_json(&self) -> Value {
        let data: Vec<Value> = self
            .models
            .iter()
            .map(|(name, route)| {
                let mut model = json!({
                    "id": name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "mmgate",
                });
                match route {
                    Route::Native(m) => {
                        model["served_by"] = json!("native");
                        model["context_length"] = json!(m.runtime.prompt.context_length);
                        model["modalities"] = json!(
                            m.runtime
                                .prompt
                                .media_kinds()
                                .iter()
                                .map(|k| k.name())
                                .collect::<Vec<_>>()
                        );
                    }
                    Route::Upstream { pool, media } => {
                        model["served_by"] = json!("upstream");
                        model["media"] = json!(media.name());
                        match media {
                            UpstreamMedia::Embed(m) => {
                                model["images_encoded_here"] = json!(true);
                                model["context_length"] = json!(m.runtime.prompt.context_length);
                            }
                            UpstreamMedia::Preprocess(prompt) => {
                                model["context_length"] = json!(prompt.context_length);
                                model["modalities"] = json!(
                                    prompt
                                        .media_kinds()
                                        .iter()
                                        .map(|k| k.name())
                                        .collect::<Vec<_>>()
                                );
                            }
                            UpstreamMedia::Forward => {}
                        }
                        model["upstreams"] = pool.health_json();
                    }
                }
                model
            })
            .collect();
        json!({"object": "list", "data": data})
    }
}

fn encode_failed(message: &str) -> ApiError {
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "encode_failed",
        message.to_owned(),
    )
}

/// The body as a chat completion request, every route's way.
fn chat_request(body: &[u8]) -> Result<ChatCompletionRequest, ApiError> {
    serde_json::from_slice(body).map_err(|e| invalid_json(&e))
}

/// Bodies from which size [`parsed_off_thread`] parses on a blocking thread.
const BODY_WORTH_A_THREAD: usize = 1 << 20;

/// [`chat_request`], on a blocking thread for a large body: parsing megabytes holds up every
/// other connection of the thread that serves this one. A body larger than the text limit is
/// first read for its text's size alone (no copy of it): one over the limit is refused before
/// its text is copied out of the body.
async fn parsed_off_thread(
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
                return Err(chat::text_too_large(bytes, max_text_bytes));
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

fn invalid_json(error: &serde_json::Error) -> ApiError {
    ApiError::new(
        StatusCode::BAD_REQUEST,
        "invalid_request",
        format!("the request body is not a valid chat completion request: {error}"),
    )
}

/// `chatcmpl-` + a process-unique suffix.
fn completion_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "chatcmpl-{:08x}{:08x}",
        nanos,
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}
