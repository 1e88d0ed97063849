//! `POST /v1/responses` (OpenAI's Responses API), `GET` and `DELETE /v1/responses/{id}`.
//!
//! A Responses request means a chat completion ([`crate::wire::openai::responses`]): it is
//! translated into one and served as chat is, by the native core or by the model's upstream (asked
//! for a chat completion, its media as the model's mode sends them, its answer streamed back and
//! translated), under the same budget, plugins, limits and guards. Either way the answer comes as
//! steps of text ([`Step`]), which are written as a response object or as its event stream, and
//! kept with the conversation when the request asks for `store`.

use std::collections::VecDeque;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::StatusCode;
use pingora::protocols::http::ServerSession;
use serde_json::{Value, json};

use super::chat::{MODEL_NAME_LOGGED, refused_if_client_error};
use super::io::{EventStream, read_body, write_json_with};
use super::media_modes::ModeCall;
use super::request::{checked_shape, off_thread_if_large, shape_error};
use super::{Gateway, Route};
use crate::access::{Access, CLIENT_CLOSED, Tokens};
use crate::error::ApiError;
use crate::keylimits::TokenTally;
use crate::native::generation::{Generation, Step};
use crate::prepare::errors::invalid;
use crate::responses_store::Conversation;
use crate::store::Caller;
use crate::upstream::{Exchange, UpstreamPool};
use crate::wire::openai::ChatCompletionRequest;
use crate::wire::openai::responses::{ResponseObject, ResponsesRequest, output_text};
use crate::wire::openai::shape;

const ROUTE: &str = "/v1/responses";

impl Gateway {
    /// Answers a Responses request; what it used is told to `tally`.
    pub(super) async fn responses(
        &self,
        session: &mut ServerSession,
        tally: Option<&TokenTally>,
        mut access: Access,
    ) {
        let started = Instant::now();
        let outcome = self
            .responses_inner(session, tally, &mut access)
            .await
            .map_err(|(route, mut error)| {
                // The chat machinery names the chat field; here the client wrote `input`.
                if error.param == Some("messages") {
                    error.param = Some("input");
                }
                (route, error)
            });
        refused_if_client_error(outcome.as_ref().err().map(|(_, e)| e), tally);
        self.request_done(session, ROUTE, started, outcome, access)
            .await;
    }

