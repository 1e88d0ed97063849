//! The engine on the demo Qwen2-VL model: continuous batching gives every request exactly what it
//! would get alone; media is encoded on dedicated encoder devices and cached by content; stop
//! strings, seeds, cancellation and failures behave; and after many requests of every kind the KV
//! caches and the feature store's pins are back to zero.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

mod common;

use common::sim_device::SimDevice;
use mmgate_inference::backend::cuda::CudaBackend;
use mmgate_inference::demo::{self, DemoFamily};
use mmgate_inference::engine::{
    BatchObserver, DeviceSpec, EncodeInput, Encoder, EncoderPool, Engine, EngineConfig, Event,
    Failure, FeatureStore, FinishReason, GenerateRequest, Llm, MediaItem, PositionScheme,
    RequestHandle, SharedFeatures, Usage,
};
use mmgate_inference::models::Qwen2Vl;
use mmgate_inference::rope::{Grid, MediaSpan, mrope_positions};
use mmgate_inference::sampling::{SamplingParams, argmax};
use mmgate_inference::text::TextProcessor;
use mmgate_inference::{Backend, CpuBackend, Tensor};

type Model = Qwen2Vl<CpuBackend, CpuBackend>;

struct Setup {
    engine: Engine,
    /// Items the encoder devices have encoded.
    encoded: Arc<AtomicUsize>,
    reference: Model,
    text: Arc<TextProcessor>,
    _dir: tempfile::TempDir,
}

fn setup(cache_budget: usize) -> Setup {
    let llm_dev = CpuBackend::new("llm", 1).unwrap();
    // Two encoder devices with their own threads and their own copy of the vision tower.
    let encoder_devs = (0..2)
        .map(|i| CpuBackend::new(&format!("enc{i}"), 1).unwrap())
        .collect();
    setup_on(llm_dev, encoder_devs, cache_budget)
}

/// The engine with its LLM on `llm_dev` and an encoder device per `encoder_devs`.
fn setup_on<E: Backend, L: Backend>(
    llm_dev: L,
    encoder_devs: Vec<E>,
    cache_budget: usize,
) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let model_dir = demo::ensure(dir.path(), DemoFamily::Qwen2Vl).unwrap();
    let mut specs = Vec::new();
    let mut llm = None;
    for (i, dev) in encoder_devs.iter().enumerate() {
        let m: Qwen2Vl<E, L> = Qwen2Vl::load(&model_dir, dev, &llm_dev).unwrap();
        specs.push(DeviceSpec {
            name: format!("enc{i}"),
            encoders: vec![Arc::new(m.vision) as Arc<dyn Encoder>],
        });
        llm.get_or_insert(m.llm);
    }
    let encoded = Arc::new(AtomicUsize::new(0));
    let counter = encoded.clone();
    let observer: BatchObserver = Arc::new(move |batch| {
        counter.fetch_add(batch.items, Ordering::Relaxed);
    });
    let pool = Arc::new(EncoderPool::with_observer(specs, 4, Some(observer)).unwrap());
    let store = Arc::new(FeatureStore::new(cache_budget));
    let text = Arc::new(TextProcessor::load(&model_dir).unwrap());
    let config = EngineConfig {
        model_name: "demo".into(),
        positions: PositionScheme::MRope { merge: 2 },
        max_running: 8,
        prefill_chunk: 24,
        kv_budget_tokens: 4096,
        eos_token_ids: Vec::new(),
        deepstack_levels: 0,
    };
    let engine = Engine::start(config, llm.unwrap(), text.clone(), pool, store).unwrap();
    let ref_dev = CpuBackend::new("reference", 1).unwrap();
    let reference = Qwen2Vl::load(&model_dir, &ref_dev, &ref_dev).unwrap();
    Setup {
        engine,
        encoded,
        reference,
        text,
        _dir: dir,
    }
}

fn image(seed: u32, grid: Grid) -> Arc<EncodeInput> {
    let n = grid.patches() * 1176;
    let pixel_values: Vec<f32> = (0..n)
        .map(|i| ((i as u32 ^ seed) as f32 * 0.001).sin())
        .collect();
    Arc::new(EncodeInput::Vision {
        pixel_values: pixel_values.into(),
        grid,
    })
}

