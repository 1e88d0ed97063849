//! The connection to Redis: one multiplexed connection that reconnects by itself, driven by a small
//! runtime of its own, so that it serves pingora's per-thread runtimes and the encoder threads alike
//! and outlives none of them.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use super::{StoreConfig, Unavailable};

/// After a command finds Redis unreachable, commands fail at once for this long instead of each
/// waiting out its timeout: a blackholed Redis must not add a timeout to every request and encode.
const BACKOFF: Duration = Duration::from_secs(1);

pub struct Redis {
    /// Always `Some` until dropped (see [`Drop`]).
    runtime: Option<tokio::runtime::Runtime>,
    connection: ConnectionManager,
    prefix: String,
    timeout: Duration,
    /// When the backoff after the last unreachable answer ends, in milliseconds since `epoch`.
    retry_at_ms: AtomicU64,
    epoch: Instant,
}

impl Redis {
    /// Connects to `config.url`, waiting up to `startup_wait_seconds` for the server to answer: a
    /// replica that cannot reach its store at start says so and stops, rather than serving
    /// requests that would all fail.
    pub fn connect(config: &StoreConfig) -> anyhow::Result<Redis> {
        let url = config
            .url
            .as_deref()
            .context("[store] kind = \"redis\" needs a url")?;
        let client = redis::Client::open(url).context("[store] url is not a Redis URL")?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("mmgate-store")
            .enable_all()
            .build()
            .context("starting the store's runtime")?;
        let options = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_millis(config.connect_timeout_ms)))
            .set_response_timeout(Some(config.timeout()))
            // Reconnection is retried on each command after a failure; within one command a short
            // burst is enough (the request is answered 503 rather than held).
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(500));
        // The manager drives its connection on the runtime it is made in: this one.
        let connection = runtime
            .block_on(async { ConnectionManager::new_lazy_with_config(client, options) })
            .context("[store] Redis client")?;
        let redis = Redis {
            runtime: Some(runtime),
            connection,
            prefix: config.key_prefix.clone(),
            timeout: config.timeout(),
            retry_at_ms: AtomicU64::new(0),
            epoch: Instant::now(),
        };
        let deadline = Instant::now() + Duration::from_secs(config.startup_wait_seconds);
        loop {
            match redis.ping_blocking() {
                Ok(()) => return Ok(redis),
                Err(e) if Instant::now() >= deadline => {
                    return Err(anyhow::anyhow!(
                        "[store] cannot reach Redis at {} within {} s: {}",
                        redacted(url),
                        config.startup_wait_seconds,
                        e.0
                    ));
                }
                Err(e) => {
                    tracing::warn!(url = %redacted(url), error = %e.0, "waiting for Redis");
                    std::thread::sleep(BACKOFF);
                }
            }
        }
    }

    /// `parts` joined after the configured prefix.
    pub fn key(&self, parts: &[&str]) -> String {
        let mut key = self.prefix.clone();
        for (i, part) in parts.iter().enumerate() {
            if i > 0 {
                key.push(':');
            }
            key.push_str(part);
        }
        key
    }

    /// Runs `command` on the store's runtime, within the command timeout.
    pub async fn run<T, F, Fut>(&self, command: F) -> Result<T, Unavailable>
    where
        F: FnOnce(ConnectionManager) -> Fut,
        Fut: Future<Output = redis::RedisResult<T>> + Send + 'static,
        T: Send + 'static,
    {
        let Some(runtime) = &self.runtime else {
            return Err(Unavailable("the store is shutting down".into()));
        };
        if self.elapsed_ms() < self.retry_at_ms.load(Ordering::Relaxed) {
            return Err(Unavailable("unreachable a moment ago".into()));
        }
        let timeout = self.timeout;
        let pending = command(self.connection.clone());
        let task = runtime.spawn(async move { tokio::time::timeout(timeout, pending).await });
        let (result, unreachable) = match task.await {
            Ok(Ok(Ok(value))) => (Ok(value), false),
            Ok(Ok(Err(e))) => {
                let unreachable = e.is_io_error()
                    || e.is_timeout()
                    || e.is_connection_dropped()
                    || e.is_connection_refusal();
                (Err(Unavailable(e.to_string())), unreachable)
            }
            Ok(Err(_)) => {
                let message = format!("no answer within {} ms", timeout.as_millis());
                (Err(Unavailable(message)), true)
            }
            Err(e) => (
                Err(Unavailable(format!("the store's task failed: {e}"))),
                false,
            ),
        };
        if unreachable {
            let until = self.elapsed_ms() + BACKOFF.as_millis() as u64;
            self.retry_at_ms.store(until, Ordering::Relaxed);
        }
        result
    }

    fn elapsed_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Starts `command` and returns at once (what a drop must do, and cannot wait for); a failure
    /// is logged.
    pub fn spawn<F, Fut>(&self, command: F)
    where
        F: FnOnce(ConnectionManager) -> Fut,
        Fut: Future<Output = redis::RedisResult<()>> + Send + 'static,
    {
        let Some(runtime) = &self.runtime else {
            return;
        };
        let (timeout, pending) = (self.timeout, command(self.connection.clone()));
        runtime.spawn(async move {
            match tokio::time::timeout(timeout, pending).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "a store update failed"),
                Err(_) => tracing::warn!("a store update timed out"),
            }
        });
    }

    /// [`Self::run`] from a thread outside any async runtime (the encoder threads).
    pub fn run_blocking<T, F, Fut>(&self, command: F) -> Result<T, Unavailable>
    where
        F: FnOnce(ConnectionManager) -> Fut,
        Fut: Future<Output = redis::RedisResult<T>> + Send + 'static,
        T: Send + 'static,
    {
        let Some(runtime) = &self.runtime else {
            return Err(Unavailable("the store is shutting down".into()));
        };
        runtime.handle().block_on(self.run(command))
    }

    /// Whether Redis answers now (readiness).
    pub async fn ping(&self) -> Result<(), Unavailable> {
        self.run(|mut c| async move { redis::cmd("PING").query_async::<()>(&mut c).await })
            .await
    }

    fn ping_blocking(&self) -> Result<(), Unavailable> {
        self.run_blocking(|mut c| async move { redis::cmd("PING").query_async::<()>(&mut c).await })
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        // Dropping a runtime blocks, which panics inside another runtime (where the gateway may
        // be dropped): let its thread wind down in the background instead.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// The URL without its password, for logs and errors.
fn redacted(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut parsed) if parsed.password().is_some() => {
            let _ = parsed.set_password(Some("***"));
            parsed.to_string()
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_stay_out_of_messages() {
        assert_eq!(
            redacted("redis://user:hunter2@10.0.0.1:6379/0"),
            "redis://user:***@10.0.0.1:6379/0"
        );
        assert_eq!(redacted("redis://10.0.0.1:6379"), "redis://10.0.0.1:6379");
    }

    #[test]
    fn an_unreachable_server_is_a_clear_error_at_start() {
        // A port nobody listens on: bind one, note it, free it.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap_or(1);
        let config = StoreConfig {
            kind: super::super::StoreKind::Redis,
            url: Some(format!("redis://:pw@127.0.0.1:{port}")),
            startup_wait_seconds: 0,
            ..StoreConfig::default()
        };
        let error = Redis::connect(&config).err().map(|e| format!("{e:#}"));
        let error = error.unwrap_or_default();
        assert!(error.contains("cannot reach Redis"), "{error}");
        assert!(!error.contains(":pw@"), "{error}");
    }
}
