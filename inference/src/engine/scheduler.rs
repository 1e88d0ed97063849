//! The engine's thread: its queue of submitted requests, the sequences it runs (admission, media
//! readiness, chunked prefill, batched decode, streaming and stop strings), and what each step
//! costs.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use tokio::sync::mpsc::UnboundedSender;

use super::{
    Deepstack, EncodeInput, EncoderPool, EngineConfig, EngineStats, Event, Failure, FeatureKey,
    FeatureState, FeatureStore, FinishReason, Llm, MediaItem, PositionScheme, SeqCache, SeqStep,
    Submission, Usage, store,
};
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::merge::PlaceholderMap;
use crate::rope::{MediaSpan, mrope_positions};
use crate::sampling::Sampler;
use crate::tensor::Tensor;
use crate::text::{TextProcessor, TextStream};

/// A prefill chunk shared with other sequences costs at most a full chunk's attention over this
/// many keys (see `Scheduler::step`).
const SHARED_STEP_CONTEXT: usize = 4096;
/// A prompt prefilling alone costs at most a full chunk's attention over this many keys a step:
/// a request arriving meanwhile waits for the step in flight, and a full chunk at the end of a
/// 32k-token context attends over about twice as many keys as one here.
const LONE_STEP_CONTEXT: usize = 16_384;
/// Fewest rows a long prompt's chunk is cut to.
const MIN_CUT_ROWS: usize = 32;

/// One sequence's input to a forward step.
struct StepInput<L: Backend> {
    embeds: Tensor<L>,
    positions: Vec<[i64; 3]>,
    /// Rows of the step that are media tokens, and each deepstack level's features for them.
    deepstack: Option<(Vec<u32>, Vec<Tensor<L>>)>,
}

struct Sequence<C> {
    ids: Vec<u32>,
    positions: Vec<[i64; 3]>,
    /// Added to a generated token's index to get its M-RoPE position.
    delta: i64,
    media: Vec<(store::FeatureKey, MediaItem)>,
    /// Each media item's prompt rows.
    media_rows: Vec<Range<usize>>,
    /// Pins still held in the feature store.
    pinned: bool,
    media_ready: bool,
    cached_media: usize,
    /// Prompt rows before the first media item whose features are not ready: prefillable while
    /// the rest still encode (the text before the first placeholder at admission; then, as items
    /// and pieces of items become ready in prompt order, up to the next that is not).
    ready_until: usize,
    /// Per item made in pieces: its index, and the time from admission to its first piece ready
    /// once one is; `None` in the list once its last piece is ready too (and counted).
    piece_clocks: Vec<Option<(usize, Option<Duration>)>>,
    /// Pieces whose features are not ready, as of the last poll.
    pieces_pending: usize,
    admitted: std::time::Instant,
    prefilled: usize,
    cache: C,
    reserved: usize,
    sampler: Sampler,
    stream: TextStream,
    /// The token to feed next (sampled, not yet in the cache).
    next: Option<u32>,
    generated: usize,
    text: String,
    emitted: usize,
    max_tokens: usize,
    stop: Vec<String>,
    events: UnboundedSender<Event>,
    cancel: Arc<AtomicBool>,
    outcome: Option<Outcome>,
}

enum Outcome {
    Finished(FinishReason),
    Cancelled,
    Failed(Failure),
}

pub(super) struct Scheduler<M: Llm> {
    config: EngineConfig,
    llm: M,
    text: Arc<TextProcessor>,
    pool: Arc<EncoderPool>,
    store: Arc<FeatureStore>,
    eos: Vec<u32>,
    queue: VecDeque<Submission>,
    running: Vec<Sequence<M::Cache>>,
    stats: Arc<Mutex<EngineStats>>,
    wake_tx: Sender<()>,
    wake_rx: Receiver<()>,
    totals: EngineStats,
    /// Requests admitted so far: with an item's index, names its pieces to the encoder pool.
    request_serial: u64,
}

