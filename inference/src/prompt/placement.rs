//! Where a media item's tokens go in the prompt and what the engine gets for them: a plugin's
//! tensors for the item (or for each of its parts, made ahead or still coming), embeddings made on
//! another replica, or a client's. The family says what its tensors make (tokens, grid, runs of
//! tokens between texts, M-RoPE step); this module lays that out as the engine's items and the
//! prompt ids replacing the item's one templated placeholder.

use std::sync::Arc;

use super::{PlacedItem, PromptModel};
use crate::engine::{Delivery, EncodeInput, Handoff, InputPart, MediaItem, Piece};
use crate::error::{Error, Result};
use crate::families::{FamilyModel, MediaKind, Placement};
use crate::item_tensors::{ItemTensors, NamedTensor, TensorOrigin, Values};

/// A part of an item as its plugin planned it before making it: its tokens, and the small tensors
/// that place them (a grid, a video's timing).
#[derive(Debug)]
pub struct PartLayout {
    pub tokens: usize,
    pub placing: ItemTensors,
}

impl PlacedItem {
    /// `part`'s items as piece `piece` of this item (stored under `share_key` if given), its ids
    /// after this item's.
    fn append_piece(&mut self, mut part: PlacedItem, piece: Piece, share_key: Option<[u8; 32]>) {
        for item in &mut part.items {
            item.piece = Some(piece);
            item.share_key = share_key;
        }
        self.items.append(&mut part.items);
        self.ids.append(&mut part.ids);
    }

    /// Whether the pieces make the `tokens` the plugin planned (`what` made them).
    fn check_tokens(&self, tokens: usize, what: &str) -> Result<()> {
        let made: usize = self.items.iter().map(|i| i.tokens).sum();
        if made != tokens {
            return Err(Error::Input(format!(
                "the plugin planned {tokens} tokens but its {what} make {made}"
            )));
        }
        Ok(())
    }
}

fn input_error(context: impl std::fmt::Display, error: Error) -> Error {
    match error {
        Error::Input(message) => Error::Input(format!("{context}: {message}")),
        other => Error::Input(format!("{context}: {other}")),
    }
}

impl PromptModel {
    /// The engine's input for one preprocessed item (the plugin's tensors), checking that the
    /// plugin's token count is what the encoder will produce.
    pub fn media_item(
        &self,
        kind: MediaKind,
        tokens: usize,
        tensors: ItemTensors,
    ) -> Result<PlacedItem> {
        let mut tensors = tensors.from_origin(TensorOrigin::Plugin);
        let planned = self.native()?.plan_input(kind, &mut tensors)?;
        if planned.tokens != tokens {
            return Err(Error::Input(format!(
                "the plugin planned {tokens} tokens but its tensors make {}",
                planned.tokens
            )));
        }
        self.place(
            kind,
            planned.input,
            planned.tokens,
            Placement {
                grid: None,
                time_interval: planned.time_interval,
                runs: planned.runs,
            },
        )
    }

    /// The engine's items for an item the plugin made in parts (contract 0.4): each part planned by
    /// the family as an item of its own and placed as a piece of item `index` of the request, so
    /// that each is encoded, merged and prefilled as soon as it and what precedes it are ready. A
    /// piece laid out as one run of placeholders continues the previous piece's M-RoPE block (a
    /// Qwen2-VL video: one block whose temporal patches the pieces share out); one laid out in
    /// runs (a Qwen3-VL video's frames after their timestamps) places each run itself. The parts'
    /// tokens must add up to the plugin's plan. An item the encoder must see whole (see
    /// [`PromptModel::row_bands`]) is refused: its parts are joined and placed by
    /// [`Self::media_item`].
    pub fn media_parts(
        &self,
        kind: MediaKind,
        tokens: usize,
        parts: Vec<ItemTensors>,
        index: usize,
    ) -> Result<PlacedItem> {
        if self.native()?.row_bands(kind).is_some() {
            return Err(Error::Input(format!(
                "model {}'s encoder sees a {} whole: its parts are joined before it is placed",
                self.name,
                kind.name()
            )));
        }
        let mut placed = PlacedItem {
            items: Vec::with_capacity(parts.len()),
            ids: Vec::new(),
        };
        let mut temporal_patches = 0;
        for (n, part) in parts.into_iter().enumerate() {
            let mut part = part.from_origin(TensorOrigin::PluginPart);
            let planned = self
                .native()?
                .plan_input(kind, &mut part)
                .map_err(|e| input_error(format_args!("part {n}"), e))?;
            let grid = match &planned.input {
                EncodeInput::Vision { grid, .. } => Some(*grid),
                _ => None,
            };
            // Only a vision input has an M-RoPE block to continue.
            let one_block = planned.runs.is_empty() && grid.is_some();
            let piece = Piece {
                item: index,
                continues_at: (one_block && n > 0).then_some(temporal_patches),
            };
            temporal_patches += grid.map_or(0, |g| g.t);
            let part_tokens = planned.tokens;
            let part = self.place(
                kind,
                planned.input,
                part_tokens,
                Placement {
                    grid: None,
                    time_interval: planned.time_interval,
                    runs: planned.runs,
                },
            )?;
            placed.append_piece(part, piece, None);
        }
        placed.check_tokens(tokens, "parts")?;
        Ok(placed)
    }

