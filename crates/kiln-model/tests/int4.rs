//! INT4/INT8 Hugging Face checkpoints — GPTQ (GPTQModel's `gptq` format: symmetric and not,
//! groups of 32 and whole rows, act-order, 8-bit), AWQ (AutoAWQ's GEMM packing) and
//! compressed-tensors `pack-quantized` (W4A16 symmetric and asymmetric, W8A16 per channel,
//! a legacy act-order `weight_g_idx` with a different order per weight) — written by the
//! libraries themselves (`scripts/make_int4_fixtures.py`):
//! - kiln's blocks dequantize to exactly the library's dequantization (f32 scales: the exact
//!   products (q − z)·scale), and stay packed on the device in the smallest exact block dtype;
//! - the model's logits at every prompt position and 12 greedy tokens match `transformers`
//!   float32 on the same dequantized weights, on the CPU reference and both wgpu kernel
//!   families. Tolerance 2e-5 + 2e-5·|ref| as `tests/architectures.rs`: the same f32 values,
//!   summed in another order. The native CPU backend (8-bit activations) within
//!   `NATIVE_TOL`, its greedy ids until its own margin says the reference could differ.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::PathBuf;

use kiln_attention::KvCache;
use kiln_kv::{BlockId, KvDtype};
use kiln_model::{
    KvPoolConfig, LoadOptions, LogitsAt, Model, ModelConfig, ModelFiles, SafetensorsFile, SeqInput,
    Weight,
};
use kiln_tensor::{DType, Device, Recorder};
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/int4")
        .join(name)
}

/// The native CPU backend's bound (absolute and relative): its matmuls quantize X to 8 bits a
/// 32-element block, which moved these tiny random models' logits by at most 0.059 (measured
/// over every fixture and prompt; f32 backends: under 2e-5).
const NATIVE_TOL: f32 = 0.1;

fn devices() -> Vec<(&'static str, Device)> {
    let mut v = common::devices();
    v.extend(kiln_testkit::wgpu_other_kernels().map(|d| ("wgpu (other kernels)", d)));
    v
}

/// The seven projections of layer `l` with their `[out, in]` shapes.
fn projections(cfg: &ModelConfig, l: usize) -> [(Weight, [usize; 2]); 7] {
    let (h, qd, kvd) = (
        cfg.hidden,
        cfg.heads * cfg.head_dim,
        cfg.kv_heads * cfg.head_dim,
    );
    [
        (Weight::Q(l), [qd, h]),
        (Weight::K(l), [kvd, h]),
        (Weight::V(l), [kvd, h]),
        (Weight::O(l), [h, qd]),
        (Weight::Gate(l), [cfg.ffn, h]),
        (Weight::Up(l), [cfg.ffn, h]),
        (Weight::Down(l), [h, cfg.ffn]),
    ]
}

/// Loads the fixture, checks layer 0's weights against the library's dequantization bit for
/// bit, that every projection is `want` (its packed size on the device), and whether the
/// checkpoint's act-order permutes inputs; then runs it against the reference.
fn check(name: &str, want: DType, permuted: bool) {
    let files = ModelFiles::open(&fixture(name), LoadOptions::default()).unwrap();
    let cfg = files.config().clone();
    let src = files.weights();
    let deq = SafetensorsFile::open(&fixture(name).join("dequant.safetensors")).unwrap();
    let mut any_perm = false;
    let mut packed_bytes = 0u64;
    for l in 0..cfg.layers {
        for (w, [rows, cols]) in projections(&cfg, l) {
            let lin = src
                .load_linear(&Device::Reference, w, &[rows, cols])
                .unwrap();
            assert_eq!(lin.weight.dtype(), want, "{name}: {w:?}");
            packed_bytes += want.bytes_for(rows * cols).unwrap() as u64;
            any_perm |= lin.input_perm.is_some();
            if l > 0 {
                continue;
            }
            let got = lin.weight.to_f32_vec().unwrap();
            let reference = deq.read_f32(&w.hf_name()).unwrap();
            assert_eq!(reference.len(), rows * cols);
            for r in 0..rows {
                for j in 0..cols {
                    let c = lin.input_perm.as_ref().map_or(j, |p| p[j] as usize);
                    let (g, e) = (got[r * cols + j], reference[r * cols + c]);
                    assert!(
                        g.to_bits() == e.to_bits(),
                        "{name}: {w:?} [{r}, {c}]: kiln {g} vs library {e}"
                    );
                }
            }
        }
    }
    assert_eq!(any_perm, permuted, "{name}: input permutation");

    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture(name).join("reference.json")).unwrap(),
    )
    .unwrap();
    for (backend, dev) in devices() {
        let model = Model::load(&dev, cfg.clone(), src).unwrap();
        // The packed projections plus, at most, the embedding, head and norms at 4 bytes a
        // value and a 4-byte index per input column of each projection.
        let floats = (2 * cfg.vocab * cfg.hidden + (2 * cfg.layers + 1) * cfg.hidden) as u64;
        let perms = (7 * 4 * cfg.ffn * cfg.layers) as u64;
        assert!(
            model.weight_bytes() >= packed_bytes
                && model.weight_bytes() <= packed_bytes + 4 * floats + perms,
            "{name}: {} weight bytes for {packed_bytes} packed",
            model.weight_bytes()
        );
        for (pi, p) in reference["prompts"].as_array().unwrap().iter().enumerate() {
            run_prompt(&model, &dev, p, &format!("{name} {backend} prompt {pi}"));
        }
    }
}

