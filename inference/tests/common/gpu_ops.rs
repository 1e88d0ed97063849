//! Every operation of the CUDA backend against the CPU backend, on any device: the simulator in
//! `cuda_backend.rs`, a real GPU in `cuda_gpu.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use mmgate_inference::backend::cuda::{Arg, CudaBackend, DType, Device, LaunchDims};
use mmgate_inference::{
    Activation, AttentionMask, AttentionShape, Backend, Conv1dShape, CpuBackend, Segment,
};
use rand::{Rng, SeedableRng};

pub fn random(seed: u64, n: usize) -> Vec<f32> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.gen_range(-2.0f32..2.0)).collect()
}

/// Largest |a − b| relative to the largest |b| (the parity tests' measure).
pub fn assert_close(what: &str, ours: &[f32], want: &[f32], tolerance: f32) {
    assert_eq!(ours.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-30);
    let err = ours
        .iter()
        .zip(want)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()))
        / scale;
    assert!(
        err <= tolerance,
        "{what}: relative error {err:.3e} over {tolerance:.1e}"
    );
}

/// f32 kernels against the CPU: only summation order and libm's last bits differ.
const TOL: f32 = 2e-6;

fn up<B: Backend>(b: &B, v: &[f32]) -> B::Buffer {
    b.upload(v).unwrap()
}

fn run_linear<D: Device>(cpu: &CpuBackend, gpu: &CudaBackend<D>, bias: bool, dtype: DType) {
    let (m, k, n) = (5, 37, 19);
    let x = random(1, m * k);
    let w = random(2, n * k);
    let b = random(3, n);
    let round = |v: &[f32]| -> Vec<f32> {
        v.iter()
            .map(|&x| half::bf16::from_f32(x).to_f32())
            .collect()
    };
    // bf16: the reference multiplies the same rounded operands (inputs and weights), in f32.
    let (x_ref, w_ref) = match dtype {
        DType::F32 => (x.clone(), w.clone()),
        DType::Bf16 => (round(&x), round(&w)),
    };
    let want = cpu
        .linear(
            &up(cpu, &x_ref),
            &up(cpu, &w_ref),
            bias.then(|| up(cpu, &b)).as_ref(),
            [m, k, n],
        )
        .unwrap();
    let weight = gpu.upload_as(&w, dtype).unwrap();
    assert_eq!(gpu.bytes(&weight), n * k * dtype.size());
    let got = gpu
        .linear(
            &up(gpu, &x),
            &weight,
            bias.then(|| up(gpu, &b)).as_ref(),
            [m, k, n],
        )
        .unwrap();
    assert_close(
        &format!("linear (bias {bias}, {dtype:?})"),
        &gpu.download(&got).unwrap(),
        &cpu.download(&want).unwrap(),
        TOL,
    );
}

fn check_attention<D: Device>(
    cpu: &CpuBackend,
    gpu: &CudaBackend<D>,
    shape: AttentionShape,
    kv_capacity: usize,
) {
    let q = random(10, shape.q_rows * shape.heads * shape.head_dim);
    let k = random(11, kv_capacity * shape.kv_heads * shape.head_dim);
    let v = random(12, kv_capacity * shape.kv_heads * shape.head_dim);
    let want = cpu
        .attention(&up(cpu, &q), &up(cpu, &k), &up(cpu, &v), &shape)
        .unwrap();
    let got = gpu
        .attention(&up(gpu, &q), &up(gpu, &k), &up(gpu, &v), &shape)
        .unwrap();
    assert_close(
        &format!("attention {:?}", shape.mask),
        &gpu.download(&got).unwrap(),
        &cpu.download(&want).unwrap(),
        TOL,
    );
}

