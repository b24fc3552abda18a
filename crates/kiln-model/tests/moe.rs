//! Mixture-of-experts models against their references, on every backend: tiny random-weight
//! Qwen3-MoE and Mixtral checkpoints made by `transformers` (`scripts/make_tiny_fixtures.py`),
//! as HF folders and as GGUF files written by llama.cpp's own converter. The HF folders and
//! the F32 GGUFs match transformers' float32 logits at every prompt position and its greedy
//! continuation token for token; the Q8_0 GGUFs and the MXFP4 ones (llama.cpp's quantizer,
//! its `MXFP4_MOE` type) follow llama.cpp's greedy continuation of the same file
//! (`llama-cpp-python`) until its first near-tie.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::{Path, PathBuf};

use common::tiny;
use kiln_model::{
    Arch, CpuExperts, CpuMoe, ExpertProj, GgufSource, LoadOptions, Model, ModelConfig, ModelFiles,
    MoeConfig, SafetensorsFile, StDtype, encode_safetensors,
};
use kiln_tensor::{DType, Router};
use serde_json::Value;

/// Margin under which transformers' top two tokens count as tied, for files holding its very
/// weights in f32 (kiln's logits differ from its by under 1e-5).
const F32_TIE: f64 = 1e-3;
/// Against llama.cpp on a quantized file (Q8_0, or MXFP4 experts). Measured on these fixtures: kiln's logits (every
/// backend) differ from llama.cpp's by 0.015 to 0.04 at each position, and by up to 0.17 where
/// a token's third expert changes (a router near-tie): activations rounded to 8 bits by one
/// and not the other, or in another order, on random weights where logits are close.
const Q8_TIE: f64 = 0.05;
const STEPS: usize = 16;

fn dir(name: &str) -> PathBuf {
    kiln_testkit::tiny_model_dir(name)
}

fn json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The native CPU backend's bound on logits (absolute and relative) where a file's weights
/// are quantized and the reference computed on their exact dequantization: its matmuls take
/// X rounded to 8 bits a 32-element block (as `tests/int4.rs` bounds it; 0.012 on the MXFP4
/// experts here).
const NATIVE_TOL: f32 = 0.1;

/// Loads `path` on every device; checks its logits against `reference.json` (unless
/// `logits` is false) and its greedy continuation against `greedy`. A `quantized` file's
/// reference is its exact dequantization in f32: the native backend, which rounds the
/// activations it multiplies by quantized weights to 8 bits, is held to [`NATIVE_TOL`] and
/// may part from the greedy tokens at a reference margin under [`Q8_TIE`].
fn check_with(
    path: &Path,
    greedy: &Value,
    (tie, quantized): (f64, bool),
    logits: bool,
    what: &str,
) -> ModelConfig {
    let files = ModelFiles::open(path, LoadOptions::default()).unwrap();
    let reference = match path.is_dir() {
        true => json(&path.join("reference.json")),
        false => json(&path.with_file_name("reference.json")),
    };
    let ids = tiny::ids(&reference["input_ids"]);
    let cfg = files.config().clone();
    for (backend, dev) in common::devices() {
        let model = Model::load(&dev, cfg.clone(), files.weights()).unwrap();
        let eight_bit = quantized && matches!(dev, kiln_tensor::Device::Cpu(_));
        let what = format!("{what} {backend}");
        if logits {
            let got = tiny::forward_all(&model, &dev, &ids);
            let want = tiny::logits(&reference["logits"]);
            let tol = if eight_bit { NATIVE_TOL } else { 2e-5 };
            tiny::assert_logits_within(&got, &want, cfg.vocab, &what, tol);
        }
        let got = tiny::greedy(&model, &dev, &ids, STEPS);
        let tie = if eight_bit { tie.max(Q8_TIE) } else { tie };
        tiny::assert_greedy(&got, greedy, tie, &what);
    }
    cfg
}

/// [`check_with`] a file of f32 weights (or one compared with llama.cpp's run of it).
fn check(path: &Path, greedy: &Value, tie: f64, logits: bool, what: &str) -> ModelConfig {
    check_with(path, greedy, (tie, false), logits, what)
}