/// A chat prompt with `images` expanded to their token counts.
fn prompt(s: &Setup, words: &str, images: &[Grid]) -> Vec<u32> {
    let mut ids = s
        .text
        .encode(&format!("<|im_start|>user\n{words}"))
        .unwrap();
    let pad = s.reference.config.image_token_id;
    for g in images {
        ids.push(s.reference.config.vision_start_token_id);
        ids.extend(std::iter::repeat_n(pad, g.tokens(2)));
        ids.push(s.reference.config.vision_end_token_id);
    }
    ids.extend(
        s.text
            .encode("<|im_end|>\n<|im_start|>assistant\n")
            .unwrap(),
    );
    ids
}

fn request(
    s: &Setup,
    ids: Vec<u32>,
    images: Vec<Arc<EncodeInput>>,
    max_tokens: usize,
) -> GenerateRequest {
    let media = images
        .into_iter()
        .map(|input| {
            let tokens = match input.as_ref() {
                EncodeInput::Vision { grid, .. }
                | EncodeInput::Embeddings {
                    grid: Some(grid), ..
                } => grid.tokens(2),
                _ => unreachable!(),
            };
            MediaItem {
                input,
                placeholder: s.reference.config.image_token_id,
                tokens,
                processor_config: "{}".into(),
                time_interval: 1.0,
                share_key: None,
                part: None,
                piece: None,
            }
        })
        .collect();
    GenerateRequest {
        prompt: ids,
        media,
        sampling: SamplingParams::greedy(),
        max_tokens,
        stop: Vec::new(),
    }
}

/// Greedy tokens computed without the engine: one sequence, whole-prompt prefill.
fn solo_greedy(s: &Setup, ids: &[u32], images: &[Arc<EncodeInput>], n: usize) -> Vec<u32> {
    let m = &s.reference;
    let mut embeds = m.llm.embed(ids).unwrap();
    let mut spans = Vec::new();
    let mut features = Vec::new();
    for img in images {
        let EncodeInput::Vision { pixel_values, grid } = img.as_ref() else {
            unreachable!()
        };
        let mut values = Vec::new();
        pixel_values.extend_f32(&mut values);
        let px = Tensor::from_host(m.vision.device(), &values, &[grid.patches(), 1176]).unwrap();
        features.push(m.vision.encode(&px, &[*grid]).unwrap());
        spans.push(MediaSpan {
            token: m.config.image_token_id,
            grid: *grid,
            time_interval: 1.0,
            continues_at: None,
        });
    }
    let counts: Vec<usize> = features.iter().map(|f| f.rows()).collect();
    let map = mmgate_inference::merge::PlaceholderMap::build(ids, m.config.image_token_id, &counts)
        .unwrap();
    map.merge(&mut embeds, &features.iter().collect::<Vec<_>>())
        .unwrap();
    let (positions, delta) = mrope_positions(ids, &spans, 2).unwrap();
    let mut cache = m.llm.new_cache(ids.len() + n).unwrap();
    let h = m.llm.forward(embeds, &positions, &mut cache).unwrap();
    let mut next = argmax(
        &m.llm
            .logits(&h.slice_rows(ids.len() - 1, 1).unwrap())
            .unwrap()
            .to_host()
            .unwrap(),
    );
    let mut out = vec![next];
    while out.len() < n {
        let pos = cache.len() as i64 + delta;
        let h = m
            .llm
            .forward(m.llm.embed(&[next]).unwrap(), &[[pos; 3]], &mut cache)
            .unwrap();
        next = argmax(&m.llm.logits(&h).unwrap().to_host().unwrap());
        out.push(next);
    }
    out
}

/// Everything a request produced: token ids, text, and how it ended.
fn collect(mut h: RequestHandle) -> (Vec<u32>, String, Result<(FinishReason, Usage), Failure>) {
    let (mut ids, mut text) = (Vec::new(), String::new());
    loop {
        match h.events.blocking_recv() {
            Some(Event::Token { id, text: t }) => {
                ids.push(id);
                text.push_str(&t);
            }
            Some(Event::Done { finish, usage }) => return (ids, text, Ok((finish, usage))),
            Some(Event::Failed(msg)) => return (ids, text, Err(msg)),
            None => {
                return (ids, text, Err(Failure::Internal("channel closed".into())));
            }
        }
    }
}

