//! `kiln-bench gpu-check`'s DeepSeek-V4 kernel checks, at V4-Flash's shapes: the compressors'
//! pooling (CSA's overlapping windows after a carried window, HCA's windows of 128), the
//! compressed layers' RoPE on the trailing channels there and back, the lightning indexer's
//! top-k, and the attention core over raw rows and picked entries, each against the CPU
//! reference compiled into the same binary; and a whole tiny V4 model against transformers'
//! goldens (kiln-model's test fixture).

use kiln_attention::{CompressedKv, EntryChoice, compressed_attention};
use kiln_tensor::{
    Device, MappedRows, PoolWindows, Recorder, RopeConfig, RopeLayout, RopeScaling, RopeTable,
    RotaryChannels, RowMap, Tensor,
};

use std::path::Path;

use anyhow::Context;
use kiln_model::SafetensorsFile;
use kiln_model::v4::{V4Model, V4Sequence};

use crate::kernel_checks::{Check, max_error, values};

/// Where kiln-model's DeepSeek-V4 fixtures are in the repository.
pub(crate) const FIXTURES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../crates/kiln-model/tests/fixtures/deepseek_v4"
);

/// V4-Flash's head (and compressed entry) width, its indexer's, and its rotary width.
const HEAD: usize = 512;
const INDEX_HEAD: usize = 128;
const ROPE: usize = 64;

fn check(what: String, e: f32, bound: f32) -> Check {
    Check {
        what,
        max_error: e,
        bound,
        ok: e <= bound,
    }
}

pub(crate) fn v4_checks(dev: &Device, seed: u64) -> anyhow::Result<Vec<Check>> {
    let cpu = Device::Reference;
    let mut out = Vec::new();
    for (ratio, windows, cols, rows) in [
        (
            4,
            PoolWindows::Overlapping { previous: true },
            2 * HEAD,
            4 + 4 * 9 + 2,
        ),
        (128, PoolWindows::Disjoint, HEAD, 2 * 128 + 5),
    ] {
        let kv = values(seed, rows * cols);
        let gate: Vec<f32> = values(seed + 1, rows * cols)
            .iter()
            .map(|v| 4.0 * v)
            .collect();
        let ape = values(seed + 2, ratio * cols);
        let run = |d: &Device| -> anyhow::Result<Vec<f32>> {
            let t = |shape: &[usize], v: &[f32]| Tensor::from_f32(d, shape, v);
            let mut rec = Recorder::new(d);
            let y = rec.compress_pool(
                &t(&[rows, cols], &kv)?,
                &t(&[rows, cols], &gate)?,
                &t(&[ratio, cols], &ape)?,
                ratio,
                windows,
            )?;
            rec.submit()?;
            Ok(y.to_f32_vec()?)
        };
        let e = max_error(&run(dev)?, &run(&cpu)?);
        out.push(check(
            format!("compress_pool ratio {ratio} {windows:?}"),
            e,
            1e-5,
        ));
    }
    let rope = RopeConfig {
        head_dim: HEAD,
        rotary_dim: ROPE,
        theta: 160_000.0,
        scaling: RopeScaling::Yarn {
            factor: 16.0,
            original_max_position: 65536,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: 1.0,
            truncate: true,
        },
        layout: RopeLayout::Interleaved,
        rotated: RotaryChannels::Trailing,
    };
    let (tokens, heads) = (6, 64);
    let x = values(seed + 3, tokens * heads * HEAD);
    let positions: Vec<u32> = (0..tokens as u32).map(|t| 1000 + 37 * t).collect();
    let run = |d: &Device| -> anyhow::Result<[Vec<f32>; 2]> {
        let table = RopeTable::new(d, rope, 2048)?;
        let pos = table.positions(&positions)?;
        let mut rec = Recorder::new(d);
        let y = rec.rope(&Tensor::from_f32(d, &[tokens, heads, HEAD], &x)?, &pos)?;
        let back = rec.unrope(&y, &pos)?;
        rec.submit()?;
        Ok([y.to_f32_vec()?, back.to_f32_vec()?])
    };
    let ([y, back], [y_cpu, back_cpu]) = (run(dev)?, run(&cpu)?);
    out.push(check(
        "rope, trailing 64 of 512, YaRN".into(),
        max_error(&y, &y_cpu),
        1e-5,
    ));
    out.push(check(
        "unrope, trailing 64 of 512".into(),
        max_error(&back, &back_cpu),
        1e-5,
    ));
    out.push(check(
        "unrope(rope(x)) = x".into(),
        max_error(&back, &x),
        1e-5,
    ));
    let (entries, index_heads, k) = (2000, 64, 512);
    let q = values(seed + 4, tokens * index_heads * INDEX_HEAD);
    let w = values(seed + 5, tokens * index_heads);
    let keys = values(seed + 6, entries * INDEX_HEAD);
    let visible: Vec<u32> = [0, 3, 600, 1500, 1999, 2000].to_vec();
    let run = |d: &Device| -> anyhow::Result<Vec<u32>> {
        let mut rec = Recorder::new(d);
        let p = rec.indexer_topk(
            &Tensor::from_f32(d, &[tokens, index_heads, INDEX_HEAD], &q)?,
            &Tensor::from_f32(d, &[tokens, index_heads], &w)?,
            MappedRows::consecutive(&Tensor::from_f32(d, &[entries, INDEX_HEAD], &keys)?),
            &visible,
            k,
            1.0 / ((INDEX_HEAD * index_heads) as f32).sqrt(),
        )?;
        rec.submit()?;
        Ok(p.to_u32_vec()?)
    };
    let (picks, picks_cpu) = (run(dev)?, run(&cpu)?);
    // Each token's picks as a set: a pick differs when the reference did not pick it (a
    // near-tie at the k-th score may round the other way on another device).
    let differ: usize = picks
        .chunks_exact(k)
        .zip(picks_cpu.chunks_exact(k))
        .map(|(got, want)| {
            got.iter()
                .filter(|e| want.binary_search(e).is_err())
                .count()
        })
        .sum();
    let share = differ as f32 / picks.len() as f32;
    out.push(check(
        format!(
            "indexer_topk {index_heads}x{INDEX_HEAD}, k {k} of {entries}: share of picks differing"
        ),
        share,
        0.01,
    ));
    let raw_rows = 140;
    let qa = values(seed + 7, tokens * heads * HEAD);
    let raw = values(seed + 8, raw_rows * HEAD);
    let ent = values(seed + 9, 300 * HEAD);
    let sinks = values(seed + 10, heads);
    let chosen: Vec<u32> = (0..tokens * 8).map(|i| (i * 37 % 300) as u32).collect();
    let run = |d: &Device| -> anyhow::Result<Vec<f32>> {
        let t = |shape: &[usize], v: &[f32]| Tensor::from_f32(d, shape, v);
        let (raw_t, ent_t) = (t(&[raw_rows, HEAD], &raw)?, t(&[300, HEAD], &ent)?);
        let picks_t = Tensor::from_u32(d, &[tokens, 8], &chosen)?;
        let kv = CompressedKv {
            raw: &raw_t,
            raw_map: RowMap::Consecutive,
            first: 2000,
            window: 128,
            entries: Some(MappedRows::consecutive(&ent_t)),
            choice: EntryChoice::Picked(&picks_t),
        };
        let positions: Vec<u32> = (2134..2140).collect();
        let mut rec = Recorder::new(d);
        let y = compressed_attention(
            &mut rec,
            &t(&[tokens, heads, HEAD], &qa)?,
            &positions,
            kv,
            &t(&[heads], &sinks)?,
            1.0 / (HEAD as f32).sqrt(),
        )?;
        rec.submit()?;
        Ok(y.to_f32_vec()?)
    };
    let e = max_error(&run(dev)?, &run(&cpu)?);
    out.push(check(
        "compressed attention 64x512, window 128 + 8 picks".into(),
        e,
        1e-4,
    ));
    Ok(out)
}

