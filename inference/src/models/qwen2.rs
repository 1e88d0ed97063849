//! The Qwen2 decoder-only LLM (RMSNorm, grouped-query attention with q/k/v biases, RoPE or M-RoPE,
//! SwiGLU MLP) and its KV cache; also Qwen3's (no q/k/v biases, an RMSNorm over each head of q and
//! k, interleaved M-RoPE, and Qwen3-VL's deepstack: vision features added to the hidden states of
//! the image tokens after each of the first layers). Which of them a checkpoint is, its tensors
//! and config say. It takes input embeddings rather than token ids so that encoder outputs can be
//! merged in before the prefill. It is what the engine runs: it implements [`Llm`].

use crate::backend::{AttentionMask, AttentionShape, Backend, KvLayout};
use crate::engine::llm::{Llm, SeqCache};
use crate::error::{Error, Result};
use crate::models::config::TextConfig;
use crate::rope;
use crate::tensor::{KvLayer, Tensor};
use crate::weights::Weights;

// The step types are the engine's (its `Llm` trait takes them); direct callers of `forward_batch`
// find them here too.
pub use crate::engine::llm::{Deepstack, SeqStep};

struct DecoderLayer<B: Backend> {
    input_norm: Tensor<B>,
    q: Tensor<B>,
    q_bias: Option<Tensor<B>>,
    k: Tensor<B>,
    k_bias: Option<Tensor<B>>,
    v: Tensor<B>,
    v_bias: Option<Tensor<B>>,
    /// Qwen3: RMSNorm over each head of q and k, before the rotary embedding.
    q_norm: Option<Tensor<B>>,
    k_norm: Option<Tensor<B>>,
    o: Tensor<B>,
    post_attention_norm: Tensor<B>,
    gate: Tensor<B>,
    up: Tensor<B>,
    down: Tensor<B>,
}

pub struct Qwen2<B: Backend> {
    config: TextConfig,
    embed_tokens: Tensor<B>,
    layers: Vec<DecoderLayer<B>>,
    norm: Tensor<B>,
    /// `None` when the output head is tied to the embedding table.
    lm_head: Option<Tensor<B>>,
    inv_freq: Vec<f32>,
    /// Which position component turns each rotary frequency.
    rope_components: Vec<usize>,
    device: B,
}

/// Keys and values of every layer for one sequence, room for `capacity` rows each, the first `len`
/// filled.
pub struct KvCache<B: Backend> {
    layers: Vec<KvLayer<B>>,
    len: usize,
    capacity: usize,
}

impl<B: Backend> KvCache<B> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Device bytes held (whatever is filled).
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(KvLayer::bytes).sum()
    }
}

