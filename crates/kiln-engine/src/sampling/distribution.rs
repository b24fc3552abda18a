//! Speculative sampling keeps the target distribution: chi-square tests over seeded draws from
//! controlled logits, through the sampler's verify step (a point-mass draft) and through
//! rejection sampling from a draft distribution.

#![allow(clippy::unwrap_used)]

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use std::collections::HashMap;

use super::{LogprobRequest, Sampler, SamplingParams, TokenHistory};

/// The reference: one step of speculative sampling (Leviathan et al. 2023; Chen et al. 2023). `target` is the
/// target model's distribution p and `proposal` the draft's q, both as (id, unnormalised
/// weight) lists; `None` means q is a point mass on `draft` (a deterministic proposer). The
/// draft is accepted with probability min(1, p(draft) / q(draft)); otherwise the token comes
/// from the normalised residual max(0, p − q). The token returned is distributed exactly as p
/// when `draft` was drawn from q. Makes one RNG draw, plus one on rejection. Returns the token
/// and whether it is the draft.
fn rejection_sample<R: Rng + ?Sized>(
    target: &[(u32, f64)],
    proposal: Option<&[(u32, f64)]>,
    draft: u32,
    rng: &mut R,
) -> (u32, bool) {
    let total = |d: &[(u32, f64)]| d.iter().map(|c| c.1.max(0.0)).sum::<f64>();
    let p_total = total(target);
    if p_total <= 0.0 {
        return (draft, false); // no distribution at all: validated rows never get here
    }
    let p_draft = target
        .iter()
        .filter(|c| c.0 == draft)
        .map(|c| c.1.max(0.0))
        .sum::<f64>()
        / p_total;
    // q as normalised probabilities by id (a point mass on the draft when `None`).
    let q: HashMap<u32, f64> = match proposal {
        None => HashMap::from([(draft, 1.0)]),
        Some(q) => {
            let q_total = total(q);
            let mut m = HashMap::new();
            if q_total > 0.0 {
                for &(id, w) in q {
                    *m.entry(id).or_insert(0.0) += w.max(0.0) / q_total;
                }
            }
            m
        }
    };
    let q_draft = q.get(&draft).copied().unwrap_or(0.0);
    let u = rng.random::<f64>();
    // q(draft) = 0 cannot happen for a draft drawn from q; then only p decides.
    if p_draft > 0.0 && (q_draft <= 0.0 || u * q_draft < p_draft) {
        return (draft, true);
    }
    // The residual max(0, p - q) over p's support.
    let residual: Vec<(u32, f64)> = target
        .iter()
        .map(|&(id, w)| {
            let qi = q.get(&id).copied().unwrap_or(0.0);
            (id, (w.max(0.0) / p_total - qi).max(0.0))
        })
        .collect();
    let mass: f64 = residual.iter().map(|c| c.1).sum();
    if mass <= 0.0 {
        // p == q up to rounding: the acceptance test could only fail by rounding.
        return (draft, p_draft > 0.0);
    }
    let mut u = rng.random::<f64>() * mass;
    let mut pick = draft;
    for &(id, w) in &residual {
        if w > 0.0 {
            pick = id;
            if u < w {
                break;
            }
            u -= w;
        }
    }
    (pick, false)
}

const NONE: LogprobRequest = LogprobRequest {
    logprobs: false,
    top_logprobs: 0,
};

