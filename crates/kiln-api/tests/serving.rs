//! `Serving`, what the front doors share: loading, serving, draining and stuck as health says
//! them, new work refused while loading or draining, one drain for every caller, and the call
//! counts in the one metrics text.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::{config, tiny_engine};
use kiln_api::{Health, NotServing, Protocol, Serving, ServingConfig};
use kiln_engine::{EngineError, FaultPlan, Request, StepGate};
use kiln_tensor::Device;

fn serving(stuck_after: Duration) -> Serving {
    Serving::new(ServingConfig {
        drain_timeout: Duration::from_secs(10),
        stuck_after,
        ..ServingConfig::default()
    })
}

#[tokio::test]
async fn loading_serving_draining() {
    let s = serving(Duration::from_secs(60));
    assert_eq!(s.health(), Health::Loading);
    assert_eq!(s.for_work().err(), Some(NotServing::Loading));
    s.attach(tiny_engine(&Device::reference(), 255, config(64, 4, 32, 8)))
        .await
        .unwrap();
    assert_eq!(s.health(), Health::Serving);
    assert!(
        s.attach(tiny_engine(&Device::reference(), 255, config(64, 4, 32, 8)))
            .await
            .is_err(),
        "a second engine"
    );
    let engine = s.for_work().unwrap().clone();
    let running = engine
        .submit(Request::tokens(vec![1, 2, 3]).max_new_tokens(40))
        .unwrap();

    // Two front doors drain at once: both wait for the one drain, the request finishes.
    tokio::join!(s.drain(), s.drain());
    assert_eq!(s.health(), Health::Draining);
    assert_eq!(s.for_work().err(), Some(NotServing::Draining));
    assert!(s.loaded().is_ok(), "reads still work while draining");
    assert!(engine.is_stopped());
    let out = running.collect().await.unwrap();
    assert_eq!(out.outputs[0].token_ids.len(), 40);

    s.record(Protocol::Http, "/v1/completions", "200");
    s.record(Protocol::Http, "/v1/completions", "200");
    s.record(Protocol::Grpc, "/kiln.v1.Generation/Generate", "Ok");
    let text = s.metrics_text();
    assert!(text.contains(
        r#"kiln_api_requests_total{protocol="http",endpoint="/v1/completions",code="200"} 2"#
    ));
    assert!(text.contains("kiln_generation_tokens_total 42"), "{text}");
    assert!(text.ends_with("# EOF\n"));
}

/// A step held in flight (an armed [`StepGate`]) is stuck at once with no slack; released,
/// the request finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_running_past_the_limit_is_stuck() {
    let gate = StepGate::new();
    let mut cfg = config(64, 4, 32, 8);
    cfg.faults = FaultPlan {
        gate: Some(gate.clone()),
        ..FaultPlan::default()
    };
    let s = serving(Duration::ZERO);
    s.attach(tiny_engine(&Device::reference(), 255, cfg))
        .await
        .unwrap();
    let engine = s.engine().unwrap().clone();
    gate.arm();
    let mut long = Request::tokens(vec![1, 2, 3]).max_new_tokens(20);
    long.stopping.ignore_eos = true;
    let stream = engine.submit(long).unwrap();
    let held = gate.clone();
    let started = tokio::task::spawn_blocking(move || held.wait_started(Duration::from_secs(60)))
        .await
        .unwrap();
    assert!(started, "the request's step never started");
    assert_eq!(s.health(), Health::Stuck);
    gate.release();
    let out = stream.collect().await.unwrap();
    assert_eq!(out.outputs[0].token_ids.len(), 20);
}

/// A step that hangs (held by a [`StepGate`]) makes health Stuck once it has gone past the
/// limit, saying why; once it moves again the request finishes and health is Serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_step_is_stuck_until_it_moves_again() {
    let gate = StepGate::new();
    let mut cfg = config(64, 4, 32, 8);
    cfg.faults = FaultPlan {
        gate: Some(gate.clone()),
        ..FaultPlan::default()
    };
    let s = serving(Duration::from_millis(300));
    s.attach(tiny_engine(&Device::reference(), 255, cfg))
        .await
        .unwrap();
    let engine = s.engine().unwrap().clone();
    gate.arm();
    let mut long = Request::tokens(vec![1, 2, 3]).max_new_tokens(40);
    long.stopping.ignore_eos = true;
    let stream = engine.submit(long).unwrap();
    let held = gate.clone();
    let started = tokio::task::spawn_blocking(move || held.wait_started(Duration::from_secs(60)))
        .await
        .unwrap();
    assert!(started, "the request's step never started");
    // Held, the step goes past the limit whatever the machine's load, and stays there.
    let waited = tokio::time::Instant::now();
    while s.health() != Health::Stuck {
        assert!(waited.elapsed() < Duration::from_secs(60), "never stuck");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let why = s.stuck_reason().unwrap();
    assert!(why.contains("no progress"), "{why}");
    gate.release();
    let out = stream.collect().await.unwrap();
    assert_eq!(out.outputs[0].token_ids.len(), 40);
    // The loop goes idle once the last step closes, and stays so: Serving.
    let waited = tokio::time::Instant::now();
    while s.health() != Health::Serving {
        assert!(
            waited.elapsed() < Duration::from_secs(60),
            "still {:?}",
            s.health()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Steps that keep failing (a lost device, injected) fail their requests with INTERNAL; after
/// three in a row the engine stops, health says why, and new work is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steps_that_keep_failing_stop_the_engine() {
    let mut cfg = config(64, 4, 32, 8);
    cfg.faults = FaultPlan {
        fail_from_step: Some(1),
        ..FaultPlan::default()
    };
    let engine = tiny_engine(&Device::reference(), 255, cfg);
    for _ in 0..3 {
        match engine.submit(Request::tokens(vec![1, 2, 3]).max_new_tokens(4)) {
            Ok(stream) => match stream.collect().await {
                Err(EngineError::Internal(e)) => {
                    assert!(e.to_string().contains("injected fault"), "{e}");
                }
                other => panic!("expected INTERNAL, got {other:?}"),
            },
            Err(e) => panic!("refused before three failures: {e}"),
        }
    }
    let waited = tokio::time::Instant::now();
    while !engine.is_stopped() {
        assert!(waited.elapsed() < Duration::from_secs(10), "still running");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(matches!(
        engine.submit(Request::tokens(vec![1, 2, 3])),
        Err(EngineError::ShuttingDown)
    ));
    let s = serving(Duration::from_secs(60));
    // A stopped engine cannot warm up: attach fails, and the process would exit.
    assert!(s.attach(engine).await.is_err());
}
