//! Greedy-decode from token ids on the default model: `cargo run -p kiln-model --example greedy_ids -- MODEL.gguf cpu|wgpu 504 3575 282`.
use kiln_kv::KvDtype;
use kiln_kv::device::{KvCache, KvCacheConfig};
use kiln_model::{GgufSource, LogitsAt, Model, ModelConfig, SeqInput};
use kiln_tensor::{BackendChoice, Device, DeviceOptions, Recorder};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let src = GgufSource::open(std::path::Path::new(&args[1]))?;
    let backend: BackendChoice = args[2].parse()?;
    let dev = Device::new(&DeviceOptions {
        backend,
        ..DeviceOptions::default()
    })?;
    let cfg = ModelConfig::from_gguf(src.file())?;
    println!("{cfg:?}");
    let t0 = std::time::Instant::now();
    let model = Model::load(&dev, cfg.clone(), &src)?;
    println!(
        "loaded in {:?}, {} weight bytes",
        t0.elapsed(),
        model.weight_bytes()
    );
    let mut ids: Vec<u32> = args[3..]
        .iter()
        .map(|s| s.parse())
        .collect::<Result<_, _>>()?;
    let kv = KvCacheConfig {
        layers: cfg.layers,
        kv_heads: cfg.kv_heads,
        head_dim: cfg.head_dim,
        block_size: 16,
        num_blocks: 64,
        dtype: KvDtype::F32,
    };
    let mut cache = KvCache::new(&dev, kv)?;
    let table: Vec<u32> = (0..64).collect();
    let mut fed = 0;
    for step in 0..12 {
        let t = std::time::Instant::now();
        let mut rec = Recorder::new(&dev);
        let logits = model.forward(
            &mut rec,
            &mut cache,
            &[SeqInput {
                tokens: &ids[fed..],
                block_table: &table,
                context_len: ids.len(),
            }],
            LogitsAt::Last,
        )?;
        let best = rec.argmax(&logits)?;
        rec.submit()?;
        let next = best.to_u32_vec()?[0];
        println!("step {step}: {next} ({:?})", t.elapsed());
        fed = ids.len();
        ids.push(next);
    }
    println!("{ids:?}");
    Ok(())
}