    async fn responses_inner(
        &self,
        session: &mut ServerSession,
        tally: Option<&TokenTally>,
        access: &mut Access,
    ) -> Result<(&'static str, StatusCode), (&'static str, ApiError)> {
        let none = |e| ("none", e);
        let body = read_body(session, self.limits.max_body_bytes)
            .await
            .map_err(none)?;
        if let Some(tally) = tally {
            tally.request(body.len());
        }
        checked_shape(&body, "input", &self.limits, not_a_responses_request)
            .await
            .map_err(none)?;
        // Parsing megabytes holds up the connection's thread: a large body is parsed off it.
        let mut request: ResponsesRequest = off_thread_if_large(&body, |body| {
            serde_json::from_slice(&body).map_err(|e| not_a_responses_request(&e))
        })
        .await
        .map_err(none)?;
        access.model = Some(request.model.chars().take(MODEL_NAME_LOGGED).collect());
        let caller = self.caller(session);
        let Some(route) = self.models.get(&request.model) else {
            return Err(none(ApiError::new(
                StatusCode::NOT_FOUND,
                "model_not_found",
                format!("the model {:?} does not exist", request.model),
            )));
        };
        let history = match &request.previous_response_id {
            None => Vec::new(),
            Some(id) => {
                let kept = self
                    .responses
                    .get(&caller, id)
                    .await
                    .map_err(|e| none(e.into()))?;
                let Some(kept) = kept else {
                    let mut error = ApiError::new(
                        StatusCode::NOT_FOUND,
                        "previous_response_not_found",
                        format!(
                            "no stored response {} (never stored, expired or deleted)",
                            shown_id(id)
                        ),
                    );
                    error.param = Some("previous_response_id");
                    return Err(none(error));
                };
                kept.conversation
            }
        };
        let earlier = history.len();
        // Converting a large input to chat messages holds up the connection's thread as parsing
        // it would: it goes off it too.
        let limits = self.limits.shape();
        let (request, conversation, chat) = off_thread_if_large(&body, move |_| {
            let conversation = request
                .conversation(history)
                .map_err(|e| invalid(e.param, e.message))?;
            // Kept turns count too: a follow-up may not grow a conversation past what one request
            // may hold.
            shape::check_values(&conversation, "input", limits)
                .map_err(|e| shape_error(e, "input", not_a_responses_request))?;
            let chat = request.chat_body(&conversation);
            Ok((request, conversation, chat))
        })
        .await
        .map_err(none)?;
        let turn = Turn::new(&request, earlier);
        let (label, steps, headers) = match route {
            Route::Native(model) => {
                let label = "native";
                let parsed: ChatCompletionRequest = serde_json::from_value(chat)
                    .map_err(|e| (label, invalid("input", e.to_string())))?;
                let prepared = self
                    .prepare(&caller, model, parsed)
                    .await
                    .map_err(|e| (label, e))?;
                let generation = Generation::start(model, prepared).map_err(|e| (label, e))?;
                (label, Steps::Native(Box::new(generation)), Vec::new())
            }
            Route::Upstream { pool, media } => {
                let label = "upstream";
                let call = ModeCall {
                    pool,
                    services: self.services(&caller),
                    metrics: &self.metrics,
                };
                let mut sent = chat;
                // The upstream always streams: the answer is translated as it comes.
                sent["stream"] = json!(true);
                sent["stream_options"] = json!({"include_usage": true});
                let (sent, additions) = media
                    .prepare(&call, Bytes::from(sent.to_string()))
                    .await
                    .map_err(|e| (label, e))?;
                let exchange = self
                    .chat_upstream(session, pool, &sent, request.user.as_deref())
                    .await
                    .map_err(|e| (label, e))?;
                let headers: Vec<(&str, String)> = additions
                    .headers
                    .iter()
                    .filter_map(|(name, value)| Some((*name, value.to_str().ok()?.to_owned())))
                    .collect();
                let steps = Steps::Upstream(Box::new(UpstreamSteps {
                    exchange: Some(exchange),
                    pending: Vec::new(),
                    text: VecDeque::new(),
                    finish: None,
                    done: None,
                    usage_media: additions.usage_media,
                    _held: additions.held,
                    pool,
                }));
                (label, steps, headers)
            }
        };
        self.answer(
            session,
            &caller,
            &turn,
            conversation,
            steps,
            &headers,
            tally,
            access,
        )
        .await
        .map(|status| (label, status))
        .map_err(|e| (label, e))
    }

    /// Sends the chat completion `body` to `pool`'s `/v1/chat/completions`: its answer's head,
    /// read; a failure (the upstream's own error answer included) is the error to answer with.
    async fn chat_upstream(
        &self,
        session: &ServerSession,
        pool: &UpstreamPool,
        body: &Bytes,
        user: Option<&str>,
    ) -> Result<Exchange, ApiError> {
        let mut header = session.req_header().clone();
        header.set_uri(http::Uri::from_static("/v1/chat/completions"));
        let key = pool.balance_key(body, user).into_owned();
        let client = self.client_hop(session.client_addr());
        let mut exchange = pool.exchange(&header, body, &key, &client).await?;
        let status = exchange
            .upstream
            .resp_header()
            .map_or(StatusCode::BAD_GATEWAY, |h| h.status);
        if status.is_success() {
            return Ok(exchange);
        }
        // The upstream's error, in the same OpenAI shape, with its status.
        let answer = exchange
            .read_whole(pool.answer_timeout())
            .await
            .unwrap_or_default();
        let message = serde_json::from_slice::<Value>(&answer)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
            .unwrap_or_else(|| String::from_utf8_lossy(&answer).into_owned());
        Err(ApiError::new(
            status,
            "upstream_error",
            format!("the model's upstream answered {status}: {message}"),
        ))
    }

