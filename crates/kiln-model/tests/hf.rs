//! Hugging Face folders: the folder `export::write_hf_folder` makes from the default GGUF (the
//! code path of `cargo xtask fetch-model --hf`) reproduces the golden fixture on every backend,
//! loads with `--quantize q8_0`, and broken folders fail with one clear error each.
//!
//! Tolerances and the golden runner (all 6 prompts, 32 greedy steps) are `common/golden.rs`'s.
//! The F32 folder holds the GGUF's dequantized values exactly, so only the Q/K row order (undone
//! by the export, half-split RoPE at run time) and f32 summation order differ.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::{Path, PathBuf};

use kiln_attention::KvCache;
use kiln_kv::{BlockId, BlockManager, BlockManagerConfig, KvDtype, SeqConfig, SeqId};
use kiln_model::export::{HfExport, weight_shapes, write_hf_folder};
use kiln_model::{
    Arch, KvPoolConfig, LoadOptions, LogitsAt, Model, ModelConfig, ModelFiles, SeqInput, Weight,
};
use kiln_tensor::{DType, Device, Recorder, RopeLayout};
use serde_json::Value;

/// A folder under the system temp dir, removed when dropped (also on a failed assertion).
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("kiln-hf-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn hf_folder_from_gguf_matches_golden_on_every_backend_and_quantizes() {
    let dir = TempDir::new("golden");
    write_hf_folder(&common::model_path(), &dir.0, &HfExport::default()).unwrap();
    for f in [
        "config.json",
        "tokenizer_config.json",
        "generation_config.json",
        "model.safetensors",
    ] {
        assert!(dir.0.join(f).is_file(), "{f} not written");
    }
    let tc: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.0.join("tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(tc["eos_token"], "<|im_end|>");
    assert!(
        tc["chat_template"]
            .as_str()
            .unwrap()
            .contains("<|im_start|>")
    );

    let files = ModelFiles::open(&dir.0, LoadOptions::default()).unwrap();
    let cfg = files.config().clone();
    assert_eq!(
        (
            cfg.arch,
            cfg.layers,
            cfg.heads,
            cfg.kv_heads,
            cfg.head_dim,
            cfg.vocab
        ),
        (Arch::Llama, 30, 9, 3, 64, 49152)
    );
    assert_eq!(
        (
            cfg.rope_layout,
            cfg.tie_embeddings,
            cfg.rms_eps,
            cfg.attention[0].rope.theta
        ),
        (RopeLayout::HalfSplit, true, 1e-5, 100000.0)
    );
    assert!(
        !files.weights().has(Weight::LmHead),
        "tied embeddings: no lm_head.weight"
    );

    let cases = common::golden::cases();
    let mut f32_logits = Vec::new();
    for (name, dev) in common::devices() {
        let model = Model::load(&dev, cfg.clone(), files.weights()).unwrap();
        let logits = common::golden::run(name, model, 32);
        if name == "reference" {
            f32_logits = logits;
        }
    }

    // Load-time Q8_0 of the same folder, against its own F32 logits on the CPU.
    let q8 = ModelFiles::open(
        &dir.0,
        LoadOptions {
            dtype: None,
            quantize: Some(DType::Q8_0),
        },
    )
    .unwrap();
    let dev = Device::reference();
    let qmodel = Model::load(&dev, cfg.clone(), q8.weights()).unwrap();
    let fmodel = Model::load(&dev, cfg.clone(), files.weights()).unwrap();
    assert!(
        qmodel.weight_bytes() * 3 < fmodel.weight_bytes(),
        "Q8_0 weights are about 3.8x smaller than F32"
    );
    drop(fmodel);
    let kvc = cfg.kv_cache_config(KvPoolConfig {
        block_size: 16,
        num_blocks: 256,
        dtype: KvDtype::F32,
    });
    let mut cache = KvCache::new(&dev, kvc).unwrap();
    let mut kv = BlockManager::new(BlockManagerConfig::new(256)).unwrap();
    let seqs: Vec<SeqId> = (0..cases.len() as u64).map(SeqId).collect();
    for (s, c) in seqs.iter().zip(&cases) {
        kv.allocate(*s, &c.ids, SeqConfig::default()).unwrap();
    }
    let tables: Vec<&[BlockId]> = seqs.iter().map(|&s| kv.block_table(s).unwrap()).collect();
    let inputs: Vec<SeqInput<'_>> = cases
        .iter()
        .zip(&tables)
        .map(|(c, t)| SeqInput {
            tokens: &c.ids,
            block_table: t,
            context_len: c.ids.len(),
        })
        .collect();
    let mut rec = Recorder::new(&dev);
    let q_logits = qmodel
        .forward(&mut rec, &mut cache, &inputs, LogitsAt::All)
        .unwrap();
    rec.submit().unwrap();
    let q_logits = q_logits.to_f32_vec().unwrap();
    assert_eq!(q_logits.len(), f32_logits.len());
    let vocab = cfg.vocab;
    let (mut worst, mut sum, mut agree, mut confident) = (0f32, 0f64, 0usize, 0usize);
    for (q, f) in q_logits.chunks(vocab).zip(f32_logits.chunks(vocab)) {
        for (a, b) in q.iter().zip(f) {
            worst = worst.max((a - b).abs());
            sum += f64::from((a - b).abs());
        }
        let mut sorted = f.to_vec();
        sorted.sort_by(|a, b| b.total_cmp(a));
        if sorted[0] - sorted[1] >= 1.0 {
            confident += 1;
            agree += usize::from(common::golden::argmax(q) == common::golden::argmax(f));
        }
    }
    let mean = sum / q_logits.len() as f64;
    eprintln!(
        "q8_0 vs f32: max |diff| {worst}, mean |diff| {mean:.4}, argmax agreement {agree}/{confident} where the f32 margin >= 1"
    );
    // Re-quantizing the (Q4_1-derived) weights to Q8_0 rounds each to 1/254 of its block's
    // largest magnitude; over 30 layers that moves logits (O(10..30)) by, measured on the CPU
    // over every prompt position of the fixture: max 1.32, mean 0.13, no confident argmax
    // flipped. The bounds leave ~2x headroom; a wrong block layout or scale is off by whole
    // units everywhere and flips argmaxes.
    assert!(
        worst < 2.5 && mean < 0.25,
        "q8_0 logits drift: max {worst}, mean {mean}"
    );
    assert_eq!(agree, confident, "q8_0 changed a confident argmax");
}

// ---- broken folders: a tiny model written by hand ----

const TINY_CONFIG: &str = r#"{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1,
  "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 96,
  "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": true,
  "max_position_embeddings": 64}"#;

