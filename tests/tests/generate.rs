//! Generation over real gRPC against the default model: the reference text, unary vs stream,
//! per-request options, request ids, deadlines, client disconnects, and 32 concurrent streams
//! with cancellations and deadlines leaving the KV pool all free.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::time::Duration;

use kiln_server::pb;
use kiln_tests::{Options, TestServer, collect_stream, greedy, sampled};
use tonic::Code;

/// Outputs by index over a whole stream: (text, token ids, finish), and the last message.
async fn collect_all(
    mut stream: tonic::Streaming<pb::GenerateResponse>,
) -> (
    BTreeMap<u32, (String, Vec<u32>, Option<pb::FinishInfo>)>,
    Vec<pb::GenerateResponse>,
) {
    let mut outs: BTreeMap<u32, (String, Vec<u32>, Option<pb::FinishInfo>)> = BTreeMap::new();
    let mut msgs = Vec::new();
    while let Some(msg) = stream.message().await.expect("stream message") {
        for o in &msg.outputs {
            let e = outs.entry(o.index).or_default();
            e.0.push_str(&o.text);
            e.1.extend(&o.token_ids);
            if o.finish.is_some() {
                e.2 = o.finish.clone();
            }
        }
        msgs.push(msg);
    }
    (outs, msgs)
}

