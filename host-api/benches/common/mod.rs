//! What the plugin benchmarks share: their arguments, the built-in plugin they time, medians.

use std::sync::Arc;
use std::time::Instant;

use mmgate_host::{LoadedPlugin, Media, PluginRegistry, Sandbox, SandboxLimits};

/// The `mmgate` binary's allocator: a plugin call's large buffers (a decoded photo, its patches)
/// are reused from its heap, where the system allocator maps and unmaps them every call and pays
/// their page faults again (a third of a 12 MP photo's time on this machine).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// A run's inputs: `MODALITY FILE CONFIG.json ITERATIONS`.
pub struct Run {
    pub modality: String,
    pub file: String,
    pub media: Media,
    pub config: String,
    pub iterations: usize,
}

impl Run {
    /// The command line's (`cargo bench` appends `--bench`; everything else is ours); `None`, with
    /// the usage printed, when it is not one.
    pub fn from_args(name: &str) -> Option<Run> {
        let args: Vec<String> = std::env::args()
            .skip(1)
            .filter(|a| a != "--bench")
            .collect();
        let [modality, file, config, iterations] = args.as_slice() else {
            eprintln!("usage: {name} MODALITY FILE CONFIG.json ITERATIONS (see bench/)");
            return None;
        };
        Some(Run {
            modality: modality.clone(),
            file: file.clone(),
            media: Media {
                data: std::fs::read(file).unwrap(),
                mime_type: None,
            },
            config: std::fs::read_to_string(config).unwrap(),
            iterations: iterations.parse::<usize>().unwrap().max(1),
        })
    }
}

/// The built-in plugin for `modality`, in a sandbox of `limits`.
pub fn builtin(modality: &str, limits: SandboxLimits) -> Arc<LoadedPlugin> {
    let sandbox = Arc::new(Sandbox::new(limits).unwrap());
    let registry = PluginRegistry::builtin(&sandbox).unwrap();
    registry.for_modality(modality).unwrap().clone()
}

/// The median wall time of `iterations` calls of `f`, in milliseconds.
pub fn median_ms<T>(iterations: usize, mut f: impl FnMut() -> T) -> f64 {
    let mut samples: Vec<f64> = (0..iterations)
        .map(|_| {
            let start = Instant::now();
            std::hint::black_box(f());
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}
