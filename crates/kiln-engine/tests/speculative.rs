//! Speculative decoding: greedy outputs are token-for-token those of plain decoding (n-gram
//! prompt lookup and a draft model, alone and batched, on the golden prompts of the default
//! model and on the tiny models with a pool that forces preemption); a draft model
//! with another tokenizer is refused by name.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use kiln_engine::{
    DraftModel, Engine, EngineConfig, EngineHandle, Request, SamplingParams, SpecMethod, SpecStats,
    SpeculativeConfig, StartError,
};
use kiln_tensor::Device;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;

fn golden_prompts() -> Vec<(String, Vec<u32>)> {
    let v: Value = serde_json::from_str(include_str!(
        "../../kiln-model/tests/fixtures/smollm2_golden.json"
    ))
    .unwrap();
    v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let ids = c["prompt_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect();
            (c["name"].as_str().unwrap().to_owned(), ids)
        })
        .collect()
}

fn spec(method: SpecMethod, k: usize) -> SpeculativeConfig {
    SpeculativeConfig {
        method,
        num_tokens: k,
        disable_batch_size: 64,
    }
}

fn greedy(ids: &[u32], new: usize, speculate: bool) -> Request {
    let mut r = Request::tokens(ids.to_vec()).max_new_tokens(new);
    r.stopping.ignore_eos = true;
    r.speculate = speculate;
    r
}

/// Runs `reqs` at once; returns each one's tokens and speculation figures.
fn batch(e: &EngineHandle, reqs: &[Request]) -> Vec<(Vec<u32>, SpecStats)> {
    let streams: Vec<_> = reqs.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
    streams
        .into_iter()
        .map(|s| {
            let out = s.blocking_collect().unwrap();
            (out.outputs[0].token_ids.clone(), out.timing.speculative)
        })
        .collect()
}

fn total(stats: &[(Vec<u32>, SpecStats)]) -> SpecStats {
    stats
        .iter()
        .fold(SpecStats::default(), |a, (_, s)| SpecStats {
            proposed_tokens: a.proposed_tokens + s.proposed_tokens,
            accepted_tokens: a.accepted_tokens + s.accepted_tokens,
            verify_steps: a.verify_steps + s.verify_steps,
        })
}

fn assert_idle_and_free(e: &EngineHandle, name: &str) {
    let stats = common::wait_idle(e);
    assert_eq!(stats.kv.used_blocks, 0, "{name}: {stats:?}");
    if let Some(d) = stats.draft_kv {
        assert_eq!(d.used_blocks, 0, "{name}: draft pool: {stats:?}");
    }
    stats.invariants.unwrap();
}

/// Every golden prompt, greedy, 32 new tokens: with speculation off (the reference), then on,
/// one at a time and all together.
fn check_golden(name: &str, e: &EngineHandle) -> SpecStats {
    let prompts = golden_prompts();
    let off: Vec<Request> = prompts.iter().map(|(_, p)| greedy(p, 32, false)).collect();
    let on: Vec<Request> = prompts.iter().map(|(_, p)| greedy(p, 32, true)).collect();
    let want: Vec<Vec<u32>> = off
        .iter()
        .map(|r| batch(e, std::slice::from_ref(r))[0].0.clone())
        .collect();
    let alone: Vec<(Vec<u32>, SpecStats)> = on
        .iter()
        .map(|r| batch(e, std::slice::from_ref(r))[0].clone())
        .collect();
    let together = batch(e, &on);
    for (i, (case, _)) in prompts.iter().enumerate() {
        assert_eq!(alone[i].0, want[i], "{name}/{case}: alone");
        assert_eq!(together[i].0, want[i], "{name}/{case}: batched");
    }
    assert_idle_and_free(e, name);
    let t = total(&alone);
    assert!(t.verify_steps > 0 && t.proposed_tokens > 0, "{name}: {t:?}");
    eprintln!(
        "{name}: alone {t:?} acceptance {:.2}, batched {:?}",
        t.acceptance_rate(),
        total(&together)
    );
    t
}

fn golden_config() -> EngineConfig {
    common::config(256, 16, 256, 8)
}

#[test]
fn greedy_with_ngram_lookup_is_plain_greedy_on_the_golden_prompts() {
    for (name, dev) in common::devices() {
        let mut cfg = golden_config();
        cfg.speculative = Some(spec(SpecMethod::Ngram { min_n: 1, max_n: 3 }, 4));
        let e = common::default_engine(&dev, cfg);
        check_golden(name, &e);
    }
}

