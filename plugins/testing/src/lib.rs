//! A test-only plugin. Its `preprocess` behaves as the media bytes say, so one component can play every
//! well-behaved and hostile part the host's sandbox tests and benchmarks need:
//!
//! | media bytes        | behaviour                                                         |
//! |--------------------|-------------------------------------------------------------------|
//! | `echo` + payload   | returns the whole media as one `u8` tensor (benchmarks, healthy)  |
//! | `spin`             | loops forever (deadline)                                          |
//! | `sleep:MS`         | sleeps `MS` ms off the CPU, then loops a little (the deadlines' clocks) |
//! | `grow`             | allocates memory without bound (memory cap)                       |
//! | `recurse`          | recurses until the wasm (host-managed) stack overflows            |
//! | `recurse-shadow`   | recurses with big frames until its in-memory shadow stack overflows |
//! | `huge:N`           | returns an `N`-byte tensor (output byte cap)                      |
//! | `trap`             | panics (a wasm trap)                                              |
//! | `malformed`        | returns a tensor whose shape does not match its bytes             |
//! | `fail`             | returns a typed `invalid-media` error                             |
//! | `escape`           | tries the filesystem, environment and arguments; reports what it saw |
//! | `odd-grid`         | Qwen2-VL image patches on a 1x3x4 grid: 3 tokens as planned, but no 2x2 merge fits it, so a model's encoder fails on it (the encode-error policy) |
//! | `parts:N:B`        | made in `N` parts (contract 0.4), each a `B`-byte tensor (the host's caps on parts) and its index, placed beforehand by that index (0.5) |
//!
//! `probe` and `plan` are always well-behaved. Besides its own `test` modality it serves `image`,
//! so a chat request can send it an image part (as `application/x-mmgate-test`, which nothing else
//! takes). Never embedded in the gateway.

use mmgate_plugin_sdk::*;
use std::hint::black_box;

struct TestPlugin;

impl Plugin for TestPlugin {
    fn describe() -> Descriptor {
        Descriptor {
            name: "testing".into(),
            version: "0.1.0".into(),
            description: "test-only plugin: well-behaved or hostile on demand".into(),
            modalities: vec!["test".into(), "image".into()],
            mime_types: vec!["application/x-mmgate-test".into()],
            processor_types: vec![],
        }
    }

    fn probe(media: Media) -> PluginResult<MediaInfo> {
        let mut info = MediaInfo::new("test", "test");
        info.extra
            .push(("bytes".into(), media.data.len().to_string()));
        if media.data.starts_with(b"odd-grid") {
            info.extra
                .push(("tokens".into(), ODD_GRID_TOKENS.to_string()));
        }
        if let Some((parts, bytes)) = parts_command(&media.data) {
            info.extra
                .push(("parts".into(), format!("{parts}:{bytes}")));
        }
        Ok(info)
    }

    fn plan(info: MediaInfo, budget: Budget, _config: ProcessorConfig) -> PluginResult<TokenPlan> {
        let tokens = info
            .extra
            .iter()
            .find(|(key, _)| key == "tokens")
            .and_then(|(_, value)| value.parse().ok())
            .unwrap_or(1);
        if budget.max_tokens < tokens {
            return Err(PluginError::over_budget(
                tokens,
                budget.max_tokens,
                "needs its tokens",
            ));
        }
        let parts = info
            .extra
            .iter()
            .find(|(key, _)| key == "parts")
            .map(|(_, value)| value.clone());
        TokenPlan::new(
            tokens,
            false,
            "as many tokens as the command needs",
            &serde_json::json!({ "parts": parts }),
        )
    }

    fn parts(plan: TokenPlan, _config: ProcessorConfig) -> PluginResult<u32> {
        let choices: serde_json::Value = plan.choices()?;
        Ok(choices["parts"]
            .as_str()
            .and_then(|p| parts_command(format!("parts:{p}").as_bytes()))
            .map_or(1, |(parts, _)| parts))
    }

    fn preprocess_part(
        media: Media,
        plan: TokenPlan,
        config: ProcessorConfig,
        index: u32,
    ) -> PluginResult<Vec<Tensor>> {
        match parts_command(&media.data) {
            Some((_, bytes)) => Ok(vec![
                Tensor::from_u8("part", &[bytes], vec![index as u8; bytes])?,
                part_index(index)?,
            ]),
            None => Self::preprocess(media, plan, config),
        }
    }

    /// The first part takes the item's one token; each is placed by its index.
    fn part_plans(plan: TokenPlan, config: ProcessorConfig) -> PluginResult<Vec<PartPlan>> {
        let parts = Self::parts(plan.clone(), config)?;
        (0..parts)
            .map(|index| {
                Ok(PartPlan {
                    tokens: if index == 0 { plan.tokens } else { 0 },
                    placing: vec![part_index(index)?],
                })
            })
            .collect()
    }

