//! Shared engine test setup: the tiny random llama (vocabulary 256) with a byte-level
//! tokenizer, the default model, and the devices under test.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

use kiln_engine::{Checkpoint, DraftModel, Engine, EngineConfig, EngineHandle};
use kiln_kv::BlockManagerConfig;
use kiln_model::{LoadOptions, Model, ModelFiles};
use kiln_scheduler::SchedulerConfig;
use kiln_tensor::Device;
use kiln_tokenizer::{SpecialTokens, Tokenizer};

#[allow(unused_imports)]
pub use kiln_testkit::devices;

pub fn tiny_dir() -> PathBuf {
    kiln_testkit::tiny_model_dir("llama3")
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

/// The byte-level tokenizer of the tiny models, EOS `eos`.
pub fn byte_tokenizer(eos: u32) -> Tokenizer {
    Tokenizer::byte_level(SpecialTokens {
        eos: Some(eos),
        ..SpecialTokens::default()
    })
    .unwrap()
}

/// A tiny random-weight model of the fixtures (`llama3`, `mistral`, `qwen2`) on `dev`.
pub fn tiny_model(dev: &Device, arch: &str) -> Model {
    let dir = tiny_dir().join("..").join(arch);
    let files = ModelFiles::open(&dir, LoadOptions::default()).unwrap();
    Model::load(dev, files.config().clone(), files.weights()).unwrap()
}

/// The tiny llama on `dev` with a byte-level tokenizer whose EOS is `eos`.
pub fn tiny_engine(dev: &Device, eos: u32, cfg: EngineConfig) -> EngineHandle {
    Engine::start(tiny_model(dev, "llama3"), byte_tokenizer(eos), cfg).unwrap()
}

/// The tiny llama drafted for by the tiny model `draft` (`mistral`: same byte-level
/// vocabulary, different weights, so most drafts are rejected; `llama3`: itself, so greedy
/// drafts hold). `cfg.speculative` must name the draft method.
pub fn tiny_engine_with_draft(
    dev: &Device,
    eos: u32,
    cfg: EngineConfig,
    draft: &str,
) -> EngineHandle {
    let draft = DraftModel {
        model: tiny_model(dev, draft),
        tokenizer: byte_tokenizer(eos),
    };
    Engine::start_with_draft(
        tiny_model(dev, "llama3"),
        byte_tokenizer(eos),
        cfg,
        Some(draft),
    )
    .unwrap()
}

/// The default model (SmolLM2-135M Q4_1) on `dev`, and its tokenizer.
pub fn default_model(dev: &Device) -> (Model, Tokenizer) {
    Checkpoint::open(&kiln_testkit::default_model(), LoadOptions::default())
        .unwrap()
        .load(dev, None, &mut |_, _| {})
        .unwrap()
}

/// The default model (SmolLM2-135M Q4_1) on `dev`.
pub fn default_engine(dev: &Device, cfg: EngineConfig) -> EngineHandle {
    let (model, tok) = default_model(dev);
    Engine::start(model, tok, cfg).unwrap()
}

/// The engine's stats once it holds no request (waiting until then: the requests in flight
/// finish or their dropped streams are noticed, whatever the machine's load; a minute
/// without getting there is a hang).
pub fn wait_idle(e: &EngineHandle) -> kiln_engine::EngineStats {
    let start = std::time::Instant::now();
    loop {
        let s = e.stats_blocking().unwrap();
        if s.requests == 0 {
            return s;
        }
        assert!(
            start.elapsed() < std::time::Duration::from_secs(60),
            "engine never went idle: {s:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}