/// The HF folder, the F32 GGUF (both against transformers) and the Q8_0 GGUF (against
/// llama.cpp); returns the folder's config and the GGUF's.
fn check_formats(name: &str) -> (ModelConfig, ModelConfig) {
    let d = dir(name);
    let transformers = json(&d.join("reference.json"))["greedy"].clone();
    let hf = check(&d, &transformers, F32_TIE, true, &format!("{name} HF"));
    let gguf = check(
        &d.join("model-f32.gguf"),
        &transformers,
        F32_TIE,
        true,
        &format!("{name} F32 GGUF"),
    );
    // llama.cpp on the F32 file gives transformers' tokens too (a check of the references).
    let llama_f32 = json(&d.join("reference-f32.json"));
    assert_eq!(llama_f32["greedy"]["tokens"], transformers["tokens"]);
    for ty in ["q8_0", "mxfp4"] {
        let llama = json(&d.join(format!("reference-{ty}.json")))["greedy"].clone();
        let path = d.join(format!("model-{ty}.gguf"));
        check(&path, &llama, Q8_TIE, false, &format!("{name} {ty} GGUF"));
    }
    // llama.cpp's quantizer put the experts in MXFP4 (GGUF type 39), which kiln keeps.
    let mxfp4 = GgufSource::open(&d.join("model-mxfp4.gguf")).unwrap();
    let experts = mxfp4.file().tensor("blk.0.ffn_gate_exps.weight").unwrap();
    assert_eq!(DType::of_ggml(experts.ggml_type.0), Some(DType::MXFP4));
    (hf, gguf)
}

#[test]
fn qwen3moe_matches_transformers_and_llama_cpp_in_both_formats() {
    let (hf, gguf) = check_formats("qwen3moe");
    let moe = MoeConfig {
        experts: 8,
        used: 3,
        expert_ffn: 32,
        router: Router::SoftmaxTopK { renorm: true },
        biases: false,
        dense_layers: vec![],
    };
    assert_eq!((hf.arch, hf.moe.as_ref()), (Arch::Qwen3Moe, Some(&moe)));
    assert_eq!((gguf.arch, gguf.moe.as_ref()), (Arch::Qwen3Moe, Some(&moe)));
    assert!(hf.qk_norm && gguf.qk_norm);
}

#[test]
fn mixtral_matches_transformers_and_llama_cpp_in_both_formats() {
    let (hf, gguf) = check_formats("mixtral");
    let moe = MoeConfig {
        experts: 8,
        used: 2,
        expert_ffn: 32,
        router: Router::SoftmaxTopK { renorm: true },
        biases: false,
        dense_layers: vec![],
    };
    assert_eq!((hf.arch, hf.moe.as_ref()), (Arch::Mixtral, Some(&moe)));
    // llama.cpp's converter writes Mixtral as `llama` with experts.
    assert_eq!((gguf.arch, gguf.moe.as_ref()), (Arch::Llama, Some(&moe)));
}

/// GPT-OSS: the HF folder (transformers' own float layout, `gate_up_proj` interleaved) against
/// transformers; the GGUFs against llama.cpp on the same file. GGUF metadata cannot say
/// YaRN's `truncate: false` (GPT-OSS's): llama.cpp rounds the correction range out to whole
/// dimensions, and kiln reads a GGUF as llama.cpp does, so even the F32 file follows
/// llama.cpp rather than transformers (llama.cpp's own F32 greedy parts from transformers'
/// at step 10 on this fixture).
#[test]
fn gpt_oss_matches_transformers_and_llama_cpp_in_both_formats() {
    let d = dir("gpt_oss");
    let transformers = json(&d.join("reference.json"))["greedy"].clone();
    let hf = check(&d, &transformers, F32_TIE, true, "gpt_oss HF");
    let mut gguf = None;
    for ty in ["f32", "q8_0", "mxfp4"] {
        let llama = json(&d.join(format!("reference-{ty}.json")))["greedy"].clone();
        let path = d.join(format!("model-{ty}.gguf"));
        gguf = Some(check(
            &path,
            &llama,
            Q8_TIE,
            false,
            &format!("gpt_oss {ty} GGUF"),
        ));
    }
    let gguf = gguf.unwrap();
    let moe = MoeConfig {
        experts: 8,
        used: 3,
        expert_ffn: 32,
        router: Router::TopKSoftmax,
        biases: true,
        dense_layers: vec![],
    };
    for (what, cfg) in [("HF", &hf), ("GGUF", &gguf)] {
        assert_eq!(
            (cfg.arch, cfg.moe.as_ref()),
            (Arch::GptOss, Some(&moe)),
            "{what}"
        );
        assert!(cfg.qkv_bias && cfg.o_bias && cfg.attn_sinks, "{what}");
        let windows: Vec<_> = cfg.attention.iter().map(|a| a.window).collect();
        assert_eq!(windows, [Some(8), None, Some(8), None], "{what}");
        let truncate = match cfg.attention[0].rope.scaling {
            kiln_tensor::RopeScaling::Yarn { truncate, .. } => truncate,
            other => panic!("{what}: {other:?}"),
        };
        assert_eq!(truncate, what == "GGUF", "{what}");
    }
}

