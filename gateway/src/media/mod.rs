//! Media through the plugins: fetching and uploads, recognising what a file is, the plugin host's
//! pools, the per-request pipeline (probe, plan, preprocess), token budgets, and the encoder
//! feature cache shared by replicas.

pub mod account;
pub mod budget;
pub mod documents;
pub mod feature_cache;
pub mod fetch;
pub mod files;
pub mod pipeline;
pub mod plugins;
pub mod processor_settings;
pub mod render;
pub mod sniff;
