//! A simple sampler for `kiln generate`: greedy, or temperature with top-k and top-p from a
//! seeded RNG. (The engine's full sampler, with penalties and logprobs, belongs to kiln-engine.)

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Debug, Clone, Copy)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no limit.
    pub top_k: usize,
    pub top_p: f32,
}

impl SamplingParams {
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(format!("--temperature {} must be >= 0", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("--top-p {} must be in (0, 1]", self.top_p));
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }
}

#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

impl Sampler {
    pub fn new(params: SamplingParams, seed: u64) -> Self {
        Self {
            params,
            rng: StdRng::seed_from_u64(seed),
        }
    }

    /// Pick a token from one row of logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let mut idx: Vec<usize> = (0..logits.len())
            .filter(|&i| logits[i].is_finite())
            .collect();
        if idx.is_empty() {
            return 0;
        }
        idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        if self.params.is_greedy() {
            return idx[0] as u32;
        }
        if self.params.top_k > 0 {
            idx.truncate(self.params.top_k);
        }
        let t = self.params.temperature;
        let m = logits[idx[0]];
        let mut probs: Vec<f64> = idx
            .iter()
            .map(|&i| f64::from((logits[i] - m) / t).exp())
            .collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        // Smallest prefix whose mass reaches top_p (always at least one token).
        let mut mass = 0.0;
        let mut keep = probs.len();
        for (n, p) in probs.iter().enumerate() {
            mass += p;
            if mass >= f64::from(self.params.top_p) {
                keep = n + 1;
                break;
            }
        }
        let kept: f64 = probs[..keep].iter().sum();
        let mut u = self.rng.random::<f64>() * kept;
        for (n, p) in probs[..keep].iter().enumerate() {
            if u < *p {
                return idx[n] as u32;
            }
            u -= p;
        }
        idx[keep - 1] as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_top_k_top_p_and_seeds() {
        let logits = [1.0, 3.0, 2.0, f32::NEG_INFINITY, 2.9];
        let greedy = SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
        };
        assert_eq!(Sampler::new(greedy, 1).sample(&logits), 1);
        // top-k 2 only ever yields the two best.
        let k2 = SamplingParams {
            temperature: 1.0,
            top_k: 2,
            top_p: 1.0,
        };
        let mut s = Sampler::new(k2, 7);
        let picks: Vec<u32> = (0..200).map(|_| s.sample(&logits)).collect();
        assert!(picks.iter().all(|&p| p == 1 || p == 4));
        assert!(picks.contains(&1) && picks.contains(&4));
        // A tiny top-p keeps only the best.
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.01,
        };
        assert!((0..50).all(|_| Sampler::new(p, 3).sample(&logits) == 1));
        // Same seed, same draws.
        let any = SamplingParams {
            temperature: 0.8,
            top_k: 0,
            top_p: 0.95,
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(any, 42);
            (0..30).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(any, 42);
            (0..30).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b);
        assert!(
            SamplingParams {
                temperature: -1.0,
                ..any
            }
            .validate()
            .is_err()
        );
        assert!(SamplingParams { top_p: 0.0, ..any }.validate().is_err());
    }
}
