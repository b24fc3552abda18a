//! DeepSeek-V4's KV cache on paper: the bytes one sequence holds at 1M tokens, from V4-Flash's
//! published config (the hub's names) and from transformers' default config (its own names,
//! V4-Pro's layer schedule), beside a dense-attention model of the same shape and
//! DeepSeek-V3.2's MLA cache (transformers' `DeepseekV32Config`). The configs are fixtures made
//! by `scripts/make_deepseek_v4_kv_fixtures.py`, which has transformers read V4-Flash's back.
//! The published claim is that V4 needs about 10% of V3.2's KV cache at 1M tokens.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

use kiln_kv::{CacheKind, KvDtype, KvLayout, LayerCache};
use kiln_model::{DeepseekV4Config, ModelError, V4Attention};

fn fixture(name: &str) -> (String, String) {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/deepseek_v4")
        .join(name);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    (p.display().to_string(), text)
}

fn v4(name: &str) -> DeepseekV4Config {
    let (file, text) = fixture(name);
    DeepseekV4Config::from_hf_json(&file, &text).unwrap()
}

const MILLION: u64 = 1 << 20;
const GIB: f64 = (1u64 << 30) as f64;

/// The same layers with ordinary attention over one K=V head of `head_dim` (the comparison
/// the architecture invites: only the compression differs).
fn dense_shared_kv(layers: u32, head_dim: u32) -> KvLayout {
    let mut l = KvLayout::dense(layers, 1, head_dim);
    for c in &mut l.caches {
        c.vectors = 1;
    }
    l
}

fn kinds(cfg: &DeepseekV4Config) -> (usize, usize, usize) {
    let count = |f: fn(&V4Attention) -> bool| cfg.attention.iter().filter(|a| f(a)).count();
    (
        count(|a| matches!(a, V4Attention::Sliding)),
        count(|a| matches!(a, V4Attention::Csa { .. })),
        count(|a| matches!(a, V4Attention::Hca { .. })),
    )
}

#[test]
fn both_configs_read_as_transformers_reads_them() {
    let flash = v4("v4_flash_config.json");
    assert_eq!(
        kinds(&flash),
        (2, 21, 20),
        "V4-Flash: 2 sliding, 21 CSA, 20 HCA"
    );
    assert_eq!(flash.attention[2], V4Attention::Csa { ratio: 4 });
    assert_eq!(flash.attention[3], V4Attention::Hca { ratio: 128 });
    assert_eq!(
        (flash.rope_dim, flash.moe.hash_layers, flash.window),
        (64, 3, 128)
    );
    assert_eq!(flash.compress_rope_theta, 160_000.0);
    let kiln_tensor::RopeScaling::Yarn {
        factor,
        original_max_position,
        attention_factor,
        ..
    } = flash.compress_scaling
    else {
        panic!("{:?}", flash.compress_scaling)
    };
    assert_eq!(
        (factor, original_max_position, attention_factor),
        (16.0, 65536, 1.0)
    );
    // transformers' default: V4-Pro's schedule (three HCA, then CSA and HCA alternating).
    let pro = v4("transformers_default_config.json");
    assert_eq!(kinds(&pro), (0, 20, 23));
    assert_eq!(
        &pro.attention[..4],
        &[
            V4Attention::Hca { ratio: 128 },
            V4Attention::Hca { ratio: 128 },
            V4Attention::Hca { ratio: 128 },
            V4Attention::Csa { ratio: 4 }
        ]
    );
    assert_eq!(
        (pro.rope_dim, pro.moe.hash_layers, pro.rope_theta),
        (64, 3, 10_000.0)
    );
    // Everything else the two configs state is the same model.
    let same = DeepseekV4Config {
        attention: flash.attention.clone(),
        compress_scaling: flash.compress_scaling,
        ..pro.clone()
    };
    assert_eq!(same, flash);
}

