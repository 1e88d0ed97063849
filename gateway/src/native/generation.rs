//! A prepared request run on the engine: its parts fed as they are made, its events turned into
//! text steps, and the model's encode-error policy applied when an item fails to encode.

use http::StatusCode;
use mmgate_inference::engine::{
    Event, Failure, FinishReason, GenerateRequest, RequestHandle, Usage,
};
use mmgate_inference::sampling::SamplingParams;
use mmgate_inference::text::ChatMessage;
use serde_json::Value;

use super::chat::Prepared;
use crate::access::as_attribute;
use crate::config::EncodeErrorPolicy;
use crate::error::ApiError;
use crate::media::account::{self, MediaAccount};
use crate::model::LocalModel;
use crate::prepare::errors::internal;
use crate::prepare::plugin_output::item_tensors;
use crate::prepare::prompt_text::{prompt_ids, without_media};

/// A running generation. Its steps are text deltas, then the end; an encode failure is retried
/// without the media when the model's policy says so (before any token was produced: a request's
/// first token needs all its media).
pub struct Generation<'m> {
    model: &'m LocalModel,
    handle: RequestHandle,
    messages: Vec<ChatMessage>,
    max_tokens: usize,
    stop: Vec<String>,
    sampling: SamplingParams,
    /// The media accounts, updated when items are dropped.
    pub media: Vec<MediaAccount>,
    produced: bool,
    /// The tokens generated so far.
    pub token_ids: Vec<u32>,
    /// One per task handing a part still being made to the engine: dropping it stops the task
    /// (a part not yet begun is then never made).
    feeding: Vec<tokio::sync::oneshot::Sender<()>>,
    /// The generation's span (under the request's), and the phase's within it: `prefill` (the
    /// media merged, the prompt prefilled, the first token) until the first token, then `decode`.
    span: tracing::Span,
    phase: tracing::Span,
}

impl Drop for Generation<'_> {
    fn drop(&mut self) {
        self.stop_feeding();
    }
}

pub enum Step {
    Text(String),
    Done {
        finish: &'static str,
        usage: Value,
        /// The stop string that ended the answer, if one did.
        stop_sequence: Option<String>,
    },
}

impl<'m> Generation<'m> {
    pub fn start(model: &'m LocalModel, prepared: Prepared) -> Result<Self, ApiError> {
        let Prepared {
            request,
            messages,
            media,
            feeds,
            ..
        } = prepared;
        let (max_tokens, stop, sampling) = (
            request.max_tokens,
            request.stop.clone(),
            request.sampling.clone(),
        );
        let span = tracing::info_span!(
            "generate",
            gen_ai.request.max_tokens = as_attribute(max_tokens),
            mmgate.media_items = as_attribute(media.len()),
            mmgate.pieces_fed = as_attribute(feeds.len()),
        );
        let phase = tracing::info_span!(parent: &span, "prefill");
        // Submitted in the prefill's span: the engine traces the request's encoding under it.
        let submitting = phase.clone().entered();
        let handle = model
            .runtime
            .engine()
            .map_err(|e| internal(e.to_string()))?
            .submit(request)
            .map_err(|e| internal(e.to_string()))?;
        drop(submitting);
        // Each part goes to the engine as soon as it is made; the engine merges and prefills the
        // pieces in order meanwhile.
        let feeding = feeds
            .into_iter()
            .map(|(part, maker)| {
                let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
                tokio::spawn(async move {
                    tokio::select! {
                        made = part.wait() => maker.deliver(
                            made.map(|tensors| item_tensors(&tensors)).map_err(|e| e.to_string()),
                        ),
                        _ = stopped => maker.cancel(),
                    }
                });
                stop
            })
            .collect();
        Ok(Self {
            model,
            handle,
            messages,
            max_tokens,
            stop,
            sampling,
            media,
            produced: false,
            token_ids: Vec::new(),
            feeding,
            span,
            phase,
        })
    }

    /// The next step; `Ok(None)` never comes before `Done`.
    pub async fn next(&mut self) -> Result<Step, ApiError> {
        loop {
            let event = self
                .handle
                .events
                .recv()
                .await
                .ok_or_else(|| internal("the inference engine stopped"))?;
            match event {
                Event::Token { id, text } => {
                    if !self.produced {
                        self.next_phase(tracing::info_span!(parent: &self.span, "decode"));
                    }
                    self.produced = true;
                    self.token_ids.push(id);
                    if !text.is_empty() {
                        return Ok(Step::Text(text));
                    }
                }
                Event::Done { finish, usage } => {
                    self.next_phase(tracing::Span::none());
                    return Ok(self.done(finish, &usage));
                }
                Event::Failed(Failure::Encode { item, message })
                    if self.model.on_encode_error == EncodeErrorPolicy::Drop && !self.produced =>
                {
                    tracing::warn!(item, %message, "encoding failed; dropping the media");
                    self.rerun_without_media(&message)?;
                }
                Event::Failed(failure) => return Err(failure_error(&failure)),
            }
        }
    }

    /// Ends the phase's span now and starts `next`. (A span's trace ends where it was last
    /// exited, and the request's encoding entered the prefill's on the engine's thread long
    /// before the prefill ends: it is entered once more here.)
    fn next_phase(&mut self, next: tracing::Span) {
        self.phase.in_scope(|| {});
        self.phase = next;
    }

    fn done(&self, finish: FinishReason, usage: &Usage) -> Step {
        let (finish, stop_sequence) = match finish {
            FinishReason::Stop => ("stop", None),
            FinishReason::StopString(which) => ("stop", self.stop.get(which).cloned()),
            FinishReason::Length => ("length", None),
        };
        Step::Done {
            finish,
            stop_sequence,
            usage: crate::wire::openai::usage_json(
                usage.prompt_tokens,
                usage.completion_tokens,
                &account::render(&self.media),
            ),
        }
    }

    fn stop_feeding(&mut self) {
        self.feeding.clear();
    }

    /// The drop policy: the same conversation with its media parts removed.
    fn rerun_without_media(&mut self, reason: &str) -> Result<(), ApiError> {
        self.stop_feeding();
        for account in &mut self.media {
            if account.dropped.is_none() {
                account.drop_for(reason);
            }
        }
        let prompt = prompt_ids(
            &self.model.runtime.prompt,
            &without_media(&self.messages, |_| true),
        )?;
        let context = self.model.runtime.prompt.context_length;
        let max_tokens = self
            .max_tokens
            .min(context.saturating_sub(prompt.len()).max(1));
        self.handle = self
            .model
            .runtime
            .engine()
            .map_err(|e| internal(e.to_string()))?
            .submit(GenerateRequest {
                prompt,
                media: Vec::new(),
                sampling: self.sampling.clone(),
                max_tokens,
                stop: self.stop.clone(),
            })
            .map_err(|e| internal(e.to_string()))?;
        Ok(())
    }
}

pub(crate) fn failure_error(failure: &Failure) -> ApiError {
    match failure {
        Failure::Encode { .. } => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "encode_failed",
            failure.to_string(),
        ),
        Failure::Invalid(message) => {
            ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", message.clone())
        }
        Failure::Internal(message) => internal(message.clone()),
    }
}