impl<M: Llm> Scheduler<M> {
    pub(super) fn new(
        config: EngineConfig,
        llm: M,
        text: Arc<TextProcessor>,
        pool: Arc<EncoderPool>,
        store: Arc<FeatureStore>,
        stats: Arc<Mutex<EngineStats>>,
    ) -> Self {
        let mut eos: Vec<u32> = llm.eos_token_ids().to_vec();
        eos.extend(text.eos_token_id());
        eos.extend(&config.eos_token_ids);
        eos.sort_unstable();
        eos.dedup();
        let (wake_tx, wake_rx) = crossbeam_channel::unbounded();
        Self {
            config,
            llm,
            text,
            pool,
            store,
            eos,
            queue: VecDeque::new(),
            running: Vec::new(),
            stats,
            wake_tx,
            request_serial: 0,
            wake_rx,
            totals: EngineStats::default(),
        }
    }

    pub(super) fn run(mut self, commands: Receiver<Submission>) {
        loop {
            // Block only when there is nothing to do.
            if self.running.is_empty() && self.queue.is_empty() {
                match commands.recv() {
                    Ok(s) => self.queue.push_back(s),
                    Err(_) => return,
                }
            }
            while let Ok(s) = commands.try_recv() {
                self.queue.push_back(s);
            }
            self.admit();
            self.poll_media();
            let worked = match self.step() {
                Ok(worked) => worked,
                Err(e) => {
                    // A failed batch fails the sequences in it; the engine goes on.
                    tracing::error!(error = %e, "engine step failed");
                    for seq in self.running.iter_mut().filter(|s| s.outcome.is_none()) {
                        seq.outcome = Some(Outcome::Failed(Failure::Internal(e.to_string())));
                    }
                    true
                }
            };
            self.retire();
            self.publish_stats();
            if !worked && !self.running.is_empty() {
                // Everyone waits for encoders: sleep until one finishes or a request arrives.
                crossbeam_channel::select! {
                    recv(self.wake_rx) -> _ => {}
                    recv(commands) -> s => match s {
                        Ok(s) => self.queue.push_back(s),
                        // The engine was dropped: stop everything now.
                        Err(_) => {
                            for seq in &mut self.running {
                                seq.outcome.get_or_insert(Outcome::Cancelled);
                            }
                            self.retire();
                            return;
                        }
                    },
                    default(Duration::from_millis(50)) => {}
                }
                while self.wake_rx.try_recv().is_ok() {}
            }
        }
    }

    fn reserved(&self) -> usize {
        self.running.iter().map(|s| s.reserved).sum()
    }

    fn admit(&mut self) {
        while self.running.len() < self.config.max_running {
            let Some(sub) = self.queue.front() else { break };
            let need = sub.request.prompt.len() + sub.request.max_tokens;
            if need > self.config.kv_budget_tokens || need > self.llm.max_positions() {
                let sub = self.queue.pop_front();
                if let Some(sub) = sub {
                    self.totals.failed += 1;
                    let _ = sub.events.send(Event::Failed(Failure::Invalid(format!(
                        "prompt ({} tokens) + max_tokens ({}) exceed what this model can hold ({})",
                        sub.request.prompt.len(),
                        sub.request.max_tokens,
                        self.config.kv_budget_tokens.min(self.llm.max_positions())
                    ))));
                }
                continue;
            }
            if self.reserved() + need > self.config.kv_budget_tokens {
                break; // wait for running sequences to finish
            }
            let Some(sub) = self.queue.pop_front() else {
                break;
            };
            let events = sub.events.clone();
            match self.start(sub) {
                Ok(seq) => self.running.push(seq),
                Err(e) => {
                    self.totals.failed += 1;
                    let _ = events.send(Event::Failed(Failure::Invalid(e.to_string())));
                }
            }
        }
    }

