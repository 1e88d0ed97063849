//! The sandbox every plugin call runs in: one shared wasmtime `Engine` (pooling allocator, epoch
//! interruption driven by a ticker thread), and the per-call `Store` state with its limits.
//!
//! Per call a plugin gets: a fresh store, a memory cap, a deadline, a wasm stack cap, WASI with no
//! preopened directories, no network, no environment, no arguments and closed stdio, and a cap on the
//! bytes it may hand back (enforced by the caller, see `plugin.rs`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use wasmtime::component::{Component, HasSelf, Linker, ResourceTable};
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use crate::audio::{AudioView, HasAudio};
use crate::call_clock::CallClock;
use crate::compile_cache::CompileCache;
use crate::contract::{LogLevel, mmgate, v0_1, v0_2, v0_3, v0_4};
use crate::error::{DeadlinePassed, LoadError};
use crate::image::{CallImages, HasImage, ImageView};
use crate::video::{CallVideos, HasVideo, VideoView};

/// How often the epoch advances. A deadline is rounded up to whole ticks, so a call overruns its
/// deadline by at most one tick (plus the time to unwind).
pub const EPOCH_TICK: Duration = Duration::from_millis(5);

/// Set to `perfmap` to profile plugins with Linux `perf`: wasmtime then writes the compiled
/// functions' names to `/tmp/perf-<pid>.map`, so `perf record -g` / `perf report` show the
/// plugin's own functions instead of anonymous JIT addresses. Off by default (it costs a file
/// write per compiled module).
pub const PROFILER_VARIABLE: &str = "MMGATE_WASM_PROFILER";

/// Linear memory a pool slot keeps resident between calls (zeroed with memset instead of returned to
/// the kernel): every call starts from a fresh instance, and without this each one would page-fault
/// its whole working set back in (for an image, tens of MB per call). Bounded per slot, so at most
/// this times the slots in use stays resident; the pool hands a module the slots it used before, so
/// the slots in use are about the calls run at once. 128 MB holds a 12 MP photo's call (the JPEG,
/// its 36 MB of pixels, 36 MB of patch bytes and the allocator's slack): at 64 MB its last tens of MB
/// were faulted in on every call, which cost more than clearing them (measured on a 4032x3024
/// JPEG by `benches/plugin_preprocess.rs`).
const KEEP_RESIDENT_BYTES: usize = 128 << 20;

/// Limits applied to every plugin call.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct SandboxLimits {
    /// Most bytes of linear memory one call may use.
    pub memory_bytes: usize,
    /// Deadline of one call in milliseconds of the plugin's own CPU time (its thread's, less what
    /// host capabilities such as video decoding spent for it; see `call_clock`), enforced by
    /// epoch interruption, so a plugin stuck in a loop is stopped however busy the machine is and
    /// a busy machine does not stop a plugin that is making progress.
    pub deadline_ms: u64,
    /// Milliseconds added to `deadline_ms` for each thousand tokens a call makes (`preprocess`,
    /// a part of it, `reduce`): a plan's tokens bound the work of making them, so a long video
    /// planned within the limits gets the time its frames take.
    pub deadline_ms_per_1000_tokens: u64,
    /// Wall-clock deadline of one call in milliseconds, host work included: the backstop for a
    /// call that makes no progress at all.
    pub wall_deadline_ms: u64,
    /// Most bytes one call may return (sum of its tensors' data).
    pub max_output_bytes: usize,
    /// Most bytes of wasm stack.
    pub max_wasm_stack: usize,
    /// Most plugin instances alive at once (sizes the pooling allocator).
    pub max_instances: u32,
    /// Limits of the host's video decoder (contract 0.2), per opened video.
    pub video: mmgate_video_decode::Limits,
    /// Limits of the host's JPEG decoder (contract 0.3.1), per image; a plugin may only narrow them.
    pub image: mmgate_image_decode::Limits,
}

impl Default for SandboxLimits {
    fn default() -> Self {
        SandboxLimits {
            // A 12.8 MP image (Qwen2-VL's max_pixels) is ~37 MB decoded and ~80 MB of u8 patches.
            memory_bytes: 1 << 30,
            deadline_ms: 10_000,
            deadline_ms_per_1000_tokens: 1_000,
            wall_deadline_ms: 120_000,
            max_output_bytes: 512 << 20,
            max_wasm_stack: 1 << 20,
            max_instances: 64,
            video: mmgate_video_decode::Limits::default(),
            image: mmgate_image_decode::Limits::default(),
        }
    }
}

