//! The tiny random-weight fixtures' references (`reference.json` of kiln-testkit's `fixtures/tiny` and
//! `tests/fixtures/int4`): token ids and float32 logits from `transformers`, compared with
//! 2e-5 + 2e-5·|reference| (the same f32 values, summed in another order).

use kiln_attention::KvCache;
use kiln_kv::{BlockId, KvDtype};
use kiln_model::{KvPoolConfig, LogitsAt, Model, ModelConfig, SeqInput};
use kiln_tensor::{Device, Recorder};
use serde_json::Value;

/// A cache of F32 K/V for a tiny model: 8 blocks of 16 tokens, handed out out of order.
fn cache(cfg: &ModelConfig, dev: &Device) -> (KvCache, Vec<BlockId>) {
    let kvc = cfg.kv_cache_config(KvPoolConfig {
        block_size: 16,
        num_blocks: 8,
        dtype: KvDtype::F32,
    });
    let table = [2, 0, 3, 7, 1, 5, 4, 6].map(BlockId).to_vec();
    (KvCache::new(dev, kvc).unwrap(), table)
}

/// One forward step of `tokens` ending at `context_len`, the logits `at` asks for.
fn step(
    model: &Model,
    dev: &Device,
    (cache, table): &mut (KvCache, Vec<BlockId>),
    tokens: &[u32],
    context_len: usize,
    at: LogitsAt<'_>,
) -> Vec<f32> {
    let mut rec = Recorder::new(dev);
    let seq = SeqInput {
        tokens,
        block_table: table,
        context_len,
    };
    let logits = model.forward(&mut rec, cache, &[seq], at).unwrap();
    rec.submit().unwrap();
    logits.to_f32_vec().unwrap()
}

/// The logits at every position of `ids`, one forward step.
pub fn forward_all(model: &Model, dev: &Device, ids: &[u32]) -> Vec<f32> {
    let mut kv = cache(model.config(), dev);
    step(model, dev, &mut kv, ids, ids.len(), LogitsAt::All)
}

/// `steps` greedy tokens after `ids`: the prompt in one step, then a token a step.
pub fn greedy(model: &Model, dev: &Device, ids: &[u32], steps: usize) -> Vec<u32> {
    let mut kv = cache(model.config(), dev);
    let mut out = Vec::new();
    let mut tokens = ids.to_vec();
    let mut len = 0;
    for _ in 0..steps {
        len += tokens.len();
        let l = step(model, dev, &mut kv, &tokens, len, LogitsAt::Last);
        let best =
            l.iter().enumerate().fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &v)| if v > b.1 { (i, v) } else { b },
            );
        out.push(best.0 as u32);
        tokens = vec![best.0 as u32];
    }
    out
}

/// Asserts `got` follows the reference's greedy `tokens`: the two may part only at a step
/// whose reference top-1/top-2 margin is under `tie` (where either token is a fair answer),
/// and nothing after it is compared.
pub fn assert_greedy(got: &[u32], reference: &Value, tie: f64, what: &str) {
    let want = ids(&reference["tokens"]);
    let margins: Vec<f64> = reference["margins"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_f64().unwrap())
        .collect();
    assert!(
        got.len() >= want.len(),
        "{what}: {} of {} steps",
        got.len(),
        want.len()
    );
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        if g != w {
            assert!(
                margins[i] < tie,
                "{what}: greedy step {i} (reference margin {}): {got:?} vs {want:?}",
                margins[i]
            );
            eprintln!(
                "{what}: {i} greedy steps agree, then a reference near-tie ({})",
                margins[i]
            );
            return;
        }
    }
    eprintln!("{what}: all {} greedy steps agree", want.len());
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Rows of logits, flattened.
pub fn logits(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .flat_map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
        })
        .collect()
}

/// Asserts `got` is within tolerance of `want` (rows of `vocab`), naming `what` and the
/// position; prints and returns the largest difference.
pub fn assert_logits_close(got: &[f32], want: &[f32], vocab: usize, what: &str) -> f32 {
    assert_logits_within(got, want, vocab, what, 2e-5)
}

/// [`assert_logits_close`] with `abs + rel·|reference|`, `tol` for both.
pub fn assert_logits_within(got: &[f32], want: &[f32], vocab: usize, what: &str, tol: f32) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: logits");
    let mut worst = 0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs();
        worst = worst.max(err);
        assert!(
            err <= tol + tol * w.abs(),
            "{what}: logit {i} (position {}): {g} vs {w}",
            i / vocab
        );
    }
    eprintln!("{what}: max |logit - reference| = {worst}");
    worst
}