#[test]
fn greedy_with_a_draft_model_is_plain_greedy_on_the_golden_prompts() {
    // The only real checkpoint in the tests is the default model, so it drafts for itself:
    // nearly every draft holds, which walks the all-accepted path (bonus token, draft cache
    // reuse); the tiny models below walk the rejections.
    let dev = Device::reference();
    let (model, tokenizer) = common::default_model(&dev);
    let (draft, draft_tok) = common::default_model(&dev);
    let mut cfg = golden_config();
    cfg.speculative = Some(spec(SpecMethod::Draft, 3));
    let e = Engine::start_with_draft(
        model,
        tokenizer,
        cfg,
        Some(DraftModel {
            model: draft,
            tokenizer: draft_tok,
        }),
    )
    .unwrap();
    let t = check_golden("cpu", &e);
    assert!(t.acceptance_rate() > 0.9, "{t:?}");
    let m = e.metrics().encode();
    for name in [
        "kiln_spec_decode_proposed_tokens_total",
        "kiln_spec_decode_accepted_tokens_total",
        "kiln_spec_decode_acceptance_ratio",
        "kiln_spec_decode_mean_accepted_length",
    ] {
        assert!(m.contains(name), "{name} missing from:\n{m}");
    }
}

/// The tiny llama (drafted for by the tiny mistral, or by n-gram lookup) on every backend: ten
/// requests, greedy and seeded-sampled, some not speculating, in a pool small enough to
/// preempt, give each the tokens it gives alone without speculation.
#[test]
fn tiny_models_keep_every_token_in_a_crowd_with_preemption() {
    let mut rng = StdRng::seed_from_u64(9);
    let mut prompt = |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(3..256)).collect() };
    let all: Vec<Request> = (0..10)
        .map(|i| {
            let mut r = greedy(&prompt(10 + 3 * i), 30 + i, i % 4 != 3);
            if i % 2 == 1 {
                r = r.sampling(
                    SamplingParams {
                        temperature: 0.9,
                        ..SamplingParams::default()
                    },
                    i as u64,
                );
                r.stopping.max_new_tokens = Some(30 + i);
            }
            r
        })
        .collect();
    for (name, dev) in common::devices() {
        for method in [SpecMethod::Ngram { min_n: 1, max_n: 2 }, SpecMethod::Draft] {
            let make = |cfg: EngineConfig| match method {
                SpecMethod::Draft => common::tiny_engine_with_draft(&dev, 2, cfg, "mistral"),
                SpecMethod::Ngram { .. } => common::tiny_engine(&dev, 2, cfg),
            };
            let mut roomy = common::config(512, 16, 512, 16);
            roomy.speculative = Some(spec(method, 4));
            let e = make(roomy);
            let want: Vec<Vec<u32>> = all
                .iter()
                .map(|r| {
                    let mut off = r.clone();
                    off.speculate = false;
                    batch(&e, &[off])[0].0.clone()
                })
                .collect();
            let alone = batch(&e, std::slice::from_ref(&all[0]));
            assert_eq!(alone[0].0, want[0], "{name}/{method:?}: alone");
            assert!(alone[0].1.verify_steps > 0, "{name}/{method:?}: {alone:?}");
            drop(e);

            // 24 blocks of 4 tokens, 32-token steps: chunked prefill, preemption, drafts cut
            // by the budget and the pool.
            let mut small = common::config(24, 4, 32, 10);
            small.speculative = Some(spec(method, 4));
            let e = make(small);
            let got = batch(&e, &all);
            for (i, (r, (ids, s))) in all.iter().zip(&got).enumerate() {
                assert_eq!(*ids, want[i], "{name}/{method:?}: request {i} in a crowd");
                if !r.speculate {
                    assert_eq!(*s, SpecStats::default(), "{name}: opted out but speculated");
                }
            }
            let stats = e.stats_blocking().unwrap();
            assert!(stats.preemptions > 0, "{name}/{method:?}: {stats:?}");
            assert_idle_and_free(&e, name);
            let t = total(&got);
            assert!(t.verify_steps > 0, "{name}/{method:?}: {t:?}");
            eprintln!("{name}/{method:?}: crowd {t:?}");
        }
    }
}

