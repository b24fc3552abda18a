//! A whole DeepSeek-V4 model against transformers' `DeepseekV4ForCausalLM` (a tiny random
//! checkpoint with sliding, CSA and HCA layers and a hash-routed first MoE layer, saved by
//! transformers; goldens by `scripts/make_deepseek_v4_module_fixtures.py`, float32), on every
//! backend: the logits of 173 tokens run in chunks (boundaries inside compression windows,
//! single-token steps, past HCA's first window of 128) and greedy continuations token for
//! token, from the Hugging Face folder and from llama.cpp's converter's GGUFs of it (F32 with
//! MXFP4 experts; FP8 linears as Q8_0, beside llama.cpp's run of the same file) and from
//! the folder as DeepSeek ships it (FP8 linears, FP4 experts); and bad checkpoints refused by
//! name.

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
    let chunks = chunks(g);
    let longest = chunks.iter().copied().max().unwrap();
    let mut seq = V4Sequence::new(&model, tokens.len(), longest).unwrap();
    let (mut start, mut got) = (0, Vec::new());
    for n in chunks {
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
/// backend, against llama.cpp's and against transformers'. Q8_0 rounds the FP8 values again,
/// and on a tiny random model a rounding flips routing choices, each of which moves whole
/// logit rows: so the distances compared are means over every logit, and departures of the
/// argmax. Where kiln keeps activations in f32 (reference, wgpu) it is no further from
/// transformers than llama.cpp is; the native CPU backend quantizes activations to 8 bits as
/// ggml's CPU code does, and is nearer llama.cpp than llama.cpp is to transformers. Every
/// backend's argmax departs from transformers' at no more than 5 tokens beyond llama.cpp's.
#[test]
fn the_q8_0_gguf_against_llama_cpp_on_the_same_file() {
    let g = golden();
    let want = g.read_f32("logits").unwrap();
    let theirs = g.read_f32("llama_cpp_q8_0.logits").unwrap();
    let vocab = want.len() / ids(&g, "input_ids").len();
    let mean = |a: &[f32], b: &[f32]| {
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).sum::<f32>() / a.len() as f32
    };
    let (lw, la) = distance(&theirs, &want, vocab);
    let lm = mean(&theirs, &want);
    eprintln!(
        "llama.cpp (CPU) on tiny-q8_0.gguf vs transformers: mean |diff| {lm:e}, max {lw:e}, \
         argmax differs at {la} of 173"
    );
    for (name, dev) in kiln_testkit::devices() {
        let got = chunked_logits(&g, &fixtures().join("tiny-q8_0.gguf"), &dev);
        let (tw, ta) = distance(&got, &want, vocab);
        let (cw, ca) = distance(&got, &theirs, vocab);
        let (tm, cm) = (mean(&got, &want), mean(&got, &theirs));
        eprintln!(
            "{name} on tiny-q8_0.gguf: vs transformers mean |diff| {tm:e}, max {tw:e}, argmax \
             differs at {ta}; vs llama.cpp mean {cm:e}, max {cw:e}, argmax differs at {ca}"
        );
        assert!(
            got.iter().all(|v| v.is_finite()),
            "{name}: non-finite logits"
        );
        assert!(
            ta <= la + 5,
            "{name}: argmax departs at {ta}, llama.cpp's at {la}"
        );
        if name == "cpu" {
            assert!(
                cm <= lm,
                "{name}: {cm} from llama.cpp, which is {lm} from transformers"
            );
        } else {
            assert!(tm <= lm, "{name}: {tm} from transformers, llama.cpp {lm}");
        }
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

/// The tiny model as DeepSeek ships V4 (`tiny-fp8/`: DeepSeek's names, the attention and
/// shared-expert linears as FP8 E4M3 with a ue8m0 scale a 128 × 128 block, the routed experts
/// as FP4 E2M1 with a ue8m0 scale a 32 inputs; the values transformers' float model holds),
/// loaded packed (FP8 and MXFP4 blocks): transformers' logits and greedy tokens where kiln
/// keeps activations in f32; the native CPU backend, which multiplies MXFP4 against 8-bit
/// activations, gives what it gives on the converter's F32 GGUF of the same values.
#[test]
fn deepseeks_own_fp8_and_fp4_checkpoint_loads_packed_and_matches_transformers() {
    let g = golden();
    let folder = fixtures().join("tiny-fp8");
    let want = g.read_f32("logits").unwrap();
    let vocab = want.len() / ids(&g, "input_ids").len();
    for (name, dev) in kiln_testkit::devices() {
        let got = chunked_logits(&g, &folder, &dev);
        let (worst, argmax) = distance(&got, &want, vocab);
        let model = V4Model::load(&folder, &dev, 256).unwrap();
        let differ = greedy_differing(&g, Some((&model, &dev)), "");
        eprintln!(
            "{name} on tiny-fp8/: max |logit diff| {worst:e}, argmax differing at {argmax} of \
             173 tokens, greedy tokens differing {differ} of 72"
        );
        if name == "cpu" {
            let gguf = chunked_logits(&g, &fixtures().join("tiny-f32.gguf"), &dev);
            let (same, _) = distance(&got, &gguf, vocab);
            eprintln!("cpu: tiny-fp8/ against tiny-f32.gguf: max |logit diff| {same:e}");
            assert!(same <= 1e-4, "cpu: {same} from the GGUF of the same values");
        } else {
            assert!(
                worst <= 1e-4 && differ == 0,
                "{name}: {worst}, {differ} tokens"
            );
        }
    }
}

/// `tiny-fp8/` with its tensors changed by `edit` (each name, dtype, shape and bytes), in a
/// scratch folder; the load's error with its sources.
fn load_edited(
    tag: &str,
    edit: impl Fn(&mut Vec<(String, StDtype, Vec<usize>, Vec<u8>)>),
) -> String {
    let dir = std::env::temp_dir().join(format!("kiln-v4-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = fixtures().join("tiny-fp8");
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let st = SafetensorsFile::open(&src.join("model.safetensors")).unwrap();
    let mut tensors: Vec<_> = st
        .names()
        .map(|n| {
            let (dtype, shape) = st.info(n).unwrap();
            (
                n.to_string(),
                dtype,
                shape.to_vec(),
                st.read_bytes(n).unwrap(),
            )
        })
        .collect();
    edit(&mut tensors);
    let bytes = encode_safetensors(&tensors, &Default::default()).unwrap();
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
    let e = V4Model::load(&dir, &Device::reference(), 64).unwrap_err();
    std::fs::remove_dir_all(&dir).unwrap();
    let mut msg = e.to_string();
    let mut next = std::error::Error::source(&e);
    while let Some(s) = next {
        msg += &format!(": {s}");
        next = s.source();
    }
    msg
}

/// An FP8 weight without its scales, with a scale grid of the wrong shape, or holding the
/// E4M3 NaN code: each refused naming the tensor and what was expected.
#[test]
fn bad_fp8_weights_are_refused_by_name() {
    let wq = "layers.0.attn.wq_a.weight";
    let msg = load_edited("fp8-unscaled", |t| {
        t.retain(|x| x.0 != "layers.0.attn.wq_a.scale")
    });
    assert!(
        msg.contains(&format!("tensor `{wq}`"))
            && msg.contains("layers.0.attn.wq_a.scale or layers.0.attn.wq_a.weight_scale_inv"),
        "{msg}"
    );
    let msg = load_edited("fp8-grid", |t| {
        let s = t
            .iter_mut()
            .find(|x| x.0 == "layers.0.attn.wq_a.scale")
            .unwrap();
        s.2 = vec![1, 2];
        s.3 = vec![127, 127];
    });
    assert!(
        msg.contains("tensor `layers.0.attn.wq_a.scale`") && msg.contains("expected [1, 1]"),
        "{msg}"
    );
    let msg = load_edited("fp8-nan", |t| {
        let w = t.iter_mut().find(|x| x.0 == wq).unwrap();
        w.3[40] = 0x7f;
    });
    assert!(
        msg.contains(&format!("tensor `{wq}`")) && msg.contains("NaN code"),
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
