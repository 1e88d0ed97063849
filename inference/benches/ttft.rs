//! Text-only time-to-first-token on the demo Qwen2-VL model, with the encoder device idle and with it
//! saturated by video-sized vision jobs, measured in the same run. The encoder device and the LLM
//! device have their own threads, so the goal is at most 5 % worse under encoder load.
//!
//!     cargo bench -p mmgate-inference --bench ttft

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use mmgate_inference::Result;
use mmgate_inference::engine::EncodeInput;
use mmgate_inference::rope::Grid;

use common::{demo_engine, ttft};

const SAMPLES: usize = 100;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let demo = demo_engine(8, 8192)?;
    let (engine, text, pool) = (&demo.engine, &demo.text, &demo.pool);
    let prompt = text.encode(&"Describe the weather in the garden today, please. ".repeat(8))?;

    for _ in 0..5 {
        ttft(engine, &prompt)?; // warm-up
    }
    let idle: Vec<Duration> = (0..SAMPLES)
        .map(|_| ttft(engine, &prompt))
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
        .map(|_| ttft(engine, &prompt))
        .collect::<Result<_>>()?;
    let jobs = done_jobs.load(Ordering::Relaxed);
    running.store(false, Ordering::Relaxed);
    let _ = feeder.join();
    while in_flight.load(Ordering::Relaxed) > 0 {
        std::thread::sleep(Duration::from_millis(5));
    }
    // Idle again, so drift over the run (warm-up, clocks) shows up as two idle numbers apart.
    let idle_after: Vec<Duration> = (0..SAMPLES)
        .map(|_| ttft(engine, &prompt))
        .collect::<Result<_>>()?;

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