    /// The engine's items for an item whose parts are still being made (contract 0.5): each part
    /// placed from its layout (its tokens, and its placing tensors read as the family reads
    /// embeddings made elsewhere) as a piece of item `index` whose input comes later through a
    /// handoff; and, per part, the [`PieceMaker`] that turns its tensors into that input once
    /// made. Pieces continue each other's M-RoPE block as [`Self::media_parts`] places them.
    /// With `share_keys` (one per part, or none), each piece's output is stored in the shared
    /// cache under its part's key. `None` when the model's encoder must see such an item whole
    /// (see [`PromptModel::row_bands`]): its parts are joined once all are made.
    pub fn coming_parts(
        &self,
        kind: MediaKind,
        tokens: usize,
        layouts: Vec<PartLayout>,
        share_keys: &[[u8; 32]],
        index: usize,
    ) -> Result<Option<(PlacedItem, Vec<PieceMaker>)>> {
        if self.native()?.row_bands(kind).is_some() {
            return Ok(None);
        }
        let mut makers = Vec::with_capacity(layouts.len());
        let placed = self.placed_pieces(
            kind,
            tokens,
            layouts,
            share_keys,
            index,
            |n, part_tokens, placement| {
                let (handoff, delivery) = Handoff::new();
                makers.push(PieceMaker {
                    family: self.family.clone(),
                    kind,
                    item: index,
                    part: n,
                    placement: placement.clone(),
                    tokens: part_tokens,
                    delivery: Some(delivery),
                });
                Ok(EncodeInput::Later {
                    grid: placement.grid,
                    handoff,
                })
            },
        )?;
        Ok(Some((placed, makers)))
    }

    /// The engine's items for an item whose parts another replica encoded (stored piece by piece,
    /// see [`Self::coming_parts`]): each part's output placed by its layout as a piece of item
    /// `index`, exactly as the parts made here would be.
    pub fn encoded_parts(
        &self,
        kind: MediaKind,
        tokens: usize,
        layouts: Vec<PartLayout>,
        features: Vec<Arc<Vec<f32>>>,
        index: usize,
    ) -> Result<PlacedItem> {
        if features.len() != layouts.len() {
            return Err(Error::Input(format!(
                "the shared entry has {} parts, not {}",
                features.len(),
                layouts.len()
            )));
        }
        let mut features = features.into_iter();
        let width = self.embedding_width;
        self.placed_pieces(
            kind,
            tokens,
            layouts,
            &[],
            index,
            |n, part_tokens, placement| {
                let embeddings = features
                    .next()
                    .ok_or_else(|| Error::Input(format!("the shared entry lacks part {n}")))?;
                if embeddings.len() != part_tokens * width {
                    return Err(Error::Input(format!(
                        "the shared entry's part {n} is not {part_tokens} tokens"
                    )));
                }
                Ok(EncodeInput::Embeddings {
                    embeddings,
                    grid: placement.grid,
                })
            },
        )
    }

    /// An item's parts placed by their layouts (their placing tensors read as the family reads
    /// embeddings made elsewhere), each the input `input_of` gives for it, as pieces of item
    /// `index`: a piece laid out as one run continues the previous piece's M-RoPE block, as
    /// [`Self::media_parts`] places them. The layouts' tokens must add up to the plugin's plan. A
    /// piece's engine items (one per run) carry its part's key in `share_keys`, if any.
    fn placed_pieces(
        &self,
        kind: MediaKind,
        tokens: usize,
        layouts: Vec<PartLayout>,
        share_keys: &[[u8; 32]],
        index: usize,
        mut input_of: impl FnMut(usize, usize, &Placement) -> Result<EncodeInput>,
    ) -> Result<PlacedItem> {
        let mut placed = PlacedItem {
            items: Vec::with_capacity(layouts.len()),
            ids: Vec::new(),
        };
        let mut temporal_patches = 0;
        for (n, layout) in layouts.into_iter().enumerate() {
            let placing = layout.placing.from_origin(TensorOrigin::PartPlan);
            let placement = self
                .native()?
                .place_embeddings(kind, Some(&placing), layout.tokens)
                .map_err(|e| input_error(format_args!("part plan {n}"), e))?;
            let one_block = placement.runs.is_empty() && placement.grid.is_some();
            let piece = Piece {
                item: index,
                continues_at: (one_block && n > 0).then_some(temporal_patches),
            };
            temporal_patches += placement.grid.map_or(0, |g| g.t);
            let input = input_of(n, layout.tokens, &placement)?;
            let part = self.place(kind, input, layout.tokens, placement)?;
            placed.append_piece(part, piece, share_keys.get(n).copied());
        }
        placed.check_tokens(tokens, "part plans")?;
        Ok(placed)
    }

