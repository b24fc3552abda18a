//! DeepSeek-V4 served by the engine, built as `kiln serve` builds it (`Checkpoint::open`,
//! `build`), from llama.cpp's converter's GGUF of the tiny checkpoint that `kiln-model`'s
//! `deepseek_v4_model` checks against transformers: its state in kiln-kv's two pools (main
//! blocks for the windows, kept blocks for the entries), prompts prefilled in chunks beside
//! each other's decodes, preempted when the main pool runs short, and reused from the prefix
//! cache, give transformers' greedy tokens (on the backends whose activations stay f32) and
//! the library's single-sequence run (on every backend); what the pools cannot do is refused
//! by name.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

use kiln_engine::{
    BuildError, Checkpoint, EngineHandle, EngineOptions, KvSize, Output, PoolPlan, Request, build,
};
use kiln_model::v4::V4Model;
use kiln_model::{LoadOptions, SafetensorsFile};
use kiln_tensor::Device;

const NEW: usize = 24;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../kiln-model/tests/fixtures/deepseek_v4")
}

fn gguf() -> PathBuf {
    fixtures().join("tiny-f32.gguf")
}

fn ids(g: &SafetensorsFile, name: &str) -> Vec<u32> {
    g.read_f32(name)
        .unwrap()
        .iter()
        .map(|&v| v as u32)
        .collect()
}

/// The golden's three prompts (5, 13 and 130 tokens) and transformers' greedy continuations.
fn golden() -> Vec<(Vec<u32>, Vec<u32>)> {
    let g = SafetensorsFile::open(&fixtures().join("model_golden.safetensors")).unwrap();
    (0..3)
        .map(|i| {
            let p = ids(&g, &format!("gen.prompt.{i}"));
            let w = ids(&g, &format!("gen.greedy.{i}"));
            (p, w)
        })
        .collect()
}

/// An engine for the tiny GGUF on `dev`: `chunk` tokens a step, the pools `size` gives.
fn engine(dev: &Device, size: KvSize, chunk: usize) -> (EngineHandle, PoolPlan) {
    let opts = EngineOptions {
        kv_size: size,
        max_num_batched_tokens: Some(chunk),
        max_num_seqs: Some(4),
        ..EngineOptions::new(dev.clone())
    };
    let c = Checkpoint::open(&gguf(), LoadOptions::default()).unwrap();
    assert_eq!(c.config().arch_name(), "deepseek_v4");
    let built = build(c, &opts, &mut |_, _| {}).unwrap();
    (built.engine, built.kv)
}

fn greedy(prompt: &[u32]) -> Request {
    let mut r = Request::tokens(prompt.to_vec()).max_new_tokens(NEW);
    r.stopping.ignore_eos = true;
    r
}

/// Every prompt submitted at once, each output in order.
fn run_all(e: &EngineHandle, prompts: &[Vec<u32>]) -> Vec<Output> {
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| e.submit(greedy(p)).unwrap())
        .collect();
    streams
        .into_iter()
        .map(|s| s.blocking_collect().unwrap())
        .collect()
}

#[test]
fn served_in_chunks_and_batched_it_gives_transformers_and_the_librarys_tokens() {
    let cases = golden();
    let prompts: Vec<Vec<u32>> = cases.iter().map(|(p, _)| p.clone()).collect();
    for (name, dev) in kiln_testkit::devices() {
        // The library's own run of each prompt alone, on this device.
        let model = V4Model::load(&gguf(), &dev, 256).unwrap();
        let alone: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| model.generate_greedy(&dev, p, NEW).unwrap())
            .collect();
        drop(model);
        // 7 tokens a step: boundaries inside CSA's windows of 4 and HCA's of 128, the
        // prompts' chunks beside each other's decodes.
        let (e, plan) = engine(&dev, KvSize::Bytes(8 << 20), 7);
        assert!(matches!(plan, PoolPlan::Kept(_)), "{name}: {plan}");
        let outs = run_all(&e, &prompts);
        for (i, (out, (_, want))) in outs.iter().zip(&cases).enumerate() {
            let got = &out.outputs[0].token_ids;
            assert_eq!(got, &alone[i], "{name}: prompt {i}, against the library");
            // The native CPU backend multiplies MXFP4 experts with 8-bit activations, as
            // ggml's CPU code does: that flips this tiny model's routing (deepseek_v4_model).
            if name != "cpu" {
                assert_eq!(got, want, "{name}: prompt {i}, against transformers");
            }
        }
        // The long prompt again: its first block comes from the prefix cache, in both pools.
        let again = run_all(&e, &prompts[2..]);
        assert_eq!(again[0].usage.cached_prompt_tokens, 128, "{name}");
        assert_eq!(
            again[0].outputs[0].token_ids, alone[2],
            "{name}: after a prefix hit"
        );
    }
}

