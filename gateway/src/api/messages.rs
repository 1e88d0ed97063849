//! `POST /v1/messages` (Anthropic's Messages API) and `POST /v1/messages/count_tokens`.
//!
//! A Messages request means a chat completion ([`crate::wire::anthropic`]): it is translated into
//! one and served as chat is ([`super::steps`]), under the same budget, plugins, limits and
//! guards; its answer is written as a message or as Anthropic's event stream. `count_tokens` plans
//! the same chat completion without running it ([`Gateway::plan_chat`]): for a model whose media
//! are planned here the count is the one its answer's `usage.input_tokens` will say.

use std::time::Instant;

use bytes::Bytes;
use http::StatusCode;
use pingora::protocols::http::ServerSession;
use serde_json::{Value, json};

use super::Gateway;
use super::chat::{MODEL_NAME_LOGGED, charge_usage, refused_if_client_error};
use super::io::{EventStream, read_body, write_json_with};
use super::request::{checked_shape, off_thread_if_large};
use super::steps::Answer;
use crate::access::{Access, CLIENT_CLOSED};
use crate::error::ApiError;
use crate::keylimits::TokenTally;
use crate::native::generation::Step;
use crate::prepare::errors::invalid;
use crate::wire::anthropic::{self, MESSAGES, MessagesRequest, Refusal};

impl Gateway {
    /// Answers a Messages request; what it used is told to `tally`.
    pub(super) async fn messages(
        &self,
        session: &mut ServerSession,
        tally: Option<&TokenTally>,
        mut access: Access,
    ) {
        let started = Instant::now();
        let outcome = self.messages_inner(session, tally, &mut access).await;
        refused_if_client_error(outcome.as_ref().err().map(|(_, e)| e), tally);
        self.request_done(session, MESSAGES, started, outcome, access)
            .await;
    }

    async fn messages_inner(
        &self,
        session: &mut ServerSession,
        tally: Option<&TokenTally>,
        access: &mut Access,
    ) -> Result<(&'static str, StatusCode), (&'static str, ApiError)> {
        let none = |e| ("none", e);
        let (request, chat) = self.messages_request(session, tally).await.map_err(none)?;
        access.model = Some(request.model.chars().take(MODEL_NAME_LOGGED).collect());
        let Some(route) = self.models.get(&request.model) else {
            return Err(none(ApiError::model_not_found(&request.model)));
        };
        match request.max_tokens {
            Some(tokens) if tokens >= 1 => {}
            Some(_) => {
                return Err(none(invalid(
                    "max_tokens",
                    "max_tokens: must be at least 1",
                )));
            }
            None => return Err(none(invalid("max_tokens", "max_tokens: Field required"))),
        }
        let caller = self.caller(session);
        let user = request.metadata.as_ref().and_then(|m| m.user_id.as_deref());
        let answer = self
            .start_answer(session, &caller, route, chat, user)
            .await?;
        let label = answer.label;
        self.write_message(session, &request, answer, tally, access)
            .await
            .map(|status| (label, status))
            .map_err(|e| (label, e))
    }

    /// `POST /v1/messages/count_tokens`: the input tokens the same request is charged, its media
    /// planned as its model's route plans them, nothing run.
    pub(super) async fn count_message_tokens(
        &self,
        session: &mut ServerSession,
        tally: Option<&TokenTally>,
    ) -> Result<Value, ApiError> {
        // An unknown model is refused by the planning, as for the chat plan route.
        let (request, mut chat) = self.messages_request(session, tally).await?;
        chat["stream"] = json!(false);
        if let Some(options) = chat.as_object_mut() {
            options.remove("stream_options");
        }
        let plan = self
            .plan_chat(
                session,
                Bytes::from(chat.to_string()),
                &request.model,
                false,
                tally,
            )
            .await?;
        Ok(json!({"input_tokens": plan["prompt_tokens"]}))
    }

    /// The request's body read within the limits, parsed, and translated to the chat completion
    /// it means (off the connection's thread when large).
    async fn messages_request(
        &self,
        session: &mut ServerSession,
        tally: Option<&TokenTally>,
    ) -> Result<(MessagesRequest, Value), ApiError> {
        let body = read_body(session, self.limits.max_body_bytes).await?;
        if let Some(tally) = tally {
            tally.request(body.len());
        }
        checked_shape(&body, "messages", &self.limits, not_a_messages_request).await?;
        off_thread_if_large(&body, |body| {
            let request: MessagesRequest =
                serde_json::from_slice(&body).map_err(|e| not_a_messages_request(&e))?;
            let chat = request.chat_body().map_err(|refusal| match refusal {
                Refusal::Invalid(e) => invalid(e.param, e.message),
                Refusal::Unsupported(message) => ApiError::new(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "unsupported_media",
                    message,
                ),
            })?;
            Ok((request, chat))
        })
        .await
    }

