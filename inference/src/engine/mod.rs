//! The engine: one thread that owns the LLM and every sequence's KV cache and runs continuous
//! batching, with media encoded asynchronously by the [`EncoderPool`] into the [`FeatureStore`].
//!
//! A request moves waiting-for-encoding → prefill (in chunks) → decode → done. Each iteration
//! runs one batched forward over every decoding sequence plus prefill chunks up to a token budget,
//! so long prompts never stall decodes. A request's media is submitted to the encoders when it is
//! admitted; until it is ready the request may still prefill the text before its first
//! placeholder, and requests without media never wait for an encoder at all. Tokens stream out
//! through a channel as they are sampled; a dropped receiver or [`RequestHandle::cancel`] stops the
//! request, and its KV cache and feature pins are released at once.
//!
//! The engine sees models through traits only and names none: it runs any [`Llm`] (generic, so a
//! step costs no dynamic dispatch) and encodes with any [`Encoder`]; each model implements them
//! beside itself in [`models`](crate::models). [`input`] holds what the encoders take, [`encoder`]
//! the trait and the machinery the towers share, [`handoff`] the rendezvous by which a piece made
//! after its request was submitted arrives, [`pool`] and [`store`] the encoder devices and their
//! outputs.

pub mod encoder;
pub mod handoff;
pub mod input;
pub mod llm;
pub mod pool;
mod scheduler;
pub mod store;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crossbeam_channel::Sender;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

pub use encoder::Encoder;
pub use input::{Delivery, EncodeInput, EncoderKind, Handed, Handoff, PixelSource, PixelValues};
pub use llm::{Deepstack, Llm, SeqCache, SeqStep};
pub use pool::{BatchObserver, BatchReport, DeviceSpec, EncoderPool, SharedFeatures};
pub use store::{FeatureKey, FeatureState, FeatureStore, StoreStats};

use scheduler::Scheduler;

use crate::error::{Error, Result};
use crate::rope::Grid;
use crate::sampling::SamplingParams;
use crate::text::TextProcessor;

/// How prompt positions are numbered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PositionScheme {
    /// 0, 1, 2, … (Qwen2, Qwen2-Audio).
    Plain,
    /// Qwen2-VL's M-RoPE over each vision item's merged grid.
    MRope { merge: usize },
}

#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Part of every feature-cache key, so two models never share features.
    pub model_name: String,
    pub positions: PositionScheme,
    /// Sequences decoding or prefilling at once.
    pub max_running: usize,
    /// Prompt tokens prefilled per iteration, across requests.
    pub prefill_chunk: usize,
    /// KV-cache rows all running sequences may reserve together (prompt + max_tokens each).
    pub kv_budget_tokens: usize,
    /// Ids that end a generation besides `config.json`'s and the tokenizer's `eos_token`
    /// (`generation_config.json` lists them).
    pub eos_token_ids: Vec<u32>,
    /// Feature sets an encoder output carries beside the merged embeddings (Qwen3-VL's deepstack):
    /// each media row is `hidden · (1 + deepstack_levels)` wide, the embeddings first, then one
    /// `hidden`-wide row per level that the LLM adds to its hidden states after that layer.
    pub deepstack_levels: usize,
}

/// One media item of a request: its encoder input and where its embeddings go.
#[derive(Debug, Clone)]
pub struct MediaItem {
    pub input: Arc<EncodeInput>,
    /// The placeholder token its embeddings replace (`tokens` of them, contiguous, in the prompt).
    pub placeholder: u32,
    pub tokens: usize,
    /// The processor config the input was made with (part of the cache key).
    pub processor_config: String,
    /// M-RoPE temporal step per temporal patch (see [`MediaSpan::time_interval`]).
    pub time_interval: f32,
    /// Where a shared feature cache keeps this item's encoder output, when the caller keyed it
    /// (by the media and its plan, so that other replicas find it before preprocessing); `None`:
    /// under the encoder input's hash.
    pub share_key: Option<[u8; 32]>,
    /// Which of the input's encoder output tokens this item's placeholders take, when one input
    /// fills several runs of the prompt (a Qwen3-VL video: one run per temporal patch, each after
    /// its timestamp). Such items follow each other in the request and share the input's `Arc`,
    /// which is encoded once. `None`: all of them.
    pub part: Option<InputPart>,
    /// When the item was made in pieces (contract 0.4's parts), which piece of which item this is.
    pub piece: Option<Piece>,
}

/// One of the pieces a media item was made in: encoded on its own, and merged and prefilled as
/// soon as it and everything before it in the prompt are ready.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Piece {
    /// The item's index in the request: pieces of one item are never batched together, so they
    /// become ready in order while the next encode.
    pub item: usize,
    /// Its M-RoPE block continues the previous piece's from this temporal patch (a piece of a
    /// Qwen2-VL video); `None`: a block of its own (a Qwen3-VL frame after its timestamp, audio).
    pub continues_at: Option<usize>,
}

/// A run of an input's encoder output tokens (see [`MediaItem::part`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct InputPart {
    /// The first of the input's output tokens this run takes.
    pub first_token: usize,
    /// The grid that places the run's tokens (M-RoPE).
    pub grid: Grid,
    /// Its time in its video (see [`crate::families::PromptRun::at`]); the engine does not read
    /// it.
    pub at: Option<f64>,
}

