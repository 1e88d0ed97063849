//! `mmgate generate`: one request through the plugins and the native inference core in this
//! process, printing one JSON line with the generated tokens, text and usage.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, anyhow, bail};
use clap::Args;
use mmgate_host::{Media, PluginRegistry, SandboxLimits};
use mmgate_inference::engine::{Event, FinishReason, GenerateRequest};
use mmgate_inference::sampling::SamplingParams;
use mmgate_inference::text::{ChatMessage, ContentPart};
use serde_json::json;

use crate::budget::BudgetError;
use crate::config::PluginsConfig;
use crate::error::ApiError;
use crate::media::sniff_mime_type;
use crate::model::{
    MediaKind, ModelRuntime, RuntimeOptions, default_cache_dir, expand_placeholders,
    resolve_model_dir,
};
use crate::pipeline;

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

pub fn run(args: GenerateArgs) -> anyhow::Result<ExitCode> {
    let dir = resolve_model_dir(&args.model, &default_cache_dir())?;
    let name = dir
        .file_name()
        .map_or("model".into(), |n| n.to_string_lossy().into_owned());
    let runtime = ModelRuntime::load(&name, &dir, &RuntimeOptions::default(), None)
        .with_context(|| format!("loading the model in {}", dir.display()))?;
    let model = &runtime.prompt;

    let files: Vec<(MediaKind, &PathBuf)> = (args.image.iter().map(|f| (MediaKind::Image, f)))
        .chain(args.video.iter().map(|f| (MediaKind::Video, f)))
        .chain(args.audio.iter().map(|f| (MediaKind::Audio, f)))
        .collect();
    for (kind, _) in &files {
        model.placeholder(*kind)?;
    }
    let mut content: Vec<ContentPart> = files.iter().map(|(k, _)| k.content_part()).collect();
    content.push(ContentPart::Text(args.prompt.clone()));
    let messages = [ChatMessage {
        role: "user".into(),
        content,
    }];
    let templated = model.text.apply_chat_template(&messages, true)?;
    let ids = model.text.encode(&templated)?;

    // Media share what the context leaves after the text and the completion.
    let text_tokens = model.text_tokens(&ids);
    let budget = model
        .context_length
        .checked_sub(text_tokens + args.max_tokens)
        .ok_or_else(|| anyhow!("the prompt ({text_tokens} tokens) and max_tokens leave no room in the context ({})", model.context_length))?;

    let sandbox = crate::plugins::sandbox(SandboxLimits::default(), &PluginsConfig::default())?;
    let registry = match &args.plugin_dir {
        Some(dir) => PluginRegistry::with_dir(&sandbox, dir),
        None => PluginRegistry::builtin(&sandbox),
    }?;
    let mut items = Vec::with_capacity(files.len());
    for (kind, path) in &files {
        let data =
            std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
        let mime_type = sniff_mime_type(&data);
        let media = Media {
            data,
            mime_type: mime_type.map(str::to_owned),
        };
        let plugin = pipeline::choose_plugin(
            &registry,
            &media,
            Some(kind.name()),
            &model.processor_config,
        )
        .ok_or_else(|| {
            anyhow!(
                "{}: no loaded plugin accepts this file ({})",
                path.display(),
                mime_type.unwrap_or("unknown content")
            )
        })?;
        items.push((plugin.clone(), media));
    }
    let processed = pipeline::process_together(
        &items,
        &model.processor_config,
        u32::try_from(budget).unwrap_or(u32::MAX),
    )
    .map_err(|e| match e {
        BudgetError::Plugin { item, error } => {
            anyhow!(
                "{}: {}",
                files[item].1.display(),
                ApiError::from(&error).message
            )
        }
        other => anyhow!("{other}"),
    })?;
    let mut media = Vec::with_capacity(processed.len());
    let mut media_report = Vec::with_capacity(processed.len());
    for ((kind, path), p) in files.iter().zip(&processed) {
        media.push(
            model
                .media_item(*kind, p.plan.tokens, &p.tensors)
                .with_context(|| path.display().to_string())?,
        );
        media_report
            .push(json!({"kind": kind.name(), "tokens": p.plan.tokens, "reason": p.plan.reason}));
    }
    let prompt = expand_placeholders(&ids, &media)?;
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: 0,
        seed: args.seed,
    };
    let mut handle = runtime.engine()?.submit(GenerateRequest {
        prompt,
        media,
        sampling,
        max_tokens: args.max_tokens,
        stop: Vec::new(),
    })?;

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
