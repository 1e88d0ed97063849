//! Demo models: tiny Qwen2-VL-, Qwen2.5-VL-, Qwen3-VL- and Qwen2-Audio-architecture checkpoints with seeded random weights,
//! a byte-level BPE tokenizer trained here on a small built-in corpus, the families' chat templates,
//! and the processor configs the built-in plugins read, all in HF's directory layout. They let the
//! gateway and `mmgate generate` run end to end on a fresh machine with no downloads; their output
//! is, of course, gibberish. A real checkpoint directory goes through exactly the same loading code.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;
use tokenizers::models::TrainerWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use crate::error::{Error, Result};

/// Bumped whenever what [`write()`] produces changes, so cached copies are regenerated.
/// 4: Qwen2's pre-tokenizer (digits one by one), and the audio template takes `{"type": "audio"}`.
pub const DEMO_VERSION: u32 = 4;

/// Qwen2's pre-tokenizer split (its tokenizer.json): contractions, letters with one leading
/// non-letter, single digits, punctuation runs, newlines, spaces. transformers' `Qwen2Tokenizer`
/// splits with it whatever a checkpoint's tokenizer.json says, so the demo does too: `Audio 1:`
/// must be the same tokens here and in any engine that loads the demo checkpoint.
const QWEN2_PRETOKENIZE: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Special tokens of the Qwen2 chat format and its media placeholders.
pub const SPECIAL_TOKENS: [&str; 10] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|AUDIO|>",
];

/// Qwen2-VL-Instruct's chat template.
pub const QWEN2_VL_CHAT_TEMPLATE: &str = "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// Qwen3-VL-Instruct's chat template for text, images and videos (its tool-calling branches left
/// out): no default system prompt, media as `<|vision_start|><|image_pad|><|vision_end|>`.
pub const QWEN3_VL_CHAT_TEMPLATE: &str = "{%- if messages[0]['role'] == 'system' %}<|im_start|>system\n{% if messages[0]['content'] is string %}{{ messages[0]['content'] }}{% else %}{% for content in messages[0]['content'] %}{% if 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{%- endif %}{%- for message in messages %}{%- if not (loop.first and message['role'] == 'system') %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' or 'video' in content %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{%- endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}";

/// Qwen2-Audio-Instruct's chat template, which also takes `{"type": "audio"}` parts (what transformers'
/// server makes of an `input_audio` part; the original only looks for an `audio` or `audio_url` key).
pub const QWEN2_AUDIO_CHAT_TEMPLATE: &str = "{% set audio_count = namespace(value=0) %}{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}{% set audio_count.value = audio_count.value + 1 %}Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// The text the demo tokenizer's merges are learned from.
const CORPUS: &str = "\
A multimodal gateway receives chat completions with images, video and audio. Each picture is resized \
and cut into patches; each clip is sampled into frames; each recording is decoded and turned into a \
log-mel spectrogram. The encoder turns patches and spectrograms into embeddings, and the language model \
reads them in place of the placeholder tokens of the prompt. What is in this image? Describe the video. \
Transcribe the audio. The quick brown fox jumps over the lazy dog. A cat sat on the mat, and the dog \
watched the birds in the garden. It was a bright cold day in April, and the clocks were striking \
thirteen. The river runs past the old mill and under the stone bridge to the sea. Numbers: 0 1 2 3 4 5 \
6 7 8 9 10 100 1000. Colours: red, green, blue, yellow, black, white. The weather today is sunny with \
a light breeze from the west. Please answer briefly. Thank you! Hello, how can I help you today? \
I see a person standing next to a car on a street. There is music playing and someone speaking.";

/// Which demo model to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DemoFamily {
    Qwen2Vl,
    /// Qwen2.5-VL's tower: RMSNorm, gated MLP, window attention, time-scaled video positions.
    Qwen2_5Vl,
    Qwen2Audio,
    /// Qwen3-VL: patches of 16, learned position embeddings, deepstack, the Qwen3 LLM (q/k
    /// norms, interleaved M-RoPE), its own video processor config.
    Qwen3Vl,
}