    fn start(&mut self, sub: Submission) -> Result<Sequence<M::Cache>> {
        // Encoder jobs submitted from here on are the request's ([`pool::EncoderPool`] traces
        // them under the span current at submission).
        let _traced = sub.trace.clone().entered();
        let trace = sub.trace;
        let r = sub.request;
        if r.prompt.is_empty() {
            return Err(Error::Input("empty prompt".into()));
        }
        if r.max_tokens == 0 {
            return Err(Error::Input("max_tokens must be at least 1".into()));
        }
        let sampler = Sampler::new(r.sampling.clone())?;
        // Each item's rows, in prompt order per placeholder token.
        let mut media_rows = vec![0..0; r.media.len()];
        let mut tokens: Vec<u32> = r.media.iter().map(|m| m.placeholder).collect();
        tokens.sort_unstable();
        tokens.dedup();
        for token in tokens {
            let of_token: Vec<usize> = (0..r.media.len())
                .filter(|&i| r.media[i].placeholder == token)
                .collect();
            let counts: Vec<usize> = of_token.iter().map(|&i| r.media[i].tokens).collect();
            let map = PlaceholderMap::build(&r.prompt, token, &counts)?;
            for (i, rows) in of_token.into_iter().zip(map.items) {
                media_rows[i] = rows;
            }
        }
        let (positions, delta) = match self.config.positions {
            PositionScheme::MRope { merge } if !r.media.is_empty() => {
                let spans = media_spans(&r.media, &media_rows)?;
                mrope_positions(&r.prompt, &spans, merge)?
            }
            _ => ((0..r.prompt.len() as i64).map(|p| [p; 3]).collect(), 0),
        };
        let text_prefix = media_rows
            .iter()
            .map(|r| r.start)
            .min()
            .unwrap_or(r.prompt.len());
        let reserved = r.prompt.len() + r.max_tokens;
        let cache = self.llm.new_cache(reserved)?;

        // Pin every item's features; encode what nobody has encoded yet (after every pin is
        // taken, so that an input whose submission fails is failed for all of its parts).
        let mut media = Vec::with_capacity(r.media.len());
        let mut cached_media = 0;
        let mut to_encode = Vec::new();
        let mut previous: Option<(Arc<EncodeInput>, FeatureKey)> = None;
        for item in r.media {
            // The parts of one input share its features: hashed, pinned and encoded as one.
            let part_of_previous = previous
                .as_ref()
                .filter(|(input, _)| item.part.is_some() && Arc::ptr_eq(input, &item.input))
                .map(|&(_, key)| key);
            let key = match part_of_previous {
                Some(key) => key,
                None => {
                    let key = store::feature_key(
                        &self.config.model_name,
                        &item.processor_config,
                        &item.input,
                    );
                    let pinned = match item.input.as_ref() {
                        EncodeInput::Later { .. } => {
                            self.store.pin_once(key);
                            store::Pinned::MustEncode
                        }
                        _ => self.store.pin(key),
                    };
                    match pinned {
                        store::Pinned::Shared => cached_media += 1,
                        store::Pinned::MustEncode => {
                            let piece_of = item.piece.map(|p| (self.request_serial, p.item));
                            to_encode.push((key, item.input.clone(), item.share_key, piece_of));
                        }
                    }
                    previous = Some((item.input.clone(), key));
                    key
                }
            };
            if part_of_previous.is_some() {
                self.store.pin(key);
            }
            media.push((key, item));
        }
        self.request_serial += 1;
        for (key, input, share_key, piece_of) in to_encode {
            let store = self.store.clone();
            let wake = self.wake_tx.clone();
            let done = move |result| {
                store.complete(key, result);
                let _ = wake.send(());
            };
            // One id per item of one request: its pieces are batched apart.
            let piece_id = piece_of.map(|(request, item)| (request << 16) ^ item as u64);
            if let EncodeInput::Later { handoff, .. } = input.as_ref() {
                let (pool, store, trace) = (self.pool.clone(), self.store.clone(), trace.clone());
                handoff.attach(move |handed| {
                    let _traced = trace.enter();
                    // A request that ended meanwhile released its pin: nothing waits for it.
                    if store.state(&key).is_none() {
                        return;
                    }
                    let input = match handed {
                        Ok(input) => Arc::new(input),
                        Err(message) => return done(Err(message)),
                    };
                    let (fail, failing) = (store.clone(), key);
                    let submitted = match piece_id {
                        Some(id) => pool.submit_piece(input, id, share_key, done),
                        None => pool.submit_shared(input, share_key, done),
                    };
                    if let Err(e) = submitted {
                        fail.complete(failing, Err(e.to_string()));
                    }
                });
                continue;
            }
            let submitted = match piece_id {
                Some(id) => self.pool.submit_piece(input, id, share_key, done),
                None => self.pool.submit_shared(input, share_key, done),
            };
            if let Err(e) = submitted {
                self.store.complete(key, Err(e.to_string()));
            }
        }
        let mut pieced: Vec<usize> = media
            .iter()
            .filter_map(|(_, m)| m.piece.map(|p| p.item))
            .collect();
        pieced.dedup();
        let piece_clocks = pieced.into_iter().map(|item| Some((item, None))).collect();
        let pieces_pending = media.iter().filter(|(_, m)| m.piece.is_some()).count();
        Ok(Sequence {
            ids: r.prompt,
            positions,
            delta,
            pinned: !media.is_empty(),
            media_ready: media.is_empty(),
            media,
            media_rows,
            cached_media,
            ready_until: text_prefix,
            pieces_pending,
            piece_clocks,
            admitted: std::time::Instant::now(),
            prefilled: 0,
            cache,
            reserved,
            sampler,
            stream: self.text.stream(true),
            next: None,
            generated: 0,
            text: String::new(),
            emitted: 0,
            max_tokens: r.max_tokens,
            stop: r.stop,
            events: sub.events,
            cancel: sub.cancel,
            outcome: None,
        })
    }

