//! Qwen2-VL: the vision tower (Conv3d patch embedding, 2-D rotary attention blocks, 2×2 patch
//! merger) and its configuration; the LLM half is [`Qwen2`].
//!
//! The tower takes the plugin's `pixel_values` (`[patches, C·T·P·P]`, patches block-major within
//! each frame) and `image_grid_thw`, attends within each frame, and returns one embedding of the
//! LLM's width per `merge²` patches: exactly the rows the prompt's placeholder tokens stand for.

use std::path::Path;

use crate::backend::{Activation, AttentionMask, AttentionShape, Backend};
use crate::error::{Error, Result};
use crate::models::config::{ConfigFile, TextConfig};
use crate::models::qwen2::Qwen2;
use crate::rope::{self, Grid};
use crate::tensor::Tensor;
use crate::weights::Weights;

/// The LayerNorm epsilon transformers hard-codes for the tower and merger.
const VISION_NORM_EPS: f32 = 1e-6;

#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    pub depth: usize,
    pub embed_dim: usize,
    /// Width of the merger's output: the LLM's hidden size.
    pub out_dim: usize,
    pub heads: usize,
    pub mlp_ratio: f32,
    pub in_channels: usize,
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub merge: usize,
    pub activation: Activation,
    pub rope_theta: f32,
}

