//! The tiny random-weight fixtures' references (`reference.json` of kiln-testkit's `fixtures/tiny` and
//! `tests/fixtures/int4`): token ids and float32 logits from `transformers`, compared with
//! 2e-5 + 2e-5·|reference| (the same f32 values, summed in another order).

use serde_json::Value;

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
