//! The encoder pool: encoder devices, each a thread of its own in front of its device (a CPU device
//! has its own rayon threads; a CUDA device, later, its own stream), fed by a queue. `submit` never
//! blocks: it picks the least-loaded device that has an encoder for the input and returns a ticket.
//! A device drains up to `max_batch` queued jobs of one kind at a time and encodes them as one batch.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use super::encoder::Encoder;
use super::input::{EncodeInput, EncoderKind};
use crate::error::{Error, Result};

/// What a finished job delivers: the item's embeddings or why it failed.
pub type EncodeResult = std::result::Result<Arc<Vec<f32>>, String>;

struct Job {
    input: Arc<EncodeInput>,
    /// Where the shared cache is to keep the output (the caller looked there already).
    share_key: Option<[u8; 32]>,
    /// The item this job is a piece of: a batch takes one piece of an item, so the item's first
    /// piece is done first and its next ones follow (on this or another device).
    piece_of: Option<u64>,
    done: Box<dyn FnOnce(EncodeResult) + Send>,
    /// The span it was submitted in (its request's), and when: its encoding is traced there,
    /// the wait for the device included.
    trace: tracing::Span,
    queued: Instant,
}

struct Device {
    name: String,
    kinds: Vec<EncoderKind>,
    queue: Option<Sender<Job>>,
    /// Jobs queued or running on this device.
    load: Arc<AtomicUsize>,
    thread: Option<JoinHandle<()>>,
}

/// What one encoded batch took, reported to the pool's observer (metrics) from the device's thread.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchReport<'a> {
    pub device: &'a str,
    pub kind: EncoderKind,
    pub items: usize,
    /// Items of the batch whose encoding failed.
    pub failed: usize,
    /// Time in the encoder (not in the queue).
    pub took: Duration,
}

/// Receives a [`BatchReport`] after every batch.
pub type BatchObserver = Arc<dyn Fn(&BatchReport<'_>) + Send + Sync>;

/// Encoder outputs kept beyond this process, where other replicas find them, under keys their
/// callers choose (the gateway's: an item's media and plan, so that it is found before the item is
/// preprocessed). It must not fail a request: a lookup it cannot answer is a miss, a write it
/// cannot make is dropped.
pub trait SharedFeatures: Send + Sync {
    /// The output under `key` with the note stored beside it (what a caller needs to use the
    /// output without the input it was encoded from); a miss unless both are there.
    fn get(&self, key: &[u8; 32]) -> Option<(Vec<f32>, Vec<u8>)>;
    /// Stores an output; the pool does, for every job submitted with a key.
    fn put(&self, key: &[u8; 32], features: &[f32]);
    /// Stores the note for `key`'s output (written before the output itself is).
    fn put_note(&self, key: &[u8; 32], note: Vec<u8>);
}

/// A device's encoders, as configured: a name and one encoder per modality it serves.
pub struct DeviceSpec {
    pub name: String,
    pub encoders: Vec<Arc<dyn Encoder>>,
}

pub struct EncoderPool {
    devices: Vec<Device>,
}

/// Per-device queue depths (for metrics).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceLoad {
    pub name: String,
    pub queued: usize,
}

impl EncoderPool {
    pub fn new(specs: Vec<DeviceSpec>, max_batch: usize) -> Result<Self> {
        Self::with_observer(specs, max_batch, None)
    }

    /// A pool that reports every batch to `observer`.
    pub fn with_observer(
        specs: Vec<DeviceSpec>,
        max_batch: usize,
        observer: Option<BatchObserver>,
    ) -> Result<Self> {
        Self::start(specs, max_batch, observer, None)
    }