fn reason(f: &Option<pb::FinishInfo>) -> pb::FinishReason {
    f.as_ref().expect("finish info").reason()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_text_matches_the_transformers_reference() {
    let t = TestServer::start(Options::default()).await;
    let out = t
        .generation()
        .generate(greedy("Once upon a time", 12))
        .await
        .expect("Generate")
        .into_inner();
    let o = &out.outputs[0];
    // HF transformers (float32) continues the prompt this way.
    assert!(
        o.text.starts_with(", the city of Nova Haven"),
        "got {:?}",
        o.text
    );
    assert_eq!(reason(&o.finish), pb::FinishReason::Length);
    let usage = out.usage.expect("usage");
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (4, 12));
    let timing = out.timing.expect("timing");
    assert!(timing.time_to_first_token_ns > 0 && timing.total_ns >= timing.time_to_first_token_ns);
    t.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_deltas_concatenate_to_the_unary_text() {
    let t = TestServer::start(Options::default()).await;
    let mut g = t.generation();
    let mut req = sampled("The best way to learn a language is", 24, 1234);
    req.sampling.as_mut().unwrap().n = 2;
    req.output = Some(pb::OutputOptions {
        return_token_ids: true,
        ..Default::default()
    });
    let unary = g.generate(req.clone()).await.unwrap().into_inner();
    assert_eq!(unary.outputs.len(), 2);

    let (outs, msgs) =
        collect_all(g.generate_stream(req.clone()).await.unwrap().into_inner()).await;
    assert_eq!(outs.len(), 2);
    for u in &unary.outputs {
        let (text, ids, finish) = &outs[&u.index];
        assert_eq!(text, &u.text, "output {}", u.index);
        assert_eq!(ids, &u.token_ids, "output {}", u.index);
        assert_eq!(finish, &u.finish);
    }
    // Usage and timing ride on the last message only.
    let last = msgs.last().unwrap();
    assert_eq!(last.usage.unwrap().completion_tokens, 48);
    assert!(msgs[..msgs.len() - 1].iter().all(|m| m.usage.is_none()));

    // Batched messages: at most `stream_interval` tokens each, same text.
    req.output.as_mut().unwrap().stream_interval = 5;
    let (outs5, msgs5) = collect_all(g.generate_stream(req).await.unwrap().into_inner()).await;
    assert_eq!(outs5, outs);
    assert!(msgs5.len() < msgs.len());
    for m in &msgs5 {
        for o in &m.outputs {
            assert!(
                o.token_ids.len() <= 5,
                "{} tokens in one message",
                o.token_ids.len()
            );
        }
    }
    t.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_options_request_ids_and_stop_strings() {
    let t = TestServer::start(Options::default()).await;
    let mut g = t.generation();

    // Without return_token_ids or logprobs the outputs carry text only.
    let plain = g.generate(greedy("Once upon a time", 4)).await.unwrap();
    let echoed = plain
        .metadata()
        .get(kiln_server::REQUEST_ID)
        .expect("a generated x-request-id")
        .to_str()
        .unwrap()
        .to_owned();
    let plain = plain.into_inner();
    assert_eq!(echoed, plain.request_id);
    assert!(!plain.request_id.is_empty());
    assert!(plain.outputs[0].token_ids.is_empty() && plain.outputs[0].logprobs.is_empty());

    // x-request-id is honoured and echoed; logprobs come with their alternatives.
    let mut body = greedy("Once upon a time", 4);
    body.output = Some(pb::OutputOptions {
        logprobs: true,
        top_logprobs: 3,
        return_token_ids: true,
        ..Default::default()
    });
    let mut req = tonic::Request::new(body);
    req.metadata_mut()
        .insert("x-request-id", "client-abc-123".parse().unwrap());
    let resp = g.generate(req).await.unwrap();
    assert_eq!(
        resp.metadata().get("x-request-id").unwrap(),
        "client-abc-123"
    );
    let resp = resp.into_inner();
    assert_eq!(resp.request_id, "client-abc-123");
    let o = &resp.outputs[0];
    assert_eq!(o.logprobs.len(), 4);
    for (lp, &id) in o.logprobs.iter().zip(&o.token_ids) {
        assert_eq!(lp.token_id, id);
        assert_eq!(lp.top_logprobs.len(), 3);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(lp.top_logprobs[0].token_id, id);
        assert!(lp.logprob <= 0.0);
    }

    // The request_id field wins over the metadata.
    let mut body = greedy("Once upon a time", 2);
    body.request_id = "from-body".into();
    assert_eq!(
        g.generate(body).await.unwrap().into_inner().request_id,
        "from-body"
    );

    // A stop string ends the text before it.
    let mut body = greedy("Once upon a time", 20);
    body.stopping.as_mut().unwrap().stop = vec!["Nova".into()];
    let (text, finish, _) = collect_stream(g.generate_stream(body).await.unwrap().into_inner(), 0)
        .await
        .unwrap();
    assert_eq!(text, ", the city of ");
    let finish = finish.unwrap();
    assert_eq!(finish.reason(), pb::FinishReason::StopSequence);
    assert_eq!(finish.stop_sequence, "Nova");

    // A chat prompt goes through the model's template.
    let chat = pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Chat(pb::ChatMessages {
            messages: vec![pb::ChatMessage {
                role: "user".into(),
                content: "Say hello.".into(),
                ..Default::default()
            }],
            ..Default::default()
        })),
        ..greedy("", 8)
    };
    let out = g.generate(chat).await.unwrap().into_inner();
    assert!(out.usage.unwrap().prompt_tokens > 5);
    t.shutdown().await;
}