/// Runs every backend operation on `gpu` and on the CPU backend and compares them, and the u8
/// sample expansion against the contract's layout: every kernel is launched at least once.
pub fn every_op_matches_the_cpu_backend<D: Device>(gpu: &CudaBackend<D>) {
    // The f32 kernels: AMX tiles (where the CPU has them) round to bf16 halves, further from the
    // CUDA kernels' f32 than the tolerances checked here.
    let cpu = CpuBackend::new("reference", 1).unwrap().without_amx();
    let cpu = &cpu;

    for dtype in [DType::F32, DType::Bf16] {
        for bias in [false, true] {
            run_linear(cpu, gpu, bias, dtype);
        }
    }

    for dim in [7, 80, 300] {
        let rows = 3;
        let x = random(20 + dim as u64, rows * dim);
        let w = random(21, dim);
        let b = random(22, dim);
        let want = cpu.rms_norm(&up(cpu, &x), &up(cpu, &w), dim, 1e-6).unwrap();
        let got = gpu.rms_norm(&up(gpu, &x), &up(gpu, &w), dim, 1e-6).unwrap();
        assert_close(
            "rms_norm",
            &gpu.download(&got).unwrap(),
            &cpu.download(&want).unwrap(),
            TOL,
        );
        let want = cpu
            .layer_norm(&up(cpu, &x), &up(cpu, &w), &up(cpu, &b), dim, 1e-5)
            .unwrap();
        let got = gpu
            .layer_norm(&up(gpu, &x), &up(gpu, &w), &up(gpu, &b), dim, 1e-5)
            .unwrap();
        assert_close(
            "layer_norm",
            &gpu.download(&got).unwrap(),
            &cpu.download(&want).unwrap(),
            TOL,
        );
    }

    let n = 1000;
    let (a, b) = (random(30, n), random(31, n));
    let mut want = up(cpu, &a);
    cpu.add_assign(&mut want, &up(cpu, &b)).unwrap();
    let mut got = up(gpu, &a);
    gpu.add_assign(&mut got, &up(gpu, &b)).unwrap();
    assert_close(
        "add_assign",
        &gpu.download(&got).unwrap(),
        &cpu.download(&want).unwrap(),
        TOL,
    );
    for act in [
        Activation::Silu,
        Activation::Gelu,
        Activation::QuickGelu,
        Activation::GeluTanh,
    ] {
        let mut want = up(cpu, &a);
        cpu.activate(&mut want, act).unwrap();
        let mut got = up(gpu, &a);
        gpu.activate(&mut got, act).unwrap();
        assert_close(
            &format!("{act:?}"),
            &gpu.download(&got).unwrap(),
            &cpu.download(&want).unwrap(),
            TOL,
        );
        let mut want = up(cpu, &a);
        cpu.gated_activate(&mut want, &up(cpu, &b), act).unwrap();
        let mut got = up(gpu, &a);
        gpu.gated_activate(&mut got, &up(gpu, &b), act).unwrap();
        assert_close(
            &format!("gated {act:?}"),
            &gpu.download(&got).unwrap(),
            &cpu.download(&want).unwrap(),
            TOL,
        );
    }

    let (rows, heads, head_dim) = (5, 3, 16);
    let x = random(40, rows * heads * head_dim);
    let cos = random(41, rows * head_dim);
    let sin = random(42, rows * head_dim);
    let mut want = up(cpu, &x);
    cpu.rope(&mut want, &up(cpu, &cos), &up(cpu, &sin), heads, head_dim)
        .unwrap();
    let mut got = up(gpu, &x);
    gpu.rope(&mut got, &up(gpu, &cos), &up(gpu, &sin), heads, head_dim)
        .unwrap();
    assert_close(
        "rope",
        &gpu.download(&got).unwrap(),
        &cpu.download(&want).unwrap(),
        TOL,
    );

    // Causal decode against a cache with spare rows, grouped-query heads, head_dim 80 (not a
    // multiple of the warp), more than one chunk of 32 keys.
    check_attention(
        cpu,
        gpu,
        AttentionShape {
            q_rows: 3,
            kv_rows: 70,
            heads: 4,
            kv_heads: 2,
            head_dim: 80,
            scale: 80f32.powf(-0.5),
            mask: AttentionMask::Causal { first_query: 67 },
        },
        96,
    );
    // Packed segments, one of them padded (only its first rows are keys).
    check_attention(
        cpu,
        gpu,
        AttentionShape {
            q_rows: 45,
            kv_rows: 45,
            heads: 2,
            kv_heads: 2,
            head_dim: 24,
            scale: 0.2,
            mask: AttentionMask::Segments(vec![
                Segment {
                    rows: 0..40,
                    visible_keys: 33,
                },
                Segment {
                    rows: 40..45,
                    visible_keys: 5,
                },
            ]),
        },
        45,
    );

    let conv = Conv1dShape {
        segments: 2,
        len: 9,
        channels: 3,
        kernel: 3,
        stride: 2,
        padding: 1,
    };
    let x = random(50, conv.segments * conv.len * conv.channels);
    let want = cpu.im2col_1d(&up(cpu, &x), &conv).unwrap();
    let got = gpu.im2col_1d(&up(gpu, &x), &conv).unwrap();
    assert_eq!(
        gpu.download(&got).unwrap(),
        cpu.download(&want).unwrap(),
        "im2col_1d"
    );
    let x = random(51, 12 * 5);
    let want = cpu.mean_pool_rows(&up(cpu, &x), 5, 3).unwrap();
    let got = gpu.mean_pool_rows(&up(gpu, &x), 5, 3).unwrap();
    assert_close(
        "mean_pool_rows",
        &gpu.download(&got).unwrap(),
        &cpu.download(&want).unwrap(),
        TOL,
    );

    let dim = 6;
    let table = random(60, 10 * dim);
    let ids = [3u32, 0, 9, 3];
    let want = cpu.gather_rows(&up(cpu, &table), dim, &ids).unwrap();
    let got = gpu.gather_rows(&up(gpu, &table), dim, &ids).unwrap();
    assert_eq!(
        gpu.download(&got).unwrap(),
        cpu.download(&want).unwrap(),
        "gather_rows"
    );
    let bf16_table = gpu.upload_as(&table, DType::Bf16).unwrap();
    let got = gpu.gather_rows(&bf16_table, dim, &ids).unwrap();
    let rounded: Vec<f32> = cpu
        .download(&want)
        .unwrap()
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect();
    assert_eq!(gpu.download(&got).unwrap(), rounded, "gather_rows_bf16");

    let src = random(61, 2 * dim);
    let mut want = up(cpu, &table);
    cpu.scatter_rows(&mut want, dim, &[7, 2], &up(cpu, &src))
        .unwrap();
    let mut got = up(gpu, &table);
    gpu.scatter_rows(&mut got, dim, &[7, 2], &up(gpu, &src))
        .unwrap();
    assert_eq!(
        gpu.download(&got).unwrap(),
        cpu.download(&want).unwrap(),
        "scatter_rows"
    );
    cpu.write_rows(&mut want, dim, 8, &up(cpu, &src)).unwrap();
    gpu.write_rows(&mut got, dim, 8, &up(gpu, &src)).unwrap();
    assert_eq!(
        gpu.download(&got).unwrap(),
        cpu.download(&want).unwrap(),
        "write_rows"
    );
    let want = cpu.slice_rows(&want, dim, 1, 4).unwrap();
    let got = gpu.slice_rows(&got, dim, 1, 4).unwrap();
    assert_eq!(
        gpu.download(&got).unwrap(),
        cpu.download(&want).unwrap(),
        "slice_rows"
    );

    expand_samples_matches_the_contract(gpu.device());
}

