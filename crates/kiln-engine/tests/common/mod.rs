//! Shared engine test setup: the tiny random llama (vocabulary 256) with a byte-level
//! tokenizer, the default model, and the devices under test.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

use kiln_engine::{Engine, EngineConfig, EngineHandle};
use kiln_kv::BlockManagerConfig;
use kiln_model::{LoadOptions, Model, ModelFiles};
use kiln_scheduler::SchedulerConfig;
use kiln_tensor::Device;
use kiln_tokenizer::{SpecialTokens, Tokenizer};

pub use kiln_testkit::devices;

pub fn tiny_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../kiln-model/tests/fixtures/tiny/llama3")
}

/// An engine config: `blocks` blocks of `block_size`, a token budget and a sequence cap.
pub fn config(blocks: u32, block_size: u32, budget: usize, max_seqs: usize) -> EngineConfig {
    let mut s = SchedulerConfig::new(BlockManagerConfig {
        block_size,
        ..BlockManagerConfig::new(blocks)
    });
    s.max_num_batched_tokens = budget;
    s.max_num_seqs = max_seqs;
    EngineConfig::new(s)
}

/// The tiny llama on `dev` with a byte-level tokenizer whose EOS is `eos`.
pub fn tiny_engine(dev: &Device, eos: u32, cfg: EngineConfig) -> EngineHandle {
    let files = ModelFiles::open(&tiny_dir(), LoadOptions::default()).unwrap();
    let model = Model::load(dev, files.config().clone(), files.weights()).unwrap();
    let tok = Tokenizer::byte_level(SpecialTokens {
        eos: Some(eos),
        ..SpecialTokens::default()
    })
    .unwrap();
    Engine::start(model, tok, cfg).unwrap()
}

/// The default model (SmolLM2-135M Q4_1) on `dev`.
pub fn default_engine(dev: &Device, cfg: EngineConfig) -> EngineHandle {
    let path = kiln_testkit::default_model();
    let files = ModelFiles::open(&path, LoadOptions::default()).unwrap();
    let model = Model::load(dev, files.config().clone(), files.weights()).unwrap();
    let tok = Tokenizer::from_gguf_file(&path).unwrap();
    Engine::start(model, tok, cfg).unwrap()
}