/// (name, dtype string, shape, bytes)
type RawTensor = (String, String, Vec<usize>, Vec<u8>);

fn raw_safetensors(tensors: &[RawTensor]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut off = 0;
    for (name, dtype, shape, data) in tensors {
        header.insert(name.clone(), serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [off, off + data.len()]}));
        off += data.len();
    }
    let json = serde_json::to_vec(&Value::Object(header)).unwrap();
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend(json);
    for t in tensors {
        out.extend(&t.3);
    }
    out
}

fn tiny_tensors() -> Vec<RawTensor> {
    let cfg = ModelConfig::from_hf_json("config.json", TINY_CONFIG).unwrap();
    weight_shapes(&cfg, false)
        .into_iter()
        .map(|(w, shape)| {
            let n: usize = shape.iter().product();
            let bytes = (0..n)
                .flat_map(|i| ((i % 7) as f32 * 0.01).to_le_bytes())
                .collect();
            (w.hf_name(), "F32".to_string(), shape, bytes)
        })
        .collect()
}

fn tiny_folder(dir: &Path, tensors: &[RawTensor]) {
    std::fs::write(dir.join("config.json"), TINY_CONFIG).unwrap();
    std::fs::write(dir.join("model.safetensors"), raw_safetensors(tensors)).unwrap();
}

/// Open + load on the CPU; the error as text.
fn load_err(dir: &Path) -> String {
    let r = ModelFiles::open(dir, LoadOptions::default()).and_then(|f| {
        Model::load(&Device::reference(), f.config().clone(), f.weights()).map(|_| ())
    });
    r.unwrap_err().to_string()
}

fn assert_has(e: &str, needles: &[&str]) {
    for n in needles {
        assert!(e.contains(n), "error lacks `{n}`: {e}");
    }
}

