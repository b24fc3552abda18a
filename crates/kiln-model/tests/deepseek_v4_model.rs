//! A whole DeepSeek-V4 model against transformers' `DeepseekV4ForCausalLM` (a tiny random
//! checkpoint with sliding, CSA and HCA layers and a hash-routed first MoE layer, saved by
//! transformers; goldens by `scripts/make_deepseek_v4_module_fixtures.py`, float32), on every
//! backend: the logits of 173 tokens run in chunks (boundaries inside compression windows,
//! single-token steps, past HCA's first window of 128) and greedy continuations token for
//! token, from the Hugging Face folder and from llama.cpp's converter's GGUFs of it (F32 with
//! MXFP4 experts; FP8 linears as Q8_0, beside llama.cpp's run of the same file); and bad
//! checkpoints refused by name.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

use kiln_model::v4::{V4Model, V4Sequence};
use kiln_model::{SafetensorsFile, StDtype, encode_safetensors};
use kiln_tensor::{Device, Recorder};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepseek_v4")
}

fn golden() -> SafetensorsFile {
    SafetensorsFile::open(&fixtures().join("model_golden.safetensors")).unwrap()
}

fn ids(g: &SafetensorsFile, name: &str) -> Vec<u32> {
    g.read_f32(name)
        .unwrap()
        .iter()
        .map(|&v| v as u32)
        .collect()
}

/// The chunks transformers ran the tokens in.
fn chunks(g: &SafetensorsFile) -> Vec<usize> {
    g.read_f32("chunks")
        .unwrap()
        .iter()
        .map(|&v| v as usize)
        .collect()
}

/// The logits of the golden's tokens, run in its chunks by the model at `path` on `dev`.
fn chunked_logits(g: &SafetensorsFile, path: &Path, dev: &Device) -> Vec<f32> {
    let tokens = ids(g, "input_ids");
    let model = V4Model::load(path, dev, 256).unwrap();
    let mut seq = V4Sequence::default();
    let (mut start, mut got) = (0, Vec::new());
    for n in chunks(g) {
        let mut rec = Recorder::new(dev);
        let logits = model
            .forward(&mut rec, &tokens[start..start + n], &mut seq)
            .unwrap();
        rec.submit().unwrap();
        got.extend(logits.to_f32_vec().unwrap());
        start += n;
    }
    assert_eq!(seq.len(), tokens.len());
    got
}

/// Largest |a - b| and the rows whose argmax differs, of two `[rows, vocab]` logit sets.
fn distance(a: &[f32], b: &[f32], vocab: usize) -> (f32, usize) {
    let argmax = |r: &[f32]| (0..r.len()).fold(0, |m, i| if r[i] > r[m] { i } else { m });
    let rows = a
        .chunks(vocab)
        .zip(b.chunks(vocab))
        .filter(|(x, y)| argmax(x) != argmax(y))
        .count();
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    (worst, rows)
}

/// Greedy tokens of the golden's three prompts that differ from transformers' (`gen.greedy.i`):
/// the model's on `dev`, or, without one, those the golden holds under `other.greedy.i`.
fn greedy_differing(g: &SafetensorsFile, model: Option<(&V4Model, &Device)>, other: &str) -> usize {
    (0..3)
        .map(|i| {
            let want = ids(g, &format!("gen.greedy.{i}"));
            let got = match model {
                Some((m, dev)) => {
                    let prompt = ids(g, &format!("gen.prompt.{i}"));
                    m.generate_greedy(dev, &prompt, want.len()).unwrap()
                }
                None => ids(g, &format!("{other}.greedy.{i}")),
            };
            got.iter().zip(&want).filter(|(a, b)| a != b).count()
        })
        .sum()
}

#[test]
fn logits_of_a_chunked_run_match_transformers_on_every_backend() {
    let g = golden();
    let want = g.read_f32("logits").unwrap();
    let vocab = want.len() / ids(&g, "input_ids").len();
    for (name, dev) in kiln_testkit::devices() {
        let got = chunked_logits(&g, &fixtures().join("tiny"), &dev);
        let (worst, _) = distance(&got, &want, vocab);
        eprintln!("{name}: max |logit diff| {worst:e}");
        assert!(worst <= 1e-4, "{name}: max |logit diff| {worst}");
    }
}

#[test]
fn greedy_continuations_match_transformers_token_for_token_on_every_backend() {
    let g = golden();
    for (name, dev) in kiln_testkit::devices() {
        let model = V4Model::load(&fixtures().join("tiny"), &dev, 256).unwrap();
        for i in 0..3 {
            let prompt = ids(&g, &format!("gen.prompt.{i}"));
            let want = ids(&g, &format!("gen.greedy.{i}"));
            let got = model.generate_greedy(&dev, &prompt, want.len()).unwrap();
            assert_eq!(got, want, "{name} prompt {i}");
        }
    }
}

