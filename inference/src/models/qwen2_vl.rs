//! Qwen2-VL and Qwen2.5-VL: the vision tower (Conv3d patch embedding, 2-D rotary attention
//! blocks, 2×2 patch merger) and its configuration; the LLM half is [`Qwen2`].
//!
//! The tower takes the plugin's `pixel_values` (`[patches, C·T·P·P]`, patches block-major within
//! each frame) and `image_grid_thw`, and returns one embedding of the LLM's width per `merge²`
//! patches: exactly the rows the prompt's placeholder tokens stand for. The two generations share
//! that flow and differ in the blocks: Qwen2-VL has LayerNorm and a GELU MLP and attends within
//! each frame; Qwen2.5-VL has RMSNorm and a gated SiLU MLP, and most of its blocks attend only
//! within windows of a few merged patches (the rest, `fullatt_block_indexes`, within the frame).

use std::path::Path;

use crate::backend::{Activation, AttentionMask, AttentionShape, Backend};
use crate::engine::encoder::{Encoder, PatchTower, encode_patches};
use crate::engine::{EncodeInput, EncoderKind};
use crate::error::{Error, Result};
use crate::models::config::{ConfigFile, Section, TextConfig};
use crate::models::qwen2::Qwen2;
use crate::rope::{self, Grid};
use crate::tensor::Tensor;
use crate::weights::{Scope, Weights};

/// The norm epsilon transformers hard-codes for the tower and merger.
const VISION_NORM_EPS: f32 = 1e-6;

/// Which generation's blocks the tower is built from.
#[derive(Debug, Clone, PartialEq)]
pub enum VisionBlocks {
    /// Qwen2-VL: LayerNorm, `fc2(act(fc1(x)))`, attention within each frame.
    Qwen2Vl { mlp_hidden: usize },
    /// Qwen2.5-VL: RMSNorm, `down(act(gate(x)) · up(x))`, window attention except in `full_blocks`.
    Qwen2_5Vl {
        mlp_hidden: usize,
        window: WindowAttention,
    },
}

/// Qwen2.5-VL's windows: squares of `merged_side × merged_side` merged patches (`window_size`
/// pixels), cut from the top-left of each frame (the last row and column of windows may be
/// smaller).
#[derive(Debug, Clone, PartialEq)]
pub struct WindowAttention {
    pub merged_side: usize,
    /// Blocks that attend across the whole frame instead.
    pub full_blocks: Vec<usize>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    pub depth: usize,
    pub embed_dim: usize,
    /// Width of the merger's output: the LLM's hidden size.
    pub out_dim: usize,
    pub heads: usize,
    pub in_channels: usize,
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub merge: usize,
    pub activation: Activation,
    pub rope_theta: f32,
    pub blocks: VisionBlocks,
    /// Qwen2.5-VL: M-RoPE temporal positions per second of video (`None`: one per temporal patch).
    pub tokens_per_second: Option<f32>,
}

