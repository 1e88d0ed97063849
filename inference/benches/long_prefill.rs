//! Time to first token of one long text prompt on the demo Qwen2-VL LLM (one thread, as the LLM
//! device gets on two cores), at 2k, 8k and 30k tokens: at long context the attention over every
//! earlier key is most of a prefill (the demo's layers are narrow), which is what a long video's or
//! audio file's first token waits for.
//!
//!     cargo bench -p mmgate-inference --bench long_prefill

mod common;

use mmgate_inference::Result;

use common::{decode_per_token, demo_engine, ttft};

const CONTEXTS: [usize; 3] = [2_048, 8_192, 30_000];
/// Tokens decoded after each context's prompt, to time a decoding step there.
const DECODED: usize = 32;

fn main() -> Result<()> {
    let demo = demo_engine(1, 32_768)?;
    let (engine, text) = (&demo.engine, &demo.text);
    let sentence = text.encode("Describe the weather in the garden today, please. ")?;
    ttft(engine, &sentence)?; // warm-up
    println!("long text prefill, demo Qwen2-VL LLM on 1 thread (prefill chunks of 512):");
    for context in CONTEXTS {
        let prompt: Vec<u32> = sentence.iter().copied().cycle().take(context).collect();
        let rounds = if context > 10_000 { 2 } else { 5 };
        let best = (0..rounds)
            .map(|_| ttft(engine, &prompt))
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .min()
            .unwrap_or_default();
        println!(
            "  {context:>6} tokens: {:>8.1} ms ({:.1} µs a token), best of {rounds}",
            best.as_secs_f64() * 1e3,
            best.as_secs_f64() * 1e6 / context as f64
        );
        let decode = decode_per_token(engine, &prompt, DECODED)?;
        println!(
            "  {context:>6} tokens: then {:>6.2} ms a token decoded ({DECODED} tokens)",
            decode.as_secs_f64() * 1e3
        );
    }
    Ok(())
}
