//! Sampling on the device (`DeviceSampling::On`) gives the tokens the host sampler gives
//! (`Off`) for the same seeds, across the sampling knobs, penalties, bias and
//! `min_new_tokens`, with and without speculative verification; requests that ask for logprobs
//! stay on the host.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeMap;

use kiln_engine::{
    DeviceSampling, EngineConfig, EngineHandle, Request, SamplingParams, SpecMethod,
    SpeculativeConfig,
};

/// Seeded requests over the knobs the device sampler takes.
fn requests(speculate: bool) -> Vec<Request> {
    let knobs = [
        SamplingParams {
            temperature: 1.0,
            ..SamplingParams::default()
        },
        SamplingParams {
            temperature: 0.8,
            top_k: 12,
            top_p: 0.9,
            ..SamplingParams::default()
        },
        SamplingParams {
            temperature: 1.5,
            min_p: 0.1,
            repetition_penalty: 1.3,
            ..SamplingParams::default()
        },
        SamplingParams {
            temperature: 0.7,
            presence_penalty: 0.8,
            frequency_penalty: 0.5,
            logit_bias: BTreeMap::from([(60, 3.0), (61, -100.0)]),
            ..SamplingParams::default()
        },
        // Greedy with a penalty: a row, but no draw.
        SamplingParams {
            temperature: 0.0,
            repetition_penalty: 1.5,
            ..SamplingParams::default()
        },
    ];
    let prompt: Vec<u32> = [40, 41, 42, 43, 60, 61].repeat(3);
    let mut reqs = Vec::new();
    for (i, p) in knobs.iter().enumerate() {
        for seed in 0..4u64 {
            let mut r = Request::tokens(prompt.clone()).sampling(p.clone(), seed * 7 + i as u64);
            r.stopping.max_new_tokens = Some(14);
            // Half of them may not stop on EOS (2) or 70 before 6 tokens.
            if seed % 2 == 1 {
                r.stopping.min_new_tokens = 6;
                r.stopping.stop_token_ids = vec![70];
            } else {
                r.stopping.ignore_eos = true;
            }
            r.speculate = speculate;
            reqs.push(r);
        }
    }
    reqs
}

fn run(e: &EngineHandle, reqs: &[Request]) -> Vec<Vec<u32>> {
    let streams: Vec<_> = reqs.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
    streams
        .into_iter()
        .map(|s| s.blocking_collect().unwrap().outputs[0].token_ids.clone())
        .collect()
}

fn config(on: bool, speculative: bool) -> EngineConfig {
    let mut cfg = common::config(256, 16, 256, 16);
    cfg.device_sampling = if on {
        DeviceSampling::On
    } else {
        DeviceSampling::Off
    };
    if speculative {
        cfg.speculative = Some(SpeculativeConfig {
            method: SpecMethod::Draft,
            num_tokens: 3,
            disable_batch_size: 64,
        });
    }
    cfg
}

#[test]
fn the_device_sampler_gives_the_host_samplers_tokens() {
    let Some(dev) = kiln_testkit::wgpu() else {
        eprintln!("no wgpu adapter (opted out)");
        return;
    };
    let host = common::tiny_engine(&dev, 2, config(false, false));
    let want = run(&host, &requests(false));
    assert_eq!(host.stats_blocking().unwrap().device_sampled_rows, 0);
    let device = common::tiny_engine(&dev, 2, config(true, false));
    let got = run(&device, &requests(false));
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "request {i}");
    }
    let stats = device.stats_blocking().unwrap();
    // Every token of every request came from the device sampler.
    let tokens: usize = got.iter().map(Vec::len).sum();
    assert_eq!(stats.device_sampled_rows, tokens as u64, "{stats:?}");
    assert_eq!(stats.kv.used_blocks, 0);

    // Verification rows sampled on the device, each as if the drafts before it were
    // accepted: the same tokens again.
    let drafted = common::tiny_engine_with_draft(&dev, 2, config(true, true), "llama3");
    let got = run(&drafted, &requests(true));
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "request {i} with speculation");
    }
    let stats = drafted.stats_blocking().unwrap();
    assert!(stats.device_sampled_rows > tokens as u64, "{stats:?}");
}

#[test]
fn logprob_requests_sample_on_the_host() {
    let Some(dev) = kiln_testkit::wgpu() else {
        eprintln!("no wgpu adapter (opted out)");
        return;
    };
    let e = common::tiny_engine(&dev, 2, config(true, false));
    let mut r = Request::tokens(vec![40, 41, 42]).sampling(SamplingParams::default(), 3);
    r.stopping.max_new_tokens = Some(5);
    r.stopping.ignore_eos = true;
    r.output.logprobs = true;
    let out = e.submit(r).unwrap().blocking_collect().unwrap();
    assert_eq!(out.outputs[0].token_ids.len(), 5);
    assert_eq!(e.stats_blocking().unwrap().device_sampled_rows, 0);
}
