//! The plugins a running gateway serves, and reloading them while it serves.
//!
//! Requests take a snapshot ([`LivePlugins::registry`]) and finish on it, whatever is reloaded in the
//! meantime. A reload (a change in the plugin directory, or SIGHUP) builds the next registry beside
//! the current one, validating every new or changed plugin first (manifest hash, compilation, contract,
//! `describe()`), then swaps it in. A plugin that fails is logged with its reason and reported on
//! `GET /v1/plugins`; the version it was meant to replace keeps serving.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, bail};
use arc_swap::ArcSwap;
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use mmgate_host::{CompileCache, PluginRegistry, Sandbox, SandboxLimits};
use notify::event::ModifyKind;
use notify::{EventKind, RecursiveMode, Watcher};
use serde::{Deserialize, Serialize};

/// The cores this process may use: the default thread count of HTTP and of plugin calls.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(2, std::num::NonZeroUsize::get)
}

/// The plugin threads' default `nice` value: where they share the cores, the encoders and the
/// LLM (or, on GPUs, the host threads that drive them) go first. A video made in pieces then has
/// its first piece encoded sooner, and its first token a little sooner on average (measured by
/// `bench/pieces.py`). Under a load that keeps every core busy encoding and decoding, a new item's
/// plugin calls get about a tenth of the cores.
const DEFAULT_PLUGIN_NICE: u8 = 10;

/// How plugin calls are run, and where compiled plugins are kept between runs.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PluginsConfig {
    /// Threads running plugin calls (default: one per core). Each call in flight holds one of the
    /// sandbox's `max_instances`, so there can be no more threads than that.
    pub threads: Option<usize>,
    /// The plugin threads' CPU priority as a Linux `nice` value, 0–19 (default 10): below the
    /// encoders' and the LLM's, which a media request needs after its plugin calls, so where they
    /// share the cores the work nearest a first token goes first (0: the same priority).
    pub nice: Option<u8>,
    /// Plugin calls that may wait for a thread (default: 16 per thread); past that a request's media
    /// are refused at once with 503 instead of queueing without bound.
    pub queue: Option<usize>,
    /// Where compiled plugins are kept so that a restart does not compile them again (default:
    /// `$XDG_CACHE_HOME/mmgate/compiled-plugins` or `~/.cache/mmgate/compiled-plugins`).
    pub compile_cache_dir: Option<PathBuf>,
    /// Compile every plugin at start instead (default false).
    pub no_compile_cache: bool,
}

impl PluginsConfig {
    /// Plugin threads: configured, or one per core.
    pub fn threads(&self) -> usize {
        self.threads.unwrap_or_else(cores)
    }

    /// The plugin threads' `nice` value: configured, or 10.
    pub fn nice(&self) -> u8 {
        self.nice.unwrap_or(DEFAULT_PLUGIN_NICE)
    }

    /// Calls that may wait for a thread: configured, or 16 per thread.
    pub fn queue(&self) -> usize {
        self.queue.unwrap_or(self.threads() * 16)
    }

    /// The compile cache, if it is on and usable. One that cannot be used costs compile time only,
    /// so it is a warning, not an error.
    pub fn compile_cache(&self) -> Option<CompileCache> {
        if self.no_compile_cache {
            return None;
        }
        let dir = self
            .compile_cache_dir
            .clone()
            .or_else(CompileCache::default_dir)?;
        CompileCache::open(dir)
            .inspect_err(|e| tracing::warn!("{e}; plugins are compiled at every start"))
            .ok()
    }

    pub(crate) fn validate(&self, sandbox: &SandboxLimits) -> anyhow::Result<()> {
        if self.threads == Some(0) {
            bail!("plugins.threads must be positive");
        }
        if self.queue == Some(0) {
            bail!("plugins.queue must be positive");
        }
        if self.nice() > 19 {
            bail!("plugins.nice must be 0 to 19");
        }
        let threads = self.threads();
        if threads > sandbox.max_instances as usize {
            bail!(
                "plugins.threads ({threads}) is more than sandbox.max_instances ({}): every thread \
                 needs an instance slot",
                sandbox.max_instances
            );
        }
        Ok(())
    }
}

/// The sandbox plugins run in, with `config`'s compile cache when it is on and usable.
pub fn sandbox(limits: SandboxLimits, config: &PluginsConfig) -> anyhow::Result<Arc<Sandbox>> {
    let sandbox = Sandbox::new(limits).context("creating the plugin sandbox")?;
    Ok(Arc::new(match config.compile_cache() {
        Some(cache) => sandbox.with_compile_cache(cache),
        None => sandbox,
    }))
}

/// How long the directory must stay quiet before a reload: copying a component and its manifest is
/// several events, and one reload should see both.
const SETTLE: Duration = Duration::from_millis(300);

/// The outcome of the latest reload, as `GET /v1/plugins` shows it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ReloadStatus {
    /// Incremented by every reload, successful or not.
    pub generation: u64,
    /// The plugins the latest reload could not load.
    pub rejected: Vec<RejectedPlugin>,
    /// When the latest reload ran, in seconds since the Unix epoch (none yet: absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub at: Option<u64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct RejectedPlugin {
    pub manifest: String,
    pub reason: String,
    /// The version loaded from this manifest before keeps serving.
    pub kept_previous: bool,
}

pub struct LivePlugins {
    sandbox: Arc<Sandbox>,
    dir: Option<PathBuf>,
    current: ArcSwap<PluginRegistry>,
    /// The latest reload's outcome.
    status: Mutex<ReloadStatus>,
}