fn wait_idle(engine: &Engine) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = engine.stats();
        if s.running == 0 && s.queued == 0 && engine.feature_store().stats().encoding == 0 {
            return;
        }
        assert!(Instant::now() < deadline, "engine never went idle: {s:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn batched_requests_match_their_solo_greedy_runs() {
    batched_requests_match_solo_runs(&setup(1 << 20));
}

/// The CUDA backend simulated on the CPU (kernels as NVRTC compiles them, GEMMs with cuBLAS's
/// semantics) behind the real engine: the LLM on "cuda:0", two encoder devices "cuda:1" and
/// "cuda:2" fed by the encoder pool, text-only and image requests in flight together, each
/// answered with the tokens the CPU backend's solo run gives.
#[test]
fn the_engine_on_simulated_gpus_matches_the_cpu_backend() {
    let gpu = |name: &str| CudaBackend::new(SimDevice::new(name));
    let llm = gpu("cuda:0");
    let s = setup_on(llm.clone(), vec![gpu("cuda:1"), gpu("cuda:2")], 1 << 20);
    batched_requests_match_solo_runs(&s);
    // Sequences sampling in the same step had their logits made in one product: the LM head (as
    // wide as the vocabulary) multiplied several rows at once, not one row a sequence.
    let reference = &s.reference.llm;
    let hidden = Tensor::zeros(Llm::device(reference), &[1, Llm::hidden_size(reference)]).unwrap();
    let vocab = Llm::logits(reference, &hidden).unwrap().cols();
    let record = llm.device().record.lock().unwrap();
    let most_rows = record
        .gemms
        .iter()
        .filter_map(|g| match (g.m == vocab, g.n == vocab) {
            (true, _) => Some(g.n),
            (_, true) => Some(g.m),
            _ => None,
        })
        .max();
    assert!(
        most_rows > Some(1),
        "LM head products of at most {most_rows:?} rows"
    );
}

/// The same on real GPUs (the GPU bundle's `run.sh`): LLM on cuda:0, the encoder on cuda:1 where
/// there is one.
#[test]
#[ignore = "needs an NVIDIA GPU: the GPU bundle's run.sh"]
fn the_engine_on_real_gpus_matches_the_cpu_backend() {
    let (encoder, llm) = common::real_gpus();
    let s = setup_on(llm, vec![encoder], 1 << 20);
    batched_requests_match_solo_runs(&s);
}

fn batched_requests_match_solo_runs(s: &Setup) {
    let g1 = Grid { t: 1, h: 4, w: 6 };
    let g2 = Grid { t: 1, h: 2, w: 2 };
    let cases: Vec<(Vec<u32>, Vec<Arc<EncodeInput>>)> = vec![
        (prompt(s, "Hello, how can I help you today?", &[]), vec![]),
        (
            prompt(s, "What is in this image?", &[g1]),
            vec![image(1, g1)],
        ),
        (
            prompt(s, "Describe both pictures please.", &[g2, g1]),
            vec![image(2, g2), image(3, g1)],
        ),
        (
            prompt(
                s,
                "The quick brown fox jumps over the lazy dog. A cat sat on the mat.",
                &[],
            ),
            vec![],
        ),
    ];
    // All in flight together: prefill chunks of 24 tokens interleave with other requests' decodes.
    let handles: Vec<_> = cases
        .iter()
        .map(|(ids, imgs)| {
            s.engine
                .submit(request(s, ids.clone(), imgs.clone(), 12))
                .unwrap()
        })
        .collect();
    for ((ids, imgs), h) in cases.iter().zip(handles) {
        let (tokens, _, end) = collect(h);
        let (finish, usage) = end.unwrap();
        let want = solo_greedy(s, ids, imgs, tokens.len());
        assert_eq!(tokens, want, "prompt of {} tokens", ids.len());
        assert_eq!(usage.prompt_tokens, ids.len());
        assert_eq!(usage.completion_tokens, tokens.len());
        assert!(finish == FinishReason::Length || tokens.len() < 12);
    }
    // The same image again comes from the feature store.
    let ids = prompt(s, "Again?", &[g1]);
    let (_, _, end) = collect(
        s.engine
            .submit(request(s, ids, vec![image(1, g1)], 2))
            .unwrap(),
    );
    assert_eq!(end.unwrap().1.cached_media, 1);
    wait_idle(&s.engine);
}