#[test]
fn speculation_stays_off_above_the_batch_size_rule() {
    let mut cfg = common::config(256, 16, 256, 8);
    cfg.speculative = Some(SpeculativeConfig {
        disable_batch_size: 2,
        ..spec(SpecMethod::Ngram { min_n: 1, max_n: 2 }, 4)
    });
    let e = common::tiny_engine(&Device::reference(), 2, cfg);
    let measured = greedy(&[5, 6, 7, 5, 6], 12, true);
    // Alone it speculates.
    let alone = batch(&e, std::slice::from_ref(&measured));
    assert!(alone[0].1.verify_steps > 0, "{alone:?}");
    // With three long requests running, four run: more than two, so never.
    let background: Vec<_> = (0..3u32)
        .map(|i| {
            e.submit(greedy(&[9 + i, 6, 7, 9 + i, 6], 240, true))
                .unwrap()
        })
        .collect();
    let start = std::time::Instant::now();
    while e.stats_blocking().unwrap().running < 3 {
        assert!(start.elapsed().as_secs() < 30, "the background never ran");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let crowded = batch(&e, std::slice::from_ref(&measured));
    assert_eq!(crowded[0].1, SpecStats::default());
    assert_eq!(crowded[0].0, alone[0].0);
    for s in background {
        e.abort(s.id());
    }
    assert_idle_and_free(&e, "cpu");
}

#[test]
fn a_draft_model_with_another_tokenizer_is_refused_by_name() {
    let dev = Device::reference();
    let mut cfg = common::config(64, 16, 64, 4);
    cfg.speculative = Some(spec(SpecMethod::Draft, 4));
    let mut other = common::byte_tokenizer(3);
    // Same vocabulary, other end-of-sequence id.
    let draft = DraftModel {
        model: common::tiny_model(&dev, "mistral"),
        tokenizer: std::mem::replace(&mut other, common::byte_tokenizer(3)),
    };
    let err = Engine::start_with_draft(
        common::tiny_model(&dev, "llama3"),
        common::byte_tokenizer(2),
        cfg.clone(),
        Some(draft),
    )
    .unwrap_err();
    match &err {
        StartError::Config { field, reason } => {
            assert_eq!(*field, "draft_model");
            assert!(reason.contains("end-of-sequence"), "{reason}");
        }
        e => panic!("{e}"),
    }
    // Another vocabulary: the default model's tokenizer.
    let path = kiln_testkit::default_model();
    let smol = kiln_tokenizer::Tokenizer::from_gguf_file(&path).unwrap();
    let err = Engine::start_with_draft(
        common::tiny_model(&dev, "llama3"),
        common::byte_tokenizer(2),
        cfg.clone(),
        Some(DraftModel {
            model: common::tiny_model(&dev, "mistral"),
            tokenizer: smol,
        }),
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("tokens, the target's has 256"),
        "{err}"
    );
    // The draft method without a draft model.
    let err = Engine::start(
        common::tiny_model(&dev, "llama3"),
        common::byte_tokenizer(2),
        cfg,
    )
    .unwrap_err();
    assert!(err.to_string().contains("needs a draft model"), "{err}");
}

#[test]
fn seeded_sampling_gives_the_same_tokens_with_and_without_speculation() {
    // A sampled draw is a function of the seed, the position and the logits (Gumbel-max), and
    // verification accepts a draft exactly when it is that draw: so every seeded request gives
    // the same tokens with drafts as without, while drafts are both accepted and rejected. The
    // tiny llama drafts for itself, so its drafts are its most likely tokens.
    let mut cfg = common::config(256, 16, 256, 16);
    cfg.speculative = Some(spec(SpecMethod::Draft, 3));
    let e = common::tiny_engine_with_draft(&Device::reference(), 2, cfg, "llama3");
    let prompt: Vec<u32> = [40, 41, 42, 43].repeat(4);
    let params = SamplingParams {
        temperature: 1.2,
        top_k: 6,
        top_p: 0.95,
        ..SamplingParams::default()
    };
    let reqs = |speculate: bool| -> Vec<Request> {
        (0..64)
            .map(|seed| {
                let mut r = Request::tokens(prompt.clone()).sampling(params.clone(), seed);
                r.stopping.max_new_tokens = Some(12);
                r.stopping.ignore_eos = true;
                r.speculate = speculate;
                r
            })
            .collect()
    };
    let plain = batch(&e, &reqs(false));
    let drafted = batch(&e, &reqs(true));
    for (seed, (a, b)) in plain.iter().zip(&drafted).enumerate() {
        assert_eq!(a.0, b.0, "seed {seed}");
    }
    let t = total(&drafted);
    let rate = t.acceptance_rate();
    assert!(
        t.verify_steps > 64 && rate > 0.1 && rate < 0.9,
        "drafts must be both accepted and rejected: {t:?}"
    );
    assert_idle_and_free(&e, "cpu");
}

#[test]
fn drafts_that_keep_missing_back_off() {
    // The tiny mistral predicts the tiny llama badly: after verifying steps that accept
    // nothing, a sequence decodes 1, 2, 4, 8, then 16 steps without drafts, so most of a long
    // output is plain decoding; its tokens stay those of plain decoding.
    let mut cfg = common::config(256, 16, 256, 4);
    cfg.speculative = Some(spec(SpecMethod::Draft, 4));
    let e = common::tiny_engine_with_draft(&Device::reference(), 2, cfg, "mistral");
    let r = greedy(&[7, 8, 9, 10, 11], 120, true);
    let mut off = r.clone();
    off.speculate = false;
    let plain = batch(&e, &[off])[0].0.clone();
    let (ids, s) = batch(&e, &[r])[0].clone();
    assert_eq!(ids, plain);
    assert!(s.verify_steps > 0, "{s:?}");
    // 119 decode steps: with every draft missed, verifications come after 0, 1, 2, 4, 8, 16,
    // 16, ... plain steps: about 10 of them, where drafting every step would make 119.
    let most = if s.accepted_tokens == 0 { 12 } else { 60 };
    assert!(s.verify_steps <= most, "no back-off: {s:?}");
    assert_idle_and_free(&e, "cpu");
}
