//! What asking for prompt log-probabilities costs a prefill: the default model (SmolLM2-135M
//! Q4_1) on the native CPU backend prefills one 512-token prompt and samples one token,
//! without (`plain`) and with `prompt_logprobs: 1` (`prompt_logprobs`: the LM head on all 512
//! positions instead of one, every row read back and log-softmaxed on the host). The ratio of
//! the two figures of one run is the cost; the prefix cache is off, so every iteration computes
//! the whole prompt.
//!
//! Run: `cargo bench -p kiln-engine --bench prompt_logprobs`.

use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use kiln_engine::{Checkpoint, Engine, EngineConfig, EngineHandle, Request};
use kiln_kv::BlockManagerConfig;
use kiln_model::LoadOptions;
use kiln_scheduler::SchedulerConfig;

const PROMPT: usize = 512;

/// Ends the bench with why it cannot run.
fn fail(what: &str, e: impl std::fmt::Display) -> ! {
    eprintln!("prompt_logprobs bench: {what}: {e}");
    std::process::exit(2)
}

fn engine() -> EngineHandle {
    let dev = kiln_testkit::native_cpu();
    let (model, tok) = Checkpoint::open(&kiln_testkit::default_model(), LoadOptions::default())
        .and_then(|c| c.load(&dev, None, &mut |_, _| {}))
        .unwrap_or_else(|e| fail("the default model", e));
    let mut s = SchedulerConfig::new(BlockManagerConfig {
        enable_prefix_caching: false,
        ..BlockManagerConfig::new(64)
    });
    s.max_num_batched_tokens = PROMPT;
    Engine::start(model, tok, EngineConfig::new(s)).unwrap_or_else(|e| fail("the engine", e))
}

fn prefill(e: &EngineHandle, prompt: &[u32], scored: bool) {
    let mut r = Request::tokens(prompt.to_vec()).max_new_tokens(1);
    r.output.prompt_logprobs = scored.then_some(1);
    let out = e.submit(r).and_then(|s| s.blocking_collect());
    match out {
        Ok(o) => assert_eq!(
            o.prompt_logprobs.map(|p| p.scores.len()),
            scored.then_some(PROMPT - 1)
        ),
        Err(e) => fail("a request", e),
    }
}

fn bench(c: &mut Criterion) {
    let e = engine();
    // Token ids spread over the model's vocabulary.
    let prompt: Vec<u32> = (0..PROMPT as u32).map(|i| 300 + (i * 37) % 4000).collect();
    let mut g = c.benchmark_group(format!("prefill_{PROMPT}"));
    g.sample_size(10).measurement_time(Duration::from_secs(20));
    g.bench_function("plain", |b| b.iter(|| prefill(&e, &prompt, false)));
    g.bench_function("prompt_logprobs", |b| b.iter(|| prefill(&e, &prompt, true)));
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