fn softmax(x: &[f64]) -> Vec<f64> {
    let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = x.iter().map(|v| (v - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|v| v / s).collect()
}

/// Pearson's statistic of `counts` against probabilities `p` (cells with p = 0 must be empty).
fn chi_square(counts: &[usize], p: &[f64]) -> (f64, usize) {
    let n: usize = counts.iter().sum();
    let mut stat = 0.0;
    let mut cells = 0;
    for (&c, &pi) in counts.iter().zip(p) {
        if pi == 0.0 {
            assert_eq!(c, 0, "a token of probability 0 was drawn");
            continue;
        }
        let expected = n as f64 * pi;
        stat += (c as f64 - expected).powi(2) / expected;
        cells += 1;
    }
    (stat, cells - 1)
}

/// The chi-square quantile at 1 - 1e-4 (Wilson–Hilferty), so a correct sampler fails about
/// once in ten thousand runs of a seed; the seeds are fixed, so the test is deterministic.
fn critical(df: usize) -> f64 {
    let d = df as f64;
    let z = 3.719;
    d * (1.0 - 2.0 / (9.0 * d) + z * (2.0 / (9.0 * d)).sqrt()).powi(3)
}

const LOGITS: [f32; 8] = [2.0, 1.5, 1.1, 0.4, 0.0, -0.5, -1.2, -3.0];

/// The target distribution after the sampler's processing, computed independently.
fn target(params: &SamplingParams) -> Vec<f64> {
    let t = f64::from(params.temperature);
    let mut p = softmax(&LOGITS.iter().map(|&v| f64::from(v) / t).collect::<Vec<_>>());
    if params.top_k > 0 {
        // LOGITS are sorted, so the top k are the first k.
        p.iter_mut().skip(params.top_k).for_each(|x| *x = 0.0);
        let s: f64 = p.iter().sum();
        p.iter_mut().for_each(|x| *x /= s);
    }
    p
}

#[test]
fn verified_sampling_follows_the_target_distribution_for_any_draft() {
    let n = 60_000;
    let settings = [
        SamplingParams::default(),
        SamplingParams {
            temperature: 0.7,
            top_k: 5,
            ..SamplingParams::default()
        },
    ];
    for (si, params) in settings.iter().enumerate() {
        let p = target(params);
        // A likely draft, an unlikely one and one outside top-k's support.
        for draft in [0u32, 4, 7] {
            let mut sampler = Sampler::new(params.clone(), 1000 + draft as u64 + si as u64);
            let history = TokenHistory::new(&[]);
            let mut counts = vec![0usize; LOGITS.len()];
            let mut accepted = 0usize;
            for _ in 0..n {
                let (s, ok) = sampler
                    .verify(&LOGITS, &history, &[], Some(draft), NONE)
                    .unwrap();
                counts[s.token as usize] += 1;
                if ok {
                    assert_eq!(s.token, draft);
                    accepted += 1;
                }
            }
            let (stat, df) = chi_square(&counts, &p);
            assert!(
                stat < critical(df),
                "params {si}, draft {draft}: chi-square {stat:.1} >= {:.1} (df {df}): {counts:?} vs {p:?}",
                critical(df)
            );
            // A point-mass draft is accepted with probability p(draft).
            let rate = accepted as f64 / n as f64;
            let sd = (p[draft as usize] * (1.0 - p[draft as usize]) / n as f64).sqrt();
            assert!(
                (rate - p[draft as usize]).abs() <= 5.0 * sd + 1e-12,
                "params {si}, draft {draft}: accepted {rate} vs p {}",
                p[draft as usize]
            );
        }
    }
}

#[test]
fn rejection_sampling_from_a_draft_distribution_yields_the_target_distribution() {
    let p = softmax(&[1.0, 0.2, -0.5, 2.0, 0.0, -2.0]);
    let q = softmax(&[0.0, 1.5, 0.5, 0.5, -1.0, 1.0]);
    let to_list = |d: &[f64]| -> Vec<(u32, f64)> {
        d.iter()
            .enumerate()
            .map(|(i, &w)| (i as u32, w * 3.0)) // unnormalised on purpose
            .collect()
    };
    let (pl, ql) = (to_list(&p), to_list(&q));
    let mut rng = StdRng::seed_from_u64(42);
    let n = 80_000;
    let mut counts = vec![0usize; p.len()];
    let mut accepted = 0usize;
    for _ in 0..n {
        // The draft comes from q.
        let mut u: f64 = rng.random();
        let mut draft = q.len() - 1;
        for (i, &qi) in q.iter().enumerate() {
            if u < qi {
                draft = i;
                break;
            }
            u -= qi;
        }
        let (tok, ok) = rejection_sample(&pl, Some(&ql), draft as u32, &mut rng);
        counts[tok as usize] += 1;
        accepted += usize::from(ok);
    }
    let (stat, df) = chi_square(&counts, &p);
    assert!(
        stat < critical(df),
        "chi-square {stat:.1}: {counts:?} vs {p:?}"
    );
    // Theory: the acceptance probability is the overlap sum(min(p, q)).
    let overlap: f64 = p.iter().zip(&q).map(|(a, b)| a.min(*b)).sum();
    let rate = accepted as f64 / n as f64;
    let sd = (overlap * (1.0 - overlap) / n as f64).sqrt();
    assert!((rate - overlap).abs() < 5.0 * sd, "{rate} vs {overlap}");
}
