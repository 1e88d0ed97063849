//! A bounded pool of threads for plugin calls. Plugin calls are CPU-bound and synchronous: they must
//! never run on an async reactor thread, where one slow image would stall every connection. Callers
//! `await` the result; when every worker is busy and the queue is full they get `Overloaded` at once
//! instead of queueing without bound.
//!
//! Two queues: the short calls that decide what a request does (choosing a plugin, probe, plan)
//! go [ahead](PluginPool::run_ahead) of the queued preprocessing, so that a request asking for a
//! small image is not planned only after another's long video has been made part by part.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender, TrySendError};

use crate::error::CallError;

type Job = Box<dyn FnOnce() + Send + 'static>;

pub struct PluginPool {
    /// Preprocessing, and the short calls ahead of it; `None` once the pool is shutting down.
    queues: Option<Queues>,
    workers: Vec<JoinHandle<()>>,
    queue_capacity: usize,
    /// Calls running on a worker right now.
    running: Arc<AtomicUsize>,
}

/// Counts one call as running until dropped (so a call that panics is counted out too).
struct Running(Arc<AtomicUsize>);

impl Running {
    fn start(count: &Arc<AtomicUsize>) -> Running {
        count.fetch_add(1, Ordering::SeqCst);
        Running(count.clone())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

struct Queues {
    normal: Sender<Job>,
    ahead: Sender<Job>,
}

/// Which queue a call waits in.
#[derive(Clone, Copy)]
enum Lane {
    Normal,
    Ahead,
}

/// The next call for a worker: one waiting ahead if any (the biased select takes the first ready
/// queue in its list), else whichever comes first; `None` once both queues are closed and empty.
fn next_job(ahead: &Receiver<Job>, normal: &Receiver<Job>) -> Option<Job> {
    crossbeam_channel::select_biased! {
        recv(ahead) -> job => job.ok().or_else(|| normal.recv().ok()),
        recv(normal) -> job => job.ok().or_else(|| ahead.recv().ok()),
    }
}

impl PluginPool {
    /// `threads` workers (at least one) at priority `nice` (see [`crate::priority`]; 0: this
    /// thread's) and room for `queue_capacity` waiting calls in each queue.
    pub fn new(threads: usize, queue_capacity: usize, nice: u8) -> std::io::Result<PluginPool> {
        let (normal, normal_rx) = crossbeam_channel::bounded::<Job>(queue_capacity);
        let (ahead, ahead_rx) = crossbeam_channel::bounded::<Job>(queue_capacity);
        let mut workers = Vec::new();
        for index in 0..threads.max(1) {
            let (normal_rx, ahead_rx) = (normal_rx.clone(), ahead_rx.clone());
            let worker = std::thread::Builder::new()
                .name(format!("mmgate-plugin-{index}"))
                .spawn(move || {
                    crate::priority::lower_this_thread(nice);
                    while let Some(job) = next_job(&ahead_rx, &normal_rx) {
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
            queues: Some(Queues { normal, ahead }),
            workers,
            queue_capacity,
            running: Arc::new(AtomicUsize::new(0)),
        })
    }

    pub fn threads(&self) -> usize {
        self.workers.len()
    }

    /// Calls running on a worker right now.
    pub fn running(&self) -> usize {
        self.running.load(Ordering::SeqCst)
    }

    /// Calls waiting for a worker right now.
    pub fn queued(&self) -> usize {
        self.queues
            .as_ref()
            .map_or(0, |q| q.normal.len() + q.ahead.len())
    }

    /// Workers neither running a call nor about to take a waiting one, right now: a hint (it may
    /// change the moment it is read) for work that is worth splitting only when cores are free.
    pub fn idle(&self) -> usize {
        let taken = self.running() + self.queued();
        self.threads().saturating_sub(taken)
    }

    /// Run `call` on a worker and wait for it without blocking the async runtime.
    pub async fn run<R: Send + 'static>(
        &self,
        call: impl FnOnce() -> Result<R, CallError> + Send + 'static,
    ) -> Result<R, CallError> {
        self.start(call)?.wait().await
    }

    /// [`Self::run`] for a short call that decides what a request does (choosing a plugin, probe,
    /// plan): it goes before every call waiting in the other queue.
    pub async fn run_ahead<R: Send + 'static>(
        &self,
        call: impl FnOnce() -> Result<R, CallError> + Send + 'static,
    ) -> Result<R, CallError> {
        self.queue(Lane::Ahead, call)?.wait().await
    }

    /// Queue `call` now (before anything awaits: calls started one after another run in that
    /// order) and hand back where its result will come; refused at once when the queue is full.
    pub fn start<R: Send + 'static>(
        &self,
        call: impl FnOnce() -> Result<R, CallError> + Send + 'static,
    ) -> Result<Started<R>, CallError> {
        self.queue(Lane::Normal, call)
    }

    fn queue<R: Send + 'static>(
        &self,
        lane: Lane,
        call: impl FnOnce() -> Result<R, CallError> + Send + 'static,
    ) -> Result<Started<R>, CallError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let running = self.running.clone();
        // The call's time on a worker, under the caller's span: a trace shows the wait for a
        // worker as the gap before it.
        let caller = tracing::Span::current();
        let job: Job = Box::new(move || {
            // A caller gone before its call began (a request ended while its later parts
            // queued) wants nothing: the call is skipped.
            if tx.is_closed() {
                return;
            }
            // Counted out before the caller hears back, so that what it asks next sees this worker
            // free again.
            let result = {
                let _on_worker = tracing::info_span!(parent: &caller, "plugin.run").entered();
                let _running = Running::start(&running);
                call()
            };
            let _ = tx.send(result);
        });
        let queues = self
            .queues
            .as_ref()
            .ok_or_else(|| CallError::Host("the plugin pool is shut down".into()))?;
        let sender = match lane {
            Lane::Normal => &queues.normal,
            Lane::Ahead => &queues.ahead,
        };
        sender.try_send(job).map_err(|e| match e {
            TrySendError::Full(_) => CallError::Overloaded {
                queued: self.queue_capacity,
            },
            TrySendError::Disconnected(_) => CallError::Host("the plugin pool is shut down".into()),
        })?;
        Ok(Started(rx))
    }
}