/// Embeddings an encoder made elsewhere (what an mmgate in front sends) are merged as they are:
/// the same tokens as the image itself, and no encoder device is used for them.
#[test]
fn precomputed_embeddings_generate_what_their_image_does() {
    let s = setup(0);
    let grid = Grid { t: 1, h: 4, w: 6 };
    let img = image(11, grid);
    let EncodeInput::Vision { pixel_values, .. } = img.as_ref() else {
        unreachable!()
    };
    let mut values = Vec::new();
    pixel_values.extend_f32(&mut values);
    let m = &s.reference;
    let px = Tensor::from_host(m.vision.device(), &values, &[grid.patches(), 1176]).unwrap();
    let features = m.vision.encode(&px, &[grid]).unwrap().to_host().unwrap();
    let embeds = Arc::new(EncodeInput::Embeddings {
        embeddings: Arc::new(features),
        grid: Some(grid),
    });
    let ids = prompt(&s, "what is this", &[grid]);
    let expected = solo_greedy(&s, &ids, &[img], 6);

    let encoded_before = s.encoded.load(Ordering::Relaxed);
    let h = s
        .engine
        .submit(request(&s, ids.clone(), vec![embeds], 6))
        .unwrap();
    let (got, _, outcome) = collect(h);
    assert!(outcome.is_ok(), "{outcome:?}");
    assert_eq!(got, expected);
    assert_eq!(s.encoded.load(Ordering::Relaxed), encoded_before);

    // Embeddings of the wrong size fail that request alone.
    let short = Arc::new(EncodeInput::Embeddings {
        embeddings: Arc::new(vec![0.0; 8]),
        grid: Some(grid),
    });
    let h = s.engine.submit(request(&s, ids, vec![short], 6)).unwrap();
    assert!(collect(h).2.is_err());
    wait_idle(&s.engine);
}

#[test]
fn stop_strings_and_seeds() {
    let s = setup(0);
    let ids = prompt(&s, "Tell me about the river and the mill.", &[]);
    let (_, text, _) = collect(
        s.engine
            .submit(request(&s, ids.clone(), vec![], 24))
            .unwrap(),
    );
    let chars: Vec<char> = text.chars().collect();
    assert!(
        chars.len() > 6,
        "demo output too short to test stops: {text:?}"
    );
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let mut req = request(&s, ids.clone(), vec![], 24);
    req.stop = vec![stop.clone()];
    let (_, stopped, end) = collect(s.engine.submit(req).unwrap());
    assert_eq!(end.unwrap().0, FinishReason::StopString(0));
    assert!(
        text.starts_with(&stopped) && !stopped.contains(&stop),
        "{stopped:?} vs {text:?} stop {stop:?}"
    );
    assert_eq!(&text[stopped.len()..stopped.len() + stop.len()], stop);

    let sampled = |seed| {
        let mut req = request(&s, ids.clone(), vec![], 16);
        req.sampling = SamplingParams {
            temperature: 1.0,
            top_p: 0.9,
            top_k: 0,
            seed: Some(seed),
        };
        collect(s.engine.submit(req).unwrap()).0
    };
    assert_eq!(sampled(11), sampled(11));
    wait_idle(&s.engine);
}