    /// Writes the answer as a message, or as its event stream.
    async fn write_message(
        &self,
        session: &mut ServerSession,
        request: &MessagesRequest,
        mut answer: Answer<'_>,
        tally: Option<&TokenTally>,
        access: &mut Access,
    ) -> Result<StatusCode, ApiError> {
        let id = format!("msg_{:032x}", rand::random::<u128>());
        let model = request.model.as_str();
        let added = std::mem::take(&mut answer.headers);
        let headers: Vec<(&str, &str)> = added.iter().map(|(n, v)| (*n, v.as_str())).collect();
        if !request.stream {
            let mut text = String::new();
            loop {
                match answer.steps.next().await? {
                    Step::Text(delta) => text.push_str(&delta),
                    Step::Done {
                        finish,
                        usage,
                        stop_sequence,
                    } => {
                        charge_usage(access, tally, &usage);
                        let stop = anthropic::stop_reason(finish, stop_sequence.as_deref());
                        let message = anthropic::message_json(
                            &id,
                            model,
                            Some(&text),
                            Some(stop),
                            anthropic::usage(&usage),
                        );
                        write_json_with(session, StatusCode::OK, &message, &headers).await;
                        return Ok(StatusCode::OK);
                    }
                }
            }
        }

        // The first step decides the status: a failure before any text is still a proper error.
        let first = answer.steps.next().await?;
        let Ok(mut events) = EventStream::start_with(session, &headers).await else {
            return Ok(CLIENT_CLOSED);
        };
        let send = async |events: &mut EventStream<'_>, kind: &str, mut event: Value| {
            event["type"] = json!(kind);
            events.send_event(kind, &event).await
        };
        // The input's count where it is known now (the native prompt, or the engine's promised
        // count); the last event says it in any case.
        let opening_usage = json!({
            "input_tokens": answer.prompt_tokens.unwrap_or(0),
            "output_tokens": 0,
        });
        let opening = [
            (
                "message_start",
                json!({"message": anthropic::message_json(&id, model, None, None, opening_usage)}),
            ),
            (
                "content_block_start",
                json!({"index": 0, "content_block": {"type": "text", "text": ""}}),
            ),
            ("ping", json!({})),
        ];
        for (kind, event) in opening {
            if send(&mut events, kind, event).await.is_err() {
                return Ok(CLIENT_CLOSED); // dropping the steps cancels the generation
            }
        }
        let mut step: Result<Step, ApiError> = Ok(first);
        loop {
            let sent = match step {
                Ok(Step::Text(delta)) => {
                    let delta = json!({"index": 0, "delta": {"type": "text_delta", "text": delta}});
                    send(&mut events, "content_block_delta", delta).await
                }
                Ok(Step::Done {
                    finish,
                    usage,
                    stop_sequence,
                }) => {
                    charge_usage(access, tally, &usage);
                    let (reason, sequence) =
                        anthropic::stop_reason(finish, stop_sequence.as_deref());
                    let closing = [
                        ("content_block_stop", json!({"index": 0})),
                        (
                            "message_delta",
                            json!({
                                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                "usage": anthropic::usage(&usage),
                            }),
                        ),
                        ("message_stop", json!({})),
                    ];
                    for (kind, event) in closing {
                        if send(&mut events, kind, event).await.is_err() {
                            return Ok(CLIENT_CLOSED);
                        }
                    }
                    let _ = events.finish().await;
                    return Ok(StatusCode::OK);
                }
                Err(error) => {
                    // Mid-stream the status is sent: the failure goes as an error event, then the
                    // stream ends, and the access line says why.
                    access.broke_off(error.code);
                    let event = anthropic::error_json(error.status, &error.message);
                    if send(&mut events, "error", event).await.is_ok() {
                        let _ = events.finish().await;
                    }
                    return Ok(StatusCode::OK);
                }
            };
            if sent.is_err() {
                return Ok(CLIENT_CLOSED);
            }
            step = answer.steps.next().await;
        }
    }
}

fn not_a_messages_request(error: &serde_json::Error) -> ApiError {
    ApiError::new(
        StatusCode::BAD_REQUEST,
        "invalid_request",
        format!("the request body is not a valid Messages request: {error}"),
    )
}
