//! Qwen3-VL's vision tower: a Conv3d patch embedding with bias, learned position embeddings on a
//! square table resampled bilinearly to each grid, LayerNorm blocks with a GELU-tanh MLP and the
//! axial 2-D rotary embedding of Qwen2-VL, a merger, and the deepstack mergers whose outputs the
//! LLM adds to its first layers' hidden states at the image tokens. Its LLM half is [`Qwen2`] (q/k
//! norms, interleaved M-RoPE, deepstack).
//!
//! [`Qwen2`]: crate::models::Qwen2

use std::path::Path;

use crate::backend::{Activation, AttentionMask, AttentionShape, Backend};
use crate::engine::encoder::{Encoder, PatchTower, encode_patches};
use crate::engine::{EncodeInput, EncoderKind};
use crate::error::{Error, Result};
use crate::models::config::{ConfigFile, TextConfig};
use crate::models::qwen2_vl::{check_pixel_values, self_attention};
use crate::rope::{self, Grid};
use crate::tensor::Tensor;
use crate::weights::{Scope, Weights};

/// LayerNorm epsilon of every norm in the tower.
const EPS: f32 = 1e-6;

#[derive(Debug, Clone, PartialEq)]
pub struct Qwen3VisionConfig {
    pub depth: usize,
    pub embed_dim: usize,
    pub out_dim: usize,
    pub heads: usize,
    pub mlp_hidden: usize,
    pub in_channels: usize,
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub merge: usize,
    pub activation: Activation,
    pub rope_theta: f32,
    /// Side of the square learned position table (`sqrt(num_position_embeddings)`).
    pub position_side: usize,
    /// Blocks after which a deepstack merger taps the hidden states.
    pub deepstack: Vec<usize>,
}

impl Qwen3VisionConfig {
    pub fn read(dir: &Path) -> Result<Self> {
        let file = ConfigFile::read(dir)?;
        let err = |reason: String| Error::Config {
            path: file.path.clone(),
            reason,
        };
        let v = file
            .value
            .get("vision_config")
            .ok_or_else(|| err("missing vision_config".into()))?;
        let num = |key: &str| -> Result<usize> {
            v.get(key)
                .and_then(|x| x.as_u64())
                .map(|n| n as usize)
                .ok_or_else(|| err(format!("vision_config.{key} is missing")))
        };
        let embed_dim = num("hidden_size")?;
        let heads = num("num_heads")?;
        if heads == 0 || !embed_dim.is_multiple_of(heads) || !(embed_dim / heads).is_multiple_of(4)
        {
            return Err(err(format!("hidden_size {embed_dim} over {heads} heads")));
        }
        let positions = num("num_position_embeddings")?;
        let side = (positions as f64).sqrt() as usize;
        if side * side != positions || side < 2 {
            return Err(err(format!(
                "num_position_embeddings {positions} is not a square"
            )));
        }
        let deepstack: Vec<usize> = v
            .get("deepstack_visual_indexes")
            .and_then(|d| d.as_array())
            .map(|a| {
                a.iter()
                    .filter_map(|x| x.as_u64().map(|n| n as usize))
                    .collect()
            })
            .unwrap_or_default();
        let activation = v
            .get("hidden_act")
            .and_then(|a| a.as_str())
            .map_or(Some(Activation::GeluTanh), Activation::from_hf)
            .ok_or_else(|| err("vision_config.hidden_act is not supported".into()))?;
        let rope_theta = v
            .get("rope_parameters")
            .and_then(|r| r.get("rope_theta"))
            .and_then(|t| t.as_f64())
            .map_or(10000.0, |t| t as f32);
        let depth = num("depth")?;
        let mut taps: Vec<usize> = deepstack.clone();
        taps.sort_unstable();
        taps.dedup();
        if taps.len() != deepstack.len() || taps.last().is_some_and(|&t| t >= depth) {
            return Err(err(format!(
                "deepstack_visual_indexes {deepstack:?} are not distinct blocks of {depth}"
            )));
        }
        let (patch_size, temporal_patch_size, merge) = (
            num("patch_size")?,
            num("temporal_patch_size").unwrap_or(2),
            num("spatial_merge_size").unwrap_or(2),
        );
        if patch_size == 0 || temporal_patch_size == 0 || merge == 0 {
            return Err(err(format!(
                "patch_size {patch_size}, temporal_patch_size {temporal_patch_size} and \
                 spatial_merge_size {merge} must be positive"
            )));
        }
        Ok(Self {
            depth,
            embed_dim,
            out_dim: num("out_hidden_size")?,
            heads,
            mlp_hidden: num("intermediate_size")?,
            in_channels: num("in_channels").unwrap_or(3),
            patch_size,
            temporal_patch_size,
            merge,
            activation,
            rope_theta,
            position_side: side,
            deepstack,
        })
    }

