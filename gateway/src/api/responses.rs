//! `POST /v1/responses` (OpenAI's Responses API), `GET` and `DELETE /v1/responses/{id}`.
//!
//! A Responses request means a chat completion ([`crate::wire::openai::responses`]): it is
//! translated into one and served as chat is, by the native core or by the model's upstream (asked
//! for a chat completion, its media as the model's mode sends them, its answer streamed back and
//! translated), under the same budget, plugins, limits and guards. Either way the answer comes as
//! steps of text ([`Step`]), which are written as a response object or as its event stream, and
//! kept with the conversation when the request asks for `store`.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use http::StatusCode;
use pingora::protocols::http::ServerSession;
use serde_json::{Value, json};

use super::Gateway;
use super::chat::{MODEL_NAME_LOGGED, charge_usage, refused_if_client_error};
use super::io::{EventStream, read_body, write_json_with};
use super::request::{checked_shape, off_thread_if_large, shape_error};
use super::steps::{Answer, Steps};
use crate::access::{Access, CLIENT_CLOSED};
use crate::error::ApiError;
use crate::keylimits::TokenTally;
use crate::native::generation::Step;
use crate::prepare::errors::invalid;
use crate::responses_store::Conversation;
use crate::store::Caller;
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
            return Err(none(ApiError::model_not_found(&request.model)));
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
        let Answer {
            label,
            steps,
            headers,
            ..
        } = self
            .start_answer(session, &caller, route, chat, request.user.as_deref())
            .await?;
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
        let headers: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
        if !turn.request.stream {
            let mut text = String::new();
            loop {
                match steps.next().await? {
                    Step::Text(delta) => text.push_str(&delta),
                    Step::Done { finish, usage, .. } => {
                        charge_usage(access, tally, &usage);
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
                Ok(Step::Done { finish, usage, .. }) => {
                    charge_usage(access, tally, &usage);
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