#[test]
fn nothing_leaks_across_finished_cancelled_and_failed_requests() {
    let s = setup(0);
    let g = Grid { t: 1, h: 4, w: 4 };
    let mut handles = Vec::new();
    for i in 0..24u32 {
        let ids = prompt(&s, "What is in this image?", &[g]);
        let req = match i % 4 {
            // Finishes normally.
            0 => request(&s, ids, vec![image(i, g)], 4),
            // Cancelled after its first token, or dropped unread.
            1 | 2 => request(&s, ids, vec![image(i, g)], 500),
            // Fails in the encoder: the patches do not match the grid.
            _ => request(
                &s,
                ids,
                vec![Arc::new(EncodeInput::Vision {
                    pixel_values: vec![0.0; 7].into(),
                    grid: g,
                })],
                4,
            ),
        };
        handles.push((i % 4, s.engine.submit(req).unwrap()));
    }
    // Placeholder count that matches no item: refused at admission.
    let bad = request(
        &s,
        prompt(&s, "x", &[g]),
        vec![image(99, Grid { t: 1, h: 2, w: 2 })],
        4,
    );
    let (_, _, end) = collect(s.engine.submit(bad).unwrap());
    assert!(end.is_err());
    let mut seen_cancelled = 0;
    for (kind, mut h) in handles {
        match kind {
            0 => assert!(collect(h).2.is_ok()),
            1 => {
                assert!(matches!(
                    h.events.blocking_recv(),
                    Some(Event::Token { .. })
                ));
                h.cancel();
                // The random demo model may have ended on its own first; otherwise the channel just closes.
                if collect(h).2.is_err() {
                    seen_cancelled += 1;
                }
            }
            2 => drop(h),
            _ => {
                let err = collect(h).2.unwrap_err();
                assert!(matches!(&err, Failure::Encode { item: 0, .. }), "{err}");
            }
        }
    }
    wait_idle(&s.engine);
    let stats = s.engine.stats();
    assert_eq!((stats.kv_bytes, stats.kv_reserved_tokens), (0, 0));
    assert_eq!(stats.failed, 7);
    assert_eq!(stats.completed + stats.cancelled, 18);
    assert!(
        stats.cancelled >= seen_cancelled && seen_cancelled > 0,
        "{stats:?}, {seen_cancelled} seen"
    );
    let store = s.engine.feature_store().stats();
    assert_eq!(
        (store.entries, store.pinned_bytes, store.cached_bytes),
        (0, 0, 0),
        "{store:?}"
    );
}

/// A shared feature cache as replicas would have it (here a map).
#[derive(Default)]
struct MapFeatures(std::sync::Mutex<std::collections::HashMap<[u8; 32], Vec<f32>>>);

impl SharedFeatures for MapFeatures {
    fn get(&self, key: &[u8; 32]) -> Option<(Vec<f32>, Vec<u8>)> {
        self.0
            .lock()
            .unwrap()
            .get(key)
            .map(|f| (f.clone(), Vec::new()))
    }
    fn put(&self, key: &[u8; 32], features: &[f32]) {
        self.0.lock().unwrap().insert(*key, features.to_vec());
    }
    fn put_note(&self, _key: &[u8; 32], _note: Vec<u8>) {}
}

#[test]
fn a_keyed_job_is_in_the_shared_cache_before_its_caller_hears_of_it() {
    let dir = tempfile::tempdir().unwrap();
    let model_dir = demo::ensure(dir.path(), DemoFamily::Qwen2Vl).unwrap();
    let dev = CpuBackend::new("enc", 1).unwrap();
    let m: Model = Qwen2Vl::load(&model_dir, &dev, &dev).unwrap();
    let specs = vec![DeviceSpec {
        name: "enc".into(),
        encoders: vec![Arc::new(m.vision) as Arc<dyn Encoder>],
    }];
    let shared = Arc::new(MapFeatures::default());
    let pool = EncoderPool::start(specs, 4, None, Some(shared.clone())).unwrap();
    let encode = |input: Arc<EncodeInput>, key: Option<[u8; 32]>| {
        let (tx, rx) = std::sync::mpsc::channel();
        let seen = shared.clone();
        pool.submit_shared(input, key, move |r| {
            // What another replica would find at this moment.
            let stored = key.and_then(|k| seen.get(&k)).map(|(f, _)| f);
            tx.send((r.unwrap(), stored)).unwrap();
        })
        .unwrap();
        rx.recv_timeout(Duration::from_secs(60)).unwrap()
    };
    let (features, stored) = encode(image(7, Grid { t: 1, h: 4, w: 4 }), Some([7; 32]));
    assert_eq!(stored.as_deref(), Some(&features[..]));
    // A job without a key is not shared.
    encode(image(8, Grid { t: 1, h: 4, w: 4 }), None);
    assert_eq!(shared.0.lock().unwrap().len(), 1);
}

