//! `POST /v1/chat/completions`: routed by model name to the native core (a JSON reply, or an SSE
//! stream) or to the model's upstream pool, its media as the model's mode sends them
//! ([`super::media_modes`]).

use std::borrow::Cow;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use http::StatusCode;
use pingora::protocols::http::ServerSession;
use serde::Deserialize;
use serde_json::{Value, json};

use super::io::{EventStream, read_body, write_error, write_json};
use super::media_modes::{ModeCall, modalities};
use super::request::{checked_shape, invalid_json, parsed_off_thread};
use super::{Gateway, Route};
use crate::access::{Access, CLIENT_CLOSED, Tokens, UPSTREAM_FAILED_MID_ANSWER};
use crate::error::ApiError;
use crate::keylimits::TokenTally;
use crate::model::LocalModel;
use crate::native::chat::{self, Prepared};
use crate::native::generation::{Generation, Step};
use crate::prepare::items::ChatServices;
use crate::store::Caller;
use crate::upstream::{Forwarded, UpstreamPool};
use crate::wire::openai::{self, ChatCompletionRequest};

/// Characters of a requested model's name the access log keeps (a client may send any string).
pub(super) const MODEL_NAME_LOGGED: usize = 128;

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
        refused_if_client_error(outcome.as_ref().err().map(|(_, e)| e), tally);
        self.request_done(session, "/v1/chat/completions", started, outcome, access)
            .await;
    }

    /// A request on `path` that writes its own answer, done: the error answered if it failed,
    /// and the request counted and logged with the route it took.
    pub(super) async fn request_done(
        &self,
        session: &mut ServerSession,
        path: &'static str,
        started: Instant,
        outcome: Result<(&'static str, StatusCode), (&'static str, ApiError)>,
        mut access: Access,
    ) {
        let (route, status, code) = match &outcome {
            Ok((route, status)) => (*route, *status, None),
            Err((route, error)) => (*route, error.status, Some(error.code)),
        };
        if let Err((_, error)) = outcome {
            access.failed_with(&error);
            write_error(session, &error).await;
        }
        self.metrics
            .request_done(path, route, status, started.elapsed());
        access.log(path, route, status, code);
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
        checked_shape(&body, "messages", &self.limits, invalid_json)
            .await
            .map_err(|e| ("none", e))?;
        let routing: RoutingFields =
            serde_json::from_slice(&body).map_err(|e| ("none", invalid_json(&e)))?;
        access.model = Some(routing.model.chars().take(MODEL_NAME_LOGGED).collect());
        let caller = self.caller(session);
        match self.models.get(routing.model.as_ref()) {
            None => Err(("none", ApiError::model_not_found(&routing.model))),
            Some(Route::Upstream { pool, media }) => {
                let call = ModeCall {
                    pool,
                    services: self.services(&caller),
                    metrics: &self.metrics,
                };
                let (body, additions) = media
                    .prepare(&call, body.clone())
                    .await
                    .map_err(|e| ("upstream", e))?;
                let key = pool.balance_key(&body, routing.user.as_deref());
                let client = self.client_hop(session.client_addr());
                match pool
                    .forward(session, body.clone(), &key, &additions, &client, tally)
                    .await
                {
                    Forwarded::Answered(status) => Ok(("upstream", status)),
                    Forwarded::BrokeOff(status) => {
                        access.broke_off(UPSTREAM_FAILED_MID_ANSWER);
                        Ok(("upstream", status))
                    }
                    Forwarded::Failed(error) => Err(("upstream", error)),
                }
            }
            Some(Route::Native(model)) => {
                let request = parsed_off_thread(body, &self.limits)
                    .await
                    .map_err(|e| ("native", e))?;
                self.native(session, &caller, model, request, tally, access)
                    .await
                    .map(|status| ("native", status))
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
            Route::Upstream { pool, media } if media.relays_as_it_came(pool, body) => {
                Some((pool, routing.user.map(Cow::into_owned)))
            }
            _ => None,
        }
    }

    pub(super) fn services<'a>(&'a self, caller: &'a Caller) -> ChatServices<'a> {
        ChatServices {
            caller,
            registry: self.plugins.registry(),
            pool: &self.pool,
            limits: &self.limits,
            files: &self.files,
            fetcher: &self.fetcher,
            documents: &self.documents,
        }
    }

    /// The request's media fetched, preprocessed and budgeted for `model`, and counted in the metrics.
    pub(super) async fn prepare(
        &self,
        caller: &Caller,
        model: &LocalModel,
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
        model: &LocalModel,
        request: ChatCompletionRequest,
        tally: Option<&TokenTally>,
        access: &mut Access,
    ) -> Result<StatusCode, ApiError> {
        let prepared = self.prepare(caller, model, request).await?;
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
                    Step::Done { finish, usage, .. } => {
                        charge_usage(access, tally, &usage);
                        let reply =
                            openai::completion_json(&id, created, name, &text, finish, usage);
                        write_json(session, StatusCode::OK, &reply).await;
                        return Ok(StatusCode::OK);
                    }
                }
            }
        }

        // The first step decides the status: a failure before any token is still a proper error.
        let first = generation.next().await?;
        let Ok(mut events) = EventStream::start(session).await else {
            return Ok(CLIENT_CLOSED); // dropping the generation cancels it
        };
        let role = openai::chunk_json(
            &id,
            created,
            name,
            json!({"role": "assistant", "content": ""}),
            None,
        );
        if events.send(&role).await.is_err() {
            return Ok(CLIENT_CLOSED);
        }
        let mut step: Result<Step, ApiError> = Ok(first);
        loop {
            let sent = match step {
                Ok(Step::Text(delta)) => {
                    let chunk =
                        openai::chunk_json(&id, created, name, json!({"content": delta}), None);
                    events.send(&chunk).await
                }
                Ok(Step::Done { finish, usage, .. }) => {
                    charge_usage(access, tally, &usage);
                    let last = openai::chunk_json(&id, created, name, json!({}), Some(finish));
                    let mut sent = events.send(&last).await;
                    if include_usage && sent.is_ok() {
                        let chunk = openai::usage_chunk_json(&id, created, name, usage);
                        sent = events.send(&chunk).await;
                    }
                    if sent.is_ok() {
                        sent = events.send_raw("[DONE]").await;
                    }
                    if sent.is_err() {
                        return Ok(CLIENT_CLOSED);
                    }
                    let _ = events.finish().await;
                    return Ok(StatusCode::OK);
                }
                Err(error) => {
                    // Mid-stream the status is sent: the error goes as an event, then the stream ends.
                    let body: Value = serde_json::from_slice(&error.body()).unwrap_or(Value::Null);
                    if events.send(&body).await.is_ok() {
                        let _ = events.finish().await;
                    }
                    return Ok(StatusCode::OK);
                }
            };
            if sent.is_err() {
                // The client left: dropping the generation cancels it in the engine.
                return Ok(CLIENT_CLOSED);
            }
            step = generation.next().await;
        }
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
                        model["responses"] = json!("native");
                        model["context_length"] = json!(m.runtime.prompt.context_length);
                        model["modalities"] = modalities(&m.runtime.prompt);
                    }
                    Route::Upstream { pool, media } => {
                        model["served_by"] = json!("upstream");
                        // `/v1/responses` reaches the engine as the chat completion it means.
                        model["responses"] = json!("chat_completions");
                        media.describe(&mut model);
                        model["upstreams"] = pool.health_json();
                    }
                }
                // Every model answers each API; a count before sending only where media are
                // planned here.
                let mut apis = vec!["/v1/chat/completions", "/v1/responses", "/v1/messages"];
                if self.planning_side(name).is_ok() {
                    apis.push("/v1/messages/count_tokens");
                }
                model["apis"] = json!(apis);
                model
            })
            .collect();
        json!({"object": "list", "data": data})
    }
}

/// What an answer used (its `usage`), told to the access line and charged to the key's `tally`.
pub(super) fn charge_usage(access: &mut Access, tally: Option<&TokenTally>, usage: &Value) {
    access.tokens = Some(Tokens::of_usage(usage));
    if let (Some(tally), Some(total)) = (tally, usage["total_tokens"].as_u64()) {
        tally.used(total);
    }
}

/// A request refused with a client error (4xx: `error`) ran nothing: `tally` charges it nothing.
pub(super) fn refused_if_client_error(error: Option<&ApiError>, tally: Option<&TokenTally>) {
    if let (Some(error), Some(tally)) = (error, tally)
        && error.status.is_client_error()
    {
        tally.refused();
    }
}

/// `chatcmpl-` + a random suffix (an id tells nothing of when it was made or of other requests).
fn completion_id() -> String {
    format!("chatcmpl-{:032x}", rand::random::<u128>())
}
