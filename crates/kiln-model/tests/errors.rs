//! Bad configs and bad GGUF files give one clear error naming the file and what is wrong.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kiln_gguf::{GgmlType, GgufWriter};
use kiln_model::{GgufSource, Model, ModelConfig, ModelError};
use kiln_tensor::Device;

#[test]
fn hf_config_errors_name_the_field() {
    let e = ModelConfig::from_hf_json("cfg.json", r#"{"model_type": "gpt2"}"#).unwrap_err();
    assert!(
        matches!(e, ModelError::Architecture { .. })
            && e.to_string().contains("cfg.json")
            && e.to_string().contains("gpt2"),
        "{e}"
    );
    let e = ModelConfig::from_hf_json(
        "cfg.json",
        r#"{"model_type": "llama", "num_hidden_layers": 2}"#,
    )
    .unwrap_err();
    assert!(e.to_string().contains("hidden_size"), "{e}");
    let e = ModelConfig::from_hf_json("cfg.json", "{not json").unwrap_err();
    assert!(e.to_string().contains("cfg.json"), "{e}");
    let bad_heads = r#"{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 3, "intermediate_size": 8, "vocab_size": 10}"#;
    let e = ModelConfig::from_hf_json("cfg.json", bad_heads).unwrap_err();
    assert!(e.to_string().contains("num_key_value_heads"), "{e}");
    let bad_rope = r#"{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "intermediate_size": 8, "vocab_size": 10, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}}"#;
    let e = ModelConfig::from_hf_json("cfg.json", bad_rope).unwrap_err();
    assert!(
        e.to_string().contains("rope_scaling.rope_type") && e.to_string().contains("longrope"),
        "{e}"
    );
    // YaRN without an original context, and without the model's to default to.
    let yarn = bad_rope.replace("longrope", "yarn");
    let e = ModelConfig::from_hf_json("cfg.json", &yarn).unwrap_err();
    assert!(e.to_string().contains("max_position_embeddings"), "{e}");
}

/// The tiny GGUFs' tensors beside the MLP (hidden 32, 2 heads of 16, vocab 8): embedding,
/// final norm, one layer's attention and its MLP norm, in ggml's dimension order.
fn attention_tensors() -> Vec<(&'static str, Vec<u64>)> {
    vec![
        ("token_embd.weight", vec![32, 8]),
        ("output_norm.weight", vec![32]),
        ("blk.0.attn_norm.weight", vec![32]),
        ("blk.0.attn_q.weight", vec![32, 32]),
        ("blk.0.attn_k.weight", vec![32, 32]),
        ("blk.0.attn_v.weight", vec![32, 32]),
        ("blk.0.attn_output.weight", vec![32, 32]),
        ("blk.0.ffn_norm.weight", vec![32]),
    ]
}

/// A one-layer llama GGUF (hidden 32, 2 heads of 16, ffn 32, vocab 8) with `tweak` applied to
/// its tensor list.
fn tiny_gguf(tweak: impl Fn(&str, Vec<u64>, GgmlType) -> Option<(Vec<u64>, GgmlType)>) -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.metadata("general.architecture", "llama")
        .metadata("llama.embedding_length", 32u32)
        .metadata("llama.block_count", 1u32)
        .metadata("llama.attention.head_count", 2u32)
        .metadata("llama.attention.head_count_kv", 2u32)
        .metadata("llama.feed_forward_length", 32u32)
        .metadata("llama.vocab_size", 8u32)
        .metadata("llama.context_length", 64u32);
    let mlp = [
        ("blk.0.ffn_gate.weight", vec![32, 32]),
        ("blk.0.ffn_up.weight", vec![32, 32]),
        ("blk.0.ffn_down.weight", vec![32, 32]),
    ];
    for (name, dims) in attention_tensors().into_iter().chain(mlp) {
        if let Some((dims, ty)) = tweak(name, dims, GgmlType::F32) {
            let n: u64 = dims.iter().product();
            let bytes = ty.byte_size(n).unwrap_or(n * 4) as usize;
            w.tensor(name, &dims, ty, vec![0u8; bytes]);
        }
    }
    w.to_bytes().unwrap()
}

fn load(bytes: &[u8], name: &str) -> Result<(), ModelError> {
    let dir = std::env::temp_dir().join(format!("kiln-model-errors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    let r = GgufSource::open(&path).and_then(|src| {
        let cfg = ModelConfig::from_gguf(src.file())?;
        Model::load(&Device::reference(), cfg, &src).map(|_| ())
    });
    std::fs::remove_file(&path).unwrap();
    r
}

#[test]
fn a_valid_tiny_gguf_loads() {
    load(&tiny_gguf(|_, d, t| Some((d, t))), "ok.gguf").unwrap();
}

#[test]
fn gguf_tensor_errors_name_the_file_and_tensor() {
    let e = load(
        &tiny_gguf(|n, d, t| (n != "blk.0.attn_k.weight").then_some((d, t))),
        "missing.gguf",
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("missing.gguf")
            && e.to_string().contains("blk.0.attn_k.weight")
            && e.to_string().contains("missing"),
        "{e}"
    );
    let e = load(
        &tiny_gguf(|n, d, t| {
            Some(if n == "blk.0.ffn_up.weight" {
                (vec![32, 16], t)
            } else {
                (d, t)
            })
        }),
        "shape.gguf",
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("blk.0.ffn_up.weight") && e.to_string().contains("disagrees"),
        "{e}"
    );
    let e = load(
        &tiny_gguf(|n, d, t| {
            Some(if n == "blk.0.attn_q.weight" {
                (d, GgmlType(16))
            } else {
                (d, t)
            })
        }),
        "iq2.gguf",
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("blk.0.attn_q.weight")
            && e.to_string().contains("IQ2_XXS")
            && e.to_string().contains("not supported"),
        "{e}"
    );
    let mut truncated = tiny_gguf(|_, d, t| Some((d, t)));
    truncated.truncate(truncated.len() - 100);
    let e = load(&truncated, "truncated.gguf").unwrap_err();
    assert!(e.to_string().contains("truncated.gguf"), "{e}");
    let e = load(b"GGUF\x03\x00\x00\x00", "short.gguf").unwrap_err();
    assert!(e.to_string().contains("short.gguf"), "{e}");
}