    /// A pool that reports every batch to `observer` and writes the output of every job submitted
    /// with a key to `shared`.
    pub fn start(
        specs: Vec<DeviceSpec>,
        max_batch: usize,
        observer: Option<BatchObserver>,
        shared: Option<Arc<dyn SharedFeatures>>,
    ) -> Result<Self> {
        let mut devices = Vec::with_capacity(specs.len());
        for spec in specs {
            let (tx, rx) = crossbeam_channel::unbounded::<Job>();
            let load = Arc::new(AtomicUsize::new(0));
            let kinds = spec.encoders.iter().map(|e| e.kind()).collect();
            let worker_load = load.clone();
            let encoders = spec.encoders;
            let worker = Worker {
                name: spec.name.clone(),
                encoders,
                load: worker_load,
                max_batch: max_batch.max(1),
                observer: observer.clone(),
                shared: shared.clone(),
            };
            let thread = std::thread::Builder::new()
                .name(format!("encoder-{}", spec.name))
                .spawn(move || worker.run(rx))
                .map_err(|e| Error::Device {
                    device: spec.name.clone(),
                    reason: e.to_string(),
                })?;
            devices.push(Device {
                name: spec.name,
                kinds,
                queue: Some(tx),
                load,
                thread: Some(thread),
            });
        }
        Ok(Self { devices })
    }

    /// Queues `input` on the least-loaded device able to encode it; `done` runs on that device's
    /// thread when it finishes. Embeddings need no encoder: `done` runs at once, here.
    pub fn submit(
        &self,
        input: Arc<EncodeInput>,
        done: impl FnOnce(EncodeResult) + Send + 'static,
    ) -> Result<()> {
        self.submit_shared(input, None, done)
    }

    /// [`Self::submit`] of an input whose output the shared cache keeps under `share_key` (the
    /// caller looked there already): it is written there, not looked up.
    pub fn submit_shared(
        &self,
        input: Arc<EncodeInput>,
        share_key: Option<[u8; 32]>,
        done: impl FnOnce(EncodeResult) + Send + 'static,
    ) -> Result<()> {
        self.submit_job(input, share_key, None, done)
    }

    /// [`Self::submit`] of one piece of an item (`item`: an id no other item shares): pieces of one
    /// item are never in one batch, so they finish in order and the first can be merged while the
    /// next encode; pieces of different items batch as items do.
    /// With `share_key`, the shared cache keeps the piece's output under it, as
    /// [`Self::submit_shared`] does.
    pub fn submit_piece(
        &self,
        input: Arc<EncodeInput>,
        item: u64,
        share_key: Option<[u8; 32]>,
        done: impl FnOnce(EncodeResult) + Send + 'static,
    ) -> Result<()> {
        self.submit_job(input, share_key, Some(item), done)
    }

    fn submit_job(
        &self,
        input: Arc<EncodeInput>,
        share_key: Option<[u8; 32]>,
        piece_of: Option<u64>,
        done: impl FnOnce(EncodeResult) + Send + 'static,
    ) -> Result<()> {
        let Some(kind) = input.kind() else {
            return match input.as_ref() {
                EncodeInput::Embeddings { embeddings, .. } => {
                    done(Ok(embeddings.clone()));
                    Ok(())
                }
                _ => Err(Error::Input(
                    "a piece whose input has not arrived cannot be encoded".into(),
                )),
            };
        };
        let device = self
            .devices
            .iter()
            .filter(|d| d.kinds.contains(&kind))
            .min_by_key(|d| d.load.load(Ordering::Relaxed))
            .ok_or_else(|| Error::Input(format!("no encoder device serves {kind:?} inputs")))?;
        device.load.fetch_add(1, Ordering::Relaxed);
        let job = Job {
            input,
            share_key,
            piece_of,
            done: Box::new(done),
            trace: tracing::Span::current(),
            queued: Instant::now(),
        };
        let sent = device.queue.as_ref().is_some_and(|q| q.send(job).is_ok());
        if !sent {
            device.load.fetch_sub(1, Ordering::Relaxed);
            return Err(Error::Device {
                device: device.name.clone(),
                reason: "encoder thread has stopped".into(),
            });
        }
        Ok(())
    }

    pub fn loads(&self) -> Vec<DeviceLoad> {
        self.devices
            .iter()
            .map(|d| DeviceLoad {
                name: d.name.clone(),
                queued: d.load.load(Ordering::Relaxed),
            })
            .collect()
    }
}

impl Drop for EncoderPool {
    fn drop(&mut self) {
        for d in &mut self.devices {
            d.queue = None;
        }
        for d in &mut self.devices {
            if let Some(t) = d.thread.take() {
                let _ = t.join();
            }
        }
    }
}

