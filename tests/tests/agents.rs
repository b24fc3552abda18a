//! The doors agents use, against the real server: OpenAI's Responses API and Anthropic's
//! Messages API beside chat completions and gRPC. One conversation reads the same through
//! every door (same prompt, same defaults, same greedy text); real client turns (Codex's,
//! Claude Code's, from their published request shapes) get a 200 and a well-formed stream;
//! malformed bodies get each door's own error shape, naming the field, and leak nothing;
//! the reasoning split reaches every door.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use kiln_api::ReasoningParser;
use kiln_engine::SamplingParams;
use kiln_server::pb;
use kiln_tests::http::{SseStream, delete, get, post, post_with};
use kiln_tests::{Options, TestServer};
use kiln_tokenizer::ChatTemplate;
use serde_json::{Value, json};

const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1";
const QUESTION: &str = "Name three colours.";

fn fixture(name: &str) -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name);
    let text = std::fs::read_to_string(&path).expect("read a fixture");
    let mut v: Value = serde_json::from_str(&text).expect("a JSON fixture");
    v["model"] = json!(MODEL);
    v
}

/// The gRPC chat prompt of one user message.
fn grpc_chat(text: &str) -> pb::GenerateRequest {
    pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Chat(pb::ChatMessages {
            messages: vec![pb::ChatMessage {
                role: "user".into(),
                content: text.into(),
                ..Default::default()
            }],
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// The `data:` JSON of every event of a stream.
async fn events(mut s: SseStream) -> Vec<Value> {
    assert_eq!(s.status, 200);
    s.rest()
        .await
        .iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("JSON event data"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_door_reads_a_conversation_the_same() {
    let mut opts = Options::default();
    // Server defaults every door applies to what a call leaves unset: greedy, 12 tokens.
    opts.server.api.default_sampling = SamplingParams::greedy();
    opts.server.api.default_max_tokens = Some(12);
    opts.server.api.model_ids.push("gpt-5-codex".into());
    let t = TestServer::start(opts).await;
    let addr = t.http_addr();
    let user = json!([{"role": "user", "content": QUESTION}]);

    let chat = post(addr, "/v1/chat/completions", &json!({"messages": user})).await;
    assert_eq!(chat.status, 200, "{}", chat.body);
    let text = chat.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(!text.is_empty());

    // An alias an agent sends is served; the reply carries the first name.
    let resp = post(
        addr,
        "/v1/responses",
        &json!({"model": "gpt-5-codex", "input": QUESTION}),
    )
    .await;
    assert_eq!(resp.status, 200, "{}", resp.body);
    let r = resp.json();
    assert_eq!(r["model"], MODEL);
    assert_eq!(r["output"][0]["content"][0]["text"], text.as_str());
    assert_eq!(
        r["usage"]["input_tokens"],
        chat.json()["usage"]["prompt_tokens"]
    );

    // Messages requires max_tokens; the server's default length is the same 12.
    let msg = post(
        addr,
        "/v1/messages",
        &json!({"model": MODEL, "max_tokens": 12, "messages": user}),
    )
    .await;
    assert_eq!(msg.status, 200, "{}", msg.body);
    assert_eq!(msg.json()["content"][0]["text"], text.as_str());

    let grpc = t
        .generation()
        .generate(grpc_chat(QUESTION))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(grpc.outputs[0].text, text);

    // The models list names every alias.
    let models = get(addr, "/v1/models").await.json();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(ids, [MODEL, "gpt-5-codex"]);
    t.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_and_claude_code_turns_stream_well_formed() {
    let t = TestServer::start(Options::default()).await;
    let addr = t.http_addr();

    // Codex: the whole history, mixed tool types (a function, a custom grammar tool, a hosted
    // one), reasoning items, unknown fields. Short, so the test stays quick.
    let mut codex = fixture("codex_turn.json");
    codex["max_output_tokens"] = json!(16);
    let ev = events(SseStream::open(addr, "/v1/responses", &codex).await).await;
    assert_eq!(ev[0]["type"], "response.created");
    assert_eq!(ev[1]["type"], "response.in_progress");
    let last = ev.last().unwrap();
    assert!(
        ["response.completed", "response.incomplete"].contains(&last["type"].as_str().unwrap()),
        "{last}"
    );
    for (i, e) in ev.iter().enumerate() {
        assert_eq!(e["sequence_number"], i as u64, "{e}");
    }
    let id = last["response"]["id"].as_str().unwrap();
    assert!(
        ev.iter()
            .all(|e| e.get("response").is_none_or(|r| r["id"] == id))
    );

    // Claude Code: system blocks with cache_control, thinking with a signature, tool_use,
    // tool_result (one an error), its headers and `?beta=true`.
    let headers: Value = fixture("claude_code_turn.headers.json");
    let headers: Vec<(String, String)> = headers
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| k.as_str() != "model")
        .filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_owned())))
        .collect();
    let headers: Vec<(&str, &str)> = headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let mut claude = fixture("claude_code_turn.json");
    claude["max_tokens"] = json!(16);
    let s = SseStream::open_with(
        addr,
        "/v1/messages?beta=true",
        claude.to_string().into_bytes(),
        &headers,
    )
    .await;
    let ev = events(s).await;
    let kinds: Vec<&str> = ev.iter().filter_map(|e| e["type"].as_str()).collect();
    assert_eq!(kinds.first(), Some(&"message_start"), "{kinds:?}");
    assert_eq!(kinds.last(), Some(&"message_stop"), "{kinds:?}");
    assert_eq!(kinds[kinds.len() - 2], "message_delta");
    let starts = kinds
        .iter()
        .filter(|k| **k == "content_block_start")
        .count();
    let stops = kinds.iter().filter(|k| **k == "content_block_stop").count();
    assert!(starts >= 1 && starts == stops, "{kinds:?}");

    // Claude Code's max_tokens (32000, beyond this model's context) is a ceiling, not a
    // refusal.
    let big = post(
        addr,
        "/v1/messages",
        &json!({"model": MODEL, "max_tokens": 32000, "stop_sequences": [" "],
                "messages": [{"role": "user", "content": QUESTION}]}),
    )
    .await;
    assert_eq!(big.status, 200, "{}", big.body);
    t.wait_until_idle(Duration::from_secs(30)).await;
    t.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_bodies_get_each_door_s_shape_and_lose_nothing() {
    let t = TestServer::start(Options::default()).await;
    let addr = t.http_addr();
    let openai = |r: &kiln_tests::http::Reply, param: &str| {
        assert_eq!(r.status, 400, "{}", r.body);
        let e = &r.json()["error"];
        assert_eq!(e["type"], "invalid_request_error", "{}", r.body);
        assert_eq!(e["param"], param, "{}", r.body);
    };
    openai(
        &post(addr, "/v1/responses", &json!({"input": 5})).await,
        "input",
    );
    openai(
        &post(
            addr,
            "/v1/responses",
            &json!({"input": "x", "temperature": "hot"}),
        )
        .await,
        "temperature",
    );
    openai(
        &post(
            addr,
            "/v1/responses",
            &json!({"input": [{"type": "function_call", "name": "f"}]}),
        )
        .await,
        "input[0].call_id",
    );
    openai(
        &post(
            addr,
            "/v1/responses",
            &json!({"input": "x", "text": {"format": {"type": "xml"}}}),
        )
        .await,
        "text.format.type",
    );
    // Errors name a tool by its place in the body, hosted tools (dropped) counted.
    openai(
        &post(
            addr,
            "/v1/responses",
            &json!({"input": "x", "tools": [{"type": "web_search"},
                                            {"type": "function", "name": "bad name"}]}),
        )
        .await,
        "tools[1].name",
    );
    let gone = post(
        addr,
        "/v1/responses",
        &json!({"input": "x", "previous_response_id": "resp_0"}),
    )
    .await;
    assert_eq!(gone.status, 404, "{}", gone.body);
    assert_eq!(gone.json()["error"]["param"], "previous_response_id");

    let anthropic = |r: &kiln_tests::http::Reply, status: u16, kind: &str, names: &str| {
        assert_eq!(r.status, status, "{}", r.body);
        let v = r.json();
        assert_eq!(v["type"], "error", "{}", r.body);
        assert_eq!(v["error"]["type"], kind, "{}", r.body);
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.starts_with(names), "{message}");
    };
    let user = json!([{"role": "user", "content": "hi"}]);
    anthropic(
        &post(
            addr,
            "/v1/messages",
            &json!({"model": MODEL, "max_tokens": "many", "messages": user}),
        )
        .await,
        400,
        "invalid_request_error",
        "max_tokens",
    );
    anthropic(
        &post(
            addr,
            "/v1/messages",
            &json!({"model": MODEL, "messages": user}),
        )
        .await,
        400,
        "invalid_request_error",
        "max_tokens",
    );
    let image =
        json!([{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]);
    anthropic(
        &post(
            addr,
            "/v1/messages",
            &json!({"model": MODEL, "max_tokens": 4, "messages": image}),
        )
        .await,
        400,
        "invalid_request_error",
        "messages[0].content[0].type",
    );
    anthropic(
        &post(
            addr,
            "/v1/messages",
            &json!({"model": "claude-x", "max_tokens": 4, "messages": user}),
        )
        .await,
        404,
        "not_found_error",
        "model `claude-x`",
    );
    anthropic(
        &post(
            addr,
            "/v1/messages/count_tokens",
            &json!({"model": MODEL, "messages": 3}),
        )
        .await,
        400,
        "invalid_request_error",
        "messages",
    );
    anthropic(
        &post_with(addr, "/v1/messages", b"{not json".to_vec(), &[]).await,
        400,
        "invalid_request_error",
        "the body is not valid JSON",
    );
    let kv = t.wait_until_idle(Duration::from_secs(30)).await;
    assert_eq!(kv.running_requests + kv.waiting_requests, 0);
    t.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_are_stored_continued_and_deleted() {
    let t = TestServer::start(Options::default()).await;
    let addr = t.http_addr();
    let first = post(
        addr,
        "/v1/responses",
        &json!({"input": QUESTION, "temperature": 0, "max_output_tokens": 6}),
    )
    .await;
    assert_eq!(first.status, 200, "{}", first.body);
    let first = first.json();
    let id = first["id"].as_str().unwrap();
    assert_eq!(
        get(addr, &format!("/v1/responses/{id}")).await.json(),
        first
    );
    let next = post(
        addr,
        "/v1/responses",
        &json!({"input": "And three more?", "previous_response_id": id, "temperature": 0,
                "max_output_tokens": 6, "store": false}),
    )
    .await
    .json();
    assert_eq!(next["previous_response_id"], id);
    let (a, b) = (
        &first["usage"]["input_tokens"],
        &next["usage"]["input_tokens"],
    );
    assert!(
        b.as_u64() > a.as_u64(),
        "the stored turn is prepended: {a} then {b}"
    );
    assert_eq!(
        get(
            addr,
            &format!("/v1/responses/{}", next["id"].as_str().unwrap())
        )
        .await
        .status,
        404
    );
    let deleted = delete(addr, &format!("/v1/responses/{id}")).await;
    assert_eq!(deleted.json()["deleted"], true);
    assert_eq!(get(addr, &format!("/v1/responses/{id}")).await.status, 404);
    assert_eq!(
        delete(addr, &format!("/v1/responses/{id}")).await.status,
        404
    );
    t.shutdown().await;
}

/// A template that opens the think block in the prompt, as Qwen3's and DeepSeek-R1's do.
const THINKING_CHATML: &str = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n<think>\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reasoning_split_reaches_every_door() {
    let mut opts = Options::default();
    opts.server.api.reasoning = Some(ReasoningParser::Qwen3);
    opts.server.api.chat_template = Some(std::sync::Arc::new(
        ChatTemplate::new("thinking", THINKING_CHATML).unwrap(),
    ));
    let t = TestServer::start(opts).await;
    let addr = t.http_addr();
    let user = json!([{"role": "user", "content": QUESTION}]);

    // A structured-output constraint shapes the answer: the think block the prompt opened is
    // closed first, then the regex holds.
    let colour = json!({"messages": user, "temperature": 0, "max_tokens": 32,
                        "structured_outputs": {"regex": "(Red|Blue|Green)"}});
    let c = post(addr, "/v1/chat/completions", &colour).await.json();
    let m = &c["choices"][0]["message"];
    assert!(m["reasoning_content"].is_null(), "{c}");
    let answer = m["content"].as_str().unwrap();
    assert!(
        ["Red", "Blue", "Green"].contains(&answer.trim_start()),
        "{c}"
    );

    // Left to itself the model never closes it: all reasoning, on every door.
    let chat = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": user, "temperature": 0, "max_tokens": 8}),
    )
    .await
    .json();
    let m = &chat["choices"][0]["message"];
    let thought = m["reasoning_content"].as_str().unwrap().to_owned();
    assert!(!thought.is_empty() && m["content"].is_null(), "{chat}");
    let s = SseStream::open(
        addr,
        "/v1/chat/completions",
        &json!({"messages": user, "temperature": 0, "max_tokens": 8, "stream": true}),
    )
    .await;
    let streamed: String = events(s)
        .await
        .iter()
        .filter_map(|e| {
            e["choices"][0]["delta"]["reasoning_content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(streamed, thought);

    let r = post(
        addr,
        "/v1/responses",
        &json!({"input": QUESTION, "temperature": 0, "max_output_tokens": 8}),
    )
    .await
    .json();
    assert_eq!(r["output"][0]["type"], "reasoning", "{r}");
    assert_eq!(r["output"][0]["content"][0]["text"], thought.as_str());
    let s = SseStream::open(
        addr,
        "/v1/responses",
        &json!({"input": QUESTION, "temperature": 0, "max_output_tokens": 8, "stream": true}),
    )
    .await;
    let streamed: String = events(s)
        .await
        .iter()
        .filter(|e| e["type"] == "response.reasoning_text.delta")
        .filter_map(|e| e["delta"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(streamed, thought);

    let msg = post(
        addr,
        "/v1/messages",
        &json!({"model": MODEL, "max_tokens": 8, "temperature": 0, "messages": user}),
    )
    .await
    .json();
    assert_eq!(msg["content"][0]["type"], "thinking", "{msg}");
    assert_eq!(msg["content"][0]["thinking"], thought.as_str());
    assert!(
        msg["content"][0]["signature"]
            .as_str()
            .is_some_and(|s| !s.is_empty())
    );

    // A forced call, and a JSON format, hold after the think block, which they close: the
    // call and the JSON are the answer, not reasoning.
    let weather = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 12}},
                       "required": ["city"], "additionalProperties": false}}}]);
    let called = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": user, "tools": weather, "tool_choice": "required", "max_tokens": 64}),
    )
    .await
    .json();
    let choice = &called["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{called}");
    assert_eq!(
        choice["message"]["tool_calls"][0]["function"]["name"],
        "get_weather"
    );
    assert!(choice["message"]["reasoning_content"].is_null(), "{called}");
    let json_answer = post(
        addr,
        "/v1/responses",
        &json!({"input": QUESTION, "temperature": 0, "max_output_tokens": 48,
                "text": {"format": {"type": "json_schema", "name": "colour", "schema": {
                    "type": "object", "properties": {"colour": {"type": "string", "maxLength": 10}},
                    "required": ["colour"], "additionalProperties": false}}}}),
    )
    .await
    .json();
    let item = json_answer["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["type"] == "message")
        .expect("a message item");
    let text = item["content"][0]["text"].as_str().unwrap();
    assert!(
        serde_json::from_str::<Value>(text).is_ok_and(|v| v.is_object()),
        "{json_answer}"
    );

    let mut g = grpc_chat(QUESTION);
    g.sampling = Some(pb::SamplingParams {
        temperature: Some(0.0),
        ..Default::default()
    });
    g.stopping = Some(pb::StoppingCriteria {
        max_new_tokens: Some(8),
        ..Default::default()
    });
    let out = t.generation().generate(g).await.unwrap().into_inner();
    assert_eq!(out.outputs[0].reasoning, thought);
    assert_eq!(out.outputs[0].text, "");
    t.shutdown().await;
}

/// GPT-OSS's chat template (Harmony), as its GGUF and tokenizer config carry it.
const GPT_OSS_TEMPLATE: &str =
    include_str!("../../crates/kiln-api/tests/fixtures/gpt_oss_chat_template.jinja");

/// Harmony's channels reach every door as reasoning, content and tool calls. The CI model
/// does not speak Harmony, so a regex makes it write Harmony's markers (as text: its
/// vocabulary has no such special tokens) under GPT-OSS's own template, which turns the
/// split on by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harmony_channels_reach_every_door() {
    let mut opts = Options::default();
    opts.server.api.chat_template = Some(std::sync::Arc::new(
        ChatTemplate::new("gpt-oss", GPT_OSS_TEMPLATE).unwrap(),
    ));
    let t = TestServer::start(opts).await;
    let addr = t.http_addr();
    let user = json!([{"role": "user", "content": QUESTION}]);
    let answer = "<\\|channel\\|>analysis<\\|message\\|>[a-z]{3,8}<\\|end\\|>\
                  <\\|start\\|>assistant<\\|channel\\|>final<\\|message\\|>(Red|Blue|Green)";
    let body = json!({"messages": user, "temperature": 0, "max_tokens": 64,
                      "structured_outputs": {"regex": answer}});
    let c = post(addr, "/v1/chat/completions", &body).await.json();
    let m = &c["choices"][0]["message"];
    let thought = m["reasoning_content"].as_str().unwrap().to_owned();
    assert!(
        !thought.is_empty() && thought.chars().all(|c| c.is_ascii_lowercase()),
        "{c}"
    );
    let said = m["content"].as_str().unwrap().to_owned();
    assert!(["Red", "Blue", "Green"].contains(&said.as_str()), "{c}");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = events(SseStream::open(addr, "/v1/chat/completions", &streamed).await).await;
    let part = |key: &str| -> String {
        events
            .iter()
            .filter_map(|e| e["choices"][0]["delta"][key].as_str().map(str::to_owned))
            .collect()
    };
    assert_eq!(
        (part("reasoning_content"), part("content")),
        (thought.clone(), said.clone())
    );

    // A call in the commentary channel, with tools on: a tool call, not text.
    let weather = json!([{"type": "function", "function": {"name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]);
    let call = "<\\|channel\\|>analysis<\\|message\\|>[a-z]{3,8}<\\|end\\|>\
                <\\|start\\|>assistant<\\|channel\\|>commentary to=functions\\.get_weather \
                <\\|constrain\\|>json<\\|message\\|>\\{\"city\":\"(Oslo|Rome)\"\\}";
    let called = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": user, "tools": weather, "temperature": 0, "max_tokens": 96,
                "structured_outputs": {"regex": call}}),
    )
    .await
    .json();
    let choice = &called["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{called}");
    let f = &choice["message"]["tool_calls"][0]["function"];
    assert_eq!(f["name"], "get_weather", "{called}");
    let args: Value = serde_json::from_str(f["arguments"].as_str().unwrap()).unwrap();
    assert!(
        ["Oslo", "Rome"].contains(&args["city"].as_str().unwrap()),
        "{called}"
    );
    assert!(choice["message"]["content"].is_null(), "{called}");
    assert!(
        choice["message"]["reasoning_content"].is_string(),
        "{called}"
    );
    // A forced call is refused: the model chooses its calls.
    let forced = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": user, "tools": weather, "tool_choice": "required"}),
    )
    .await;
    assert_eq!(forced.status, 400);
    assert!(forced.body.contains("tool_choice"), "{}", forced.body);

    // gRPC: the same split of the same greedy output.
    let mut g = grpc_chat(QUESTION);
    g.sampling = Some(pb::SamplingParams {
        temperature: Some(0.0),
        ..Default::default()
    });
    g.stopping = Some(pb::StoppingCriteria {
        max_new_tokens: Some(64),
        ..Default::default()
    });
    g.constraint = Some(pb::generate_request::Constraint::Regex(answer.to_owned()));
    let out = t.generation().generate(g).await.unwrap().into_inner();
    assert_eq!(
        (
            out.outputs[0].reasoning.clone(),
            out.outputs[0].text.clone()
        ),
        (thought, said)
    );
    t.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_is_taken_as_bearer_or_x_api_key_and_refused_in_each_door_s_shape() {
    let mut opts = Options::default();
    opts.server.api.api_key = Some("s3cret".into());
    // No model attached: a call that passes auth is refused as loading.
    let t = TestServer::bind(opts.server.clone()).await;
    let addr = t.http_addr();
    let body =
        json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
            .to_string()
            .into_bytes();
    let none = post_with(addr, "/v1/messages", body.clone(), &[]).await;
    assert_eq!(none.status, 401, "{}", none.body);
    assert_eq!(none.json()["error"]["type"], "authentication_error");
    let wrong = post_with(addr, "/v1/messages", body.clone(), &[("x-api-key", "nope")]).await;
    assert_eq!(wrong.status, 401);
    for header in [("x-api-key", "s3cret"), ("authorization", "Bearer s3cret")] {
        let r = post_with(addr, "/v1/messages", body.clone(), &[header]).await;
        // Past auth: Anthropic's "overloaded" while the model loads.
        assert_eq!(r.status, 529, "{header:?}: {}", r.body);
        assert_eq!(r.json()["error"]["type"], "overloaded_error");
    }
    let r = post_with(addr, "/v1/responses", br#"{"input": "hi"}"#.to_vec(), &[]).await;
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["code"], "invalid_api_key");
    let r = post_with(
        addr,
        "/v1/responses",
        br#"{"input": "hi"}"#.to_vec(),
        &[("x-api-key", "s3cret")],
    )
    .await;
    assert_eq!(r.status, 503, "{}", r.body);
    t.server.shutdown().await;
}