    /// The engine's items for an item's input and the prompt ids that replace its templated
    /// placeholder: one run of `tokens` placeholders, or the family's runs between their texts,
    /// each an item taking its share of the input's tokens.
    fn place(
        &self,
        kind: MediaKind,
        input: EncodeInput,
        tokens: usize,
        placement: Placement,
    ) -> Result<PlacedItem> {
        let placeholder = self.placeholder(kind)?;
        let item = |input: Arc<EncodeInput>, tokens, part| MediaItem {
            input,
            placeholder,
            tokens,
            processor_config: self.processor_config.clone(),
            time_interval: placement.time_interval,
            share_key: None,
            part,
            piece: None,
        };
        let input = Arc::new(input);
        if placement.runs.is_empty() {
            return Ok(PlacedItem {
                ids: vec![placeholder; tokens],
                items: vec![item(input, tokens, None)],
            });
        }
        let in_runs: usize = placement.runs.iter().map(|r| r.tokens).sum();
        if in_runs != tokens {
            return Err(Error::Input(format!(
                "the item's runs hold {in_runs} tokens, not its {tokens}"
            )));
        }
        let mut placed = PlacedItem {
            items: Vec::with_capacity(placement.runs.len()),
            ids: Vec::with_capacity(tokens + 8 * placement.runs.len()),
        };
        let mut first_token = 0;
        for run in &placement.runs {
            placed.ids.extend(self.text.encode(&run.before)?);
            placed
                .ids
                .extend(std::iter::repeat_n(placeholder, run.tokens));
            placed.ids.extend(self.text.encode(&run.after)?);
            let part = InputPart {
                first_token,
                grid: run.grid,
                at: run.at,
            };
            placed
                .items
                .push(item(input.clone(), run.tokens, Some(part)));
            first_token += run.tokens;
        }
        Ok(placed)
    }

    /// The engine's input for `features` this model's encoder made of an item on another replica,
    /// placed by the item's small tensors (its grid, a video's `second_per_grid_ts`) as
    /// [`Self::media_item`] places the item itself.
    pub fn encoded_item(
        &self,
        kind: MediaKind,
        tokens: usize,
        small: ItemTensors,
        features: Arc<Vec<f32>>,
    ) -> Result<PlacedItem> {
        let small = small.from_origin(TensorOrigin::SharedEntry);
        let placement = self
            .native()?
            .place_embeddings(kind, Some(&small), tokens)?;
        if tokens == 0 || !features.len().is_multiple_of(tokens) {
            return Err(Error::Input(format!(
                "the shared entry's features do not split into {tokens} tokens"
            )));
        }
        let input = EncodeInput::Embeddings {
            embeddings: features,
            grid: placement.grid,
        };
        self.place(kind, input, tokens, placement)
    }

