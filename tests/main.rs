//! mmgate's end-to-end tests: the real `mmgate` binary (and real peers: vLLM's CPU build, Redis,
//! Chromium, the OpenAI and Anthropic SDKs) driven over HTTP and its command line. One test binary,
//! a module per subject; `cargo test -p mmgate-gateway --test end_to_end MODULE::` runs one subject.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

mod chat_api;
mod console;
mod documents;
mod engine;
mod family_counts;
mod fuzz_corpus;
mod generate_cli;
mod guide;
mod hostile;
mod passthrough;
mod plugin_authoring;
mod plugin_cli;
mod preprocess_cli;
mod replicas;
mod responses;
mod serve;
mod traces;
mod vllm;