    pub fn patch_len(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    pub fn head_dim(&self) -> usize {
        self.embed_dim / self.heads
    }
}

/// The `model_type`s this module loads.
pub const MODEL_TYPES: [&str; 1] = ["qwen3_vl"];

/// A Qwen3-VL checkpoint's configuration: its LLM, its tower and its placeholder tokens.
#[derive(Debug, Clone)]
pub struct Qwen3VlConfig {
    pub text: TextConfig,
    pub vision: Qwen3VisionConfig,
    pub image_token_id: u32,
    pub video_token_id: u32,
}

impl Qwen3VlConfig {
    pub fn read(dir: &Path) -> Result<Self> {
        Self::read_of_types(dir, &MODEL_TYPES)
    }

    /// The config of a checkpoint of one of `model_types` laid out as Qwen3-VL's (its tower and
    /// placeholders; its LLM may be another, as Qwen3.5's is).
    pub fn read_of_types(dir: &Path, model_types: &[&str]) -> Result<Self> {
        let file = ConfigFile::read_of_types(dir, model_types)?;
        let text = file.text_config()?;
        let vision = Qwen3VisionConfig::read(dir)?;
        if vision.out_dim != text.hidden_size {
            return Err(file.error(format!(
                "vision out_hidden_size {} does not match the LLM's hidden size {}",
                vision.out_dim, text.hidden_size
            )));
        }
        let root = file.root();
        let token = |key: &str, default: u32| -> Result<u32> {
            Ok(root.token_ids(key)?.first().copied().unwrap_or(default))
        };
        Ok(Self {
            text,
            vision,
            image_token_id: token("image_token_id", 151655)?,
            video_token_id: token("video_token_id", 151656)?,
        })
    }
}

type Biased<B> = (Tensor<B>, Tensor<B>);

struct Block<B: Backend> {
    norm1: Biased<B>,
    norm2: Biased<B>,
    q: Biased<B>,
    k: Biased<B>,
    v: Biased<B>,
    proj: Biased<B>,
    fc1: Biased<B>,
    fc2: Biased<B>,
}

/// The merger (LayerNorm per patch, then each merge×merge block as a row) or a deepstack merger
/// (the block as a row first, then LayerNorm over it: `use_postshuffle_norm`); then
/// `fc2(GELU(fc1(x)))`.
struct Merger<B: Backend> {
    norm: Biased<B>,
    post_shuffle: bool,
    fc1: Biased<B>,
    fc2: Biased<B>,
}

impl<B: Backend> Merger<B> {
    fn load(
        s: &mut Scope<'_, B>,
        name: &str,
        c: &Qwen3VisionConfig,
        post_shuffle: bool,
    ) -> Result<Self> {
        let merged = c.embed_dim * c.merge * c.merge;
        let norm_dim = if post_shuffle { merged } else { c.embed_dim };
        Ok(Self {
            norm: s.layer_norm(&format!("{name}.norm"), norm_dim)?,
            post_shuffle,
            fc1: s.biased_linear(&format!("{name}.linear_fc1"), merged, merged)?,
            fc2: s.biased_linear(&format!("{name}.linear_fc2"), c.out_dim, merged)?,
        })
    }

    fn apply(&self, x: &Tensor<B>, merged: usize) -> Result<Tensor<B>> {
        let rows = x.len() / merged;
        let x = if self.post_shuffle {
            x.slice_rows(0, x.rows())?
                .reshape(&[rows, merged])?
                .layer_norm(&self.norm.0, &self.norm.1, EPS)?
        } else {
            x.layer_norm(&self.norm.0, &self.norm.1, EPS)?
                .reshape(&[rows, merged])?
        };
        x.linear(&self.fc1.0, Some(&self.fc1.1))?
            .activate(Activation::Gelu)?
            .linear(&self.fc2.0, Some(&self.fc2.1))
    }
}

pub struct Qwen3VisionTower<B: Backend> {
    config: Qwen3VisionConfig,
    patch_embed: Biased<B>,
    /// The learned position table `[side², embed_dim]`, on the host: each grid's embeddings are
    /// resampled from it there.
    positions: Vec<f32>,
    blocks: Vec<Block<B>>,
    merger: Merger<B>,
    deepstack: Vec<Merger<B>>,
    device: B,
}

impl<B: Backend> Qwen3VisionTower<B> {
    /// The tower alone from a checkpoint directory.
    pub fn load(dir: &Path, device: &B) -> Result<Self> {
        let c = Qwen3VisionConfig::read(dir)?;
        let mut weights = Weights::load(dir, str::to_owned)?;
        Self::from_weights(c, &mut weights, device)
    }