/// Tensors are read from the file when loaded, not at open: a file cut short after it was
/// opened fails that read with an error naming the file and the tensor, not a panic.
#[test]
fn a_file_cut_short_after_opening_names_the_tensor() {
    let bytes = tiny_gguf(|_, d, t| Some((d, t)));
    let dir = std::env::temp_dir().join(format!("kiln-model-cut-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("cut.gguf");
    std::fs::write(&path, &bytes).unwrap();
    let src = GgufSource::open(&path).unwrap();
    let cfg = ModelConfig::from_gguf(src.file()).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(bytes.len() as u64 - 100)
        .unwrap();
    let e = Model::load(&Device::reference(), cfg, &src).unwrap_err();
    std::fs::remove_dir_all(&dir).unwrap();
    // The last tensor in the file is the one cut.
    assert!(matches!(e, ModelError::Read { .. }), "{e:?}");
    let text = e.to_string();
    assert!(
        text.contains("cut.gguf") && text.contains("tensor `blk.0.ffn_down.weight`"),
        "{text}"
    );
}

/// A one-layer `qwen3moe` GGUF (hidden 32, 2 heads of 16, 4 experts of 32, top 2) with
/// `meta` adding or replacing metadata and the tensors `keep` accepts.
fn tiny_moe_gguf(meta: &[(&str, u32)], keep: impl Fn(&str) -> bool) -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.metadata("general.architecture", "qwen3moe");
    let base = [
        ("qwen3moe.embedding_length", 32u32),
        ("qwen3moe.block_count", 1),
        ("qwen3moe.attention.head_count", 2),
        ("qwen3moe.attention.head_count_kv", 2),
        ("qwen3moe.feed_forward_length", 64),
        ("qwen3moe.vocab_size", 8),
        ("qwen3moe.context_length", 64),
        ("qwen3moe.expert_count", 4),
        ("qwen3moe.expert_used_count", 2),
        ("qwen3moe.expert_feed_forward_length", 32),
    ];
    for (k, v) in base {
        let v = meta.iter().find(|(m, _)| *m == k).map_or(v, |&(_, v)| v);
        w.metadata(k, v);
    }
    for &(k, v) in meta
        .iter()
        .filter(|(m, _)| !base.iter().any(|(b, _)| b == m))
    {
        w.metadata(k, v);
    }
    let moe = [
        ("blk.0.attn_q_norm.weight", vec![16]),
        ("blk.0.attn_k_norm.weight", vec![16]),
        ("blk.0.ffn_gate_inp.weight", vec![32, 4]),
        ("blk.0.ffn_gate_exps.weight", vec![32, 32, 4]),
        ("blk.0.ffn_down_exps.weight", vec![32, 32, 4]),
        ("blk.0.ffn_up_exps.weight", vec![32, 32, 4]),
    ];
    for (name, dims) in attention_tensors().into_iter().chain(moe) {
        if keep(name) {
            let n: u64 = dims.iter().product();
            w.tensor(name, &dims, GgmlType::F32, vec![0u8; n as usize * 4]);
        }
    }
    w.to_bytes().unwrap()
}

#[test]
fn gguf_expert_errors_name_the_key_or_tensor() {
    load(&tiny_moe_gguf(&[], |_| true), "moe-ok.gguf").unwrap();
    /// Metadata set, then the key (or tensor) the error names and what it says.
    type Case<'a> = (&'a [(&'a str, u32)], &'a str, &'a str);
    let cases: [Case<'_>; 4] = [
        (
            &[("qwen3moe.expert_gating_func", 2)],
            "qwen3moe.expert_gating_func",
            "router 2 is not supported",
        ),
        (
            &[("qwen3moe.expert_used_count", 5)],
            "qwen3moe.expert_used_count",
            "1..=4",
        ),
        (&[("qwen3moe.expert_count", 0)], "", ""),
        (
            &[("qwen3moe.expert_feed_forward_length", 16)],
            "blk.0.ffn_gate_exps.weight",
            "disagrees",
        ),
    ];
    for (meta, key, problem) in cases {
        let r = load(&tiny_moe_gguf(meta, |_| true), "moe-bad.gguf");
        if key.is_empty() {
            // No experts: the file reads as a dense model, whose MLP weights it lacks.
            let e = r.unwrap_err().to_string();
            assert!(
                e.contains("blk.0.ffn_gate.weight") && e.contains("missing"),
                "{e}"
            );
            continue;
        }
        let e = r.unwrap_err().to_string();
        assert!(
            e.contains("moe-bad.gguf") && e.contains(key) && e.contains(problem),
            "{e}"
        );
    }
    let e = load(
        &tiny_moe_gguf(&[], |n| n != "blk.0.ffn_up_exps.weight"),
        "moe-missing.gguf",
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("moe-missing.gguf")
            && e.contains("blk.0.ffn_up_exps.weight")
            && e.contains("missing"),
        "{e}"
    );
}