    /// Writes the answer `steps` make: a response object, or its event stream; keeps it with
    /// `conversation` (its input after the earlier turns) when asked to.
    #[allow(clippy::too_many_arguments)]
    async fn answer(
        &self,
        session: &mut ServerSession,
        caller: &Caller,
        turn: &Turn<'_>,
        conversation: Vec<Value>,
        mut steps: Steps<'_>,
        headers: &[(&str, String)],
        tally: Option<&TokenTally>,
        access: &mut Access,
    ) -> Result<StatusCode, ApiError> {
        let object = turn.object();
        let mut used = |usage: &Value| {
            access.tokens = Some(Tokens::of_usage(usage));
            if let (Some(tally), Some(total)) = (tally, usage["total_tokens"].as_u64()) {
                tally.used(total);
            }
        };
        let headers: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
        if !turn.request.stream {
            let mut text = String::new();
            loop {
                match steps.next().await? {
                    Step::Text(delta) => text.push_str(&delta),
                    Step::Done { finish, usage } => {
                        used(&usage);
                        let response = object.finished(&text, finish, &usage);
                        self.keep(caller, turn, conversation, &response, &text)
                            .await?;
                        write_json_with(session, StatusCode::OK, &response, &headers).await;
                        return Ok(StatusCode::OK);
                    }
                }
            }
        }

        // The first step decides the status: a failure before any text is still a proper error.
        let first = steps.next().await?;
        let Ok(mut events) = EventStream::start_with(session, &headers).await else {
            return Ok(CLIENT_CLOSED);
        };
        let mut sequence = 0u64;
        let mut send = async |events: &mut EventStream<'_>, kind: &str, mut event: Value| {
            event["type"] = json!(kind);
            event["sequence_number"] = json!(sequence);
            sequence += 1;
            events.send_event(kind, &event).await
        };
        let (item, part) = (json!({"item_id": turn.message_id, "output_index": 0}), 0);
        let with = |mut base: Value, more: Value| {
            for (k, v) in more.as_object().into_iter().flatten() {
                base[k] = v.clone();
            }
            base
        };
        let in_progress = object.json("in_progress", None, None);
        let opening = [
            ("response.created", json!({"response": in_progress})),
            ("response.in_progress", json!({"response": in_progress})),
            (
                "response.output_item.added",
                json!({"output_index": 0, "item": object.message("", "in_progress")}),
            ),
            (
                "response.content_part.added",
                with(
                    item.clone(),
                    json!({"content_index": part, "part": output_text("")}),
                ),
            ),
        ];
        for (kind, event) in opening {
            if send(&mut events, kind, event).await.is_err() {
                return Ok(CLIENT_CLOSED); // dropping the steps cancels the generation
            }
        }
        let mut text = String::new();
        let mut step: Result<Step, ApiError> = Ok(first);
        loop {
            let sent = match step {
                Ok(Step::Text(delta)) => {
                    text.push_str(&delta);
                    let delta = with(
                        item.clone(),
                        json!({"content_index": part, "delta": delta, "logprobs": []}),
                    );
                    send(&mut events, "response.output_text.delta", delta).await
                }
                Ok(Step::Done { finish, usage }) => {
                    used(&usage);
                    let response = object.finished(&text, finish, &usage);
                    // Kept before it is announced complete: a follow-up may come at once.
                    let kept = self
                        .keep(caller, turn, conversation, &response, &text)
                        .await;
                    let closing = [
                        (
                            "response.output_text.done",
                            with(
                                item.clone(),
                                json!({"content_index": part, "text": text, "logprobs": []}),
                            ),
                        ),
                        (
                            "response.content_part.done",
                            with(
                                item.clone(),
                                json!({"content_index": part, "part": output_text(&text)}),
                            ),
                        ),
                        (
                            "response.output_item.done",
                            json!({"output_index": 0, "item": response["output"][0]}),
                        ),
                    ];
                    for (kind, event) in closing {
                        if send(&mut events, kind, event).await.is_err() {
                            return Ok(CLIENT_CLOSED);
                        }
                    }
                    let last = match kept {
                        Ok(()) => ("response.completed", json!({"response": response})),
                        Err(error) => failed_event(&object, &error),
                    };
                    if send(&mut events, last.0, last.1).await.is_err() {
                        return Ok(CLIENT_CLOSED);
                    }
                    let _ = events.finish().await;
                    return Ok(StatusCode::OK);
                }
                Err(error) => {
                    // Mid-stream the status is sent: the failure goes as events, then the stream
                    // ends, and the access line says why.
                    access.broke_off(error.code);
                    let error_event =
                        json!({"code": error.code, "message": error.message, "param": error.param});
                    let (kind, failed) = failed_event(&object, &error);
                    if send(&mut events, "error", error_event).await.is_ok()
                        && send(&mut events, kind, failed).await.is_ok()
                    {
                        let _ = events.finish().await;
                    }
                    return Ok(StatusCode::OK);
                }
            };
            if sent.is_err() {
                return Ok(CLIENT_CLOSED);
            }
            step = steps.next().await;
        }
    }

    /// Keeps `response` and the conversation it ends (`conversation`, then its answer `text`),
    /// when the request asked for `store`.
    async fn keep(
        &self,
        caller: &Caller,
        turn: &Turn<'_>,
        conversation: Vec<Value>,
        response: &Value,
        text: &str,
    ) -> Result<(), ApiError> {
        if !turn.request.store {
            return Ok(());
        }
        let mut messages = conversation;
        messages.push(json!({"role": "assistant", "content": text}));
        let conversation = Conversation {
            previous: turn.request.previous_response_id.as_deref(),
            earlier: turn.earlier,
            messages,
        };
        self.responses
            .put(caller, response.clone(), conversation)
            .await
            .map_err(ApiError::from)
    }

    /// `GET /v1/responses/{id}`: the caller's kept response.
    pub(super) async fn response_json(&self, caller: &Caller, id: &str) -> Result<Value, ApiError> {
        match self.responses.get(caller, id).await? {
            Some(kept) => Ok(kept.response),
            None => Err(response_not_found(id)),
        }
    }

    /// `DELETE /v1/responses/{id}`
    pub(super) async fn delete_response(
        &self,
        caller: &Caller,
        id: &str,
    ) -> Result<Value, ApiError> {
        if self.responses.remove(caller, id).await? {
            Ok(json!({"id": id, "object": "response", "deleted": true}))
        } else {
            Err(response_not_found(id))
        }
    }
}