    /// The tower from checkpoint weights read already (`model.visual.*`), taking its tensors.
    pub fn from_weights(c: Qwen3VisionConfig, weights: &mut Weights, device: &B) -> Result<Self> {
        let d = c.embed_dim;
        let conv = weights.take_weight_data(
            "model.visual.patch_embed.proj.weight",
            &[
                d,
                c.in_channels,
                c.temporal_patch_size,
                c.patch_size,
                c.patch_size,
            ],
        )?;
        let patch_embed = (
            Tensor::from_weight(device, conv, &[d, c.patch_len()])?,
            weights.take(device, "model.visual.patch_embed.proj.bias", &[d])?,
        );
        let side = c.position_side;
        let positions = weights
            .take_host("model.visual.pos_embed.weight", &[side * side, d])?
            .data;
        let mut s = Scope::new(weights, device, "model.visual.");
        let mut blocks = Vec::with_capacity(c.depth);
        for i in 0..c.depth {
            let b = format!("blocks.{i}.");
            let [q, k, v] = s.packed_qkv(&format!("{b}attn.qkv"), d)?;
            blocks.push(Block {
                norm1: s.layer_norm(&format!("{b}norm1"), d)?,
                norm2: s.layer_norm(&format!("{b}norm2"), d)?,
                q,
                k,
                v,
                proj: s.biased_linear(&format!("{b}attn.proj"), d, d)?,
                fc1: s.biased_linear(&format!("{b}mlp.linear_fc1"), c.mlp_hidden, d)?,
                fc2: s.biased_linear(&format!("{b}mlp.linear_fc2"), d, c.mlp_hidden)?,
            });
        }
        let merger = Merger::load(&mut s, "merger", &c, false)?;
        let deepstack = (0..c.deepstack.len())
            .map(|j| Merger::load(&mut s, &format!("deepstack_merger_list.{j}"), &c, true))
            .collect::<Result<_>>()?;
        Ok(Self {
            config: c,
            patch_embed,
            positions,
            blocks,
            merger,
            deepstack,
            device: device.clone(),
        })
    }

    pub fn config(&self) -> &Qwen3VisionConfig {
        &self.config
    }

    /// The learned position embeddings of every patch of `grids` (block-major within each frame,
    /// as the patches are), resampled bilinearly with aligned corners from the square table, as
    /// transformers' `get_vision_interpolation_indices_and_weights`.
    fn position_embeddings(&self, grids: &[Grid]) -> Vec<f32> {
        let c = &self.config;
        let (side, d, m) = (c.position_side, c.embed_dim, c.merge);
        let taps = |index: usize, size: usize| -> [(usize, f32); 2] {
            let src = (index * (side - 1)) as f32 / (size.max(2) - 1) as f32;
            let floor = src.floor();
            let frac = src - floor;
            let at = floor as usize;
            [
                (at.min(side - 1), 1.0 - frac),
                ((at + 1).min(side - 1), frac),
            ]
        };
        let mut out = Vec::with_capacity(grids.iter().map(Grid::patches).sum::<usize>() * d);
        for g in grids {
            let mut frame = vec![0.0f32; g.h * g.w * d];
            let blocks_w = g.w / m;
            for (within, row_out) in frame.chunks_mut(d).enumerate() {
                let in_col = within % m;
                let in_row = within / m % m;
                let block_col = within / (m * m) % blocks_w;
                let block_row = within / (m * m * blocks_w);
                let (row, col) = (block_row * m + in_row, block_col * m + in_col);
                for (hy, wy) in taps(row, g.h) {
                    for (hx, wx) in taps(col, g.w) {
                        let weight = wy * wx;
                        let table = &self.positions[(hy * side + hx) * d..(hy * side + hx + 1) * d];
                        for (o, t) in row_out.iter_mut().zip(table) {
                            *o += t * weight;
                        }
                    }
                }
            }
            for _ in 0..g.t {
                out.extend_from_slice(&frame);
            }
        }
        out
    }

    pub fn device(&self) -> &B {
        &self.device
    }

