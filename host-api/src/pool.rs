//! A bounded pool of threads for plugin calls. Plugin calls are CPU-bound and synchronous: they must
//! never run on an async reactor thread, where one slow image would stall every connection. Callers
//! `await` the result; when every worker is busy and the queue is full they get `Overloaded` at once
//! instead of queueing without bound.

use std::panic::AssertUnwindSafe;
use std::thread::JoinHandle;

use crossbeam_channel::{Sender, TrySendError};

use crate::error::CallError;

type Job = Box<dyn FnOnce() + Send + 'static>;

pub struct PluginPool {
    sender: Option<Sender<Job>>,
    workers: Vec<JoinHandle<()>>,
    queue_capacity: usize,
}

impl PluginPool {
    /// `threads` workers (at least one) and room for `queue_capacity` waiting calls.
    pub fn new(threads: usize, queue_capacity: usize) -> std::io::Result<PluginPool> {
        let (sender, receiver) = crossbeam_channel::bounded::<Job>(queue_capacity);
        let mut workers = Vec::new();
        for index in 0..threads.max(1) {
            let receiver = receiver.clone();
            let worker = std::thread::Builder::new()
                .name(format!("mmgate-plugin-{index}"))
                .spawn(move || {
                    for job in receiver {
                        // A panic in host code must cost one call, not a worker: the caller sees its
                        // result channel close and gets a host error.
                        if std::panic::catch_unwind(AssertUnwindSafe(job)).is_err() {
                            tracing::error!(
                                "a plugin call panicked in the host; the worker goes on"
                            );
                        }
                    }
                })?;
            workers.push(worker);
        }
        Ok(PluginPool {
            sender: Some(sender),
            workers,
            queue_capacity,
        })
    }

    pub fn threads(&self) -> usize {
        self.workers.len()
    }

    /// Calls waiting for a worker right now.
    pub fn queued(&self) -> usize {
        self.sender.as_ref().map_or(0, Sender::len)
    }

    /// Run `call` on a worker and wait for it without blocking the async runtime.
    pub async fn run<R: Send + 'static>(
        &self,
        call: impl FnOnce() -> Result<R, CallError> + Send + 'static,
    ) -> Result<R, CallError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move || {
            let _ = tx.send(call());
        });
        let sender = self
            .sender
            .as_ref()
            .ok_or_else(|| CallError::Host("the plugin pool is shut down".into()))?;
        sender.try_send(job).map_err(|e| match e {
            TrySendError::Full(_) => CallError::Overloaded {
                queued: self.queue_capacity,
            },
            TrySendError::Disconnected(_) => CallError::Host("the plugin pool is shut down".into()),
        })?;
        rx.await
            .map_err(|_| CallError::Host("the plugin call panicked in the host".into()))?
    }
}

impl Drop for PluginPool {
    fn drop(&mut self) {
        // Closing the channel ends each worker's loop once the queued calls are done.
        self.sender.take();
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}