    fn poll_media(&mut self) {
        for seq in self
            .running
            .iter_mut()
            .filter(|s| !s.media_ready && s.outcome.is_none())
        {
            let mut ready_until = seq.ids.len();
            let mut ready = Vec::with_capacity(seq.media.len());
            for (item, ((key, _), rows)) in seq.media.iter().zip(&seq.media_rows).enumerate() {
                match self.store.state(key) {
                    Some(FeatureState::Ready(_)) => ready.push(true),
                    Some(FeatureState::Failed(message)) => {
                        // The whole item fails with any piece of it: what was prefilled goes
                        // with the sequence's cache.
                        seq.outcome = Some(Outcome::Failed(Failure::Encode { item, message }));
                        break;
                    }
                    Some(FeatureState::Encoding) | None => {
                        ready.push(false);
                        ready_until = ready_until.min(rows.start);
                    }
                }
            }
            if seq.outcome.is_some() {
                continue;
            }
            seq.ready_until = ready_until;
            seq.media_ready = ready_until == seq.ids.len();
            let is_piece_of = |m: &MediaItem, item: usize| m.piece.is_some_and(|p| p.item == item);
            seq.pieces_pending = seq
                .media
                .iter()
                .zip(&ready)
                .filter(|((_, m), ready)| m.piece.is_some() && !**ready)
                .count();
            let since = seq.admitted.elapsed();
            for clock in &mut seq.piece_clocks {
                let Some((item, first)) = clock else { continue };
                let pieces: Vec<bool> = seq
                    .media
                    .iter()
                    .zip(&ready)
                    .filter(|((_, m), _)| is_piece_of(m, *item))
                    .map(|(_, &r)| r)
                    .collect();
                if pieces.contains(&true) && first.is_none() {
                    *first = Some(since);
                }
                if !pieces.is_empty() && !pieces.contains(&false) {
                    self.totals.pieced_items += 1;
                    self.totals.first_piece_seconds += first.unwrap_or(since).as_secs_f64();
                    self.totals.last_piece_seconds += since.as_secs_f64();
                    *clock = None;
                }
            }
        }
    }

