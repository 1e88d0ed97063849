//! Text-only time-to-first-token on the demo Qwen2-VL model, with the encoder device idle and with it
//! saturated by video-sized vision jobs, measured in the same run. The encoder device and the LLM
//! device have their own threads, so the goal is at most 5 % worse under encoder load.
//!
//!     cargo bench -p mmgate-inference --bench ttft

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use mmgate_inference::demo::{self, DemoFamily};
use mmgate_inference::engine::{
    DeviceSpec, EncodeInput, Encoder, EncoderPool, Engine, EngineConfig, Event, FeatureStore,
    GenerateRequest, PositionScheme,
};
use mmgate_inference::models::Qwen2Vl;
use mmgate_inference::rope::Grid;
use mmgate_inference::sampling::SamplingParams;
use mmgate_inference::text::TextProcessor;
use mmgate_inference::{CpuBackend, Result};

const SAMPLES: usize = 100;

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

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
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
        max_running: 8,
        prefill_chunk: 512,
        kv_budget_tokens: 8192,
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
    let prompt = text.encode(&"Describe the weather in the garden today, please. ".repeat(8))?;

    for _ in 0..5 {
        ttft(&engine, &prompt)?; // warm-up
    }
    let idle: Vec<Duration> = (0..SAMPLES)
        .map(|_| ttft(&engine, &prompt))
        .collect::<Result<_>>()?;

    // Keep the encoder device busy: 8 frames (4 temporal patches) of 448x448 per job, always queued.
    let grid = Grid { t: 4, h: 32, w: 32 };
    let job = Arc::new(EncodeInput::Vision {
        pixel_values: vec![0.1; grid.patches() * 1176].into(),
        grid,
    });
    let running = Arc::new(AtomicBool::new(true));
    let in_flight = Arc::new(AtomicUsize::new(0));
    let done_jobs = Arc::new(AtomicUsize::new(0));
    let feeder = {
        let (pool, running, in_flight, done_jobs) = (
            pool.clone(),
            running.clone(),
            in_flight.clone(),
            done_jobs.clone(),
        );
        std::thread::spawn(move || {
            while running.load(Ordering::Relaxed) {
                if in_flight.load(Ordering::Relaxed) < 4 {
                    in_flight.fetch_add(1, Ordering::Relaxed);
                    let (f, d) = (in_flight.clone(), done_jobs.clone());
                    let _ = pool.submit(job.clone(), move |_| {
                        f.fetch_sub(1, Ordering::Relaxed);
                        d.fetch_add(1, Ordering::Relaxed);
                    });
                } else {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        })
    };
    while done_jobs.load(Ordering::Relaxed) == 0 {
        std::thread::sleep(Duration::from_millis(5));
    }
    let busy: Vec<Duration> = (0..SAMPLES)
        .map(|_| ttft(&engine, &prompt))
        .collect::<Result<_>>()?;
    let jobs = done_jobs.load(Ordering::Relaxed);
    running.store(false, Ordering::Relaxed);
    let _ = feeder.join();
    while in_flight.load(Ordering::Relaxed) > 0 {
        std::thread::sleep(Duration::from_millis(5));
    }
    // Idle again, so drift over the run (warm-up, clocks) shows up as two idle numbers apart.
    let idle_after: Vec<Duration> = (0..SAMPLES)
        .map(|_| ttft(&engine, &prompt))
        .collect::<Result<_>>()?;
    let _ = std::fs::remove_dir_all(&cache);

    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let (idle, busy, idle_after) = (median(idle), median(busy), median(idle_after));
    let baseline = idle.min(idle_after);
    println!(
        "text-only TTFT ({} prompt tokens, demo Qwen2-VL, median of {SAMPLES}): encoders idle {:.2} ms (again after: {:.2} ms), encoders saturated by video jobs {:.2} ms ({jobs} jobs of {} patches done meanwhile): {:+.1} % vs the better idle run",
        prompt.len(),
        ms(idle),
        ms(idle_after),
        ms(busy),
        grid.patches(),
        100.0 * (busy.as_secs_f64() / baseline.as_secs_f64() - 1.0)
    );
    Ok(())
}