#[test]
fn tiny_folder_loads_single_sharded_and_with_options() {
    let dir = TempDir::new("tiny-ok");
    tiny_folder(&dir.0, &tiny_tensors());
    let f = ModelFiles::open(&dir.0, LoadOptions::default()).unwrap();
    let f32_model = Model::load(&Device::reference(), f.config().clone(), f.weights()).unwrap();
    for opts in [
        LoadOptions {
            dtype: Some(DType::F16),
            quantize: None,
        },
        LoadOptions {
            dtype: None,
            quantize: Some(DType::Q4_1),
        },
    ] {
        let f = ModelFiles::open(&dir.0, opts).unwrap();
        let m = Model::load(&Device::reference(), f.config().clone(), f.weights()).unwrap();
        assert!(m.weight_bytes() < f32_model.weight_bytes(), "{opts:?}");
    }
    // Two shards and an index instead of one file.
    std::fs::remove_file(dir.0.join("model.safetensors")).unwrap();
    let all = tiny_tensors();
    let (a, b) = (all[..4].to_vec(), all[4..].to_vec());
    std::fs::write(
        dir.0.join("model-00001-of-00002.safetensors"),
        raw_safetensors(&a),
    )
    .unwrap();
    std::fs::write(
        dir.0.join("model-00002-of-00002.safetensors"),
        raw_safetensors(&b),
    )
    .unwrap();
    let mut map = serde_json::Map::new();
    for (t, file) in a.iter().map(|t| (t, 1)).chain(b.iter().map(|t| (t, 2))) {
        map.insert(
            t.0.clone(),
            format!("model-0000{file}-of-00002.safetensors").into(),
        );
    }
    std::fs::write(
        dir.0.join("model.safetensors.index.json"),
        serde_json::json!({"weight_map": map}).to_string(),
    )
    .unwrap();
    let f = ModelFiles::open(&dir.0, LoadOptions::default()).unwrap();
    let m = Model::load(&Device::reference(), f.config().clone(), f.weights()).unwrap();
    assert_eq!(m.weight_bytes(), f32_model.weight_bytes());
    // A shard the index names but the folder lacks.
    std::fs::remove_file(dir.0.join("model-00002-of-00002.safetensors")).unwrap();
    assert_has(&load_err(&dir.0), &["model-00002-of-00002.safetensors"]);
    // Casting options a GGUF file does not take.
    let e = ModelFiles::open(
        &common::model_path(),
        LoadOptions {
            dtype: Some(DType::F16),
            quantize: None,
        },
    )
    .unwrap_err()
    .to_string();
    assert_has(&e, &["Hugging Face folders"]);
}

#[test]
fn broken_folders_fail_with_one_clear_error() {
    let dir = TempDir::new("tiny-bad");
    let good = raw_safetensors(&tiny_tensors());

    // Truncated inside the header.
    tiny_folder(&dir.0, &tiny_tensors());
    std::fs::write(dir.0.join("model.safetensors"), &good[..40]).unwrap();
    assert_has(&load_err(&dir.0), &["model.safetensors", "truncated"]);
    // Truncated inside the data.
    std::fs::write(dir.0.join("model.safetensors"), &good[..good.len() - 10]).unwrap();
    assert_has(
        &load_err(&dir.0),
        &["model.safetensors", "run past the end"],
    );
    // Header bytes overwritten.
    let mut corrupt = good.clone();
    corrupt[8..20].copy_from_slice(b"\x00garbage!!!!");
    std::fs::write(dir.0.join("model.safetensors"), &corrupt).unwrap();
    assert_has(
        &load_err(&dir.0),
        &["model.safetensors", "header is not a JSON object"],
    );
    // A header length far past the end.
    let mut huge = good.clone();
    huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(dir.0.join("model.safetensors"), &huge).unwrap();
    assert_has(
        &load_err(&dir.0),
        &["model.safetensors", "truncated or corrupt header"],
    );

    // A missing tensor.
    let mut t = tiny_tensors();
    t.retain(|x| x.0 != "model.layers.0.mlp.up_proj.weight");
    tiny_folder(&dir.0, &t);
    assert_has(
        &load_err(&dir.0),
        &["model.layers.0.mlp.up_proj.weight", "missing"],
    );

    // config.json disagreeing with the stored shape.
    tiny_folder(&dir.0, &tiny_tensors());
    std::fs::write(
        dir.0.join("config.json"),
        TINY_CONFIG.replace("\"intermediate_size\": 128", "\"intermediate_size\": 96"),
    )
    .unwrap();
    assert_has(
        &load_err(&dir.0),
        &[
            "model.layers.0.mlp.gate_proj.weight",
            "[128, 64]",
            "[96, 64]",
        ],
    );

    // An integer dtype.
    let mut t = tiny_tensors();
    let e = t
        .iter_mut()
        .find(|x| x.0 == "model.layers.0.self_attn.v_proj.weight")
        .unwrap();
    e.1 = "I32".into();
    tiny_folder(&dir.0, &t);
    assert_has(
        &load_err(&dir.0),
        &[
            "model.layers.0.self_attn.v_proj.weight",
            "dtype I32 is not supported",
        ],
    );

    // No weights at all.
    std::fs::remove_file(dir.0.join("model.safetensors")).unwrap();
    assert_has(&load_err(&dir.0), &["model.safetensors"]);
    // No config.json.
    std::fs::remove_file(dir.0.join("config.json")).unwrap();
    assert_has(&load_err(&dir.0), &["config.json"]);
}