impl DemoFamily {
    /// Every demo, under the name that stands for it where a model directory is expected.
    pub const SERVED: [(&'static str, DemoFamily); 4] = [
        ("demo", DemoFamily::Qwen2Vl),
        ("demo-qwen2.5-vl", DemoFamily::Qwen2_5Vl),
        ("demo-audio", DemoFamily::Qwen2Audio),
        ("demo-qwen3-vl", DemoFamily::Qwen3Vl),
    ];

    /// The demo a served name stands for, if it is one.
    pub fn served_as(name: &str) -> Option<DemoFamily> {
        Self::SERVED
            .iter()
            .find(|(served, _)| *served == name)
            .map(|&(_, family)| family)
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Qwen2Vl => "demo-qwen2-vl",
            Self::Qwen2_5Vl => "demo-qwen2.5-vl",
            Self::Qwen2Audio => "demo-qwen2-audio",
            Self::Qwen3Vl => "demo-qwen3-vl",
        }
    }
}

/// Sizes of the demo LLM (shared by both families).
const HIDDEN: usize = 128;
const INTERMEDIATE: usize = 384;
const LAYERS: usize = 4;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_owned(),
        source,
    }
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).map_err(io(path))
}

fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    let mut text =
        serde_json::to_string_pretty(value).map_err(|e| Error::Weights(e.to_string()))?;
    text.push('\n');
    write_file(path, text.as_bytes())
}