/// A call queued by [`PluginPool::start`]: its result, once a worker has run it.
#[derive(Debug)]
pub struct Started<R>(tokio::sync::oneshot::Receiver<Result<R, CallError>>);

impl<R> Started<R> {
    pub async fn wait(self) -> Result<R, CallError> {
        self.0
            .await
            .map_err(|_| CallError::Host("the plugin call panicked in the host".into()))?
    }
}

impl Drop for PluginPool {
    fn drop(&mut self) {
        // Closing the queues ends each worker's loop once the queued calls are done.
        self.queues.take();
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// A running call takes a worker from the idle count until it returns, and is counted out
    /// before its caller hears back; a call that panics is counted out too.
    #[test]
    fn idle_counts_the_workers_without_a_call() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let pool = PluginPool::new(2, 4, 0).unwrap();
        assert_eq!(pool.idle(), 2);
        let (started_tx, started) = std::sync::mpsc::channel();
        let (release, release_rx) = std::sync::mpsc::channel::<()>();
        runtime.block_on(async {
            let blocked = pool.run(move || {
                started_tx.send(()).unwrap();
                release_rx.recv().unwrap();
                Ok(())
            });
            let watch = async {
                // The call has begun on a worker: one is left.
                tokio::task::spawn_blocking(move || started.recv().unwrap())
                    .await
                    .unwrap();
                assert_eq!(pool.idle(), 1);
                release.send(()).unwrap();
            };
            let (done, ()) = tokio::join!(blocked, watch);
            done.unwrap();
            assert_eq!(pool.idle(), 2);
            let panicked = pool.run(|| -> Result<(), CallError> { panic!("a host bug") });
            assert!(panicked.await.is_err());
        });
        // The panicking call's count is dropped during unwinding, before its channel closes.
        assert_eq!(pool.idle(), 2);
    }

    /// A call run ahead goes before the calls waiting in the other queue, whatever their order;
    /// the others keep theirs; dropping the pool runs every queued call first.
    #[test]
    fn calls_ahead_go_before_the_queued_ones() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let pool = PluginPool::new(1, 4, 0).unwrap();
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (started_tx, started) = std::sync::mpsc::channel();
        let (release, release_rx) = std::sync::mpsc::channel::<()>();
        let record = |name: &'static str| {
            let order = order.clone();
            move || {
                order.lock().unwrap().push(name);
                Ok(())
            }
        };
        runtime.block_on(async {
            // The only worker is busy until released.
            let busy = pool
                .start(move || {
                    started_tx.send(()).unwrap();
                    release_rx.recv().unwrap();
                    Ok(())
                })
                .unwrap();
            started.recv().unwrap();
            let first = pool.start(record("part 1")).unwrap();
            let second = pool.start(record("part 2")).unwrap();
            let ahead = pool.run_ahead(record("plan"));
            let release = async {
                release.send(()).unwrap();
            };
            let (planned, ()) = tokio::join!(ahead, release);
            planned.unwrap();
            busy.wait().await.unwrap();
            first.wait().await.unwrap();
            second.wait().await.unwrap();
        });
        assert_eq!(*order.lock().unwrap(), ["plan", "part 1", "part 2"]);

        let late = pool.start(record("queued at shutdown")).unwrap();
        drop(pool);
        assert_eq!(order.lock().unwrap().last(), Some(&"queued at shutdown"));
        drop(late);
    }
}
