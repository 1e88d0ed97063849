//! Model families, loaded from HF model directories.

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