    fn preprocess(
        media: Media,
        _plan: TokenPlan,
        config: ProcessorConfig,
    ) -> PluginResult<Vec<Tensor>> {
        let data = media.data;
        let command = data.get(..data.len().min(16)).unwrap_or_default();
        let text = String::from_utf8_lossy(command);
        if data.starts_with(b"echo") {
            let len = data.len();
            return Ok(vec![Tensor::from_u8("echo", &[len], data)?]);
        }
        match text.split(':').next().unwrap_or_default() {
            "spin" => spin(),
            "sleep" => {
                let ms: u64 = argument(&text, "sleep:MS needs milliseconds")?;
                std::thread::sleep(std::time::Duration::from_millis(ms));
                // A loop's back edges are where the sandbox looks at the call's clocks.
                let mut x = 0u64;
                for i in 0..1000 {
                    x = black_box(x.wrapping_add(i));
                }
                Ok(vec![Tensor::from_i64("slept", &[1], &[x as i64])?])
            }
            "grow" => grow(),
            "recurse" => Ok(vec![Tensor::from_i64("depth", &[1], &[recurse(1) as i64])?]),
            "recurse-shadow" => Ok(vec![Tensor::from_i64("depth", &[1], &[recurse_shadow(1)])?]),
            "huge" => {
                let n: usize = argument(&text, "huge:N needs a byte count")?;
                Ok(vec![Tensor::from_u8("huge", &[n], vec![7u8; n])?])
            }
            "trap" => panic!("the test plugin was asked to trap"),
            "malformed" => Ok(vec![Tensor {
                name: "malformed".into(),
                dtype: Dtype::F32,
                shape: vec![10, 10],
                data: vec![1, 2, 3],
            }]),
            "fail" => Err(PluginError::invalid("the test plugin was asked to fail")),
            "odd-grid" => odd_grid(&config),
            "escape" => {
                // [entries readable under "/", environment variables, arguments]
                let root = std::fs::read_dir("/").map_or(-1, |d| d.count() as i64);
                let seen = [
                    root,
                    std::env::vars().count() as i64,
                    std::env::args().count() as i64,
                ];
                Ok(vec![Tensor::from_i64("escape", &[3], &seen)?])
            }
            other => Err(PluginError::unsupported(format!(
                "unknown test command {other:?}"
            ))),
        }
    }
}

/// The number after a command's colon (`huge:N`, `sleep:MS`), or `missing` as the error.
fn argument<T: std::str::FromStr>(command: &str, missing: &str) -> PluginResult<T> {
    command
        .split(':')
        .nth(1)
        .and_then(|s| s.trim().parse().ok())
        .ok_or_else(|| PluginError::invalid(missing))
}

/// The `[t, h, w]` grid of `odd-grid`: 12 patches, 3 tokens by patch count, but 3 rows of patches
/// cannot be merged 2x2.
const ODD_GRID: [i64; 3] = [1, 3, 4];
const ODD_GRID_TOKENS: u32 = 3;

/// What places part `index`: its index.
fn part_index(index: u32) -> PluginResult<Tensor> {
    Tensor::from_u8("index", &[1], vec![index as u8])
}

/// `parts:N:B`: `N` parts of `B` bytes each.
fn parts_command(data: &[u8]) -> Option<(u32, usize)> {
    let text = std::str::from_utf8(data.strip_prefix(b"parts:")?).ok()?;
    let (parts, bytes) = text.trim().split_once(':')?;
    Some((parts.parse().ok()?, bytes.parse().ok()?))
}

fn odd_grid(config: &str) -> PluginResult<Vec<Tensor>> {
    let config: serde_json::Value = serde_json::from_str(config)
        .map_err(|e| PluginError::unsupported(format!("processor config: {e}")))?;
    let field = |name: &str, default: u64| config[name].as_u64().unwrap_or(default) as usize;
    let patch_len = 3 * field("temporal_patch_size", 2) * field("patch_size", 14).pow(2);
    let patches = (ODD_GRID[0] * ODD_GRID[1] * ODD_GRID[2]) as usize;
    Ok(vec![
        Tensor::from_f32(
            "pixel_values",
            &[patches, patch_len],
            &vec![0.0; patches * patch_len],
        )?,
        Tensor::from_i64("image_grid_thw", &[1, 3], &ODD_GRID)?,
    ])
}

fn spin() -> ! {
    let mut x = 0u64;
    loop {
        x = black_box(x.wrapping_add(1));
    }
}

fn grow() -> ! {
    let mut hoard: Vec<Vec<u8>> = Vec::new();
    loop {
        // Touch every page so nothing can be optimised away or left uncommitted.
        hoard.push(black_box(vec![1u8; 1 << 20]));
    }
}

// Unbounded on purpose: the host's wasm stack limit must stop it. Only wasm locals, so every frame is
// on the stack wasmtime manages (not in linear memory); the non-associative combine prevents LLVM from
// turning the recursion into a loop.
#[allow(unconditional_recursion)]
#[inline(never)]
fn recurse(depth: u64) -> u64 {
    let next = recurse(depth.wrapping_add(1));
    next.rotate_left(7) ^ depth
}

// Unbounded on purpose: large frames live on Rust's shadow stack in linear memory, which runs into the
// data below it. The guest traps; the host must report it as that call's crash.
#[allow(unconditional_recursion)]
fn recurse_shadow(depth: i64) -> i64 {
    let frame = black_box([depth; 64]);
    black_box(recurse_shadow(frame[0] + 1)) + frame[63]
}

mmgate_plugin_sdk::export_plugin!(TestPlugin);
