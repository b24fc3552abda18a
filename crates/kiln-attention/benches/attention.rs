//! Paged attention of one decode token on the native CPU backend, per KV cache format:
//! `decode/<shape>/<dtype>` attends one token at position 640 (a 128-token reply after a
//! 512-token prompt, where the bench's tg128 runs) over one layer's K/V, as a model's decode
//! step does in each layer. Throughput in bytes is the K/V bytes the format keeps for those
//! positions (scales included), so criterion's rate is the bandwidth the format's reads
//! reach; compare formats within one run.
//!
//! Shapes: SmolLM2-135M (9 query heads on 3 KV heads of 64) and Gemma 3 270M (4 on 1 of 256).
//! The INT4 cache's keys are centred on eight channel pairs a KV head, as a calibrated one's
//! are, so its scores pay for adding the centres back.
//!
//! Run: `cargo bench -p kiln-attention --bench attention` (filter with e.g. `-- int4`).

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kiln_attention::{
    AttnBatch, AttnConfig, CENTRED_PAIRS, KeyCentre, KvCache, KvCacheConfig, SeqBatch,
};
use kiln_kv::{BlockId, KvDtype};
use kiln_tensor::{BackendChoice, Device, DeviceOptions, Recorder, Tensor};

/// Positions the decode token attends (its own included).
const CONTEXT: usize = 641;
const BLOCK: usize = 16;

/// (name, query heads, KV heads, head_dim).
const SHAPES: [(&str, usize, usize, usize); 2] = [("smollm2", 9, 3, 64), ("gemma3", 4, 1, 256)];

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// A bench that cannot set up or run says why and stops.
fn fail(e: &dyn std::fmt::Display) -> ! {
    eprintln!("attention bench: {e}");
    std::process::exit(2)
}

/// One shape's decode step over `dtype`'s cache: the cache with the prompt's K/V written, the
/// step's batch, its query and the attention's shape.
struct Step {
    cache: KvCache,
    batch: AttnBatch,
    q: Tensor,
    attn: AttnConfig,
}

fn step(
    dev: &Device,
    (heads, kv_heads, head_dim): (usize, usize, usize),
    dtype: KvDtype,
) -> Result<Step> {
    let blocks = CONTEXT.div_ceil(BLOCK);
    // Blocks in reverse, so the rows are not one run of memory.
    let table: Vec<BlockId> = (0..blocks as u32).rev().map(BlockId).collect();
    let cfg = KvCacheConfig {
        layers: 1,
        kv_heads,
        head_dim,
        block_size: BLOCK,
        num_blocks: blocks,
        dtype,
    };
    let mut cache = KvCache::new(dev, cfg)?;
    if dtype == KvDtype::Int4 {
        // As a calibrated INT4 cache has them: every KV head's keys centred on eight pairs.
        let centres: Vec<KeyCentre> = (0..kv_heads * CENTRED_PAIRS)
            .map(|i| {
                let j = i % CENTRED_PAIRS;
                KeyCentre {
                    lo: j as u16,
                    hi: (j + head_dim / 2) as u16,
                    freq: 10_000f32.powf(-2.0 * j as f32 / head_dim as f32),
                    mean: [2.0, -1.0],
                }
            })
            .collect();
        cache.set_key_centres(&centres)?;
    }
    let seq = |query_len| SeqBatch {
        block_table: &table,
        query_len,
        context_len: CONTEXT,
    };
    let prompt = cache.batch(&[seq(CONTEXT)])?;
    let rows: Vec<f32> = (0..CONTEXT * kv_heads * head_dim)
        .map(|i| (i * 7919 % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let kv = Tensor::from_f32(dev, &[CONTEXT, kv_heads, head_dim], &rows)?;
    let mut rec = Recorder::new(dev);
    cache.write(&mut rec, 0, &kv, &kv, &prompt)?;
    rec.submit()?;
    let batch = cache.batch(&[seq(1)])?;
    let q = Tensor::from_f32(dev, &[1, heads, head_dim], &rows[..heads * head_dim])?;
    let attn = AttnConfig {
        heads,
        scale: 1.0 / (head_dim as f32).sqrt(),
        window: None,
        sinks: None,
    };
    Ok(Step {
        cache,
        batch,
        q,
        attn,
    })
}

impl Step {
    fn run(&self, dev: &Device) -> Result<Tensor> {
        let mut rec = Recorder::new(dev);
        let out = self
            .cache
            .attention(&mut rec, 0, &self.q, &self.batch, &self.attn)?;
        rec.submit()?;
        Ok(out)
    }
}

fn bench(c: &mut Criterion) {
    let opts = DeviceOptions {
        backend: BackendChoice::Cpu,
        ..DeviceOptions::default()
    };
    let dev = Device::new(&opts).unwrap_or_else(|e| fail(&e));
    let mut g = c.benchmark_group("decode");
    for (name, heads, kv_heads, head_dim) in SHAPES {
        for dtype in KvDtype::ALL {
            let s = step(&dev, (heads, kv_heads, head_dim), dtype).unwrap_or_else(|e| fail(&e));
            let slots = CONTEXT.div_ceil(BLOCK) * BLOCK;
            let per_position = s.cache.pool_bytes() / slots;
            g.throughput(Throughput::Bytes((per_position * CONTEXT) as u64));
            g.bench_function(BenchmarkId::new(name, dtype), |b| {
                b.iter(|| s.run(&dev).unwrap_or_else(|e| fail(&e)))
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
