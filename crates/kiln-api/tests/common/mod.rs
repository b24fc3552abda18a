//! The tiny random llama (vocabulary 256, byte-level tokenizer) behind an engine, for tests of
//! what the front doors share.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kiln_engine::{Engine, EngineConfig, EngineHandle};
use kiln_kv::BlockManagerConfig;
use kiln_model::{LoadOptions, Model, ModelFiles};
use kiln_scheduler::SchedulerConfig;
use kiln_tensor::Device;
use kiln_tokenizer::{SpecialTokens, Tokenizer};

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
    let dir = kiln_testkit::tiny_model_dir("llama3");
    let files = ModelFiles::open(&dir, LoadOptions::default()).unwrap();
    let model = Model::load(dev, files.config().clone(), files.weights()).unwrap();
    let tokenizer = Tokenizer::byte_level(SpecialTokens {
        eos: Some(eos),
        ..SpecialTokens::default()
    })
    .unwrap();
    Engine::start(model, tokenizer, cfg).unwrap()
}
