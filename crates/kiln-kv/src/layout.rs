//! What one sequence's KV caches hold, cache by cache and layer by layer, and what they cost
//! at a context length: for attention that keeps several caches a layer, growing at different
//! rates (DeepSeek-V4's compressed attention: a window of raw K=V, one pooled entry every 4 or
//! 128 tokens, the lightning indexer's keys, the compressors' pending windows), beside the
//! one cache of ordinary attention (every token's K and V) and MLA's latent. Sizing only:
//! what a `kiln info` prints and a planner divides a budget by.

use crate::KvDtype;

/// What a cache holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CacheKind {
    /// Every token's keys and values (ordinary attention), or MLA's latent and RoPE key.
    Full,
    /// The raw K=V of the last `window` tokens: a ring of fixed size.
    Window,
    /// Entries pooled by a compressor, one every `ratio` tokens of the sequence (CSA at 4,
    /// HCA at 128).
    Compressed,
    /// The lightning indexer's keys, one every `ratio` tokens (CSA layers; V3.2's every token).
    IndexerKeys,
    /// A compressor's pending windows (their kv and gate rows, f32): fixed size.
    CompressorState,
}

impl CacheKind {
    pub fn name(self) -> &'static str {
        match self {
            CacheKind::Full => "full K/V",
            CacheKind::Window => "sliding window",
            CacheKind::Compressed => "compressed entries",
            CacheKind::IndexerKeys => "indexer keys",
            CacheKind::CompressorState => "compressor state",
        }
    }
}

/// How many entries a cache holds after `tokens` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Growth {
    /// One every `ratio` tokens, once the `ratio` tokens are all there (`tokens / ratio`).
    Every(u64),
    /// The last `n` tokens (`min(tokens, n)`): a ring.
    Last(u64),
    /// `n`, whatever the length.
    Fixed(u64),
}

impl Growth {
    fn entries(self, tokens: u64) -> u64 {
        match self {
            Growth::Every(ratio) => tokens / ratio.max(1),
            Growth::Last(n) => tokens.min(n),
            Growth::Fixed(n) => n,
        }
    }
}

/// One cache of one layer: `vectors` vectors of `width` values an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerCache {
    pub layer: u32,
    pub kind: CacheKind,
    pub width: u32,
    /// Vectors an entry: 2 for separate keys and values of one head, 1 where K is V.
    pub vectors: u32,
    pub growth: Growth,
    /// Kept in f32 whatever the cache's dtype (a compressor's state).
    pub f32: bool,
}

impl LayerCache {
    /// Bytes of one entry stored as `dtype`.
    pub fn entry_bytes(&self, dtype: KvDtype) -> u64 {
        let d = if self.f32 { KvDtype::F32 } else { dtype };
        u64::from(self.vectors) * d.head_bytes(self.width)
    }

    /// Bytes after `tokens` tokens.
    pub fn bytes_at(&self, tokens: u64, dtype: KvDtype) -> u64 {
        self.growth.entries(tokens) * self.entry_bytes(dtype)
    }

    /// Bytes a token adds once the sequence is long (an entry's bytes spread over its
    /// `ratio` tokens); `None` for a cache of fixed size.
    pub fn bytes_per_token(&self, dtype: KvDtype) -> Option<f64> {
        match self.growth {
            Growth::Every(r) => Some(self.entry_bytes(dtype) as f64 / r.max(1) as f64),
            Growth::Last(_) | Growth::Fixed(_) => None,
        }
    }
}

/// Every cache of one sequence.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct KvLayout {
    pub caches: Vec<LayerCache>,
}

impl KvLayout {
    /// Ordinary attention: every layer keeps each token's K and V for `kv_heads` heads.
    pub fn dense(layers: u32, kv_heads: u32, head_dim: u32) -> Self {
        Self {
            caches: (0..layers)
                .map(|layer| LayerCache {
                    layer,
                    kind: CacheKind::Full,
                    width: head_dim,
                    vectors: 2 * kv_heads,
                    growth: Growth::Every(1),
                    f32: false,
                })
                .collect(),
        }
    }