impl LivePlugins {
    /// The built-ins and every plugin of `dir`; at start-up any plugin that fails to load is an error.
    pub fn load(sandbox: Arc<Sandbox>, dir: Option<&Path>) -> anyhow::Result<LivePlugins> {
        let registry = match dir {
            Some(dir) => PluginRegistry::with_dir(&sandbox, dir),
            None => PluginRegistry::builtin(&sandbox),
        }
        .context("loading plugins")?;
        Ok(LivePlugins {
            sandbox,
            dir: dir.map(Path::to_owned),
            current: ArcSwap::from_pointee(registry),
            status: Mutex::new(ReloadStatus::default()),
        })
    }

    /// The plugins as they are now; a caller keeps them for the whole request.
    pub fn registry(&self) -> Arc<PluginRegistry> {
        self.current.load_full()
    }

    pub fn status(&self) -> ReloadStatus {
        self.status
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    /// Reload the plugin directory now (no-op without one). Called only from the reload thread, so
    /// reloads never overlap; the status lock is held just to publish the outcome, never while
    /// plugins compile (`GET /v1/plugins` reads it on the async side).
    fn reload(&self) {
        let Some(dir) = &self.dir else {
            tracing::info!("reload requested, but no plugin_dir is configured");
            return;
        };
        let rejected = match self.current.load().reload_dir(&self.sandbox, dir) {
            Ok((next, rejected)) => {
                let loaded: Vec<String> = next
                    .iter()
                    .map(|p| format!("{} {}", p.name(), p.descriptor().version))
                    .collect();
                tracing::info!(plugins = ?loaded, "plugins reloaded");
                self.current.store(Arc::new(next));
                rejected
                    .iter()
                    .map(|r| RejectedPlugin {
                        manifest: r.manifest.display().to_string(),
                        reason: error_chain(&r.error),
                        kept_previous: r.kept_previous,
                    })
                    .collect()
            }
            Err(error) => vec![RejectedPlugin {
                manifest: dir.display().to_string(),
                reason: format!("cannot list the plugin directory: {}", error_chain(&error)),
                kept_previous: true,
            }],
        };
        for r in &rejected {
            tracing::error!(
                manifest = %r.manifest,
                reason = %r.reason,
                kept_previous = r.kept_previous,
                "plugin rejected; the loaded version (if any) keeps serving"
            );
        }
        let mut status = self
            .status
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        status.generation += 1;
        status.rejected = rejected;
        status.at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .ok()
            .map(|since| since.as_secs());
    }

    /// Reload on every change in the plugin directory and on SIGHUP, until the returned guard is
    /// dropped.
    pub fn watch(self: &Arc<Self>) -> anyhow::Result<ReloadGuard> {
        let (tx, rx) = crossbeam_channel::unbounded::<()>();
        let watcher = match &self.dir {
            Some(dir) => Some(watch_dir(dir, tx.clone())?),
            None => None,
        };
        let mut signals = signal_hook::iterator::Signals::new([signal_hook::consts::SIGHUP])
            .context("cannot install the SIGHUP handler")?;
        let signal_handle = signals.handle();
        let hup = tx;
        std::thread::Builder::new()
            .name("mmgate-sighup".into())
            .spawn(move || {
                for _ in signals.forever() {
                    tracing::info!("SIGHUP: reloading plugins");
                    if hup.send(()).is_err() {
                        break;
                    }
                }
            })
            .context("cannot start the signal thread")?;
        let live = self.clone();
        std::thread::Builder::new()
            .name("mmgate-reload".into())
            .spawn(move || reload_loop(&live, &rx))
            .context("cannot start the reload thread")?;
        Ok(ReloadGuard {
            _watcher: watcher,
            signals: signal_handle,
        })
    }
}

/// Keeps the directory watcher and the SIGHUP handler alive.
pub struct ReloadGuard {
    _watcher: Option<notify::RecommendedWatcher>,
    signals: signal_hook::iterator::Handle,
}

impl Drop for ReloadGuard {
    fn drop(&mut self) {
        // Ends the signal thread; dropping the watcher and the signal thread's sender ends the loop.
        self.signals.close();
    }
}

fn watch_dir(dir: &Path, tx: Sender<()>) -> anyhow::Result<notify::RecommendedWatcher> {
    let mut watcher =
        notify::recommended_watcher(move |event: notify::Result<notify::Event>| match event {
            // Reading the directory's files (the reload itself) raises access and, through atime,
            // metadata events: neither changes what a plugin is.
            Ok(event)
                if matches!(
                    event.kind,
                    EventKind::Access(_) | EventKind::Modify(ModifyKind::Metadata(_))
                ) => {}
            Ok(_) => {
                let _ = tx.send(());
            }
            Err(error) => tracing::warn!(error = %error, "plugin directory watch error"),
        })
        .context("cannot watch the plugin directory")?;
    watcher
        .watch(dir, RecursiveMode::NonRecursive)
        .with_context(|| format!("cannot watch {}", dir.display()))?;
    Ok(watcher)
}

/// Waits for a change, lets the directory settle, reloads; until every sender is gone.
fn reload_loop(live: &LivePlugins, changes: &Receiver<()>) {
    while changes.recv().is_ok() {
        loop {
            match changes.recv_timeout(SETTLE) {
                Ok(()) => continue,
                Err(RecvTimeoutError::Timeout) => break,
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
        live.reload();
    }
}

/// An error with its causes, on one line.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
