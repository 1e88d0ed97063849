//! The CUDA backend without a GPU: every kernel, launched exactly as the backend launches it on a
//! GPU, runs on the CPU simulator of CUDA's execution model and must match the CPU backend on the
//! same inputs; every GEMM description goes through a reference with cuBLAS's semantics. Shapes are
//! small and odd on purpose (head_dim 80, rows that are not whole warps or blocks, grids of 3 blocks
//! that must loop grid-stride).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use common::gpu_ops;
use common::sim_device::SimDevice;
use mmgate_inference::backend::ByteSamplesView;
use mmgate_inference::backend::cuda::{Arg, CudaBackend, DType, Device, LaunchDims};
use mmgate_inference::demo::{self, DemoFamily};
use mmgate_inference::engine::{EncodeInput, Encoder, PixelSource, PixelValues};
use mmgate_inference::models::Qwen2Vl;
use mmgate_inference::rope::Grid;
use mmgate_inference::{AttentionMask, AttentionShape, Backend, CpuBackend, Error};

type Sim = CudaBackend<SimDevice>;

fn backends() -> (CpuBackend, Sim) {
    (
        CpuBackend::new("reference", 1).unwrap(),
        CudaBackend::new(SimDevice::new("cuda:0")),
    )
}

fn random(seed: u64, n: usize) -> Vec<f32> {
    gpu_ops::random(seed, n)
}

fn up<B: Backend>(b: &B, v: &[f32]) -> B::Buffer {
    b.upload(v).unwrap()
}

/// Runs every backend operation on both devices, then checks that every kernel of the kernels
/// crate was launched at least once (a kernel no test runs is a kernel nobody has verified).
#[test]
fn every_kernel_matches_the_cpu_backend() {
    let gpu: Sim = CudaBackend::new(SimDevice::new("cuda:0"));
    gpu_ops::every_op_matches_the_cpu_backend(&gpu);

    let record = gpu.device().record.lock().unwrap();
    let missing: Vec<&str> = mmgate_cuda_kernels::kernels()
        .filter(|k| !record.launches.contains_key(k))
        .collect();
    assert!(missing.is_empty(), "kernels no test launched: {missing:?}");
    // Each linear is one GEMM; the bf16 ones take bf16 operands and write f32.
    assert_eq!(record.gemms.len(), 4);
    assert_eq!(
        record
            .gemms
            .iter()
            .filter(|g| g.a_type == DType::Bf16)
            .count(),
        2
    );
}

#[test]
fn bad_shapes_are_errors_before_any_launch() {
    let (cpu, gpu) = backends();
    let table = up(&gpu, &random(1, 12));
    // A token id outside the table: the same input error as the CPU backend's.
    let err = gpu.gather_rows(&table, 4, &[1, 3]).unwrap_err();
    let cpu_err = cpu
        .gather_rows(&up(&cpu, &random(1, 12)), 4, &[1, 3])
        .unwrap_err();
    assert!(matches!(err, Error::Input(_)), "{err}");
    assert_eq!(err.to_string(), cpu_err.to_string());
    assert!(matches!(
        gpu.linear(&up(&gpu, &[1.0; 6]), &up(&gpu, &[1.0; 6]), None, [2, 4, 2]),
        Err(Error::Shape { .. })
    ));
    let wide = AttentionShape {
        q_rows: 1,
        kv_rows: 1,
        heads: 1,
        kv_heads: 1,
        head_dim: 512,
        scale: 1.0,
        mask: AttentionMask::Causal { first_query: 0 },
    };
    let q = up(&gpu, &[0.0; 512]);
    assert!(matches!(
        gpu.attention(&q, &q, &q, &wide),
        Err(Error::Shape { .. })
    ));
    let launched = gpu.device().record.lock().unwrap().launches.len();
    assert_eq!(launched, 0, "a refused call launched a kernel");
}

#[test]
fn the_simulator_refuses_launches_a_gpu_would_refuse() {
    let device = SimDevice::new("cuda:0");
    let mut mem = device.alloc_zeroed(4).unwrap();
    let too_many = LaunchDims {
        grid: [1, 1, 1],
        block: [2048, 1, 1],
    };
    let err = device
        .launch(
            "add_assign",
            too_many,
            &mut [Arg::U64(0), Arg::Out(&mut mem), Arg::U64(0)],
        )
        .unwrap_err();
    assert!(err.to_string().contains("1024 threads"), "{err}");
}

/// A plugin's 8-bit pixel samples, as the gateway hands them over: three channel runs per row,
/// each standing for two temporal copies of itself (a still image), and one table per channel.
#[derive(Debug)]
struct Samples {
    samples: Vec<u8>,
    table: Vec<f32>,
}

const RUN: usize = 196;

impl PixelSource for Samples {
    fn value_count(&self) -> usize {
        self.samples.len() * 2
    }
    fn bytes(&self) -> usize {
        self.samples.len()
    }
    fn feed_content(&self, feed: &mut dyn FnMut(&[u8])) {
        feed(&self.samples);
    }
    fn extend_f32(&self, out: &mut Vec<f32>) {
        let at = out.len();
        out.resize(at + self.value_count(), 0.0);
        self.write_f32(0, &mut out[at..]);
    }
    fn write_f32(&self, start: usize, out: &mut [f32]) {
        for (i, o) in out.iter_mut().enumerate() {
            let v = start + i;
            let run = v / (2 * RUN);
            let sample = self.samples[run * RUN + v % (2 * RUN) % RUN];
            *o = self.table[(run % 3) * 256 + usize::from(sample)];
        }
    }
    fn byte_samples(&self) -> Option<ByteSamplesView<'_>> {
        Some(ByteSamplesView {
            samples: &self.samples,
            table: &self.table,
            run: RUN,
            channels: 3,
            repeats: 2,
        })
    }
}

/// The vision tower on a GPU takes a plugin's 8-bit samples as they are (a quarter of the bytes
/// cross to the device) and expands them there: the same features as the CPU backend expanding
/// them on the host, for one item and for a batch of two.
#[test]
fn the_vision_encoder_expands_byte_samples_on_the_device() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = demo::ensure(tmp.path(), DemoFamily::Qwen2Vl).unwrap();
    let (cpu, gpu) = backends();
    let on_cpu = Qwen2Vl::<CpuBackend, CpuBackend>::load_vision(&dir, &cpu).unwrap();
    let on_gpu = Qwen2Vl::<Sim, Sim>::load_vision(&dir, &gpu).unwrap();
    let item = |seed: u64, grid: Grid| {
        let n = grid.patches() * 3 * RUN;
        let samples = random(seed, n)
            .iter()
            .map(|v| ((v + 2.0) * 63.0) as u8)
            .collect();
        let table = (0..3 * 256)
            .map(|i| (i % 256) as f32 / 127.5 - 1.0 + (i / 256) as f32 * 0.1)
            .collect();
        EncodeInput::Vision {
            pixel_values: PixelValues::Source(Arc::new(Samples { samples, table })),
            grid,
        }
    };
    let a = item(1, Grid { t: 1, h: 4, w: 6 });
    let b = item(2, Grid { t: 1, h: 2, w: 2 });
    for batch in [vec![&a], vec![&a, &b]] {
        let want = Encoder::encode(&on_cpu, &batch);
        let got = Encoder::encode(&on_gpu, &batch);
        for (w, g) in want.into_iter().zip(got) {
            gpu_ops::assert_close("features", &g.unwrap(), &w.unwrap(), 1e-5);
        }
    }
    let launches = gpu.device().record.lock().unwrap().launches.clone();
    assert_eq!(launches.get("expand_samples"), Some(&3), "{launches:?}");
}