fn response_not_found(id: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "response_not_found",
        format!("no stored response {}", shown_id(id)),
    )
}

/// Characters of a client's response id an error quotes (an id is any string a client sends).
const ID_SHOWN: usize = 64;

/// A response id as errors quote it: at most [`ID_SHOWN`] characters of it.
fn shown_id(id: &str) -> String {
    match id.char_indices().nth(ID_SHOWN) {
        Some((end, _)) => format!("{:?}... ({} bytes)", &id[..end], id.len()),
        None => format!("{id:?}"),
    }
}

fn not_a_responses_request(error: &serde_json::Error) -> ApiError {
    ApiError::new(
        StatusCode::BAD_REQUEST,
        "invalid_request",
        format!("the request body is not a valid Responses request: {error}"),
    )
}

/// The `response.failed` event for `error`.
fn failed_event(object: &ResponseObject<'_>, error: &ApiError) -> (&'static str, Value) {
    let mut response = object.json("failed", None, None);
    response["error"] = json!({"code": error.code, "message": error.message});
    ("response.failed", json!({"response": response}))
}

/// One request's ids and time.
struct Turn<'r> {
    request: &'r ResponsesRequest,
    /// Messages of the conversation that came from the response it follows.
    earlier: usize,
    id: String,
    message_id: String,
    created_at: u64,
}

impl<'r> Turn<'r> {
    fn new(request: &'r ResponsesRequest, earlier: usize) -> Turn<'r> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        // Random: an id says nothing of when it was made or how many came before, and cannot be
        // guessed from another.
        let suffix = format!("{:032x}", rand::random::<u128>());
        Turn {
            request,
            earlier,
            id: format!("resp_{suffix}"),
            message_id: format!("msg_{suffix}"),
            created_at: now.as_secs(),
        }
    }

    fn object(&self) -> ResponseObject<'_> {
        ResponseObject {
            id: &self.id,
            message_id: &self.message_id,
            created_at: self.created_at,
            model: &self.request.model,
            request: self.request,
        }
    }
}

/// Where an answer's text comes from.
enum Steps<'m> {
    Native(Box<Generation<'m>>),
    Upstream(Box<UpstreamSteps<'m>>),
}

impl Steps<'_> {
    async fn next(&mut self) -> Result<Step, ApiError> {
        match self {
            Steps::Native(generation) => generation.next().await,
            Steps::Upstream(upstream) => upstream.next().await,
        }
    }
}

