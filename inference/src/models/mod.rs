//! The models' networks, loaded from HF model directories: the Qwen2 LLM and the vision and audio
//! towers. Each implements the engine's traits beside itself (the LLM [`Llm`], each tower
//! [`Encoder`]), so that the engine names no model.
//!
//! [`Llm`]: crate::engine::Llm
//! [`Encoder`]: crate::engine::Encoder

pub mod config;
pub mod generation;
pub mod qwen2;
pub mod qwen2_audio;
pub mod qwen2_vl;
pub mod qwen3_vl;

pub use generation::GenerationConfig;
pub use qwen2::{KvCache, Qwen2};
pub use qwen2_audio::{AudioEncoder, Qwen2Audio, Qwen2AudioConfig};
pub use qwen2_vl::{Qwen2Vl, Qwen2VlConfig, VisionTower};
