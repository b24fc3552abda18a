//! Prompt log-probabilities (`OutputOptions::prompt_logprobs`): the values `kiln perplexity`
//! computes for the same tokens (one log-softmax, one runner step); the same values whether
//! the prompt runs alone or chunked, batched with others, preempted, or after its prefix was
//! cached; and `max_new_tokens: 0` scoring the prompt alone.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use kiln_engine::{EngineError, EngineHandle, Field, Output, Request, TokenLogprobs};
use kiln_kv::KvDtype;
use kiln_model::perplexity::score_window;
use kiln_model::{KvPoolConfig, ModelRunner};
use kiln_tensor::Device;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A request scoring `ids` with `top` alternatives a token, then generating `new` tokens.
fn scoring(ids: Vec<u32>, top: usize, new: usize) -> Request {
    let mut r = Request::tokens(ids).max_new_tokens(new);
    r.output.prompt_logprobs = Some(top);
    r.stopping.ignore_eos = true;
    r
}

fn run(e: &EngineHandle, r: Request) -> Output {
    e.submit(r).unwrap().blocking_collect().unwrap()
}

fn scores(out: &Output) -> &[TokenLogprobs] {
    &out.prompt_logprobs
        .as_ref()
        .expect("prompt logprobs")
        .scores
}

/// `got` scores the same tokens as `want`, each within `tol`, with the same best alternative
/// unless the two best are within `tol` of each other.
fn assert_same_scores(got: &[TokenLogprobs], want: &[TokenLogprobs], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.token, w.token, "{what}: position {}", i + 1);
        assert!(
            (g.logprob - w.logprob).abs() <= tol,
            "{what}: position {}: {} vs {}",
            i + 1,
            g.logprob,
            w.logprob
        );
        assert_eq!(g.top.len(), w.top.len(), "{what}");
        let near_tie = w.top.len() > 1 && (w.top[0].logprob - w.top[1].logprob).abs() <= tol;
        if !near_tie && !w.top.is_empty() {
            assert_eq!(g.top[0].token, w.top[0].token, "{what}: position {}", i + 1);
        }
    }
}

#[test]
fn prompt_logprobs_are_kiln_perplexitys_values() {
    let dev = Device::reference();
    let (model, tok) = common::default_model(&dev);
    let text = "It is a truth universally acknowledged, that a single man in possession of a \
                good fortune, must be in want of a wife.";
    let ids = tok.encode(text).unwrap();
    let n = ids.len();
    let pool = KvPoolConfig {
        block_size: 16,
        num_blocks: 16,
        dtype: KvDtype::F32,
    };
    let mut runner = ModelRunner::new(model, pool).unwrap();
    let window = score_window(&mut runner, &ids, (0, n, n - 1), n).unwrap();
    drop(runner);
    let (model, tok) = common::default_model(&dev);
    let mut cfg = common::config(16, 16, 256, 4);
    cfg.kv_dtype = KvDtype::F32;
    let e = kiln_engine::Engine::start(model, tok, cfg).unwrap();
    let out = run(&e, scoring(ids.clone(), 3, 0));
    let lps = scores(&out);
    assert_eq!(lps.len(), n - 1);
    assert_eq!(out.prompt_logprobs.as_ref().map(|p| p.first), Some(ids[0]));
    let nll: f64 = lps.iter().map(|t| -f64::from(t.logprob)).sum();
    assert!(
        (nll - window.nll_sum).abs() < 1e-4 * n as f64,
        "engine {nll} vs kiln perplexity {}",
        window.nll_sum
    );
    // Each scores the next prompt token; the top alternatives are the row's best, in order,
    // and the rank says where the token stands among them.
    for (p, t) in lps.iter().enumerate() {
        assert_eq!(t.token, ids[p + 1]);
        assert_eq!(t.top.len(), 3);
        assert!(t.top.windows(2).all(|w| w[0].logprob >= w[1].logprob));
        match t.top.iter().position(|a| a.token == t.token) {
            Some(k) => assert_eq!(t.rank, k + 1),
            None => assert!(t.rank > 3 && t.logprob <= t.top[2].logprob),
        }
    }
    // Nothing generated: max_new_tokens 0 scores the prompt alone.
    assert!(out.outputs[0].token_ids.is_empty());
    assert_eq!(out.usage.completion_tokens, 0);
}