/// An upstream's streamed chat completion read as steps: each chunk's text, then the finish and
/// the usage (with the media account planned here).
struct UpstreamSteps<'p> {
    /// `None` once the stream has ended.
    exchange: Option<Exchange>,
    /// Bytes of an event not yet complete.
    pending: Vec<u8>,
    /// Texts read and not yet given.
    text: VecDeque<String>,
    finish: Option<&'static str>,
    /// The last step, once read (given after the texts before it).
    done: Option<Step>,
    usage_media: Option<Value>,
    /// The request's items in the EC store, held while the answer streams.
    _held: Vec<crate::ec_store::Pin>,
    pool: &'p UpstreamPool,
}

impl UpstreamSteps<'_> {
    async fn next(&mut self) -> Result<Step, ApiError> {
        loop {
            if let Some(text) = self.text.pop_front() {
                return Ok(Step::Text(text));
            }
            if let Some(done) = self.done.take() {
                return Ok(done);
            }
            let Some(exchange) = self.exchange.as_mut() else {
                return Err(self.broken("the stream ended without its usage"));
            };
            let read = tokio::time::timeout(
                self.pool.answer_timeout(),
                exchange.upstream.read_body_bytes(),
            )
            .await;
            let chunk = match read {
                Ok(Ok(Some(chunk))) => chunk,
                Ok(Ok(None)) => return Err(self.broken("the stream ended without its usage")),
                Ok(Err(e)) => return Err(self.broken(&e.to_string())),
                Err(_) => return Err(self.broken("no more of the answer in time")),
            };
            self.pending.extend_from_slice(&chunk);
            while let Some(end) = find_event_end(&self.pending) {
                let event: Vec<u8> = self.pending.drain(..end.0 + end.1).collect();
                if let Some(done) = self.event(&event[..end.0])? {
                    // The rest (`[DONE]`) is read so that the connection can be kept alive.
                    if let Some(mut exchange) = self.exchange.take()
                        && exchange
                            .read_whole(self.pool.answer_timeout())
                            .await
                            .is_ok()
                    {
                        exchange.done().await;
                    }
                    self.done = Some(done);
                    break;
                }
            }
        }
    }

    /// One event's data: its text is queued; the usage chunk ends the answer.
    fn event(&mut self, event: &[u8]) -> Result<Option<Step>, ApiError> {
        let data: String = String::from_utf8_lossy(event)
            .lines()
            .filter_map(|line| line.strip_prefix("data:"))
            .map(str::trim_start)
            .collect();
        if data.is_empty() || data == "[DONE]" {
            return Ok(None);
        }
        let chunk: Value = serde_json::from_str(&data)
            .map_err(|e| self.broken(&format!("a chunk is not JSON: {e}")))?;
        if let Some(error) = chunk.get("error") {
            let message = error["message"].as_str().unwrap_or("failed mid-answer");
            return Err(self.broken(message));
        }
        if let Some(choice) = chunk["choices"].get(0) {
            if let Some(text) = choice["delta"]["content"].as_str()
                && !text.is_empty()
            {
                self.text.push_back(text.to_owned());
            }
            if let Some(reason) = choice["finish_reason"].as_str() {
                self.finish = Some(if reason == "length" { "length" } else { "stop" });
            }
        }
        match chunk.get("usage") {
            Some(usage) if usage.is_object() => {
                let mut usage = usage.clone();
                if let Some(media) = &self.usage_media {
                    usage["media"] = media.clone();
                }
                Ok(Some(Step::Done {
                    finish: self.finish.unwrap_or("stop"),
                    usage,
                }))
            }
            _ => Ok(None),
        }
    }

    fn broken(&self, why: &str) -> ApiError {
        ApiError::new(
            StatusCode::BAD_GATEWAY,
            "upstream_error",
            format!("the model's upstream failed mid-answer: {why}"),
        )
    }
}

/// Where the first complete server-sent event in `bytes` ends: its length and its separator's.
fn find_event_end(bytes: &[u8]) -> Option<(usize, usize)> {
    let lf = bytes
        .windows(2)
        .position(|w| w == b"\n\n")
        .map(|at| (at, 2));
    let crlf = bytes
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|at| (at, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 < b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}
