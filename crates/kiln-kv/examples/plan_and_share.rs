//! Plan a paged KV cache from a memory budget, then serve two prompts that share a system
//! prompt: the second reuses the first's full blocks from the prefix cache.
//!
//! `cargo run -p kiln-kv --example plan_and_share`

use kiln_kv::{
    Allocation, BlockManager, KvBudget, KvDtype, KvError, KvPlan, KvPlanConfig, KvShape, SeqConfig,
    SeqId,
};

fn main() -> Result<(), KvError> {
    // SmolLM2-135M's attention: 30 layers, 3 KV heads of 64, f16 keys and values, in 64 MiB.
    let plan = KvPlan::new(&KvPlanConfig {
        shape: KvShape {
            num_layers: 30,
            num_kv_heads: 3,
            head_dim: 64,
            dtype: KvDtype::F16,
        },
        block_size: 16,
        max_seq_len: 8192,
        budget: KvBudget::Bytes(64 << 20),
    })?;
    println!("{plan}");
    assert_eq!(plan.bytes_per_token, 30 * 2 * 3 * 64 * 2);

    let mut kv = BlockManager::new(plan.block_manager_config())?;
    let block = kv.block_size();

    // A 40-token system prompt and two questions of 8 tokens each.
    let system: Vec<u32> = (1000..1040).collect();
    let prompt_a: Vec<u32> = system.iter().copied().chain(2000..2008).collect();
    let prompt_b: Vec<u32> = system.iter().copied().chain(3000..3008).collect();

    let a = SeqId(1);
    let got = admit(&mut kv, a, "A", &prompt_a)?;
    assert_eq!(got.cached_tokens, 0);
    // The model writes K/V for every prompt position at these slots, then commits them, which
    // registers the full blocks in the prefix cache.
    let slots = kv.slots(a, 0..prompt_a.len())?;
    assert_eq!(slots.len(), prompt_a.len());
    kv.commit(a, &prompt_a)?;

    let b = SeqId(2);
    let got = admit(&mut kv, b, "B", &prompt_b)?;
    // The system prompt's two full blocks (32 of its 40 tokens) come from A's.
    assert_eq!(got.cached_tokens, (system.len() / block) * block);
    assert_eq!(kv.block_table(a)?[..2], kv.block_table(b)?[..2]);
    kv.commit(b, &prompt_b[got.cached_tokens..])?;

    // Decode: each new token takes a slot; a block is added when the last one is full.
    for t in 0..20u32 {
        if let Some(copy) = kv.append_slots(a, 1)? {
            println!("copy block {} to {} before writing", copy.src.0, copy.dst.0);
        }
        kv.commit(a, &[4000 + t])?;
    }
    println!(
        "A is {} tokens over {} blocks",
        kv.seq_len(a)?,
        kv.block_table(a)?.len()
    );

    kv.free(a)?;
    kv.free(b)?;
    let m = kv.metrics();
    println!(
        "after both: {} used, {} evictable (kept for the next prompt with this prefix), prefix hits {}/{} tokens",
        m.used_blocks, m.evictable_blocks, m.prefix_hit_tokens, m.prefix_query_tokens
    );
    assert_eq!(m.used_blocks, 0);
    assert!(m.evictable_blocks > 0);
    Ok(())
}

/// Admission: a block table for every prompt position, with the full blocks found in the
/// prefix cache shared rather than computed again.
fn admit(
    kv: &mut BlockManager,
    seq: SeqId,
    name: &str,
    prompt: &[u32],
) -> Result<Allocation, KvError> {
    let got = kv.allocate(seq, prompt, SeqConfig::default())?;
    println!(
        "{name}: {} tokens, {} cached, {} new blocks",
        prompt.len(),
        got.cached_tokens,
        got.new_blocks
    );
    Ok(got)
}