impl<B: Backend> Qwen2<B> {
    /// Takes the LLM's weights from `weights` (names under `prefix`, e.g. `model.language_model.`;
    /// the output head is `lm_head.weight` unless tied) and places them on `device`.
    pub fn load(
        config: TextConfig,
        weights: &mut Weights,
        prefix: &str,
        device: &B,
    ) -> Result<Self> {
        let c = &config;
        // Every head is turned whole here; a checkpoint that turns part of each (Qwen3.5's LLM)
        // is planned for an engine, never run.
        if c.rotary_dim != c.head_dim {
            return Err(Error::Weights(format!(
                "a rotary embedding over {} of each head's {} dimensions is not supported",
                c.rotary_dim, c.head_dim
            )));
        }
        let (h, q_out, kv_out) = (c.hidden_size, c.heads * c.head_dim, c.kv_heads * c.head_dim);
        // Matrices keep the checkpoint's precision; norms and biases are f32.
        let take = |weights: &mut Weights, name: &str, shape: &[usize]| {
            let name = format!("{prefix}{name}");
            if shape.len() == 2 {
                weights.take_weight(device, &name, shape)
            } else {
                weights.take(device, &name, shape)
            }
        };
        let embed_tokens = take(weights, "embed_tokens.weight", &[c.vocab_size, h])?;
        let mut layers = Vec::with_capacity(c.layers);
        for i in 0..c.layers {
            // Qwen2 has q/k/v biases, Qwen3 q/k norms instead: the checkpoint says which.
            let attn = format!("{prefix}layers.{i}.self_attn.");
            let has = |name: &str| weights.contains(&format!("{attn}{name}"));
            let (biases, norms) = (has("q_proj.bias"), has("q_norm.weight"));
            let mut t =
                |name: &str, shape: &[usize]| take(weights, &format!("layers.{i}.{name}"), shape);
            let mut optional = |present: bool, name: &str, shape: &[usize]| {
                present
                    .then(|| t(&format!("self_attn.{name}"), shape))
                    .transpose()
            };
            let (q_bias, k_bias, v_bias) = (
                optional(biases, "q_proj.bias", &[q_out])?,
                optional(biases, "k_proj.bias", &[kv_out])?,
                optional(biases, "v_proj.bias", &[kv_out])?,
            );
            let (q_norm, k_norm) = (
                optional(norms, "q_norm.weight", &[c.head_dim])?,
                optional(norms, "k_norm.weight", &[c.head_dim])?,
            );
            layers.push(DecoderLayer {
                input_norm: t("input_layernorm.weight", &[h])?,
                q: t("self_attn.q_proj.weight", &[q_out, h])?,
                q_bias,
                k: t("self_attn.k_proj.weight", &[kv_out, h])?,
                k_bias,
                v: t("self_attn.v_proj.weight", &[kv_out, h])?,
                v_bias,
                q_norm,
                k_norm,
                o: t("self_attn.o_proj.weight", &[h, q_out])?,
                post_attention_norm: t("post_attention_layernorm.weight", &[h])?,
                gate: t("mlp.gate_proj.weight", &[c.intermediate_size, h])?,
                up: t("mlp.up_proj.weight", &[c.intermediate_size, h])?,
                down: t("mlp.down_proj.weight", &[h, c.intermediate_size])?,
            });
        }
        let norm = take(weights, "norm.weight", &[h])?;
        let lm_head = if c.tie_word_embeddings && !weights.contains("lm_head.weight") {
            None
        } else {
            Some(weights.take_weight(device, "lm_head.weight", &[c.vocab_size, h])?)
        };
        let inv_freq = rope::inv_freq(c.head_dim, c.rope_theta);
        let rope_components = rope::frequency_components(
            inv_freq.len(),
            c.mrope_section.as_deref(),
            c.mrope_interleaved,
        )?;
        Ok(Self {
            rope_components,
            config,
            embed_tokens,
            layers,
            norm,
            lm_head,
            inv_freq,
            device: device.clone(),
        })
    }

    pub fn config(&self) -> &TextConfig {
        &self.config
    }