impl SandboxLimits {
    pub fn deadline(&self) -> Duration {
        Duration::from_millis(self.deadline_ms)
    }

    /// The CPU deadline of a call that makes `tokens` tokens of a plan.
    pub fn deadline_for(&self, tokens: u32) -> Duration {
        let extra = self
            .deadline_ms_per_1000_tokens
            .saturating_mul(u64::from(tokens))
            / 1000;
        Duration::from_millis(self.deadline_ms.saturating_add(extra))
    }

    pub fn wall_deadline(&self) -> Duration {
        Duration::from_millis(self.wall_deadline_ms)
    }
}

/// The shared engine, its linker, and the ticker that drives deadlines.
pub struct Sandbox {
    engine: Engine,
    linker: Linker<CallState>,
    limits: SandboxLimits,
    compile_cache: Option<CompileCache>,
    // Held for its Drop: the ticker thread stops when the sandbox goes.
    _ticker: Ticker,
}

impl Sandbox {
    pub fn new(limits: SandboxLimits) -> Result<Self, LoadError> {
        let engine_error = |e: wasmtime::Error| LoadError::Engine(format!("{e:#}"));
        let mut pool = PoolingAllocationConfig::new();
        pool.total_component_instances(limits.max_instances)
            .total_core_instances(limits.max_instances.saturating_mul(8))
            .total_memories(limits.max_instances.saturating_mul(2))
            .total_tables(limits.max_instances.saturating_mul(4))
            .max_memory_size(limits.memory_bytes)
            .linear_memory_keep_resident(KEEP_RESIDENT_BYTES);
        let mut config = Config::new();
        config
            .allocation_strategy(InstanceAllocationStrategy::Pooling(pool))
            .epoch_interruption(true)
            .max_wasm_stack(limits.max_wasm_stack)
            // We use no WASIp3 async; leaving this on makes synchronous component calls far slower.
            .concurrency_support(false);
        if std::env::var_os(PROFILER_VARIABLE).is_some_and(|v| v == "perfmap") {
            // Profiling only: names every compiled function in /tmp/perf-<pid>.map for `perf`.
            config.profiler(wasmtime::ProfilingStrategy::PerfMap);
            tracing::info!("{PROFILER_VARIABLE}=perfmap: plugin code is named for perf");
        }
        let engine = Engine::new(&config).map_err(engine_error)?;

        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_sync(&mut linker).map_err(engine_error)?;
        link_contract(&mut linker).map_err(engine_error)?;

        let ticker = Ticker::start(engine.clone());
        Ok(Sandbox {
            engine,
            linker,
            limits,
            compile_cache: None,
            _ticker: ticker,
        })
    }

    /// Keeps compiled plugins in `cache` and loads them from there when they are already compiled.
    pub fn with_compile_cache(mut self, cache: CompileCache) -> Self {
        self.compile_cache = Some(cache);
        self
    }