#[test]
fn a_kept_pool_that_runs_short_preempts_and_the_output_is_unchanged() {
    let (long, _) = golden().swap_remove(2);
    let dev = Device::reference();
    let model = V4Model::load(&gguf(), &dev, 256).unwrap();
    // Two prompts of 120 tokens that each outgrow their first kept block while decoding,
    // with three kept blocks for both: one is preempted and recomputed.
    let prompts = [long[..120].to_vec(), long[6..126].to_vec()];
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| model.generate_greedy(&dev, p, NEW).unwrap())
        .collect();
    let opts = EngineOptions {
        kv_size: KvSize::Blocks(3),
        max_num_batched_tokens: Some(16),
        max_num_seqs: Some(2),
        ..EngineOptions::new(dev.clone())
    };
    let c = Checkpoint::open(&gguf(), LoadOptions::default()).unwrap();
    let built = build(c, &opts, &mut |_, _| {}).unwrap();
    let outs = run_all(&built.engine, &prompts);
    for (out, want) in outs.iter().zip(&alone) {
        assert_eq!(&out.outputs[0].token_ids, want);
    }
    let stats = built.engine.stats_blocking().unwrap();
    assert!(stats.preemptions > 0, "{stats:?}");
    // Every block of both pools is back.
    assert_eq!(stats.kv.used_blocks, 0, "{stats:?}");
    let kept = stats.kv.kept.expect("a kept pool");
    assert_eq!((kept.used_blocks, kept.total_blocks), (0, 3), "{stats:?}");
    stats.invariants.unwrap();
}

#[test]
fn what_the_pools_cannot_do_is_refused_by_name() {
    let dev = Device::reference();
    let (e, _) = engine(&dev, KvSize::Bytes(8 << 20), 64);
    // n > 1 shares a prompt's blocks by fork; kept blocks are not shared to write.
    let mut r = greedy(&[5, 6, 7]);
    r.n = 2;
    let err = e.submit(r).and_then(|s| s.blocking_collect()).unwrap_err();
    assert!(err.to_string().contains("1..=1"), "{err}");
    assert_eq!(e.info().max_n, 1);
    // The engine goes on serving.
    let out = e.submit(greedy(&[5, 6, 7])).unwrap().blocking_collect();
    assert_eq!(out.unwrap().outputs[0].token_ids.len(), NEW);
    // Options that do not apply to its pools or weights.
    let c = Checkpoint::open(&gguf(), LoadOptions::default()).unwrap();
    let opts = EngineOptions {
        kv_size: KvSize::Bytes(1 << 10),
        ..EngineOptions::new(dev.clone())
    };
    let err = build(c, &opts, &mut |_, _| {}).unwrap_err();
    assert!(matches!(err, BuildError::KvPlan { .. }), "{err:?}");
    let err = kiln_engine::error_chain(&err);
    assert!(err.contains("kv_cache_memory"), "{err}");
    let quantize = LoadOptions {
        quantize: Some(kiln_tensor::DType::Q8_0),
        ..LoadOptions::default()
    };
    let err = Checkpoint::open(&gguf(), quantize).unwrap_err();
    assert!(
        kiln_engine::error_chain(&err).contains("load options"),
        "{err:?}"
    );
}
