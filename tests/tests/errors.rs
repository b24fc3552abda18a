//! Every bad input gets its status code naming the field, and the server keeps serving; the
//! queue limit, auth, message size limit, health before warm-up and the drain.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use kiln_server::pb;
use kiln_tests::{Options, TestServer, collect_stream, greedy, start_engine};
use tonic::Code;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;

fn with(
    mut r: pb::GenerateRequest,
    f: impl FnOnce(&mut pb::GenerateRequest),
) -> pb::GenerateRequest {
    f(&mut r);
    r
}

fn ids(ids: Vec<u32>) -> Option<pb::generate_request::Prompt> {
    Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds { ids }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_get_invalid_argument_naming_the_field() {
    let t = TestServer::start(Options::default()).await;
    let ok = greedy("Once upon a time", 4);
    let context = 2048; // Options::default().max_model_len
    let cases: Vec<(&str, pb::GenerateRequest, Code, &str)> = vec![
        (
            "missing prompt",
            with(ok.clone(), |r| r.prompt = None),
            Code::InvalidArgument,
            "prompt",
        ),
        (
            "empty prompt",
            with(ok.clone(), |r| {
                r.prompt = Some(pb::generate_request::Prompt::Text(String::new()))
            }),
            Code::InvalidArgument,
            "prompt",
        ),
        (
            "no token ids",
            with(ok.clone(), |r| r.prompt = ids(vec![])),
            Code::InvalidArgument,
            "prompt",
        ),
        (
            "prompt longer than the context",
            with(ok.clone(), |r| r.prompt = ids(vec![504; context + 10])),
            Code::InvalidArgument,
            "prompt",
        ),
        (
            "token id outside the vocabulary",
            with(ok.clone(), |r| r.prompt = ids(vec![504, 49152])),
            Code::InvalidArgument,
            "prompt.token_ids",
        ),
        (
            "negative temperature",
            with(ok.clone(), |r| {
                r.sampling.as_mut().unwrap().temperature = Some(-0.5)
            }),
            Code::InvalidArgument,
            "sampling.temperature",
        ),
        (
            "top_p zero",
            with(ok.clone(), |r| {
                r.sampling.as_mut().unwrap().top_p = Some(0.0)
            }),
            Code::InvalidArgument,
            "sampling.top_p",
        ),
        (
            "top_p above one",
            with(ok.clone(), |r| {
                r.sampling.as_mut().unwrap().top_p = Some(1.5)
            }),
            Code::InvalidArgument,
            "sampling.top_p",
        ),
        (
            "too many stop strings",
            with(ok.clone(), |r| {
                r.stopping.as_mut().unwrap().stop = (0..17).map(|i| format!("s{i}")).collect()
            }),
            Code::InvalidArgument,
            "stopping.stop",
        ),
        (
            "max_new_tokens beyond the limit",
            with(ok.clone(), |r| {
                r.stopping.as_mut().unwrap().max_new_tokens = Some(context as u32 + 1)
            }),
            Code::InvalidArgument,
            "stopping.max_new_tokens",
        ),
        (
            "max_new_tokens zero",
            with(ok.clone(), |r| {
                r.stopping.as_mut().unwrap().max_new_tokens = Some(0)
            }),
            Code::InvalidArgument,
            "stopping.max_new_tokens",
        ),
        (
            "too many outputs",
            with(ok.clone(), |r| r.sampling.as_mut().unwrap().n = 1000),
            Code::InvalidArgument,
            "sampling.n",
        ),
        (
            "too many top logprobs",
            with(ok.clone(), |r| {
                r.output = Some(pb::OutputOptions {
                    top_logprobs: 1000,
                    ..Default::default()
                })
            }),
            Code::InvalidArgument,
            "output.top_logprobs",
        ),
        (
            "logit bias outside the vocabulary",
            with(ok.clone(), |r| {
                r.sampling.as_mut().unwrap().logit_bias.insert(1 << 20, 1.0);
            }),
            Code::InvalidArgument,
            "sampling.logit_bias",
        ),
        (
            "truncation to nothing",
            with(ok.clone(), |r| r.truncate_prompt_tokens = Some(0)),
            Code::InvalidArgument,
            "truncate_prompt_tokens",
        ),
        (
            "another model",
            with(ok.clone(), |r| r.model = "gpt-9".into()),
            Code::NotFound,
            "gpt-9",
        ),
    ];
    let mut g = t.generation();
    for (name, req, code, needle) in cases {
        let err = g.generate(req.clone()).await.expect_err(name);
        assert_eq!(err.code(), code, "{name}: {err:?}");
        assert!(
            err.message().contains(needle),
            "{name}: {:?} does not name {needle}",
            err.message()
        );
        let err = g.generate_stream(req).await.expect_err(name);
        assert_eq!(err.code(), code, "{name} (stream): {err:?}");
    }

    // A malformed grpc-timeout is refused too.
    let mut req = tonic::Request::new(ok.clone());
    req.metadata_mut()
        .insert("grpc-timeout", "soon".parse().unwrap());
    let err = g.generate(req).await.expect_err("bad grpc-timeout");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("grpc-timeout"));

    // Truncation keeps the tail of a prompt that would not fit.
    let long = with(ok.clone(), |r| {
        r.prompt = ids(vec![504; context + 10]);
        r.truncate_prompt_tokens = Some(100);
    });
    let out = g
        .generate(long)
        .await
        .expect("truncated prompt")
        .into_inner();
    assert_eq!(out.usage.unwrap().prompt_tokens, 100);

    // Still serving, and nothing leaked.
    let out = g
        .generate(ok)
        .await
        .expect("a good request after the bad ones")
        .into_inner();
    assert_eq!(out.usage.unwrap().completion_tokens, 4);
    let kv = t.wait_until_idle(Duration::from_secs(10)).await;
    assert_eq!(kv.used_blocks, 0);
    t.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_is_resource_exhausted() {
    let t = TestServer::start(Options {
        max_num_seqs: 1,
        max_waiting: 1,
        ..Options::default()
    })
    .await;
    let mut g = t.generation();
    let long = || {
        let mut r = greedy("Tell me a story", 1000);
        r.stopping.as_mut().unwrap().ignore_eos = true;
        r
    };
    // One running (it has produced a token), one waiting behind it...
    let mut running = g.generate_stream(long()).await.unwrap().into_inner();
    running.message().await.unwrap().expect("first token");
    let waiting = g.generate_stream(long()).await.unwrap().into_inner();
    let mut models = t.models();
    loop {
        let kv = models
            .get_model_info(pb::GetModelInfoRequest::default())
            .await
            .unwrap()
            .into_inner()
            .kv_cache
            .unwrap();
        if kv.waiting_requests == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // ...and the next one is refused.
    let err = g
        .generate(greedy("Hello", 2))
        .await
        .expect_err("queue full");
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    drop(running);
    drop(waiting);
    let kv = t.wait_until_idle(Duration::from_secs(10)).await;
    assert_eq!(kv.used_blocks, 0);
    let out = g
        .generate(greedy("Hello", 2))
        .await
        .expect("served again")
        .into_inner();
    assert_eq!(out.usage.unwrap().completion_tokens, 2);
    t.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_key_guards_the_kiln_services_but_not_health() {
    let mut opts = Options::default();
    opts.server.api.api_key = Some("s3cret".into());
    let t = TestServer::start(opts).await;
    let mut g = t.generation();
    let err = g.generate(greedy("Hi", 2)).await.expect_err("no key");
    assert_eq!(err.code(), Code::Unauthenticated);
    let keyed = |key: &str| {
        let mut r = tonic::Request::new(greedy("Hi", 2));
        r.metadata_mut()
            .insert("authorization", format!("Bearer {key}").parse().unwrap());
        r
    };
    let err = g.generate(keyed("wrong")).await.expect_err("wrong key");
    assert_eq!(err.code(), Code::Unauthenticated);
    assert!(g.generate(keyed("s3cret")).await.is_ok());
    let err = t
        .models()
        .get_model_info(pb::GetModelInfoRequest::default())
        .await
        .expect_err("no key");
    assert_eq!(err.code(), Code::Unauthenticated);
    // Probes need no key.
    let h = t
        .health()
        .check(HealthCheckRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(h.status(), ServingStatus::Serving);
    t.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_requests_are_refused_before_decoding() {
    let mut opts = Options::default();
    opts.server.api.max_request_bytes = 1024;
    let t = TestServer::start(opts).await;
    let mut g = t.generation();
    let err = g
        .generate(greedy(&"word ".repeat(1000), 2))
        .await
        .expect_err("too large");
    // gRPC's code for a message over the limit (tonic's own is OUT_OF_RANGE).
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert!(err.message().contains("too large"), "{err:?}");
    assert!(g.generate(greedy("Hi", 2)).await.is_ok());
    t.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_turns_serving_only_after_the_warm_up() {
    let opts = Options::default();
    let t = TestServer::bind(opts.server.clone()).await;
    let mut health = t.health();
    let mut watch = health
        .watch(HealthCheckRequest::default())
        .await
        .unwrap()
        .into_inner();
    let first = watch.message().await.unwrap().unwrap();
    assert_eq!(first.status(), ServingStatus::NotServing);
    let per_service = HealthCheckRequest {
        service: "kiln.v1.Generation".into(),
    };
    let h = health
        .check(per_service.clone())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(h.status(), ServingStatus::NotServing);
    // No model yet: generation and tokenization are UNAVAILABLE, metrics already answer.
    let err = t
        .generation()
        .generate(greedy("Hi", 2))
        .await
        .expect_err("not ready");
    assert_eq!(err.code(), Code::Unavailable);
    let err = t
        .tokenization()
        .tokenize(pb::TokenizeRequest::default())
        .await
        .expect_err("not ready");
    assert_eq!(err.code(), Code::Unavailable);
    assert!(t.metrics().await.contains("# EOF"));

    let engine = tokio::task::spawn_blocking(move || start_engine(&opts))
        .await
        .unwrap();
    // The engine runs, but until the warm-up finishes the server still says NOT_SERVING.
    let h = health
        .check(HealthCheckRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(h.status(), ServingStatus::NotServing);
    t.server.attach(engine).await.unwrap();
    let next = watch.message().await.unwrap().unwrap();
    assert_eq!(next.status(), ServingStatus::Serving);
    let h = health.check(per_service).await.unwrap().into_inner();
    assert_eq!(h.status(), ServingStatus::Serving);
    // The warm-up went through the engine before the first client request.
    let m = t.metrics().await;
    assert!(m.contains("kiln_generation_tokens_total 2"), "{m}");
    assert!(t.generation().generate(greedy("Hi", 2)).await.is_ok());
    t.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_requests_in_flight_and_refuses_new_ones() {
    let t = TestServer::start(Options::default()).await;
    let mut streams = Vec::new();
    for prompt in [
        "Once upon a time",
        "The capital of France is",
        "My favourite food is",
    ] {
        let mut r = greedy(prompt, 24);
        r.stopping.as_mut().unwrap().ignore_eos = true;
        let mut s = t
            .generation()
            .generate_stream(r)
            .await
            .unwrap()
            .into_inner();
        let first = s.message().await.unwrap().expect("first token");
        streams.push((first, s));
    }
    let server = std::sync::Arc::new(t);
    let drain = {
        let server = server.clone();
        tokio::spawn(async move { server.shutdown().await })
    };
    // New work is refused at once: the listener is closed and the open connection got a
    // GOAWAY, so a new call cannot start here (a load balancer sends it to another replica).
    let start = std::time::Instant::now();
    loop {
        match server.generation().generate(greedy("Hi", 2)).await {
            Err(e) if e.code() == Code::Unavailable => break,
            other => assert!(
                start.elapsed() < Duration::from_secs(30),
                "still taking work: {other:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for (first, s) in streams {
        let (rest, finish, last) = collect_stream(s, 0).await.expect("drained to the end");
        assert!(!first.outputs[0].text.is_empty() || !rest.is_empty());
        assert_eq!(finish.unwrap().reason(), pb::FinishReason::Length);
        assert_eq!(last.usage.unwrap().completion_tokens, 24);
    }
    tokio::time::timeout(Duration::from_secs(30), drain)
        .await
        .expect("shutdown finishes")
        .unwrap();
    assert!(server.server.engine().unwrap().is_stopped());
}

/// Bytes that are not a `GenerateRequest`: what a `GenerateRequest` reader finds in a message
/// whose field 1 (the request id, a string) holds invalid UTF-8, or whose field 2 (the prompt
/// text) is a number.
#[derive(Clone, PartialEq, prost::Message)]
struct NotAGenerateRequest {
    #[prost(bytes = "vec", tag = "1")]
    request_id: Vec<u8>,
    #[prost(uint64, optional, tag = "2")]
    text: Option<u64>,
}

/// Sends `body` to `Generate` as if it were a `GenerateRequest`.
async fn send_raw(t: &TestServer, body: NotAGenerateRequest) -> tonic::Status {
    let mut grpc = tonic::client::Grpc::new(t.channel.clone());
    grpc.ready().await.unwrap();
    let codec = tonic_prost::ProstCodec::<NotAGenerateRequest, pb::GenerateResponse>::default();
    let path = http::uri::PathAndQuery::from_static("/kiln.v1.Generation/Generate");
    grpc.unary(tonic::Request::new(body), path, codec)
        .await
        .expect_err("not a GenerateRequest")
}

/// Undecodable protobuf and invalid UTF-8 are the client's fault: INVALID_ARGUMENT, not the
/// INTERNAL tonic answers them with; the server keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_messages_are_invalid_argument() {
    let t = TestServer::start(Options::default()).await;
    let utf8 = send_raw(
        &t,
        NotAGenerateRequest {
            request_id: vec![b'a', 0xff, 0xfe],
            text: None,
        },
    )
    .await;
    assert_eq!(utf8.code(), Code::InvalidArgument, "{utf8:?}");
    assert!(utf8.message().contains("UTF-8"), "{utf8:?}");
    let wire = send_raw(
        &t,
        NotAGenerateRequest {
            request_id: b"ok".to_vec(),
            text: Some(7),
        },
    )
    .await;
    assert_eq!(wire.code(), Code::InvalidArgument, "{wire:?}");
    assert!(wire.message().contains("wire type"), "{wire:?}");
    assert!(t.generation().generate(greedy("Hi", 2)).await.is_ok());
    t.shutdown().await;
}

/// A body `request_id` is echoed in every streamed message and log line: bounded like the
/// `x-request-id` header instead of being echoed megabytes at a time. An unknown model name
/// comes back cut short.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echoed_names_are_bounded() {
    let t = TestServer::start(Options::default()).await;
    let mut g = t.generation();
    let huge = "x".repeat(1 << 20);
    let err = g
        .generate(with(greedy("Hi", 2), |r| r.request_id = huge.clone()))
        .await
        .expect_err("a 1 MiB request id");
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().starts_with("request_id"), "{err:?}");
    assert!(err.message().len() < 200, "{}", err.message().len());
    let id = "r".repeat(128);
    let out = g
        .generate(with(greedy("Hi", 2), |r| r.request_id = id.clone()))
        .await
        .expect("128 characters are fine")
        .into_inner();
    assert_eq!(out.request_id, id);
    let err = g
        .generate(with(greedy("Hi", 2), |r| r.model = huge.clone()))
        .await
        .expect_err("unknown model");
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    assert!(err.message().len() < 300, "{}", err.message().len());
    assert!(err.message().contains("xxxx…"), "{err:?}");
    t.shutdown().await;
}

/// A hung step (held by a [`kiln_engine::StepGate`]) turns gRPC health NOT_SERVING and HTTP
/// `/health` 503 while it lasts, then SERVING again; the request in it still finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_engine_is_not_serving_until_it_moves() {
    let gate = kiln_engine::StepGate::new();
    let t = TestServer::start(Options {
        faults: kiln_engine::FaultPlan {
            gate: Some(gate.clone()),
            ..Default::default()
        },
        stuck_after: Duration::from_millis(300),
        ..Options::default()
    })
    .await;
    gate.arm();
    let mut g = t.generation();
    let mut r = greedy("Once upon a time", 16);
    r.stopping.as_mut().unwrap().ignore_eos = true;
    let call = tokio::spawn(async move { g.generate(r).await });
    let held = gate.clone();
    let started = tokio::task::spawn_blocking(move || held.wait_started(Duration::from_secs(60)))
        .await
        .unwrap();
    assert!(started, "no step started");
    // Held, the step goes past the limit and stays there whatever the machine's load.
    kiln_tests::wait_for_health(
        &t.channel,
        ServingStatus::NotServing,
        Duration::from_secs(20),
    )
    .await;
    let (code, body) = kiln_tests::http_get(t.http_addr(), "/health").await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("stuck"), "{body}");
    gate.release();
    let out = call.await.unwrap().expect("the stalled request finishes");
    assert_eq!(out.into_inner().usage.unwrap().completion_tokens, 16);
    kiln_tests::wait_for_health(&t.channel, ServingStatus::Serving, Duration::from_secs(20)).await;
    t.shutdown().await;
}