#[test]
fn chunked_batched_preempted_and_cached_prompts_score_alike() {
    let mut rng = StdRng::seed_from_u64(9);
    let mut prompt = |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(3..256)).collect() };
    let shared = prompt(24);
    let targets: Vec<Vec<u32>> = (0..4)
        .map(|i| {
            let mut p = shared.clone();
            p.extend(prompt(5 + 7 * i));
            p
        })
        .collect();
    let others: Vec<Vec<u32>> = (0..10).map(|i| prompt(10 + 3 * i)).collect();
    for (name, dev) in common::devices() {
        // On wgpu a matmul of a few rows and one of many sum in another order.
        let tol = if name == "wgpu" { 1e-4 } else { 1e-5 };
        let roomy = common::tiny_engine(&dev, 2, common::config(256, 16, 512, 16));
        let want: Vec<Output> = targets
            .iter()
            .map(|t| run(&roomy, scoring(t.clone(), 2, 6)))
            .collect();
        drop(roomy);
        // 16 blocks of 4 tokens, 20-token steps: chunked prefill and preemption both happen;
        // the shared prefix is cached by the requests that do not score it.
        let e = common::tiny_engine(&dev, 2, common::config(16, 4, 20, 16));
        run(&e, Request::tokens(targets[0].clone()).max_new_tokens(1));
        let mut streams = Vec::new();
        for (i, o) in others.iter().enumerate() {
            let mut r = Request::tokens(o.clone()).max_new_tokens(8);
            r.stopping.ignore_eos = true;
            streams.push((None, e.submit(r).unwrap()));
            if let Some(t) = targets.get(i) {
                streams.push((Some(i), e.submit(scoring(t.clone(), 2, 6)).unwrap()));
            }
        }
        for (target, s) in streams {
            let out = s.blocking_collect().unwrap();
            let Some(i) = target else { continue };
            let what = format!("{name}: prompt {i}");
            assert_same_scores(scores(&out), scores(&want[i]), tol, &what);
            assert_eq!(
                out.usage.cached_prompt_tokens, 0,
                "{what}: reused the cache"
            );
            assert_eq!(
                out.outputs[0].token_ids, want[i].outputs[0].token_ids,
                "{what}"
            );
        }
        let stats = common::wait_idle(&e);
        assert!(stats.preemptions > 0, "{name}: the pool never ran short");
        assert_eq!(stats.kv.used_blocks, 0);
        stats.invariants.unwrap();
    }
}

#[test]
fn bad_prompt_logprobs_requests_name_the_field() {
    let e = common::tiny_engine(&Device::reference(), 2, common::config(64, 16, 256, 4));
    let field = |r: Request| match e.submit(r) {
        Err(EngineError::InvalidArgument { field, .. }) => field,
        other => panic!("{other:?}"),
    };
    let limit = e.info().max_top_logprobs;
    assert_eq!(
        field(scoring(vec![5, 6, 7], limit + 1, 1)),
        Field::PromptLogprobs
    );
    // Nothing to generate and nothing to score.
    assert_eq!(
        field(Request::tokens(vec![5, 6, 7]).max_new_tokens(0)),
        Field::MaxNewTokens
    );
    // A one-token prompt has nothing to score, and says so with an empty list.
    let out = run(&e, scoring(vec![5], 1, 0));
    assert_eq!(scores(&out), &[]);
    // A batch with one bad request queues nothing.
    let bad = Request::tokens(vec![5, 300]);
    match e.submit_all(vec![scoring(vec![5, 6], 1, 1), bad]) {
        Err((1, EngineError::InvalidArgument { field, .. })) => {
            assert_eq!(field, Field::PromptTokenIds)
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        common::wait_idle(&e).steps,
        1,
        "only the one-token prompt ran"
    );
}