impl VisionConfig {
    /// Values per patch row of `pixel_values`: channels × temporal patch × patch².
    pub fn patch_len(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    pub fn head_dim(&self) -> usize {
        self.embed_dim / self.heads
    }

    /// The M-RoPE temporal step of a video whose temporal patches are `second_per_grid_t`
    /// seconds apart (1 where the model does not scale by time).
    pub fn time_interval(&self, second_per_grid_t: f32) -> f32 {
        match self.tokens_per_second {
            // transformers: `tokens_per_second * second_per_grid_t`, in f32.
            Some(tps) => tps * second_per_grid_t,
            None => 1.0,
        }
    }

    /// Reads `vision_config` of a `qwen2_vl` or (`qwen2_5_vl: true`) a `qwen2_5_vl` config.
    fn parse(v: &Section<'_>, text: &TextConfig, qwen2_5_vl: bool) -> Result<Self> {
        let err = |reason: String| v.err(reason);
        let heads = v.usize_or(&["num_heads", "num_attention_heads"], Some(16))?;
        // Qwen2-VL calls the tower's width `embed_dim` (its `hidden_size` is the LLM's);
        // Qwen2.5-VL calls it `hidden_size` and the LLM's `out_hidden_size`.
        let (embed_dim, out_dim) = if qwen2_5_vl {
            (
                v.usize_or(&["hidden_size"], Some(1280))?,
                v.usize_or(&["out_hidden_size"], Some(text.hidden_size))?,
            )
        } else {
            (
                v.usize_or(&["embed_dim"], Some(1280))?,
                v.usize_or(&["hidden_size"], Some(text.hidden_size))?,
            )
        };
        if heads == 0 || embed_dim % heads != 0 || (embed_dim / heads) % 4 != 0 {
            return Err(err(format!(
                "embed_dim {embed_dim} over {heads} heads: head size must be a multiple of 4"
            )));
        }
        if out_dim != text.hidden_size {
            return Err(err(format!(
                "vision output {out_dim} does not match the LLM's hidden size {}",
                text.hidden_size
            )));
        }
        let rope_theta = match v.sub("rope_parameters", "vision_config.rope_parameters") {
            Some(r) => r.f32_or("rope_theta", 10000.0)?,
            None => 10000.0,
        };
        let depth = v.usize_or(&["depth", "num_hidden_layers"], Some(32))?;
        let patch_size = v.usize_or(&["patch_size", "spatial_patch_size"], Some(14))?;
        let merge = v.usize_or(&["spatial_merge_size"], Some(2))?;
        if patch_size == 0 || merge == 0 {
            return Err(err(
                "patch_size and spatial_merge_size must be positive".into()
            ));
        }
        let (blocks, activation, tokens_per_second) = if qwen2_5_vl {
            let window_size = v.usize_or(&["window_size"], Some(112))?;
            let merged_side = window_size / merge / patch_size;
            if merged_side == 0 {
                return Err(err(format!(
                    "window_size {window_size} is smaller than one merged patch ({} px)",
                    merge * patch_size
                )));
            }
            let full_blocks = match v.get("fullatt_block_indexes") {
                Some(list) => list
                    .as_array()
                    .and_then(|a| {
                        a.iter()
                            .map(|x| x.as_u64().and_then(|n| usize::try_from(n).ok()))
                            .collect::<Option<Vec<usize>>>()
                    })
                    .ok_or_else(
                        || err("fullatt_block_indexes must be a list of integers".into()),
                    )?,
                None => vec![7, 15, 23, 31],
            };
            let blocks = VisionBlocks::Qwen2_5Vl {
                mlp_hidden: v.usize_or(&["intermediate_size"], Some(3420))?,
                window: WindowAttention {
                    merged_side,
                    full_blocks,
                },
            };
            let tps = v.f32_or("tokens_per_second", 4.0)?;
            (blocks, v.activation("hidden_act", "silu")?, Some(tps))
        } else {
            let ratio = v.f32_or("mlp_ratio", 4.0)?;
            let blocks = VisionBlocks::Qwen2Vl {
                mlp_hidden: (embed_dim as f32 * ratio) as usize,
            };
            (blocks, v.activation("hidden_act", "quick_gelu")?, None)
        };
        Ok(Self {
            depth,
            embed_dim,
            out_dim,
            heads,
            in_channels: v.usize_or(&["in_channels", "in_chans"], Some(3))?,
            patch_size,
            temporal_patch_size: v.usize_or(&["temporal_patch_size"], Some(2))?,
            merge,
            activation,
            rope_theta,
            blocks,
            tokens_per_second,
        })
    }
}

/// Everything in a Qwen2-VL or Qwen2.5-VL `config.json` the model needs.
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen2VlConfig {
    pub text: TextConfig,
    pub vision: VisionConfig,
    pub image_token_id: u32,
    pub video_token_id: u32,
    pub vision_start_token_id: u32,
    pub vision_end_token_id: u32,
}

/// The `model_type`s this module loads.
pub const MODEL_TYPES: [&str; 2] = ["qwen2_vl", "qwen2_5_vl"];

impl Qwen2VlConfig {
    pub fn read(dir: &Path) -> Result<Self> {
        let file = ConfigFile::read_of_types(dir, &MODEL_TYPES)?;
        let qwen2_5_vl = file.model_type() == Some("qwen2_5_vl");
        let root = file.root();
        let err = |reason: String| file.error(reason);
        let text = match root.sub("text_config", "text_config") {
            Some(t) => TextConfig::parse(&t, &root)?,
            None => TextConfig::parse(&root, &root)?,
        };
        let v = root
            .sub("vision_config", "vision_config")
            .ok_or_else(|| err("missing vision_config".into()))?;
        let vision = VisionConfig::parse(&v, &text, qwen2_5_vl)?;
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

/// A `nn.Linear`'s weight and bias.
type Linear<B> = (Tensor<B>, Tensor<B>);

enum Norm<B: Backend> {
    Layer(Tensor<B>, Tensor<B>),
    Rms(Tensor<B>),
}

impl<B: Backend> Norm<B> {
    fn load(scope: &mut Scope<'_, B>, name: &str, dim: usize, rms: bool) -> Result<Self> {
        Ok(if rms {
            Self::Rms(scope.rms_norm(name, dim)?)
        } else {
            let (w, b) = scope.layer_norm(name, dim)?;
            Self::Layer(w, b)
        })
    }

    fn apply(&self, x: &Tensor<B>) -> Result<Tensor<B>> {
        match self {
            Self::Layer(w, b) => x.layer_norm(w, b, VISION_NORM_EPS),
            Self::Rms(w) => x.rms_norm(w, VISION_NORM_EPS),
        }
    }
}

enum Mlp<B: Backend> {
    Plain {
        fc1: Linear<B>,
        fc2: Linear<B>,
    },
    Gated {
        gate: Linear<B>,
        up: Linear<B>,
        down: Linear<B>,
    },
}

struct VisionBlock<B: Backend> {
    norm1: Norm<B>,
    norm2: Norm<B>,
    q: Linear<B>,
    k: Linear<B>,
    v: Linear<B>,
    proj: Linear<B>,
    mlp: Mlp<B>,
}

pub struct VisionTower<B: Backend> {
    config: VisionConfig,
    patch_embed: Tensor<B>,
    blocks: Vec<VisionBlock<B>>,
    merger_norm: Norm<B>,
    merger_fc1: Linear<B>,
    merger_fc2: Linear<B>,
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
        let d = c.embed_dim;
        let mut l = Scope::new(weights, device, prefix);
        let rms = matches!(c.blocks, VisionBlocks::Qwen2_5Vl { .. });
        let mut blocks = Vec::with_capacity(c.depth);
        for i in 0..c.depth {
            let b = format!("blocks.{i}.");
            let mlp = match &c.blocks {
                VisionBlocks::Qwen2Vl { mlp_hidden: h } => Mlp::Plain {
                    fc1: l.biased_linear(&format!("{b}mlp.fc1"), *h, d)?,
                    fc2: l.biased_linear(&format!("{b}mlp.fc2"), d, *h)?,
                },
                VisionBlocks::Qwen2_5Vl { mlp_hidden: h, .. } => Mlp::Gated {
                    gate: l.biased_linear(&format!("{b}mlp.gate_proj"), *h, d)?,
                    up: l.biased_linear(&format!("{b}mlp.up_proj"), *h, d)?,
                    down: l.biased_linear(&format!("{b}mlp.down_proj"), d, *h)?,
                },
            };
            let [q, k, v] = l.packed_qkv(&format!("{b}attn.qkv"), d)?;
            blocks.push(VisionBlock {
                norm1: Norm::load(&mut l, &format!("{b}norm1"), d, rms)?,
                norm2: Norm::load(&mut l, &format!("{b}norm2"), d, rms)?,
                q,
                k,
                v,
                proj: l.biased_linear(&format!("{b}attn.proj"), d, d)?,
                mlp,
            });
        }
        let merged = d * c.merge * c.merge;
        let merger_norm = Norm::load(&mut l, "merger.ln_q", d, rms)?;
        let merger_fc1 = l.biased_linear("merger.mlp.0", merged, merged)?;
        let merger_fc2 = l.biased_linear("merger.mlp.2", c.out_dim, merged)?;
        // Conv3d with stride = kernel over exactly one patch is a linear map of the flattened patch.
        let conv = weights.take_weight_data(
            &format!("{prefix}patch_embed.proj.weight"),
            &[
                d,
                c.in_channels,
                c.temporal_patch_size,
                c.patch_size,
                c.patch_size,
            ],
        )?;
        let patch_embed = Tensor::from_weight(device, conv, &[d, c.patch_len()])?;
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

    /// Bytes of device memory the weights hold.
    pub fn weight_bytes(&self) -> usize {
        let linear = |(w, b): &Linear<B>| w.bytes() + b.bytes();
        let norm = |n: &Norm<B>| match n {
            Norm::Layer(w, b) => w.bytes() + b.bytes(),
            Norm::Rms(w) => w.bytes(),
        };
        let blocks: usize = self
            .blocks
            .iter()
            .map(|b| {
                let mlp = match &b.mlp {
                    Mlp::Plain { fc1, fc2 } => linear(fc1) + linear(fc2),
                    Mlp::Gated { gate, up, down } => linear(gate) + linear(up) + linear(down),
                };
                norm(&b.norm1)
                    + norm(&b.norm2)
                    + linear(&b.q)
                    + linear(&b.k)
                    + linear(&b.v)
                    + linear(&b.proj)
                    + mlp
            })
            .sum();
        self.patch_embed.bytes()
            + blocks
            + norm(&self.merger_norm)
            + linear(&self.merger_fc1)
            + linear(&self.merger_fc2)
    }

    pub fn device(&self) -> &B {
        &self.device
    }

    /// Encodes the patches of one or more items (`pixel_values` rows in item order) into
    /// `[Σ tokens, out_dim]`, each item's tokens in placeholder order.
    pub fn encode(&self, pixel_values: &Tensor<B>, grids: &[Grid]) -> Result<Tensor<B>> {
        check_pixel_values(pixel_values, grids, self.config.patch_len())?;
        self.encode_embedded(self.embed_patches(pixel_values)?, grids)
    }

    /// The patch embedding of `[rows, patch_len]` pixel values: `[rows, embed_dim]`. Row by row,
    /// so patches may be embedded a block at a time.
    pub fn embed_patches(&self, pixel_values: &Tensor<B>) -> Result<Tensor<B>> {
        pixel_values.linear(&self.patch_embed, None)
    }

    /// [`Self::encode`] from the patches' embeddings (`[Σ patches, embed_dim]`).
    pub fn encode_embedded(&self, embedded: Tensor<B>, grids: &[Grid]) -> Result<Tensor<B>> {
        let c = &self.config;
        let patches: usize = grids.iter().map(Grid::patches).sum();
        if embedded.shape() != [patches, c.embed_dim] {
            return Err(Error::Input(format!(
                "patch embeddings {:?} do not match grids {grids:?} ({patches} patches of {})",
                embedded.shape(),
                c.embed_dim
            )));
        }
        let unit = c.merge * c.merge;
        let (mut cos, mut sin) = rope::vision_tables(grids, c.merge, c.head_dim(), c.rope_theta)?;
        let mut x = embedded;
        // Qwen2.5-VL runs the blocks with the merged patches regrouped window by window, so that
        // each window is a contiguous segment; the merger's output is put back in order at the end.
        let windows = match &c.blocks {
            VisionBlocks::Qwen2_5Vl { window, .. } => Some(window_order(grids, c.merge, window)),
            VisionBlocks::Qwen2Vl { .. } => None,
        };
        if let Some(w) = &windows {
            x = x
                .reshape(&[patches / unit, unit * c.embed_dim])?
                .gather_rows(&w.order)?
                .reshape(&[patches, c.embed_dim])?;
            let chunk = unit * c.head_dim();
            cos = permute_chunks(&cos, chunk, &w.order);
            sin = permute_chunks(&sin, chunk, &w.order);
        }
        let cos = Tensor::from_host(&self.device, &cos, &[patches, c.head_dim()])?;
        let sin = Tensor::from_host(&self.device, &sin, &[patches, c.head_dim()])?;
        let shape = |mask: AttentionMask| AttentionShape {
            q_rows: patches,
            kv_rows: patches,
            heads: c.heads,
            kv_heads: c.heads,
            head_dim: c.head_dim(),
            scale: 1.0 / (c.head_dim() as f32).sqrt(),
            mask,
        };
        // Each frame of each item attends only to itself (frames stay contiguous when regrouped).
        let per_frame = shape(AttentionMask::segments(
            grids
                .iter()
                .flat_map(|g| std::iter::repeat_n(g.h * g.w, g.t)),
        ));
        let per_window = windows
            .as_ref()
            .map(|w| shape(AttentionMask::segments(w.lengths.iter().copied())));

        for (i, b) in self.blocks.iter().enumerate() {
            let attention_shape = match (&c.blocks, &per_window) {
                (VisionBlocks::Qwen2_5Vl { window, .. }, Some(s))
                    if !window.full_blocks.contains(&i) =>
                {
                    s
                }
                _ => &per_frame,
            };
            let h = b.norm1.apply(&x)?;
            let qkv = [&b.q, &b.k, &b.v];
            x.add_assign(&self_attention(
                &h,
                qkv,
                &b.proj,
                [&cos, &sin],
                attention_shape,
            )?)?;
            let h = b.norm2.apply(&x)?;
            let h = match &b.mlp {
                Mlp::Plain { fc1, fc2 } => h
                    .linear(&fc1.0, Some(&fc1.1))?
                    .activate(c.activation)?
                    .linear(&fc2.0, Some(&fc2.1))?,
                Mlp::Gated { gate, up, down } => h
                    .linear(&gate.0, Some(&gate.1))?
                    .gated(&h.linear(&up.0, Some(&up.1))?, c.activation)?
                    .linear(&down.0, Some(&down.1))?,
            };
            x.add_assign(&h)?;
        }
        // The merger normalises each patch, then sees each merge×merge block (consecutive rows, as the
        // patches are block-major) as one row.
        let x = self.merger_norm.apply(&x)?;
        let x = x.reshape(&[patches / unit, c.embed_dim * unit])?;
        let x = x
            .linear(&self.merger_fc1.0, Some(&self.merger_fc1.1))?
            .activate(Activation::Gelu)?
            .linear(&self.merger_fc2.0, Some(&self.merger_fc2.1))?;
        match &windows {
            Some(w) => x.gather_rows(&w.inverse()),
            None => Ok(x),
        }
    }
}

/// A vision block's attention over `h`: q, k, v projections (q and k turned by the rotary
/// `cos`/`sin`), attention under `shape`, the output projection.
pub(crate) fn self_attention<B: Backend>(
    h: &Tensor<B>,
    [q, k, v]: [&Linear<B>; 3],
    proj: &Linear<B>,
    [cos, sin]: [&Tensor<B>; 2],
    shape: &AttentionShape,
) -> Result<Tensor<B>> {
    let q = h.linear(&q.0, Some(&q.1))?.rope(cos, sin, shape.head_dim)?;
    let k = h.linear(&k.0, Some(&k.1))?.rope(cos, sin, shape.head_dim)?;
    let v = h.linear(&v.0, Some(&v.1))?;
    q.attention(&k, &v, shape)?.linear(&proj.0, Some(&proj.1))
}

/// The patches `pixel_values` (`[patches, patch_len]`) must hold for `grids`.
pub(crate) fn check_pixel_values<B: Backend>(
    pixel_values: &Tensor<B>,
    grids: &[Grid],
    patch_len: usize,
) -> Result<usize> {
    let patches: usize = grids.iter().map(Grid::patches).sum();
    if pixel_values.shape() != [patches, patch_len] {
        return Err(Error::Input(format!(
            "pixel_values {:?} do not match grids {grids:?} ({patches} patches of {patch_len})",
            pixel_values.shape(),
        )));
    }
    Ok(patches)
}

/// Qwen2.5-VL's regrouping of merged patches (`merge²` consecutive rows each) into windows.
#[derive(Debug, Clone, PartialEq, Eq)]
struct WindowOrder {
    /// `order[i]`: the merged patch that goes to place `i`.
    order: Vec<u32>,
    /// Rows (patches, not merged patches) of each window, in order; none empty.
    lengths: Vec<usize>,
}

impl WindowOrder {
    /// `inverse[j]`: where merged patch `j` went.
    fn inverse(&self) -> Vec<u32> {
        let mut inverse = vec![0u32; self.order.len()];
        for (place, &unit) in self.order.iter().enumerate() {
            inverse[unit as usize] = place as u32;
        }
        inverse
    }
}

/// transformers' `get_vision_window_index`: per item and frame, windows of `merged_side²` merged
/// patches from the top-left, row by row, each window's merged patches row by row; windows cut
/// by the frame's edge are smaller (the padding transformers adds is dropped again there).
fn window_order(grids: &[Grid], merge: usize, window: &WindowAttention) -> WindowOrder {
    let side = window.merged_side;
    let mut order = Vec::new();
    let mut lengths = Vec::new();
    let mut base = 0usize;
    for g in grids {
        let (rows, cols) = (g.h / merge, g.w / merge);
        for t in 0..g.t {
            let frame = base + t * rows * cols;
            for wy in (0..rows).step_by(side) {
                for wx in (0..cols).step_by(side) {
                    let before = order.len();
                    for y in wy..(wy + side).min(rows) {
                        for x in wx..(wx + side).min(cols) {
                            order.push((frame + y * cols + x) as u32);
                        }
                    }
                    lengths.push((order.len() - before) * merge * merge);
                }
            }
        }
        base += g.t * rows * cols;
    }
    WindowOrder { order, lengths }
}

/// `data` seen as chunks of `chunk` values, reordered so that chunk `i` is old chunk `order[i]`.
fn permute_chunks(data: &[f32], chunk: usize, order: &[u32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(data.len());
    for &i in order {
        let start = i as usize * chunk;
        out.extend_from_slice(&data[start..start + chunk]);
    }
    out
}

/// A loaded Qwen2-VL or Qwen2.5-VL: the vision tower on an encoder device and the LLM on its own
/// device.
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

    /// Only the vision tower, on `device`: another encoder device's copy, reading nothing of the
    /// LLM's weights.
    pub fn load_vision(dir: &Path, device: &E) -> Result<VisionTower<E>> {
        let config = Qwen2VlConfig::read(dir)?;
        let mut weights = Weights::load(dir, canonical_name)?;
        VisionTower::load(config.vision, &mut weights, "model.visual.", device)
    }
}

// The encoder pool's view of the tower: the patch flow shared with Qwen3-VL's tower is
// `encode_patches`.
impl<B: Backend> PatchTower<B> for VisionTower<B> {
    fn device(&self) -> &B {
        VisionTower::device(self)
    }
    fn patch_len(&self) -> usize {
        self.config().patch_len()
    }
    fn embed_dim(&self) -> usize {
        self.config().embed_dim
    }
    fn merge(&self) -> usize {
        self.config().merge
    }
    fn embed_patches(&self, pixels: &Tensor<B>) -> Result<Tensor<B>> {
        VisionTower::embed_patches(self, pixels)
    }
    fn encode_embedded(&self, embedded: Tensor<B>, grids: &[Grid]) -> Result<Vec<f32>> {
        VisionTower::encode_embedded(self, embedded, grids)?.to_host()
    }
}

impl<B: Backend> Encoder for VisionTower<B> {
    fn kind(&self) -> EncoderKind {
        EncoderKind::Vision
    }
    fn encode(&self, batch: &[&EncodeInput]) -> Vec<Result<Vec<f32>>> {
        encode_patches(self, batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_tile_each_frame_from_the_top_left_and_shrink_at_the_edges() {
        // A 3x5 merged grid in windows of 2x2 merged patches, two frames.
        let window = WindowAttention {
            merged_side: 2,
            full_blocks: vec![],
        };
        let w = window_order(&[Grid { t: 2, h: 6, w: 10 }], 2, &window);
        assert_eq!(&w.order[..10], &[0, 1, 5, 6, 2, 3, 7, 8, 4, 9]);
        assert_eq!(&w.order[10..15], &[10, 11, 12, 13, 14]);
        assert_eq!(w.order[15], 15, "the second frame starts its own windows");
        let per_frame = [16, 16, 8, 8, 8, 4];
        assert_eq!(w.lengths, [per_frame, per_frame].concat());
        let inverse = w.inverse();
        for (place, &unit) in w.order.iter().enumerate() {
            assert_eq!(inverse[unit as usize] as usize, place);
        }
    }
}
