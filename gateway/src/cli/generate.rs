//! `mmgate generate`: one request through the plugins and the native inference core in this
//! process, printing one JSON line with the generated tokens, text and usage. The request is the
//! one a chat client would send, prepared by the chat route's own code (`chat::prepare`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, anyhow, bail};
use base64::Engine as _;
use clap::Args;
use mmgate_host::{PluginPool, PluginRegistry, SandboxLimits};
use serde_json::{Value, json};

use crate::config::{EncodeErrorPolicy, PluginsConfig, RequestLimits};
use crate::media::fetch::{FetchConfig, Fetcher};
use crate::media::files::{FileStore, FilesConfig};
use crate::media::sniff::sniff_mime_type;
use crate::model::LocalModel;
use crate::model::{ModelRuntime, RuntimeOptions, default_cache_dir, resolve_model_dir};
use crate::native::chat;
use crate::native::generation::{Generation, Step};
use crate::prepare::items::ChatServices;
use crate::store::Caller;
use crate::wire::openai::ChatCompletionRequest;
use crate::wire::openai::parts::url_part;
use mmgate_inference::families::MediaKind;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// An HF model directory of a natively served family, or a built-in demo model's name
    /// (`demo`, `demo-qwen2.5-vl`, `demo-qwen3-vl`, `demo-audio`).
    #[arg(long)]
    model: PathBuf,
    /// An image file (repeatable; in order, before the text).
    #[arg(long)]
    image: Vec<PathBuf>,
    /// A video file (repeatable).
    #[arg(long)]
    video: Vec<PathBuf>,
    /// An audio file (repeatable).
    #[arg(long)]
    audio: Vec<PathBuf>,
    /// The user message.
    #[arg(long)]
    prompt: String,
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long)]
    seed: Option<u64>,
    /// Extra plugins (a directory of NAME.wasm + NAME.toml).
    #[arg(long)]
    plugin_dir: Option<PathBuf>,
    /// Make each medium whole before encoding it, instead of in its plugin's parts flowing to the
    /// engine as each is made (the config's `media_parts = false`): the same tokens, later.
    #[arg(long)]
    whole_media: bool,
}

/// The request a chat client would send for these arguments: the files (images, then videos,
/// then audio) as data URLs, then the prompt. It goes through exactly the chat route's preparation.
fn chat_request(args: &GenerateArgs, files: &[(MediaKind, &PathBuf)]) -> anyhow::Result<Value> {
    let mut content = Vec::with_capacity(files.len() + 1);
    for (kind, path) in files {
        let data =
            std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
        let mime = sniff_mime_type(&data).unwrap_or("application/octet-stream");
        let url = format!(
            "data:{mime};base64,{}",
            base64::engine::general_purpose::STANDARD.encode(&data)
        );
        content.push(url_part(*kind, url));
    }
    content.push(json!({"type": "text", "text": args.prompt}));
    let mut request = json!({
        "messages": [{"role": "user", "content": content}],
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
    });
    if let Some(seed) = args.seed {
        // The API's seed is signed; the same bits give the same sampler seed back.
        request["seed"] = json!(i64::from_ne_bytes(seed.to_ne_bytes()));
    }
    Ok(request)
}

pub fn run(args: GenerateArgs) -> anyhow::Result<ExitCode> {
    let dir = resolve_model_dir(&args.model, &default_cache_dir())?;
    let name = dir
        .file_name()
        .map_or("model".into(), |n| n.to_string_lossy().into_owned());
    let runtime = ModelRuntime::load(&name, &dir, &RuntimeOptions::default(), None)
        .with_context(|| format!("loading the model in {}", dir.display()))?;
    let model = LocalModel {
        runtime,
        on_encode_error: EncodeErrorPolicy::Error,
        accept_image_embeds: false,
        media_parts: !args.whole_media,
    };
    let files: Vec<(MediaKind, &PathBuf)> = (args.image.iter().map(|f| (MediaKind::Image, f)))
        .chain(args.video.iter().map(|f| (MediaKind::Video, f)))
        .chain(args.audio.iter().map(|f| (MediaKind::Audio, f)))
        .collect();
    let request: ChatCompletionRequest = serde_json::from_value(chat_request(&args, &files)?)?;

    let plugins = PluginsConfig::default();
    let sandbox = crate::media::plugins::sandbox(SandboxLimits::default(), &plugins)?;
    let registry = Arc::new(match &args.plugin_dir {
        Some(dir) => PluginRegistry::with_dir(&sandbox, dir),
        None => PluginRegistry::builtin(&sandbox),
    }?);
    let pool = PluginPool::new(plugins.threads(), plugins.queue(), plugins.nice())?;
    // Local files: no limit but the file's own size.
    let limits = RequestLimits {
        max_media_items: files.len(),
        max_image_bytes: usize::MAX,
        max_total_image_bytes: usize::MAX,
        max_video_bytes: usize::MAX,
        max_audio_bytes: usize::MAX,
        ..RequestLimits::default()
    };
    let files_store = FileStore::in_memory(FilesConfig::default());
    let fetcher = Fetcher::new(FetchConfig::default())?;
    let caller = Caller::public();
    let documents = crate::config::DocumentsConfig::default();
    let services = ChatServices {
        caller: &caller,
        registry,
        pool: &pool,
        limits: &limits,
        files: &files_store,
        fetcher: &fetcher,
        documents: &documents,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // Driven as the chat route drives a request: the parts of items still being made are fed to
    // the engine by tasks on this runtime, which must keep running until the generation ends.
    let line = runtime.block_on(async {
        let prepared = chat::prepare(&model, request, &services)
            .await
            .map_err(|e| {
                let items: Vec<String> = files
                    .iter()
                    .enumerate()
                    .map(|(i, (_, path))| format!("{i} = {}", path.display()))
                    .collect();
                anyhow!("{} (media items: {})", e.message, items.join(", "))
            })?;
        let mut generation = Generation::start(&model, prepared)
            .map_err(|e| anyhow!("generation failed: {}", e.message))?;
        let mut text = String::new();
        let (finish, usage) = loop {
            match generation.next().await {
                Ok(Step::Text(delta)) => text.push_str(&delta),
                Ok(Step::Done { finish, usage, .. }) => break (finish, usage),
                Err(e) => bail!("generation failed: {}", e.message),
            }
        };
        // A run's output repeats exactly for a seed: its plugins' timings are left out.
        let media_report: Vec<Value> = generation.media.iter().map(|a| a.to_json(false)).collect();
        anyhow::Ok(json!({
            "token_ids": generation.token_ids,
            "text": text,
            "finish_reason": finish,
            "usage": {
                "prompt_tokens": usage["prompt_tokens"],
                "completion_tokens": usage["completion_tokens"],
                "total_tokens": usage["total_tokens"],
                "media": media_report,
            },
        }))
    })?;
    println!("{line}");
    Ok(ExitCode::SUCCESS)
}
