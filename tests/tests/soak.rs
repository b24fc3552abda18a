//! A bounded soak of the whole server: 64 concurrent clients over gRPC and HTTP mixing valid
//! requests, malformed ones, streams dropped after their first token and calls whose deadline
//! passes, on a KV pool small enough to preempt. Every request ends with a status its kind
//! allows; health stays SERVING throughout; afterwards no request runs or waits and every KV
//! block is free, and the process grew by less than 256 MiB of resident memory.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use kiln_tests::http::{SseStream, post, post_with};
use kiln_tests::{Options, TestServer, greedy};
use serde_json::json;
use tonic::Code;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;

const CLIENTS: usize = 64;
const REQUESTS_PER_CLIENT: usize = 4;
/// Resident memory the soak may add (the model, pool and kernels are in before it starts).
const RSS_BOUND_MIB: u64 = 256;

fn rss_mib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS");
    kib / 1024
}

/// splitmix64: each client's choices, reproducible from its index.
fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

const PROMPTS: [&str; 4] = [
    "Once upon a time",
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
];

/// One request of kind `kind`; panics when it ends with a status its kind does not allow.
async fn one(t: &TestServer, kind: u64, pick: u64) {
    let prompt = PROMPTS[(pick % 4) as usize];
    let new = 1 + (pick % 6) as u32;
    let mut g = t.generation();
    let http = t.http_addr();
    match kind {
        // Valid, whole: short ones, and long ones that fill the pool.
        0 => {
            let out = g
                .generate(greedy(prompt, new))
                .await
                .expect("valid request");
            assert!(out.into_inner().usage.unwrap().completion_tokens <= new);
        }
        1 => {
            let mut r = greedy(prompt, 48);
            r.stopping.as_mut().unwrap().ignore_eos = true;
            let out = g.generate(r).await.expect("valid long request");
            assert_eq!(out.into_inner().usage.unwrap().completion_tokens, 48);
        }
        // A stream dropped after its first token.
        2 => {
            let mut s = g
                .generate_stream(greedy(prompt, 64))
                .await
                .expect("stream")
                .into_inner();
            s.message().await.expect("first message");
        }
        // A deadline that may pass: finished or DEADLINE_EXCEEDED, nothing else.
        3 => {
            let mut r = tonic::Request::new(greedy(prompt, 32));
            r.set_timeout(Duration::from_millis(5 + pick % 200));
            if let Err(e) = g.generate(r).await {
                assert!(
                    matches!(e.code(), Code::DeadlineExceeded | Code::Cancelled),
                    "{e:?}"
                );
            }
        }
        // Malformed over gRPC: a field out of range, a request id too long, a prompt plus
        // max_new_tokens over the context.
        4 => {
            let mut r = greedy(prompt, new);
            match pick % 3 {
                0 => r.sampling.as_mut().unwrap().top_p = Some(5.0),
                1 => r.request_id = "x".repeat(4096),
                _ => r.stopping.as_mut().unwrap().max_new_tokens = Some(100_000),
            }
            let e = g.generate(r).await.expect_err("malformed");
            assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        }
        // Valid over HTTP.
        5 => {
            let r = post(
                http,
                "/v1/chat/completions",
                &json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": new,
                        "temperature": 0}),
            )
            .await;
            assert_eq!(r.status, 200, "{}", r.body);
        }
        // Malformed over HTTP: not JSON, a wrong type, an unknown model.
        6 => {
            let body: Vec<u8> = match pick % 3 {
                0 => b"{\"messages\": [".to_vec(),
                1 => json!({"prompt": prompt, "temperature": "hot"})
                    .to_string()
                    .into_bytes(),
                _ => json!({"prompt": prompt, "model": "m".repeat(10_000)})
                    .to_string()
                    .into_bytes(),
            };
            let r = post_with(http, "/v1/completions", body, &[]).await;
            assert!(matches!(r.status, 400 | 404), "{}: {}", r.status, r.body);
            assert!(r.body.len() < 1024, "{} bytes echoed", r.body.len());
        }
        // An HTTP stream dropped after its first chunk.
        _ => {
            let mut s = SseStream::open(
                http,
                "/v1/completions",
                &json!({"prompt": prompt, "max_tokens": 64, "stream": true}),
            )
            .await;
            assert!(s.next_data().await.is_some());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_clients_mixing_good_and_bad_requests() {
    let t = Arc::new(
        TestServer::start(Options {
            // 48 blocks of 16 tokens: a few dozen long sequences at once must preempt.
            kv_blocks: 48,
            max_num_seqs: 32,
            max_model_len: Some(512),
            ..Options::default()
        })
        .await,
    );
    let before = rss_mib();
    let stop = Arc::new(AtomicBool::new(false));
    let probes = Arc::new(AtomicUsize::new(0));
    let health = {
        let (t, stop, probes) = (t.clone(), stop.clone(), probes.clone());
        tokio::spawn(async move {
            let mut h = t.health();
            while !stop.load(Ordering::Acquire) {
                let s = h
                    .check(HealthCheckRequest::default())
                    .await
                    .expect("health answers")
                    .into_inner();
                assert_eq!(s.status(), ServingStatus::Serving, "health left SERVING");
                probes.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let t = t.clone();
            tokio::spawn(async move {
                let mut state = c as u64;
                for _ in 0..REQUESTS_PER_CLIENT {
                    let kind = next(&mut state) % 8;
                    let pick = next(&mut state);
                    one(&t, kind, pick).await;
                }
            })
        })
        .collect();
    for c in clients {
        c.await.expect("a client failed");
    }
    stop.store(true, Ordering::Release);
    health.await.expect("health probe");
    assert!(probes.load(Ordering::Relaxed) > 0);

    let kv = t.wait_until_idle(Duration::from_secs(30)).await;
    assert_eq!(
        (kv.used_blocks, kv.running_requests, kv.waiting_requests),
        (0, 0, 0),
        "{kv:?}"
    );
    let grown = rss_mib().saturating_sub(before);
    assert!(grown < RSS_BOUND_MIB, "resident memory grew {grown} MiB");
    let metrics = t.metrics().await;
    assert!(
        !metrics.contains("kiln_preemptions_total 0\n"),
        "the soak never preempted: the pool is too large to test that"
    );
    t.shutdown().await;
}
