//! Shared by the parity tests: reading the goldens made by tests/fixtures/models/generate.py and
//! checking a merged prompt's prefill logits and greedy continuation against them.

#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

pub mod gpu_ops;
pub mod sim_device;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use mmgate_inference::backend::cuda::{CudaBackend, DriverDevice};
use mmgate_inference::devices::CudaGpu;
use mmgate_inference::models::qwen2::{Deepstack, SeqStep};
use mmgate_inference::models::{KvCache, Qwen2};
use mmgate_inference::rope::Grid;
use mmgate_inference::sampling::argmax;
use mmgate_inference::{Backend, CpuBackend, Tensor};
use safetensors::{Dtype, SafeTensors};

/// fp32 tolerance: max |ours − HF| relative to the largest |HF| value of the tensor.
pub const REL_TOLERANCE: f32 = 1e-4;
pub const GREEDY_TOKENS: usize = 32;

/// A family's fixtures: under the repository these tests were built from, or under
/// `MMGATE_REPO` (a GPU bundle's tests run from a copy of the repository elsewhere).
pub fn family_dir(family: &str) -> PathBuf {
    let repo = std::env::var_os("MMGATE_REPO")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join(".."));
    repo.join("tests/fixtures/models").join(family)
}

pub enum Golden {
    F32(Vec<usize>, Vec<f32>),
    I64(Vec<i64>),
}

pub struct Goldens(HashMap<String, Golden>);

impl Goldens {
    pub fn load(family: &str) -> Self {
        Self::load_file(family, "goldens.safetensors")
    }

    pub fn load_file(family: &str, file: &str) -> Self {
        let bytes = std::fs::read(family_dir(family).join(file)).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let mut map = HashMap::new();
        for (name, view) in st.tensors() {
            let shape = view.shape().to_vec();
            let data = view.data();
            let g = match view.dtype() {
                Dtype::F32 => Golden::F32(
                    shape,
                    data.chunks_exact(4)
                        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                        .collect(),
                ),
                Dtype::F16 => Golden::F32(
                    shape,
                    data.chunks_exact(2)
                        .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                        .collect(),
                ),
                Dtype::I64 => Golden::I64(
                    data.chunks_exact(8)
                        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
                        .collect(),
                ),
                other => panic!("{name}: {other:?}"),
            };
            map.insert(name, g);
        }
        Self(map)
    }

    pub fn has(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }

    pub fn f32(&self, name: &str) -> (&[usize], &[f32]) {
        match &self.0[name] {
            Golden::F32(s, d) => (s, d),
            Golden::I64(..) => panic!("{name} is i64"),
        }
    }

    pub fn i64(&self, name: &str) -> &[i64] {
        match &self.0[name] {
            Golden::I64(d) => d,
            Golden::F32(..) => panic!("{name} is f32"),
        }
    }

    pub fn ids(&self, name: &str) -> Vec<u32> {
        self.i64(name).iter().map(|&i| i as u32).collect()
    }
}

/// The grids of `item` (`{item}.grid_thw`, rows of t, h, w).
pub fn grids(g: &Goldens, item: &str) -> Vec<Grid> {
    g.i64(&format!("{item}.grid_thw"))
        .chunks(3)
        .map(|v| Grid {
            t: v[0] as usize,
            h: v[1] as usize,
            w: v[2] as usize,
        })
        .collect()
}

pub fn relative_error(ours: &[f32], reference: &[f32]) -> f32 {
    assert_eq!(ours.len(), reference.len());
    let scale = reference.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    max_abs_diff(ours, reference) / scale
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()))
}

pub fn check_close<B: Backend>(what: &str, ours: &Tensor<B>, (shape, want): (&[usize], &[f32])) {
    assert_eq!(ours.shape(), shape, "{what}: shape");
    let err = relative_error(&ours.to_host().unwrap(), want);
    eprintln!("{what}: relative error {err:.2e}");
    assert!(err <= REL_TOLERANCE, "{what}: relative error {err}");
}

/// The simulated CUDA backend: encoder on "cuda:1", LLM on "cuda:0" (see `sim_device`).
pub fn simulated_gpus() -> (SimGpu, SimGpu) {
    (
        CudaBackend::new(sim_device::SimDevice::new("cuda:1")),
        CudaBackend::new(sim_device::SimDevice::new("cuda:0")),
    )
}

