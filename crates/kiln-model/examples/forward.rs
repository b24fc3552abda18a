//! Load a checkpoint onto a device and run the forward pass by hand: one prefill step over a
//! prompt, then greedy decode steps, each reading back only what it asks for. On the default
//! model the logits and the greedy tokens are checked against Hugging Face `transformers`'
//! (the golden fixture `tests/fixtures/smollm2_golden.json`).
//!
//! `cargo run --release -p kiln-model --example forward [MODEL.gguf|HF_DIR]` (default: the
//! default model, `models/SmolLM2-135M-Instruct.Q4_1.gguf`, fetched by `cargo xtask
//! fetch-model`; another model runs the fixture's token ids unchecked). The device is the best
//! GPU, else the CPU backend.

use std::path::PathBuf;
use std::process::ExitCode;

use kiln_kv::{BlockId, KvDtype};
use kiln_model::{KvPoolConfig, LoadOptions, Model, ModelFiles, ModelRunner, StepSeq};
use kiln_tensor::{Device, DeviceOptions};

/// The model tests' bounds against the fixture (one definition, shared with `tests/`).
#[allow(dead_code)]
#[path = "../tests/common/tolerance.rs"]
mod tolerance;
use tolerance::Tolerance;

/// The golden fixture's first case: "The capital of France is" and what transformers computes.
const GOLDEN: &str = include_str!("../tests/fixtures/smollm2_golden.json");
const BLOCK: u32 = 16;

fn main() -> ExitCode {
    let path = std::env::args_os().nth(1).map_or_else(
        || PathBuf::from("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        PathBuf::from,
    );
    match run(&path) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("forward example: {}: {e}", path.display());
            ExitCode::FAILURE
        }
    }
}

fn run(path: &std::path::Path) -> Result<(), Box<dyn std::error::Error>> {
    let golden: serde_json::Value = serde_json::from_str(GOLDEN)?;
    let case = &golden["cases"][0];
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|x| x.as_u64().or_else(|| x["id"].as_u64()))
            .map(|x| x as u32)
            .collect()
    };
    let prompt = ids(&case["prompt_ids"]);
    let reference = ids(&case["greedy"]);
    let margins: Vec<f64> = case["greedy"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|g| g["margin"].as_f64())
        .collect();
    let checked = path.ends_with("SmolLM2-135M-Instruct.Q4_1.gguf");

    // The config and tokenizer-free weights; GGUF tensors stay in their stored (quantized) type.
    let files = ModelFiles::open(path, LoadOptions::default())?;
    let device = Device::new(&DeviceOptions::default())?;
    let model = Model::load(&device, files.config().clone(), files.weights())?;
    // f32 throughout on the reference and wgpu backends; the native CPU backend quantizes
    // activations to 8 bits as llama.cpp's CPU backend does, and is held to llama.cpp's measured
    // distance from the fixture.
    let bound = Tolerance::of(&device, Tolerance::SMOLLM2_INT8_X);
    println!(
        "{} on {}: {} layers, hidden {}, vocab {}",
        path.display(),
        device.info(),
        model.config().layers,
        model.config().hidden,
        model.config().vocab
    );

    // A paged KV pool of 8 blocks; this one sequence owns them all, in order. (A real server
    // takes block tables from kiln-kv's BlockManager.)
    let mut runner = ModelRunner::new(
        model,
        KvPoolConfig {
            block_size: BLOCK,
            num_blocks: 8,
            dtype: KvDtype::F32,
        },
    )?;
    let table: Vec<BlockId> = (0..8).map(BlockId).collect();
    let blocks = |len: usize| &table[..len.div_ceil(BLOCK as usize)];

    // Prefill: the whole prompt in one step, the last position's logits read back.
    let out = runner.step(
        &[StepSeq {
            tokens: &prompt,
            block_table: blocks(prompt.len()),
            kept_table: &[],
            context_len: prompt.len(),
            logits_rows: 1,
            read_logits: true,
            sample: None,
        }],
        &[],
    )?;
    let logits = out.logits(0, 0).ok_or("no logits row")?;
    let mut top: Vec<(usize, f32)> = logits.iter().copied().enumerate().collect();
    top.sort_by(|a, b| b.1.total_cmp(&a.1));
    println!("prompt {prompt:?}: top-5 next {:?}", &top[..5]);
    if checked {
        // transformers' top-5 logits after the last prompt token, within the golden test's
        // bound for this device.
        let want = case["prompt_top5"]
            .as_array()
            .and_then(|p| p.last())
            .and_then(|p| p.as_array())
            .ok_or("fixture: prompt_top5")?;
        for w in want {
            let (id, logit) = (
                w[0].as_u64().unwrap_or(0) as usize,
                w[1].as_f64().unwrap_or(0.0),
            );
            let ours = f64::from(logits[id]);
            if (ours - logit).abs() > f64::from(bound.at(logit as f32)) {
                return Err(format!("logit of {id}: {ours} vs transformers' {logit}").into());
            }
        }
    }

    // Greedy decode: one token a step, only the device argmax read back.
    let mut tokens = prompt.clone();
    let mut next = out.argmax(0, 0).ok_or("no argmax")?;
    let mut generated = vec![next];
    for _ in 1..16 {
        tokens.push(next);
        let out = runner.step(
            &[StepSeq {
                tokens: &[next],
                block_table: blocks(tokens.len()),
                kept_table: &[],
                context_len: tokens.len(),
                logits_rows: 1,
                read_logits: false,
                sample: None,
            }],
            &[],
        )?;
        next = out.argmax(0, 0).ok_or("no argmax")?;
        generated.push(next);
    }
    println!("greedy ids: {generated:?}");
    if checked {
        // The greedy ids must be transformers' up to the first step where its top-1/top-2
        // margin is within the device's bound (there a different pick is legitimate, and the
        // sequences part).
        let same = generated
            .iter()
            .zip(&reference)
            .take_while(|(ours, theirs)| ours == theirs)
            .count();
        if same < generated.len() && margins[same] >= f64::from(bound.near_tie) {
            return Err(format!(
                "greedy id {same} is {}, transformers' {} (margin {:.3})",
                generated[same], reference[same], margins[same]
            )
            .into());
        }
        println!(
            "matches transformers: top-5 logits, and {same} of 16 greedy tokens{}",
            if same < generated.len() {
                format!(" (then a near tie, margin {:.3})", margins[same])
            } else {
                String::new()
            }
        );
    }
    Ok(())
}