/// A request that would run for minutes.
fn endless(text: &str) -> pb::GenerateRequest {
    let mut r = greedy(text, 1500);
    r.stopping.as_mut().unwrap().ignore_eos = true;
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_timeout_ends_unary_and_streaming_calls_with_deadline_exceeded() {
    let t = TestServer::start(Options::default()).await;
    let mut g = t.generation();
    let mut req = tonic::Request::new(endless("The history of the world"));
    req.set_timeout(Duration::from_millis(400));
    let err = g.generate(req).await.expect_err("should time out");
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");

    let mut req = tonic::Request::new(endless("The history of the world"));
    req.set_timeout(Duration::from_millis(600));
    let stream = g.generate_stream(req).await.unwrap().into_inner();
    let err = collect_stream(stream, 0)
        .await
        .expect_err("should time out");
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");

    let kv = t.wait_until_idle(Duration::from_secs(10)).await;
    assert_eq!(kv.used_blocks, 0);
    t.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_aborts_within_one_step() {
    let t = TestServer::start(Options::default()).await;
    let engine = t.server.engine().unwrap().clone();
    let mut g = t.generation();

    // Streaming: drop the stream after two messages.
    let mut stream = g
        .generate_stream(endless("Tell me a story"))
        .await
        .unwrap()
        .into_inner();
    for _ in 0..2 {
        stream.message().await.unwrap().expect("a message");
    }
    let before = engine.stats().await.unwrap().steps;
    drop(stream);
    let after = loop {
        let s = engine.stats().await.unwrap();
        if s.requests == 0 {
            break s;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    // The step running when the client left may finish; the next one no longer has it.
    assert!(
        after.steps <= before + 2,
        "{} steps after the drop",
        after.steps - before
    );
    assert_eq!(after.kv.used_blocks, 0);

    // Unary: the caller gives up (its call is dropped mid-flight).
    let mut g2 = g.clone();
    let call = tokio::spawn(async move { g2.generate(endless("Tell me a story")).await });
    loop {
        if engine.stats().await.unwrap().running == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    call.abort();
    let kv = t.wait_until_idle(Duration::from_secs(10)).await;
    assert_eq!((kv.used_blocks, kv.running_requests), (0, 0));
    t.shutdown().await;
}

/// What one of the 32 streams should do.
#[derive(Debug, Clone, Copy)]
enum Plan {
    /// The client drops the stream after this many messages.
    Cancel(usize),
    /// A short grpc-timeout on a long request.
    Deadline,
    /// Runs to `max_new_tokens`.
    Length,
    /// Ends at a stop string.
    Stop,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_streams_with_cancellations_and_deadlines_leave_the_pool_free() {
    let t = TestServer::start(Options::default()).await;
    let prompts = [
        "Once upon a time",
        "The capital of France is",
        "In a small village by the sea",
        "My favourite food is",
    ];
    let mut tasks = Vec::new();
    for i in 0..32usize {
        let plan = match i % 4 {
            0 => Plan::Cancel(1 + (i / 4) % 3),
            1 => Plan::Deadline,
            2 => Plan::Length,
            _ => Plan::Stop,
        };
        let mut g = t.generation();
        let prompt = prompts[i % prompts.len()];
        tasks.push(tokio::spawn(async move {
            match plan {
                Plan::Cancel(after) => {
                    let mut s = g
                        .generate_stream(endless(prompt))
                        .await
                        .unwrap()
                        .into_inner();
                    for _ in 0..after {
                        s.message()
                            .await
                            .unwrap()
                            .expect("a message before cancelling");
                    }
                    drop(s);
                }
                Plan::Deadline => {
                    let mut req = tonic::Request::new(endless(prompt));
                    req.set_timeout(Duration::from_millis(300 + 50 * (i as u64 % 5)));
                    let s = g.generate_stream(req).await.unwrap().into_inner();
                    let err = collect_stream(s, 0).await.expect_err("a deadline");
                    assert_eq!(err.code(), Code::DeadlineExceeded, "stream {i}: {err:?}");
                }
                Plan::Length => {
                    let mut req = greedy(prompt, 10);
                    req.stopping.as_mut().unwrap().ignore_eos = true;
                    let s = g.generate_stream(req).await.unwrap().into_inner();
                    let (_, finish, last) = collect_stream(s, 0).await.expect("stream completes");
                    assert_eq!(reason(&finish), pb::FinishReason::Length, "stream {i}");
                    assert_eq!(last.usage.unwrap().completion_tokens, 10, "stream {i}");
                }
                Plan::Stop => {
                    let mut req = greedy("Once upon a time", 30);
                    req.stopping.as_mut().unwrap().stop = vec!["Nova".into()];
                    let s = g.generate_stream(req).await.unwrap().into_inner();
                    let (text, finish, _) = collect_stream(s, 0).await.expect("stream completes");
                    assert_eq!(
                        reason(&finish),
                        pb::FinishReason::StopSequence,
                        "stream {i}"
                    );
                    assert_eq!(text, ", the city of ", "stream {i}");
                }
            }
        }));
    }
    for (i, task) in tasks.into_iter().enumerate() {
        task.await.unwrap_or_else(|e| panic!("stream {i}: {e}"));
    }
    let kv = t.wait_until_idle(Duration::from_secs(30)).await;
    assert_eq!(
        (kv.used_blocks, kv.running_requests, kv.waiting_requests),
        (0, 0, 0),
        "{kv:?}"
    );
    assert_eq!(kv.free_blocks, kv.total_blocks);
    let stats = t.server.engine().unwrap().stats().await.unwrap();
    assert_eq!(stats.invariants, Ok(()));
    let metrics = t.metrics().await;
    assert!(metrics.contains("kiln_kv_cache_used_blocks 0"), "{metrics}");
    assert!(metrics.contains("kiln_requests_running 0"), "{metrics}");
    t.shutdown().await;
}

/// `kiln serve --speculative ngram` as a client sees it: the same greedy tokens with the
/// request's `speculative` on (the default) and off, the figures in the last message's
/// `Timing` (zero when off), and the counters on /metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculative_decoding_keeps_greedy_tokens_and_reports_its_figures() {
    let t = TestServer::start(Options {
        speculative: Some(kiln_engine::SpeculativeConfig::ngram()),
        ..Options::default()
    })
    .await;
    let mut g = t.generation();
    // An answer that copies the prompt: n-gram lookup's best case.
    let text = "Copy: the red fox, the red fox, the red fox, the red fox, the red fox,";
    let mut on = greedy(text, 24);
    on.output.get_or_insert_default().return_token_ids = true;
    let mut off = on.clone();
    off.speculative = Some(false);
    let a = g.generate(on).await.unwrap().into_inner();
    let b = g.generate(off).await.unwrap().into_inner();
    assert_eq!(a.outputs[0].token_ids, b.outputs[0].token_ids);
    assert_eq!(a.outputs[0].token_ids.len(), 24);
    let (ta, tb) = (a.timing.unwrap(), b.timing.unwrap());
    assert!(ta.spec_verify_steps > 0, "{ta:?}");
    assert!(
        ta.spec_accepted_tokens > 0 && ta.spec_accepted_tokens <= ta.spec_proposed_tokens,
        "{ta:?}"
    );
    let rate = ta.spec_accepted_tokens as f64 / ta.spec_proposed_tokens as f64;
    assert!((ta.spec_acceptance_rate - rate).abs() < 1e-9, "{ta:?}");
    let mean = ta.spec_accepted_tokens as f64 / ta.spec_verify_steps as f64;
    assert!((ta.spec_mean_accepted_length - mean).abs() < 1e-9, "{ta:?}");
    // Accepted drafts save steps: fewer verifications than tokens.
    assert!(ta.spec_verify_steps < 23, "{ta:?}");
    assert_eq!(
        (
            tb.spec_proposed_tokens,
            tb.spec_accepted_tokens,
            tb.spec_verify_steps
        ),
        (0, 0, 0)
    );
    let m = t.metrics().await;
    let accepted = m
        .lines()
        .find_map(|l| l.strip_prefix("kiln_spec_decode_accepted_tokens_total "))
        .unwrap_or_else(|| panic!("no accepted-token counter in:\n{m}"));
    assert_eq!(accepted.trim(), ta.spec_accepted_tokens.to_string());
    assert!(m.contains("kiln_spec_decode_acceptance_ratio"), "{m}");
    let kv = t.wait_until_idle(Duration::from_secs(10)).await;
    assert_eq!(kv.used_blocks, 0);
    t.shutdown().await;
}

/// Structured output and tool calls over gRPC: a JSON schema, a choice, a bad regex refused
/// before queueing, and a forced tool call (unary and streamed) whose arguments parse and
/// match the function's parameters; the call round-trips as history.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn constraints_and_tool_calls_over_grpc() {
    use pb::generate_request::Constraint;
    let t = TestServer::start(Options::default()).await;
    let mut g = t.generation();

    let schema = r#"{"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
                     "required": ["answer"], "additionalProperties": false}"#;
    let mut r = greedy("Is the sky blue? Answer in JSON: ", 32);
    r.constraint = Some(Constraint::JsonSchema(schema.into()));
    let out = g.generate(r).await.unwrap().into_inner();
    let o = &out.outputs[0];
    let v: serde_json::Value = serde_json::from_str(&o.text).unwrap();
    assert!(
        ["yes", "no"].contains(&v["answer"].as_str().unwrap()),
        "{}",
        o.text
    );
    assert_eq!(reason(&o.finish), pb::FinishReason::ConstraintComplete);

    let mut r = greedy("Pick a colour: ", 16);
    r.constraint = Some(Constraint::Choice(pb::Choices {
        choices: vec!["red".into(), "green".into()],
    }));
    let out = g.generate(r).await.unwrap().into_inner();
    assert!(["red", "green"].contains(&out.outputs[0].text.as_str()));

    let mut r = greedy("x", 4);
    r.constraint = Some(Constraint::Regex("[a-".into()));
    let err = g.generate(r).await.expect_err("a bad regex is refused");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().contains("constraint.regex"),
        "{}",
        err.message()
    );

    let params = r#"{"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                     "required": ["city"], "additionalProperties": false}"#;
    let chat = |messages: Vec<pb::ChatMessage>, mode: pb::tool_choice::Mode| pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Chat(pb::ChatMessages {
            messages,
            tools: vec![pb::Tool {
                name: "get_weather".into(),
                description: "Current weather in a city".into(),
                parameters_json: params.into(),
            }],
            tool_choice: Some(pb::ToolChoice {
                choice: Some(pb::tool_choice::Choice::Mode(mode.into())),
            }),
            ..Default::default()
        })),
        ..greedy("", 64)
    };
    let user = pb::ChatMessage {
        role: "user".into(),
        content: "What is the weather in Paris?".into(),
        ..Default::default()
    };
    let req = chat(vec![user.clone()], pb::tool_choice::Mode::Required);
    let out = g.generate(req.clone()).await.unwrap().into_inner();
    let o = &out.outputs[0];
    assert_eq!(reason(&o.finish), pb::FinishReason::ToolCalls, "{o:?}");
    assert_eq!(o.tool_calls.len(), 1, "{o:?}");
    let call = &o.tool_calls[0];
    assert_eq!(call.name, "get_weather");
    assert!(call.id.starts_with("call_"));
    let args: serde_json::Value = serde_json::from_str(&call.arguments).unwrap();
    assert!(
        args["city"]
            .as_str()
            .is_some_and(|c| c.chars().count() <= 20),
        "{args}"
    );
    assert_eq!(args.as_object().unwrap().len(), 1);

    // Streamed: held, then the whole call on the last message.
    let mut stream = g.generate_stream(req).await.unwrap().into_inner();
    let mut calls = Vec::new();
    while let Some(msg) = stream.message().await.unwrap() {
        for o in msg.outputs {
            calls.extend(o.tool_calls);
        }
    }
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].arguments, call.arguments, "greedy: the same call");

    // The call and its result as history; then an answer in text.
    let history = vec![
        user,
        pb::ChatMessage {
            role: "assistant".into(),
            tool_calls: vec![call.clone()],
            ..Default::default()
        },
        pb::ChatMessage {
            role: "tool".into(),
            content: r#"{"temperature": 18}"#.into(),
            tool_call_id: call.id.clone(),
            ..Default::default()
        },
    ];
    let out = g
        .generate(chat(history, pb::tool_choice::Mode::None))
        .await
        .unwrap()
        .into_inner();
    assert!(out.outputs[0].tool_calls.is_empty());
    assert!(!out.outputs[0].text.is_empty());
    t.shutdown().await;
}