pub type SimGpu = CudaBackend<sim_device::SimDevice>;

/// Real GPUs (`./dev gpu-check`): the encoder on cuda:1 and the LLM on cuda:0 when there are two,
/// both on cuda:0 otherwise.
pub fn real_gpus() -> (CudaGpu, CudaGpu) {
    let count = mmgate_inference::backend::cuda::device_count().expect("a CUDA driver");
    assert!(count > 0, "the driver sees no GPU");
    let open = |label: &str, ordinal: usize| {
        CudaBackend::new(DriverDevice::open(label, ordinal).expect("open the GPU"))
    };
    let encoder = open("encoder", if count > 1 { 1 } else { 0 });
    eprintln!("GPUs: {count}; encoder on {}", encoder.name());
    (encoder, open("llm", 0))
}

pub fn devices() -> (CpuBackend, CpuBackend) {
    (
        CpuBackend::new("encoder", 2).unwrap(),
        CpuBackend::new("llm", 2).unwrap(),
    )
}

/// Prefills the merged prompt `embeds` and compares the logits at the stored rows, then decodes
/// greedily and compares the 32 tokens. Generated tokens sit at position `len + delta` (the M-RoPE
/// offset; 0 for plain RoPE).
pub fn check_prefill_and_greedy<B: Backend>(
    llm: &Qwen2<B>,
    g: &Goldens,
    prompt: &str,
    embeds: Tensor<B>,
    positions: &[[i64; 3]],
    delta: i64,
) {
    check_prefill_and_greedy_with(llm, g, prompt, embeds, positions, delta, None);
}

/// [`check_prefill_and_greedy`] with Qwen3-VL's deepstack features added in the prefill.
pub fn check_prefill_and_greedy_with<B: Backend>(
    llm: &Qwen2<B>,
    g: &Goldens,
    prompt: &str,
    embeds: Tensor<B>,
    positions: &[[i64; 3]],
    delta: i64,
    deepstack: Option<Deepstack<'_, B>>,
) {
    let n = embeds.rows();
    let mut cache: KvCache<B> = llm.new_cache(n + GREEDY_TOKENS).unwrap();
    let hidden = llm
        .forward_batch(vec![SeqStep {
            embeds,
            positions,
            cache: &mut cache,
            deepstack,
        }])
        .unwrap()
        .pop()
        .unwrap();
    let logits = llm.logits(&hidden).unwrap().to_host().unwrap();
    let vocab = llm.config().vocab_size;
    let rows = g.i64(&format!("{prompt}.logit_rows"));
    let ours: Vec<f32> = rows
        .iter()
        .flat_map(|&r| {
            logits[r as usize * vocab..(r as usize + 1) * vocab]
                .iter()
                .copied()
        })
        .collect();
    let (shape, want) = g.f32(&format!("{prompt}.logits"));
    assert_eq!(shape, [rows.len(), vocab]);
    let err = relative_error(&ours, want);
    let max_abs = max_abs_diff(&ours, want);
    eprintln!(
        "{prompt} logits ({} rows): relative error {err:.2e} (max abs {max_abs:.2e})",
        rows.len()
    );
    assert!(
        err <= REL_TOLERANCE,
        "{prompt} logits: relative error {err}"
    );

    let (_, margins) = g.f32(&format!("{prompt}.margins"));
    let min_margin = margins.iter().fold(f32::INFINITY, |m, &v| m.min(v));
    let mut last = logits[(n - 1) * vocab..].to_vec();
    let mut generated = Vec::new();
    for _ in 0..GREEDY_TOKENS {
        let next = argmax(&last);
        generated.push(i64::from(next));
        let pos = cache.len() as i64 + delta;
        let h = llm
            .forward(llm.embed(&[next]).unwrap(), &[[pos; 3]], &mut cache)
            .unwrap();
        last = llm.logits(&h).unwrap().to_host().unwrap();
    }
    assert_eq!(
        generated,
        g.i64(&format!("{prompt}.generated")),
        "{prompt}: greedy tokens"
    );
    eprintln!(
        "{prompt}: {GREEDY_TOKENS} greedy tokens identical; smallest HF top-2 margin {min_margin:.3}, our largest logit error {max_abs:.2e}"
    );
    // Greedy agreement means something only if float noise could not have flipped a choice.
    assert!(
        max_abs * 10.0 < min_margin,
        "{prompt}: logit error too close to the greedy margins"
    );
}