/// The prompt's logits at every position, then greedy decoding one token a step through the
/// paged cache.
fn run_prompt(model: &Model, dev: &Device, p: &Value, what: &str) {
    let cfg = model.config();
    let prompt = common::tiny::ids(&p["input_ids"]);
    let greedy = common::tiny::ids(&p["greedy"]);
    let want = common::tiny::logits(&p["logits"]);
    let kvc = cfg.kv_cache_config(KvPoolConfig {
        block_size: 16,
        num_blocks: 4,
        dtype: KvDtype::F32,
    });
    let mut cache = KvCache::new(dev, kvc).unwrap();
    let table = [3, 1, 0].map(BlockId);
    let mut step = |tokens: &[u32], context_len: usize, at: LogitsAt<'_>| {
        let mut rec = Recorder::new(dev);
        let logits = model
            .forward(
                &mut rec,
                &mut cache,
                &[SeqInput {
                    tokens,
                    block_table: &table,
                    context_len,
                }],
                at,
            )
            .unwrap();
        rec.submit().unwrap();
        logits.to_f32_vec().unwrap()
    };
    let got = step(&prompt, prompt.len(), LogitsAt::All);
    let tol = match dev {
        Device::Cpu(_) => NATIVE_TOL,
        Device::Reference | Device::Wgpu(_) => 2e-5,
    };
    common::tiny::assert_logits_within(&got, &want, cfg.vocab, what, tol);
    // Greedy ids must equal the reference's. Within `tol` of it, a pick whose own top-1/top-2
    // margin is at least 2·tol(top) is the reference's pick too; below that the two may
    // legitimately part, and the comparison stops there. Only the native backend's bound
    // leaves room for that: f32 backends compare every token.
    let native = matches!(dev, Device::Cpu(_));
    let tie = |row: &[f32]| {
        if !native {
            return false;
        }
        let mut s = row.to_vec();
        s.sort_by(|a, b| b.total_cmp(a));
        s[0] - s[1] < 2.0 * (tol + tol * s[0].abs())
    };
    let argmax = common::golden::argmax;
    // Picks until the first whose row is tied (that pick itself may differ).
    let mut row = got[got.len() - cfg.vocab..].to_vec();
    let mut tokens = Vec::new();
    while tokens.len() < greedy.len() && !tie(&row) {
        tokens.push(argmax(&row));
        if tokens.len() < greedy.len() {
            row = step(
                &[*tokens.last().unwrap()],
                prompt.len() + tokens.len(),
                LogitsAt::Last,
            );
        }
    }
    let n = tokens.len();
    assert_eq!(tokens, greedy[..n], "{what}: greedy tokens");
}

#[test]
fn gptq_4bit_symmetric_groups_of_32_load_as_q4_0() {
    check("gptq_w4_sym_g32", DType::Q4_0, false);
}

#[test]
fn gptq_4bit_asymmetric_groups_of_32() {
    check("gptq_w4_asym_g32", DType::Q4_Z, false);
}

#[test]
fn gptq_4bit_asymmetric_whole_rows() {
    check("gptq_w4_asym_rows", DType::Q4_Z, false);
}

#[test]
fn gptq_4bit_act_order_gathers_inputs() {
    check("gptq_w4_desc_act", DType::Q4_Z, true);
}

#[test]
fn gptq_8bit_symmetric_loads_as_q8_0() {
    check("gptq_w8_sym_g32", DType::Q8_0, false);
}

#[test]
fn gptq_8bit_asymmetric() {
    check("gptq_w8_asym_g32", DType::Q8_Z, false);
}

#[test]
fn awq_gemm_4bit_groups_of_32() {
    check("awq_w4_g32", DType::Q4_Z, false);
}

#[test]
fn compressed_tensors_w4a16_symmetric_loads_as_q4_0() {
    check("ct_w4a16_sym_g32", DType::Q4_0, false);
}

#[test]
fn compressed_tensors_w4a16_asymmetric() {
    check("ct_w4a16_asym_g32", DType::Q4_Z, false);
}

#[test]
fn compressed_tensors_w8a16_asymmetric_per_channel() {
    check("ct_w8a16_asym_channel", DType::Q8_Z, false);
}

#[test]
fn compressed_tensors_act_order_with_an_order_per_weight() {
    check("ct_w4a16_actorder", DType::Q4_0, true);
}

/// A copy of fixture `name` in a temp folder, removed when dropped.
struct Copy(PathBuf);