    /// Compiles a component (whose sha256 is `sha256`, hex), through the compile cache if there is
    /// one.
    pub(crate) fn compile(&self, wasm: &[u8], sha256: &str) -> wasmtime::Result<Component> {
        match &self.compile_cache {
            Some(cache) => cache.component(&self.engine, wasm, sha256),
            None => Component::new(&self.engine, wasm),
        }
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    pub fn linker(&self) -> &Linker<CallState> {
        &self.linker
    }

    pub fn limits(&self) -> &SandboxLimits {
        &self.limits
    }

    /// Epoch ticks until `time` has passed on any clock at least as slow as the wall's: rounded
    /// up, plus one because the current tick may be nearly over.
    pub fn ticks(time: Duration) -> u64 {
        let tick = EPOCH_TICK.as_micros().max(1);
        u64::try_from(time.as_micros().div_ceil(tick))
            .unwrap_or(u64::MAX)
            .saturating_add(1)
    }
}

/// Links the imports of every contract version this host serves: `types` and `host` on the call's
/// state itself, each capability's interface on that capability's view of the state, lent by
/// [`CallState::video_view`], [`CallState::image_view`] and [`CallState::audio_view`]. These are the interfaces each world's
/// generated `add_to_linker` links, taken one by one so that each can be given its own getter: the
/// capabilities then need not know the call's state.
fn link_contract(linker: &mut Linker<CallState>) -> wasmtime::Result<()> {
    // The earlier contracts' bindings take their `types` from the current ones: linked once.
    mmgate::modality::types::add_to_linker::<_, HasSelf<CallState>>(linker, |state| state)?;
    mmgate::modality::host::add_to_linker::<_, HasSelf<CallState>>(linker, |state| state)?;
    mmgate::modality::video::add_to_linker::<_, HasVideo>(linker, CallState::video_view)?;
    mmgate::modality::image::add_to_linker::<_, HasImage>(linker, CallState::image_view)?;
    mmgate::modality::audio::add_to_linker::<_, HasAudio>(linker, CallState::audio_view)?;
    // The imports of the earlier contracts, for plugins built against them.
    v0_4::mmgate::modality::host::add_to_linker::<_, HasSelf<CallState>>(linker, |state| state)?;
    v0_4::mmgate::modality::video::add_to_linker::<_, HasVideo>(linker, CallState::video_view)?;
    v0_4::mmgate::modality::image::add_to_linker::<_, HasImage>(linker, CallState::image_view)?;
    v0_3::mmgate::modality::host::add_to_linker::<_, HasSelf<CallState>>(linker, |state| state)?;
    v0_3::mmgate::modality::video::add_to_linker::<_, HasVideo>(linker, CallState::video_view)?;
    v0_3::mmgate::modality::image::add_to_linker::<_, HasImage>(linker, CallState::image_view)?;
    v0_2::mmgate::modality::host::add_to_linker::<_, HasSelf<CallState>>(linker, |state| state)?;
    v0_2::mmgate::modality::video::add_to_linker::<_, HasVideo>(linker, CallState::video_view)?;
    v0_1::mmgate::modality::host::add_to_linker::<_, HasSelf<CallState>>(linker, |state| state)?;
    Ok(())
}

/// A thread that advances the engine's epoch every [`EPOCH_TICK`]; stopped and joined on drop.
struct Ticker {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl Ticker {
    fn start(engine: Engine) -> Ticker {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = std::thread::Builder::new()
            .name("mmgate-epoch".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    std::thread::sleep(EPOCH_TICK);
                    engine.increment_epoch();
                }
            })
            .ok();
        if handle.is_none() {
            tracing::error!("cannot start the epoch ticker thread: plugin deadlines will not fire");
        }
        Ticker { stop, handle }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
    }
}

/// Longest log line a plugin may write; longer ones are cut.
const MAX_LOG_LINE: usize = 4096;

/// The data of one call's `Store`.
pub struct CallState {
    wasi: WasiCtx,
    table: ResourceTable,
    limiter: MemoryLimiter,
    plugin: Arc<str>,
    clock: CallClock,
    /// Each host capability's share of the call, owned by its module.
    videos: CallVideos,
    images: CallImages,
}