#[test]
fn kv_bytes_at_one_million_tokens_against_dense_attention_and_v3_2() {
    let flash = v4("v4_flash_config.json");
    let pro = v4("transformers_default_config.json");
    let (_, v32_text) = fixture("v32_default_config.json");
    let v32: serde_json::Value = serde_json::from_str(&v32_text).unwrap();
    let n = |k: &str| v32[k].as_u64().unwrap() as u32;
    let mla = KvLayout::mla(
        n("num_hidden_layers"),
        n("kv_lora_rank"),
        n("qk_rope_head_dim"),
        n("index_head_dim"),
    );
    let dt = KvDtype::F16;
    let rows = [
        ("DeepSeek-V4-Flash", flash.kv_layout()),
        (
            "DeepSeek-V4 (transformers' default, V4-Pro's schedule)",
            pro.kv_layout(),
        ),
        (
            "dense attention, V4-Flash's shape (one K=V head)",
            dense_shared_kv(43, 512),
        ),
        (
            "dense attention, V4-Flash's shape (K and V)",
            KvLayout::dense(43, 1, 512),
        ),
        ("DeepSeek-V3.2 (MLA latent + indexer key)", mla.clone()),
    ];
    println!("| model | values a token | bytes at 2^20 tokens (16-bit) | share of V3.2 |");
    println!("| --- | ---: | ---: | ---: |");
    let v32_bytes = mla.bytes_at(MILLION, dt) as f64;
    for (name, l) in &rows {
        let b = l.bytes_at(MILLION, dt) as f64;
        println!(
            "| {name} | {} | {:.2} GiB | {:.1}% |",
            l.values_per_token(),
            b / GIB,
            100.0 * b / v32_bytes
        );
    }
    // The arithmetic of llama.cpp's layout (`llama_kv_cache_dsv4`), by hand: 21 CSA layers
    // of (512 + 128) / 4 and 20 HCA layers of 512 / 128 values a token.
    assert_eq!(flash.kv_layout().values_per_token(), 3440.0);
    assert_eq!(
        pro.kv_layout().values_per_token(),
        20.0 * 160.0 + 23.0 * 4.0
    );
    assert_eq!(dense_shared_kv(43, 512).values_per_token(), 22_016.0);
    assert_eq!(mla.values_per_token(), 61.0 * (512.0 + 64.0 + 128.0));
    // What does not grow: 43 windows of 128 rows, and the compressors' pending windows.
    let fl = flash.kv_layout();
    let window = fl.kind_bytes(CacheKind::Window, MILLION, dt);
    assert_eq!(window, 43 * 128 * 512 * 2);
    let state = fl.kind_bytes(CacheKind::CompressorState, MILLION, dt);
    assert_eq!(
        state,
        21 * (8 * 1024 * 2 * 4 + 8 * 256 * 2 * 4) + 20 * 128 * 512 * 2 * 4
    );
    assert_eq!(state, fl.kind_bytes(CacheKind::CompressorState, 1, dt));
    let share = fl.bytes_at(MILLION, dt) as f64 / v32_bytes;
    println!(
        "V4-Flash holds {:.1}% of V3.2's KV bytes at 2^20 tokens (published: about 10%); \
         {:.1}% of dense attention with one K=V head",
        100.0 * share,
        100.0 * fl.bytes_at(MILLION, dt) as f64
            / dense_shared_kv(43, 512).bytes_at(MILLION, dt) as f64
    );
    assert!((0.079..0.082).contains(&share), "{share}");
}

/// Where a file names a thing twice, transformers' reading wins: `partial_rotary_factor` over
/// `qk_rope_head_dim`, `num_local_experts` over `n_routed_experts`, `intermediate_size` over
/// `moe_intermediate_size`, the legacy `compress_rate_csa` over `compress_rates`,
/// `rope_scaling` over `rope_parameters`.
#[test]
fn names_given_twice_resolve_as_transformers_resolves_them() {
    let (file, text) = fixture("v4_flash_config.json");
    let mut c: serde_json::Value = serde_json::from_str(&text).unwrap();
    c["partial_rotary_factor"] = 0.25.into();
    c["num_local_experts"] = 128.into();
    c["intermediate_size"] = 1024.into();
    c["compress_rates"] = serde_json::json!({
        "compressed_sparse_attention": 8,
        "heavily_compressed_attention": 64
    });
    c["compress_rate_csa"] = 16.into();
    c["rope_parameters"] =
        serde_json::json!({"main": {"rope_theta": 777.0}, "compress": {"rope_theta": 123.0}});
    let v = DeepseekV4Config::from_hf_json(&file, &c.to_string()).unwrap();
    assert_eq!(v.rope_dim, 128);
    assert_eq!((v.moe.experts, v.moe.expert_ffn), (128, 1024));
    assert_eq!(v.attention[2], V4Attention::Csa { ratio: 16 });
    assert_eq!(v.attention[3], V4Attention::Hca { ratio: 64 });
    assert_eq!((v.rope_theta, v.compress_rope_theta), (10_000.0, 160_000.0));
}