    /// One batched forward over decodes and prefill chunks. Returns whether anything ran.
    fn step(&mut self) -> Result<bool> {
        let mut budget = self.config.prefill_chunk.max(1);
        // Sequences with rows to feed this step: a long prompt's chunk is also cut by its
        // attention cost (rows × keys); when there is more than one, so that a step stays about as
        // long as a full chunk over a short context and the others' tokens are not held up
        // behind it (a long video prefilling piece by piece beside a text question), else less
        // (smaller steps cost more in all: each reads the whole context's keys and values).
        let active = self
            .running
            .iter()
            .filter(|seq| {
                seq.outcome.is_none()
                    && (seq.next.is_some()
                        || seq.prefilled
                            < if seq.media_ready {
                                seq.ids.len()
                            } else {
                                seq.ready_until
                            })
            })
            .count();
        let step_context = if active > 1 {
            SHARED_STEP_CONTEXT
        } else {
            LONE_STEP_CONTEXT
        };
        let attention_budget = self.config.prefill_chunk.max(1) * step_context;
        // (sequence index, rows fed, whether its last row yields a token)
        let mut plan: Vec<(usize, Range<usize>, bool)> = Vec::new();
        for (i, seq) in self.running.iter().enumerate() {
            if seq.outcome.is_some() || seq.cancel.load(Ordering::Relaxed) || seq.events.is_closed()
            {
                continue;
            }
            if seq.next.is_some() {
                plan.push((i, 0..0, true));
                continue;
            }
            let limit = if seq.media_ready {
                seq.ids.len()
            } else {
                seq.ready_until
            };
            if seq.prefilled < limit && budget > 0 {
                let mut n = (limit - seq.prefilled).min(budget);
                let keys = seq.prefilled + n;
                n = n.min((attention_budget / keys.max(1)).max(MIN_CUT_ROWS));
                budget -= n;
                let rows = seq.prefilled..seq.prefilled + n;
                plan.push((i, rows.clone(), rows.end == seq.ids.len()));
            }
        }
        if plan.is_empty() {
            return Ok(false);
        }
        let mut inputs = Vec::with_capacity(plan.len());
        for (i, rows, _) in &plan {
            inputs.push(self.input_rows(&self.running[*i], rows.clone())?);
        }
        // Disjoint mutable borrows of the caches, in plan order.
        let mut caches: Vec<Option<&mut M::Cache>> = self
            .running
            .iter_mut()
            .map(|s| Some(&mut s.cache))
            .collect();
        let mut embeds = Vec::with_capacity(inputs.len());
        let mut positions = Vec::with_capacity(inputs.len());
        let mut deepstacks = Vec::with_capacity(inputs.len());
        for input in inputs {
            embeds.push(input.embeds);
            positions.push(input.positions);
            deepstacks.push(input.deepstack);
        }
        let mut steps = Vec::with_capacity(plan.len());
        for ((((i, _, _), embeds), positions), deepstack) in
            plan.iter().zip(embeds).zip(&positions).zip(&deepstacks)
        {
            let cache = caches[*i]
                .take()
                .ok_or_else(|| Error::Input("sequence planned twice".into()))?;
            steps.push(SeqStep {
                embeds,
                positions,
                cache,
                deepstack: deepstack
                    .as_ref()
                    .map(|(rows, features)| Deepstack { rows, features }),
            });
        }
        let llm = &self.llm;
        let hidden = llm.device().run_on(|| llm.forward_batch(steps))?;
        // The last hidden state of each sequence that samples this step, for one logits product.
        let mut sampling = Vec::new();
        for ((i, rows, samples), h) in plan.into_iter().zip(hidden) {
            let seq = &mut self.running[i];
            if seq.next.take().is_none() {
                seq.prefilled = rows.end;
                if seq.prefilled == seq.ids.len() && seq.pinned {
                    // Merged: the features are in the KV cache now; the store may cache or drop them.
                    for (key, _) in &seq.media {
                        self.store.unpin(key);
                    }
                    seq.pinned = false;
                }
            }
            if samples {
                sampling.push((i, h.slice_rows(h.rows() - 1, 1)?));
            }
        }
        if !sampling.is_empty() {
            // One product for the batch: the LM head, the largest matrix, is read once a step
            // instead of once a sequence (at batch 8, most of a step's time had gone to it).
            let mut last =
                Tensor::zeros(self.llm.device(), &[sampling.len(), self.llm.hidden_size()])?;
            for (at, (_, row)) in sampling.iter().enumerate() {
                last.write_rows(at, row)?;
            }
            let logits = self.llm.logits(&last)?.to_host()?;
            let vocab = logits.len() / sampling.len();
            for ((i, _), row) in sampling.iter().zip(logits.chunks_exact(vocab.max(1))) {
                let seq = &mut self.running[*i];
                let token = seq.sampler.sample(row)?;
                on_token(seq, token, &self.eos, &self.text);
            }
        }
        Ok(true)
    }