/// llama.cpp's converter's F32 GGUF of the tiny model (routed experts as MXFP4, the values
/// the float model holds): the same logits and greedy tokens as transformers where kiln keeps
/// activations in f32 (the reference and wgpu backends). The native CPU backend multiplies
/// MXFP4 against 8-bit activations, as ggml's CPU code does: its distance from transformers
/// is printed beside llama.cpp's own on the same file (from the golden).
#[test]
fn the_converters_gguf_matches_transformers_where_activations_stay_f32() {
    let g = golden();
    let gguf = fixtures().join("tiny-f32.gguf");
    let want = g.read_f32("logits").unwrap();
    let vocab = want.len() / ids(&g, "input_ids").len();
    let (lw, la) = distance(&g.read_f32("llama_cpp.logits").unwrap(), &want, vocab);
    let lg = greedy_differing(&g, None, "llama_cpp");
    eprintln!(
        "llama.cpp (CPU) on tiny-f32.gguf: max |logit diff| {lw:e}, argmax differing at {la} \
         of 173 tokens, greedy tokens differing {lg} of 72"
    );
    for (name, dev) in kiln_testkit::devices() {
        let (worst, argmax) = distance(&chunked_logits(&g, &gguf, &dev), &want, vocab);
        let model = V4Model::load(&gguf, &dev, 256).unwrap();
        let differ = greedy_differing(&g, Some((&model, &dev)), "");
        eprintln!(
            "{name} on tiny-f32.gguf: max |logit diff| {worst:e}, argmax differing at {argmax} \
             of 173 tokens, greedy tokens differing {differ} of 72"
        );
        if name != "cpu" {
            assert!(
                worst <= 1e-4 && differ == 0,
                "{name}: {worst}, {differ} tokens"
            );
        }
    }
}

/// The converter's GGUF with DeepSeek's FP8 linears written as Q8_0 (and MXFP4 experts),
/// beside llama.cpp's own run of the same file: kiln's logits of the 173 tokens, on every
/// backend, against llama.cpp's and against transformers'. Q8_0 moves a tiny random model far
/// from transformers; kiln is held to llama.cpp's own distance on this file (its largest
/// difference within 5% of llama.cpp's, its argmax departing at no more than 5 tokens beyond
/// llama.cpp's).
#[test]
fn the_q8_0_gguf_against_llama_cpp_on_the_same_file() {
    let g = golden();
    let want = g.read_f32("logits").unwrap();
    let theirs = g.read_f32("llama_cpp_q8_0.logits").unwrap();
    let vocab = want.len() / ids(&g, "input_ids").len();
    let (lw, la) = distance(&theirs, &want, vocab);
    eprintln!(
        "llama.cpp (CPU) on tiny-q8_0.gguf vs transformers: max |diff| {lw:e}, argmax differs \
         at {la} of 173"
    );
    for (name, dev) in kiln_testkit::devices() {
        let got = chunked_logits(&g, &fixtures().join("tiny-q8_0.gguf"), &dev);
        let (tw, ta) = distance(&got, &want, vocab);
        let (cw, ca) = distance(&got, &theirs, vocab);
        eprintln!(
            "{name} on tiny-q8_0.gguf: vs transformers max |diff| {tw:e}, argmax differs at {ta}; \
             vs llama.cpp max |diff| {cw:e}, argmax differs at {ca}"
        );
        assert!(
            got.iter().all(|v| v.is_finite()),
            "{name}: non-finite logits"
        );
        assert!(
            tw <= 1.05 * lw && ta <= la + 5,
            "{name}: further from transformers than llama.cpp"
        );
    }
}

/// A folder without layer 0's hash table: the load fails naming the tensor.
#[test]
fn a_missing_tensor_is_refused_by_name() {
    let dir = std::env::temp_dir().join(format!("kiln-v4-missing-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tiny = fixtures().join("tiny");
    std::fs::copy(tiny.join("config.json"), dir.join("config.json")).unwrap();
    let st = SafetensorsFile::open(&tiny.join("model.safetensors")).unwrap();
    let kept: Vec<(String, StDtype, Vec<usize>, Vec<u8>)> = st
        .names()
        .filter(|n| !n.ends_with("tid2eid"))
        .map(|n| {
            let (dtype, shape) = st.info(n).unwrap();
            let bytes = st
                .read_f32(n)
                .unwrap()
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect();
            assert_eq!(dtype, StDtype::F32);
            (n.to_string(), dtype, shape.to_vec(), bytes)
        })
        .collect();
    let bytes = encode_safetensors(&kept, &Default::default()).unwrap();
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
    let e = V4Model::load(&dir, &Device::reference(), 64).unwrap_err();
    std::fs::remove_dir_all(&dir).unwrap();
    let msg = e.to_string();
    assert!(
        msg.contains("tensor `layers.0.ffn.gate.tid2eid`: missing"),
        "{msg}"
    );
}

/// DeepSeek ships most linears as FP8 e4m3 with block scales, which kiln does not read yet:
/// the load names the tensor and the dtypes it takes.
#[test]
fn an_fp8_checkpoint_is_refused_by_name() {
    let dir = std::env::temp_dir().join(format!("kiln-v4-fp8-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(fixtures().join("tiny/config.json"), dir.join("config.json")).unwrap();
    // One tensor, `embed.weight` [32, 64], stored as F8_E4M3 (one byte a value).
    let header = r#"{"embed.weight":{"dtype":"F8_E4M3","shape":[32,64],"data_offsets":[0,2048]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend(std::iter::repeat_n(0u8, 2048));
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
    let e = V4Model::load(&dir, &Device::reference(), 64).unwrap_err();
    std::fs::remove_dir_all(&dir).unwrap();
    let msg = e.to_string();
    assert!(msg.contains("tensor `embed.weight`"), "{msg}");
    assert!(
        msg.contains("F8_E4M3") && msg.contains("F32, F16, BF16"),
        "{msg}"
    );
}

/// Another architecture's GGUF is refused naming the key and what it holds.
#[test]
fn another_architectures_gguf_is_refused_by_name() {
    let path = kiln_testkit::default_model();
    let e = V4Model::load(&path, &Device::reference(), 64).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("general.architecture") && msg.contains("`llama` is not deepseek4"),
        "{msg}"
    );
}