#[test]
fn patches_embedded_a_block_at_a_time_give_the_features_of_the_whole() {
    let dir = tempfile::tempdir().unwrap();
    let model_dir = demo::ensure(dir.path(), DemoFamily::Qwen2Vl).unwrap();
    let dev = CpuBackend::new("enc", 1).unwrap();
    let m: Model = Qwen2Vl::load(&model_dir, &dev, &dev).unwrap();
    // More patches than one block holds (1 Mi values), in three items of one batch, one ending
    // mid-block.
    let patch_len = m.vision.config().patch_len();
    let big = Grid { t: 1, h: 40, w: 32 };
    assert!(big.patches() * patch_len > 1 << 20);
    let small = Grid { t: 1, h: 4, w: 6 };
    let video = Grid { t: 2, h: 14, w: 26 };
    let inputs = [image(3, big), image(5, small), image(9, video)];
    let batch: Vec<&EncodeInput> = inputs.iter().map(AsRef::as_ref).collect();
    let blockwise = Encoder::encode(&m.vision, &batch);
    let mut pixels = Vec::new();
    for input in &inputs {
        let EncodeInput::Vision { pixel_values, .. } = input.as_ref() else {
            unreachable!()
        };
        pixel_values.extend_f32(&mut pixels);
    }
    let patches = big.patches() + small.patches() + video.patches();
    let whole = Tensor::from_host(&dev, &pixels, &[patches, patch_len]).unwrap();
    let whole = m
        .vision
        .encode(&whole, &[big, small, video])
        .unwrap()
        .to_host()
        .unwrap();
    let blockwise: Vec<f32> = blockwise.into_iter().flat_map(|r| r.unwrap()).collect();
    assert_eq!(blockwise.len(), whole.len());
    let worst = blockwise
        .iter()
        .zip(&whole)
        .map(|(a, b)| (a - b).abs() / b.abs().max(1e-3))
        .fold(0f32, f32::max);
    let differing = blockwise
        .iter()
        .zip(&whole)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert_eq!(
        differing,
        0,
        "block-wise embedding changed {differing} of {} features (worst relative difference {worst:e})",
        whole.len()
    );
}

/// An item that fails to encode in the middle of a batch fails alone: the items beside it get the
/// very features they get encoded on their own (the gateway's drop and error policies then apply
/// to that item and its request only).
#[test]
fn an_item_failing_mid_batch_leaves_the_others_their_own_features() {
    let dir = tempfile::tempdir().unwrap();
    let model_dir = demo::ensure(dir.path(), DemoFamily::Qwen2Vl).unwrap();
    let dev = CpuBackend::new("enc", 1).unwrap();
    let m: Model = Qwen2Vl::load(&model_dir, &dev, &dev).unwrap();
    // A 3-row grid the 2x2 merge cannot take, between two good items.
    let inputs = [
        image(3, Grid { t: 1, h: 4, w: 4 }),
        image(5, Grid { t: 1, h: 3, w: 4 }),
        image(9, Grid { t: 1, h: 4, w: 6 }),
    ];
    let batch: Vec<&EncodeInput> = inputs.iter().map(AsRef::as_ref).collect();
    let results = Encoder::encode(&m.vision, &batch);
    assert_eq!(results.len(), 3);
    let error = results[1].as_ref().err().map(ToString::to_string);
    assert!(
        error.as_deref().is_some_and(|e| e.contains("merge")),
        "{error:?}"
    );
    for i in [0, 2] {
        let alone = Encoder::encode(&m.vision, &batch[i..=i])
            .pop()
            .unwrap()
            .unwrap();
        let beside = results[i].as_ref().unwrap();
        assert!(
            alone
                .iter()
                .zip(beside)
                .all(|(a, b)| a.to_bits() == b.to_bits())
                && alone.len() == beside.len(),
            "item {i} changed beside a failing one"
        );
    }
}
