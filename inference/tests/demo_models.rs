//! The demo models load through the same code as real checkpoints, their chat templates put one
//! placeholder per media item, their tokenizer round-trips text, and greedy generation runs.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use mmgate_inference::demo::{self, DemoFamily};
use mmgate_inference::models::{Qwen2Audio, Qwen2Vl};
use mmgate_inference::sampling::argmax;
use mmgate_inference::text::{ChatMessage, ContentPart, TextProcessor};
use mmgate_inference::{CpuBackend, Tensor};

fn cpu() -> CpuBackend {
    CpuBackend::new("test", 2).unwrap()
}

#[test]
fn demo_vl_model_templates_tokenizes_and_generates() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = demo::ensure(tmp.path(), DemoFamily::Qwen2Vl).unwrap();
    // A second call reuses the written model.
    assert_eq!(demo::ensure(tmp.path(), DemoFamily::Qwen2Vl).unwrap(), dir);
    let dev = cpu();
    let model: Qwen2Vl<CpuBackend, CpuBackend> = Qwen2Vl::load(&dir, &dev, &dev).unwrap();
    let text = TextProcessor::load(&dir).unwrap();
    assert_eq!(text.vocab_size(), model.config.text.vocab_size);

    let sentence = "Hello, how can I help you today? Ünïcödé ✓";
    assert_eq!(
        text.decode(&text.encode(sentence).unwrap(), false).unwrap(),
        sentence
    );

    let messages = [ChatMessage {
        role: "user".into(),
        content: vec![
            ContentPart::Image,
            ContentPart::Text("What is in this image?".into()),
        ],
    }];
    let prompt = text.apply_chat_template(&messages, true).unwrap();
    assert_eq!(
        prompt,
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n\
         <|vision_start|><|image_pad|><|vision_end|>What is in this image?<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = text.encode(&prompt).unwrap();
    let image_pad = model.config.image_token_id;
    assert_eq!(ids.iter().filter(|&&i| i == image_pad).count(), 1);
    assert_eq!(text.token_id("<|image_pad|>"), Some(image_pad));

    // A 28x28 image: 4 patches, one merged token.
    let pixels = Tensor::from_host(&dev, &vec![0.5; 4 * 1176], &[4, 1176]).unwrap();
    let grid = mmgate_inference::rope::Grid { t: 1, h: 2, w: 2 };
    let features = model.vision.encode(&pixels, &[grid]).unwrap();
    assert_eq!(features.shape(), [1, model.config.text.hidden_size]);

    let mut embeds = model.llm.embed(&ids).unwrap();
    let map = mmgate_inference::merge::PlaceholderMap::build(&ids, image_pad, &[1]).unwrap();
    map.merge(&mut embeds, &[&features]).unwrap();
    let media = [mmgate_inference::rope::MediaSpan {
        token: image_pad,
        grid,
        time_interval: 1.0,
        continues_at: None,
    }];
    let (positions, delta) = mmgate_inference::rope::mrope_positions(&ids, &media, 2).unwrap();
    let mut cache = model.llm.new_cache(ids.len() + 8).unwrap();
    let h = model.llm.forward(embeds, &positions, &mut cache).unwrap();
    let logits = model
        .llm
        .logits(&h.slice_rows(ids.len() - 1, 1).unwrap())
        .unwrap();
    let mut next = argmax(&logits.to_host().unwrap());
    let mut stream = text.stream(true);
    let mut out = String::new();
    for _ in 0..8 {
        if let Some(delta_text) = stream.step(&text, next).unwrap() {
            out.push_str(&delta_text);
        }
        let pos = cache.len() as i64 + delta;
        let h = model
            .llm
            .forward(model.llm.embed(&[next]).unwrap(), &[[pos; 3]], &mut cache)
            .unwrap();
        next = argmax(&model.llm.logits(&h).unwrap().to_host().unwrap());
    }
    assert_eq!(cache.len(), ids.len() + 8);
}

#[test]
fn demo_audio_model_loads_and_its_template_marks_the_audio() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = demo::ensure(tmp.path(), DemoFamily::Qwen2Audio).unwrap();
    let dev = cpu();
    let model: Qwen2Audio<CpuBackend, CpuBackend> = Qwen2Audio::load(&dir, &dev, &dev).unwrap();
    let text = TextProcessor::load(&dir).unwrap();
    let messages = [ChatMessage {
        role: "user".into(),
        content: vec![
            ContentPart::Audio,
            ContentPart::Text("Transcribe the audio.".into()),
        ],
    }];
    let prompt = text.apply_chat_template(&messages, true).unwrap();
    assert!(
        prompt.contains("Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\nTranscribe the audio."),
        "{prompt}"
    );
    let ids = text.encode(&prompt).unwrap();
    assert_eq!(
        ids.iter()
            .filter(|&&i| i == model.config.audio_token_id)
            .count(),
        1
    );
    // One second (100 mel frames) → 25 embeddings.
    let features = vec![0.1f32; 128 * 3000];
    let embeds = model.audio.encode(&features, &[100]).unwrap();
    assert_eq!(
        embeds.shape(),
        [
            model.config.audio.output_len(100),
            model.config.text.hidden_size
        ]
    );
}

/// `surely_longer_than` is a lower bound: on texts long enough to be counted in many pieces (words,
/// runs of whitespace, no whitespace at all, multi-byte characters, special tokens written in the
/// text) it never says a text is longer than its real token count, and it finds a text of a
/// megabyte longer than a context of thousands.
#[test]
fn a_text_is_found_surely_longer_without_overcounting() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = demo::ensure(tmp.path(), DemoFamily::Qwen2Vl).unwrap();
    let text = TextProcessor::load(&dir).unwrap();
    let words: String = (0..12_000)
        .map(|i| format!("word{} ", i % 97))
        .collect::<String>();
    let samples = [
        words.clone(),
        words.replace(' ', "  \n\t "),
        "x".repeat(70_000),
        "Ünïcödé ✓ 漢字かな ".repeat(3_000),
        // Multi-byte characters across every cut, with no whitespace to cut before.
        "✓漢".repeat(9_000),
        "<|im_start|>user\nhello<|im_end|>\n".repeat(2_000),
    ];
    for sample in &samples {
        let exact = text.encode(sample).unwrap().len();
        assert!(
            !text.surely_longer_than(sample, exact).unwrap(),
            "overcounted a text of {} bytes and {exact} tokens",
            sample.len()
        );
        assert!(text.surely_longer_than(sample, exact / 2).unwrap());
    }
    let megabyte = words.repeat(12);
    assert!(text.surely_longer_than(&megabyte, 32_768).unwrap());
    assert!(!text.surely_longer_than("a short question", 32_768).unwrap());
}
