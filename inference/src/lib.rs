//! mmgate's native inference core: tensors over device backends, the vision and audio encoders, the
//! Qwen2 LLM, and the merge of encoder outputs into the LLM's prefill.
//!
//! It consumes the tensors the modality plugins produce and knows nothing of HTTP or WebAssembly.

pub mod backend;
pub mod demo;
pub mod devices;
pub mod engine;
pub mod error;
pub mod families;
pub mod item_tensors;
pub mod merge;
pub mod models;
pub mod prompt;
pub mod rope;
pub mod sampling;
pub mod tensor;
pub mod text;
pub mod weights;

pub use backend::cpu::CpuBackend;
pub use backend::{Activation, AttentionMask, AttentionShape, Backend, Conv1dShape, Segment};
pub use error::{Error, Result};
pub use tensor::Tensor;
