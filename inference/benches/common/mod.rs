//! The demo Qwen2-VL model running in an engine on one LLM thread and one encoder thread (the
//! devices two cores get), and the time to a prompt's first token: what the engine benches share.

// Each bench compiles this module on its own and uses only part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mmgate_inference::demo::{self, DemoFamily};
use mmgate_inference::engine::{
    DeviceSpec, Encoder, EncoderPool, Engine, EngineConfig, Event, FeatureStore, GenerateRequest,
    PositionScheme,
};
use mmgate_inference::models::Qwen2Vl;
use mmgate_inference::sampling::SamplingParams;
use mmgate_inference::text::TextProcessor;
use mmgate_inference::{CpuBackend, Result};

pub struct DemoEngine {
    pub engine: Engine,
    pub text: Arc<TextProcessor>,
    pub pool: Arc<EncoderPool>,
    /// The demo checkpoint's directory, removed when this is dropped.
    cache: PathBuf,
}

impl Drop for DemoEngine {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.cache);
    }
}

/// The demo Qwen2-VL in an engine with prefill chunks of 512 tokens.
pub fn demo_engine(max_running: usize, kv_budget_tokens: usize) -> Result<DemoEngine> {
    let cache = std::env::temp_dir().join(format!("mmgate-bench-{}", std::process::id()));
    let dir = demo::ensure(&cache, DemoFamily::Qwen2Vl)?;
    let llm_dev = CpuBackend::new("llm", 1)?;
    let enc_dev = CpuBackend::new("enc", 1)?;
    let model: Qwen2Vl<CpuBackend, CpuBackend> = Qwen2Vl::load(&dir, &enc_dev, &llm_dev)?;
    let (engine, text, pool) = qwen2_vl_engine(model, &dir, max_running, kv_budget_tokens)?;
    Ok(DemoEngine {
        engine,
        text,
        pool,
        cache,
    })
}

/// A loaded Qwen2-VL in an engine with prefill chunks of 512 tokens, its vision tower the one
/// encoder of a device of its own; with the text processor and the encoder pool.
pub fn qwen2_vl_engine(
    model: Qwen2Vl<CpuBackend, CpuBackend>,
    dir: &Path,
    max_running: usize,
    kv_budget_tokens: usize,
) -> Result<(Engine, Arc<TextProcessor>, Arc<EncoderPool>)> {
    let vision: Arc<dyn Encoder> = Arc::new(model.vision);
    let pool = Arc::new(EncoderPool::new(
        vec![DeviceSpec {
            name: "enc".into(),
            encoders: vec![vision],
        }],
        4,
    )?);
    let text = Arc::new(TextProcessor::load(dir)?);
    let config = EngineConfig {
        model_name: "bench".into(),
        positions: PositionScheme::MRope { merge: 2 },
        max_running,
        prefill_chunk: 512,
        kv_budget_tokens,
        eos_token_ids: Vec::new(),
        deepstack_levels: 0,
    };
    let engine = Engine::start(
        config,
        model.llm,
        text.clone(),
        pool.clone(),
        Arc::new(FeatureStore::new(0)),
    )?;
    Ok((engine, text, pool))
}

/// A text-only greedy request for up to `max_tokens` tokens.
fn greedy_text(prompt: &[u32], max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        prompt: prompt.to_vec(),
        media: Vec::new(),
        sampling: SamplingParams::greedy(),
        max_tokens,
        stop: Vec::new(),
    }
}

/// Time to the first token of a text-only prompt.
pub fn ttft(engine: &Engine, prompt: &[u32]) -> Result<Duration> {
    let start = Instant::now();
    let mut h = engine.submit(greedy_text(prompt, 1))?;
    match h.events.blocking_recv() {
        Some(Event::Token { .. }) => Ok(start.elapsed()),
        Some(Event::Failed(m)) => Err(mmgate_inference::Error::Input(m.to_string())),
        Some(Event::Done { .. }) | None => Err(mmgate_inference::Error::Input("no token".into())),
    }
}

/// Time per generated token after a prompt's first: `tokens` more decoding steps, timed from the
/// first token to the last.
pub fn decode_per_token(engine: &Engine, prompt: &[u32], tokens: usize) -> Result<Duration> {
    let mut h = engine.submit(greedy_text(prompt, tokens + 1))?;
    let (mut first, mut seen) = (None, 0);
    loop {
        match h.events.blocking_recv() {
            Some(Event::Token { .. }) => {
                seen += 1;
                first.get_or_insert_with(Instant::now);
            }
            Some(Event::Failed(m)) => return Err(mmgate_inference::Error::Input(m.to_string())),
            Some(Event::Done { .. }) | None => break,
        }
    }
    match first {
        Some(first) if seen == tokens + 1 => Ok(first.elapsed() / tokens as u32),
        _ => Err(mmgate_inference::Error::Input(format!(
            "{seen} tokens of {}",
            tokens + 1
        ))),
    }
}