    /// Encodes the patches of one or more items into the merged output `[Σ tokens, out_dim]` and
    /// one deepstack feature set of the same shape per deepstack tap.
    pub fn encode(
        &self,
        pixel_values: &Tensor<B>,
        grids: &[Grid],
    ) -> Result<(Tensor<B>, Vec<Tensor<B>>)> {
        check_pixel_values(pixel_values, grids, self.config.patch_len())?;
        self.encode_embedded(self.embed_patches(pixel_values)?, grids)
    }

    /// The patch embedding (with its bias) of `[rows, patch_len]` pixel values: `[rows,
    /// embed_dim]`. Row by row, so patches may be embedded a block at a time.
    pub fn embed_patches(&self, pixel_values: &Tensor<B>) -> Result<Tensor<B>> {
        pixel_values.linear(&self.patch_embed.0, Some(&self.patch_embed.1))
    }

    /// [`Self::encode`] from the patches' embeddings (`[Σ patches, embed_dim]`).
    pub fn encode_embedded(
        &self,
        mut x: Tensor<B>,
        grids: &[Grid],
    ) -> Result<(Tensor<B>, Vec<Tensor<B>>)> {
        let c = &self.config;
        let patches: usize = grids.iter().map(Grid::patches).sum();
        if x.shape() != [patches, c.embed_dim] {
            return Err(Error::Input(format!(
                "patch embeddings {:?} do not match grids {grids:?} ({patches} patches of {})",
                x.shape(),
                c.embed_dim
            )));
        }
        // The rotary tables first: they check every grid against the merge, which the position
        // resampling's block order relies on.
        let (cos, sin) = rope::vision_tables(grids, c.merge, c.head_dim(), c.rope_theta)?;
        x.add_assign(&Tensor::from_host_vec(
            &self.device,
            self.position_embeddings(grids),
            &[patches, c.embed_dim],
        )?)?;
        let cos = Tensor::from_host_vec(&self.device, cos, &[patches, c.head_dim()])?;
        let sin = Tensor::from_host_vec(&self.device, sin, &[patches, c.head_dim()])?;
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
        let merged = c.embed_dim * c.merge * c.merge;
        let mut deepstack = Vec::with_capacity(self.deepstack.len());
        for (i, b) in self.blocks.iter().enumerate() {
            let h = x.layer_norm(&b.norm1.0, &b.norm1.1, EPS)?;
            let qkv = [&b.q, &b.k, &b.v];
            x.add_assign(&self_attention(&h, qkv, &b.proj, [&cos, &sin], &shape)?)?;
            let h = x
                .layer_norm(&b.norm2.0, &b.norm2.1, EPS)?
                .linear(&b.fc1.0, Some(&b.fc1.1))?
                .activate(c.activation)?
                .linear(&b.fc2.0, Some(&b.fc2.1))?;
            x.add_assign(&h)?;
            if let Some(j) = c.deepstack.iter().position(|&tap| tap == i) {
                deepstack.push(self.deepstack[j].apply(&x, merged)?);
            }
        }
        Ok((self.merger.apply(&x, merged)?, deepstack))
    }
}

// The encoder pool's view of the tower: the patch flow shared with Qwen2-VL's tower is
// `encode_patches`.
impl<B: Backend> PatchTower<B> for Qwen3VisionTower<B> {
    fn device(&self) -> &B {
        Qwen3VisionTower::device(self)
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
        Qwen3VisionTower::embed_patches(self, pixels)
    }
    /// Each token's row is its merged embedding followed by its deepstack features, level by level
    /// (the layout vLLM's Qwen3-VL uses too): one row per token keeps the pool, the feature store
    /// and the shared cache unaware of deepstack; the engine splits the row at the merge.
    fn encode_embedded(&self, embedded: Tensor<B>, grids: &[Grid]) -> Result<Vec<f32>> {
        let (merged, deepstack) = Qwen3VisionTower::encode_embedded(self, embedded, grids)?;
        let merged = merged.to_host()?;
        let deepstack = deepstack
            .iter()
            .map(Tensor::to_host)
            .collect::<Result<Vec<_>>>()?;
        let width = self.config().out_dim;
        let mut rows = Vec::with_capacity(merged.len() * (1 + deepstack.len()));
        for (token, row) in merged.chunks_exact(width).enumerate() {
            rows.extend_from_slice(row);
            for level in &deepstack {
                rows.extend_from_slice(&level[token * width..(token + 1) * width]);
            }
        }
        Ok(rows)
    }
}

impl<B: Backend> Encoder for Qwen3VisionTower<B> {
    fn kind(&self) -> EncoderKind {
        EncoderKind::Vision
    }
    fn encode(&self, batch: &[&EncodeInput]) -> Vec<Result<Vec<f32>>> {
        encode_patches(self, batch)
    }
}