/// The tiny random DeepSeek-V4 model in `dir`, from its Hugging Face folder (`tiny/`), as
/// DeepSeek ships it (`tiny-fp8/`: FP8 linears, FP4 experts) and from llama.cpp's
/// converter's GGUF of it (`tiny-f32.gguf`), on `dev`, against
/// transformers' goldens (`model_golden.safetensors`): the logits of its tokens run in the
/// golden's chunks, and its greedy continuations.
pub(crate) fn v4_model_checks(dev: &Device, dir: &Path) -> anyhow::Result<Vec<Check>> {
    let golden = SafetensorsFile::open(&dir.join("model_golden.safetensors"))
        .with_context(|| format!("the DeepSeek-V4 goldens in {}", dir.display()))?;
    let ids = |name: &str| -> anyhow::Result<Vec<u32>> {
        Ok(golden.read_f32(name)?.iter().map(|&v| v as u32).collect())
    };
    let tokens = ids("input_ids")?;
    let chunks = ids("chunks")?;
    let want = golden.read_f32("logits")?;
    let mut out = Vec::new();
    for (what, path) in [
        ("HF folder", dir.join("tiny")),
        ("FP8 and FP4 folder", dir.join("tiny-fp8")),
        ("F32 GGUF", dir.join("tiny-f32.gguf")),
    ] {
        let model = V4Model::load(&path, dev, 256)?;
        let mut seq = V4Sequence::new(&model, tokens.len(), 256)?;
        let (mut start, mut logits) = (0, Vec::new());
        for &n in &chunks {
            let n = n as usize;
            let mut rec = Recorder::new(dev);
            let l = model.forward(&mut rec, &tokens[start..start + n], &mut seq)?;
            rec.submit()?;
            logits.extend(l.to_f32_vec()?);
            start += n;
        }
        let e = max_error(&logits, &want);
        let name = format!(
            "DeepSeek-V4 tiny model ({what}): logits of {} tokens in chunks",
            tokens.len()
        );
        out.push(check(name, e, 1e-4));
        let mut differ = 0usize;
        for i in 0..3 {
            let want = ids(&format!("gen.greedy.{i}"))?;
            let got = model.generate_greedy(dev, &ids(&format!("gen.prompt.{i}"))?, want.len())?;
            differ += got.iter().zip(&want).filter(|(a, b)| a != b).count();
        }
        out.push(check(
            format!("DeepSeek-V4 tiny model ({what}): greedy tokens differing from transformers"),
            differ as f32,
            0.0,
        ));
    }
    Ok(out)
}