/// A device's thread: its encoders and what it reports to.
struct Worker {
    name: String,
    encoders: Vec<Arc<dyn Encoder>>,
    load: Arc<AtomicUsize>,
    max_batch: usize,
    observer: Option<BatchObserver>,
    shared: Option<Arc<dyn SharedFeatures>>,
}

impl Worker {
    fn run(self, rx: Receiver<Job>) {
        let max_batch = self.max_batch;
        let mut backlog: VecDeque<Job> = VecDeque::new();
        loop {
            let first = match backlog.pop_front() {
                Some(job) => job,
                None => match rx.recv() {
                    Ok(job) => job,
                    Err(_) => return,
                },
            };
            let Some(kind) = first.input.kind() else {
                // `submit` answers embeddings itself; none is ever queued.
                (first.done)(Err("embeddings reached an encoder queue".into()));
                continue;
            };
            let mut batch = vec![first];
            // Take what else is queued of the same kind, one piece of an item at most; others wait
            // their turn in order.
            let fits = |batch: &[Job], job: &Job| {
                job.input.kind() == Some(kind)
                    && batch.len() < max_batch
                    && job
                        .piece_of
                        .is_none_or(|item| batch.iter().all(|b| b.piece_of != Some(item)))
            };
            let mut rest = VecDeque::new();
            while let Some(job) = backlog.pop_front() {
                if fits(&batch, &job) {
                    batch.push(job);
                } else {
                    rest.push_back(job);
                }
            }
            while batch.len() < max_batch {
                match rx.try_recv() {
                    Ok(job) if fits(&batch, &job) => batch.push(job),
                    Ok(job) => rest.push_back(job),
                    Err(_) => break,
                }
            }
            backlog = rest;
            self.encode(kind, batch);
        }
    }

    fn encode(&self, kind: EncoderKind, batch: Vec<Job>) {
        let started = Instant::now();
        let results = match self.encoders.iter().find(|e| e.kind() == kind) {
            Some(encoder) => {
                let inputs: Vec<&EncodeInput> = batch.iter().map(|j| j.input.as_ref()).collect();
                // A span per job, under its request's, open while the batch encodes.
                let _traced: Vec<tracing::Span> = batch
                    .iter()
                    .filter(|job| !job.trace.is_none())
                    .map(|job| {
                        tracing::info_span!(
                            parent: &job.trace,
                            "encode",
                            mmgate.encoder = ?kind,
                            mmgate.device = %self.name,
                            mmgate.batch = i64::try_from(inputs.len()).unwrap_or(i64::MAX),
                            mmgate.queued_us = i64::try_from(job.queued.elapsed().as_micros())
                                .unwrap_or(i64::MAX),
                        )
                    })
                    .collect();
                encoder.encode(&inputs)
            }
            None => batch
                .iter()
                .map(|_| Err(Error::Input(format!("no {kind:?} encoder"))))
                .collect(),
        };
        // Every job's callback must run exactly once, whatever the encoder returned.
        let results = if results.len() == batch.len() {
            results
        } else {
            batch
                .iter()
                .map(|_| {
                    Err(Error::Input(
                        "encoder returned a wrong number of results".into(),
                    ))
                })
                .collect()
        };
        tracing::debug!(device = %self.name, ?kind, items = batch.len(), took = ?started.elapsed(), "encoded");
        if let Some(observe) = &self.observer {
            observe(&BatchReport {
                device: &self.name,
                kind,
                items: batch.len(),
                failed: results.iter().filter(|r| r.is_err()).count(),
                took: started.elapsed(),
            });
        }
        for (job, result) in batch.into_iter().zip(results) {
            // Written before the job's callers hear of it, so another replica asked right after
            // finds it.
            if let (Some(shared), Some(key), Ok(features)) = (&self.shared, job.share_key, &result)
            {
                shared.put(&key, features);
            }
            self.load.fetch_sub(1, Ordering::Relaxed);
            (job.done)(result.map(Arc::new).map_err(|e| e.to_string()));
        }
    }
}