    /// The engine's input for embeddings an encoder of this model made elsewhere (vLLM's
    /// `image_embeds`): `[tokens, hidden]` floats of any width, and for a vision model the grid
    /// that places them (`(3,)` or `(1, 3)` integers).
    pub fn embeddings_item(
        &self,
        kind: MediaKind,
        embeddings: NamedTensor,
        grid: Option<NamedTensor>,
    ) -> Result<MediaItem> {
        let placeholder = self.placeholder(kind)?;
        if grid.is_none() {
            // A family that places embeddings by a grid says so before anything else is read.
            self.native()?.place_embeddings(kind, None, 0)?;
        }
        let [tokens, hidden] = embeddings.shape[..] else {
            return Err(Error::Input(format!(
                "image_embeds has shape {:?}; [tokens, hidden] is expected",
                embeddings.shape
            )));
        };
        let tokens = usize::try_from(tokens)
            .map_err(|_| Error::Input(format!("image_embeds holds {tokens} tokens")))?;
        if hidden != self.embedding_width as u64 {
            return Err(Error::Input(format!(
                "image_embeds are {hidden} wide; model {} embeds tokens in {}",
                self.name, self.embedding_width
            )));
        }
        if tokens == 0 {
            return Err(Error::Input("image_embeds holds no tokens".into()));
        }
        let values = match embeddings.values {
            Values::Floats { values, .. } => values,
            Values::Unreadable(why) => return Err(Error::Input(why)),
            Values::Ints { dtype, .. } => {
                return Err(Error::Input(format!(
                    "image_embeds are {dtype}; floats are expected"
                )));
            }
            Values::Samples(_) => {
                return Err(Error::Input(
                    "image_embeds are u8; floats are expected".into(),
                ));
            }
        };
        if values.len() != tokens * self.embedding_width {
            return Err(Error::Input(format!(
                "image_embeds holds {} values, not {tokens}x{hidden}",
                values.len()
            )));
        }
        if !values.iter().all(|v| v.is_finite()) {
            return Err(Error::Input(
                "image_embeds holds values that are not finite".into(),
            ));
        }
        // The client's grid, under the name the family reads it by.
        let grid = grid.map(|g| {
            ItemTensors::new(vec![NamedTensor {
                name: "image_grid_thw".into(),
                ..g
            }])
            .from_origin(TensorOrigin::Client)
        });
        let Placement { grid, .. } =
            self.native()?
                .place_embeddings(kind, grid.as_ref(), tokens)?;
        Ok(MediaItem {
            input: Arc::new(EncodeInput::Embeddings {
                embeddings: Arc::new(values),
                grid,
            }),
            placeholder,
            tokens,
            processor_config: self.processor_config.clone(),
            time_interval: 1.0,
            share_key: None,
            part: None,
            piece: None,
        })
    }
}

/// What turns one part of an item, placed before it was made ([`PromptModel::coming_parts`]),
/// into its encoder input once made, and hands that to the engine. Dropped before delivering
/// while its request still waits, it is a bug in whatever drives the request: it fails the item
/// saying which part was never made, and logs that once.
pub struct PieceMaker {
    family: Arc<dyn FamilyModel>,
    kind: MediaKind,
    /// The media item's index in the request, and the part's within the item.
    item: usize,
    part: usize,
    /// Where the part was placed: what its tensors must make.
    placement: Placement,
    tokens: usize,
    /// Taken when delivered.
    delivery: Option<Delivery>,
}

impl PieceMaker {
    /// Hands the part's input to the engine: its tensors as the family reads them, checked to
    /// make what was placed (the same tokens, grid, runs and M-RoPE step); or why there is none
    /// (the maker's own error), which fails the item in the engine as an encode error does.
    pub fn deliver(mut self, made: std::result::Result<ItemTensors, String>) {
        let input = made.and_then(|tensors| {
            self.input_of(tensors)
                .map_err(|e| format!("media item {} part {}: {e}", self.item, self.part))
        });
        if let Some(delivery) = self.delivery.take() {
            delivery.deliver(input);
        }
    }

    /// Lets the part go unmade because its request is being stopped (the client left, or the
    /// request is rerun without its media): not the bug dropping an awaited maker is.
    pub fn cancel(mut self) {
        self.delivery.take();
    }

    fn input_of(&self, tensors: ItemTensors) -> Result<EncodeInput> {
        let mut tensors = tensors.from_origin(TensorOrigin::PluginPart);
        // Made by `coming_parts`, which only a native family places.
        let native = self
            .family
            .native()
            .ok_or_else(|| Error::Input("the item's model does not run here".into()))?;
        let planned = native.plan_input(self.kind, &mut tensors)?;
        let grid = match &planned.input {
            EncodeInput::Vision { grid, .. } => Some(*grid),
            _ => None,
        };
        let made = Placement {
            grid,
            time_interval: planned.time_interval,
            runs: planned.runs,
        };
        if planned.tokens != self.tokens || made != self.placement {
            return Err(Error::Input(format!(
                "its tensors make {} tokens placed as {made:?}, not the {} tokens placed as {:?} its part plan gave",
                planned.tokens, self.tokens, self.placement
            )));
        }
        Ok(planned.input)
    }
}

impl Drop for PieceMaker {
    fn drop(&mut self) {
        let Some(delivery) = self.delivery.take() else {
            return;
        };
        if !delivery.awaited() {
            // The request is gone (cancelled or over): nobody waits for this part.
            return;
        }
        let message = format!(
            "media item {} part {} was never made: what drove the request stopped feeding its parts to the engine",
            self.item, self.part
        );
        tracing::error!(item = self.item, part = self.part, "{message}");
        delivery.deliver(Err(message));
    }
}