/// GPT-OSS's experts in MXFP4 as OpenAI released them (`_blocks`/`_scales`, gate and up
/// interleaved), kept packed, against transformers' own dequantization of the same tensors.
#[test]
fn gpt_oss_with_mxfp4_experts_as_released_matches_transformers() {
    let d = dir("gpt_oss_mxfp4");
    let transformers = json(&d.join("reference.json"))["greedy"].clone();
    check_with(&d, &transformers, (F32_TIE, true), true, "gpt_oss_mxfp4 HF");
    let files = ModelFiles::open(&d, LoadOptions::default()).unwrap();
    let dev = kiln_tensor::Device::Reference;
    let experts = files
        .weights()
        .load_experts(&dev, 0, ExpertProj::Gate, [8, 32, 64])
        .unwrap();
    assert_eq!(experts.dtype(), DType::MXFP4);
}

/// `--cpu-moe` and `--n-cpu-moe 1` on lavapipe: the experts on the native CPU backend, the
/// rest on the GPU, give the all-device result: with f32 weights the same logits (within f32
/// rounding) and greedy tokens; with MXFP4 experts, whose native products take 8-bit
/// activations, llama.cpp's greedy tokens until its first near-tie, as the all-device run.
#[test]
fn experts_on_the_cpu_beside_the_gpu_give_the_all_device_result() {
    let Some(gpu) = kiln_testkit::wgpu() else {
        return;
    };
    let cases = [
        (dir("qwen3moe").join("model-f32.gguf"), None),
        (dir("gpt_oss"), None),
        (
            dir("gpt_oss").join("model-mxfp4.gguf"),
            Some("reference-mxfp4.json"),
        ),
    ];
    for (path, quantized) in cases {
        let files = ModelFiles::open(&path, LoadOptions::default()).unwrap();
        let cfg = files.config().clone();
        let reference = match path.is_dir() {
            true => json(&path.join("reference.json")),
            false => json(&path.with_file_name("reference.json")),
        };
        let ids = tiny::ids(&reference["input_ids"]);
        let all = Model::load(&gpu, cfg.clone(), files.weights()).unwrap();
        assert_eq!(all.host_experts().1, [] as [usize; 0]);
        let want = tiny::forward_all(&all, &gpu, &ids);
        let tokens = tiny::greedy(&all, &gpu, &ids, STEPS);
        for (placement, layers) in [
            (CpuMoe::All, (0..cfg.layers).collect()),
            (CpuMoe::First(1), vec![0]),
        ] {
            let what = format!("{} {placement:?}", path.display());
            let split = Model::load_with_progress(
                &gpu,
                cfg.clone(),
                files.weights(),
                Some(&CpuExperts {
                    layers: placement,
                    cpu: kiln_testkit::native_cpu(),
                }),
                &mut |_, _| {},
            )
            .unwrap();
            let (host, on_cpu) = split.host_experts();
            assert_eq!(on_cpu, layers.as_slice(), "{what}");
            assert!(host > 0, "{what}");
            assert_eq!(split.weight_bytes() + host, all.weight_bytes(), "{what}");
            let greedy = tiny::greedy(&split, &gpu, &ids, STEPS);
            match quantized {
                None => {
                    let got = tiny::forward_all(&split, &gpu, &ids);
                    tiny::assert_logits_within(&got, &want, cfg.vocab, &what, 1e-4);
                    assert_eq!(greedy, tokens, "{what}");
                }
                // The native products round activations to 8 bits, which moves a router's
                // near-tie in a later layer (0.14 on a logit here): greedy tokens, as for
                // every quantized file, follow llama.cpp's until its first near-tie.
                Some(r) => {
                    let llama = json(&path.with_file_name(r))["greedy"].clone();
                    tiny::assert_greedy(&greedy, &llama, Q8_TIE, &what);
                }
            }
        }
    }
}