/// Trains the byte-level BPE on [`CORPUS`] and adds the special tokens.
fn build_tokenizer() -> Result<Tokenizer> {
    let err = |e: tokenizers::Error| Error::Weights(format!("building the demo tokenizer: {e}"));
    let mut tokenizer = Tokenizer::new(BPE::default());
    let split = Split::new(
        SplitPattern::Regex(QWEN2_PRETOKENIZE.into()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(err)?;
    tokenizer.with_pre_tokenizer(Some(Sequence::new(vec![
        split.into(),
        ByteLevel::new(false, false, false).into(),
    ])));
    tokenizer.with_decoder(Some(ByteLevel::new(false, true, true)));
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(768)
        .min_frequency(2)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    tokenizer
        .train(&mut trainer, CORPUS.split(". "))
        .map_err(err)?;
    let specials: Vec<AddedToken> = SPECIAL_TOKENS
        .iter()
        .map(|t| AddedToken::from(*t, true))
        .collect();
    tokenizer.add_special_tokens(&specials);
    Ok(tokenizer)
}

/// Seeded weights: N(0, 1/fan_in) for matrices, ones (plus noise) for norms, small biases.
struct WeightMaker {
    rng: ChaCha8Rng,
    tensors: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
}

impl WeightMaker {
    fn normal(&mut self) -> f32 {
        // Box–Muller; u1 in (0, 1] so the log is finite.
        let u1: f32 = 1.0 - self.rng.r#gen::<f32>();
        let u2: f32 = self.rng.r#gen::<f32>();
        (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
    }

    fn add(&mut self, name: String, shape: &[usize], kind: Init) {
        let n: usize = shape.iter().product();
        let fan_in: usize = shape[1..].iter().product::<usize>().max(1);
        let data = (0..n)
            .map(|_| match kind {
                Init::Matrix => self.normal() / (fan_in as f32).sqrt(),
                Init::Norm => 1.0 + 0.05 * self.normal(),
                Init::Bias => 0.02 * self.normal(),
                Init::Embedding => self.normal(),
            })
            .collect();
        self.tensors.insert(name, (shape.to_vec(), data));
    }

    fn linear(&mut self, name: &str, out: usize, inp: usize, bias: bool) {
        self.add(format!("{name}.weight"), &[out, inp], Init::Matrix);
        if bias {
            self.add(format!("{name}.bias"), &[out], Init::Bias);
        }
    }

    fn layer_norm(&mut self, name: &str, dim: usize) {
        self.add(format!("{name}.weight"), &[dim], Init::Norm);
        self.add(format!("{name}.bias"), &[dim], Init::Bias);
    }

    fn rms_norm(&mut self, name: &str, dim: usize) {
        self.add(format!("{name}.weight"), &[dim], Init::Norm);
    }

    fn write(self, path: &Path) -> Result<()> {
        let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = self
            .tensors
            .into_iter()
            .map(|(name, (shape, data))| {
                (
                    name,
                    shape,
                    data.iter().flat_map(|v| v.to_le_bytes()).collect(),
                )
            })
            .collect();
        let views = bytes
            .iter()
            .map(|(name, shape, data)| {
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data)
                    .map(|v| (name.clone(), v))
                    .map_err(|e| Error::Weights(e.to_string()))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut metadata = std::collections::HashMap::new();
        metadata.insert("format".to_owned(), "pt".to_owned());
        let out = safetensors::serialize(views, Some(metadata))
            .map_err(|e| Error::Weights(e.to_string()))?;
        write_file(path, &out)
    }
}

#[derive(Clone, Copy)]
enum Init {
    Matrix,
    Norm,
    Bias,
    Embedding,
}

/// The Qwen2 LLM's weights; `qwen3`: Qwen3's (no q/k/v biases, RMSNorm over each head's q and k).
fn llm_weights(w: &mut WeightMaker, vocab: usize, qwen3: bool) {
    let p = "model.language_model.";
    w.add(
        format!("{p}embed_tokens.weight"),
        &[vocab, HIDDEN],
        Init::Embedding,
    );
    let head_dim = HIDDEN / HEADS;
    for i in 0..LAYERS {
        let l = format!("{p}layers.{i}.");
        w.add(format!("{l}input_layernorm.weight"), &[HIDDEN], Init::Norm);
        w.linear(
            &format!("{l}self_attn.q_proj"),
            HEADS * head_dim,
            HIDDEN,
            !qwen3,
        );
        w.linear(
            &format!("{l}self_attn.k_proj"),
            KV_HEADS * head_dim,
            HIDDEN,
            !qwen3,
        );
        w.linear(
            &format!("{l}self_attn.v_proj"),
            KV_HEADS * head_dim,
            HIDDEN,
            !qwen3,
        );
        if qwen3 {
            w.rms_norm(&format!("{l}self_attn.q_norm"), head_dim);
            w.rms_norm(&format!("{l}self_attn.k_norm"), head_dim);
        }
        w.linear(
            &format!("{l}self_attn.o_proj"),
            HIDDEN,
            HEADS * head_dim,
            false,
        );
        w.add(
            format!("{l}post_attention_layernorm.weight"),
            &[HIDDEN],
            Init::Norm,
        );
        w.linear(&format!("{l}mlp.gate_proj"), INTERMEDIATE, HIDDEN, false);
        w.linear(&format!("{l}mlp.up_proj"), INTERMEDIATE, HIDDEN, false);
        w.linear(&format!("{l}mlp.down_proj"), HIDDEN, INTERMEDIATE, false);
    }
    w.add(format!("{p}norm.weight"), &[HIDDEN], Init::Norm);
    // An output head of its own: tied to random embeddings, the model just repeats its last token.
    w.linear("lm_head", vocab, HIDDEN, false);
}

fn text_config(vocab: usize, eos: u32, rope: serde_json::Value) -> serde_json::Value {
    json!({
        "vocab_size": vocab,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_parameters": rope,
        "eos_token_id": eos,
        "tie_word_embeddings": false,
    })
}

/// Writes the demo model of `family` into `dir` (created if missing), seeded by `seed`.
pub fn write(dir: &Path, family: DemoFamily, seed: u64) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let tokenizer = build_tokenizer()?;
    let vocab = tokenizer.get_vocab_size(true);
    let id = |t: &str| {
        tokenizer
            .token_to_id(t)
            .ok_or_else(|| Error::Weights(format!("demo tokenizer lacks {t}")))
    };
    let eos = id("<|im_end|>")?;
    let mut weights = WeightMaker {
        rng: ChaCha8Rng::seed_from_u64(seed),
        tensors: BTreeMap::new(),
    };
    llm_weights(&mut weights, vocab, family == DemoFamily::Qwen3Vl);
    let mut extra_files = Vec::new();
    let (config, chat_template, preprocessor) = match family {
        DemoFamily::Qwen2Vl | DemoFamily::Qwen2_5Vl => {
            let qwen2_5 = family == DemoFamily::Qwen2_5Vl;
            let (embed, heads, depth, mlp) = (64, 4, 2, 128);
            let v = "model.visual.";
            weights.add(
                format!("{v}patch_embed.proj.weight"),
                &[embed, 3, 2, 14, 14],
                Init::Matrix,
            );
            for i in 0..depth {
                let b = format!("{v}blocks.{i}.");
                for norm in ["norm1", "norm2"] {
                    if qwen2_5 {
                        weights.rms_norm(&format!("{b}{norm}"), embed);
                    } else {
                        weights.layer_norm(&format!("{b}{norm}"), embed);
                    }
                }
                weights.linear(&format!("{b}attn.qkv"), 3 * embed, embed, true);
                weights.linear(&format!("{b}attn.proj"), embed, embed, true);
                if qwen2_5 {
                    weights.linear(&format!("{b}mlp.gate_proj"), mlp, embed, true);
                    weights.linear(&format!("{b}mlp.up_proj"), mlp, embed, true);
                    weights.linear(&format!("{b}mlp.down_proj"), embed, mlp, true);
                } else {
                    weights.linear(&format!("{b}mlp.fc1"), mlp, embed, true);
                    weights.linear(&format!("{b}mlp.fc2"), embed, mlp, true);
                }
            }
            if qwen2_5 {
                weights.rms_norm(&format!("{v}merger.ln_q"), embed);
            } else {
                weights.layer_norm(&format!("{v}merger.ln_q"), embed);
            }
            weights.linear(&format!("{v}merger.mlp.0"), 4 * embed, 4 * embed, true);
            weights.linear(&format!("{v}merger.mlp.2"), HIDDEN, 4 * embed, true);
            let common = json!({
                "num_heads": heads, "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2,
                "temporal_patch_size": 2, "depth": depth,
            });
            let (architecture, model_type, specific) = if qwen2_5 {
                // Windows of 2x2 merged patches (56 px) in block 0; block 1 sees the whole frame.
                let vision = json!({
                    "hidden_size": embed, "out_hidden_size": HIDDEN, "intermediate_size": mlp,
                    "hidden_act": "silu", "window_size": 56, "fullatt_block_indexes": [1],
                    "tokens_per_second": 2,
                });
                ("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", vision)
            } else {
                let vision = json!({
                    "embed_dim": embed, "hidden_size": HIDDEN,
                    // transformers 5 wants an integer ratio.
                    "mlp_ratio": mlp / embed, "hidden_act": "quick_gelu",
                });
                ("Qwen2VLForConditionalGeneration", "qwen2_vl", vision)
            };
            let mut vision_config = common;
            if let (Some(all), Some(extra)) = (vision_config.as_object_mut(), specific.as_object())
            {
                all.extend(extra.clone());
            }
            let config = json!({
                "architectures": [architecture],
                "model_type": model_type,
                "text_config": text_config(vocab, eos, json!({
                    "rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]
                })),
                "vision_config": vision_config,
                "image_token_id": id("<|image_pad|>")?,
                "video_token_id": id("<|video_pad|>")?,
                "vision_start_token_id": id("<|vision_start|>")?,
                "vision_end_token_id": id("<|vision_end|>")?,
                "tie_word_embeddings": false,
            });
            // At most 256 tokens per image keeps the demo quick.
            let preprocessor = json!({
                "image_processor_type": "Qwen2VLImageProcessor",
                "min_pixels": 3136, "max_pixels": 256 * 28 * 28,
                "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
                "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711],
            });
            (config, QWEN2_VL_CHAT_TEMPLATE, preprocessor)
        }
        DemoFamily::Qwen3Vl => {
            let (embed, heads, depth, mlp, side) = (64, 4, 2, 128, 16);
            let merged = 4 * embed;
            let v = "model.visual.";
            weights.add(
                format!("{v}patch_embed.proj.weight"),
                &[embed, 3, 2, 16, 16],
                Init::Matrix,
            );
            weights.add(format!("{v}patch_embed.proj.bias"), &[embed], Init::Bias);
            weights.add(
                format!("{v}pos_embed.weight"),
                &[side * side, embed],
                Init::Embedding,
            );
            for i in 0..depth {
                let b = format!("{v}blocks.{i}.");
                weights.layer_norm(&format!("{b}norm1"), embed);
                weights.layer_norm(&format!("{b}norm2"), embed);
                weights.linear(&format!("{b}attn.qkv"), 3 * embed, embed, true);
                weights.linear(&format!("{b}attn.proj"), embed, embed, true);
                weights.linear(&format!("{b}mlp.linear_fc1"), mlp, embed, true);
                weights.linear(&format!("{b}mlp.linear_fc2"), embed, mlp, true);
            }
            weights.layer_norm(&format!("{v}merger.norm"), embed);
            weights.linear(&format!("{v}merger.linear_fc1"), merged, merged, true);
            weights.linear(&format!("{v}merger.linear_fc2"), HIDDEN, merged, true);
            // A deepstack tap after each block.
            for j in 0..depth {
                let m = format!("{v}deepstack_merger_list.{j}.");
                weights.layer_norm(&format!("{m}norm"), merged);
                weights.linear(&format!("{m}linear_fc1"), merged, merged, true);
                weights.linear(&format!("{m}linear_fc2"), HIDDEN, merged, true);
            }
            let mut text = text_config(
                vocab,
                eos,
                json!({
                    "rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [6, 5, 5],
                    "mrope_interleaved": true,
                }),
            );
            text["head_dim"] = json!(HIDDEN / HEADS);
            text["attention_bias"] = json!(false);
            let config = json!({
                "architectures": ["Qwen3VLForConditionalGeneration"],
                "model_type": "qwen3_vl",
                "text_config": text,
                "vision_config": {
                    "depth": depth, "hidden_size": embed, "num_heads": heads, "intermediate_size": mlp,
                    "out_hidden_size": HIDDEN, "in_channels": 3, "patch_size": 16,
                    "temporal_patch_size": 2, "spatial_merge_size": 2, "hidden_act": "gelu_pytorch_tanh",
                    "num_position_embeddings": side * side, "deepstack_visual_indexes": [0, 1],
                },
                "image_token_id": id("<|image_pad|>")?,
                "video_token_id": id("<|video_pad|>")?,
                "vision_start_token_id": id("<|vision_start|>")?,
                "vision_end_token_id": id("<|vision_end|>")?,
                "tie_word_embeddings": false,
            });
            // At most 256 tokens per image, and 1 024 for a video's frames together, keep the
            // demo quick.
            let preprocessor = json!({
                "image_processor_type": "Qwen2VLImageProcessorFast",
                "size": {"shortest_edge": 4096, "longest_edge": 256 * 32 * 32},
                "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
                "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
            });
            extra_files.push((
                "video_preprocessor_config.json",
                json!({
                    "video_processor_type": "Qwen3VLVideoProcessor",
                    "size": {"shortest_edge": 4096, "longest_edge": 2 * 1024 * 32 * 32},
                    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
                    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                    "fps": 2, "min_frames": 4, "max_frames": 768,
                }),
            ));
            (config, QWEN3_VL_CHAT_TEMPLATE, preprocessor)
        }
        DemoFamily::Qwen2Audio => {
            let (d, heads, layers, ffn, mel) = (64, 4, 2, 128, 128);
            let a = "model.audio_tower.";
            weights.add(format!("{a}conv1.weight"), &[d, mel, 3], Init::Matrix);
            weights.add(format!("{a}conv1.bias"), &[d], Init::Bias);
            weights.add(format!("{a}conv2.weight"), &[d, d, 3], Init::Matrix);
            weights.add(format!("{a}conv2.bias"), &[d], Init::Bias);
            weights.add(
                format!("{a}embed_positions.weight"),
                &[1500, d],
                Init::Embedding,
            );
            for i in 0..layers {
                let l = format!("{a}layers.{i}.");
                weights.layer_norm(&format!("{l}self_attn_layer_norm"), d);
                weights.linear(&format!("{l}self_attn.q_proj"), d, d, true);
                weights.linear(&format!("{l}self_attn.k_proj"), d, d, false);
                weights.linear(&format!("{l}self_attn.v_proj"), d, d, true);
                weights.linear(&format!("{l}self_attn.out_proj"), d, d, true);
                weights.layer_norm(&format!("{l}final_layer_norm"), d);
                weights.linear(&format!("{l}fc1"), ffn, d, true);
                weights.linear(&format!("{l}fc2"), d, ffn, true);
            }
            weights.layer_norm(&format!("{a}layer_norm"), d);
            weights.linear("model.multi_modal_projector.linear", HIDDEN, d, true);
            let mut text = text_config(
                vocab,
                eos,
                json!({"rope_type": "default", "rope_theta": 10000.0}),
            );
            text["model_type"] = json!("qwen2");
            let config = json!({
                "architectures": ["Qwen2AudioForConditionalGeneration"],
                "model_type": "qwen2_audio",
                "text_config": text,
                "audio_config": {
                    "model_type": "qwen2_audio_encoder", "num_mel_bins": mel, "encoder_layers": layers,
                    "encoder_attention_heads": heads, "encoder_ffn_dim": ffn, "d_model": d,
                    "max_source_positions": 1500, "activation_function": "gelu",
                },
                "audio_token_index": id("<|AUDIO|>")?,
                "tie_word_embeddings": false,
            });
            let preprocessor = json!({
                "feature_extractor_type": "WhisperFeatureExtractor", "processor_class": "Qwen2AudioProcessor",
                "feature_size": mel, "sampling_rate": 16000, "hop_length": 160, "n_fft": 400,
                "chunk_length": 30, "n_samples": 480000, "nb_max_frames": 3000,
                "padding_side": "right", "padding_value": 0.0, "return_attention_mask": false, "dither": 0.0,
            });
            (config, QWEN2_AUDIO_CHAT_TEMPLATE, preprocessor)
        }
    };
    weights.write(&dir.join("model.safetensors"))?;
    write_json(&dir.join("config.json"), &config)?;
    write_json(&dir.join("preprocessor_config.json"), &preprocessor)?;
    for (name, value) in &extra_files {
        write_json(&dir.join(name), value)?;
    }
    write_json(
        &dir.join("generation_config.json"),
        &json!({"eos_token_id": [eos], "pad_token_id": id("<|endoftext|>")?}),
    )?;
    write_json(
        &dir.join("tokenizer_config.json"),
        &json!({
            "chat_template": chat_template,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "bos_token": null,
            "model_max_length": 32768,
        }),
    )?;
    let tokenizer_path = dir.join("tokenizer.json");
    tokenizer
        .save(&tokenizer_path, false)
        .map_err(|e| Error::Weights(format!("{}: {e}", tokenizer_path.display())))?;
    write_file(
        &dir.join("README.md"),
        format!(
            "# {} (mmgate demo model, version {DEMO_VERSION})\n\nRandom weights (seed {seed}) in the \
             architecture of its family, a byte-level BPE tokenizer and the family's chat template. It \
             exercises the whole serving path; what it generates is meaningless.\n",
            family.name()
        )
        .as_bytes(),
    )
}

/// Whether `name` stands for a demo model where a model directory is expected.
pub fn is_served_name(name: &str) -> bool {
    DemoFamily::served_as(name).is_some()
}

/// The demo model `name` stands for (see [`DemoFamily::SERVED`]), under `cache_dir` (see
/// [`ensure`]); `None` when `name` is no demo's.
pub fn ensure_served(cache_dir: &Path, name: &str) -> Option<Result<PathBuf>> {
    DemoFamily::served_as(name).map(|family| ensure(cache_dir, family))
}

/// The demo model of `family` under `cache_dir`, written there first if missing or outdated. Written
/// into a temporary sibling and renamed, so concurrent starts never see half a model.
pub fn ensure(cache_dir: &Path, family: DemoFamily) -> Result<PathBuf> {
    let dir = cache_dir.join(format!("{}-v{DEMO_VERSION}", family.name()));
    if dir.join("README.md").is_file() {
        return Ok(dir);
    }
    std::fs::create_dir_all(cache_dir).map_err(io(cache_dir))?;
    let tmp = cache_dir.join(format!(".{}-{}", family.name(), std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    write(&tmp, family, 0x6d6d_6761_7465)?;
    match std::fs::rename(&tmp, &dir) {
        Ok(()) => Ok(dir),
        // Another process finished first: use its copy.
        Err(_) if dir.join("README.md").is_file() => {
            let _ = std::fs::remove_dir_all(&tmp);
            Ok(dir)
        }
        Err(e) => Err(io(&dir)(e)),
    }
}
