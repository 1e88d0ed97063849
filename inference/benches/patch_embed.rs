//! The vision encoder's input for a 4032x3024 photo (Qwen2-VL at its shipped `max_pixels`: 62 208
//! patches of 1 176 values, held as 8-bit samples and a normalisation table): expanded to f32 as a
//! whole and then embedded (the path before) vs expanded and embedded a block of rows at a time
//! ([`embed_blockwise`]), in the same run, on one thread. The embedding has 32 outputs so that what
//! differs, the expansion and the copies of 290 MB, is what is timed; the real tower's 1 280-wide
//! embedding costs the same either way.
//!
//!     cargo bench -p mmgate-inference --bench patch_embed

use std::sync::Arc;
use std::time::{Duration, Instant};

use mmgate_inference::engine::encoder::embed_blockwise;
use mmgate_inference::engine::{PixelSource, PixelValues};
use mmgate_inference::{CpuBackend, Result, Tensor};

const PATCHES: usize = 62_208;
const PATCH_LEN: usize = 1_176;
const OUT: usize = 32;
const SAMPLES: usize = 7;

/// 8-bit samples in runs of one channel each, and a table per channel (as the image plugin hands
/// them over).
#[derive(Debug)]
struct Samples {
    data: Vec<u8>,
    table: Vec<f32>,
    run: usize,
}

impl Samples {
    fn write(&self, start: usize, out: &mut [f32]) {
        for (i, value) in out.iter_mut().enumerate() {
            let at = start + i;
            let channel = (at / self.run) % 3;
            *value = self.table[channel * 256 + usize::from(self.data[at])];
        }
    }
}

impl PixelSource for Samples {
    fn value_count(&self) -> usize {
        self.data.len()
    }
    fn bytes(&self) -> usize {
        self.data.len() + 4 * self.table.len()
    }
    fn feed_content(&self, feed: &mut dyn FnMut(&[u8])) {
        feed(&self.data);
    }
    fn extend_f32(&self, out: &mut Vec<f32>) {
        let at = out.len();
        out.resize(at + self.data.len(), 0.0);
        self.write(0, &mut out[at..]);
    }
    fn write_f32(&self, start: usize, out: &mut [f32]) {
        self.write(start, out);
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let device = CpuBackend::new("bench", 1)?;
    let samples = Samples {
        data: (0..PATCHES * PATCH_LEN)
            .map(|i| (i * 31 % 251) as u8)
            .collect(),
        table: (0..768).map(|i| (i % 256) as f32 / 255.0 - 0.5).collect(),
        run: PATCH_LEN / 3,
    };
    let pixels = PixelValues::Source(Arc::new(samples));
    let weight: Vec<f32> = (0..OUT * PATCH_LEN)
        .map(|i| (i % 7) as f32 * 0.01)
        .collect();
    let weight = Tensor::from_host(&device, &weight, &[OUT, PATCH_LEN])?;

    let whole = || -> Result<Vec<f32>> {
        let mut values = Vec::new();
        pixels.extend_f32(&mut values);
        let input = Tensor::from_host(&device, &values, &[PATCHES, PATCH_LEN])?;
        input.linear(&weight, None)?.to_host()
    };
    let blockwise = || {
        embed_blockwise(&device, &[(&pixels, PATCHES)], PATCH_LEN, |x| {
            x.linear(&weight, None)
        })
    };
    if whole()? != blockwise()? {
        return Err(mmgate_inference::Error::Input(
            "the two paths disagree".into(),
        ));
    }
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..SAMPLES {
        let t = Instant::now();
        whole()?;
        a.push(t.elapsed());
        let t = Instant::now();
        blockwise()?;
        b.push(t.elapsed());
    }
    let (a, b) = (median(a), median(b));
    println!(
        "4032x3024 photo's patches ({PATCHES} x {PATCH_LEN}) into a {OUT}-wide embedding, one thread: \
         expanded whole {:.1} ms, block-wise {:.1} ms ({:.2}x), {:.1} ms less on the critical path",
        a.as_secs_f64() * 1e3,
        b.as_secs_f64() * 1e3,
        a.as_secs_f64() / b.as_secs_f64(),
        (a.as_secs_f64() - b.as_secs_f64()) * 1e3
    );
    Ok(())
}
