//! What the engine runs: the [`Llm`] trait, everything the scheduler asks of a decoder-only LLM
//! (embedding lookups, KV caches, one batched forward step over several sequences, logits). The
//! models implement it beside themselves (the Qwen2 family's in [`models`](crate::models)); the
//! engine is generic over it, so a step costs no dynamic dispatch.

use crate::backend::Backend;
use crate::error::Result;
use crate::tensor::Tensor;

/// A decoder-only LLM the engine can run. It takes input embeddings rather than token ids, so that
/// encoder outputs can be merged in before the prefill. `Sync` because the engine runs each step
/// on the device's own threads ([`Backend::run_on`]).
pub trait Llm: Send + Sync + 'static {
    /// The device its weights live on, where the engine makes the step's tensors.
    type Backend: Backend;
    /// One sequence's keys and values.
    type Cache: SeqCache;

    fn device(&self) -> &Self::Backend;
    /// Width of an input embedding (and of each deepstack feature row).
    fn hidden_size(&self) -> usize;
    /// Most tokens (prompt and generated) a sequence may hold.
    fn max_positions(&self) -> usize;
    /// Token ids that end a generation, from the model's config.
    fn eos_token_ids(&self) -> &[u32];
    /// A KV cache for a sequence of up to `capacity` tokens.
    fn new_cache(&self, capacity: usize) -> Result<Self::Cache>;
    /// Input embeddings `[ids, hidden]` for token ids.
    fn embed(&self, ids: &[u32]) -> Result<Tensor<Self::Backend>>;
    /// One step of several sequences at once (continuous batching): each sequence's rows are
    /// appended to its cache, attending only to it. Returns each sequence's final hidden states
    /// `[n, hidden]`, in order.
    fn forward_batch(
        &self,
        steps: Vec<SeqStep<'_, Self::Backend, Self::Cache>>,
    ) -> Result<Vec<Tensor<Self::Backend>>>;
    /// Output logits `[rows, vocab]` for final hidden states.
    fn logits(&self, hidden: &Tensor<Self::Backend>) -> Result<Tensor<Self::Backend>>;
}

/// What the engine reads of a sequence's KV cache.
pub trait SeqCache: Send {
    /// Tokens whose keys and values it holds.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Device bytes held (whatever is filled).
    fn bytes(&self) -> usize;
}

/// One sequence's part of a batched forward step.
pub struct SeqStep<'a, B: Backend, C> {
    /// Input embeddings of the sequence's next tokens, `[n, hidden]`.
    pub embeds: Tensor<B>,
    pub positions: &'a [[i64; 3]],
    pub cache: &'a mut C,
    /// Qwen3-VL's deepstack: after decoder layer i, `features[i]` (`[rows.len(), hidden]`) is added
    /// to the hidden states of the step's rows `rows` (its image tokens).
    pub deepstack: Option<Deepstack<'a, B>>,
}

/// Features added to a step's media rows after each of the LLM's first layers (see
/// [`SeqStep::deepstack`]).
pub struct Deepstack<'a, B: Backend> {
    pub rows: &'a [u32],
    pub features: &'a [Tensor<B>],
}