#[test]
fn qwen3moe_without_renormalised_weights_and_with_a_dense_layer() {
    let d = dir("qwen3moe_dense");
    let greedy = json(&d.join("reference.json"))["greedy"].clone();
    let cfg = check(&d, &greedy, F32_TIE, true, "qwen3moe_dense HF");
    let moe = cfg.moe.unwrap();
    assert_eq!(
        (moe.router, moe.dense_layers, moe.experts, moe.used),
        (Router::SoftmaxTopK { renorm: false }, vec![0], 6, 2)
    );
}

/// The fixture's config with `edit` applied, read back.
fn edited(name: &str, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) -> String {
    let mut v = json(&dir(name).join("config.json"));
    edit(v.as_object_mut().unwrap());
    match ModelConfig::from_hf_json("config.json", &v.to_string()) {
        Ok(c) => panic!("accepted: {:?}", c.moe),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_expert_configs_and_files_are_refused_by_name() {
    let e = edited("qwen3moe", |v| {
        v.insert("num_experts_per_tok".into(), 9.into());
    });
    assert!(
        e.contains("num_experts_per_tok") && e.contains("1..=8"),
        "{e}"
    );
    let e = edited("qwen3moe", |v| {
        v.insert("num_local_experts".into(), 2000.into());
    });
    assert!(
        e.contains("num_local_experts") && e.contains("outside"),
        "{e}"
    );
    let e = edited("mixtral", |v| {
        v.insert("hidden_act".into(), "gelu".into());
    });
    assert!(e.contains("hidden_act") && e.contains("gelu"), "{e}");
    let e = edited("gpt_oss", |v| {
        v.insert("swiglu_limit".into(), 10.0.into());
    });
    assert!(e.contains("swiglu_limit") && e.contains("7"), "{e}");
    let e = edited("qwen3moe", |v| {
        v.insert("mlp_only_layers".into(), serde_json::json!([5]));
    });
    assert!(
        e.contains("mlp_only_layers") && e.contains("layer 5"),
        "{e}"
    );

    // A router whose shape disagrees with the config, and a checkpoint that lacks an expert:
    // the load names the tensor and the file.
    let tmp = std::env::temp_dir().join(format!("kiln-moe-missing-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let load = |config: &Value| {
        std::fs::write(tmp.join("config.json"), config.to_string()).unwrap();
        let files = ModelFiles::open(&tmp, LoadOptions::default()).unwrap();
        Model::load(
            &kiln_tensor::Device::Reference,
            files.config().clone(),
            files.weights(),
        )
        .unwrap_err()
        .to_string()
    };
    // The fixture's weights without the tensor `gone`, into `tmp`.
    let without = |fixture: &str, gone: &str| {
        let st = SafetensorsFile::open(&dir(fixture).join("model.safetensors")).unwrap();
        let tensors: Vec<_> = st
            .names()
            .filter(|n| *n != gone)
            .map(|n| {
                let v = st.read_f32(n).unwrap();
                let shape = st.info(n).unwrap().1.to_vec();
                let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                (n.to_string(), StDtype::F32, shape, bytes)
            })
            .collect();
        let bytes = encode_safetensors(&tensors, &Default::default()).unwrap();
        std::fs::write(tmp.join("model.safetensors"), bytes).unwrap();
    };
    let config = json(&dir("mixtral").join("config.json"));
    let gone = "model.layers.1.block_sparse_moe.experts.5.w3.weight";
    without("mixtral", gone);
    let mut nine = config.clone();
    nine["num_local_experts"] = 9.into();
    let shape_err = load(&nine);
    let missing = load(&config);
    // GPT-OSS without an expert bias, or without a layer's sinks.
    let gpt_oss = json(&dir("gpt_oss").join("config.json"));
    for gone in [
        "model.layers.2.mlp.experts.gate_up_proj_bias",
        "model.layers.1.self_attn.sinks",
    ] {
        without("gpt_oss", gone);
        let e = load(&gpt_oss);
        assert!(e.contains(gone) && e.contains("missing"), "{e}");
    }
    std::fs::remove_dir_all(&tmp).unwrap();
    assert!(
        shape_err.contains("model.layers.0.block_sparse_moe.gate.weight")
            && shape_err.contains("[8, 64] disagrees with config.json's [9, 64]"),
        "{shape_err}"
    );
    assert!(
        missing.contains(gone) && missing.contains("missing"),
        "{missing}"
    );
}