#[derive(Debug, Clone)]
pub struct GenerateRequest {
    /// Token ids with each media item's placeholder already repeated `tokens` times.
    pub prompt: Vec<u32>,
    pub media: Vec<MediaItem>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    /// Generation ends before any of these strings.
    pub stop: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token.
    Stop,
    /// The request's stop string of this index.
    StopString(usize),
    /// `max_tokens` reached.
    Length,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Usage {
    /// Including the media placeholders.
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Media items whose embeddings came from the feature store's cache (or a concurrent request).
    pub cached_media: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A sampled token and the text it completes (may be empty mid-character or held back while it
    /// could be the start of a stop string).
    Token {
        id: u32,
        text: String,
    },
    Done {
        finish: FinishReason,
        usage: Usage,
    },
    Failed(Failure),
}

/// Why a request failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// Encoding media item `item` (in the request's order) failed; nothing was generated.
    Encode { item: usize, message: String },
    /// The request cannot run as given (it never fits the KV budget, an empty prompt, ...).
    Invalid(String),
    /// The engine failed while running it.
    Internal(String),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Encode { item, message } => {
                write!(f, "encoding media item {item} failed: {message}")
            }
            Self::Invalid(message) | Self::Internal(message) => f.write_str(message),
        }
    }
}

/// The caller's side of a running request.
pub struct RequestHandle {
    pub events: UnboundedReceiver<Event>,
    cancel: Arc<AtomicBool>,
}

impl RequestHandle {
    /// Stops the request; its resources are freed on the engine's next iteration.
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStats {
    pub running: usize,
    pub queued: usize,
    pub waiting_for_encoder: usize,
    /// Device bytes of all live KV caches.
    pub kv_bytes: usize,
    pub kv_reserved_tokens: usize,
    pub completed: u64,
    pub cancelled: u64,
    pub failed: u64,
    /// Pieces of items (contract 0.4's parts) admitted whose features are not ready yet.
    pub pieces_in_flight: usize,
    /// Items made in pieces whose pieces have all become ready, and the seconds from admission to
    /// each one's first and to its last piece ready, summed (a mean each, and how far encoding
    /// runs ahead of the merge).
    pub pieced_items: u64,
    pub first_piece_seconds: f64,
    pub last_piece_seconds: f64,
}

struct Submission {
    request: GenerateRequest,
    events: UnboundedSender<Event>,
    cancel: Arc<AtomicBool>,
    /// The span the request was submitted in: its encoder work is traced under it.
    trace: tracing::Span,
}

pub struct Engine {
    commands: Option<Sender<Submission>>,
    stats: Arc<Mutex<EngineStats>>,
    store: Arc<FeatureStore>,
    thread: Option<JoinHandle<()>>,
}

impl Engine {
    /// Starts the engine's thread, which owns `llm` from now on.
    pub fn start<M: Llm>(
        config: EngineConfig,
        llm: M,
        text: Arc<TextProcessor>,
        pool: Arc<EncoderPool>,
        store: Arc<FeatureStore>,
    ) -> Result<Self> {
        let (tx, rx) = crossbeam_channel::unbounded();
        let stats = Arc::new(Mutex::new(EngineStats::default()));
        let state = Scheduler::new(config, llm, text, pool, store.clone(), stats.clone());
        let thread = std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || state.run(rx))
            .map_err(|e| Error::Device {
                device: "engine".into(),
                reason: e.to_string(),
            })?;
        Ok(Self {
            commands: Some(tx),
            stats,
            store,
            thread: Some(thread),
        })
    }

    /// Queues a request; returns at once.
    pub fn submit(&self, request: GenerateRequest) -> Result<RequestHandle> {
        let (events, rx) = unbounded_channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let submission = Submission {
            request,
            events,
            cancel: cancel.clone(),
            trace: tracing::Span::current(),
        };
        self.commands
            .as_ref()
            .and_then(|c| c.send(submission).ok())
            .ok_or_else(|| Error::Device {
                device: "engine".into(),
                reason: "the engine has stopped".into(),
            })?;
        Ok(RequestHandle { events: rx, cancel })
    }

    pub fn stats(&self) -> EngineStats {
        self.stats.lock().map(|s| s.clone()).unwrap_or_default()
    }

    pub fn feature_store(&self) -> &FeatureStore {
        &self.store
    }
}

/// An LLM that can start the engine that runs it, whatever its type: what a model's loader hands
/// over, so that its caller names neither the model nor its device. One dynamic call starts the
/// engine, which then runs the LLM's own type.
pub trait StartEngine: Send {
    fn start(
        self: Box<Self>,
        config: EngineConfig,
        text: Arc<TextProcessor>,
        pool: Arc<EncoderPool>,
        store: Arc<FeatureStore>,
    ) -> Result<Engine>;
}

impl<M: Llm> StartEngine for M {
    fn start(
        self: Box<Self>,
        config: EngineConfig,
        text: Arc<TextProcessor>,
        pool: Arc<EncoderPool>,
        store: Arc<FeatureStore>,
    ) -> Result<Engine> {
        Engine::start(config, *self, text, pool, store)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.commands = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
