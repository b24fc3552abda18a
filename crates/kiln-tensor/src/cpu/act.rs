//! Activations quantized for integer dot products: each 32-element group of a row of X as 32
//! `i8` with an f32 scale (amax / 127, rounded half away from zero, as ggml's `Q8_0`), and the
//! integer sums of its two halves, which the formats with offsets need.

/// Rows of X, quantized.
#[derive(Debug, Default)]
pub(crate) struct QuantX {
    pub m: usize,
    pub k: usize,
    /// `[m][k]` quants.
    pub q: Vec<i8>,
    /// `[m][k / 32]` scales.
    pub d: Vec<f32>,
    /// `[m][k / 32]` sums of quants 0–15 and 16–31.
    pub sums: Vec<[i32; 2]>,
}

impl QuantX {
    /// Quantize `x` (`m` rows of `k`, `k` a multiple of 32) into `self`, reusing its buffers.
    pub fn fill(&mut self, x: &[f32], m: usize, k: usize) {
        debug_assert!(k.is_multiple_of(32) && x.len() == m * k);
        self.m = m;
        self.k = k;
        self.q.resize(m * k, 0);
        self.d.resize(m * k / 32, 0.0);
        self.sums.resize(m * k / 32, [0, 0]);
        for (((xs, qs), d), s) in x
            .chunks_exact(32)
            .zip(self.q.chunks_exact_mut(32))
            .zip(&mut self.d)
            .zip(&mut self.sums)
        {
            let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
            *d = amax / 127.0;
            let id = if *d != 0.0 { 1.0 / *d } else { 0.0 };
            for (q, &v) in qs.iter_mut().zip(xs) {
                *q = (v * id).round() as i8;
            }
            let half = |h: &[i8]| h.iter().map(|&v| i32::from(v)).sum::<i32>();
            *s = [half(&qs[..16]), half(&qs[16..])];
        }
    }

    /// The values the quants stand for (`q·d`), for tests and references.
    #[cfg(test)]
    pub fn dequantized(&self) -> Vec<f32> {
        self.q
            .chunks_exact(32)
            .zip(&self.d)
            .flat_map(|(q, &d)| q.iter().map(move |&v| f32::from(v) * d))
            .collect()
    }
}