    /// Embeddings and positions of prompt rows `rows` (media rows replaced by their features, with
    /// their deepstack rows if the model has them), or of the pending sampled token when `rows` is
    /// empty.
    fn input_rows(
        &self,
        seq: &Sequence<M::Cache>,
        rows: Range<usize>,
    ) -> Result<StepInput<M::Backend>> {
        if let Some(token) = seq.next {
            let pos = seq.cache.len() as i64 + seq.delta;
            return Ok(StepInput {
                embeds: self.llm.embed(&[token])?,
                positions: vec![[pos; 3]],
                deepstack: None,
            });
        }
        let mut embeds = self.llm.embed(&seq.ids[rows.clone()])?;
        let hidden = self.llm.hidden_size();
        let levels = self.config.deepstack_levels;
        let width = hidden * (1 + levels);
        let mut deepstack_rows = Vec::new();
        let mut deepstack = vec![Vec::new(); levels];
        for ((key, item), item_rows) in seq.media.iter().zip(&seq.media_rows) {
            let (start, end) = (item_rows.start.max(rows.start), item_rows.end.min(rows.end));
            if start >= end {
                continue;
            }
            let Some(FeatureState::Ready(features)) = self.store.state(key) else {
                return Err(Error::Input(
                    "media features vanished before the merge".into(),
                ));
            };
            let made = features.len() / width;
            let first = item.part.map_or(0, |p| p.first_token);
            let fits = match item.part {
                Some(_) => first + item_rows.len() <= made,
                None => made == item_rows.len(),
            };
            if !features.len().is_multiple_of(width) || !fits {
                return Err(Error::Input(format!(
                    "an encoder produced {} values ({width} a token) for {} placeholders from token {first}",
                    features.len(),
                    item_rows.len()
                )));
            }
            let from = first + start - item_rows.start;
            let part = &features[from * width..(from + end - start) * width];
            let mut main = Vec::with_capacity((end - start) * hidden);
            for row in part.chunks_exact(width) {
                let (first, rest) = row.split_at(hidden);
                main.extend_from_slice(first);
                for (level, values) in deepstack.iter_mut().zip(rest.chunks_exact(hidden)) {
                    level.extend_from_slice(values);
                }
            }
            deepstack_rows.extend((start - rows.start) as u32..(end - rows.start) as u32);
            let main = Tensor::from_host_vec(self.llm.device(), main, &[end - start, hidden])?;
            embeds.write_rows(start - rows.start, &main)?;
        }
        let deepstack = if levels > 0 && !deepstack_rows.is_empty() {
            let n = deepstack_rows.len();
            let features = deepstack
                .into_iter()
                .map(|values| Tensor::from_host_vec(self.llm.device(), values, &[n, hidden]))
                .collect::<Result<Vec<_>>>()?;
            Some((deepstack_rows, features))
        } else {
            None
        };
        Ok(StepInput {
            embeds,
            positions: seq.positions[rows].to_vec(),
            deepstack,
        })
    }

    /// Ends sequences that finished, failed or were cancelled: final event, pins and cache freed.
    fn retire(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            let seq = &mut self.running[i];
            if seq.outcome.is_none()
                && (seq.cancel.load(Ordering::Relaxed) || seq.events.is_closed())
            {
                seq.outcome = Some(Outcome::Cancelled);
            }
            if seq.outcome.is_none() {
                i += 1;
                continue;
            }
            let seq = self.running.swap_remove(i);
            if seq.pinned {
                for (key, _) in &seq.media {
                    self.store.unpin(key);
                }
            }
            match seq.outcome {
                Some(Outcome::Finished(finish)) => {
                    self.totals.completed += 1;
                    let usage = Usage {
                        prompt_tokens: seq.ids.len(),
                        completion_tokens: seq.generated,
                        cached_media: seq.cached_media,
                    };
                    let _ = seq.events.send(Event::Done { finish, usage });
                }
                Some(Outcome::Failed(msg)) => {
                    self.totals.failed += 1;
                    let _ = seq.events.send(Event::Failed(msg));
                }
                Some(Outcome::Cancelled) | None => self.totals.cancelled += 1,
            }
        }
    }

    fn publish_stats(&self) {
        let mut s = self.totals.clone();
        s.running = self.running.len();
        s.queued = self.queue.len();
        s.waiting_for_encoder = self.running.iter().filter(|s| !s.media_ready).count();
        s.kv_bytes = self.running.iter().map(|s| s.cache.bytes()).sum();
        s.kv_reserved_tokens = self.reserved();
        s.pieces_in_flight = self.running.iter().map(|s| s.pieces_pending).sum();
        if let Ok(mut shared) = self.stats.lock() {
            *shared = s;
        }
    }
}