impl VisionConfig {
    /// Values per patch row of `pixel_values`: channels × temporal patch × patch².
    pub fn patch_len(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    pub fn head_dim(&self) -> usize {
        self.embed_dim / self.heads
    }
}

/// Everything in a Qwen2-VL `config.json` the model needs.
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen2VlConfig {
    pub text: TextConfig,
    pub vision: VisionConfig,
    pub image_token_id: u32,
    pub video_token_id: u32,
    pub vision_start_token_id: u32,
    pub vision_end_token_id: u32,
}

impl Qwen2VlConfig {
    pub fn read(dir: &Path) -> Result<Self> {
        let file = ConfigFile::read_of_type(dir, "qwen2_vl")?;
        let root = file.root();
        let err = |reason: String| file.error(reason);
        let text = match root.sub("text_config", "text_config") {
            Some(t) => TextConfig::parse(&t, &root)?,
            None => TextConfig::parse(&root, &root)?,
        };
        let v = root
            .sub("vision_config", "vision_config")
            .ok_or_else(|| err("missing vision_config".into()))?;
        let heads = v.usize_or(&["num_heads", "num_attention_heads"], Some(16))?;
        let embed_dim = v.usize_or(&["embed_dim"], Some(1280))?;
        if heads == 0 || embed_dim % heads != 0 || (embed_dim / heads) % 4 != 0 {
            return Err(err(format!(
                "vision embed_dim {embed_dim} over {heads} heads: head size must be a multiple of 4"
            )));
        }
        let rope_theta = match v.sub("rope_parameters", "vision_config.rope_parameters") {
            Some(r) => r.f32_or("rope_theta", 10000.0)?,
            None => 10000.0,
        };
        let vision = VisionConfig {
            depth: v.usize_or(&["depth", "num_hidden_layers"], Some(32))?,
            embed_dim,
            out_dim: v.usize_or(&["hidden_size"], Some(text.hidden_size))?,
            heads,
            mlp_ratio: v.f32_or("mlp_ratio", 4.0)?,
            in_channels: v.usize_or(&["in_channels", "in_chans"], Some(3))?,
            patch_size: v.usize_or(&["patch_size", "spatial_patch_size"], Some(14))?,
            temporal_patch_size: v.usize_or(&["temporal_patch_size"], Some(2))?,
            merge: v.usize_or(&["spatial_merge_size"], Some(2))?,
            activation: v.activation("hidden_act", "quick_gelu")?,
            rope_theta,
        };
        if vision.out_dim != text.hidden_size {
            return Err(err(format!(
                "vision output {} does not match the LLM's hidden size {}",
                vision.out_dim, text.hidden_size
            )));
        }
        let token = |key: &str, default: u32| -> Result<u32> {
            Ok(root.token_ids(key)?.first().copied().unwrap_or(default))
        };
        Ok(Self {
            text,
            vision,
            image_token_id: token("image_token_id", 151655)?,
            video_token_id: token("video_token_id", 151656)?,
            vision_start_token_id: token("vision_start_token_id", 151652)?,
            vision_end_token_id: token("vision_end_token_id", 151653)?,
        })
    }
}

/// Maps checkpoint names of every transformers generation to the current ones: the Hub's
/// `model.layers.*` / `visual.*` become `model.language_model.layers.*` / `model.visual.*`.
pub fn canonical_name(name: &str) -> String {
    if let Some(rest) = name.strip_prefix("visual.") {
        return format!("model.visual.{rest}");
    }
    if let Some(rest) = name.strip_prefix("model.")
        && !rest.starts_with("language_model.")
        && !rest.starts_with("visual.")
    {
        return format!("model.language_model.{rest}");
    }
    name.to_owned()
}

struct VisionBlock<B: Backend> {
    norm1: (Tensor<B>, Tensor<B>),
    norm2: (Tensor<B>, Tensor<B>),
    q: (Tensor<B>, Tensor<B>),
    k: (Tensor<B>, Tensor<B>),
    v: (Tensor<B>, Tensor<B>),
    proj: (Tensor<B>, Tensor<B>),
    fc1: (Tensor<B>, Tensor<B>),
    fc2: (Tensor<B>, Tensor<B>),
}

pub struct VisionTower<B: Backend> {
    config: VisionConfig,
    patch_embed: Tensor<B>,
    blocks: Vec<VisionBlock<B>>,
    merger_norm: (Tensor<B>, Tensor<B>),
    merger_fc1: (Tensor<B>, Tensor<B>),
    merger_fc2: (Tensor<B>, Tensor<B>),
    device: B,
}

impl<B: Backend> VisionTower<B> {
    pub fn load(
        config: VisionConfig,
        weights: &mut Weights,
        prefix: &str,
        device: &B,
    ) -> Result<Self> {
        let c = &config;
        let (d, mlp) = (c.embed_dim, (c.embed_dim as f32 * c.mlp_ratio) as usize);
        let mut pair =
            |name: &str, out: usize, inp: Option<usize>| -> Result<(Tensor<B>, Tensor<B>)> {
                let w_shape: Vec<usize> = match inp {
                    Some(i) => vec![out, i],
                    None => vec![out],
                };
                Ok((
                    weights.take(device, &format!("{prefix}{name}.weight"), &w_shape)?,
                    weights.take(device, &format!("{prefix}{name}.bias"), &[out])?,
                ))
            };
        let mut blocks = Vec::with_capacity(c.depth);
        for i in 0..c.depth {
            let b = format!("blocks.{i}.");
            let norm1 = pair(&format!("{b}norm1"), d, None)?;
            let norm2 = pair(&format!("{b}norm2"), d, None)?;
            let proj = pair(&format!("{b}attn.proj"), d, Some(d))?;
            let fc1 = pair(&format!("{b}mlp.fc1"), mlp, Some(d))?;
            let fc2 = pair(&format!("{b}mlp.fc2"), d, Some(mlp))?;
            // The checkpoint packs q, k and v into one [3d, d] projection; split it once here.
            let (qkv_w, qkv_b) = pair(&format!("{b}attn.qkv"), 3 * d, Some(d))?;
            let (w, bias) = (qkv_w.to_host()?, qkv_b.to_host()?);
            let part = |j: usize| -> Result<(Tensor<B>, Tensor<B>)> {
                Ok((
                    Tensor::from_host(device, &w[j * d * d..(j + 1) * d * d], &[d, d])?,
                    Tensor::from_host(device, &bias[j * d..(j + 1) * d], &[d])?,
                ))
            };
            blocks.push(VisionBlock {
                norm1,
                norm2,
                q: part(0)?,
                k: part(1)?,
                v: part(2)?,
                proj,
                fc1,
                fc2,
            });
        }
        let merged = d * c.merge * c.merge;
        let merger_norm = pair("merger.ln_q", d, None)?;
        let merger_fc1 = pair("merger.mlp.0", merged, Some(merged))?;
        let merger_fc2 = pair("merger.mlp.2", c.out_dim, Some(merged))?;
        // Conv3d with stride = kernel over exactly one patch is a linear map of the flattened patch.
        let conv = weights.take_host(
            &format!("{prefix}patch_embed.proj.weight"),
            &[
                d,
                c.in_channels,
                c.temporal_patch_size,
                c.patch_size,
                c.patch_size,
            ],
        )?;
        let patch_embed = Tensor::from_host(device, &conv.data, &[d, c.patch_len()])?;
        Ok(Self {
            config,
            patch_embed,
            blocks,
            merger_norm,
            merger_fc1,
            merger_fc2,
            device: device.clone(),
        })
    }