    /// Bytes of device memory the weights hold.
    pub fn weight_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                [
                    Some(&l.input_norm),
                    Some(&l.q),
                    l.q_bias.as_ref(),
                    Some(&l.k),
                    l.k_bias.as_ref(),
                    Some(&l.v),
                    l.v_bias.as_ref(),
                    l.q_norm.as_ref(),
                    l.k_norm.as_ref(),
                    Some(&l.o),
                    Some(&l.post_attention_norm),
                    Some(&l.gate),
                    Some(&l.up),
                    Some(&l.down),
                ]
                .iter()
                .flatten()
                .map(|t| t.bytes())
                .sum::<usize>()
            })
            .sum();
        self.embed_tokens.bytes()
            + layers
            + self.norm.bytes()
            + self.lm_head.as_ref().map_or(0, |t| t.bytes())
    }

    pub fn device(&self) -> &B {
        &self.device
    }

    /// A KV cache for a sequence of up to `capacity` tokens.
    pub fn new_cache(&self, capacity: usize) -> Result<KvCache<B>> {
        let layout = KvLayout {
            capacity,
            kv_heads: self.config.kv_heads,
            head_dim: self.config.head_dim,
        };
        let layers = self
            .layers
            .iter()
            .map(|_| KvLayer::new(&self.device, layout))
            .collect::<Result<_>>()?;
        Ok(KvCache {
            layers,
            len: 0,
            capacity,
        })
    }

    /// Input embeddings `[ids, hidden]` for token ids.
    pub fn embed(&self, ids: &[u32]) -> Result<Tensor<B>> {
        self.embed_tokens.gather_rows(ids)
    }

    /// Runs `embeds` (`[n, hidden]`, the next `n` tokens of the sequence) through the decoder,
    /// appending their keys and values to `cache`; returns the final-norm hidden states `[n, hidden]`.
    /// `positions` are the tokens' rotary positions (all three components equal for plain text).
    pub fn forward(
        &self,
        embeds: Tensor<B>,
        positions: &[[i64; 3]],
        cache: &mut KvCache<B>,
    ) -> Result<Tensor<B>> {
        let mut out = self.forward_batch(vec![SeqStep {
            embeds,
            positions,
            cache,
            deepstack: None,
        }])?;
        out.pop()
            .ok_or_else(|| Error::shape("qwen2 forward", "no output"))
    }

    /// One step of several sequences at once (continuous batching): their rows go through every
    /// linear layer together, while each attends only to its own KV cache. Returns each sequence's
    /// final-norm hidden states, in order.
    pub fn forward_batch(&self, steps: Vec<SeqStep<'_, B, KvCache<B>>>) -> Result<Vec<Tensor<B>>> {
        let c = &self.config;
        let mut offsets = Vec::with_capacity(steps.len());
        let mut total = 0;
        for s in &steps {
            let n = s.embeds.rows();
            if s.embeds.shape() != [n, c.hidden_size] || s.positions.len() != n {
                return Err(Error::shape(
                    "qwen2 forward",
                    format!(
                        "embeddings {:?} with {} positions",
                        s.embeds.shape(),
                        s.positions.len()
                    ),
                ));
            }
            if s.cache.len + n > s.cache.capacity || s.cache.layers.len() != self.layers.len() {
                return Err(Error::Input(format!(
                    "{n} tokens do not fit the KV cache ({} of {} used)",
                    s.cache.len, s.cache.capacity
                )));
            }
            offsets.push(total);
            total += n;
        }
        let mut x = Tensor::zeros(&self.device, &[total, c.hidden_size])?;
        let mut positions = Vec::with_capacity(total);
        let mut seqs = Vec::with_capacity(steps.len());
        let mut deepstacks = Vec::new();
        for (s, &at) in steps.into_iter().zip(&offsets) {
            x.write_rows(at, &s.embeds)?;
            positions.extend_from_slice(s.positions);
            if let Some(d) = s.deepstack {
                let n = s.embeds.rows() as u32;
                if d.rows.iter().any(|&r| r >= n) {
                    return Err(Error::shape("deepstack", "a row past the step's tokens"));
                }
                let rows: Vec<u32> = d.rows.iter().map(|&r| r + at as u32).collect();
                deepstacks.push((rows, d.features));
            }
            seqs.push((at, s.embeds.rows(), s.cache));
        }
        let (cos, sin) = rope::tables(&positions, &self.inv_freq, &self.rope_components)?;
        let cos = Tensor::from_host(&self.device, &cos, &[total, c.head_dim])?;
        let sin = Tensor::from_host(&self.device, &sin, &[total, c.head_dim])?;
        let q_width = c.heads * c.head_dim;
        for (i, layer) in self.layers.iter().enumerate() {
            let h = x.rms_norm(&layer.input_norm, c.rms_norm_eps)?;
            let head_norm = |t: Tensor<B>, norm: &Option<Tensor<B>>| -> Result<Tensor<B>> {
                let Some(norm) = norm else { return Ok(t) };
                let shape = t.shape().to_vec();
                let heads = t.len() / c.head_dim;
                let per_head = t.reshape(&[heads, c.head_dim])?;
                per_head.rms_norm(norm, c.rms_norm_eps)?.reshape(&shape)
            };
            let q = head_norm(h.linear(&layer.q, layer.q_bias.as_ref())?, &layer.q_norm)?
                .rope(&cos, &sin, c.head_dim)?;
            let k = head_norm(h.linear(&layer.k, layer.k_bias.as_ref())?, &layer.k_norm)?
                .rope(&cos, &sin, c.head_dim)?;
            let v = h.linear(&layer.v, layer.v_bias.as_ref())?;
            let mut attn = Tensor::zeros(&self.device, &[total, q_width])?;
            for (at, n, cache) in seqs.iter_mut() {
                let (at, n) = (*at, *n);
                let len = cache.len;
                cache.layers[i].write(len, &k.slice_rows(at, n)?, &v.slice_rows(at, n)?)?;
                let shape = AttentionShape {
                    q_rows: n,
                    kv_rows: cache.len + n,
                    heads: c.heads,
                    kv_heads: c.kv_heads,
                    head_dim: c.head_dim,
                    scale: 1.0 / (c.head_dim as f32).sqrt(),
                    mask: AttentionMask::Causal {
                        first_query: cache.len,
                    },
                };
                let q_seq = q.slice_rows(at, n)?;
                attn.write_rows(at, &q_seq.attention_cached(&cache.layers[i], &shape)?)?;
            }
            x.add_assign(&attn.linear(&layer.o, None)?)?;

            let h = x.rms_norm(&layer.post_attention_norm, c.rms_norm_eps)?;
            let gated = h
                .linear(&layer.gate, None)?
                .gated(&h.linear(&layer.up, None)?, c.activation)?;
            x.add_assign(&gated.linear(&layer.down, None)?)?;
            for (rows, features) in &deepstacks {
                if let Some(add) = features.get(i) {
                    let mut at_rows = x.gather_rows(rows)?;
                    at_rows.add_assign(add)?;
                    x.scatter_rows(rows, &at_rows)?;
                }
            }
        }
        let x = x.rms_norm(&self.norm, c.rms_norm_eps)?;
        let mut out = Vec::with_capacity(seqs.len());
        for (at, n, cache) in seqs {
            cache.len += n;
            out.push(x.slice_rows(at, n)?);
        }
        Ok(out)
    }

    /// Output logits `[rows, vocab]` for final hidden states.
    pub fn logits(&self, hidden: &Tensor<B>) -> Result<Tensor<B>> {
        hidden.linear(self.lm_head.as_ref().unwrap_or(&self.embed_tokens), None)
    }
}

impl<B: Backend> SeqCache for KvCache<B> {
    fn len(&self) -> usize {
        self.len
    }
    fn bytes(&self) -> usize {
        KvCache::bytes(self)
    }
}

impl<B: Backend> Llm for Qwen2<B> {
    type Backend = B;
    type Cache = KvCache<B>;

    fn device(&self) -> &B {
        &self.device
    }
    fn hidden_size(&self) -> usize {
        self.config.hidden_size
    }
    fn max_positions(&self) -> usize {
        self.config.max_position_embeddings
    }
    fn eos_token_ids(&self) -> &[u32] {
        &self.config.eos_token_ids
    }
    fn new_cache(&self, capacity: usize) -> Result<KvCache<B>> {
        Qwen2::new_cache(self, capacity)
    }
    fn embed(&self, ids: &[u32]) -> Result<Tensor<B>> {
        Qwen2::embed(self, ids)
    }
    fn forward_batch(&self, steps: Vec<SeqStep<'_, B, KvCache<B>>>) -> Result<Vec<Tensor<B>>> {
        Qwen2::forward_batch(self, steps)
    }
    fn logits(&self, hidden: &Tensor<B>) -> Result<Tensor<B>> {
        Qwen2::logits(self, hidden)
    }
}
