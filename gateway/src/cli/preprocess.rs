//! `mmgate preprocess`: run one media file through its plugin exactly as a request would, and write
//! the tensors the encoder would get as safetensors (for checking against HF, or feeding a model).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, anyhow, bail};
use clap::Args;
use mmgate_host::{Dtype, Media, PluginRegistry, SandboxLimits, Tensor};
use serde_json::{Value, json};

use crate::config::PluginsConfig;
use crate::error::ApiError;
use crate::media::budget::BudgetError;
use crate::media::pipeline;
use crate::media::sniff::sniff_mime_type;

use crate::media::render;

#[derive(Args, Debug)]
pub struct PreprocessArgs {
    /// A model directory holding the processor's `preprocessor_config.json`.
    #[arg(long)]
    model: PathBuf,
    /// The media file (image, audio or video: whatever a loaded plugin accepts).
    file: PathBuf,
    /// Where to write the tensors (safetensors).
    #[arg(long)]
    out: PathBuf,
    /// Token budget for this item (default: unlimited, i.e. the processor's native size).
    #[arg(long)]
    max_tokens: Option<u32>,
    /// A plugin directory to load besides the built-in plugins (its plugins win).
    #[arg(long)]
    plugin_dir: Option<PathBuf>,
    /// Print a JSON account of what was done: sizes or duration, tokens, reason, tensors, timings.
    #[arg(long)]
    explain: bool,
    /// Also draw the audio's log-mel spectrogram as a PNG (audio only).
    #[arg(long, value_name = "OUT.png")]
    mel_png: Option<PathBuf>,
    /// Also draw the frames a video's plan chose, as the model sees them, with their timestamps and
    /// the token cost (video only).
    #[arg(long, value_name = "OUT.png")]
    contact_sheet: Option<PathBuf>,
}

pub fn run(args: PreprocessArgs) -> anyhow::Result<ExitCode> {
    // With what the model's family adds (Mistral 3's merge, LLaVA-NeXT's tower), as served.
    let config = mmgate_inference::prompt::plugin_processor_config(&args.model)?;
    let data = std::fs::read(&args.file)
        .with_context(|| format!("cannot read {}", args.file.display()))?;

    let sandbox =
        crate::media::plugins::sandbox(SandboxLimits::default(), &PluginsConfig::default())?;
    let registry = match &args.plugin_dir {
        Some(dir) => PluginRegistry::with_dir(&sandbox, dir),
        None => PluginRegistry::builtin(&sandbox),
    }?;
    let mime_type = sniff_mime_type(&data);
    let media = Media {
        data,
        mime_type: mime_type.map(str::to_owned),
    };
    let plugin =
        pipeline::choose_plugin(&registry, &media, None, &config).ok_or_else(
            || match mime_type {
                Some(mime_type) => anyhow!(
                    "no loaded plugin accepts {mime_type} ({})",
                    args.file.display()
                ),
                None => anyhow!(
                    "{}: not a media file any plugin recognises ({} bytes of unknown content)",
                    args.file.display(),
                    media.data.len()
                ),
            },
        )?;
    // Plugin errors read the way a client would see them (the message the API would return), on
    // one line: decoder messages sometimes carry newlines.
    let reason = |e: BudgetError| {
        let message = match e {
            BudgetError::Plugin { error, .. } => ApiError::from(&error).message,
            too_small => too_small.to_string(),
        };
        anyhow!(
            "{}",
            message.split_whitespace().collect::<Vec<_>>().join(" ")
        )
    };
    let max_tokens = args.max_tokens.unwrap_or(u32::MAX);
    let item = [(plugin.clone(), media)];
    let whole = pipeline::Produce::Tensors {
        parts: pipeline::Parts::Whole,
    };
    let processed = pipeline::process_together(&item, &config, max_tokens, &whole)
        .map_err(reason)?
        .pop()
        .context("the plugin returned no result")?;
    let plan = &processed.plan;
    // What HF's processor gives: samples a plugin sent as u8 with a table become floats again.
    let pipeline::Made::Tensors(made) = &processed.made else {
        bail!("the plugin made no tensors of the item");
    };
    let tensors = &mmgate_host::with_f32_values(made)
        .map_err(|e| anyhow!("the plugin's output is malformed: {e}"))?;

    let metadata = HashMap::from([
        ("format".to_owned(), "pt".to_owned()),
        ("mmgate.plugin".to_owned(), plugin.name().to_owned()),
        ("mmgate.tokens".to_owned(), plan.tokens.to_string()),
    ]);
    // The picture first: when it cannot be drawn (not audio), nothing is written.
    if let Some(path) = &args.mel_png {
        let png = render::mel_png(tensors).context("--mel-png")?;
        std::fs::write(path, png).with_context(|| format!("cannot write {}", path.display()))?;
    }
    if let Some(path) = &args.contact_sheet {
        let (mean, std) = normalisation(&config);
        let png =
            render::contact_sheet(tensors, mean, std, plan.tokens).context("--contact-sheet")?;
        std::fs::write(path, png).with_context(|| format!("cannot write {}", path.display()))?;
    }
    write_safetensors(&args.out, tensors, metadata)?;

    if args.explain {
        let mut report = serde_json::Map::new();
        report.insert("file".into(), json!(args.file.display().to_string()));
        report.insert("mime_type".into(), json!(mime_type));
        report.extend(pipeline::report(plugin, &processed));
        report.insert("out".into(), json!(args.out.display().to_string()));
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(ExitCode::SUCCESS)
}

/// The processor config's `image_mean` and `image_std` (CLIP's when absent), to undo normalisation.
fn normalisation(config: &str) -> ([f32; 3], [f32; 3]) {
    let value: Value = serde_json::from_str(config).unwrap_or_default();
    let triple = |key: &str, default: [f32; 3]| {
        serde_json::from_value::<[f32; 3]>(value[key].clone()).unwrap_or(default)
    };
    (
        triple("image_mean", [0.481_454_66, 0.457_827_5, 0.408_210_73]),
        triple("image_std", [0.268_629_5, 0.261_302_6, 0.275_777_1]),
    )
}

fn safetensors_dtype(dtype: Dtype) -> safetensors::Dtype {
    match dtype {
        Dtype::U8 => safetensors::Dtype::U8,
        Dtype::I32 => safetensors::Dtype::I32,
        Dtype::I64 => safetensors::Dtype::I64,
        Dtype::F16 => safetensors::Dtype::F16,
        Dtype::Bf16 => safetensors::Dtype::BF16,
        Dtype::F32 => safetensors::Dtype::F32,
    }
}

fn write_safetensors(
    path: &Path,
    tensors: &[Tensor],
    metadata: HashMap<String, String>,
) -> anyhow::Result<()> {
    let mut views = Vec::with_capacity(tensors.len());
    for tensor in tensors {
        let shape = tensor
            .shape
            .iter()
            .map(|&d| usize::try_from(d))
            .collect::<Result<Vec<_>, _>>()
            .with_context(|| format!("tensor {} has a dimension too large", tensor.name))?;
        let view = safetensors::tensor::TensorView::new(
            safetensors_dtype(tensor.dtype),
            shape,
            &tensor.data,
        )
        .map_err(|e| anyhow!("tensor {}: {e}", tensor.name))?;
        views.push((tensor.name.as_str(), view));
    }
    if views.is_empty() {
        bail!("the plugin produced no tensors");
    }
    safetensors::tensor::serialize_to_file(views, Some(metadata), path)
        .map_err(|e| anyhow!("cannot write {}: {e}", path.display()))
}