    pub fn config(&self) -> &VisionConfig {
        &self.config
    }

    pub fn device(&self) -> &B {
        &self.device
    }

    /// Encodes the patches of one or more items (`pixel_values` rows in item order) into
    /// `[Σ tokens, out_dim]`, each item's tokens in placeholder order.
    pub fn encode(&self, pixel_values: &Tensor<B>, grids: &[Grid]) -> Result<Tensor<B>> {
        let c = &self.config;
        let patches: usize = grids.iter().map(Grid::patches).sum();
        if pixel_values.shape() != [patches, c.patch_len()] {
            return Err(Error::Input(format!(
                "pixel_values {:?} do not match grids {grids:?} ({patches} patches of {})",
                pixel_values.shape(),
                c.patch_len()
            )));
        }
        let (cos, sin) = rope::vision_tables(grids, c.merge, c.head_dim(), c.rope_theta)?;
        let cos = Tensor::from_host(&self.device, &cos, &[patches, c.head_dim()])?;
        let sin = Tensor::from_host(&self.device, &sin, &[patches, c.head_dim()])?;
        let shape = AttentionShape {
            q_rows: patches,
            kv_rows: patches,
            heads: c.heads,
            kv_heads: c.heads,
            head_dim: c.head_dim(),
            scale: 1.0 / (c.head_dim() as f32).sqrt(),
            // Each frame of each item attends only to itself.
            mask: AttentionMask::segments(
                grids
                    .iter()
                    .flat_map(|g| std::iter::repeat_n(g.h * g.w, g.t)),
            ),
        };

        let mut x = pixel_values.linear(&self.patch_embed, None)?;
        for b in &self.blocks {
            let h = x.layer_norm(&b.norm1.0, &b.norm1.1, VISION_NORM_EPS)?;
            let q = h
                .linear(&b.q.0, Some(&b.q.1))?
                .rope(&cos, &sin, c.head_dim())?;
            let k = h
                .linear(&b.k.0, Some(&b.k.1))?
                .rope(&cos, &sin, c.head_dim())?;
            let v = h.linear(&b.v.0, Some(&b.v.1))?;
            let attn = q.attention(&k, &v, &shape)?;
            x.add_assign(&attn.linear(&b.proj.0, Some(&b.proj.1))?)?;
            let h = x.layer_norm(&b.norm2.0, &b.norm2.1, VISION_NORM_EPS)?;
            let h = h.linear(&b.fc1.0, Some(&b.fc1.1))?.activate(c.activation)?;
            x.add_assign(&h.linear(&b.fc2.0, Some(&b.fc2.1))?)?;
        }
        // The merger normalises each patch, then sees each merge×merge block (consecutive rows, as the
        // patches are block-major) as one row.
        let x = x.layer_norm(&self.merger_norm.0, &self.merger_norm.1, VISION_NORM_EPS)?;
        let x = x.reshape(&[
            patches / (c.merge * c.merge),
            c.embed_dim * c.merge * c.merge,
        ])?;
        let x = x
            .linear(&self.merger_fc1.0, Some(&self.merger_fc1.1))?
            .activate(Activation::Gelu)?;
        x.linear(&self.merger_fc2.0, Some(&self.merger_fc2.1))
    }
}

/// A loaded Qwen2-VL: the vision tower on an encoder device and the LLM on its own device.
pub struct Qwen2Vl<E: Backend, L: Backend> {
    pub config: Qwen2VlConfig,
    pub vision: VisionTower<E>,
    pub llm: Qwen2<L>,
}

impl<E: Backend, L: Backend> Qwen2Vl<E, L> {
    pub fn load(dir: &Path, encoder_device: &E, llm_device: &L) -> Result<Self> {
        let config = Qwen2VlConfig::read(dir)?;
        let mut weights = Weights::load(dir, canonical_name)?;
        let vision = VisionTower::load(
            config.vision.clone(),
            &mut weights,
            "model.visual.",
            encoder_device,
        )?;
        let llm = Qwen2::load(
            config.text.clone(),
            &mut weights,
            "model.language_model.",
            llm_device,
        )?;
        weights.warn_unused();
        Ok(Self {
            config,
            vision,
            llm,
        })
    }
}