fn media_spans(media: &[MediaItem], rows: &[Range<usize>]) -> Result<Vec<MediaSpan>> {
    let mut order: Vec<usize> = (0..media.len()).collect();
    order.sort_by_key(|&i| rows[i].start);
    order
        .into_iter()
        .map(|i| match media[i].input.as_ref() {
            EncodeInput::Vision { grid, .. }
            | EncodeInput::Embeddings {
                grid: Some(grid), ..
            }
            | EncodeInput::Later {
                grid: Some(grid), ..
            } => Ok(MediaSpan {
                token: media[i].placeholder,
                grid: media[i].part.map_or(*grid, |part| part.grid),
                time_interval: media[i].time_interval,
                continues_at: media[i].piece.and_then(|p| p.continues_at),
            }),
            EncodeInput::Embeddings { grid: None, .. } | EncodeInput::Later { grid: None, .. } => {
                Err(Error::Input(
                    "embeddings without their grid in an M-RoPE (vision) model".into(),
                ))
            }
            EncodeInput::Audio { .. } => {
                Err(Error::Input("audio in an M-RoPE (vision) model".into()))
            }
        })
        .collect()
}

/// Records a sampled token: streams its text (holding back what may start a stop string) and decides
/// whether the sequence is done.
fn on_token<C>(seq: &mut Sequence<C>, token: u32, eos: &[u32], text: &TextProcessor) {
    seq.generated += 1;
    if eos.contains(&token) {
        flush(seq, None, token);
        seq.outcome = Some(Outcome::Finished(FinishReason::Stop));
        return;
    }
    match seq.stream.step(text, token) {
        Ok(Some(delta)) => seq.text.push_str(&delta),
        Ok(None) => {}
        Err(e) => {
            seq.outcome = Some(Outcome::Failed(Failure::Internal(e.to_string())));
            return;
        }
    }
    let unsent = &seq.text[seq.emitted..];
    let found = (seq.stop.iter().enumerate()).filter_map(|(i, s)| Some((unsent.find(s)?, i)));
    if let Some((at, which)) = found.min() {
        let end = seq.emitted + at;
        flush(seq, Some(end), token);
        seq.outcome = Some(Outcome::Finished(FinishReason::StopString(which)));
        return;
    }
    let hold = held_back(&seq.text[seq.emitted..], &seq.stop);
    let end = seq.text.len() - hold;
    if seq.generated >= seq.max_tokens {
        flush(seq, None, token);
        seq.outcome = Some(Outcome::Finished(FinishReason::Length));
        return;
    }
    flush(seq, Some(end), token);
    seq.next = Some(token);
}

/// Sends the text from `emitted` to `end` (all of it when `None`) with the token.
fn flush<C>(seq: &mut Sequence<C>, end: Option<usize>, token: u32) {
    let end = end.unwrap_or(seq.text.len()).max(seq.emitted);
    let text = seq.text[seq.emitted..end].to_owned();
    seq.emitted = end;
    if seq.events.send(Event::Token { id: token, text }).is_err() {
        seq.outcome = Some(Outcome::Cancelled);
    }
}

/// Bytes at the end of `pending` that are a proper prefix of some stop string.
fn held_back(pending: &str, stops: &[String]) -> usize {
    let mut hold = 0;
    for stop in stops {
        for (k, _) in stop.char_indices().skip(1) {
            if pending.ends_with(&stop[..k]) {
                hold = hold.max(k);
            }
        }
    }
    hold
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_back_only_possible_stop_prefixes() {
        let stops = vec!["END".to_owned(), "ü!".to_owned()];
        assert_eq!(held_back("hello E", &stops), 1);
        assert_eq!(held_back("hello EN", &stops), 2);
        assert_eq!(held_back("hello", &stops), 0);
        assert_eq!(held_back("grü", &stops), "ü".len());
    }
}