impl CallState {
    /// The state of a call of `call` (the contract function) to `plugin`, held to `deadline` of
    /// the plugin's own CPU time.
    pub fn new(
        plugin: Arc<str>,
        call: &'static str,
        limits: &SandboxLimits,
        deadline: Duration,
    ) -> CallState {
        // The default builder already inherits nothing; the network switches are spelled out because
        // they are the sandbox's promise, not an accident of defaults.
        let wasi = WasiCtx::builder()
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false)
            .build();
        CallState {
            wasi,
            table: ResourceTable::new(),
            limiter: MemoryLimiter {
                limit: limits.memory_bytes,
                hit: false,
            },
            clock: CallClock::start(&plugin, call, deadline, limits.wall_deadline()),
            plugin,
            videos: CallVideos::new(&limits.video),
            images: CallImages::new(&limits.image),
        }
    }

    /// Videos this call opens are decoded on one thread, whatever `sandbox.video.decoder_threads`
    /// says (see `Making::Part`).
    pub(crate) fn decode_videos_on_one_thread(&mut self) {
        self.videos.decode_on_one_thread();
    }

    /// When the call's wall-clock deadline passes: host work done on the plugin's behalf stops
    /// there too.
    pub fn wall_deadline(&self) -> Instant {
        self.clock.wall_deadline()
    }

    /// The video capability's view of the call: its share, the resource table its videos live
    /// in, and the clock its decoding is charged to.
    fn video_view(&mut self) -> VideoView<'_> {
        VideoView {
            videos: &mut self.videos,
            table: &mut self.table,
            clock: &mut self.clock,
        }
    }

    /// The image capability's view of the call: its share, and the clock its decoding is charged
    /// to.
    fn image_view(&mut self) -> ImageView<'_> {
        ImageView {
            images: &self.images,
            clock: &mut self.clock,
        }
    }

    /// The audio capability's view of the call: the clock its work is charged to.
    fn audio_view(&mut self) -> AudioView<'_> {
        AudioView {
            clock: &mut self.clock,
        }
    }

    /// Checked at each epoch deadline: epoch ticks the plugin may run before the next check, or
    /// the deadline it passed.
    pub(crate) fn next_check(&mut self) -> Result<u64, DeadlinePassed> {
        self.clock.check().map(Sandbox::ticks)
    }

    /// The deadline the call passed, if one did.
    pub fn deadline_passed(&self) -> Option<&DeadlinePassed> {
        self.clock.passed()
    }

    pub fn limiter(&mut self) -> &mut MemoryLimiter {
        &mut self.limiter
    }

    /// Whether the call tried to grow memory past the cap (a trap after that is the cap's doing).
    pub fn memory_limit_hit(&self) -> bool {
        self.limiter.hit
    }
}

impl WasiView for CallState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

/// Caps linear memory per call, remembering whether the cap was hit so a later trap is reported as a
/// memory error rather than a crash. Growth is refused (not trapped) so that a plugin that can cope
/// with a failed allocation may.
pub struct MemoryLimiter {
    limit: usize,
    hit: bool,
}

/// Most table elements per call; tables hold function references, far fewer than this in practice.
const MAX_TABLE_ELEMENTS: usize = 1 << 20;

impl wasmtime::ResourceLimiter for MemoryLimiter {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.limit {
            self.hit = true;
            return Ok(false);
        }
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= MAX_TABLE_ELEMENTS)
    }
}

impl mmgate::modality::types::Host for CallState {}

impl mmgate::modality::host::Host for CallState {
    fn log(&mut self, level: LogLevel, mut message: String) {
        if message.len() > MAX_LOG_LINE {
            let mut cut = MAX_LOG_LINE;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
        }
        let plugin = &*self.plugin;
        match level {
            LogLevel::Trace => tracing::trace!(plugin, "{message}"),
            LogLevel::Debug => tracing::debug!(plugin, "{message}"),
            LogLevel::Info => tracing::info!(plugin, "{message}"),
            LogLevel::Warn => tracing::warn!(plugin, "{message}"),
            LogLevel::Error => tracing::error!(plugin, "{message}"),
        }
    }

    fn monotonic_now(&mut self) -> u64 {
        monotonic_origin().elapsed().as_nanos() as u64
    }

    fn time_remaining(&mut self) -> u64 {
        u64::try_from(self.clock.remaining().as_nanos()).unwrap_or(u64::MAX)
    }
}

/// The `host` interface of a superseded contract (`$version`: the module of its frozen bindings):
/// the same functions as the current one, each served by it.
macro_rules! previous_host_interface {
    ($version:ident) => {
        impl $version::mmgate::modality::host::Host for CallState {
            fn log(&mut self, level: $version::mmgate::modality::host::LogLevel, message: String) {
                use $version::mmgate::modality::host::LogLevel as Old;
                let level = match level {
                    Old::Trace => LogLevel::Trace,
                    Old::Debug => LogLevel::Debug,
                    Old::Info => LogLevel::Info,
                    Old::Warn => LogLevel::Warn,
                    Old::Error => LogLevel::Error,
                };
                mmgate::modality::host::Host::log(self, level, message);
            }

            fn monotonic_now(&mut self) -> u64 {
                mmgate::modality::host::Host::monotonic_now(self)
            }

            fn time_remaining(&mut self) -> u64 {
                mmgate::modality::host::Host::time_remaining(self)
            }
        }
    };
}

previous_host_interface!(v0_4);
previous_host_interface!(v0_3);
previous_host_interface!(v0_2);
previous_host_interface!(v0_1);

fn monotonic_origin() -> Instant {
    static ORIGIN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
}