#[test]
fn keys_kiln_cannot_honour_are_refused_by_name() {
    let (file, text) = fixture("v4_flash_config.json");
    let base: serde_json::Value = serde_json::from_str(&text).unwrap();
    let with = |k: &str, v: serde_json::Value| {
        let mut c = base.clone();
        c[k] = v;
        DeepseekV4Config::from_hf_json(&file, &c.to_string()).unwrap_err()
    };
    let field = |e: ModelError| match e {
        ModelError::Config { field, problem, .. } => format!("{field}: {problem}"),
        other => panic!("{other}"),
    };
    assert!(field(with("scoring_func", "softmax".into())).starts_with("scoring_func: `softmax`"));
    assert!(field(with("num_key_value_heads", 8.into())).starts_with("num_key_value_heads: 8"));
    let mut ratios = base["compress_ratios"].clone();
    ratios[5] = 16.into();
    assert!(field(with("compress_ratios", ratios)).starts_with("compress_ratios[5]: 16"));
    assert!(
        field(with("compress_ratios", serde_json::json!([0, 4]))).starts_with("compress_ratios:")
    );
    assert!(
        field(with(
            "layer_types",
            serde_json::json!(vec!["full_attention"; 43])
        ))
        .starts_with("layer_types[0]")
    );
    assert!(field(with("o_groups", 7.into())).starts_with("o_groups: 7 does not divide 64"));
    // Sizes the kernels bound, refused at load rather than at the first step.
    assert!(field(with("index_topk", 0.into())).starts_with("index_topk: 0 is outside"));
    assert!(field(with("hc_mult", 9.into())).starts_with("hc_mult: 9 is outside 1..=8"));
    assert!(field(with("hc_sinkhorn_iters", 0.into())).starts_with("hc_sinkhorn_iters: 0"));
    assert!(field(with("head_dim", 2048.into())).starts_with("head_dim: 2048 is outside 1..=1024"));
    assert!(field(with("num_experts_per_tok", 300.into())).starts_with("num_experts_per_tok: 300"));
    assert!(field(with("q_lora_rank", 0.into())).starts_with("q_lora_rank: 0"));
    assert!(field(with("attention_bias", true.into())).starts_with("attention_bias"));
    assert!(
        field(with(
            "rope_scaling",
            serde_json::json!({"type": "linear", "factor": 2.0})
        ))
        .starts_with("rope_scaling")
    );
    assert!(field(with("model_type", "deepseek_v3".into())).starts_with("model_type"));
    // Where transformers and llama.cpp read a key differently, only their common value.
    assert!(field(with("norm_topk_prob", false.into())).starts_with("norm_topk_prob"));
    assert!(field(with("n_shared_experts", 2.into())).starts_with("n_shared_experts: 2"));
    assert!(field(with("mlp_bias", true.into())).starts_with("mlp_bias"));
    let mut yarn = base["rope_scaling"].clone();
    yarn["attention_factor"] = 1.3.into();
    assert!(field(with("rope_scaling", yarn)).starts_with("rope_scaling.attention_factor: 1.3"));
    assert!(field(with("compress_rates", 4.into())).starts_with("compress_rates: 4"));
    assert!(
        field(with(
            "compress_rates",
            serde_json::json!({"compressed_sparse_attention": 8})
        ))
        .starts_with("compress_rates.heavily_compressed_attention: missing")
    );
    let (pro_file, pro_text) = fixture("transformers_default_config.json");
    let mut half: serde_json::Value = serde_json::from_str(&pro_text).unwrap();
    half["rope_parameters"]
        .as_object_mut()
        .unwrap()
        .remove("compress");
    let e = DeepseekV4Config::from_hf_json(&pro_file, &half.to_string()).unwrap_err();
    assert!(field(e).starts_with("rope_parameters.compress: missing"));
    assert!(
        field(with(
            "mlp_layer_types",
            serde_json::json!(["hash_moe", "moe"])
        ))
        .starts_with("mlp_layer_types")
    );
    // The window and state caches are the layout's only fixed parts.
    let l = v4("v4_flash_config.json").kv_layout();
    assert!(l.caches.iter().all(|c: &LayerCache| matches!(
        c.kind,
        CacheKind::Window
            | CacheKind::Compressed
            | CacheKind::IndexerKeys
            | CacheKind::CompressorState
    )));
}