impl Copy {
    fn of(name: &str, tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("kiln-int4-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(fixture(name).join(f), dir.join(f)).unwrap();
        }
        Self(dir)
    }

    fn edit_config(&self, edit: impl FnOnce(&mut Value)) {
        let p = self.0.join("config.json");
        let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        edit(&mut v["quantization_config"]);
        std::fs::write(&p, v.to_string()).unwrap();
    }

    /// Rewrites bytes of the safetensors file: its header text with `header`, and the first
    /// 4 data bytes of tensor `tensor` with `first`.
    fn edit_weights(&self, header: (&str, &str), tensor: &str, first: Option<[u8; 4]>) {
        let p = self.0.join("model.safetensors");
        let mut b = std::fs::read(&p).unwrap();
        let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
        let text = String::from_utf8(b[8..8 + n].to_vec()).unwrap();
        let edited = text.replacen(header.0, header.1, 1);
        assert_eq!(edited.len(), text.len(), "header edits keep the length");
        b[8..8 + n].copy_from_slice(edited.as_bytes());
        if let Some(first) = first {
            let h: Value = serde_json::from_str(&text).unwrap();
            let start = 8 + n + h[tensor]["data_offsets"][0].as_u64().unwrap() as usize;
            b[start..start + 4].copy_from_slice(&first);
        }
        std::fs::write(&p, b).unwrap();
    }

    fn load(&self) -> Result<(), kiln_model::ModelError> {
        let files = ModelFiles::open(&self.0, LoadOptions::default())?;
        Model::load(&Device::Reference, files.config().clone(), files.weights()).map(|_| ())
    }
}

impl Drop for Copy {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn unsupported_quantization_configs_name_config_json_and_the_field() {
    type Edit = fn(&mut Value);
    let cases: [(&str, &str, Edit, &str); 6] = [
        (
            "gptq_w4_asym_g32",
            "bits",
            |q| q["bits"] = 3.into(),
            "3-bit",
        ),
        (
            "gptq_w4_asym_g32",
            "quant_method",
            |q| q["quant_method"] = "hqq".into(),
            "hqq",
        ),
        (
            "gptq_w4_asym_g32",
            "group_size",
            |q| q["group_size"] = 48.into(),
            "multiple of 32",
        ),
        (
            "gptq_w4_asym_g32",
            "format",
            |q| q["format"] = "marlin".into(),
            "marlin",
        ),
        (
            "awq_w4_g32",
            "version",
            |q| q["version"] = "gemv".into(),
            "gemv",
        ),
        (
            "ct_w4a16_sym_g32",
            "config_groups.group_0.format",
            |q| q["config_groups"]["group_0"]["format"] = "float-quantized".into(),
            "float-quantized",
        ),
    ];
    for (name, field, edit, what) in cases {
        let c = Copy::of(name, "cfg");
        c.edit_config(edit);
        let e = c.load().unwrap_err().to_string();
        assert!(
            e.contains("config.json")
                && e.contains(&format!("`quantization_config.{field}`"))
                && e.contains(what),
            "{name} {field}: {e}"
        );
    }
}

#[test]
fn bad_quantized_tensors_name_the_file_and_tensor() {
    let q = "model.layers.0.self_attn.q_proj";
    // Scales and zeros for groups of 32, config.json says 64.
    let c = Copy::of("gptq_w4_asym_g32", "groups");
    c.edit_config(|q| q["group_size"] = 64.into());
    let e = c.load().unwrap_err().to_string();
    assert!(
        e.contains("model.safetensors")
            && e.contains(&format!("`{q}.qzeros`"))
            && e.contains("shape"),
        "{e}"
    );
    // A group index past the last group.
    let c = Copy::of("gptq_w4_desc_act", "gidx");
    c.edit_weights(("", ""), &format!("{q}.g_idx"), Some(99i32.to_le_bytes()));
    let e = c.load().unwrap_err().to_string();
    assert!(
        e.contains(&format!("`{q}.g_idx`")) && e.contains("group 99"),
        "{e}"
    );
    // Zeros stored as floats.
    let c = Copy::of("gptq_w4_asym_g32", "dtype");
    let entry = format!(r#""{q}.qzeros":{{"dtype":"I32""#);
    c.edit_weights((&entry, &entry.replace("I32", "F32")), q, None);
    let e = c.load().unwrap_err().to_string();
    assert!(
        e.contains(&format!("`{q}.qzeros`")) && e.contains("dtype F32"),
        "{e}"
    );
    // compressed-tensors: a packed width that disagrees with the layer.
    let c = Copy::of("ct_w4a16_asym_g32", "ct");
    c.edit_weights(
        ("", ""),
        &format!("{q}.weight_shape"),
        Some(63i32.to_le_bytes()),
    );
    let e = c.load().unwrap_err().to_string();
    assert!(
        e.contains(&format!("`{q}.weight_shape`")) && e.contains("[63, 64]"),
        "{e}"
    );
}
