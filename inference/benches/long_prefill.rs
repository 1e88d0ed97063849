//! Time to first token of one long text prompt on the demo Qwen2-VL LLM (one thread, as the LLM
//! device gets on two cores), at 2k, 8k and 30k tokens: at long context the attention over every
//! earlier key is most of a prefill (the demo's layers are narrow), which is what a long video's or
//! audio file's first token waits for.
//!
//!     cargo bench -p mmgate-inference --bench long_prefill

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

const CONTEXTS: [usize; 3] = [2_048, 8_192, 30_000];

fn ttft(engine: &Engine, prompt: &[u32]) -> Result<Duration> {
    let start = Instant::now();
    let mut h = engine.submit(GenerateRequest {
        prompt: prompt.to_vec(),
        media: Vec::new(),
        sampling: SamplingParams::greedy(),
        max_tokens: 1,
        stop: Vec::new(),
    })?;
    match h.events.blocking_recv() {
        Some(Event::Token { .. }) => Ok(start.elapsed()),
        Some(Event::Failed(m)) => Err(mmgate_inference::Error::Input(m.to_string())),
        Some(Event::Done { .. }) | None => Err(mmgate_inference::Error::Input("no token".into())),
    }
}

fn main() -> Result<()> {
    let cache = std::env::temp_dir().join(format!("mmgate-bench-{}", std::process::id()));
    let dir = demo::ensure(&cache, DemoFamily::Qwen2Vl)?;
    let llm_dev = CpuBackend::new("llm", 1)?;
    let enc_dev = CpuBackend::new("enc", 1)?;
    let model: Qwen2Vl<CpuBackend, CpuBackend> = Qwen2Vl::load(&dir, &enc_dev, &llm_dev)?;
    let vision: Arc<dyn Encoder> = Arc::new(model.vision);
    let pool = Arc::new(EncoderPool::new(
        vec![DeviceSpec {
            name: "enc".into(),
            encoders: vec![vision],
        }],
        4,
    )?);
    let text = Arc::new(TextProcessor::load(&dir)?);
    let config = EngineConfig {
        model_name: "demo".into(),
        positions: PositionScheme::MRope { merge: 2 },
        max_running: 1,
        prefill_chunk: 512,
        kv_budget_tokens: 32_768,
        eos_token_ids: Vec::new(),
        deepstack_levels: 0,
    };
    let engine = Engine::start(
        config,
        model.llm,
        text.clone(),
        pool,
        Arc::new(FeatureStore::new(0)),
    )?;
    let sentence = text.encode("Describe the weather in the garden today, please. ")?;
    ttft(&engine, &sentence)?; // warm-up
    println!("long text prefill, demo Qwen2-VL LLM on 1 thread (prefill chunks of 512):");
    for context in CONTEXTS {
        let prompt: Vec<u32> = sentence.iter().copied().cycle().take(context).collect();
        let rounds = if context > 10_000 { 2 } else { 5 };
        let best = (0..rounds)
            .map(|_| ttft(&engine, &prompt))
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .min()
            .unwrap_or_default();
        println!(
            "  {context:>6} tokens: {:>8.1} ms ({:.1} µs a token), best of {rounds}",
            best.as_secs_f64() * 1e3,
            best.as_secs_f64() * 1e6 / context as f64
        );
    }
    let _ = std::fs::remove_dir_all(&cache);
    Ok(())
}
