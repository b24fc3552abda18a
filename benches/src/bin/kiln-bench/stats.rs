//! Pure helpers: synthetic prompts, per-request samples and the figures made from them.

use std::time::{Duration, Instant};

use kiln_engine::SpecStats;

/// Nearest-rank percentile of sorted samples: the smallest sample with at least `p`% of the
/// samples at or below it (so p99 of fewer than 100 samples is the maximum). `None` when empty.
pub fn percentile(sorted: &[Duration], p: usize) -> Option<Duration> {
    let rank = (p * sorted.len()).div_ceil(100).max(1);
    sorted.get(rank - 1).copied()
}

/// Milliseconds, for tables and JSON.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// `Some(ms)` of a percentile.
pub fn pct_ms(sorted: &[Duration], p: usize) -> Option<f64> {
    percentile(sorted, p).map(ms)
}

/// Mean of durations in ms (`None` when empty).
pub fn mean_ms(d: &[Duration]) -> Option<f64> {
    (!d.is_empty()).then(|| d.iter().map(|x| ms(*x)).sum::<f64>() / d.len() as f64)
}

/// Deterministic synthetic prompts: token ids in `[base, vocab)`, clear of the special tokens
/// that sit at the bottom of real vocabularies. Each call to [`fresh`](Self::fresh) uses a new
/// salt, so no two prompts share a first KV block and the prefix cache never shortens a
/// prefill it should not.
#[derive(Debug, Clone)]
pub struct Prompts {
    base: u32,
    span: u32,
    next_salt: u64,
}

impl Prompts {
    pub fn new(vocab: usize) -> Self {
        let vocab = u32::try_from(vocab).unwrap_or(u32::MAX).max(2);
        let base = if vocab >= 4000 { 1000 } else { vocab / 4 };
        Self {
            base,
            span: vocab - base,
            next_salt: 1,
        }
    }

    /// `n` ids of a salt no earlier call used.
    pub fn fresh(&mut self, n: usize) -> Vec<u32> {
        let salt = self.next_salt;
        self.next_salt += 1;
        self.ids(salt, n)
    }

    /// `n` ids determined by `salt`.
    pub fn ids(&self, salt: u64, n: usize) -> Vec<u32> {
        (0..n as u64)
            .map(|j| {
                let h = splitmix64(salt.wrapping_mul(0x1_0000_0001).wrapping_add(j));
                self.base + (h % u64::from(self.span)) as u32
            })
            .collect()
    }
}

/// A 64-bit mixer (SplitMix64's finaliser): well-spread ids from small counters.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// What one request measured, client side.
#[derive(Debug, Clone)]
pub struct Sample {
    pub submitted: Instant,
    /// Arrival time of each generated token (tokens that arrive together share one).
    pub token_times: Vec<Instant>,
    pub token_ids: Vec<u32>,
    pub prompt_tokens: usize,
    pub cached_prompt_tokens: usize,
    /// The engine's own TTFT (from the request's arrival at the engine), when reported.
    pub server_ttft: Option<Duration>,
    /// What speculative decoding did for the request, as the engine reports it.
    pub spec: SpecStats,
}

impl Sample {
    /// An empty sample of a request of `prompt_tokens` expecting `new_tokens`.
    pub fn new(submitted: Instant, prompt_tokens: usize, new_tokens: usize) -> Self {
        Self {
            submitted,
            token_times: Vec::with_capacity(new_tokens),
            token_ids: Vec::with_capacity(new_tokens),
            prompt_tokens,
            cached_prompt_tokens: 0,
            server_ttft: None,
            spec: SpecStats::default(),
        }
    }

    /// Submission to the first token.
    pub fn ttft(&self) -> Duration {
        self.token_times
            .first()
            .map_or(Duration::ZERO, |t| *t - self.submitted)
    }

    /// Gaps between consecutive tokens.
    pub fn gaps(&self) -> Vec<Duration> {
        self.token_times.windows(2).map(|w| w[1] - w[0]).collect()
    }

    /// First token to last token.
    pub fn decode_time(&self) -> Duration {
        match (self.token_times.first(), self.token_times.last()) {
            (Some(a), Some(b)) => *b - *a,
            _ => Duration::ZERO,
        }
    }

    /// Submission to the last token.
    pub fn e2e(&self) -> Duration {
        self.token_times
            .last()
            .map_or(Duration::ZERO, |t| *t - self.submitted)
    }
}

/// `count / seconds`, `None` when there is no time to divide by.
pub fn rate(count: f64, d: Duration) -> Option<f64> {
    let s = d.as_secs_f64();
    (s > 0.0).then(|| count / s)
}

/// CPU seconds this process has used (user + system), where the OS tells (Linux `/proc`).
pub fn process_cpu_s() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may hold spaces) start after its ')'.
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after ')', in clock ticks
    // (100 a second on Linux).
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn ms_list(v: &[u64]) -> Vec<Duration> {
        v.iter().map(|&x| Duration::from_millis(x)).collect()
    }

    #[test]
    fn nearest_rank_percentiles() {
        assert_eq!(percentile(&[], 50), None);
        let one = ms_list(&[7]);
        assert_eq!(percentile(&one, 0), Some(Duration::from_millis(7)));
        assert_eq!(percentile(&one, 99), Some(Duration::from_millis(7)));
        let v = ms_list(&(1..=10).collect::<Vec<_>>());
        assert_eq!(percentile(&v, 50), Some(Duration::from_millis(5)));
        assert_eq!(percentile(&v, 90), Some(Duration::from_millis(9)));
        assert_eq!(percentile(&v, 99), Some(Duration::from_millis(10)));
        assert_eq!(percentile(&v, 100), Some(Duration::from_millis(10)));
        let v = ms_list(&(1..=200).collect::<Vec<_>>());
        assert_eq!(percentile(&v, 99), Some(Duration::from_millis(198)));
        assert_eq!(mean_ms(&ms_list(&[1, 2, 3])), Some(2.0));
        assert_eq!(mean_ms(&[]), None);
    }

    #[test]
    fn prompts_are_deterministic_distinct_and_in_range() {
        let mut p = Prompts::new(49152);
        let a = p.fresh(512);
        let b = p.fresh(512);
        assert_eq!(a.len(), 512);
        assert_ne!(a[..16], b[..16]);
        assert!(a.iter().chain(&b).all(|&t| (1000..49152).contains(&t)));
        assert_eq!(Prompts::new(49152).fresh(512), a);
        // A tiny vocabulary still works.
        let t = Prompts::new(256).fresh(64);
        assert!(t.iter().all(|&x| (64..256).contains(&x)));
    }

    #[test]
    fn sample_figures() {
        let t0 = Instant::now();
        let at = |m| t0 + Duration::from_millis(m);
        let s = Sample {
            submitted: t0,
            token_times: vec![at(100), at(110), at(130)],
            token_ids: vec![1, 2, 3],
            prompt_tokens: 8,
            cached_prompt_tokens: 0,
            server_ttft: None,
            spec: SpecStats::default(),
        };
        assert_eq!(s.ttft(), Duration::from_millis(100));
        assert_eq!(s.gaps(), ms_list(&[10, 20]));
        assert_eq!(s.decode_time(), Duration::from_millis(30));
        assert_eq!(s.e2e(), Duration::from_millis(130));
        assert_eq!(rate(3.0, Duration::from_millis(1500)), Some(2.0));
        assert_eq!(rate(3.0, Duration::ZERO), None);
    }
}
