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
use mmgate_inference::engine::{Event, FinishReason};
use serde_json::{Value, json};

use crate::config::{EncodeErrorPolicy, PluginsConfig, RequestLimits};
use crate::media::fetch::{FetchConfig, Fetcher};
use crate::media::files::{FileStore, FilesConfig};
use crate::media::sniff::sniff_mime_type;
use crate::native::chat::{self, ChatServices, NativeModel};
use crate::native::model::{
    MediaKind, ModelRuntime, RuntimeOptions, default_cache_dir, resolve_model_dir,
};
use crate::store::Caller;
use crate::wire::openai::ChatCompletionRequest;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// An HF model directory (Qwen2-VL or Qwen2-Audio), or `demo` / `demo-audio` for the built-in
    /// demo models.
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
        let field = match kind {
            MediaKind::Image => "image_url",
            MediaKind::Video => "video_url",
            MediaKind::Audio => "audio_url",
        };
        content.push(json!({"type": field, field: {"url": url}}));
    }
    content.push(json!({"type": "text", "text": args.prompt}));
    let mut request = json!({
        "messages": [{"role": "user", "content": content}],
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
    });
    if let Some(seed) = args.seed {
        request["seed"] = json!(seed);
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
    let model = NativeModel {
        runtime,
        on_encode_error: EncodeErrorPolicy::Error,
        accept_image_embeds: false,
        media_parts: true,
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
    let services = ChatServices {
        caller: &caller,
        registry,
        pool: &pool,
        limits: &limits,
        files: &files_store,
        fetcher: &fetcher,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let prepared = runtime
        .block_on(chat::prepare(&model, request, &services))
        .map_err(|e| {
            let items: Vec<String> = files
                .iter()
                .enumerate()
                .map(|(i, (_, path))| format!("{i} = {}", path.display()))
                .collect();
            anyhow!("{} (media items: {})", e.message, items.join(", "))
        })?;
    let (request, accounts) = prepared.into_request();
    // A run's output repeats exactly for a seed: its plugins' timings are left out.
    let media_report: Vec<Value> = accounts.iter().map(|a| a.to_json(false)).collect();
    let mut handle = model.runtime.engine()?.submit(request)?;

    let (mut token_ids, mut text) = (Vec::new(), String::new());
    let (finish, usage) = loop {
        match handle.events.blocking_recv() {
            Some(Event::Token { id, text: t }) => {
                token_ids.push(id);
                text.push_str(&t);
            }
            Some(Event::Done { finish, usage }) => break (finish, usage),
            Some(Event::Failed(failure)) => bail!("generation failed: {failure}"),
            None => bail!("the engine stopped"),
        }
    };
    let line = json!({
        "token_ids": token_ids,
        "text": text,
        "finish_reason": match finish { FinishReason::Stop => "stop", FinishReason::Length => "length" },
        "usage": {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "media": media_report,
        },
    });
    println!("{line}");
    Ok(ExitCode::SUCCESS)
}