/// The u8 → f32 expansion of a plugin's samples: 2 channels of runs of 3, each run standing for
/// 2 copies of itself (the host contract's `ByteSamples` layout), against the layout written out.
fn expand_samples_matches_the_contract<D: Device>(device: &D) {
    let (run, channels, repeats) = (3usize, 2usize, 2usize);
    let rows = 2;
    let samples: Vec<u8> = (0..rows * channels * run)
        .map(|i| (i * 37 % 256) as u8)
        .collect();
    let table: Vec<f32> = (0..channels * 256).map(|i| i as f32 * 0.5 - 7.0).collect();
    let mut want = Vec::new();
    for which_run in samples.chunks(run).enumerate() {
        let (r, values) = which_run;
        for _ in 0..repeats {
            for &s in values {
                want.push(table[(r % channels) * 256 + usize::from(s)]);
            }
        }
    }
    let samples_mem = device.upload(&samples).unwrap();
    let table_mem = device.upload(bytemuck::cast_slice(&table)).unwrap();
    let mut out = device.alloc_zeroed(want.len() * 4).unwrap();
    device
        .launch(
            "expand_samples",
            LaunchDims {
                grid: [2, 1, 1],
                block: [32, 1, 1],
            },
            &mut [
                Arg::In(&samples_mem),
                Arg::In(&table_mem),
                Arg::Out(&mut out),
                Arg::U64(want.len() as u64),
                Arg::U32(run as u32),
                Arg::U32(channels as u32),
                Arg::U32(repeats as u32),
            ],
        )
        .unwrap();
    let mut got = vec![0.0f32; want.len()];
    device
        .download(&out, bytemuck::cast_slice_mut(&mut got))
        .unwrap();
    assert_eq!(got, want, "expand_samples");
}