    /// DeepSeek-V3.2's cache: every layer keeps each token's MLA latent and RoPE key
    /// (`latent + rope` values) and its lightning indexer key (`index_dim`).
    pub fn mla(layers: u32, latent: u32, rope: u32, index_dim: u32) -> Self {
        let mut caches = Vec::new();
        for layer in 0..layers {
            for (kind, width) in [
                (CacheKind::Full, latent + rope),
                (CacheKind::IndexerKeys, index_dim),
            ] {
                caches.push(LayerCache {
                    layer,
                    kind,
                    width,
                    vectors: 1,
                    growth: Growth::Every(1),
                    f32: false,
                });
            }
        }
        Self { caches }
    }

    /// Bytes of the whole layout after `tokens` tokens of one sequence.
    pub fn bytes_at(&self, tokens: u64, dtype: KvDtype) -> u64 {
        self.caches.iter().map(|c| c.bytes_at(tokens, dtype)).sum()
    }

    /// Bytes a token adds once the sequence is long (the caches that grow, each entry's bytes
    /// spread over its `ratio` tokens).
    pub fn bytes_per_token(&self, dtype: KvDtype) -> f64 {
        self.caches
            .iter()
            .filter_map(|c| c.bytes_per_token(dtype))
            .sum()
    }

    /// Values (elements) a token adds once the sequence is long: the figure that does not
    /// depend on the element type.
    pub fn values_per_token(&self) -> f64 {
        self.caches
            .iter()
            .filter_map(|c| match c.growth {
                Growth::Every(r) => {
                    Some(f64::from(c.vectors) * f64::from(c.width) / r.max(1) as f64)
                }
                Growth::Last(_) | Growth::Fixed(_) => None,
            })
            .sum()
    }

    /// Bytes of the caches of `kind` after `tokens` tokens.
    pub fn kind_bytes(&self, kind: CacheKind, tokens: u64, dtype: KvDtype) -> u64 {
        self.caches
            .iter()
            .filter(|c| c.kind == kind)
            .map(|c| c.bytes_at(tokens, dtype))
            .sum()
    }

    /// Bytes by kind of cache after `tokens` tokens, in [`CacheKind`] order, kinds with none
    /// left out.
    pub fn by_kind(&self, tokens: u64, dtype: KvDtype) -> Vec<(CacheKind, u64)> {
        let kinds: std::collections::BTreeSet<CacheKind> =
            self.caches.iter().map(|c| c.kind).collect();
        kinds
            .into_iter()
            .map(|k| (k, self.kind_bytes(k, tokens, dtype)))
            .filter(|&(_, b)| b > 0)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dense_layout_is_the_kv_shape_s_bytes_a_token() {
        let l = KvLayout::dense(30, 3, 64);
        let shape = crate::KvShape {
            num_layers: 30,
            num_kv_heads: 3,
            head_dim: 64,
            dtype: KvDtype::F16,
        };
        assert_eq!(
            l.bytes_per_token(KvDtype::F16),
            shape.bytes_per_token().unwrap() as f64
        );
        assert_eq!(
            l.bytes_at(100, KvDtype::Int8),
            100 * 30 * 2 * 3 * KvDtype::Int8.head_bytes(64)
        );
        assert_eq!(l.values_per_token(), (30 * 2 * 3 * 64) as f64);
    }

    #[test]
    fn caches_grow_at_their_own_rates() {
        let cache = |kind, width, growth, f32| LayerCache {
            layer: 0,
            kind,
            width,
            vectors: 1,
            growth,
            f32,
        };
        let l = KvLayout {
            caches: vec![
                cache(CacheKind::Window, 8, Growth::Last(128), false),
                cache(CacheKind::Compressed, 8, Growth::Every(4), false),
                cache(CacheKind::CompressorState, 8, Growth::Fixed(3), true),
            ],
        };
        // 10 tokens: 10 window rows, 2 complete entries (the third window is pending), state.
        let (w, e, s) = (8 * 2, 8 * 2, 3 * 8 * 4);
        assert_eq!(l.bytes_at(10, KvDtype::F16), 10 * w + 2 * e + s);
        // 1000 tokens: the ring holds 128.
        assert_eq!(l.bytes_at(1000, KvDtype::F16), 128 * w + 250 * e + s);
        assert_eq!(l.bytes_per_token(KvDtype::F16), e as f64 / 4.0);
        assert_eq!(
            l.by_kind(10, KvDtype::F16),
            vec![
                (CacheKind::Window, 10 * w),
                (CacheKind::Compressed, 2 * e),
                (CacheKind::CompressorState, s)
            ]
        );
        assert_eq!(
            l.by_kind(0, KvDtype::F16),
            vec![(CacheKind::CompressorState, s)]
        );
    }
}
