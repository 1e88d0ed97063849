//! An answer made from a chat completion's body, read as steps of text (each delta, then the end
//! with its usage) wherever it is made: by the native core, or by the model's upstream asked for a
//! streamed chat completion (its media as the model's mode sends them). The APIs that mean a chat
//! completion without being one (OpenAI's Responses, Anthropic's Messages) write these steps in
//! their own shapes.

use std::collections::VecDeque;

use bytes::Bytes;
use http::StatusCode;
use pingora::protocols::http::ServerSession;
use serde_json::{Value, json};

use super::media_modes::ModeCall;
use super::{Gateway, Route};
use crate::error::ApiError;
use crate::native::generation::{Generation, Step};
use crate::prepare::errors::invalid;
use crate::store::Caller;
use crate::upstream::{Exchange, UpstreamPool};
use crate::wire::openai::ChatCompletionRequest;

/// An answer started: where it is made, its steps, the headers its route adds (the promise of
/// planned media), and the prompt's tokens where they are known before the end.
pub(super) struct Answer<'m> {
    pub label: &'static str,
    pub steps: Steps<'m>,
    pub headers: Vec<(&'static str, String)>,
    pub prompt_tokens: Option<u64>,
}

impl Gateway {
    /// Starts the chat completion `chat` (a body as a client would send it) on `route`; its
    /// failure is told with the route it took.
    pub(super) async fn start_answer<'m>(
        &'m self,
        session: &ServerSession,
        caller: &Caller,
        route: &'m Route,
        chat: Value,
        user: Option<&str>,
    ) -> Result<Answer<'m>, (&'static str, ApiError)> {
        match route {
            Route::Native(model) => {
                let label = "native";
                let parsed: ChatCompletionRequest = serde_json::from_value(chat)
                    .map_err(|e| (label, invalid("messages", e.to_string())))?;
                let prepared = self
                    .prepare(caller, model, parsed)
                    .await
                    .map_err(|e| (label, e))?;
                let prompt_tokens = Some(prepared.prompt_tokens() as u64);
                let generation = Generation::start(model, prepared).map_err(|e| (label, e))?;
                Ok(Answer {
                    label,
                    steps: Steps::Native(Box::new(generation)),
                    headers: Vec::new(),
                    prompt_tokens,
                })
            }
            Route::Upstream { pool, media } => {
                let label = "upstream";
                let call = ModeCall {
                    pool,
                    services: self.services(caller),
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
                    .chat_upstream(session, pool, &sent, user)
                    .await
                    .map_err(|e| (label, e))?;
                let headers: Vec<(&'static str, String)> = additions
                    .headers
                    .iter()
                    .filter_map(|(name, value)| Some((*name, value.to_str().ok()?.to_owned())))
                    .collect();
                // Media planned here come with the engine's count, promised.
                let prompt_tokens = headers
                    .iter()
                    .find(|(name, _)| *name == super::media_modes::PROMPT_TOKENS_HEADER)
                    .and_then(|(_, value)| value.parse().ok());
                let steps = Steps::Upstream(Box::new(UpstreamSteps {
                    exchange: Some(exchange),
                    pending: Vec::new(),
                    text: VecDeque::new(),
                    finish: None,
                    stop_sequence: None,
                    done: None,
                    usage_media: additions.usage_media,
                    _held: additions.held,
                    pool,
                }));
                Ok(Answer {
                    label,
                    steps,
                    headers,
                    prompt_tokens,
                })
            }
        }
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
}

/// Where an answer's text comes from.
pub(super) enum Steps<'m> {
    Native(Box<Generation<'m>>),
    Upstream(Box<UpstreamSteps<'m>>),
}

impl Steps<'_> {
    pub async fn next(&mut self) -> Result<Step, ApiError> {
        match self {
            Steps::Native(generation) => generation.next().await,
            Steps::Upstream(upstream) => upstream.next().await,
        }
    }
}

/// An upstream's streamed chat completion read as steps: each chunk's text, then the finish and
/// the usage (with the media account planned here).
pub(super) struct UpstreamSteps<'p> {
    /// `None` once the stream has ended.
    exchange: Option<Exchange>,
    /// Bytes of an event not yet complete.
    pending: Vec<u8>,
    /// Texts read and not yet given.
    text: VecDeque<String>,
    finish: Option<&'static str>,
    /// The stop string that ended the answer, as vLLM names it (`stop_reason`).
    stop_sequence: Option<String>,
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
                // A number is a stop token's id, not a stop string.
                self.stop_sequence = choice["stop_reason"].as_str().map(str::to_owned);
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
                    stop_sequence: self.stop_sequence.take(),
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
